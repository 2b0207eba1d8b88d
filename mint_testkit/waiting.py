"""Deadline polls: wait for the event a test asserts on, not for a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    pred: Callable[[], T], timeout: float, what: str | Callable[[], str], interval: float = 0.02
) -> T:
    """Call `pred` until it returns something true, and return that; AssertionError naming `what` (or what it
    returns then, to show the state at the deadline) when `timeout` seconds pass first. A loaded host only makes
    it slower, never wrong: the caller asserts after the event it waits for, where a fixed sleep would assert after
    whatever happened to finish in time."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what if isinstance(what, str) else what()}: not within {timeout:g} s")
        time.sleep(interval)
