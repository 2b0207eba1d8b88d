"""The front's own routes under /v1/mint/: the replicas behind it and prefetch (admin token), and the resolver
callback vLLM's plugin asks about a name it does not serve (resolver token)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from mint_core.serving.admin import check_prefetch
from mint_core.serving.front.state import BASE_ADAPTER, GatewayDep
from mint_core.serving.protocol import APIError, PrefetchRequest, PrefetchResponse
from mint_core.serving.relay import parse

router = APIRouter(tags=["mint"])


class ResolveRequest(BaseModel):
    address: str
    base: str | None = None


@router.get("/v1/mint/replicas")
async def replicas(request: Request, gw: GatewayDep) -> dict[str, Any]:
    """Each replica: health, the revisions it holds, its load, its share of the requests (admin token)."""
    gw.auth.check_admin(request)
    return await gw.backend.replicas(gw.golden.state)


@router.post("/v1/mint/prefetch", response_model=PrefetchResponse)
async def prefetch(request: Request, gw: GatewayDep) -> PrefetchResponse:
    """Vet catalog addresses and load them into vLLM under their own names ahead of need."""
    gw.auth.check_admin(request)
    _, body = parse(await request.body(), PrefetchRequest)
    check_prefetch(body.addresses, gw.catalog)

    async def one(address: str) -> str:
        try:
            digest, path = await run_in_threadpool(gw.vet_address, address)
            if gw.served.get(address) != digest:
                await gw.load(address, digest, path, inplace=address in gw.served)
            return "loaded"
        except APIError as e:
            return f"error: {e.message}"

    jobs = [asyncio.ensure_future(one(a)) for a in body.addresses]
    if not body.wait:
        return PrefetchResponse(scheduled=len(jobs))
    results = await asyncio.gather(*jobs)
    return PrefetchResponse(scheduled=len(jobs), results=dict(zip(body.addresses, results, strict=True)))


@router.post("/v1/mint/resolve")
async def resolve(request: Request, gw: GatewayDep) -> dict[str, str]:
    """vLLM's resolver plugin asks here about a name it does not serve: the verified revision, or 404."""
    gw.auth.check_resolver(request)
    _, body = parse(await request.body(), ResolveRequest)
    if body.address == BASE_ADAPTER:  # vLLM restarted under a request for the base
        gw.served[BASE_ADAPTER] = gw.base_digest
        return {"lora_path": str(gw.base_dir), "digest": f"sha256:{gw.base_digest}"}
    # a replica that restarted asks for a name the others serve: what they serve
    if (held := gw.backend.beside(body.address, gw.served)) is not None:
        return {"lora_path": str(gw.store.local_dir(held)), "digest": f"sha256:{held}"}
    digest, path = await run_in_threadpool(gw.vet_address, body.address)
    gw.served[body.address] = digest
    gw.golden.after_load(body.address, delay_s=2.0)  # vLLM loads it once this answer reaches it
    return {"lora_path": str(path), "digest": f"sha256:{digest}"}
