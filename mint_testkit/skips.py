"""The one rule for a test whose service is missing: it skips, except under CI=true, where it fails."""

from __future__ import annotations

import os

import pytest

CI_ENV = "CI"
"""Set to true by the CI entry point (.ci/run)."""


def in_ci() -> bool:
    """This run is CI's: `$CI` is 1, true or yes (any case)."""
    return os.environ.get(CI_ENV, "").strip().lower() in ("1", "true", "yes")


def require(available: bool, what: str) -> None:
    """Skip the test when a service it needs is missing (`what` says which), except under CI=true, where a missing
    service fails it: CI runs every service, and must not go green with the test unrun."""
    if available:
        return
    if in_ci():
        pytest.fail(f"CI=true and {what}", pytrace=False)
    pytest.skip(what)
