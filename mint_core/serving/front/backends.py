"""What serves behind the vLLM front: one vLLM (`OneVLLM`), or a fleet of replicas the front routes over itself
(`Replicas`), both behind one protocol (`Backend`), so the front's routes never ask which.

Two implementations rather than one vLLM as a fleet of one: a fleet differs in what it answers, not only in how
many it asks. One vLLM's `/metrics` passes vLLM's own series through (N replicas' series would collide); its failed
load is vLLM's own error, relayed as vLLM gave it (a fleet's names the replica that refused and puts every replica
back); a fleet smoke-checks each replica after a load (one more request on vLLM, which tests that count vLLM's
requests would see); a fleet picks a replica per request (`Fleet.route`), and lets the requests under way end before
the golden probe kills a poisoned replica (`drain`), while one vLLM's requests fail over to 503. Each difference is a method here, chosen once when the front starts (`backend_for`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import httpx
from fastapi import Response
from prometheus_client import CollectorRegistry, generate_latest

from mint_core.serving import upstream
from mint_core.serving.config import ServingConfig
from mint_core.serving.fleet import ROUTE_HEADER, Fleet, Replica, digest_of_path, load_lora
from mint_core.serving.golden import Target
from mint_core.serving.protocol import APIError
from mint_core.serving.relay import relayed
from mint_core.serving.swap_lock import SwapLock

logger = logging.getLogger(__name__)
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


class Backend(Protocol):
    """What the front needs of the vLLM server(s) behind it."""

    http: httpx.AsyncClient  # builds the requests `stream` sends (the one vLLM's client, or a replica's)

    def targets(
        self, served: Callable[[], dict[str, str]], prepare: Callable[[], Awaitable[None]]
    ) -> list[Target]:
        """What the golden probe asks (`served`: what the front serves; `prepare`: makes the base servable)."""
        ...

    async def send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request (503 when unreachable)."""
        ...

    async def stream(self, request: httpx.Request) -> httpx.Response:
        """One streamed request (503 when unreachable)."""
        ...

    def headers(self, model: str) -> dict[str, str]:
        """The headers a request under `model` is sent with."""
        ...

    async def models(self) -> list[dict[str, Any]]:
        """vLLM's model cards."""
        ...

    async def served(self) -> dict[str, str]:
        """Adapter name -> hex digest of what vLLM serves now."""
        ...

    def digest(self, replica: str | None, model: str) -> str | None:
        """The digest `replica` serves under `model`, when known per replica."""
        ...

    def beside(self, name: str, served: dict[str, str]) -> str | None:
        """The revision a restarted vLLM asking for `name` must take to agree with those serving beside it."""
        ...

    async def load(self, name: str, digest: str, path: Path, inplace: bool) -> None:
        """Revision `digest` (its verified directory `path`) under `name`, in place when `inplace`."""
        ...

    async def unload(self, name: str) -> None: ...

    async def metrics(self, registry: CollectorRegistry) -> Response:
        """vLLM's series and the front's own (`registry`)."""
        ...

    async def replicas(self, state: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """Each replica, with the golden probe's `state` of it."""
        ...

    async def health(self) -> None:
        """Nothing when vLLM answers /health (a fleet: a replica in rotation does); else 503."""
        ...

    async def drain(self, batch: SwapLock) -> None:
        """Before the golden probe kills a poisoned replica."""
        ...

    async def close(self) -> None: ...


def client(url: str, key: str) -> httpx.AsyncClient:
    """A client of a vLLM at `url`, with `key` (serving/upstream.py: httpx's interface over aiohttp's pool)."""
    return upstream.client(url, key)


def unreachable(where: str, e: Exception) -> APIError:
    return APIError(503, f"the vLLM backend{where} is unreachable: {e}", "ServiceUnavailableError")


class OneVLLM:
    """One vLLM at `config.vllm_url`, reached with mint's key."""

    def __init__(self, config: ServingConfig, key: str):
        self.url = config.vllm_url
        self.http = client(config.vllm_url, key)

    def targets(
        self, served: Callable[[], dict[str, str]], prepare: Callable[[], Awaitable[None]]
    ) -> list[Target]:
        return [Target(self.url.rstrip("/"), self.http, served, prepare=prepare)]

    async def send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return await self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise unreachable(f" at {self.url}", e) from None

    async def stream(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.http.send(request, stream=True)
        except httpx.HTTPError as e:
            raise unreachable("", e) from None

    def headers(self, model: str) -> dict[str, str]:
        return {}

    async def models(self) -> list[dict[str, Any]]:
        r = await self.send("GET", "/v1/models")
        return list(r.json().get("data", []))

    async def served(self) -> dict[str, str]:
        served = {}
        for c in await self.models():
            if c.get("parent") and (digest := digest_of_path(c.get("root"))):
                served[c["id"]] = digest
        return served

    def digest(self, replica: str | None, model: str) -> str | None:
        return None

    def beside(self, name: str, served: dict[str, str]) -> str | None:
        return None  # nothing serves beside it: the name is resolved afresh

    async def load(self, name: str, digest: str, path: Path, inplace: bool) -> None:
        async def post(route: str, body: dict[str, Any]) -> httpx.Response:
            return await self.send("POST", route, json=body)

        r, _ = await load_lora(post, lambda r: r.status_code == 200, name, path, inplace)
        if r.status_code != 200:
            raise relayed(r)
        logger.info("vLLM serves %s as sha256:%s", name, digest[:12])

    async def unload(self, name: str) -> None:
        r = await self.send("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        if r.status_code != 200:
            raise relayed(r)

    async def metrics(self, registry: CollectorRegistry) -> Response:
        r = await self.send("GET", "/metrics")
        if r.status_code != 200:
            raise relayed(r)
        return Response(r.content + generate_latest(registry), media_type=r.headers.get("content-type"))

    async def replicas(self, state: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        raise APIError(404, "this front has one vLLM, no replicas", "NotFoundError")

    async def health(self) -> None:
        try:
            r = await self.http.get("/health", timeout=5)
        except httpx.HTTPError as e:
            raise APIError(
                503, f"the vLLM backend is not answering: {e}", "ServiceUnavailableError"
            ) from None
        if r.status_code != 200:
            raise APIError(
                503, f"the vLLM backend answers {r.status_code} to /health", "ServiceUnavailableError"
            )

    async def drain(self, batch: SwapLock) -> None:
        return None  # nothing else could take them: every request fails over to 503 meanwhile

    async def close(self) -> None:
        await self.http.aclose()


class Replicas:
    """N vLLM replicas (`config.vllm_replicas`, serving/fleet.py) the front routes over itself: each request to one
    replica, chosen by its served name, with the routed key; loads and unloads on every replica, all or nothing,
    with the full key."""

    def __init__(
        self,
        config: ServingConfig,
        key: str,
        registry: CollectorRegistry,
        out: Callable[[str | None], bool],
        hidden: str,
        dir_of: Callable[[str], Path],
    ):
        # requests: the narrower key, which opens no adapter route on the replicas
        routed_key = config.vllm_routed_key.get_secret_value() if config.vllm_routed_key else key
        self.fleet = Fleet(config.vllm_replicas, key, registry, client, routed_key, hidden=hidden)
        self.http = self.fleet.replicas[
            0
        ].routed  # builds streamed requests; `stream` sends each to its replica
        self.out = out  # whether a replica is out of rotation (its answers are not passed on)
        self.dir_of = dir_of  # a revision's verified directory in the store: what a failed load puts back

    def targets(
        self, served: Callable[[], dict[str, str]], prepare: Callable[[], Awaitable[None]]
    ) -> list[Target]:
        # each replica at its own URL with the full key; a restarted one asks the front for the base
        return [
            Target(r.url, r.http, _served_by(r), labels=(r.name,), read=partial(self.fleet.read, r))
            for r in self.fleet.replicas
        ]

    async def send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = dict(kw.pop("headers", None) or {})
        key = headers.pop(ROUTE_HEADER, "")

        async def one(r: Replica) -> httpx.Response:
            return await r.routed.request(method, path, headers=headers, **kw)

        try:
            return await self.fleet.route(key, one, self.out)
        except httpx.HTTPError as e:
            raise unreachable("", e) from None

    async def stream(self, request: httpx.Request) -> httpx.Response:
        key = request.headers.get(ROUTE_HEADER, "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _OWN_HEADERS}

        async def one(r: Replica) -> httpx.Response:
            path = request.url.raw_path.decode()
            to = r.routed.build_request(request.method, path, content=request.content, headers=headers)
            return await r.routed.send(to, stream=True)

        try:
            return await self.fleet.route(key, one, self.out)
        except httpx.HTTPError as e:
            raise unreachable("", e) from None

    def headers(self, model: str) -> dict[str, str]:
        # routed on the served name, so one adapter stays on one replica (`send` and `stream` take it off)
        return {ROUTE_HEADER: model}

    async def models(self) -> list[dict[str, Any]]:
        return await self.fleet.models()  # every replica's own listing

    async def served(self) -> dict[str, str]:
        return await self.fleet.refresh()

    def digest(self, replica: str | None, model: str) -> str | None:
        return self.fleet.digest(replica, model)

    def beside(self, name: str, served: dict[str, str]) -> str | None:
        # the fleet's revision, whatever loaded it (a promotion, or an admin load by path no address names)
        return served.get(name)

    async def load(self, name: str, digest: str, path: Path, inplace: bool) -> None:
        held = await self.fleet.load(name, digest, path, self.dir_of)  # the caller holds the batch's lock
        logger.info("vLLM replicas %s serve %s as sha256:%s", ", ".join(held), name, digest[:12])

    async def unload(self, name: str) -> None:
        status, message = await self.fleet.unload(name)  # from every replica
        if status != 200:
            raise APIError(status, message, "NotFoundError" if status == 404 else "BackendError")

    async def metrics(self, registry: CollectorRegistry) -> Response:
        await self.fleet.report()  # N replicas' series would collide: the front's own, with each replica's
        return Response(generate_latest(registry), media_type=PROMETHEUS)

    async def replicas(self, state: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        report = await self.fleet.report()
        for row in report:  # out of rotation (its golden answers changed), and when it last was
            row.update(state(row["replica"]))
        return {"routing": "consistent_hash on the served name", "replicas": report}

    async def health(self) -> None:
        live = [r for r in self.fleet.replicas if not self.out(r.name)]
        answers = await asyncio.gather(*(self.fleet.check(r) for r in live))
        if not any(answers):
            names = ", ".join(r.name for r in live) or "none in rotation"
            raise APIError(503, f"no vLLM replica answers /health ({names})", "ServiceUnavailableError")

    async def drain(self, batch: SwapLock) -> None:
        # nothing more is routed to it, and an answer it gives is sent again elsewhere (`Fleet.route`); a kill
        # would fail the requests under way, which the other replicas can take
        await batch.acquire_write()
        await batch.release_write()

    async def close(self) -> None:
        await self.fleet.close()


# what `client()` sets on a request to a replica itself, and the routing key, which stays in the front
_OWN_HEADERS = frozenset({"host", "content-length", "authorization", ROUTE_HEADER})


def _served_by(r: Replica) -> Callable[[], dict[str, str]]:
    return lambda: r.served  # read when asked: a read of the replica replaces the dict


def backend_for(
    config: ServingConfig,
    registry: CollectorRegistry,
    out: Callable[[str | None], bool],
    hidden: str,
    dir_of: Callable[[str], Path],
) -> Backend:
    """The backend `config` names: a fleet when it lists replicas (`vllm_replicas`), else one vLLM."""
    if config.vllm_api_key is None:
        raise ValueError("backend vllm needs vllm_api_key: the key vLLM was started with")
    key = config.vllm_api_key.get_secret_value()
    if config.vllm_replicas:
        return Replicas(config, key, registry, out, hidden, dir_of)
    return OneVLLM(config, key)
