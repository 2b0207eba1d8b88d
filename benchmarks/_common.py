"""Helpers shared by the benchmark scripts: timing, reporting, peak memory."""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


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


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(result: dict[str, Any]) -> None:
    """The last line a benchmark prints: one JSON object."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True))
