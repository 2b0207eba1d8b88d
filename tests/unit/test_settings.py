"""Settings precedence shared by `mint serve` and `mint up`: file, then environment, then explicit values."""

from __future__ import annotations

from pathlib import Path

import pytest

from mint_core.services import ServicesConfig
from mint_core.serving.config import ServingConfig


def test_file_then_env_then_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("port: 9001\nmax_loras: 3\nbase: tiny-moe\n")
    monkeypatch.setenv("MINT_SERVE_MAX_LORAS", "5")
    cfg = ServingConfig.load(f, base=None, port=9002)
    assert (cfg.port, cfg.max_loras, cfg.base) == (9002, 5, "tiny-moe")  # None overrides nothing

    monkeypatch.setenv("MINT_SERVICES_MLFLOW_PORT", "5123")
    assert ServicesConfig.load().mlflow_port == 5123


def test_bad_settings_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "serve.json"
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a mapping"):
        ServingConfig.load(f)
    monkeypatch.setenv("MINT_SERVE_MAX_LORAS", "zero")
    with pytest.raises(ValueError, match="max_loras"):
        ServingConfig.load()
