"""Probes: liveness of the engine loop, and the Prometheus metrics. Neither needs a key."""

from __future__ import annotations

from fastapi import APIRouter, Response

from mint_core.serving.protocol import APIError
from mint_core.serving.server import ServerDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(server: ServerDep) -> Response:
    """200 while the engine loop runs; 503 once it has stopped, so a load balancer takes the server out."""
    if not server.loop.alive:
        raise APIError(503, "engine loop is not running", "ServiceUnavailableError")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(server: ServerDep) -> Response:
    body, ctype = server.metrics.render()
    return Response(body, media_type=ctype)
