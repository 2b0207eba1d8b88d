"""The golden probe: the front notices a poisoned vLLM replica, takes it out of rotation and has it restarted.

One NaN adapter inside vLLM poisons every tenant of the server: from the next batch on, the base and every policy
answer garbage, with status 200, until vLLM restarts (benchmarks/vllm_bad_adapters.py). The seal
(vllm_plugin/mint_vllm_seal.py) keeps anyone without mint's key from loading one, and the front validates all it
loads, but a path that holds the key (a compromised host process, a bug in a future loader) would poison the
server silently. So the front asks the replica, at a steady interval and after every load it makes, for the
greedy answers to a few fixed prompts under the base and under one champion, recorded the first time each is seen
(the base at the first probe, the champion after the first load of a policy through this front; a later load of
that name through the front records its new revision's answers). A probe runs beside other requests; when an answer
differs it runs again alone (no other request in vLLM's batch, as the answers were recorded), so a near-tie that
batching tipped is not taken for poison. A replica that still answers differently is poisoned:

- it is taken out of rotation: every completion and load through the front answers 503 naming why, and /health
  answers 503, until it is back;
- the event is logged at ERROR with the evidence (each prompt, the answer recorded, the answer got);
- its process (the one listening at vllm_url) is killed, and its supervisor (`mint_app.supervise`, as `mint up`
  runs vLLM) starts a fresh one; the front asks it the golden prompts alone once it answers /health, and puts it
  back into rotation when every answer is the recorded one (killing it again otherwise, at most MAX_KILLS times).

Greedy decoding on one replica is deterministic for a request that runs alone, so a recorded answer changes only
when the weights in use change. Costs: one request of len(prompts) sequences per probe and name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import psutil
from prometheus_client import Counter, Gauge

from mint_core.serving.protocol import APIError

if TYPE_CHECKING:
    import httpx
    from prometheus_client import CollectorRegistry

    from mint_core.serving.config import ServingConfig
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
    vllm: httpx.AsyncClient
    batch: SwapLock  # requests read, a probe that must run alone writes
    served: dict[str, str]  # adapter name -> hex digest vLLM serves under it
    base_adapter: str
    base_digest: str

    def lock(self, name: str) -> SwapLock: ...

    async def ensure_base(self) -> None: ...

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response: ...


class GoldenProbe:
    """The golden probe of the replica behind one front (see the module docstring)."""

    def __init__(self, gw: Front, prompts: list[str], max_tokens: int, interval_s: float):
        self.gw = gw
        self.prompts = list(prompts)
        self.max_tokens = max_tokens
        self.interval_s = interval_s
        self.base: Golden | None = None
        self.champion: Golden | None = None
        self.champion_name: str | None = None  # the policy whose answers are (to be) recorded
        self.out_of_rotation: str | None = None  # why, while the replica is out
        self.events: list[Event] = []
        self._probing = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.in_rotation = Gauge(
            "mint_replica_in_rotation",
            "1 while the vLLM replica is in rotation; 0 while it is out (its golden answers changed)",
            registry=gw.registry,
        )
        self.in_rotation.set(1)
        self.recorded = Gauge(
            "mint_golden_recorded",
            "Golden answers recorded, by what they are of (base, champion <name>)",
            ["of"],
            registry=gw.registry,
        )
        self.probes = Counter(
            "mint_golden_probes",
            "Golden probes of the vLLM replica, by outcome (pass, fail, skipped)",
            ["outcome"],
            registry=gw.registry,
        )

    @property
    def on(self) -> bool:
        return self.interval_s > 0

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
        """503 while the replica is out of rotation."""
        if self.out_of_rotation is not None:
            raise APIError(
                503,
                f"the vLLM replica at {self.gw.config.vllm_url} is out of rotation: {self.out_of_rotation}; "
                "its supervisor is restarting it",
                "ServiceUnavailableError",
            )

    # -- the probe ------------------------------------------------------------------------------------------------

    async def answers(self, name: str, alone: bool) -> list[str] | None:
        """vLLM's greedy answers to the prompts under `name` (None: it did not answer them with 200)."""
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
                r = await gw._call("POST", "/v1/completions", json=body)
            finally:
                if lock is not None:
                    await lock.release_read()
        finally:
            await (gw.batch.release_write() if alone else gw.batch.release_read())
        if r.status_code != 200:
            logger.warning("golden probe: vLLM answered %d under %s: %s", r.status_code, name, r.text[:300])
            return None
        choices = sorted(r.json().get("choices", []), key=lambda c: int(c.get("index", 0)))
        return [str(c.get("text")) for c in choices]

    async def _compare(self, alone: bool) -> list[Mismatch] | None:
        """What differs from the recorded answers (None: nothing could be compared)."""
        out: list[Mismatch] = []
        compared = False
        for g in (self.base, self.champion):
            if g is None or (g is self.champion and self.gw.served.get(g.name) != g.digest):
                continue  # the champion is compared while vLLM holds the revision recorded
            got = await self.answers(g.name, alone)
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

    async def _record(self) -> None:
        """The base's answers at the first probe; the champion's once it is served (again after a reload of
        it through the front, under its new revision)."""
        gw = self.gw
        if self.base is None:
            got = await self.answers(gw.base_adapter, alone=True)
            if got is not None:
                self.base = Golden(gw.base_adapter, "base", gw.base_digest, got)
                self.recorded.labels("base").set(len(got))
                logger.info("golden probe: the base's answers recorded: %s", got)
        name = self.champion_name
        digest = gw.served.get(name) if name else None
        if name and digest and (self.champion is None or self.champion.digest != digest):
            got = await self.answers(name, alone=True)
            if got is not None:
                if self.champion is not None:
                    self.recorded.remove(self.champion.label)
                self.champion = Golden(name, f"champion {name}", digest, got)
                self.recorded.labels(self.champion.label).set(len(got))
                logger.info("golden probe: %s's answers recorded (sha256:%s): %s", name, digest[:12], got)

    async def probe(self, reason: str) -> bool | None:
        """True: every answer as recorded; False: the replica is poisoned (out of rotation, being restarted);
        None: nothing compared (off, out of rotation already, vLLM unreachable)."""
        if not self.on or self.out_of_rotation is not None:
            return None
        async with self._probing:
            try:
                await self.gw.ensure_base()
                found = await self._compare(alone=False)
                if found:  # again alone, as recorded: a batch can tip a near-tie
                    found = await self._compare(alone=True)
                if not found:
                    await self._record()
            except APIError as e:  # vLLM down or restarting: its supervisor's business
                self.probes.labels("skipped").inc()
                logger.info("golden probe (%s) skipped: %s", reason, e.message)
                return None
            if found:
                self._poisoned(found, reason)
                return False
            self.probes.labels("pass" if found is not None else "skipped").inc()
            return True if found is not None else None

    # -- out of rotation, restart, back ---------------------------------------------------------------------------

    def _poisoned(self, found: list[Mismatch], reason: str) -> None:
        url = self.gw.config.vllm_url
        self.out_of_rotation = "its golden answers changed (" + "; ".join(map(str, found))[:400] + ")"
        self.in_rotation.set(0)
        self.probes.labels("fail").inc()
        event = Event(time.time(), reason, found)
        self.events.append(event)
        logger.error(
            "golden probe (%s): the vLLM replica at %s is poisoned: %d answer(s) differ from the recorded ones; "
            "out of rotation, restarting it",
            reason,
            url,
            len(found),
        )
        for m in found:
            logger.error(
                "golden evidence: %s prompt=%r expected=%r got=%r", m.label, m.prompt, m.expected, m.got
            )
        self._spawn(self._restart(event))

    def _kill(self, event: Event) -> int | None:
        pid = listening_pid(self.gw.config.vllm_url)
        if pid is None:
            event.notes.append("no process found listening at vllm_url")
            logger.error(
                "golden probe: no process of this user listens at %s: restart vLLM by hand; the replica stays "
                "out of rotation until its golden answers hold again",
                self.gw.config.vllm_url,
            )
            return None
        with contextlib.suppress(ProcessLookupError):
            # SIGKILL: its answers are garbage, nothing in flight is worth a graceful end; its supervisor
            # (a subreaper) also ends the engine processes it leaves behind, then starts a fresh vLLM
            os.kill(pid, signal.SIGKILL)
        event.kills += 1
        event.killed_pid = pid
        logger.warning("golden probe: killed vLLM (pid %d); its supervisor starts a fresh one", pid)
        return pid

    async def _restart(self, event: Event) -> None:
        gw = self.gw
        killed = self._kill(event)
        t0 = time.monotonic()
        while time.monotonic() - t0 < RESTART_TIMEOUT_S:
            await asyncio.sleep(1.0)
            if killed is not None and listening_pid(gw.config.vllm_url) in (None, killed):
                continue  # the killed process still holds the port, or none listens yet
            try:
                r = await gw.vllm.get("/health", timeout=5)
                if r.status_code != 200:
                    continue
                await gw.ensure_base()  # a fresh vLLM serves nothing: its listing is read again first
                assert self.base is not None
                got = await self.answers(gw.base_adapter, alone=True)
            except Exception as e:  # restarting: anything may fail for a while
                logger.debug("golden probe: replica not back yet: %s", e)
                continue
            if got is None:
                continue
            if got == self.base.answers:
                event.back, event.clean = time.time(), True
                self.out_of_rotation = None
                self.in_rotation.set(1)
                logger.warning(
                    "golden probe: the vLLM replica at %s is back in rotation %.1f s after it was found "
                    "poisoned; its golden answers are the recorded ones",
                    gw.config.vllm_url,
                    event.back - event.detected,
                )
                return
            event.clean = False
            logger.error(
                "golden probe: the restarted replica still answers %r, not %r", got, self.base.answers
            )
            if event.kills >= MAX_KILLS:
                logger.error(
                    "golden probe: %d restarts did not bring back the recorded answers: the replica stays out "
                    "of rotation",
                    event.kills,
                )
                return
            killed = self._kill(event)
        logger.error("golden probe: the replica did not come back within %.0f s", RESTART_TIMEOUT_S)
