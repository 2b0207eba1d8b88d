"""Every benchmark that runs a base, an engine or a trainer (or starts `mint serve`) takes `--device` (cpu by
default) and refuses one that is not there before any work, naming it. The catalog and registry benchmarks
(catalog_resolve, registry_ops, models_listing) hold no model, so they have none; adapter_load and handoff have
their own;
serving_backends, vllm_bad_adapters and eval_backends run vLLM, whose device is its environment's (.venv-vllm: CPU or
CUDA);
replicas runs it too, and its --device is the fronts' and where the replicas go (replica i on GPU i, as `mint up`)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WITH_DEVICE = [
    "adamw_slots.py",
    "alias_to_serving.py",
    "catalog_scale.py",
    "continuation_diagnosis.py",
    "continuation_recipes.py",
    "dashboard_run.py",
    "eval_revision.py",
    "grpo_learning.py",
    "learning_curves.py",
    "grpo_vs_trl.py",
    "headroom.py",
    "hot_swap.py",
    "mixed_adapter_decode.py",
    "moe_packed_load.py",
    "multi_policy_grpo.py",
    "own_task.py",
    "replicas.py",
    "routing.py",
    "serving_load.py",
    "update_memory.py",
]
ABSENT = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


def run(script: str, *args: str, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put benchmarks/ on it
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    return int(e.value.code or 0)


@pytest.mark.parametrize("script", WITH_DEVICE)
def test_a_benchmark_refuses_a_device_that_is_not_there_before_any_work(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(script, "--help", monkeypatch=monkeypatch) == 0
    assert "--device" in capsys.readouterr().out
    assert run(script, "--device", "gpu", monkeypatch=monkeypatch) == 2
    assert "--device gpu: not a device; expected cpu, cuda or cuda:N" in capsys.readouterr().err
    assert run(script, "--device", ABSENT, monkeypatch=monkeypatch) == 2
    assert f"--device {ABSENT}: " in capsys.readouterr().err


def test_every_benchmark_is_listed() -> None:
    """A new benchmark is placed here: with --device, or among those without a model."""
    without = {"catalog_resolve.py", "registry_ops.py", "adapter_load.py", "handoff.py", "tinker_clients.py"}
    without |= {"models_listing.py"}
    without |= {"serving_backends.py", "vllm_bad_adapters.py", "eval_backends.py"}
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts - without == set(WITH_DEVICE)
