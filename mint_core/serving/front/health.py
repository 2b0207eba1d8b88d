"""The front's probes: GET /health (vLLM answers, and a replica is in rotation) and GET /metrics (vLLM's series, or
each replica's with a fleet, and the front's own). Neither needs a key."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Response

from mint_core.serving.front.state import GatewayDep
from mint_core.serving.protocol import APIError

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(gw: GatewayDep) -> Response:
    gw.golden.check_rotation()
    try:
        r = await gw.backend.http.get("/health", timeout=5)
    except httpx.HTTPError as e:
        raise APIError(503, f"the vLLM backend is not answering: {e}", "ServiceUnavailableError") from None
    if r.status_code != 200:
        raise APIError(503, f"the vLLM backend answers {r.status_code} to /health", "ServiceUnavailableError")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> Response:
    return await gw.backend.metrics(gw.registry)
