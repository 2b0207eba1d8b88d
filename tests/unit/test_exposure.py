"""What "with its auth" means per service, read from the command line and environment `mint up` would start it
with: each of MLflow, Prefect and mint serve runs with its auth by default, and without it under `auth: false`,
which names what is missing; loopback is told from the network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mint_app.services.commands import command
from mint_app.services.config import ServiceName, ServicesConfig
from mint_app.services.control import ensure_access
from mint_app.services.exposure import loopback, without_auth


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_addresses(host: str) -> None:
    assert loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "10.0.0.1", "my-host.example", ""])
def test_the_network(host: str) -> None:
    assert not loopback(host)


def _config(tmp_path: Path, **fields: object) -> ServicesConfig:
    config = ServicesConfig.model_validate(
        {"state_dir": tmp_path / "run", "serve_base": str(tmp_path / "base"), **fields}
    )
    ensure_access(config)
    return config


def _reason(name: ServiceName, config: ServicesConfig) -> str | None:
    cmd, env = command(name, config)
    return without_auth(name, cmd, {**os.environ, **env}, config)


@pytest.mark.parametrize("name", ["mlflow", "prefect", "serve", "hooks", "worker"])
def test_every_service_runs_with_its_auth_by_default(tmp_path: Path, name: ServiceName) -> None:
    assert _reason(name, _config(tmp_path)) is None


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("mlflow", "without its auth app (--app-name)"),
        ("prefect", "without its auth string (PREFECT_SERVER_API_AUTH_STRING)"),
        ("serve", "would answer any caller (no serving keys: MINT_SERVE_ACCESS_FILE"),
    ],
)
def test_without_auth_each_says_what_is_missing(tmp_path: Path, name: ServiceName, says: str) -> None:
    config = _config(tmp_path, auth=False)
    reason = _reason(name, config)
    assert reason is not None and says in reason, reason
    assert _reason("hooks", config) is None  # the receiver's signed deliveries are not a login to turn off


def test_keys_a_serving_config_asks_for_count(tmp_path: Path) -> None:
    """mint serve's keys from its serving config file, not from mint up, are its auth all the same."""
    serving = tmp_path / "serving.yaml"
    serving.write_text(f"access_file: {tmp_path / 'keys.json'}\n")
    assert _reason("serve", _config(tmp_path, auth=False, serve_config=serving)) is None
