"""The load benchmarks run end to end at a tiny size and report every figure they promise.

No timing assertions: speed is the benchmarks' business; this checks that the paths they measure work (the
per-expert and packed MoE writes agree, store -> engine -> slot for each rank) and that the JSON line is whole.
The scripts run in this process, as `__main__`: a subprocess would spend most of the test importing torch again.
"""

from __future__ import annotations

import json
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_benchmark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., dict[str, Any]]:
    """run_benchmark(script, *args): the JSON object the script printed last."""

    def run(script: str, *args: str) -> dict[str, Any]:
        monkeypatch.setattr(sys, "argv", [script, *args])
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert isinstance(result, dict)
        return result

    return run


def test_moe_packed_load_runs_small(run_benchmark: Callable[..., dict[str, Any]]) -> None:
    result = run_benchmark(
        "moe_packed_load.py",
        *("--experts", "8", "--layers", "1", "--hidden", "64", "--moe-intermediate", "32"),
        *("--rank", "4", "--rounds", "2", "--disk-rounds", "1"),
    )
    for key in (
        "speedup",
        "packed_ms",
        "per_expert_ms",
        "disk_speedup",
        "disk_packed_ms",
        "disk_unpacked_ms",
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    # packed: A and B of gate_up_proj and down_proj; per expert: the shared gate/up A, gate B, up B, down A, B
    assert (result["packed_copies"], result["per_expert_copies"]) == (4, 8 * 5)


def test_adapter_load_runs_small(run_benchmark: Callable[..., dict[str, Any]]) -> None:
    result = run_benchmark(
        "adapter_load.py", "--ranks", "1,4", "--repeats", "2", "--slots", "2", "--vocab", "512"
    )
    for prefix in ("", "all_linear_"):
        assert isinstance(result[f"{prefix}slot_bytes"], int)
        for r in (1, 4):
            for key in ("load_p50_ms", "load_p99_ms", "slot_write_p50_ms"):
                assert result[f"{prefix}{key}_r{r}"] > 0, f"{prefix}{key}_r{r}"
            assert isinstance(result[f"{prefix}host_bytes_r{r}"], int)
            assert result[f"{prefix}disk_bytes_r{r}"] > result[f"{prefix}host_bytes_r{r}"]
        # slots are sized for the largest rank, so one holds exactly a revision of that rank
        assert result[f"{prefix}slot_bytes"] == result[f"{prefix}host_bytes_r4"]


def test_adapter_load_runs_at_a_real_shape(run_benchmark: Callable[..., dict[str, Any]]) -> None:
    """--shape: the LoRA sites of Qwen2-0.5B (every linear, rank 8, bf16) with no base weights; every step of the
    split is reported and the revision is the size that shape gives."""
    result = run_benchmark(
        "adapter_load.py", *("--shape", "qwen2-0.5b", "--repeats", "2", "--slots", "1", "--device", "cpu")
    )
    assert (result["shape"], result["dtype"], result["device"]) == ("qwen2-0.5b", "bfloat16", "cpu")
    for key in ("load_p50_ms", "load_p99_ms", "floor_ms", "floor_ratio", "read_p50_ms", "validate_p50_ms"):
        assert result[f"{key}_r8"] > 0, key
    for key in ("digest_p50_ms", "register_p50_ms", "slot_write_p50_ms", "store_p50_ms"):
        assert result[f"{key}_r8"] >= 0, key
    # 24 layers x 7 linears, (in + out) x rank 8 x 2 bytes: 8.8 MB, one slot's worth, in the host cache
    assert (
        result["host_bytes_r8"]
        == result["slot_bytes"]
        == 24 * 2 * 8 * ((896 + 896) * 2 + (896 + 128) * 2 + (896 + 4864) * 3)
    )
    assert result["disk_bytes_r8"] > result["host_bytes_r8"]


@pytest.mark.parametrize(
    "adapter_only",
    [pytest.param(False, marks=pytest.mark.slow), True],  # both paths: the merged baseline too (9 s)
    ids=["both paths", "adapter only"],
)
def test_handoff_runs_small(run_benchmark: Callable[..., dict[str, Any]], adapter_only: bool) -> None:
    """Both servers start, every handoff answers with the new revision (the script checks), and the adapter's
    file is in the base's dtype: bf16, half the float32 factors' bytes."""
    result = run_benchmark(
        "handoff.py",
        *(
            "--shape",
            "small",
            "--device",
            "cpu",
            "--adapter-rounds",
            "1",
            "--merged-rounds",
            "1",
            "--gap",
            "0",
        ),
        *(["--adapter-only"] if adapter_only else []),
    )
    assert (result["shape"], result["device"], result["adapter_only"]) == ("small", "cpu", adapter_only)
    for key in ("adapter_s", "adapter_s_rank1", "adapter_ready_s", "adapter_load_s", "adapter_answer_only_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    # 2 layers x 7 linears at hidden 128, MLP 512, 2 of 4 heads for k/v (64 wide): bf16 factors plus a header
    payload = 2 * 8 * 2 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 512) * 3)
    assert payload < result["adapter_bytes"] < payload + 32 * 1024
    assert ("speedup" in result) != adapter_only
    if not adapter_only:
        assert result["merged_s"] > 0 and result["speedup"] > 0


@pytest.mark.slow  # 13 s
def test_update_memory_runs_small(run_benchmark: Callable[..., dict[str, Any]]) -> None:
    """All three ways out of the model train the same adapter (the script checks and exits otherwise)."""
    result = run_benchmark(
        "update_memory.py",
        *("--vocab", "5000", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--steps", "1"),
        *("--fused-head-min-bytes", "0"),
    )
    assert result["mint_output"] == "hidden"
    for key in ("mint_update_peak_bytes", "logits_update_peak_bytes", "plain_update_peak_bytes"):
        assert isinstance(result[key], int) and result[key] >= 0, key
    for key in ("mint_update_s", "logits_update_s", "plain_update_s", "speedup"):
        assert isinstance(result[key], float) and result[key] > 0, key
    # at this size an update may not raise the RSS high-water mark above setup: the ratio is only a number
    assert isinstance(result["peak_ratio"], float) and result["peak_ratio"] >= 0


def test_adamw_slots_runs_small(run_benchmark: Callable[..., dict[str, Any]]) -> None:
    """The trainer's AdamW and the hand-written one it replaced make the same update."""
    result = run_benchmark("adamw_slots.py", "--layout", "builtin", "--policies", "2", "--rounds", "2")
    for key in ("torch_adamw_ms", "foreach_ms", "ratio"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["max_abs_diff"] < 1e-6


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_replicas_runs_quick(run_benchmark: Callable[..., dict[str, Any]]) -> None:
    """Two real vLLM replicas and mint's fronts over one and over both (minutes: two vLLM starts, the `slow` tier):
    every target answers the load, a promotion reaches every replica, and the summary carries every ratio."""
    from mint_core.serving.vllm_process import vllm_available
    from mint_testkit.harness import VLLM_PYTHON
    from mint_testkit.skips import require

    require(vllm_available(VLLM_PYTHON), f"vLLM's environment ({VLLM_PYTHON})")
    result = run_benchmark("replicas.py", "--quick")
    assert (result["figure"], result["failed"]) == ("summary", 0), result
    assert result["figures"] == ["load", "promotion"]
    for key in (
        "front_over_bare",
        "front_1x_over_bare",
        "front_2x_over_bare",
        "two_over_front",
        "promotion_r2_over_r1",
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["slot_loads_per_1k_front_2x"] >= 0
    assert abs(sum(result["share_front_2x"].values()) - 1) < 0.01
