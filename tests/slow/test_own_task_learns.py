"""A task no mint source file names is learned through the gate: examples/sums-over-100 on the built-in base, the
built-in recipe's first revision, its held-out gain and the gate's decision with every other registered task as a
guard (benchmarks/own_task.py, minutes: the `slow` tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mint_testkit.skips import require

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1800)
def test_the_built_in_base_learns_a_users_task_through_the_gate() -> None:
    require((ROOT / "data" / "base" / "config.json").is_file(), "the built-in base is not built (dvc repro)")
    require(  # the replay of the built-in tasks reads their train files
        (ROOT / "data" / "tasks" / "train" / "add.jsonl").is_file(),
        "the task data is not built (dvc repro task_data)",
    )
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/own_task.py",
            "--tasks",
            "examples/sums-over-100",
            "--task",
            "sums-over-100",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] >= 300, got
    assert got["gain"] >= 0.10 and got["p_value"] < 0.01, got
    assert got["gate"] == "pass", got
