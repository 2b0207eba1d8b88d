"""The fault suite (scripts/faults.py) end to end: every scenario on one stack against real services, each row with
nothing lost and serving agreeing with the registry. Minutes: the slow tier (`pytest -m faults` runs it alone)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mint_testkit.harness import run_fault_suite

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(3600)]


ROWS = ["server", "worker", "mlflow", "prefect", "disk", "race", "poison"]
"""The rows on one stack; the suite's four rows on a fleet of vLLM replicas are
tests/integration/test_vllm_fleet_faults.py's, which checks each more closely (run here too, they took 25 minutes
of the slow tier twice)."""


def test_every_fault_scenario_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    run = run_fault_suite("--only", ",".join(ROWS), "--json", str(out))
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-5000:]
    rows = json.loads(out.read_text())
    assert len(rows) == len(ROWS), rows
    not_run = [row["scenario"] for row in rows if row["result"].startswith("not run")]
    for row in rows:
        assert row["lost"] == 0 and row["ok"], (row, run.stderr[-5000:])
    assert run.returncode == 0 and "| scenario | what was tried | result | data lost |" in run.stdout
    # the full-disk scenario mounts a small tmpfs: root only; anywhere it can run, it must have (every assertion
    # above has run: only the root-only row is left unchecked without root)
    if os.geteuid() == 0:
        assert not not_run, not_run
    elif not_run:
        pytest.skip(f"not run without root (a tmpfs mount): {not_run}; every other scenario passed")
