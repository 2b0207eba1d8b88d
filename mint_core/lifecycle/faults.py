"""Fault points: the named places in the lifecycle's steps where a test can make a step fail (`fault`). The library
only runs the hooks installed here, and installs none itself: a fault-injection test installs one (the tests'
`tests/fault_points.py` reads the points to fail from the environment, and can end its process there)."""

from __future__ import annotations

from collections.abc import Callable

from mint_core.lifecycle.errors import LifecycleError

FaultHook = Callable[[str], None]
"""Called with a fault point's name each time a step reaches it; fails the step by raising (`InjectedFault`)."""

_HOOKS: list[FaultHook] = []


class InjectedFault(LifecycleError):
    """Raised at a fault point by a fault hook (tests)."""


def install_fault_hook(hook: FaultHook) -> None:
    """Run `hook` at every fault point of this process, until `remove_fault_hook(hook)`."""
    _HOOKS.append(hook)


def remove_fault_hook(hook: FaultHook) -> None:
    if hook in _HOOKS:
        _HOOKS.remove(hook)


def fault(point: str) -> None:
    """A fault point: run the installed hooks (none outside fault-injection tests), which may fail the step."""
    for hook in tuple(_HOOKS):
        hook(point)
