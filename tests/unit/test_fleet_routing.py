"""How the vLLM front routes over its replicas (serving/fleet.py): rendezvous hashing on the served name, the next
replica in the name's order when one refuses the connection, never a replica out of rotation, and an answer from a
replica taken out while the request ran is not passed on. The replicas are stand-ins answering over httpx's mock
transport (a real vLLM per replica runs in tests/integration/test_vllm_replicas.py), and the refused one is a real
port nothing listens on."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry

from mint_core.serving.fleet import Fleet, Replica, rendezvous
from mint_core.serving.protocol import APIError

NAMES = ["127.0.0.1:8100", "127.0.0.1:8101", "127.0.0.1:8102"]
POLICIES = [f"policy-{i}" for i in range(3000)]


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: a connection to it is refused


class Stand:
    """Replicas that answer a completion with their own name; `down` ones refuse connections."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.down: set[str] = set()
        self.seen: list[tuple[str, str | None, str | None]] = []  # (replica, auth, route header)
        self.on_request: Callable[[str], None] = lambda name: None

    def connect(self, url: str, key: str) -> httpx.AsyncClient:
        name = url.removeprefix("http://")

        def answer(request: httpx.Request) -> httpx.Response:
            if name in self.down:
                raise httpx.ConnectError("connection refused", request=request)
            if request.url.path == "/health":
                return httpx.Response(200)
            self.seen.append(
                (name, request.headers.get("authorization"), request.headers.get("x-mint-route"))
            )
            self.on_request(name)
            return httpx.Response(200, json={"replica": name}, headers={"x-mint-replica": name})

        headers = {"Authorization": f"Bearer {key}"}
        return httpx.AsyncClient(base_url=url, headers=headers, transport=httpx.MockTransport(answer))

    def fleet(self) -> Fleet:
        return Fleet(self.urls, "full", CollectorRegistry(), self.connect, "routed")


async def complete(fleet: Fleet, key: str, out: Callable[[str], bool] = lambda n: False) -> str:
    async def send(r: Replica) -> httpx.Response:
        return await r.routed.post("/v1/completions", json={"model": key})

    resp = await fleet.route(key, send, out)
    return str(resp.json()["replica"])


def test_a_name_goes_to_the_same_replica_every_time_and_the_order_depends_on_the_name_only() -> None:
    orders = {p: rendezvous(p, NAMES) for p in POLICIES}
    assert all(sorted(o) == sorted(NAMES) for o in orders.values())
    assert all(rendezvous(p, list(reversed(NAMES))) == o for p, o in orders.items())  # not on list order
    assert all(rendezvous(p, NAMES) == o for p, o in orders.items())  # stable


def test_names_spread_evenly_and_a_replica_dropping_out_moves_only_its_own() -> None:
    first = Counter(rendezvous(p, NAMES)[0] for p in POLICIES)
    assert all(abs(n / len(POLICIES) - 1 / 3) < 0.04 for n in first.values()), first
    without = [n for n in NAMES if n != NAMES[1]]
    for p in POLICIES:
        before = rendezvous(p, NAMES)
        after = rendezvous(p, without)
        # a name on a replica still there stays on it; one of the dropped replica's goes to its own next
        assert after[0] == (before[0] if before[0] != NAMES[1] else before[1])


def test_requests_for_one_name_stay_on_its_replica_with_the_routed_key() -> None:
    stand = Stand([f"http://{n}" for n in NAMES])
    fleet = stand.fleet()

    async def run() -> list[str]:
        return [await complete(fleet, p) for p in POLICIES[:30] for _ in range(3)]

    got = asyncio.run(run())
    for i, p in enumerate(POLICIES[:30]):
        assert got[3 * i : 3 * i + 3] == [rendezvous(p, NAMES)[0]] * 3
    assert {auth for _, auth, _ in stand.seen} == {"Bearer routed"}  # never mint's full key
    assert sum(r.sent for r in fleet.replicas) == 90


