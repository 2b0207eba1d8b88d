"""The replicas behind one front: N vLLM servers the front routes over itself, refreshed as one deployment.

Requests: the front picks the replica (`Fleet.route`). The key is the served name, and the order is rendezvous
(highest random weight) hashing over the replicas' names (`rendezvous`): one adapter's requests stay on one
replica, which holds it in its working set (a cold load once per adapter, not once per replica; one slot taken,
not N), and when a replica drops out only the names it held move, each to the next replica in its own order. A
replica is passed over while the golden probe has it out of rotation (serving/golden.py) or while it is down (a
request or a read could not reach it; it is asked `GET /health` again, at most every RECHECK_S, as requests come,
and routed to once it answers). A request a replica did not answer (the connection refused, or closed without an
answer) goes to the next one; an answer from a replica taken out of rotation while the request ran is dropped and
the request sent to the next. Requests carry the routed key, which a replica's seal accepts for inference only.

Loads and unloads go to each replica directly, with mint's full key: vLLM's `/v1/load_lora_adapter` changes only
the replica that answers it. A load is done only when every healthy replica took it and answers with it:

1. the replicas that answer now are the ones to change (a replica that is down resolves a name on demand when it
   comes back: its resolver plugin asks the front, which names the revision the other replicas serve under it);
2. each of them is asked to load the revision in place, all at once;
3. each lists the name with the new revision's content-addressed path, and answers a one-token completion under it
   (the smoke check, per replica);
4. if any replica refused, failed or did not answer in step 2 or 3, every replica that had changed is put back to
   what it served before (the old revision in place, or the name unloaded), and the load fails with an error that
   names the replica and its answer. The flows' transaction then moves the alias back (flows/promotion.py).

Each replica names itself in an `x-mint-replica` header (its seal adds it), so an answer says which replica gave it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from mint_core.serving.protocol import APIError

logger = logging.getLogger(__name__)
T = TypeVar("T")
REPLICA_HEADER = "x-mint-replica"
_HEX = re.compile(r"^[0-9a-f]{64}$")
# vLLM's scheduler gauges, per replica: what "load" means in `mint status` and the front's metrics
_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
_WAITING = re.compile(r"^vllm:num_requests_waiting(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


ROUTE_HEADER = "x-mint-route"
"""The served name a request is routed on, set by the front (`Replicas.headers`); it never leaves the front."""
RECHECK_S = 1.0  # a replica found down is asked GET /health again at most this often, as requests come
# A replica that refused the connection, or closed it without an answer (killed, crashed; a pooled connection to a
# dead process): the request is sent to the next replica. What the front routes is inference, which changes no
# state on a replica, so one that may have started there costs only its compute when sent again.
UNANSWERED = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


def rendezvous(key: str, names: list[str]) -> list[str]:
    """`names` in rendezvous (HRW) order for `key`: the first is the replica `key` goes to; with it gone, the
    second, and so on. Each name's place depends on `key` and that name only, so removing a replica moves only the
    keys it was first for, and adding one takes only the keys it now comes first for."""

    def weight(name: str) -> bytes:
        return hashlib.blake2b(f"{name}\x00{key}".encode(), digest_size=8).digest()

    return sorted(names, key=weight, reverse=True)


async def load_lora(
    post: Callable[[str, dict[str, Any]], Awaitable[T]],
    ok: Callable[[T], bool],
    name: str,
    path: Path,
    inplace: bool,
) -> tuple[T, str]:
    """`path` under `name` on one vLLM through `post(route, body)`, in place when `inplace`: the answer of the
    last step taken, and that step ("load", "unload" or "reload"; the first not `ok` ends it). vLLM 0.32 keeps
    `load_inplace` on the request it stores for the name and so reads the adapter from disk again at every engine
    step of every request under it (vllm-project/vllm#33791; benchmarks/replicas.py counted one disk load per
    generated token). After an in-place load, vLLM has read and checked the new files: the name is unloaded and
    loaded again from the same path without the flag. Nothing runs under the name meanwhile (the swap lock)."""
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}
    answer = await post("/v1/load_lora_adapter", body)
    if not ok(answer) or not inplace:
        return answer, "load"
    answer = await post("/v1/unload_lora_adapter", {"lora_name": name})
    if not ok(answer):
        return answer, "unload"
    return await post("/v1/load_lora_adapter", {**body, "load_inplace": False}), "reload"


def replica_name(url: str) -> str:
    """`host:port` of a replica's URL: the name its seal puts in `x-mint-replica` (VLLMConfig.address)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def digest_of_path(root: str | None) -> str | None:
    """The digest of a content-addressed store directory (the only paths the front hands vLLM)."""
    if not root:
        return None
    p = Path(root)
    return p.name if _HEX.match(p.name) and p.parent.name == p.name[:2] else None


