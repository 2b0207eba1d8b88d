"""The vLLM front's backends (serving/front/backends.py): one vLLM and a fleet load in place the same way (vLLM
0.32 keeps `load_inplace` on the name, so an in-place load is followed by an unload and a plain load of the same
path: fleet.load_lora), and the one vLLM relays vLLM's own error when a step fails. vLLM is a stand-in here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry

from mint_core.serving.config import ServingConfig
from mint_core.serving.front.backends import OneVLLM, Replicas, backend_for
from mint_core.serving.protocol import APIError
from mint_core.serving.swap_lock import SwapLock

PATH = Path("/store/sha256/ab/" + "ab" * 32)


class VLLM:
    """vLLM's LoRA routes: each call recorded as (route, load_inplace); `refuse` names a route answered 400."""

    def __init__(self, refuse: str | None = None):
        self.calls: list[tuple[str, object]] = []
        self.refuse = refuse

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append((request.url.path, body.get("load_inplace")))
        if request.url.path == self.refuse:
            error = {"message": "no", "type": "BadRequestError", "param": None, "code": 400}
            return httpx.Response(400, json={"error": error})
        return httpx.Response(200, text="Success")


def one_vllm(vllm: VLLM) -> OneVLLM:
    backend = OneVLLM(ServingConfig(backend="vllm", vllm_api_key="k"), "k")
    backend.http = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(vllm))
    return backend


LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.mark.parametrize(
    ("inplace", "calls"),
    [(False, [(LOAD, False)]), (True, [(LOAD, True), (UNLOAD, None), (LOAD, False)])],
)
def test_one_vllm_loads_in_place_as_the_fleet_does(inplace: bool, calls: list[tuple[str, object]]) -> None:
    vllm = VLLM()
    asyncio.run(one_vllm(vllm).load("a", "ab" * 32, PATH, inplace))
    assert vllm.calls == calls


def test_one_vllm_relays_the_step_that_failed() -> None:
    vllm = VLLM(refuse=UNLOAD)
    with pytest.raises(APIError) as e:
        asyncio.run(one_vllm(vllm).load("a", "ab" * 32, PATH, inplace=True))
    assert (e.value.status, e.value.type, e.value.message) == (400, "BadRequestError", "no")
    assert vllm.calls == [(LOAD, True), (UNLOAD, None)]  # no plain load after a failed unload


async def nothing() -> None:
    return None


def test_the_config_names_the_backend() -> None:
    args = (CollectorRegistry(), lambda replica: False, "_base", Path)
    one = ServingConfig(backend="vllm", vllm_api_key="k")
    assert isinstance(backend_for(one, *args), OneVLLM)
    fleet = one.model_copy(update={"vllm_replicas": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]})
    replicas = backend_for(fleet, *args)
    assert isinstance(replicas, Replicas)
    assert [t.labels for t in replicas.targets(dict, nothing)] == [
        ("127.0.0.1:9001",),
        ("127.0.0.1:9002",),
    ]
    with pytest.raises(ValueError, match="vllm_api_key"):
        backend_for(ServingConfig(backend="vllm"), *args)


class Replica:
    """One vLLM replica's routes the fleet's load and the golden probe use, answering at once."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}  # name -> digest
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            cards = [{"id": n, "parent": "base", "root": f"/s/{d[:2]}/{d}"} for n, d in self.held.items()]
            return httpx.Response(200, json={"data": cards})
        body = json.loads(request.content)
        self.calls.append((path, body.get("lora_name") or body.get("model")))
        if path == LOAD:
            self.held[body["lora_name"]] = Path(body["lora_path"]).name
            return httpx.Response(200, text="Success")
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})


def test_a_load_and_a_probe_that_runs_alone_never_wait_on_each_other() -> None:
    """A load takes vLLM's batch before its name, as requests and the golden probe do. The other order deadlocked a
    fleet's promotion: the load held the name and waited for the batch behind a probe that must run alone, and the
    probe, once the batch was its own, waited for the name."""
    from mint_core.serving.front.state import Gateway
    from mint_core.serving.golden import GoldenProbe

    async def scenario() -> None:
        config = ServingConfig(backend="vllm", vllm_api_key="k", vllm_replicas=["http://127.0.0.1:9001"])
        backend = backend_for(config, CollectorRegistry(), lambda replica: False, "_base", Path)
        assert isinstance(backend, Replicas)
        replica = Replica()
        for r in backend.fleet.replicas:
            r.http = httpx.AsyncClient(base_url=r.url, transport=httpx.MockTransport(replica))
        locks: dict[str, SwapLock] = {}
        gw = SimpleNamespace(
            batch=SwapLock(),
            lock=lambda name: locks.setdefault(name, SwapLock()),
            backend=backend,
            served={},
            _changes=0,
            golden=SimpleNamespace(after_load=lambda name: None),
            registry=CollectorRegistry(),
            ensure_base=nothing,
            base_adapter="_base",
        )
        target = backend.targets(dict, nothing)[0]
        probe = GoldenProbe(gw, [target], backend.drain, ["a"], max_tokens=1, interval_s=0.0)  # type: ignore[arg-type]

        await gw.batch.acquire_read()  # a request under another name is under way
        alone = asyncio.ensure_future(probe.answers(target, "p", alone=True))  # waits for the batch
        load = asyncio.ensure_future(Gateway.load(gw, "p", "ab" * 32, PATH, inplace=False))  # type: ignore[arg-type]
        for _ in range(20):
            await asyncio.sleep(0)
        await gw.batch.release_read()  # the request ends
        await asyncio.wait_for(asyncio.gather(alone, load), timeout=10)
        assert alone.result() == ["x"]
        assert gw.served == {"p": "ab" * 32} and replica.held == {"p": "ab" * 32}
        assert [call for call in replica.calls if call[0] == LOAD] == [(LOAD, "p")]

    asyncio.run(scenario())