def test_a_refused_connection_goes_to_the_next_replica_in_the_names_order_and_it_is_passed_over() -> None:
    port = refused_port()
    urls = [f"http://{n}" for n in NAMES[:2]] + [f"http://127.0.0.1:{port}"]
    stand = Stand(urls[:2])
    real = httpx.AsyncClient  # the refused replica: a real connection to a port nothing listens on

    def connect(url: str, key: str) -> httpx.AsyncClient:
        return real(base_url=url) if url.endswith(str(port)) else stand.connect(url, key)

    fleet = Fleet(urls, "full", CollectorRegistry(), connect, "routed")
    names = [r.name for r in fleet.replicas]
    dead = f"127.0.0.1:{port}"
    policy = next(p for p in POLICIES if rendezvous(p, names)[0] == dead)

    async def run() -> tuple[str, list[str]]:
        got = await complete(fleet, policy)
        return got, [r.name for r in fleet.order(policy, lambda n: False)]

    got, order = asyncio.run(run())
    assert got == rendezvous(policy, names)[1]  # the next in its own order, not any replica
    assert dead not in order  # passed over until it answers /health again
    assert not fleet.by_name[dead].healthy


def test_a_replica_out_of_rotation_is_never_chosen_and_its_answer_under_way_is_not_passed_on() -> None:
    stand = Stand([f"http://{n}" for n in NAMES])
    fleet = stand.fleet()
    out: set[str] = {NAMES[0]}

    async def run() -> list[str]:
        return [await complete(fleet, p, out.__contains__) for p in POLICIES[:200]]

    assert NAMES[0] not in asyncio.run(run())
    assert NAMES[0] not in {n for n, _, _ in stand.seen}

    # taken out while a request runs on it: that answer is dropped and the request sent to the next replica
    out.clear()
    policy = next(p for p in POLICIES if rendezvous(p, NAMES)[0] == NAMES[2])
    stand.on_request = lambda name: out.add(name) if name == NAMES[2] else None
    sent = fleet.by_name[NAMES[2]].sent
    assert asyncio.run(complete(fleet, policy, out.__contains__)) == rendezvous(policy, NAMES)[1]
    assert fleet.by_name[NAMES[2]].sent == sent  # its answer was not counted as passed on

    with pytest.raises(APIError) as e:  # every replica out: 503, naming why
        asyncio.run(complete(fleet, policy, lambda n: True))
    assert e.value.status == 503 and "none is up and in rotation" in e.value.message


def test_a_replica_that_was_down_is_routed_to_again_once_it_answers_health(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("mint_core.serving.fleet.RECHECK_S", 0.0)
    stand = Stand([f"http://{n}" for n in NAMES])
    fleet = stand.fleet()
    policy = next(p for p in POLICIES if rendezvous(p, NAMES)[0] == NAMES[1])
    stand.down.add(NAMES[1])

    async def run() -> tuple[str, str]:
        during = await complete(fleet, policy)
        stand.down.clear()  # its supervisor restarted it
        fleet.order(policy, lambda n: False)  # a request passing by asks it /health
        await asyncio.gather(*fleet._checks)
        return during, await complete(fleet, policy)

    during, after = asyncio.run(run())
    assert during == rendezvous(policy, NAMES)[1] and after == NAMES[1]


def test_a_replica_that_closes_the_connection_without_an_answer_is_passed_over_too() -> None:
    """A pooled connection to a replica killed meanwhile: "Server disconnected", no answer. Inference changes no
    state, so the request goes to the next replica; a timeout is not sent again (it may still be running)."""
    stand = Stand([f"http://{n}" for n in NAMES])
    fleet = stand.fleet()
    policy = next(p for p in POLICIES if rendezvous(p, NAMES)[0] == NAMES[0])

    def closed(name: str) -> None:
        if name == NAMES[0]:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    stand.on_request = closed
    assert asyncio.run(complete(fleet, policy)) == rendezvous(policy, NAMES)[1]
    assert not fleet.by_name[NAMES[0]].healthy

    def slow(name: str) -> None:
        raise httpx.ReadTimeout("timed out")

    stand.on_request = slow
    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(complete(fleet, POLICIES[1]))
