"""The golden probe's admission of replicas to vllm-router (serving/golden.py, with replica_control.Router), on a
fleet of two.

A replica out of rotation (found poisoned, being restarted) is its restart's business: a periodic probe that asks
only the replicas in rotation must not put the one out of rotation back before the router. In a fleet-poison row
of the fault suite it did: the probe's results (of the replicas it asked) were paired with every replica, so the
poisoned replica took its neighbour's pass and was added back while its restart was still running; the restart's
own add then got vllm-router's 400 "already exists" and waited 900 s for nothing. The router here is a stand-in
for its two worker routes (vllm-router itself runs in tests/integration/test_vllm_fleet_faults.py).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from mint_core.serving.golden import GoldenProbe, Target
from mint_core.serving.replica_control import Router as Membership

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


class Router:
    """vllm-router's /list_workers, /add_worker and /remove_worker, as 0.1.17 answers them."""

    def __init__(self, workers: list[str]):
        self.workers = list(workers)
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/list_workers":
            return httpx.Response(200, json={"urls": self.workers})
        url = request.url.params["url"]
        self.calls.append((request.url.path, url))
        if request.url.path == "/add_worker":
            if url in self.workers:
                return httpx.Response(400, text=f"Worker {url} already exists")
            self.workers.append(url)
        elif request.url.path == "/remove_worker":
            self.workers.remove(url)
        return httpx.Response(200, text="ok")


def probe_of(router: Router) -> GoldenProbe:
    async def nothing(*_: Any) -> None:
        return None

    vllm = httpx.AsyncClient(base_url="http://router", transport=httpx.MockTransport(router))
    targets = [Target(u, vllm, dict, labels=(u.rsplit("/", 1)[1],), read=nothing) for u in URLS]
    front = SimpleNamespace(registry=CollectorRegistry(), ensure_base=nothing)
    return GoldenProbe(front, targets, Membership(vllm), ["a"], max_tokens=2, interval_s=1.0)  # type: ignore[arg-type]


def test_a_probe_never_admits_the_replica_out_of_rotation() -> None:
    router = Router([URLS[1]])  # replica 0 was removed when it was found poisoned
    probe = probe_of(router)
    probe.targets[0].out = "its golden answers changed"
    asked: list[str] = []

    async def passes(t: Target, reason: str) -> bool:
        asked.append(t.url)
        return True

    probe._probe = passes  # type: ignore[method-assign]  # replica 1's answers hold
    assert asyncio.run(probe.probe("interval")) is True
    assert asked == [URLS[1]]
    assert router.calls == []  # replica 0 stays out until its restart admits it
    assert router.workers == [URLS[1]]


def test_a_replica_missing_from_the_router_is_added_and_an_add_of_one_there_already_counts() -> None:
    router = Router([URLS[1]])
    probe = probe_of(router)

    async def passes(t: Target, reason: str) -> bool:
        return True

    probe._probe = passes  # type: ignore[method-assign]
    assert asyncio.run(probe.probe("interval")) is True
    assert router.calls == [("/add_worker", URLS[0])]
    assert asyncio.run(probe.membership.add(probe.targets[0].url)) is True  # 400 "already exists"
    assert asyncio.run(probe.membership.remove(probe.targets[1].url)) is True
