"""The front's probes: GET /health (vLLM answers, and a replica is in rotation) and GET /metrics (vLLM's series, or
each replica's with a fleet, and the front's own). /health needs no key; /metrics, with an access file, the admin
token (its series name every tenant's models and keys)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from mint_core.serving.front.state import GatewayDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(gw: GatewayDep) -> Response:
    gw.golden.check_rotation()
    await gw.backend.health()
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request, gw: GatewayDep) -> Response:
    gw.auth.check_metrics(request)
    return await gw.backend.metrics(gw.registry)
