"""The golden probe on a fleet of two (serving/golden.py): a periodic probe asks only the replicas in rotation. A
replica out of rotation (found poisoned, being restarted) is its restart's business, and it stays out until that
restart finds its answers hold; the front routes nothing to it meanwhile (tests/unit/test_fleet_routing.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from mint_core.serving.golden import GoldenProbe, Target

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def probe_of() -> GoldenProbe:
    async def nothing(*_: Any) -> None:
        return None

    vllm = httpx.AsyncClient(base_url="http://replica")
    targets = [Target(u, vllm, dict, labels=(u.rsplit("/", 1)[1],), read=nothing) for u in URLS]
    front = SimpleNamespace(registry=CollectorRegistry(), ensure_base=nothing)
    return GoldenProbe(front, targets, nothing, ["a"], max_tokens=2, interval_s=1.0)  # type: ignore[arg-type]


def test_a_probe_never_asks_or_admits_the_replica_out_of_rotation() -> None:
    probe = probe_of()
    probe.targets[0].out = "its golden answers changed"
    asked: list[str] = []

    async def passes(t: Target, reason: str) -> bool:
        asked.append(t.url)
        return True

    probe._probe = passes  # type: ignore[method-assign]  # replica 1's answers hold
    assert asyncio.run(probe.probe("interval")) is True
    assert asked == [URLS[1]]
    assert probe.targets[0].out == "its golden answers changed"  # out until its restart admits it
    assert probe.out("127.0.0.1:9001") and not probe.out("127.0.0.1:9002")
