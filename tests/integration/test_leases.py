"""mint's one lock mechanism, leases, on each backend `lock_url` can name: the catalog on SQLite (the embedded
default), the catalog on PostgreSQL (the scale path) and Redis. The same tests run on all three: one holder at a time
across threads and processes, a dead holder's lease expiring, release by the holder only, and Prefect's SERIALIZABLE
transactions of one policy (`tasks.common.LeaseLocks`) running one at a time.

PostgreSQL at MINT_TEST_PG_URL (default 127.0.0.1:5432, user postgres; each test gets its own temporary database)
and Redis at MINT_TEST_REDIS_URL (default redis://127.0.0.1:6379/0; each test its own key names). A server that
does not answer skips its tests, except under CI=true, where it fails them: CI runs both servers.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from prefect.results import ResultStore
from prefect.transactions import IsolationLevel, transaction
from pydantic import ValidationError

from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry import leases as leases_module
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.catalog_schema import locks
from mint_core.registry.index import registry_lock
from mint_core.registry.leases import (
    LOCK_URL_ENV,
    CatalogLeases,
    Leases,
    LockTimeout,
    RedisLeases,
    held,
    leases_for,
)
from mint_core.types import Site
from mint_testkit.skips import require
from mint_testkit.waiting import wait_until
from tasks.common import LeaseLocks

pytestmark = pytest.mark.integration

PG_ADMIN_URL = os.environ.get("MINT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("MINT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SITES = {"model.layers.0.self_attn.q_proj": Site("model.layers.0.self_attn.q_proj", 16, 16)}
FIRST_HOLD_S = 3.0
"""A hold long enough for a loaded host to renew it before it runs out (1 s was not: three SQLite writes took
1.17 s in CI's run beside the stack tests' servers)."""
RENEWED_HOLD_S = 10.0


@dataclass(frozen=True)
class Backend:
    """Where a test's leases live, as `lock_url` and `catalog_url` name it; picklable, so a child process opens
    its own connection to the same leases."""

    kind: str
    catalog_url: str
    lock_url: str | None
    tag: str
    """Unique to the test: lease names carry it, so tests sharing one Redis never meet."""

    def open(self) -> Leases:
        """A fresh handle (own engine or client) on the backend's leases."""
        return leases_for(self.lock_url, Catalog(CatalogConfig(url=self.catalog_url)))

    def name(self, name: str) -> str:
        return f"{name}-{self.tag}"


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    tag = uuid.uuid4().hex[:12]
    sqlite_url = f"sqlite:///{tmp_path}/catalog.db"
    if request.param == "sqlite":
        yield Backend("sqlite", sqlite_url, None, tag)
    elif request.param == "postgres":
        yield from _postgres(tag)
    else:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        except (redis.RedisError, OSError) as e:
            require(False, f"Redis not reachable at {REDIS_URL}: {e}")
        yield Backend("redis", sqlite_url, REDIS_URL, tag)
        for key in client.scan_iter(match=f"mint:lease:*{tag}*"):
            client.delete(key)
        client.close()


def _postgres(tag: str) -> Iterator[Backend]:
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as e:
        require(False, f"PostgreSQL not reachable at {PG_ADMIN_URL}: {str(e.orig).strip().splitlines()[0]}")
    db = f"mint_test_{tag}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{db}"')
    try:
        yield Backend("postgres", admin.url.set(database=db).render_as_string(hide_password=False), None, tag)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        admin.dispose()


def _close(*handles: Leases) -> None:
    for h in handles:
        if isinstance(h, CatalogLeases):
            h.catalog.close()
        elif isinstance(h, RedisLeases):
            h.client.close()


# ---- the lease contract ----


def test_backend_is_the_one_lock_url_names(backend: Backend) -> None:
    leases = backend.open()
    assert isinstance(leases, RedisLeases if backend.kind == "redis" else CatalogLeases)
    _close(leases)


def test_lease_is_exclusive_renewed_by_its_holder_and_released_by_it_only(backend: Backend) -> None:
    one, other = backend.open(), backend.open()
    p, q = backend.name("registry/p"), backend.name("registry/q")
    assert one.acquire(p, "a", acquire_timeout=0)
    assert one.holder(p) == "a" and other.holder(p) == "a"
    assert not other.acquire(p, "b", acquire_timeout=0.05)  # held: b waits, then gives up
    assert one.acquire(p, "a", acquire_timeout=0)  # taking it again renews it
    assert other.acquire(q, "b", acquire_timeout=0)  # another name is another lease
    assert not other.release(p, "b")  # only the holder releases
    assert one.holder(p) == "a"
    assert other.release(p, "a")  # the holder, through any handle
    assert one.holder(p) is None and not one.release(p, "a")
    assert other.acquire(p, "b", acquire_timeout=0)
    _close(one, other)


