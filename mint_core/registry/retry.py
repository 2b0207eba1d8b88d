"""The one retry policy of the registry's calls made outside Prefect tasks (tenacity).

Prefect's task retries (`retries=`, `retry_condition_fn=` on the decorators in `tasks/`) retry a whole step;
underneath them, a single database or MLflow call is retried here, and only on errors that go away by waiting:
a locked SQLite database, a deadlock or serialization failure (PostgreSQL), a refused connection, and a
concurrent writer that took the same key first (every catalog write is idempotent, so running it again sees the
other writer's row). Anything else (a bad argument, an unknown policy, a conflicting digest) fails at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_TEXT = (
    "database is locked",  # SQLite: another writer holds the lock past the busy timeout
    "database table is locked",
    "deadlock",  # PostgreSQL 40P01, MySQL 1213
    "could not serialize",  # PostgreSQL 40001
    "serialization failure",
    "connection refused",
)
_TRANSIENT_SQLSTATE = ("40001", "40P01")
_KEY_TAKEN_TEXT = ("unique constraint failed", "duplicate key value")  # SQLite, PostgreSQL (23505)


def is_transient(e: BaseException) -> bool:
    """An error worth another attempt of the same call (see the module docstring)."""
    if isinstance(e, ConnectionRefusedError):
        return True
    orig = getattr(e, "orig", None)  # SQLAlchemy's DBAPIError wraps the driver's error (not imported: slow)
    if orig is not None:
        if getattr(orig, "sqlstate", None) in _TRANSIENT_SQLSTATE:
            return True
        text = str(orig).lower()
        if type(e).__name__ == "IntegrityError":
            return any(t in text for t in _KEY_TAKEN_TEXT)
        return any(t in text for t in _TRANSIENT_TEXT)
    text = str(e).lower()
    return any(t in text for t in _TRANSIENT_TEXT)


def _log(state: RetryCallState) -> None:
    e = state.outcome.exception() if state.outcome is not None else None
    logger.info(
        "transient error (%s: %s), attempt %d, retrying", type(e).__name__, str(e)[:80], state.attempt_number
    )


RETRY = Retrying(
    retry=retry_if_exception(is_transient),
    stop=stop_after_attempt(8) | stop_after_delay(30),
    wait=wait_random_exponential(multiplier=0.02, max=2.0),
    before_sleep=_log,
    reraise=True,
)
"""The shared policy: up to 8 attempts within 30 s, random exponential backoff from 20 ms up to 2 s, the last
error re-raised as it was."""


def retried(fn: Callable[[], T]) -> T:
    """`fn()` under `RETRY`. A copy per call: tenacity keeps a call's state per thread and object, and a retried
    call may make another (a registry write that writes the catalog)."""
    return RETRY.copy()(fn)
