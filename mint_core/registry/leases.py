"""Leases: the one lock mechanism of mint, with two backends chosen by one URL.

A lease is a named lock with a holder and an expiry. Every registry write of a policy takes `registry/<policy>`
(`mint_core.registry.mlflow_registry`, `mint_core.registry.index`); every promotion, Prefect's SERIALIZABLE
transaction, takes `promote-<policy>` through `tasks.common.LeaseLocks`. Both get their leases from
`leases_for(lock_url, catalog)`, so a deployment holds all its leases in one place:

- the catalog (`lock_url` None, the default): the `locks` table of the catalog's own database, a SQLite file for
  the embedded default (no server) or PostgreSQL on the scale path (shared across machines);
- Redis (`lock_url` `redis://host:port/db` or `rediss://...`), for a deployment that already runs one.

The same semantics on both: `acquire` waits up to `acquire_timeout` (None: as long as it takes) and takes the lease
for `hold_timeout` seconds, after which a holder that died has lost it; taking a lease one already holds renews it;
only the holder releases; `holder` says who holds it now. A lease, not a database transaction or connection held
open: a holder may call MLflow and the serving endpoint meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Protocol
from urllib.parse import urlsplit

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from mint_core.errors import MintError
from mint_core.registry.catalog import Catalog
from mint_core.registry.catalog_schema import locks

logger = logging.getLogger(__name__)

HOLD_S = 300.0
"""Longest a lease is held unless renewed: a holder that died frees it after this long."""
LOCK_URL_ENV = "MINT_LOCK_URL"
"""The environment variable that names where leases live when nothing else does (the registry CLI, rebuilds)."""
REDIS_SCHEMES = ("redis", "rediss")


class LockTimeout(MintError):
    """A lease stayed held by another holder for longer than the caller would wait."""


class LeasesUnavailable(MintError, ConnectionError):
    """The lease backend cannot be reached (a ConnectionError, so tasks retry it as transient)."""


class Leases(Protocol):
    """Named leases: acquire with a timeout, held until released or `hold_timeout` passes, released by the holder."""

    def acquire(
        self, name: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float = HOLD_S
    ) -> bool:
        """Take `name` for `holder`, waiting up to `acquire_timeout` seconds (None: as long as it takes); taking
        a lease one already holds renews it. False when the wait ran out."""
        ...

    def release(self, name: str, holder: str) -> bool:
        """Give `name` back; False when `holder` no longer held it (it had expired and maybe been taken)."""
        ...

    def holder(self, name: str) -> str | None:
        """Who holds `name` now, or None."""
        ...

    def last_holder(self, name: str) -> str | None:
        """Who held `name` last and never released it, expired or not (a holder that died), or None."""
        ...


@contextlib.contextmanager
def held(
    leases: Leases, name: str, holder: str, timeout_s: float | None = 120.0, hold_s: float = HOLD_S
) -> Iterator[None]:
    """Hold the lease `name` for the block; `LockTimeout` naming the holder when it stays taken."""
    if not leases.acquire(name, holder, timeout_s, hold_s):
        raise LockTimeout(
            f"lock {name!r} is held by {leases.holder(name) or 'someone'}; waited {timeout_s or 0:.0f} s"
        )
    try:
        yield
    finally:
        if not leases.release(name, holder):
            logger.warning("lock %s had expired before %s released it", name, holder)


def _poll(take: Callable[[], bool], acquire_timeout: float | None) -> bool:
    """`take()` until it succeeds or `acquire_timeout` runs out, backing off from 5 ms to 250 ms."""
    deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
    pause = 0.005
    while not take():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(pause * 2, 0.25)
    return True


class CatalogLeases:
    """Leases in the catalog's `locks` table: one row per name, held while `holder` is set and `expires` has not
    passed, so a holder that dies frees its lease then. Expiry compares the writers' clocks, so keep them in step
    (NTP) when several machines share one catalog."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def acquire(
        self, name: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float = HOLD_S
    ) -> bool:
        return _poll(lambda: self.take(name, holder, hold_timeout), acquire_timeout)

    def take(self, name: str, holder: str, hold_s: float) -> bool:
        """One try at the lease `name` for `holder` for `hold_s` seconds; taking a lease one already holds renews
        it. False when another holder has it."""
        return bool(self.catalog.transaction(lambda conn: _take(conn, name, holder, hold_s)))

    def release(self, name: str, holder: str) -> bool:
        """Give the lease back, and its row with it (a run's lease names a run: kept, rows would pile up one per
        run); False when `holder` no longer held it (it had expired and maybe been taken)."""
        return bool(
            self.catalog.transaction(
                lambda conn: (
                    conn.execute(
                        locks.delete().where(locks.c.name == name, locks.c.holder == holder)
                    ).rowcount
                )
            )
        )

    def holder(self, name: str) -> str | None:
        """Who holds the lease `name` now, or None."""
        with self.catalog.engine.connect() as conn:
            row = conn.execute(sa.select(locks.c.holder, locks.c.expires).where(locks.c.name == name)).first()
        if row is None or row[0] is None or (row[1] is not None and row[1] < time.time()):
            return None
        return str(row[0])

    def last_holder(self, name: str) -> str | None:
        """Who held `name` last and never released it: the row keeps an expired holder until another takes it."""
        with self.catalog.engine.connect() as conn:
            row = conn.execute(sa.select(locks.c.holder).where(locks.c.name == name)).first()
        return None if row is None or row[0] is None else str(row[0])

    def __repr__(self) -> str:
        return f"CatalogLeases({self.catalog.engine.url.render_as_string(hide_password=True)})"