def test_a_released_lease_leaves_no_row(backend: Backend) -> None:
    """One run, one lease name: a kept row per released lease would grow the table by a row per run."""
    leases = backend.open()
    names = [backend.name(f"run/{i}") for i in range(3)]
    for n in names:
        assert leases.acquire(n, "w@host", acquire_timeout=0)
    assert leases.release(names[0], "w@host") and leases.release(names[1], "w@host")
    if isinstance(leases, CatalogLeases):
        with leases.catalog.engine.connect() as conn:
            left = conn.execute(sa.select(locks.c.name).where(locks.c.name.in_(names))).scalars().all()
        assert left == [names[2]]
    assert [leases.holder(n) for n in names] == [None, None, "w@host"]
    assert leases.acquire(names[0], "other@host", acquire_timeout=0)  # a released name is free to take again
    _close(leases)


def test_renewal_extends_the_hold(backend: Backend) -> None:
    leases, other, name = backend.open(), backend.open(), backend.name("promote-p")
    t0 = time.monotonic()
    assert leases.acquire(name, "a", hold_timeout=FIRST_HOLD_S)
    assert not other.acquire(name, "b", acquire_timeout=0)
    assert leases.acquire(name, "a", acquire_timeout=0, hold_timeout=RENEWED_HOLD_S)
    # renewed within the first hold: later, `a` would have taken a free lease, and passed with renewal broken
    assert time.monotonic() - t0 < FIRST_HOLD_S, "the host took longer than the first hold to renew it"
    time.sleep(max(0.0, t0 + FIRST_HOLD_S + 0.1 - time.monotonic()))  # past the first hold: its deadline
    assert not other.acquire(name, "b", acquire_timeout=0)  # within the renewed one
    assert leases.holder(name) == "a"
    assert time.monotonic() - t0 < RENEWED_HOLD_S, "the checks ran past the renewed hold"
    _close(leases, other)


def test_lease_of_a_dead_holder_expires(backend: Backend) -> None:
    leases, name = backend.open(), backend.name("promote-p")
    assert leases.acquire(name, "dead", hold_timeout=0.05)
    assert not leases.acquire(name, "b", acquire_timeout=0)
    assert leases.acquire(name, "b", acquire_timeout=5)  # after 50 ms the lease is free
    assert leases.holder(name) == "b"
    assert not leases.release(name, "dead")
    assert leases.holder(name) == "b"
    _close(leases)


def test_an_expired_lease_still_names_its_last_holder_until_released_or_taken(backend: Backend) -> None:
    """What a worker starting again reads to find the runs its dead host left (mint_app.services.deployments.reclaim_runs):
    on the catalog the row keeps the holder after expiry; Redis drops the key, so there only a live holder shows."""
    leases, name = backend.open(), backend.name("run/r1")
    assert leases.last_holder(name) is None
    assert leases.acquire(name, "host-a@1", hold_timeout=0.05)
    assert leases.last_holder(name) == "host-a@1"
    wait_until(lambda: leases.holder(name) is None, 10, "the 50 ms lease expired")
    assert leases.last_holder(name) == (None if backend.kind == "redis" else "host-a@1")
    assert leases.acquire(name, "host-b@2", acquire_timeout=0)  # taken over: the new holder is the last
    assert leases.last_holder(name) == "host-b@2"
    assert leases.release(name, "host-b@2")
    assert leases.last_holder(name) is None  # released: nobody left it behind
    _close(leases)


def _take_and_die(backend: Backend, name: str) -> None:
    backend.open().acquire(name, f"dead-{os.getpid()}", hold_timeout=0.5)
    os._exit(0)  # no release, no cleanup: the process is gone with the lease held


