"""The engine behind the catalog: any catalog address becomes servable on demand, loaded in the background.

`ensure(address)` returns a future that completes when the address is a name in the engine's working set. A hit
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
from mint_core.errors import MintError
from mint_core.lora.adapter import AdapterWeights
from mint_core.registry.catalog import AddressError, Catalog, parse_address
from mint_core.registry.packs import PackReader, is_pack_location
from mint_core.registry.store import AdapterStore

logger = logging.getLogger(__name__)


@dataclass
class LoaderStats:
    """Counters of the loader; with the working set's own (hits, misses, evictions) they are the metrics."""

    requests: int = 0
    hits: int = 0
    cold_loads: int = 0
    failures: int = 0
    prefetches: int = 0
    inflight_joins: int = 0
    cold_load_s: list[float] = field(
        default_factory=list
    )  # recent cold-load latencies (resolve + read + add)


class AdapterLoader:
    """Loads catalog addresses into an engine's working set on a small thread pool."""

    def __init__(
        self,
        engine: Engine,
        catalog: Catalog,
        store: AdapterStore,
        workers: int = 2,
        alias_ttl_s: float = 5.0,
        warm_slot: bool = False,
    ):
        self.engine = engine
        self.catalog = catalog
        self.store = store
        self.alias_ttl_s = alias_ttl_s
        self.warm_slot = warm_slot
        self.stats = LoaderStats()
        self._packs = PackReader(engine.sites)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mint-loader")
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[str]] = {}
        self._resolved_at: OrderedDict[str, float] = OrderedDict()  # movable addresses: when last resolved
        self._pack_lock = threading.Lock()  # safetensors handles are not shared across threads

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- asking ----

    def ensure(self, address: str, hold: bool = False) -> Future[str]:
        """A future of the working-set name serving `address` (the address itself). With `hold`, the name is
        kept until the caller's `engine.working_set.unhold(address)` (take it when a request will use it)."""
        addr = parse_address(address)  # AddressError at once for a malformed address
        movable = addr.kind in ("policy", "alias")
        ws = self.engine.working_set
        with self._lock:
            self.stats.requests += 1
            fresh = not movable or time.monotonic() - self._resolved_at.get(address, -1e18) < self.alias_ttl_s
            if fresh and (ws.hold(address) if hold else ws.get(address) is not None):
                self.stats.hits += 1
                done: Future[str] = Future()
                done.set_result(address)
                return done
            running = self._inflight.get(address)
            if running is not None:
                self.stats.inflight_joins += 1
                if hold:
                    return _then_hold(running, ws, address)
                return running
            fut = self._pool.submit(self._load, address, movable)
            self._inflight[address] = fut
        # outside the lock: a load that already finished runs the callback right here
        fut.add_done_callback(lambda f: self._done(address, f))
        return _then_hold(fut, ws, address) if hold else fut

    def load(self, address: str, timeout: float | None = None) -> str:
        """`ensure` and wait."""
        return self.ensure(address).result(timeout)

    def prefetch(self, addresses: Iterable[str], hold: bool = False, chunk: int = 256) -> list[Future[str]]:
        """Schedule cold loads of `addresses` ahead of need (hits cost nothing), in bulk: one catalog query and
        one read per pack for each `chunk` of misses. A malformed address fails its own future only."""
        ws = self.engine.working_set
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
                fresh = not movable or time.monotonic() - self._resolved_at.get(a, -1e18) < self.alias_ttl_s
                if fresh and ws.get(a) is not None:
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
            self._pool.submit(self._load_many, part)
            for a, _, f in part:
                f.add_done_callback(partial(self._done_cb, a))
        return [_then_hold(f, ws, a) if hold else f for a, f in zip(asked, out, strict=True)]

    def _load_many(self, part: list[tuple[str, bool, Future[str]]]) -> None:
        t0 = time.perf_counter()
        ws = self.engine.working_set
        try:
            resolved = self.catalog.resolve_many([a for a, _, _ in part])
        except Exception as e:  # the catalog itself failed: every address in the chunk with it
            for _, _, f in part:
                f.set_exception(e)
            self.stats.failures += len(part)
            return
        packs: dict[str, list[tuple[str, bool, Future[str], str]]] = {}
        singles: list[tuple[str, bool, Future[str], str]] = []
        for a, movable, f in part:
            r = resolved[a]
            if isinstance(r, Exception):
                f.set_exception(r)
                self.stats.failures += 1
            elif ws.get(a) == r.digest:
                f.set_result(a)
            elif is_pack_location(r.location):
                packs.setdefault(r.location.rpartition("#")[0], []).append((a, movable, f, r.digest))
            else:
                singles.append((a, movable, f, r.digest))
        loaded: list[tuple[str, bool, Future[str], AdapterWeights | Exception, str]] = []
        for path, members in packs.items():
            with self._pack_lock:
                got = self._packs.read_many(
                    path, [(int(loc_index(a, resolved)), a) for a, _, _, _ in members], self.engine.spec
                )
            loaded += [(a, m, f, w, d) for (a, m, f, d), w in zip(members, got, strict=True)]
        for a, m, f, d in singles:
            try:
                loaded.append((a, m, f, self._read(a, resolved[a].location), d))  # type: ignore[union-attr]
            except Exception as e:
                loaded.append((a, m, f, e, d))
        n_ok = 0
        for a, movable, f, w, digest in loaded:
            if isinstance(w, Exception):
                f.set_exception(w)
                self.stats.failures += 1
                continue
            if w.digest != digest:
                f.set_exception(
                    MintError(f"{a}: the catalog names sha256:{digest}, the revision is sha256:{w.digest}")
                )
                self.stats.failures += 1
                continue
            ws.add(a, w, replace=True, ephemeral=True)
            if movable:
                with self._lock:
                    self._resolved_at[a] = time.monotonic()
            n_ok += 1
            f.set_result(a)
        if n_ok:
            per = (time.perf_counter() - t0) / len(part)
            self.stats.cold_loads += n_ok
            self.stats.cold_load_s.extend([per] * n_ok)

    def _done_cb(self, address: str, fut: Future[str]) -> None:
        self._done(address, fut)

    def _done(self, address: str, fut: Future[str]) -> None:
        with self._lock:
            if self._inflight.get(address) is fut:
                del self._inflight[address]

    # ---- loading ----

    def _load(self, address: str, movable: bool) -> str:
        t0 = time.perf_counter()
        try:
            resolved = self.catalog.resolve(address)
            ws = self.engine.working_set
            if ws.get(address) != resolved.digest:
                weights = self._read(address, resolved.location)
                if weights.digest != resolved.digest:
                    raise MintError(
                        f"{address}: the catalog names sha256:{resolved.digest}, but {resolved.location} holds "
                        f"sha256:{weights.digest}"
                    )
                ws.add(address, weights, replace=True, ephemeral=True)
                if self.warm_slot:
                    ws.release(ws.acquire(address))
            if movable:
                with self._lock:
                    self._resolved_at[address] = time.monotonic()
                    self._resolved_at.move_to_end(address)
                    while len(self._resolved_at) > 65536:
                        self._resolved_at.popitem(last=False)
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

    def _read(self, address: str, location: str) -> AdapterWeights:
        if is_pack_location(location):
            with self._pack_lock:
                return self._packs.read(location, self.engine.spec, name=address)
        path = Path(location) if "://" not in location else self.store.local_dir(Path(location).name)
        return self.engine._read(address, path)


def loc_index(address: str, resolved: dict) -> int:
    return int(resolved[address].location.rpartition("#")[2])


def _then_hold(fut: Future[str], ws: object, address: str) -> Future[str]:
    """A future that completes after `fut`, holding the name for the caller (atomically with the check)."""
    out: Future[str] = Future()

    def chain(f: Future[str]) -> None:
        try:
            name = f.result()
        except BaseException as e:
            out.set_exception(e)
            return
        if ws.hold(name):  # type: ignore[attr-defined]
            out.set_result(name)
        else:  # forgotten between load and hold (a burst of other loads): rare; the caller may ask again
            out.set_exception(MintError(f"{address} was loaded but evicted before use; retry"))

    fut.add_done_callback(chain)
    return out
