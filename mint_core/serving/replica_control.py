"""Replica control: what the golden probe (serving/golden.py) does to a replica it found poisoned.

It finds the process listening at the replica's URL and kills it (SIGKILL: its answers are garbage), waits for its
supervisor (`mint_app.services.supervise`, as `mint up` runs vLLM) to start a fresh one, asks that one the golden prompts and
puts it back when its answers are the recorded ones (killing it again otherwise, at most MAX_KILLS times). With a
fleet, membership in vllm-router's workers goes with it (`Router`): a replica found poisoned is removed at once,
added again once its answers hold, and one the router is not sending to is admitted; one vLLM has no router
(`Alone`), so the same steps leave nothing to tell.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import httpx
import psutil

from mint_core.serving.protocol import APIError

if TYPE_CHECKING:
    from mint_core.serving.swap_lock import SwapLock

logger = logging.getLogger(__name__)
MAX_KILLS = (
    3  # restarts in a row that still answer differently: then the replica stays out and an operator looks
)
RESTART_TIMEOUT_S = 900.0  # vLLM loads and profiles the base after a restart (30-100 s on 2 CPU cores)
POLL_S = 1.0  # how often a restarting replica is looked at


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


class Member(Protocol):
    """A replica as its membership in the router sees it."""

    url: str
    down: bool  # it refused a connection: the router must be told again once it is back

    @property
    def name(self) -> str: ...


class Membership(Protocol):
    """Who routes requests to the replicas: vllm-router (`Router`), or nobody (`Alone`: one vLLM)."""

    async def remove(self, url: str) -> bool | None:
        """Stop routing to `url`; None when there is nothing to stop."""
        ...

    async def add(self, url: str) -> bool:
        """Route to `url` again; True when it is routed to."""
        ...

    async def admit(self, passed: list[Member]) -> None:
        """Replicas whose answers held, routed to again where they are not."""
        ...

    async def drain(self, batch: SwapLock) -> None:
        """Before a kill: the requests under way end first where the others can take new ones."""
        ...


class Alone:
    """One vLLM behind the front: no router to tell; a kill need not wait (every request fails over to 503)."""

    async def remove(self, url: str) -> bool | None:
        return None

    async def add(self, url: str) -> bool:
        return True

    async def admit(self, passed: list[Member]) -> None:
        return None

    async def drain(self, batch: SwapLock) -> None:
        return None


class Router:
    """vllm-router's worker routes, asked through `http` (the router's address)."""

    def __init__(self, http: httpx.AsyncClient):
        self.http = http

    async def _worker(self, path: str, url: str) -> bool:
        """vllm-router's worker route `path` (`/remove_worker`, `/add_worker`) for `url`: True when it answered 200,
        or, for an add, that the worker is there already (vllm-router 0.1.17: 400 "... already exists")."""
        try:
            r = await self.http.post(path, params={"url": url}, timeout=30)
        except httpx.HTTPError as e:
            logger.error("golden probe: vllm-router did not answer %s for %s: %s", path, url, e)
            return False
        if path == "/add_worker" and r.status_code == 400 and "already exists" in r.text:
            return True
        if r.status_code != 200:
            logger.warning(
                "golden probe: vllm-router answered %s for %s with %d: %s",
                path,
                url,
                r.status_code,
                r.text[:200],
            )
        return r.status_code == 200

    async def remove(self, url: str) -> bool | None:
        return await self._worker("/remove_worker", url)

    async def add(self, url: str) -> bool:
        return await self._worker("/add_worker", url)

    async def admit(self, passed: list[Member]) -> None:
        """A replica found refusing connections (killed, crashed; its supervisor restarted it) is removed and added
        again, which clears the router's circuit breaker at once (vllm-router 0.1.17 keeps a restarted worker's
        breaker open for a minute or two, sending it nothing); one missing from the router's workers (a front
        restarted while it was out) is added."""
        try:
            r = await self.http.get("/list_workers", timeout=10)
            workers = {u.rstrip("/") for u in r.json().get("urls", [])}
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        for t in passed:
            if t.down or t.url not in workers:
                if t.url in workers:  # a restart: the router's circuit breaker for it is still open
                    await self.remove(t.url)
                if await self.add(t.url):
                    logger.warning(
                        "golden probe: %s answers as recorded after %s: the router sends to it again",
                        t.name,
                        "a restart" if t.down else "it was missing from the router's workers",
                    )
                    t.down = False

    async def drain(self, batch: SwapLock) -> None:
        # none is routed to it now, and one it answers is sent again (fleet.routed); a kill would fail them
        await batch.acquire_write()
        await batch.release_write()


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


def kill(url: str, event: Event) -> int | None:
    """SIGKILL the process listening at `url`, noted in `event`; its pid, or None when none is found."""
    pid = listening_pid(url)
    if pid is None:
        event.notes.append(f"no process found listening at {url}")
        logger.error(
            "golden probe: no process of this user listens at %s: restart vLLM by hand; the replica stays "
            "out of rotation until its golden answers hold again",
            url,
        )
        return None
    with contextlib.suppress(ProcessLookupError):
        # SIGKILL: its answers are garbage, nothing in flight is worth a graceful end; its supervisor
        # (a subreaper) also ends the engine processes it leaves behind, then starts a fresh vLLM
        os.kill(pid, signal.SIGKILL)
    event.kills += 1
    event.killed_pid = pid
    logger.warning("golden probe: killed vLLM at %s (pid %d); its supervisor starts a fresh one", url, pid)
    return pid


@dataclass
class Restart:
    """The restart of one poisoned replica, until its answers are the recorded ones again."""

    url: str
    name: str
    http: httpx.AsyncClient  # at `url`, with mint's full key
    ask: Callable[[], Awaitable[list[str] | None]]  # its greedy answers to the golden prompts, asked alone
    expected: list[str]  # the base's recorded answers
    membership: Membership

    async def run(self, event: Event, batch: SwapLock) -> bool:
        """Kill the replica, wait for a fresh one, and True once its answers hold and it is routed to again;
        False when it stays out (MAX_KILLS restarts that still answer differently, or RESTART_TIMEOUT_S)."""
        await self.membership.drain(batch)
        killed = kill(self.url, event)
        t0 = time.monotonic()
        reported: set[type[BaseException]] = set()
        while time.monotonic() - t0 < RESTART_TIMEOUT_S:
            await asyncio.sleep(POLL_S)
            if killed is not None and listening_pid(self.url) in (None, killed):
                continue  # the killed process still holds the port, or none listens yet
            try:
                got = await self._answers()
            except (httpx.HTTPError, APIError, ValueError) as e:  # restarting: refused, 503, half an answer
                logger.debug("golden probe: replica %s not back yet: %s", self.name, e)
                continue
            except Exception as e:  # not a restart's: a bug worth its traceback, once per kind; still waiting
                if type(e) not in reported:
                    reported.add(type(e))
                    logger.exception("golden probe: asking the restarted replica %s failed", self.name)
                continue
            if got is None:
                continue
            if got == self.expected:
                if not await self.membership.add(self.url):
                    continue
                event.back, event.clean = time.time(), True
                return True
            event.clean = False
            logger.error(
                "golden probe: the restarted replica %s still answers %r, not %r",
                self.name,
                got,
                self.expected,
            )
            if event.kills >= MAX_KILLS:
                logger.error(
                    "golden probe: %d restarts did not bring back the recorded answers: the replica stays out "
                    "of rotation",
                    event.kills,
                )
                return False
            killed = kill(self.url, event)
        logger.error(
            "golden probe: the replica %s did not come back within %.0f s", self.name, RESTART_TIMEOUT_S
        )
        return False

    async def _answers(self) -> list[str] | None:
        """None until the fresh replica answers /health; then its answers."""
        r = await self.http.get("/health", timeout=5)
        if r.status_code != 200:
            return None
        return await self.ask()