def test_lease_of_a_killed_process_expires(backend: Backend) -> None:
    name = backend.name("promote-p")
    child = multiprocessing.get_context("fork").Process(target=_take_and_die, args=(backend, name))
    child.start()
    child.join(30)
    leases = backend.open()
    assert leases.holder(name) == f"dead-{child.pid}"
    t0 = time.monotonic()
    assert leases.acquire(name, "next", acquire_timeout=10)
    assert time.monotonic() - t0 < 5
    _close(leases)


def test_held_names_the_holder_when_it_stays_taken(backend: Backend) -> None:
    one, other = backend.open(), backend.open()
    name = backend.name("registry/p")
    assert one.acquire(name, "x", acquire_timeout=0)
    with pytest.raises(LockTimeout, match="held by x"), held(other, name, "y", timeout_s=0.05):
        pass
    assert one.release(name, "x")
    with held(other, name, "y", timeout_s=0):
        assert one.holder(name) == "y"
    assert one.holder(name) is None
    _close(one, other)


# ---- one holder at a time: threads over several handles, processes ----


def test_threads_over_two_handles_hold_it_one_at_a_time(backend: Backend) -> None:
    handles = [backend.open(), backend.open()]
    name = backend.name("promote-p")
    inside: list[int] = []
    most = [0]
    guard = threading.Lock()

    def worker(t: int) -> None:
        for _ in range(5):
            with held(handles[t % 2], name, f"w{t}", timeout_s=60):
                with guard:
                    inside.append(t)
                    most[0] = max(most[0], len(inside))
                time.sleep(0.002)  # the test's input: a holder that takes a while, so the others overlap it
                with guard:
                    inside.remove(t)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert most[0] == 1
    assert handles[0].holder(name) is None
    _close(*handles)


def _count_under_lease(backend: Backend, name: str, counter: Path, times: int) -> None:
    leases = backend.open()
    for _ in range(times):
        with held(leases, name, f"pid{os.getpid()}", timeout_s=60):
            n = int(counter.read_text())
            time.sleep(0.005)  # a read-modify-write that loses counts unless the lease excludes the others
            counter.write_text(str(n + 1))
    os._exit(0)


