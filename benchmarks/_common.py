"""Helpers shared by the benchmark scripts: timing, reporting, peak memory."""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def best_of(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of `fn` over `repeats` runs after `warmup` runs, and all the times."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(result: dict[str, Any]) -> None:
    """The last line a benchmark prints: one JSON object."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True))