@dataclass
class Replica:
    url: str
    http: httpx.AsyncClient
    """At `url` with mint's full key: loads, unloads, reads, the golden probe."""
    routed: httpx.AsyncClient
    """At `url` with the routed key: the requests the front routes to it."""
    served: dict[str, str] = field(default_factory=dict)
    """Adapter name -> hex digest, as last read off this replica or loaded on it."""
    healthy: bool = True
    """False from a request or read that could not reach it until it answers again (`Fleet.check`)."""
    running: float | None = None
    waiting: float | None = None
    checked: float = 0.0
    sent: int = 0
    """Requests the front routed to it and passed its answer on (since the front started)."""

    @property
    def name(self) -> str:
        return replica_name(self.url)


class ReplicaRefused(APIError):
    """A load that one replica refused or failed; every replica is back on what it served before."""


class Fleet:
    """The replicas behind one front: requests routed over them (`route`), loads made on each, all or nothing."""

    def __init__(
        self,
        urls: list[str],
        key: str,
        registry: CollectorRegistry,
        connect: Callable[[str, str], httpx.AsyncClient],
        routed_key: str,
        hidden: str = "",
        smoke_prompt: str = "a",
    ):
        """`connect(url, key)`: a client of the vLLM at `url` with `key`."""
        self.hidden = hidden  # a name the front serves the base under: not listed as a revision
        labels = ["replica"]
        self.up = Gauge(
            "mint_replica_healthy", "1 while the replica answers /health", labels, registry=registry
        )
        self.adapters = Gauge(
            "mint_replica_adapters", "Adapter revisions the replica holds", labels, registry=registry
        )
        self.running = Gauge(
            "mint_replica_requests_running", "Requests the replica is running", labels, registry=registry
        )
        self.waiting = Gauge(
            "mint_replica_requests_waiting", "Requests waiting on the replica", labels, registry=registry
        )
        self.routed = Counter(
            "mint_replica_routed",
            "Requests the front routed to the replica and answered from it",
            labels,
            registry=registry,
        )
        self.replicas = [
            Replica(u.rstrip("/"), connect(u.rstrip("/"), key), connect(u.rstrip("/"), routed_key))
            for u in urls
        ]
        self.by_name = {r.name: r for r in self.replicas}
        self.names = [r.name for r in self.replicas]
        self.smoke_prompt = smoke_prompt
        self._checks: set[asyncio.Task[bool]] = set()

    async def close(self) -> None:
        for task in list(self._checks):
            task.cancel()
        for r in self.replicas:
            await r.http.aclose()
            await r.routed.aclose()

    # -- routing --------------------------------------------------------------------------------------------

    def order(self, key: str, out: Callable[[str], bool]) -> list[Replica]:
        """The replicas a request routed on `key` may go to, first choice first: rendezvous order, less those
        out of rotation (`out`) and those down. A replica down is asked /health again in the background (at most
        every RECHECK_S), so it is routed to again soon after it is back."""
        now = time.monotonic()
        usable = []
        for name in rendezvous(key, self.names):
            r = self.by_name[name]
            if out(name):
                continue
            if r.healthy:
                usable.append(r)
            elif now - r.checked >= RECHECK_S and not any(t.get_name() == name for t in self._checks):
                r.checked = now
                task = asyncio.ensure_future(self.check(r))
                task.set_name(name)
                self._checks.add(task)  # held until done: the loop keeps only weak references to tasks
                task.add_done_callback(self._checks.discard)
        return usable

    def down(self, r: Replica, e: Exception) -> None:
        """`r` could not be reached: passed over until it answers /health again."""
        if r.healthy:
            logger.warning("replica %s is down (%s): routing around it until it answers /health", r.name, e)
        r.healthy, r.checked = False, time.monotonic()

    async def route(
        self, key: str, send: Callable[[Replica], Awaitable[httpx.Response]], out: Callable[[str], bool]
    ) -> httpx.Response:
        """`send(replica)` to the first replica in `key`'s order that takes it: the next when a replica refuses
        the connection or closes it without an answer (UNANSWERED), or is taken out of rotation while the request
        ran there (its answer is not passed on, whatever it was: it may be garbage). A timeout is raised. 503 when
        no replica is left to try."""
        tried: list[str] = []
        for r in self.order(key, out):
            tried.append(r.name)
            try:
                resp = await send(r)
            except UNANSWERED as e:
                self.down(r, e)
                continue
            except httpx.TransportError as e:
                self.down(r, e)
                if out(r.name):  # its answer would have been dropped: the request is sent again
                    continue
                raise
            if out(r.name):
                await resp.aclose()
                logger.warning("an answer from %s, out of rotation, dropped; sending again", r.name)
                continue
            r.sent += 1
            self.routed.labels(r.name).inc()
            return resp
        why = f"tried {', '.join(tried)}" if tried else "none is up and in rotation"
        raise APIError(503, f"no vLLM replica could take the request ({why})", "ServiceUnavailableError")

    # -- what each replica serves ---------------------------------------------------------------------------

    async def check(self, r: Replica) -> bool:
        """Whether `r` answers /health now (routed to again when it does)."""
        try:
            healthy = (await r.http.get("/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            self.back(r)
        r.healthy, r.checked = healthy, time.monotonic()
        return r.healthy

    def back(self, r: Replica) -> None:
        """`r` answered: routed to again if it was down."""
        if not r.healthy:
            logger.warning("replica %s answers again: routed to", r.name)
        r.healthy = True

    async def read(self, r: Replica) -> None:
        """What `r` serves now (nothing when it does not answer)."""
        try:
            resp = await r.http.get("/v1/models", timeout=10)
        except httpx.HTTPError as e:
            self.down(r, e)
            return
        if resp.status_code != 200:
            r.healthy, r.checked = False, time.monotonic()
            return
        self.back(r)
        r.served = {
            c["id"]: d
            for c in resp.json().get("data", [])
            if c.get("parent") and (d := digest_of_path(c.get("root"))) is not None
        }

    async def refresh(self) -> dict[str, str]:
        """Read every replica; the names the healthy ones serve (name -> digest; where two replicas disagree,
        which happens only while one is being put back, the first replica's)."""
        await asyncio.gather(*(self.read(r) for r in self.replicas))
        out: dict[str, str] = {}
        for r in self.replicas:
            if r.healthy:
                for n, d in r.served.items():
                    out.setdefault(n, d)
        return out

    async def models(self) -> list[dict[str, Any]]:
        """vLLM's model cards from every replica that answers (a name any of them holds), not from one routed to:
        one replica may be down or hold less."""

        async def one(r: Replica) -> list[dict[str, Any]] | None:
            try:
                resp = await r.http.get("/v1/models", timeout=10)
            except httpx.HTTPError:
                return None
            return list(resp.json().get("data", [])) if resp.status_code == 200 else None

        listed = await asyncio.gather(*(one(r) for r in self.replicas))
        if all(cards is None for cards in listed):
            raise APIError(503, "no vLLM replica answers /v1/models", "ServiceUnavailableError")
        out: dict[str, dict[str, Any]] = {}
        for cards in listed:
            for c in cards or []:
                out.setdefault(str(c.get("id")), c)
        return list(out.values())

    async def read_load(self, r: Replica) -> None:
        """vLLM's running and waiting requests on `r`, from its /metrics."""
        try:
            resp = await r.http.get("/metrics", timeout=5)
        except httpx.HTTPError:
            r.running = r.waiting = None
            return
        text = resp.text if resp.status_code == 200 else ""
        r.running = sum(float(x) for x in _RUNNING.findall(text)) if _RUNNING.search(text) else None
        r.waiting = sum(float(x) for x in _WAITING.findall(text)) if _WAITING.search(text) else None

    async def report(self) -> list[dict[str, Any]]:
        """Each replica: its address, health, the revisions it holds, its load and its share of the requests the
        front routed (for `mint status`); the front's replica gauges are set from it."""
        await asyncio.gather(*(self.read(r) for r in self.replicas))
        await asyncio.gather(*(self.read_load(r) for r in self.replicas if r.healthy))
        total = sum(r.sent for r in self.replicas)
        out = []
        for r in self.replicas:
            held = (
                {n: f"sha256:{d}" for n, d in sorted(r.served.items()) if n != self.hidden}
                if r.healthy
                else {}
            )
            self.up.labels(r.name).set(1 if r.healthy else 0)
            self.adapters.labels(r.name).set(len(held))
            self.running.labels(r.name).set(r.running or 0 if r.healthy else 0)
            self.waiting.labels(r.name).set(r.waiting or 0 if r.healthy else 0)
            out.append(
                {
                    "replica": r.name,
                    "url": r.url,
                    "healthy": r.healthy,
                    "revisions": held,
                    "running": r.running if r.healthy else None,
                    "waiting": r.waiting if r.healthy else None,
                    "requests": r.sent,
                    "share": round(r.sent / total, 4) if total else None,
                }
            )
        return out

    def digest(self, replica: str | None, name: str) -> str | None:
        """The digest `replica` (its `x-mint-replica`) serves under `name`, as last read or loaded."""
        r = self.by_name.get(replica or "")
        return r.served.get(name) if r is not None else None

    # -- all or nothing ---------------------------------------------------------------------------------------

    async def _post(self, r: Replica, path: str, body: dict[str, Any]) -> tuple[int, str]:
        try:
            resp = await r.http.post(path, json=body)
        except httpx.HTTPError as e:
            return 503, f"unreachable: {e}"
        if resp.status_code == 200:
            return 200, ""
        try:
            message = str(resp.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = resp.text[:300]
        return resp.status_code, message

    async def _load(self, r: Replica, name: str, path: Path, inplace: bool) -> tuple[int, str]:
        """`path` under `name` on `r`, in place where `r` holds the name (`load_lora`)."""

        async def post(route: str, body: dict[str, Any]) -> tuple[int, str]:
            return await self._post(r, route, body)

        (status, message), step = await load_lora(post, lambda a: a[0] == 200, name, path, inplace)
        return status, f"unload after the in-place load: {message}" if step == "unload" else message

    async def _smoke(self, r: Replica, name: str, digest: str) -> tuple[int, str]:
        """`r` lists `name` as `digest` and answers a one-token completion under it."""
        await self.read(r)
        if r.served.get(name) != digest:
            got = r.served.get(name)
            return 409, f"lists {name!r} as {'sha256:' + got if got else 'nothing'} after the load"
        body = {"model": name, "prompt": self.smoke_prompt, "max_tokens": 1, "temperature": 0.0}
        return await self._post(r, "/v1/completions", body)

    async def load(self, name: str, digest: str, path: Path, dir_of: Callable[[str], Path]) -> list[str]:
        """Load revision `digest` (its verified directory `path`) under `name` on every healthy replica and
        smoke-check it there, or on none: ReplicaRefused names the first replica that refused or failed, once
        every replica is back on what it served before. `dir_of(digest)`: a revision's directory in the store.
        Returns the replicas that now serve it."""
        await asyncio.gather(*(self.read(r) for r in self.replicas))
        live = [r for r in self.replicas if r.healthy]
        if not live:
            raise APIError(503, "no vLLM replica is healthy", "ServiceUnavailableError")
        before = {r.name: r.served.get(name) for r in live}
        loaded = await asyncio.gather(*(self._load(r, name, path, before[r.name] is not None) for r in live))
        failed = [(r, s, m) for r, (s, m) in zip(live, loaded, strict=True) if s != 200]
        if not failed:
            smoked = await asyncio.gather(*(self._smoke(r, name, digest) for r in live))
            failed = [(r, s, f"smoke check: {m}") for r, (s, m) in zip(live, smoked, strict=True) if s != 200]
        if failed:
            await self._put_back(live, name, before, dir_of)
            r, status, message = failed[0]
            was = before[r.name]
            others = "; ".join(f"{x.name}: {s} {m}" for x, s, m in failed[1:])
            raise ReplicaRefused(
                status if 400 <= status < 600 else 500,
                f"replica {r.name} failed the load of {name!r} (sha256:{digest[:12]}): {status} {message}"
                + (f"; also {others}" if others else "")
                + f". Every replica is back on {'sha256:' + was[:12] if was else 'nothing'} for {name!r}",
                "ReplicaLoadFailed",
                "lora_path",
            )
        for r in live:
            r.served[name] = digest
        return [r.name for r in live]

    async def _put_back(
        self, live: list[Replica], name: str, before: dict[str, str | None], dir_of: Callable[[str], Path]
    ) -> None:
        async def one(r: Replica) -> None:
            was = before[r.name]
            if was is None:
                status, message = await self._post(r, "/v1/unload_lora_adapter", {"lora_name": name})
                ok = status in (200, 404)  # 404: it never took the new one
            else:
                status, message = await self._load(r, name, dir_of(was), inplace=True)
                ok = status == 200
            if not ok:  # the replica is left as it is; the next reconcile or restart brings it back in line
                logger.error("replica %s: could not put %r back: %s %s", r.name, name, status, message)
            await self.read(r)

        await asyncio.gather(*(one(r) for r in live))
        logger.warning("put %r back on %d replica(s) after a failed load", name, len(live))

    async def unload(self, name: str) -> tuple[int, str]:
        """Unload `name` from every replica; 404 only when no replica held it."""
        results = await asyncio.gather(
            *(self._post(r, "/v1/unload_lora_adapter", {"lora_name": name}) for r in self.replicas)
        )
        for r in self.replicas:
            r.served.pop(name, None)
        if any(s == 200 for s, _ in results):
            return 200, ""
        bad = [(r, s, m) for r, (s, m) in zip(self.replicas, results, strict=True) if s not in (200, 404)]
        if bad:
            r, s, m = bad[0]
            return s, f"replica {r.name}: {m}"
        return 404, f"The lora adapter '{name}' cannot be found."
