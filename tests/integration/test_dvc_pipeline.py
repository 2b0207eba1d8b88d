"""The DVC pipeline: its stages and their order, params.yaml sections that the commands accept, and (slow) that a
change to one parameter reruns exactly the stages that depend on it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mint_core.data.build import DataParams
from mint_core.engine.pretrain import PretrainParams

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STAGES = {"tiny_base@dense", "tiny_base@moe", "tiny_base@mla", "task_data", "builtin_base"}


def dvc(*args: str, cwd: Path, timeout: float = 300) -> str:
    """Run dvc (the venv's, with the venv's `mint` on PATH); its output, or a failure showing it."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DVC_NO_ANALYTICS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"dvc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout + proc.stderr


def test_stages_and_order() -> None:
    listed = dvc("stage", "list", "--name-only", cwd=REPO).split()
    assert set(listed) >= STAGES, listed
    dot = dvc("dag", "--dot", cwd=REPO)
    edges = set(re.findall(r'"?([\w@]+)"?\s*->\s*"?([\w@]+)"?', dot))
    assert ("task_data", "builtin_base") in edges, dot
    assert not any("tiny_base" in a or "tiny_base" in b for a, b in edges), "tiny bases stand alone"


def test_params_file_fits_the_commands() -> None:
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    DataParams(**doc["data"])
    base = PretrainParams(**doc["base"])
    assert base.max_position_embeddings >= base.seq_len


def _changed_stages(out: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w@]+)'", out))


@pytest.mark.slow
def test_a_data_param_reruns_exactly_the_stages_below_it(tmp_path: Path) -> None:
    """In a scratch git+DVC repo with the real dvc.yaml and a shrunken params.yaml: after a full repro nothing is
    left to run; after changing data.seed, task_data and builtin_base rerun and the tiny bases do not."""
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(REPO / "dvc.yaml", work / "dvc.yaml")
    pipeline = yaml.safe_load((REPO / "dvc.yaml").read_text())
    for stage in pipeline["stages"].values():
        for dep in stage.get("do", stage).get("deps", []):
            if dep.endswith(".py"):  # source deps: copy them so the scratch repo can hash them
                (work / dep).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / dep, work / dep)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"].update(tasks=["copy", "add"], n_train=40, n_heldout=4)
    params["base"].update(
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        intermediate_size=32,
        steps=3,
        batch_size=4,
        eval_per_task=2,
    )
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    dvc("init", "-q", cwd=work)

    dvc("repro", cwd=work, timeout=600)
    assert (work / "dvc.lock").is_file()
    assert (work / "data" / "base" / "config.json").is_file()
    assert (work / "data" / "metrics" / "builtin_base.json").is_file()
    assert _changed_stages(dvc("repro", "--dry", cwd=work)) == set()

    params["data"]["seed"] += 1
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # A dry run sees only the stage whose own params changed (downstream deps change only once it has run)...
    assert _changed_stages(dvc("repro", "--dry", cwd=work)) == {"task_data"}
    # ...the real run reruns it and the base trained on its output, and leaves the tiny bases alone.
    out = dvc("repro", cwd=work, timeout=600)
    assert _changed_stages(out) == {"task_data", "builtin_base"}, out
    assert "Stage 'tiny_base@dense' didn't change" in out
    assert "up to date" in dvc("status", cwd=work)