def test_processes_hold_it_one_at_a_time(backend: Backend, tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    name = backend.name("registry/p")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_count_under_lease, args=(backend, name, counter, 6)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert int(counter.read_text()) == 18


# ---- Prefect's SERIALIZABLE transactions through the lock manager ----


def test_serializable_transactions_of_one_policy_run_one_at_a_time(backend: Backend) -> None:
    inside: list[str] = []
    most = [0]
    guard = threading.Lock()
    a, b = backend.name("a"), backend.name("b")

    def promotion(policy: str) -> None:
        store = ResultStore(lock_manager=LeaseLocks(backend.lock_url, backend.catalog_url, hold_timeout=30))
        with transaction(
            key=f"promote-{policy}",
            isolation_level=IsolationLevel.SERIALIZABLE,
            store=store,
            overwrite=True,
            write_on_commit=False,
        ):
            with guard:
                inside.append(policy)
                most[0] = max(most[0], inside.count(policy))
            time.sleep(0.05)  # the test's input: a promotion that takes a while, so the others overlap it
            with guard:
                inside.remove(policy)

    threads = [threading.Thread(target=promotion, args=(p,)) for _ in range(4) for p in (a, b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert most[0] == 1  # never two promotions of one policy at once (a and b may overlap)
    leases = backend.open()
    assert leases.holder(f"promote-{a}") is None and leases.holder(f"promote-{b}") is None
    _close(leases)


def test_lock_manager_contract(backend: Backend) -> None:
    locks_ = LeaseLocks(backend.lock_url, backend.catalog_url, hold_timeout=0.1)
    k = backend.name("k")
    assert locks_.acquire_lock(k, "h1", acquire_timeout=0)
    assert locks_.is_locked(k) and locks_.is_lock_holder(k, "h1") and not locks_.is_lock_holder(k, "h2")
    assert not locks_.acquire_lock(k, "h2", acquire_timeout=0)
    assert locks_.wait_for_lock(k, timeout=5)  # the hold timeout passes: free
    assert locks_.acquire_lock(k, "h2", acquire_timeout=0)
    locks_.release_lock(k, "h1")  # expired and taken by h2 since: logged, not raised
    assert locks_.is_lock_holder(k, "h2")
    locks_.release_lock(k, "h2")
    assert not locks_.is_locked(k)


def test_prefect_and_registry_leases_are_one_mechanism(backend: Backend) -> None:
    """What a promotion holds through Prefect, `leases_for` (the registry's path) sees, and the other way round;
    with Redis named, the catalog's table holds nothing."""
    prefect_locks = LeaseLocks(backend.lock_url, backend.catalog_url, hold_timeout=30)
    catalog = Catalog(CatalogConfig(url=backend.catalog_url))
    registry_leases = leases_for(backend.lock_url, catalog)
    promote, registry = backend.name("promote-p"), backend.name("registry/p")
    assert prefect_locks.acquire_lock(promote, "flow", acquire_timeout=0)
    assert registry_leases.holder(promote) == "flow"
    assert registry_leases.acquire(registry, "writer", acquire_timeout=0)
    assert prefect_locks.is_lock_holder(registry, "writer")
    with catalog.engine.connect() as conn:
        rows = conn.execute(sa.select(sa.func.count()).select_from(locks)).scalar_one()
    assert rows == (0 if backend.kind == "redis" else 2)
    prefect_locks.release_lock(promote, "flow")
    assert registry_leases.release(registry, "writer")
    catalog.close()


# ---- registry writes ----


def test_registry_writes_wait_for_the_lease_where_lock_url_says(
    backend: Backend, mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workspace's registry takes `registry/<policy>` from the backend `lock_url` names: a write waits while
    another holder has it there, and goes on once it is released."""
    ws = Workspace(
        tracking_uri=mlflow_server,
        store=str(tmp_path / "store"),
        catalog_url=backend.catalog_url,
        lock_url=backend.lock_url,
    )
    reg = ws.registry()
    assert isinstance(ws.leases(), RedisLeases if backend.kind == "redis" else CatalogLeases)
    out = tmp_path / "adapter"
    save_adapter(random_adapter(SITES, ["q_proj"], rank=2, seed=0, base_fingerprint="f" * 64), out, SITES)
    digest = reg.store.put_dir(out)
    policy = backend.name("leased")
    other = backend.open()
    assert other.acquire(registry_lock(policy), "someone", acquire_timeout=0)
    done: list[int] = []
    writer = threading.Thread(
        target=lambda: done.append(reg.create_revision(policy, digest, base="f" * 64, rank=2).version)
    )
    refused = count_refusals(monkeypatch, writer)
    writer.start()
    wait_until(lambda: refused[0] >= 2, 30, "the writer tried the held lease twice")
    assert writer.is_alive() and not done  # refused, and waiting for the lease
    with reg.catalog.engine.connect() as conn:  # one mechanism: with Redis named, the catalog holds no lease
        rows = conn.execute(sa.select(sa.func.count()).select_from(locks)).scalar_one()
    assert rows == (0 if backend.kind == "redis" else 1)
    assert other.release(registry_lock(policy), "someone")
    writer.join(60)
    assert done == [1]
    assert other.holder(registry_lock(policy)) is None
    _close(other)


def count_refusals(monkeypatch: pytest.MonkeyPatch, thread: threading.Thread) -> list[int]:
    """How many times `thread` has tried a lease and been refused, on either backend: the event that shows a
    writer waiting (both backends' `acquire` poll their `take` through `leases._poll`)."""
    refused = [0]
    poll = leases_module._poll

    def counted(take: Callable[[], bool], acquire_timeout: float | None) -> bool:
        def counted_take() -> bool:
            took = take()
            if not took and threading.current_thread() is thread:
                refused[0] += 1
            return took

        return poll(counted_take, acquire_timeout)

    monkeypatch.setattr(leases_module, "_poll", counted)
    return refused


# ---- the workspace setting ----


def test_workspace_lock_url_names_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOCK_URL_ENV, raising=False)
    assert Workspace().lock_url is None
    assert Workspace(lock_url="redis://cache:6379/2").lock_url == "redis://cache:6379/2"
    monkeypatch.setenv(LOCK_URL_ENV, "rediss://cache:6380/0")
    assert Workspace().lock_url == "rediss://cache:6380/0"
    with pytest.raises(ValidationError, match="lock_url"):
        Workspace(lock_url="postgresql://db/mint")


def test_workspace_refuses_the_old_redis_url_with_a_pointer_to_lock_url() -> None:
    with pytest.raises(ValidationError, match=r"redis_url is gone.*lock_url: redis://"):
        Workspace.model_validate({"redis_url": "redis://127.0.0.1:6379/0"})
