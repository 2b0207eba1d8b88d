"""The golden probe: the front notices a poisoned vLLM replica and takes it out of rotation (detection; what is done
to the replica then, kill and restart, is serving/replica_control.py's).

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
  why, and /health answers 503, until it is back. A replica of a fleet: the front routes nothing more to it, and an
  answer from it to a request already under way is not passed on: the front sends the request to the next replica
  (`Fleet.route`); the other replicas go on serving, and the front answers 503 only when every replica is out;
- the event is logged at ERROR with the evidence (the replica, each prompt, the answer recorded, the answer got);
- replica control kills its process (the one listening at its URL), and its supervisor (`mint_app.services.supervise`, as `mint up`
  runs vLLM) starts a fresh one; the front asks it the golden prompts alone, with mint's key, once it answers
  /health, and puts it back into rotation when every answer is the recorded one (killing it again otherwise, at
  most MAX_KILLS times); the front routes to it again from then on.

A replica is asked directly at its own URL with mint's full key (as fleet loads are).

Greedy decoding on one replica is deterministic for a request that runs alone, so a recorded answer changes only
when the weights in use change. Costs: one request of len(prompts) sequences per probe, name and replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from prometheus_client import Counter, Gauge

from mint_core.serving.fleet import replica_name
from mint_core.serving.protocol import APIError
from mint_core.serving.replica_control import Drain, Event, Mismatch, Restart

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from mint_core.serving.swap_lock import SwapLock

logger = logging.getLogger(__name__)


@dataclass
class Golden:
    """The recorded greedy answers of one served name (under one revision)."""

    name: str  # the name vLLM is asked under
    label: str  # how the evidence names it
    digest: str
    answers: list[str]


class Front(Protocol):
    """What the probe uses of the front of a vLLM server (`front.state.Gateway` is one; the probe names what it
    uses rather than importing the gateway that holds it)."""

    registry: CollectorRegistry
    batch: SwapLock  # requests read, a probe that must run alone writes
    base_adapter: str
    base_digest: str

    def lock(self, name: str) -> SwapLock: ...

    async def ensure_base(self) -> None: ...


async def _nothing() -> None:
    return None


@dataclass
class Target:
    """One vLLM server the probe asks: the single vLLM behind the front, or one replica of a fleet."""

    url: str
    http: httpx.AsyncClient  # at `url`, with mint's full key
    served: Callable[
        [], dict[str, str]
    ]  # what it serves (adapter name -> hex digest), as last read or loaded
    labels: tuple[str, ...] = ()  # its metric labels: (its name,) in a fleet; one vLLM's series have none
    read: Callable[[], Awaitable[None]] = _nothing  # what it serves, read again before a probe
    prepare: Callable[[], Awaitable[None]] = _nothing  # before a restarted one is asked (one vLLM: the base)
    base: Golden | None = None
    champion: Golden | None = None
    out: str | None = None  # why it is out of rotation, while it is

    @property
    def name(self) -> str:
        return replica_name(self.url)


def _child(metric: Any, labels: tuple[str, ...]) -> Any:
    """The series of `metric` with `labels` (a metric without label names is its own series)."""
    return metric.labels(*labels) if labels else metric


class GoldenProbe:
    """The golden probe of the replicas behind one front (see the module docstring); what happens to a replica
    found poisoned is replica control's (serving/replica_control.py); `drain` runs before a kill."""

    def __init__(
        self,
        gw: Front,
        targets: list[Target],
        drain: Drain,
        prompts: list[str],
        max_tokens: int,
        interval_s: float,
    ):
        self.gw = gw
        self.targets = targets
        self.drain = drain
        self.prompts = list(prompts)
        self.max_tokens = max_tokens
        self.interval_s = interval_s
        self.champion_name: str | None = None  # the policy whose answers are (to be) recorded
        self.events: list[Event] = []
        self._probing = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        per = ["replica"] if any(t.labels for t in targets) else []  # one vLLM: the series as before fleets
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
        _child(self.in_rotation, t.labels).set(1 if on else 0)

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
        if why is None:
            return
        if len(self.targets) == 1:
            t = self.targets[0]
            where, why = f"the vLLM replica at {t.url}", str(t.out)
        else:
            where = "every vLLM replica"
        raise APIError(
            503,
            f"{where} is out of rotation: {why}; its supervisor is restarting it",
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
                _child(self.recorded, ("base", *t.labels)).set(len(got))
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
                    self.recorded.remove(t.champion.label, *t.labels)
                t.champion = Golden(name, f"champion {name}", digest, got)
                _child(self.recorded, (t.champion.label, *t.labels)).set(len(got))
                logger.info(
                    "golden probe: %s's answers on %s recorded (sha256:%s): %s",
                    name,
                    t.name,
                    digest[:12],
                    got,
                )

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
            await asyncio.gather(*(t.read() for t in self.targets))
            # a replica out of rotation is its restart's business (`_restart` admits it back), not the probe's
            asked = [t for t in self.targets if t.out is None]
            results = [await self._probe(t, reason) for t in asked]
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

    # -- out of rotation, restart, back ---------------------------------------------------------------------------

    async def _poisoned(self, t: Target, found: list[Mismatch], reason: str) -> None:
        t.out = "its golden answers changed (" + "; ".join(map(str, found))[:400] + ")"
        self._rotation(t, False)
        self.probes.labels("fail").inc()
        event = Event(time.time(), reason, found, replica=t.name)
        self.events.append(event)
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

    async def _restart(self, t: Target, event: Event) -> None:
        assert t.base is not None  # found poisoned: its base's answers were recorded and compared
        base = self.gw.base_adapter

        async def ask() -> list[str] | None:
            await t.prepare()  # one vLLM, fresh, serves nothing: its listing is read again first
            return await self.answers(t, base, alone=True)

        restart = Restart(t.url, t.name, t.http, ask, t.base.answers, self.drain)
        if not await restart.run(event, self.gw.batch):
            return
        t.out = None
        self._rotation(t, True)
        logger.warning(
            "golden probe: the vLLM replica at %s is back in rotation %.1f s after it was found poisoned; its "
            "golden answers are the recorded ones",
            t.url,
            (event.back or time.time()) - event.detected,
        )
