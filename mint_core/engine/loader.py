"""One way in and out of a serving engine's working set: admin loads and unloads, and on-demand catalog loads.

A server changes its adapters only through `AdapterManager`. The admin load route (and so a promote refresh,
which is an admin load in place) calls `load(name, path, replace)`, the unload route `unload(name)`, and a request
or prefetch naming a catalog address that is not loaded calls `ensure(address)`. Every load reads and validates
the new revision before the working set changes (as vLLM's LoRA worker manager loads a new adapter "first to
ensure it is actually valid, before evicting any existing adapters"), so a bad adapter is refused with nothing
evicted and a name being swapped keeps serving its old revision. Loads and unloads are idempotent: loading a name
with the revision it already serves changes nothing and returns False, and so does unloading a name that is not
loaded. The swap itself is the working set's: atomic per request, the old slot freed when its last request ends.

`ensure(address)` returns a future that completes when the address is a name in the working set. A hit
(already loaded, resolution still fresh) completes at once; a miss resolves the address in the catalog, reads and
validates the revision (from the store, or from a pack) and adds it to the host cache on a loader thread, so the
engine loop never waits on disk: the request that needs it waits, the batch does not. Concurrent asks for one
address share one load. `prefetch` schedules loads ahead of need. Addresses that can move (`policy`,
`policy@alias`) are re-resolved after `alias_ttl_s`, and a moved alias is loaded in place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from mint_core.engine.engine import Engine
from mint_core.engine.working_set import WorkingSet
from mint_core.errors import MintError
from mint_core.lora.adapter import AdapterWeights
from mint_core.registry.catalog import AddressError, Catalog, parse_address
from mint_core.registry.catalog_schema import Resolved
from mint_core.registry.packs import PackReader, is_pack_location
from mint_core.registry.store import AdapterStore

logger = logging.getLogger(__name__)


class NoCatalog(MintError):
    """An on-demand load was asked of a manager that has no catalog to resolve addresses in."""


@dataclass
class LoaderStats:
    """Counters of on-demand loads; with the working set's own (hits, misses, evictions) they are the metrics."""

    requests: int = 0
    hits: int = 0
    cold_loads: int = 0
    failures: int = 0
    prefetches: int = 0
    inflight_joins: int = 0
    cold_load_s: list[float] = field(
        default_factory=list
    )  # recent cold-load latencies (resolve + read + add)


