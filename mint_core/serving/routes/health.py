"""Probes: liveness of the engine loop (no key: load balancers probe it), and the Prometheus metrics (the admin
token with an access file: its series name every tenant's models and keys; open otherwise)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

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
async def metrics(request: Request, server: ServerDep) -> Response:
    server.auth.check_metrics(request)
    body, ctype = server.metrics.render()
    return Response(body, media_type=ctype)
