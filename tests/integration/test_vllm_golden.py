"""The golden probe end to end (issue #34 item 0): the fault suite's `poison` row alone. A sealed, supervised vLLM
behind mint's front (as `mint up --serving vllm` starts them) refuses issue #34's unkeyed attack; a NaN adapter
forced in with mint's key is noticed by the golden probe, the replica is taken out of rotation with the evidence
logged and restarted by its supervisor, and every answer after it comes back is the one before the attack.
Minutes (two vLLM starts): the slow tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mint_core.serving.vllm_process import vllm_available
from tests.integration.conftest import VLLM_PYTHON, require

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]


def test_a_poisoned_vllm_is_noticed_taken_out_and_comes_back_clean(tmp_path: Path) -> None:
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
    out = tmp_path / "poison.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "faults.py"), "--only", "poison", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-5000:]
    (row,) = json.loads(out.read_text())
    assert row["ok"] and row["lost"] == 0, (row, run.stderr[-5000:])
    result = row["result"]
    assert "unkeyed POST /adapters 401, POST /v1/load_lora_adapter 401" in result, result
    assert (
        "(0 after detection)" in result and "back clean: True" in result and "evidence logged: True" in result
    )