class AdapterManager:
    """Loads and unloads an engine's adapters: by path for the admin routes, by catalog address on demand (on a
    small thread pool, when a catalog is given)."""

    def __init__(
        self,
        engine: Engine,
        store: AdapterStore,
        catalog: Catalog | None = None,
        workers: int = 2,
        alias_ttl_s: float = 5.0,
    ):
        self.engine = engine
        self.store = store
        self.catalog = catalog
        self.alias_ttl_s = alias_ttl_s
        self.stats = LoaderStats()
        self._packs = PackReader(engine.sites)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mint-loader")
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[str]] = {}
        self._resolved_at: OrderedDict[str, float] = OrderedDict()  # movable addresses: when last resolved
        self._pack_lock = threading.Lock()  # safetensors handles are not shared across threads

    @property
    def working_set(self) -> WorkingSet:
        return self.engine.working_set

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- by name: the admin routes ----

    def load(self, name: str, path: Path, replace: bool = False) -> bool:
        """Validate the adapter at `path`, then serve it as `name`. With `replace`, a name already loaded moves to
        the new revision in place. False if `name` already serves that revision (nothing changes).

        Raises AdapterError for an invalid adapter and AdapterExists for a name serving another revision without
        `replace`; in both cases before anything is evicted or moved."""
        weights = self.engine.read_adapter(name, path)
        added = self._install(name, weights, source=path, replace=replace, ephemeral=False)
        logger.info("loaded %s from %s (%s)", name, path, "new revision" if added else "already loaded")
        return added

    def unload(self, name: str) -> bool:
        """Stop serving `name`; its slot is freed now, or when the last request using it ends. False if it was
        not loaded (unloading twice is safe)."""
        with self._lock:
            self._resolved_at.pop(name, None)
        return self.working_set.remove(name)

    def _install(
        self, name: str, weights: AdapterWeights, source: Path | None, replace: bool, ephemeral: bool
    ) -> bool:
        """The one place the manager changes the working set; `weights` were validated by the caller's read."""
        return self.working_set.add(name, weights, source=source, replace=replace, ephemeral=ephemeral)

    # ---- by catalog address: on demand ----

    def ensure(self, address: str, hold: bool = False) -> Future[str]:
        """A future of the working-set name serving `address` (the address itself). With `hold`, the name is
        kept until the caller's `engine.working_set.unhold(address)` (take it when a request will use it)."""
        catalog = self._catalog()
        addr = parse_address(address)  # AddressError at once for a malformed address
        movable = addr.kind in ("policy", "alias")
        ws = self.working_set
        with self._lock:
            self.stats.requests += 1
            if self._fresh(address, movable) and (ws.hold(address) if hold else ws.get(address) is not None):
                self.stats.hits += 1
                done: Future[str] = Future()
                done.set_result(address)
                return done
            running = self._inflight.get(address)
            if running is not None:
                self.stats.inflight_joins += 1
                return _then_hold(running, ws, address) if hold else running
            fut = self._pool.submit(self._load_address, catalog, address, movable)
            self._inflight[address] = fut
        # outside the lock: a load that already finished runs the callback right here
        fut.add_done_callback(partial(self._done, address))
        return _then_hold(fut, ws, address) if hold else fut

    def load_address(self, address: str, timeout: float | None = None) -> str:
        """`ensure` and wait."""
        return self.ensure(address).result(timeout)

    def prefetch(self, addresses: Iterable[str], hold: bool = False, chunk: int = 256) -> list[Future[str]]:
        """Schedule cold loads of `addresses` ahead of need (hits cost nothing), in bulk: one catalog query and
        one read per pack for each `chunk` of misses. A malformed address fails its own future only."""
        catalog = self._catalog()
        ws = self.working_set
        out: list[Future[str]] = []
        asked = list(addresses)
        todo: list[tuple[str, bool, Future[str]]] = []
        with self._lock:
            for a in asked:
                self.stats.prefetches += 1
                self.stats.requests += 1
                fut: Future[str] = Future()
                try:
                    addr = parse_address(a)
                except AddressError as e:
                    fut.set_exception(e)
                    out.append(fut)
                    continue
                movable = addr.kind in ("policy", "alias")
                if self._fresh(a, movable) and ws.get(a) is not None:
                    self.stats.hits += 1
                    fut.set_result(a)
                elif a in self._inflight:
                    self.stats.inflight_joins += 1
                    fut = self._inflight[a]
                else:
                    self._inflight[a] = fut
                    todo.append((a, movable, fut))
                out.append(fut)
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            self._pool.submit(self._load_many, catalog, part)
            for a, _, f in part:
                f.add_done_callback(partial(self._done, a))
        return [_then_hold(f, ws, a) if hold else f for a, f in zip(asked, out, strict=True)]

    def _catalog(self) -> Catalog:
        if self.catalog is None:
            raise NoCatalog("this server has no catalog (set catalog_url) to load addresses from")
        return self.catalog

    def _fresh(self, address: str, movable: bool) -> bool:
        """Whether a loaded `address` may be served without asking the catalog again (caller holds the lock)."""
        return not movable or time.monotonic() - self._resolved_at.get(address, -1e18) < self.alias_ttl_s

    def _resolved(self, address: str) -> None:
        with self._lock:
            self._resolved_at[address] = time.monotonic()
            self._resolved_at.move_to_end(address)
            while len(self._resolved_at) > 65536:
                self._resolved_at.popitem(last=False)

    def _done(self, address: str, fut: Future[str]) -> None:
        with self._lock:
            if self._inflight.get(address) is fut:
                del self._inflight[address]

    def _load_address(self, catalog: Catalog, address: str, movable: bool) -> str:
        t0 = time.perf_counter()
        try:
            resolved = catalog.resolve(address)
            if self.working_set.get(address) != resolved.digest:
                weights = self._verified(address, resolved, self._read(address, resolved.location))
                self._install(address, weights, source=None, replace=True, ephemeral=True)
            if movable:
                self._resolved(address)
        except Exception:
            self.stats.failures += 1
            raise
        dt = time.perf_counter() - t0
        self.stats.cold_loads += 1
        self.stats.cold_load_s.append(dt)
        if len(self.stats.cold_load_s) > 100_000:
            del self.stats.cold_load_s[:50_000]
        logger.debug("cold load %s in %.1f ms", address, dt * 1e3)
        return address

    def _load_many(self, catalog: Catalog, part: list[tuple[str, bool, Future[str]]]) -> None:
        t0 = time.perf_counter()
        ws = self.working_set
        try:
            resolved = catalog.resolve_many([a for a, _, _ in part])
        except Exception as e:  # the catalog itself failed: every address in the chunk with it
            for _, _, f in part:
                f.set_exception(e)
            self.stats.failures += len(part)
            return
        packs: dict[str, list[tuple[str, bool, Future[str], Resolved]]] = {}
        singles: list[tuple[str, bool, Future[str], Resolved]] = []
        for a, movable, f in part:
            r = resolved[a]
            if isinstance(r, Exception):
                f.set_exception(r)
                self.stats.failures += 1
            elif ws.get(a) == r.digest:
                f.set_result(a)
            elif is_pack_location(r.location):
                packs.setdefault(r.location.rpartition("#")[0], []).append((a, movable, f, r))
            else:
                singles.append((a, movable, f, r))
        loaded: list[tuple[str, bool, Future[str], Resolved, AdapterWeights | Exception]] = []
        for path, members in packs.items():
            with self._pack_lock:
                got = self._packs.read_many(
                    path, [(_pack_index(r.location), a) for a, _, _, r in members], self.engine.spec
                )
            loaded += [(a, m, f, r, w) for (a, m, f, r), w in zip(members, got, strict=True)]
        for a, m, f, r in singles:
            try:
                loaded.append((a, m, f, r, self._read(a, r.location)))
            except Exception as e:
                loaded.append((a, m, f, r, e))
        n_ok = 0
        for a, movable, f, r, w in loaded:
            try:
                if isinstance(w, Exception):
                    raise w
                self._install(a, self._verified(a, r, w), source=None, replace=True, ephemeral=True)
            except Exception as e:
                f.set_exception(e)
                self.stats.failures += 1
                continue
            if movable:
                self._resolved(a)
            n_ok += 1
            f.set_result(a)
        if n_ok:
            per = (time.perf_counter() - t0) / len(part)
            self.stats.cold_loads += n_ok
            self.stats.cold_load_s.extend([per] * n_ok)

    def _read(self, address: str, location: str) -> AdapterWeights:
        """Read and validate the revision at a catalog location (a store directory or a pack member)."""
        if is_pack_location(location):
            with self._pack_lock:
                return self._packs.read(location, self.engine.spec, name=address)
        path = Path(location) if "://" not in location else self.store.local_dir(Path(location).name)
        return self.engine.read_adapter(address, path)

    @staticmethod
    def _verified(address: str, resolved: Resolved, weights: AdapterWeights) -> AdapterWeights:
        """`weights`, if they are the revision the catalog names (a blob changed under the catalog is refused)."""
        if weights.digest != resolved.digest:
            raise MintError(
                f"{address}: the catalog names {resolved.digest.prefixed}, but {resolved.location} holds "
                f"{weights.digest.prefixed if weights.digest else 'an unnamed revision'}"
            )
        return weights


def _pack_index(location: str) -> int:
    return int(location.rpartition("#")[2])


def _then_hold(fut: Future[str], ws: WorkingSet, address: str) -> Future[str]:
    """A future that completes after `fut`, holding the name for the caller (atomically with the check)."""
    out: Future[str] = Future()

    def chain(f: Future[str]) -> None:
        try:
            name = f.result()
        except BaseException as e:
            out.set_exception(e)
            return
        if ws.hold(name):
            out.set_result(name)
        else:  # forgotten between load and hold (a burst of other loads): rare; the caller may ask again
            out.set_exception(MintError(f"{address} was loaded but evicted before use; retry"))

    fut.add_done_callback(chain)
    return out
