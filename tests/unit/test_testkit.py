"""The test kit's own rules: a deadline wait returns what it waited for or fails naming it, and a missing service
skips a test except under CI=true, where it fails it."""

from __future__ import annotations

import time

import pytest

from mint_testkit.skips import in_ci, require
from mint_testkit.waiting import wait_until


def test_wait_until_returns_what_came_true() -> None:
    calls = iter([0, None, "", "ready"])
    assert wait_until(lambda: next(calls), 5, "the fourth call", interval=0) == "ready"


def test_wait_until_fails_at_its_deadline_naming_what_it_waited_for() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"^the server's answer: not within 0.2 s$"):
        wait_until(lambda: False, 0.2, "the server's answer")
    assert time.monotonic() - t0 >= 0.2
    seen = [0]

    def poll() -> bool:
        seen[0] += 1
        return False

    # a callable `what` says what it saw at the deadline, not when the wait began
    with pytest.raises(AssertionError, match=r"^polled [1-9]\d* times: not within 0.1 s$"):
        wait_until(poll, 0.1, lambda: f"polled {seen[0]} times")


@pytest.mark.parametrize(
    ("value", "ci"), [("true", True), ("1", True), ("YES", True), ("", False), ("0", False)]
)
def test_ci_is_what_the_ci_entry_point_sets(monkeypatch: pytest.MonkeyPatch, value: str, ci: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci() is ci


def test_a_missing_service_skips_except_under_ci_where_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    require(True, "nothing missing")  # no skip, no failure
    with pytest.raises(pytest.skip.Exception, match="Redis not reachable"):
        require(False, "Redis not reachable")
    monkeypatch.setenv("CI", "true")
    require(True, "nothing missing")
    with pytest.raises(pytest.fail.Exception, match="CI=true and Redis not reachable"):
        require(False, "Redis not reachable")
