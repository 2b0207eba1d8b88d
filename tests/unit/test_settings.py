"""Settings precedence shared by `mint serve` and `mint up`: file, then environment, then explicit values."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mint_app.cli.app import app
from mint_app.job import config as job_config
from mint_app.job import main as main_job
from mint_app.services.config import ServicesConfig
from mint_core.serving.config import ServingConfig
from mint_core.settings import read_mapping


def test_file_then_env_then_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("port: 9001\nmax_loras: 3\nbase: tiny-moe\n")
    monkeypatch.setenv("MINT_SERVE_MAX_LORAS", "5")
    cfg = ServingConfig.load(f, base=None, port=9002)
    assert (cfg.port, cfg.max_loras, cfg.base) == (9002, 5, "tiny-moe")  # None overrides nothing

    monkeypatch.setenv("MINT_SERVICES_MLFLOW_PORT", "5123")
    assert ServicesConfig.load().mlflow_port == 5123


def test_a_config_built_in_code_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINT_SERVE_MAX_LORAS", "5")
    assert ServingConfig().max_loras == 8
    assert ServingConfig(port=0).port == 0
    assert ServingConfig.load().max_loras == 5


def test_bad_settings_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "serve.json"
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a mapping"):
        ServingConfig.load(f)
    f.write_text('{"max_lora": 3}')
    with pytest.raises(ValueError, match="max_lora"):
        ServingConfig.load(f)
    with pytest.raises(ValueError, match="cannot read the settings file") as e:
        ServingConfig.load(tmp_path / "none.yaml")
    assert str(tmp_path / "none.yaml") in str(e.value)
    monkeypatch.setenv("MINT_SERVE_MAX_LORAS", "zero")
    with pytest.raises(ValueError, match="max_loras"):
        ServingConfig.load()


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.yaml", None, "cannot read the settings file"),
        ("broken.yaml", "a: [1,\n", "not valid YAML"),
        ("broken.json", "{bad json", "not valid JSON"),
        ("list.yaml", "- 1\n", "expected a mapping of settings"),
    ],
)
def test_a_settings_file_that_cannot_be_used_is_named(
    tmp_path: Path, name: str, text: str | None, message: str
) -> None:
    f = tmp_path / name
    if text is not None:
        f.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        read_mapping(f)
    assert str(f) in str(e.value)


def test_mint_run_takes_file_env_and_flags_and_refuses_bad_values_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[job_config.MainJobConfig] = []
    monkeypatch.setattr(main_job, "run_main_job", lambda cfg, console: seen.append(cfg))
    f = tmp_path / "run.yaml"
    f.write_text("steps: 3\nfirst_steps: 2\nrank: 4\nbuild: true\n")
    monkeypatch.setenv("MINT_RUN_RANK", "6")
    out = CliRunner().invoke(
        app, ["run", "--config", str(f), "--steps", "7", "--no-build", "--policies", "add"]
    )
    assert out.exit_code == 0, out.output
    (cfg,) = seen
    assert (cfg.steps, cfg.first_steps, cfg.rank, cfg.build, cfg.policies) == (7, 2, 6, False, ["add"])

    monkeypatch.setenv("MINT_RUN_RANK", "six")
    out = CliRunner().invoke(app, ["run", "--config", str(f)])
    assert out.exit_code == 2 and "rank" in out.output
    f.write_text("- steps\n")
    monkeypatch.delenv("MINT_RUN_RANK")
    out = CliRunner().invoke(app, ["run", "--config", str(f)])
    assert out.exit_code == 2 and "expected a mapping" in out.output
    out = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "none.yaml")])
    assert out.exit_code == 2 and "cannot read" in out.output, out.output
    assert len(seen) == 1  # nothing ran for the bad ones
