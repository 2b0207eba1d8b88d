"""The golden probe: the front notices a poisoned vLLM replica, takes it out of rotation and has it restarted.

One NaN adapter inside vLLM poisons every tenant of the server: from the next batch on, the base and every policy
answer garbage, with status 200, until vLLM restarts (benchmarks/vllm_bad_adapters.py). The seal
(vllm_plugin/mint_vllm_seal.py) keeps anyone without mint's key from loading one, and the front validates all it
loads, but a path that holds the key (a compromised host process, a bug in a future loader) would poison the
server silently. So the front asks each replica, at a steady interval and after every load it makes, for the
greedy answers to a few fixed prompts under the base and under one champion, recorded per replica the first time
each is seen (the base at the first probe, the champion after the first load of a policy through this front; a
later load of that name through the front records its new revision's answers). A probe runs beside other
requests; when an answer differs it runs again alone (no other request in the front's batch, as the answers were
recorded), so a near-tie that batching tipped is not taken for poison. A replica that still answers differently is
poisoned:

- it is taken out of rotation. One vLLM (no fleet): every completion and load through the front answers 503 naming
  why, and /health answers 503, until it is back. A replica of a fleet: it is removed from vllm-router's workers
  (`POST /remove_worker`), so the router stops sending to it at once, and an answer that still names it (a request
  already under way) is not passed on: the front sends the request again (fleet.routed); the other replicas go on
  serving, and the front answers 503 only when every replica is out;
- the event is logged at ERROR with the evidence (the replica, each prompt, the answer recorded, the answer got);
- its process (the one listening at its URL) is killed, and its supervisor (`mint_app.supervise`, as `mint up`
  runs vLLM) starts a fresh one; the front asks it the golden prompts alone, with mint's key, once it answers
  /health, and puts it back into rotation when every answer is the recorded one (a replica: added to the router
  again, `POST /add_worker`; killing it again otherwise, at most MAX_KILLS times).

A replica is asked directly at its own URL with mint's full key (as fleet loads are), never through the router.
The probe also admits a replica the router is not sending to once its answers hold: one it found refusing
connections (killed, crashed; its supervisor restarted it) is removed and added again, which clears the router's
circuit breaker at once (vllm-router 0.1.17 keeps a restarted worker's breaker open for a minute or two, sending
it nothing), and one missing from the router's workers (a front restarted while it was out) is added.

Greedy decoding on one replica is deterministic for a request that runs alone, so a recorded answer changes only
when the weights in use change. Costs: one request of len(prompts) sequences per probe, name and replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import httpx
import psutil
from prometheus_client import Counter, Gauge

from mint_core.serving.fleet import replica_name
from mint_core.serving.protocol import APIError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from mint_core.serving.config import ServingConfig
    from mint_core.serving.fleet import Fleet, Replica
    from mint_core.serving.swap_lock import SwapLock

logger = logging.getLogger(__name__)
MAX_KILLS = (
    3  # restarts in a row that still answer differently: then the replica stays out and an operator looks
)
RESTART_TIMEOUT_S = 900.0  # vLLM loads and profiles the base after a restart (30-100 s on 2 CPU cores)


@dataclass
class Golden:
    """The recorded greedy answers of one served name (under one revision)."""

    name: str  # the name vLLM is asked under
    label: str  # how the evidence names it
    digest: str
    answers: list[str]


@dataclass
class Mismatch:
    label: str
    prompt: str
    expected: str
    got: str

    def __str__(self) -> str:
        return f"{self.label}: {self.prompt!r} expected {self.expected!r}, got {self.got!r}"


@dataclass
class Event:
    """One poisoning as the front saw it (times in epoch s)."""

    detected: float
    reason: str
    evidence: list[Mismatch]
    killed_pid: int | None = None
    back: float | None = None
    kills: int = 0
    clean: bool | None = None
    notes: list[str] = field(default_factory=list)
    replica: str = ""  # host:port of the replica found poisoned


def listening_pid(url: str) -> int | None:
    """The process that listens on `url`'s port on this host (vLLM's API server), if this user may see it. A
    child that inherited the socket (an engine process) is passed over for the parent that opened it."""
    port = urlsplit(url).port
    try:
        pids = {
            int(c.pid)
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        }
        for pid in sorted(pids):
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).ppid() not in pids:
                    return pid
    except psutil.Error:
        return None
    return min(pids) if pids else None


class Front(Protocol):
    """What the probe uses of the front of a vLLM server (`gateway.Gateway` is one; the probe names what it uses
    rather than importing the gateway that holds it)."""

    config: ServingConfig
    registry: CollectorRegistry
    vllm: httpx.AsyncClient  # the single vLLM with mint's key; with a fleet, the router
    fleet: Fleet | None
    batch: SwapLock  # requests read, a probe that must run alone writes
    served: dict[str, str]  # adapter name -> hex digest vLLM serves under it
    base_adapter: str
    base_digest: str

    def lock(self, name: str) -> SwapLock: ...

    async def ensure_base(self) -> None: ...


@dataclass
class Target:
    """One vLLM server the probe asks: the single vLLM behind the front, or one replica of a fleet."""

    url: str
    http: httpx.AsyncClient  # at `url`, with mint's full key
    served: Callable[
        [], dict[str, str]
    ]  # what it serves (adapter name -> hex digest), as last read or loaded
    base: Golden | None = None
    champion: Golden | None = None
    out: str | None = None  # why it is out of rotation, while it is
    down: bool = False  # it refused a connection: the router must be told again once it is back

    @property
    def name(self) -> str:
        return replica_name(self.url)


def _served_by(r: Replica) -> Callable[[], dict[str, str]]:
    return lambda: r.served  # read when asked: a read of the replica replaces the dict


class GoldenProbe:
    """The golden probe of the replicas behind one front (see the module docstring)."""

    def __init__(self, gw: Front, prompts: list[str], max_tokens: int, interval_s: float):
        self.gw = gw
        self.prompts = list(prompts)
        self.max_tokens = max_tokens
        self.interval_s = interval_s
        fleet = gw.fleet
        self.targets = (
            [Target(r.url, r.http, _served_by(r)) for r in fleet.replicas]
            if fleet is not None
            else [Target(gw.config.vllm_url.rstrip("/"), gw.vllm, lambda: gw.served)]
        )
        self.champion_name: str | None = None  # the policy whose answers are (to be) recorded
        self.events: list[Event] = []
        self._probing = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        per = ["replica"] if fleet is not None else []  # one vLLM: the series as before fleets
        self.in_rotation = Gauge(
            "mint_replica_in_rotation",
            "1 while the vLLM replica is in rotation; 0 while it is out (its golden answers changed)",
            per,
            registry=gw.registry,
        )
        self.recorded = Gauge(
            "mint_golden_recorded",
            "Golden answers recorded, by what they are of (base, champion <name>)",
            ["of", *per],
            registry=gw.registry,
        )
        self.probes = Counter(
            "mint_golden_probes",
            "Golden probes of the vLLM replicas, by outcome (pass, fail, skipped)",
            ["outcome"],
            registry=gw.registry,
        )
        for t in self.targets:
            self._rotation(t, True)

    @property
    def on(self) -> bool:
        return self.interval_s > 0

    @property
    def out_of_rotation(self) -> str | None:
        """Why the front cannot serve (every replica is out), else None."""
        if all(t.out is not None for t in self.targets):
            return "; ".join(f"{t.name}: {t.out}" for t in self.targets)
        return None

    def out(self, replica: str | None) -> bool:
        """Whether the replica named `replica` (its `x-mint-replica`) is out of rotation."""
        return any(t.out is not None and t.name == replica for t in self.targets)

    def state(self, replica: str) -> dict[str, Any]:
        """For the front's replica report: why `replica` is out of rotation (None while it is in), and the last
        time the probe found it poisoned (epoch seconds found and back, the evidence), if ever."""
        last = next((e for e in reversed(self.events) if e.replica == replica), None)
        return {
            "out_of_rotation": next((t.out for t in self.targets if t.name == replica), None),
            "last_poisoned": None
            if last is None
            else {
                "detected": last.detected,
                "back": last.back,
                "clean": last.clean,
                "kills": last.kills,
                "evidence": [str(m) for m in last.evidence],
            },
        }

    def _rotation(self, t: Target, on: bool) -> None:
        (self.in_rotation.labels(t.name) if self.gw.fleet is not None else self.in_rotation).set(
            1 if on else 0
        )

    def _recorded(self, t: Target, label: str) -> Any:
        return (
            self.recorded.labels(label, t.name) if self.gw.fleet is not None else self.recorded.labels(label)
        )

    # -- scheduling ---------------------------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def run(self) -> None:
        """Probe every interval_s until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe(f"every {self.interval_s:g} s")
            except Exception:  # an answer of an unexpected shape must not end the probing for good
                logger.exception("golden probe failed")

    def after_load(self, name: str, delay_s: float = 0.0) -> None:
        """A load through the front (or, with `delay_s`, one vLLM makes on the resolver's answer) ended: probe.
        The first policy loaded becomes the champion whose answers are recorded."""
        if not self.on:
            return
        if self.champion_name is None:
            self.champion_name = name

        async def later() -> None:
            await asyncio.sleep(delay_s)
            try:
                await self.probe(f"after the load of {name}")
            except Exception:
                logger.exception("golden probe after the load of %s failed", name)

        self._spawn(later())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def check_rotation(self) -> None:
        """503 while no replica is in rotation (the one vLLM, or every replica of a fleet)."""
        why = self.out_of_rotation
        if why is not None:
            where = "every vLLM replica" if self.gw.fleet is not None else "the vLLM replica at"
            what = "" if self.gw.fleet is not None else f" {self.gw.config.vllm_url}"
            raise APIError(
                503,
                f"{where}{what} is out of rotation: "
                f"{why if self.gw.fleet is not None else self.targets[0].out}; its supervisor is restarting it",
                "ServiceUnavailableError",
            )

    # -- the probe ------------------------------------------------------------------------------------------------

    async def answers(self, t: Target, name: str, alone: bool) -> list[str] | None:
        """The replica's greedy answers to the prompts under `name` (None: it did not answer them with 200)."""
        gw = self.gw
        body = {
            "model": name,
            "prompt": self.prompts,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "seed": 0,
            "ignore_eos": True,
        }
        await (gw.batch.acquire_write() if alone else gw.batch.acquire_read())
        lock = gw.lock(name) if name != gw.base_adapter else None
        try:
            if lock is not None:
                await lock.acquire_read()
            try:
                r = await t.http.post("/v1/completions", json=body)
            except httpx.ConnectError as e:
                t.down = True
                raise APIError(503, f"{t.url} refuses connections: {e}", "ServiceUnavailableError") from None
            except httpx.HTTPError as e:
                raise APIError(503, f"{t.url} is unreachable: {e}", "ServiceUnavailableError") from None
            finally:
                if lock is not None:
                    await lock.release_read()
        finally:
            await (gw.batch.release_write() if alone else gw.batch.release_read())
        if r.status_code != 200:
            logger.warning(
                "golden probe: %s answered %d under %s: %s", t.name, r.status_code, name, r.text[:300]
            )
            return None
        choices = sorted(r.json().get("choices", []), key=lambda c: int(c.get("index", 0)))
        return [str(c.get("text")) for c in choices]

    async def _compare(self, t: Target, alone: bool) -> list[Mismatch] | None:
        """What differs from the answers recorded on `t` (None: nothing could be compared)."""
        out: list[Mismatch] = []
        compared = False
        for g in (t.base, t.champion):
            if g is None or (g is t.champion and t.served().get(g.name) != g.digest):
                continue  # the champion is compared while the replica holds the revision recorded
            got = await self.answers(t, g.name, alone)
            if got is None:
                continue
            compared = True
            out += [
                Mismatch(g.label, p, e, x)
                for p, e, x in zip(self.prompts, g.answers, got, strict=False)
                if e != x
            ]
            if len(got) != len(g.answers):
                out.append(Mismatch(g.label, "(every prompt)", f"{len(g.answers)} answers", f"{len(got)}"))
        return out if compared else None

    async def _record(self, t: Target) -> None:
        """The base's answers at the first probe of `t`; the champion's once `t` serves it (again after a reload
        of it through the front, under its new revision)."""
        gw = self.gw
        if t.base is None:
            got = await self.answers(t, gw.base_adapter, alone=True)
            if got is not None:
                t.base = Golden(gw.base_adapter, "base", gw.base_digest, got)
                self._recorded(t, "base").set(len(got))
                logger.info("golden probe: the base's answers on %s recorded: %s", t.name, got)
                others = {tuple(o.base.answers) for o in self.targets if o.base is not None}
                if len(others) > 1:  # not poison by itself (another card, another kernel): worth a look
                    logger.warning("golden probe: the replicas' recorded base answers differ: %s", others)
        name = self.champion_name
        digest = t.served().get(name) if name else None
        if name and digest and (t.champion is None or t.champion.digest != digest):
            got = await self.answers(t, name, alone=True)
            if got is not None:
                if t.champion is not None:
                    self.recorded.remove(*self._labels(t, t.champion.label))
                t.champion = Golden(name, f"champion {name}", digest, got)
                self._recorded(t, t.champion.label).set(len(got))
                logger.info(
                    "golden probe: %s's answers on %s recorded (sha256:%s): %s",
                    name,
                    t.name,
                    digest[:12],
                    got,
                )

    def _labels(self, t: Target, label: str) -> tuple[str, ...]:
        return (label, t.name) if self.gw.fleet is not None else (label,)

    async def probe(self, reason: str) -> bool | None:
        """True: every answer as recorded on every replica asked; False: a replica is poisoned (out of rotation,
        being restarted); None: nothing compared (off, out of rotation already, vLLM unreachable)."""
        if not self.on:
            return None
        async with self._probing:
            try:
                await self.gw.ensure_base()
            except APIError as e:  # vLLM down or restarting: its supervisor's business
                self.probes.labels("skipped").inc()
                logger.info("golden probe (%s) skipped: %s", reason, e.message)
                return None
            if self.gw.fleet is not None:
                await asyncio.gather(*(self.gw.fleet.read(r) for r in self.gw.fleet.replicas))
            # a replica out of rotation is its restart's business (`_restart` admits it back), not the probe's
            asked = [t for t in self.targets if t.out is None]
            results = [await self._probe(t, reason) for t in asked]
        if self.gw.fleet is not None:
            await self._admit([t for t, ok in zip(asked, results, strict=True) if ok])
        if any(r is False for r in results):
            return False
        return True if any(r is True for r in results) else None

    async def _probe(self, t: Target, reason: str) -> bool | None:
        try:
            found = await self._compare(t, alone=False)
            if found:  # again alone, as recorded: a batch can tip a near-tie
                found = await self._compare(t, alone=True)
            if not found:
                await self._record(t)
        except APIError as e:  # the replica down or restarting: its supervisor's business
            self.probes.labels("skipped").inc()
            logger.info("golden probe (%s) of %s skipped: %s", reason, t.name, e.message)
            return None
        if found:
            await self._poisoned(t, found, reason)
            return False
        self.probes.labels("pass" if found is not None else "skipped").inc()
        return True if found is not None else None

    # -- the router (a fleet) -------------------------------------------------------------------------------------

    async def _router(self, path: str, t: Target) -> bool:
        """vllm-router's worker route `path` (`/remove_worker`, `/add_worker`) for `t`: True when it answered 200,
        or, for an add, that the worker is there already (vllm-router 0.1.17: 400 "... already exists")."""
        try:
            r = await self.gw.vllm.post(path, params={"url": t.url}, timeout=30)
        except httpx.HTTPError as e:
            logger.error("golden probe: vllm-router did not answer %s for %s: %s", path, t.name, e)
            return False
        if path == "/add_worker" and r.status_code == 400 and "already exists" in r.text:
            return True
        if r.status_code != 200:
            logger.warning(
                "golden probe: vllm-router answered %s for %s with %d: %s",
                path,
                t.name,
                r.status_code,
                r.text[:200],
            )
        return r.status_code == 200

    async def _admit(self, passed: list[Target]) -> None:
        """Replicas whose answers held, put (back) before the router where it is not sending to them."""
        try:
            r = await self.gw.vllm.get("/list_workers", timeout=10)
            workers = {u.rstrip("/") for u in r.json().get("urls", [])}
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        for t in passed:
            if t.down or t.url not in workers:
                if t.url in workers:  # a restart: the router's circuit breaker for it is still open
                    await self._router("/remove_worker", t)
                if await self._router("/add_worker", t):
                    logger.warning(
                        "golden probe: %s answers as recorded after %s: the router sends to it again",
                        t.name,
                        "a restart" if t.down else "it was missing from the router's workers",
                    )
                    t.down = False

    # -- out of rotation, restart, back ---------------------------------------------------------------------------

    async def _poisoned(self, t: Target, found: list[Mismatch], reason: str) -> None:
        t.out = "its golden answers changed (" + "; ".join(map(str, found))[:400] + ")"
        self._rotation(t, False)
        self.probes.labels("fail").inc()
        event = Event(time.time(), reason, found, replica=t.name)
        self.events.append(event)
        if self.gw.fleet is not None:  # the router stops sending to it before anything else happens
            removed = await self._router("/remove_worker", t)
            event.notes.append(f"removed from the router: {removed}")
        logger.error(
            "golden probe (%s): the vLLM replica at %s is poisoned: %d answer(s) differ from the recorded ones; "
            "out of rotation, restarting it",
            reason,
            t.url,
            len(found),
        )
        for m in found:
            logger.error(
                "golden evidence: replica=%s %s prompt=%r expected=%r got=%r",
                t.name,
                m.label,
                m.prompt,
                m.expected,
                m.got,
            )
        self._spawn(self._restart(t, event))

    def _kill(self, t: Target, event: Event) -> int | None:
        pid = listening_pid(t.url)
        if pid is None:
            event.notes.append(f"no process found listening at {t.url}")
            logger.error(
                "golden probe: no process of this user listens at %s: restart vLLM by hand; the replica stays "
                "out of rotation until its golden answers hold again",
                t.url,
            )
            return None
        with contextlib.suppress(ProcessLookupError):
            # SIGKILL: its answers are garbage, nothing in flight is worth a graceful end; its supervisor
            # (a subreaper) also ends the engine processes it leaves behind, then starts a fresh vLLM
            os.kill(pid, signal.SIGKILL)
        event.kills += 1
        event.killed_pid = pid
        logger.warning(
            "golden probe: killed vLLM at %s (pid %d); its supervisor starts a fresh one", t.url, pid
        )
        return pid

    async def _restart(self, t: Target, event: Event) -> None:
        gw = self.gw
        if gw.fleet is not None:  # the requests under way end first: none is routed to it now, and one it
            await gw.batch.acquire_write()  # answers is sent again (fleet.routed); a kill would fail them
            await gw.batch.release_write()
        killed = self._kill(t, event)
        t0 = time.monotonic()
        while time.monotonic() - t0 < RESTART_TIMEOUT_S:
            await asyncio.sleep(1.0)
            if killed is not None and listening_pid(t.url) in (None, killed):
                continue  # the killed process still holds the port, or none listens yet
            try:
                r = await t.http.get("/health", timeout=5)
                if r.status_code != 200:
                    continue
                if gw.fleet is None:
                    await gw.ensure_base()  # a fresh vLLM serves nothing: its listing is read again first
                # (a replica of a fleet asks the front for the base's zero adapter on the first request for it)
                assert t.base is not None
                got = await self.answers(t, gw.base_adapter, alone=True)
            except Exception as e:  # restarting: anything may fail for a while
                logger.debug("golden probe: replica %s not back yet: %s", t.name, e)
                continue
            if got is None:
                continue
            if got == t.base.answers:
                if gw.fleet is not None and not await self._router("/add_worker", t):
                    continue
                event.back, event.clean = time.time(), True
                t.out, t.down = None, False
                self._rotation(t, True)
                logger.warning(
                    "golden probe: the vLLM replica at %s is back in rotation %.1f s after it was found "
                    "poisoned; its golden answers are the recorded ones",
                    t.url,
                    event.back - event.detected,
                )
                return
            event.clean = False
            logger.error(
                "golden probe: the restarted replica %s still answers %r, not %r", t.name, got, t.base.answers
            )
            if event.kills >= MAX_KILLS:
                logger.error(
                    "golden probe: %d restarts did not bring back the recorded answers: the replica stays out "
                    "of rotation",
                    event.kills,
                )
                return
            killed = self._kill(t, event)
        logger.error(
            "golden probe: the replica %s did not come back within %.0f s", t.name, RESTART_TIMEOUT_S
        )
