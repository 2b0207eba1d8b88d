"""benchmarks/serving_backends.py runs end to end with --quick and reports every figure it promises.

No timing assertions: speed is the benchmark's business; this checks that each path it measures works on both
backends (decode on mint serve, through the front and on vLLM directly; load to first answer; in-place handoff and
a merged vLLM; hot swaps under load) and that its JSON lines are whole, with no failed request and no answer
that mixed two revisions. A subprocess: the script starts its own servers and sets their log level in its
environment. Minutes (two vLLM starts): the `slow` tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mint_core.serving.vllm_process import vllm_available
from mint_testkit.harness import VLLM_PYTHON
from mint_testkit.skips import require

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]


def test_serving_backends_quick_reports_every_figure() -> None:
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serving_backends.py"), "--quick"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MINT_VLLM_PYTHON": str(VLLM_PYTHON)},
        timeout=1700,
    )
    assert out.returncode == 0, out.stderr[-5000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    figures = {x["figure"]: x for x in lines}
    assert list(figures) == ["decode", "servable", "handoff", "hot_swap", "summary"], out.stdout
    for name, fig in figures.items():
        assert fig["failed"] == 0, (name, fig)

    decode = figures["decode"]
    for k in ("mint_tok_s", "front_tok_s", "direct_tok_s", "mint_over_vllm", "front_over_direct"):
        assert decode[k] > 0, k
    assert decode["requests"] > 0
    servable = figures["servable"]
    assert servable["mint_ms"] > 0 and servable["vllm_ms"] > 0 and servable["revisions"] > 0
    handoff = figures["handoff"]
    assert handoff["inplace_ms"] > 0 and handoff["merged_ms"] > 0
    assert handoff["merged_matches_adapter"] is True  # the baseline serves the same model
    swap = figures["hot_swap"]
    assert swap["mixed"] == 0, swap
    assert swap["requests"] > 0 and swap["promotes"] >= 1 and swap["rollbacks"] >= 1
    assert swap["swap_errors"] == 0 and swap["swap_p50_ms"] > 0

    summary = figures["summary"]
    for k in (
        "decode_mint_over_vllm",
        "decode_front_over_direct",
        "servable_mint_over_vllm",
        "handoff_merged_over_inplace",
    ):
        assert summary[k] > 0, k
    assert summary["hot_swap_mixed"] == 0 and summary["hot_swap_failed"] == 0
