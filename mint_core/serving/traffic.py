"""A built-in traffic generator: users asking a registered task's prompts of the policies under a canary.

It stands in for live traffic in the demo (`mint run`) and the tests: a thread that keeps `concurrency`
completions in flight against a server, each from one of `users` simulated users (the request's `user`, so one
user stays on one arm of a split), with prompts drawn from the task's held-out rows (its spec's data; a chat
prompt goes to /v1/chat/completions as its messages, a text prompt to /v1/completions) with a seed of its own (repeats
allowed, as in real traffic: `add` has only 10^4 distinct prompts). Which policies it asks: the ones named, or (`follow`)
every policy that has a canary split on the server right now, each with the task of its name.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

from mint_core.data.generators import Example
from mint_core.data.spec import registry

logger = logging.getLogger(__name__)
SEED = 7_000_001
"""Seed of the traffic's prompt streams (apart from the datasets' seeds)."""


@dataclass
class TrafficStats:
    sent: int = 0
    answered: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class Traffic:
    """`with Traffic(url, ...):` sends requests until the block ends; `stats` says how many and how they went."""

    def __init__(
        self,
        url: str,
        policies: dict[str, str] | None = None,
        api_key: str | None = None,
        concurrency: int = 8,
        users: int = 100_000,
        max_tokens: int = 8,
        temperature: float = 0.0,
        seed: int = 0,
    ):
        """`policies`: policy -> task; None follows the server's canary splits (a policy named after a task)."""
        self.url, self.policies, self.api_key = url.rstrip("/"), policies, api_key
        self.concurrency, self.users = concurrency, users
        self.max_tokens, self.temperature = max_tokens, temperature
        self.rng = random.Random(seed)
        self.stats = TrafficStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prompts: dict[str, random.Random] = {}
        self._rows: dict[str, list[Example]] = {}
        self.tasks = registry()

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run()), name="mint-traffic", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _prompt(self, task: str) -> str | list[dict[str, str]]:
        rng = self._prompts.setdefault(task, random.Random(f"{task}:{SEED}"))
        if task not in self._rows:
            self._rows[task] = self.tasks.get(task).heldout_rows()
        return rng.choice(self._rows[task]).prompt

    async def _targets(self, http: httpx.AsyncClient) -> dict[str, str]:
        if self.policies is not None:
            return self.policies
        try:
            r = await http.get("/v1/mint/canary", timeout=10)
            names = list(r.json()) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            names = []
        return {n: n for n in names if n in self.tasks}

    async def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.concurrency, keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=120, limits=limits) as http:
            targets: dict[str, str] = {}
            checked = 0.0

            async def user() -> None:
                nonlocal targets, checked
                while not self._stop.is_set():
                    if time.monotonic() - checked > 1.0:
                        checked = time.monotonic()
                        targets = await self._targets(http)
                    if not targets:
                        await asyncio.sleep(0.2)
                        continue
                    policy = self.rng.choice(sorted(targets))
                    prompt = self._prompt(targets[policy])
                    body: dict[str, object] = {
                        "model": policy,
                        "max_tokens": self.max_tokens,
                        "temperature": self.temperature,
                        "user": f"user-{self.rng.randrange(self.users)}",
                    }
                    if isinstance(prompt, str):
                        route, body["prompt"] = "/v1/completions", prompt
                    else:
                        route, body["messages"] = "/v1/chat/completions", prompt
                    self.stats.sent += 1
                    try:
                        r = await http.post(route, json=body)
                        ok = r.status_code == 200
                        why = str(r.status_code)
                    except Exception as e:  # the generator keeps going whatever one request met
                        ok, why = False, type(e).__name__
                    if ok:
                        self.stats.answered += 1
                    else:
                        self.stats.failed += 1
                        self.stats.errors[why] = self.stats.errors.get(why, 0) + 1
                        await asyncio.sleep(0.2)

            await asyncio.gather(*(user() for _ in range(self.concurrency)))
