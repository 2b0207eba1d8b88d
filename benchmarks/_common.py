"""Helpers shared by the benchmark scripts: timing, reporting, peak memory."""

from __future__ import annotations

import json
import os
import resource
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> dict[str, float]:
    """Median wall time of each function, run round-robin so that drift in machine speed hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def stop_servers_on_kill() -> None:
    """A SIGTERM (`kill`, `timeout`, `pkill`) exits through SystemExit, so the `finally` blocks and exit stacks that
    stop the servers a benchmark started run; Python's default would end the process at once and leave them up."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages: on a shared machine a figure is only as steady as they are."""
    return [round(x, 2) for x in os.getloadavg()]


def pct(values: list[float], q: float) -> float:
    """The `q`th percentile of `values` (NaN when there are none)."""
    return float(np.percentile(values, q)) if values else float("nan")


def checked(r: Any, what: str) -> Any:
    """`r` (an httpx response) when it is a 200; otherwise a RuntimeError naming `what` and the answer."""
    if r.status_code != 200:
        raise RuntimeError(f"{what}: {r.status_code} {r.text[:300]}")
    return r


def report(result: dict[str, Any]) -> None:
    """The last line a benchmark prints: one JSON object."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True))


# Real bases' shapes, for the benchmarks that measure the adapter path at them (`--shape`). Qwen2-0.5B ties its
# embeddings; Qwen3-4B does too (vocab 151,936 x hidden 2560).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
}


def shape_config(shape: str, **overrides: Any) -> Any:
    """The transformers config of a named shape (SHAPES), with overrides."""
    from transformers import AutoConfig  # deferred: most benchmarks never name a shape

    kw = {**SHAPES[shape], "max_position_embeddings": 512, **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def shape_sites(shape: str) -> dict[str, Any]:
    """Every LoRA site (linear of the decoder layers) of a named shape, from a model on the meta device: the
    shapes without a byte of the base's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from mint_core.engine.base import discover_sites

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    return discover_sites(model)


def add_device(ap: Any) -> None:
    """The benchmarks' one device switch, `--device` (cpu by default): where the base, the engine's slots and the
    trainer run. Check it with `checked_device` right after parsing."""
    ap.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N: where the base, the engine and the trainer run"
    )


def checked_device(ap: Any, device: str) -> str:
    """`device` when it is cpu, cuda or cuda:N and visible here; otherwise the parser's error naming it (exit 2),
    before any work."""
    from mint_core.engine.device import DeviceError, check_device  # deferred: torch

    try:
        check_device(device, "--device")
    except DeviceError as e:
        ap.error(str(e))
    return device


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so a wall-clock timing covers it (a no-op on the CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def synced(fn: Callable[[], Any], device: str) -> Callable[[], None]:
    """`fn`, then a wait for `device` (see `synchronize`): what `interleaved` times on a GPU."""

    def run() -> None:
        fn()
        synchronize(device)

    return run
