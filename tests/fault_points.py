"""Fault injection for tests: a fault hook (`mint_core.lifecycle.faults`) driven by `$MINT_LIFECYCLE_FAULT`, installed
in this test process (`installed`) or in a `mint` command run as `python -m tests.fault_points <mint args>`.

The variable holds comma-separated fault points: `point`, `point:N` for the N-th time it is reached, `...:kill` to
end the process there with SIGKILL (no cleanup, no rollback: a crash) instead of raising `InjectedFault`.
"""

from __future__ import annotations

import logging
import os
import runpy
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from mint_core.lifecycle.faults import InjectedFault, install_fault_hook, remove_fault_hook

FAULT_ENV = "MINT_LIFECYCLE_FAULT"
"""The fault points to fail, read at each point reached (so a test may set it after installing the hook)."""

logger = logging.getLogger(__name__)


class EnvFaults:
    """A fault hook failing the points `$MINT_LIFECYCLE_FAULT` names; counts how often each point was reached."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}

    def __call__(self, point: str) -> None:
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return
        self.hits[point] = self.hits.get(point, 0) + 1
        for item in spec.split(","):
            parts = item.strip().split(":")
            if not parts or parts[0] != point:
                continue
            kill = "kill" in parts[1:]
            counts = [int(p) for p in parts[1:] if p.isdigit()]
            if counts and counts[0] != self.hits[point]:
                continue
            logger.warning("injected fault at %s (%s)", point, "kill" if kill else "raise")
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedFault(f"injected fault at {point}")


@contextmanager
def installed() -> Iterator[EnvFaults]:
    """`$MINT_LIFECYCLE_FAULT`'s faults in this process for the block."""
    hook = EnvFaults()
    install_fault_hook(hook)
    try:
        yield hook
    finally:
        remove_fault_hook(hook)


if __name__ == "__main__":
    # `mint <args>` with the hook installed: what `python -m mint_app.cli.app <args>` runs, in this process
    install_fault_hook(EnvFaults())
    runpy.run_module("mint_app.cli.app", run_name="__main__", alter_sys=True)
