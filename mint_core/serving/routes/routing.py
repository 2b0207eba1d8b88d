"""Which router answers `model: "auto"` (serving/routing.py), the same on both backends:

GET /v1/mint/router                       the revision serving, where it came from, its counts (API key)
PUT /v1/mint/router {"path", "revision"}  serve the router saved at `path`, inside the routing dir (admin token)

A PUT is checked before anything changes: a path outside the routing dir is a 400, a router that does not load (a
missing or corrupt file, another format or featurizer, a revision other than the one named) a 422 naming the file
and the problem, and the serving router stays. The same revision again is a no-op: the router keeps what it learned
online since it was loaded.
"""

from __future__ import annotations

from typing import cast

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from mint_core.routing.router import RouterLoadError
from mint_core.serving.admin import Auth
from mint_core.serving.protocol import APIError
from mint_core.serving.routing import RouterSpec, RouterView, RoutingState

router = APIRouter(tags=["routing"])


def _state(request: Request) -> tuple[RoutingState, Auth]:
    return cast(RoutingState, request.app.state.routing), cast(Auth, request.app.state.auth)


@router.get("/v1/mint/router", response_model=RouterView)
async def view(request: Request) -> RouterView:
    state, auth = _state(request)
    caller = auth.check_api_key(request)
    return state.view(caller, request.app.state.base_name)


@router.put("/v1/mint/router", response_model=RouterView)
async def put_router(request: Request, spec: RouterSpec) -> RouterView:
    state, auth = _state(request)
    auth.check_admin(request)
    try:
        await run_in_threadpool(state.swap, spec)
    except RouterLoadError as e:
        raise APIError(
            422, f"{e}; the serving router ({state.revision}) stays", "UnprocessableEntityError", "path"
        ) from None
    return state.view(auth.identify(request), request.app.state.base_name)
