"""The main job starts its serving backend beside the first wave's training, but refuses one that cannot start
before anything starts or trains (`mint_app.job.main._start_step`)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from mint_app.job import main as job_main
from mint_app.job.config import MainJobConfig, MainJobError
from mint_app.job.report import Timer


def test_a_vllm_that_cannot_start_is_refused_before_any_service_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    monkeypatch.setenv("MINT_SERVICES_VLLM_PYTHON", str(missing))
    started: list[object] = []
    monkeypatch.setattr(job_main, "start", lambda *a, **k: started.append(a) or [])
    cfg = MainJobConfig.load(None, state_dir=tmp_path / "state", serving="vllm")
    console = Console(file=io.StringIO(), width=200)
    job = job_main._Job(cfg, console, Timer(console), "test-round")
    with pytest.raises(MainJobError, match="vLLM's environment is missing") as err:
        job_main._start_step(job)
    assert str(missing) in str(err.value) and "make vllm-venv" in str(err.value)
    assert started == []  # nothing was started: MLflow and Prefect included
