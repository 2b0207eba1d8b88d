"""Replica control: what the golden probe (serving/golden.py) does to a replica it found poisoned.

It finds the process listening at the replica's URL and kills it (SIGKILL: its answers are garbage), waits for its
supervisor (`mint_app.services.supervise`, as `mint up` runs vLLM) to start a fresh one, asks that one the golden prompts and
puts it back when its answers are the recorded ones (killing it again otherwise, at most MAX_KILLS times). The
front stops routing to a replica as soon as it is out of rotation (serving/fleet.py), and routes to it again once it
is back in; before the kill, a fleet lets the requests under way end (`Drain`: the other replicas take new ones,
and an answer from the poisoned one is sent again elsewhere), while one vLLM need not wait (every request fails
over to 503).
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


class Drain(Protocol):
    """What happens before a poisoned replica is killed (`Replicas.drain`, `OneVLLM.drain`)."""

    async def __call__(self, batch: SwapLock) -> None: ...


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
    drain: Drain

    async def run(self, event: Event, batch: SwapLock) -> bool:
        """Kill the replica, wait for a fresh one, and True once its answers hold; False when it stays out
        (MAX_KILLS restarts that still answer differently, or RESTART_TIMEOUT_S)."""
        await self.drain(batch)
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
