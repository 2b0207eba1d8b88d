"""Canary splits and feedback (`serving/canary.py`), the same on both backends:

PUT    /v1/mint/canary/{name}  {"canary", "control", "share"}   put a split (admin token; repeating is a no-op)
DELETE /v1/mint/canary/{name}                                     end it (admin token); 404 when there is none
GET    /v1/mint/canary/{name}?after=<seq>&limit=<n>               the split, counts per arm, score events
GET    /v1/mint/canary                                            every split
POST   /v1/feedback            {"id", "score"}                    score an answer by its response id (API key)

A serving key reads the splits of the names it may call only (another's: 403; the listing leaves them out), and
scores answers under those names only (another's answer id: 404, as one never seen).
"""

from __future__ import annotations

from typing import cast

from fastapi import APIRouter, Query, Request

from mint_core.serving.admin import Auth
from mint_core.serving.canary import (
    AlreadyScored,
    CanaryState,
    CanaryView,
    Feedback,
    ScoreEvent,
    Split,
    UnknownResponse,
)
from mint_core.serving.protocol import APIError

router = APIRouter(tags=["canary"])


def _state(request: Request) -> tuple[CanaryState, Auth]:
    return cast(CanaryState, request.app.state.canary), cast(Auth, request.app.state.auth)


@router.put("/v1/mint/canary/{name}", response_model=CanaryView)
async def put_split(request: Request, name: str, split: Split) -> CanaryView:
    state, auth = _state(request)
    auth.check_admin(request)
    if split.canary == name or split.control == split.canary:
        raise APIError(
            400,
            f"a canary of {name!r} needs its own served name (got canary {split.canary!r}, control "
            f"{split.control!r})",
            "BadRequestError",
            "canary",
        )
    state.put(name, split)
    return state.view(name, after=2**62)


@router.delete("/v1/mint/canary/{name}", response_model=CanaryView)
async def clear_split(request: Request, name: str) -> CanaryView:
    state, auth = _state(request)
    auth.check_admin(request)
    if state.clear(name) is None:
        raise APIError(404, f"no canary split for {name!r}", "NotFoundError", "name")
    return state.view(name, after=2**62)


@router.get("/v1/mint/canary/{name}", response_model=CanaryView)
async def view(
    request: Request, name: str, after: int = Query(0, ge=0), limit: int = Query(10_000, ge=1, le=100_000)
) -> CanaryView:
    state, auth = _state(request)
    if not auth.check_api_key(request).may(name, request.app.state.base_name):
        raise APIError(403, "this key may not read that canary", "PermissionDeniedError", "name")
    return state.view(name, after, limit)


@router.get("/v1/mint/canary")
async def splits(request: Request) -> dict[str, Split]:
    state, auth = _state(request)
    caller = auth.check_api_key(request)
    base_name = request.app.state.base_name
    return {name: split for name, split in list(state.splits.items()) if caller.may(name, base_name)}


@router.post("/v1/feedback", response_model=ScoreEvent)
async def feedback(request: Request, body: Feedback) -> ScoreEvent:
    state, auth = _state(request)
    caller = auth.check_api_key(request)
    try:
        name = state.name_of(body.id)
        if name is not None and not caller.may(name, request.app.state.base_name):
            raise UnknownResponse(body.id)  # another key's answer: as if never seen
        return state.feedback(body.id, body.score)
    except UnknownResponse:
        raise APIError(
            404,
            f"no answer with id {body.id!r} (unknown, or older than the last answers kept)",
            "NotFoundError",
            "id",
        ) from None
    except AlreadyScored:
        raise APIError(409, f"the answer {body.id!r} is already scored", "ConflictError", "id") from None
