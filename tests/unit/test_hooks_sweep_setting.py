"""The receiver's sweep interval: `mint up` passes `ServicesConfig.hooks_sweep_s` to the receiver's process as
MINT_HOOKS_SWEEP_S, which `HooksConfig` reads; unset, the receiver keeps its own default. A bad value is refused
naming the field, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from mint_app.services.commands import command
from mint_app.services.config import ServicesConfig
from mint_app.services.webhooks import HooksConfig


def _config(tmp_path: Path, **extra: object) -> ServicesConfig:
    return ServicesConfig.model_validate({"state_dir": tmp_path / "run", **extra})


@pytest.mark.parametrize("sweep", [0, 2.5])
def test_mint_up_gives_the_receiver_its_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sweep: float
) -> None:
    cmd, env = command("hooks", _config(tmp_path, hooks_sweep_s=sweep))
    assert cmd[-1] == "mint_app.services.webhooks"
    assert env["MINT_HOOKS_SWEEP_S"] == str(float(sweep))
    # what the receiver's process makes of its environment
    (tmp_path / "secret").write_text("s")
    for key, value in env.items():
        if key.startswith("MINT_HOOKS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("MINT_HOOKS_SECRET_FILE", str(tmp_path / "secret"))
    assert HooksConfig.load(None).sweep_s == sweep


def test_unset_the_receiver_keeps_its_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, env = command("hooks", _config(tmp_path))
    assert "MINT_HOOKS_SWEEP_S" not in env
    monkeypatch.delenv("MINT_HOOKS_SWEEP_S", raising=False)
    assert HooksConfig.load(None).sweep_s == HooksConfig.model_fields["sweep_s"].default == 30.0


def test_a_negative_sweep_is_refused_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError, match="hooks_sweep_s"):
        _config(tmp_path, hooks_sweep_s=-1)
    monkeypatch.setenv("MINT_HOOKS_SWEEP_S", "-5")
    with pytest.raises(ValidationError, match="sweep_s"):
        HooksConfig.load(None)


def test_the_docs_give_the_sweep_and_the_reconcile_interval_as_the_code_and_prefect_yaml_do() -> None:
    import yaml

    root = Path(__file__).resolve().parents[2]
    readme = (root / "infra" / "README.md").read_text()
    sweep = HooksConfig.model_fields["sweep_s"].default
    assert f"receiver's sweep: every {sweep:g} s (`ServicesConfig.hooks_sweep_s`" in readme
    deployments = yaml.safe_load((root / "infra" / "prefect.yaml").read_text())["deployments"]
    (reconcile,) = [d for d in deployments if d["name"] == "reconcile"]
    (interval,) = [s["interval"] for s in reconcile["schedules"]]
    assert f"| `reconcile` | `flows/reconcile.py:reconcile` | every {interval // 60} minutes:" in readme


def test_a_registry_that_does_not_answer_is_one_warning_while_it_lasts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweep's pass cannot list the policies (MLflow down): each pass says so in its result, the log once."""
    import logging
    import threading

    from mint_app.services.webhooks import Sweeper
    from mint_core.lifecycle.workspace import Workspace
    from mint_testkit.harness import free_port

    (tmp_path / "secret").write_text("s")
    ws = Workspace(
        tracking_uri=f"http://127.0.0.1:{free_port()}",
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        serving_url=f"http://127.0.0.1:{free_port()}",
    )
    sweeper = Sweeper(HooksConfig(secret_file=tmp_path / "secret", workspace=ws), lambda p: threading.Lock())
    with caplog.at_level(logging.INFO, logger="mint.hooks"):
        assert [sweeper.tick() for _ in range(3)] == [None, None, None]
    said = [r for r in caplog.records if r.name == "mint.hooks"]
    assert [r.levelno for r in said] == [logging.WARNING], [r.getMessage() for r in said]
    assert "RegistryUnavailable" in said[0].getMessage() and "listing them" in said[0].getMessage()
    assert sweeper.passes == 0
