"""mint's own routes, beside the OpenAI/vLLM contract, under /v1/mint/ (admin token)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from mint_core.serving.admin import check_prefetch
from mint_core.serving.protocol import PrefetchRequest, PrefetchResponse
from mint_core.serving.server import ServerDep

router = APIRouter(tags=["mint"])


@router.post("/v1/mint/prefetch", response_model=PrefetchResponse)
async def prefetch(request: Request, body: PrefetchRequest, server: ServerDep) -> PrefetchResponse:
    """Schedule cold loads of catalog addresses ahead of need. With `wait`, answer once they are loaded, with
    each address's outcome."""
    server.auth.check_admin(request)
    check_prefetch(body.addresses, server.catalog)
    futures = server.adapters.prefetch(body.addresses)
    if not body.wait:
        return PrefetchResponse(scheduled=len(futures))
    results: dict[str, str] = {}
    for a, f in zip(body.addresses, futures, strict=True):
        try:
            await asyncio.wrap_future(f)
            results[a] = "loaded"
        except Exception as e:
            results[a] = f"error: {e}"
    return PrefetchResponse(scheduled=len(futures), results=results)
