"""What every task shares: which errors are worth a retry, the lock that serialises a policy's promotions, and
artifact keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

from prefect.results import ResultStore
from prefect_redis import RedisLockManager
from pydantic import BaseModel

from mint_core.lifecycle import Workspace
from mint_core.registry.runs import IDEMPOTENCY_TAG

T = TypeVar("T")

RETRY_DELAYS: list[float] = [1, 3, 8]
"""Seconds between the attempts of a task that hit a transient error."""


def is_transient(exc: BaseException | None) -> bool:
    """A connection error or timeout somewhere in the cause chain: worth another attempt. Validation errors,
    a failed gate, a lost alias race and bad adapters are not."""
    import httpx

    from mint_core.registry.mlflow_registry import RegistryUnavailable
    from mint_core.serving.client import ServingError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionError | TimeoutError | httpx.TransportError | RegistryUnavailable):
            return True
        if isinstance(exc, ServingError) and exc.status in (0, 429, 502, 503, 504):
            return True
        try:
            import requests

            if isinstance(exc, requests.ConnectionError | requests.Timeout):
                return True
        except ImportError:  # pragma: no cover
            pass
        exc = exc.__cause__ or exc.__context__
    return False


def transient(task: Any, task_run: Any, state: Any) -> bool:
    """`retry_condition_fn` of the tasks: retry only transient errors."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            state.result()
        except BaseException as e:
            exc = e
    return is_transient(exc)


class _RedisLocks(RedisLockManager):
    """Prefect's Redis lock manager with a hold timeout, so a process killed inside a transaction frees its
    policy's lock after `hold_timeout` instead of never; and releasing a lock that already expired is logged,
    not raised (a raise in commit would roll back a promotion that had finished)."""

    def __init__(self, hold_timeout: float, **kwargs: Any) -> None:
        self.hold_timeout = hold_timeout
        super().__init__(**kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "hold_timeout": self.hold_timeout}

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        return super().acquire_lock(key, holder, acquire_timeout, hold_timeout or self.hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        from redis.exceptions import LockError

        try:
            super().release_lock(key, holder)
        except (LockError, ValueError) as e:
            import logging

            logging.getLogger(__name__).warning("lock %s had expired before release: %s", key, e)
            self._locks.pop(self._lock_name_for_key(key), None)


def lock_store(ws: Workspace) -> ResultStore:
    """A result store whose only job is the Redis lock of SERIALIZABLE transactions."""
    return ResultStore(lock_manager=_RedisLocks(ws.lock_hold_s, connection_url=ws.redis_url))


def cached_in(task: T, ws: Workspace) -> T:
    """The task with its persisted results (its cache) in the workspace's folder."""
    return task.with_options(result_storage=Path(ws.work_dir).resolve() / "results")  # type: ignore[attr-defined, no-any-return]


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from free text."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower())).strip("-")[:100]


class Timed(BaseModel):
    """Outputs carry the seconds the mint_core work took, so a flow can tell Prefect's overhead apart."""

    work_s: float | None = None
    """Seconds of mint_core work inside the task (None where not measured)."""


class RevisionRef(Timed):
    """One version of a policy, as the tasks pass it along."""

    policy: str
    version: int
    digest: str
    run_id: str | None = None
    parent: str | None = None
    """`mint.parent`: the champion it was trained from (`policy/vN`)."""
    idempotency_key: str | None = None
    gate_passed: bool | None = None
    """The recorded gate decision (`mint.gate`), if any."""

    @property
    def address(self) -> str:
        return f"{self.policy}/v{self.version}"

    @classmethod
    def of(cls, rev: Any) -> RevisionRef:
        gate = rev.gate
        return cls(
            policy=rev.policy,
            version=rev.version,
            digest=rev.digest,
            run_id=rev.run_id,
            parent=rev.parent,
            idempotency_key=rev.tags.get(IDEMPOTENCY_TAG),
            gate_passed=None if gate is None else bool(gate.get("passed")),
        )


class AliasMoved(Timed):
    """Where `champion` pointed before a move and after it."""

    policy: str
    from_version: int | None
    to_version: int
    to_digest: str
    """The digest of the revision `champion` points at now."""
    moved: bool
    """False when it already pointed there (an earlier attempt had moved it)."""