def _take(conn: Connection, name: str, holder: str, hold_s: float) -> bool:
    now = time.time()
    free = sa.or_(locks.c.holder.is_(None), locks.c.holder == holder, locks.c.expires < now)
    taken = conn.execute(
        locks.update().where(locks.c.name == name, free).values(holder=holder, expires=now + hold_s)
    ).rowcount
    if taken:
        return True
    if conn.execute(sa.select(locks.c.name).where(locks.c.name == name)).first() is not None:
        return False
    conn.execute(locks.insert().values(name=name, holder=holder, expires=now + hold_s))
    return True


# KEYS[1] = the lease, ARGV[1] = the holder, ARGV[2] = hold milliseconds. Compare-and-act in one script, so no other
# client can take the lease between the check and the change.
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class RedisLeases:
    """Leases in Redis: one key per lease (`<prefix><name>`) holding the holder, expiring with the lease
    (`SET NX PX`); renewal and release compare the holder first (Lua). Expiry is Redis's own clock."""

    def __init__(self, url: str, prefix: str = "mint:lease:"):
        self.url = url
        self.prefix = prefix
        self.client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)

    def _call(self, what: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise LeasesUnavailable(f"{what}: Redis at {_safe(self.url)} is unreachable: {e}") from e

    def acquire(
        self, name: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float = HOLD_S
    ) -> bool:
        key, ms = self.prefix + name, max(1, round(hold_timeout * 1000))

        def take() -> bool:
            if self.client.set(key, holder, nx=True, px=ms):
                return True
            return bool(self._renew(keys=[key], args=[holder, ms]))

        return _poll(lambda: bool(self._call(f"take lock {name!r}", take)), acquire_timeout)

    def release(self, name: str, holder: str) -> bool:
        return bool(
            self._call(
                f"release lock {name!r}", lambda: self._release(keys=[self.prefix + name], args=[holder])
            )
        )

    def holder(self, name: str) -> str | None:
        value = self._call(f"read lock {name!r}", lambda: self.client.get(self.prefix + name))
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def last_holder(self, name: str) -> str | None:
        """Redis drops a key when its lease expires, so the last holder is the holder while it holds."""
        return self.holder(name)

    def __repr__(self) -> str:
        return f"RedisLeases({_safe(self.url)})"


def _safe(url: str) -> str:
    """The URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}").geturl()


def check_lock_url(url: str | None) -> str | None:
    """`url` if it names a lease backend (None or empty: the catalog; `redis://`/`rediss://`: Redis), else ValueError."""
    if not url:
        return None
    if urlsplit(url).scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"lock URL {_safe(url)!r}: leases live in the catalog (leave it unset) or in Redis (redis://host:port/db)"
        )
    return url


def leases_for(url: str | None, catalog: Catalog) -> Leases:
    """The leases `url` names: the catalog's when it is None or empty, Redis for `redis://`/`rediss://`."""
    url = check_lock_url(url)
    return CatalogLeases(catalog) if url is None else RedisLeases(url)


def default_leases(catalog: Catalog) -> Leases:
    """`leases_for` the URL in $MINT_LOCK_URL (unset: the catalog): for callers given no workspace."""
    return leases_for(os.environ.get(LOCK_URL_ENV), catalog)
