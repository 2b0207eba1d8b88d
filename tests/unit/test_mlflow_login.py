"""Which MLflow login mint's clients and the services it starts use (`mlflow_auth.service_env`): the state dir's
service account for the MLflow it runs; for one it does not run, the exported login of that MLflow's owner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mint_app.services.config import ServicesConfig
from mint_app.services.mlflow_auth import PASSWORD_ENV, USER_ENV, service_env
from mint_app.services.processes import write_record
from mint_core.access import access_path, ensure


@pytest.fixture
def own(tmp_path: Path) -> tuple[ServicesConfig, dict[str, str]]:
    config = ServicesConfig.model_validate({"state_dir": tmp_path / "run", "mlflow_port": 5999})
    service = ensure(access_path(config.state_dir))[0].service
    return config, {USER_ENV: service.mlflow_user, PASSWORD_ENV: service.mlflow_password}


def test_the_state_dirs_own_mlflow_gets_its_service_account_even_with_a_login_exported(
    own: tuple[ServicesConfig, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, account = own
    monkeypatch.setenv(USER_ENV, "someone")
    monkeypatch.setenv(PASSWORD_ENV, "else")
    write_record(config, "mlflow", os.getpid(), config.url("mlflow"))
    assert service_env(config) == account


@pytest.mark.parametrize("remote", [False, True])
def test_an_mlflow_it_does_not_run_gets_the_exported_login(
    own: tuple[ServicesConfig, dict[str, str]], monkeypatch: pytest.MonkeyPatch, remote: bool
) -> None:
    config, account = own
    if remote:  # another host's MLflow; a record here does not make it this state dir's
        config = config.model_copy(update={"mlflow_url": "http://10.0.0.2:5000"})
        write_record(config, "mlflow", os.getpid(), "http://127.0.0.1:5999")
    monkeypatch.delenv(USER_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    assert service_env(config) == account  # nothing exported: the state dir's (a host given host A's file)
    monkeypatch.setenv(USER_ENV, "owner")
    monkeypatch.setenv(PASSWORD_ENV, "secret")
    assert service_env(config) == {USER_ENV: "owner", PASSWORD_ENV: "secret"}
    monkeypatch.delenv(PASSWORD_ENV)  # half a login is none
    assert service_env(config) == account
