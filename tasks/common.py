"""What every task shares: which errors are worth a retry, the lease lock that serialises a policy's promotions,
and artifact keys."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import httpx
import requests
from prefect.locking.protocol import LockManager
from prefect.results import ResultStore
from pydantic import BaseModel

from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.leases import Leases, check_lock_url, leases_for
from mint_core.registry.reader import RegistryUnavailable
from mint_core.registry.runs import IDEMPOTENCY_TAG
from mint_core.serving.client import ServingError
from mint_core.types import Digest

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_DELAYS: list[float] = [1, 3, 8]
"""Seconds between the attempts of a task that hit a transient error."""


def is_transient(exc: BaseException | None) -> bool:
    """A connection error or timeout somewhere in the cause chain: worth another attempt. Validation errors,
    a failed gate, a lost alias race and bad adapters are not."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(
            exc,
            ConnectionError
            | TimeoutError
            | httpx.TransportError
            | RegistryUnavailable
            | requests.ConnectionError
            | requests.Timeout,
        ):
            return True
        if isinstance(exc, ServingError) and exc.status in (0, 429, 502, 503, 504):
            return True
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


class LeaseLocks(LockManager):
    """Prefect's lock manager over mint's leases (`mint_core.registry.leases`): the lock of SERIALIZABLE
    transactions, keyed by the transaction's key (`promote-<policy>`).

    One lock mechanism for all of mint: registry writes take the same leases (`registry/<policy>`) from the same
    place, `leases_for(workspace.lock_url, catalog)`. The catalog is the default, because every deployment already
    has the catalog and not every one has Redis: the embedded default is a SQLite file and needs no server, and the
    scale path puts the catalog on PostgreSQL, which then serialises promotions across machines. A deployment that
    already runs Redis can keep its leases there instead (`lock_url: redis://host:port/db`), with the same
    semantics (`RedisLeases`). A holder that dies frees its lease after `hold_timeout`; releasing a lease that had
    already expired is logged, not raised (a raise in commit would roll back a promotion that had finished).

    Holds URLs only, not connections: Prefect copies and pickles the lock manager with its result store, and each
    process opens one client per backend (`_LEASES`).
    """

    def __init__(self, lock_url: str | None, catalog_url: str, hold_timeout: float):
        self.lock_url = check_lock_url(lock_url)
        self.catalog_url = catalog_url
        self.hold_timeout = hold_timeout

    @property
    def leases(self) -> Leases:
        key = (self.lock_url, self.catalog_url)
        with _LEASES_LOCK:
            leases = _LEASES.get(key)
            if leases is None:
                catalog = Catalog(CatalogConfig(url=self.catalog_url))
                leases = _LEASES[key] = leases_for(self.lock_url, catalog)
        return leases

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        return self.leases.acquire(key, holder, acquire_timeout, hold_timeout or self.hold_timeout)

    async def aacquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        return await asyncio.to_thread(self.acquire_lock, key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        if not self.leases.release(key, holder):
            logger.warning("lock %s had expired before %s released it", key, holder)

    def is_locked(self, key: str) -> bool:
        return self.leases.holder(key) is not None

    def is_lock_holder(self, key: str, holder: str) -> bool:
        return self.leases.holder(key) == holder

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_locked(key):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.wait_for_lock, key, timeout)


_LEASES: dict[tuple[str | None, str], Leases] = {}  # one client per backend and process
_LEASES_LOCK = threading.Lock()


def lock_store(ws: Workspace) -> ResultStore:
    """A result store whose only job is the lease lock of SERIALIZABLE transactions."""
    return ResultStore(lock_manager=LeaseLocks(ws.lock_url, ws.catalog_url, ws.lock_hold_s))


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
    digest: Digest
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
    to_digest: Digest
    """The digest of the revision `champion` points at now."""
    moved: bool
    """False when it already pointed there (an earlier attempt had moved it)."""
