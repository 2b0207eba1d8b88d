"""The front's generation routes: POST /v1/completions and /v1/chat/completions, checked with mint serve's checks,
then relayed to vLLM under the swap lock of the name asked for, whole or streamed, in mint's shape (serving/relay.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from mint_core.serving.chat import chat_ids
from mint_core.serving.fleet import REPLICA_HEADER
from mint_core.serving.front.state import BASE_ADAPTER, Gateway, get_gateway
from mint_core.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from mint_core.serving.relay import (
    decoded,
    named,
    normalised,
    prompt_only,
    relayed,
    validated,
)
from mint_core.serving.server import Server
from mint_core.serving.swap_lock import SwapLock

router = APIRouter(tags=["completions"])
Release = Callable[[], Awaitable[None]]


# The front's state is read off the app here, not through `GatewayDep`: FastAPI runs a plain-function dependency
# in its thread pool, and that hop was a sixth of the front's CPU per request (py-spy, 16 concurrent streams).
@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _counted(get_gateway(request), request, "/v1/completions", CompletionRequest)


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await _counted(get_gateway(request), request, "/v1/chat/completions", ChatCompletionRequest)


async def _counted(
    gw: Gateway, request: Request, path: str, model: type[CompletionRequest | ChatCompletionRequest]
) -> Response:
    """A request answered (its refusals are counted by the error handler, http_errors)."""
    out = await _generate(gw, request, path, model)
    gw.count(getattr(request.state, "model", None), out.status_code)
    return out


async def _generate(
    gw: Gateway, request: Request, path: str, model: type[CompletionRequest | ChatCompletionRequest]
) -> Response:
    gw.auth.check_api_key(request)
    raw = await request.body()
    try:
        data = decoded(raw)
        request.state.model = data.get("model")  # for the request counter, even when refused
    finally:  # out of rotation: 503, whatever the body
        gw.golden.check_rotation()
    body = validated(data, model)
    gw.auth.check_call(request, body.model, gw.base_name)  # 403 before the name is looked up anywhere
    score_only = check_prompts(gw, data, body)
    if score_only:
        data["max_tokens"] = 1  # vLLM generates at least one token; the front drops it below
    await gw.known(body.model)
    lock = None if body.model == gw.base_name else gw.lock(body.model)
    if lock is None:
        await gw.ensure_base()
        data["model"] = BASE_ADAPTER
    # requests that ask prompt logprobs (lm-eval's loglikelihood) share vLLM's batch like any other: mint starts
    # vLLM with LoRA on the decoder's matrices only (VLLMConfig.lora_target_modules), and vLLM 0.32's lm_head
    # wrapper, which died on two such sequences in one batch, is never there
    await gw.batch.acquire_read()

    async def release_batch() -> None:
        await gw.batch.release_read()

    try:
        if body.stream:
            return await _stream(gw, lock, body, data, path, release_batch)
        out = await _whole(gw, lock, body, data, path, score_only)
    except BaseException:
        await release_batch()
        raise
    await release_batch()
    return out


def check_prompts(gw: Gateway, data: dict[str, Any], body: CompletionRequest | ChatCompletionRequest) -> bool:
    """mint's checks of the prompts, max_tokens and sampling fields, with mint serve's answers (vLLM caps or
    answers otherwise); fills in mint's default max_tokens. True when the request only scores its prompts (echo
    with max_tokens 0, which vLLM does not take)."""
    limits = gw.limits
    if isinstance(body, CompletionRequest):
        if body.stream and body.echo:
            raise APIError(400, "echo is not supported with stream", "BadRequestError", "echo")
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", "BadRequestError", "prompt")
        lengths = [len(limits.tokenize(p)) for p in prompts]
        fits = [limits.max_tokens(body.max_tokens, n, echo=body.echo) for n in lengths]
        if body.max_tokens is None:
            data["max_tokens"] = min(fits)
    else:
        ids = limits.tokenize(chat_ids(gw.tokenizer, body.messages))
        fits = [limits.max_tokens(body.requested_max_tokens(), len(ids), echo=False)]
        if body.requested_max_tokens() is None:
            data["max_tokens"] = fits[0]
    Server.sampling_params(body, max(1, fits[0]), 0)  # the engine's own range checks, naming the field
    return isinstance(body, CompletionRequest) and body.echo and fits[0] == 0


async def _whole(
    gw: Gateway, lock: SwapLock | None, body: Any, data: dict[str, Any], path: str, score_only: bool
) -> Response:
    """One request to vLLM, answered whole."""
    headers = gw.backend.headers(body.model)
    if lock is not None:
        await lock.acquire_read()
    try:
        r = await gw.backend.send("POST", path, json=data, headers=headers)
        if r.status_code != 200:
            raise relayed(r)
        out, replica = r.json(), r.headers.get(REPLICA_HEADER)
        fp = gw.fingerprint(body.model, replica) if lock else "base"
    finally:
        if lock is not None:
            await lock.release_read()
    out = normalised(out, fp, body.model)
    return JSONResponse(
        prompt_only(gw.tokenizer, out, body) if score_only else out, headers=named(replica, fp)
    )


async def _stream(
    gw: Gateway, lock: SwapLock | None, body: Any, data: dict[str, Any], path: str, release_batch: Release
) -> Response:
    """One streamed request to vLLM; the stream holds its locks (and its place in the batch) until it ends, however
    it ends (`_events` releases them); until it is under way, the caller releases the batch when this raises."""
    if lock is not None:
        await lock.acquire_read()  # released when the stream ends (`_events`), however it ends
    try:
        request = gw.backend.http.build_request(
            "POST", path, json=data, headers=gw.backend.headers(body.model)
        )
        r = await gw.backend.stream(request)
    except BaseException:
        if lock is not None:
            await lock.release_read()
        raise
    if r.status_code != 200:
        await r.aread()
        await r.aclose()
        if lock is not None:
            await lock.release_read()
        raise relayed(r)
    replica = r.headers.get(REPLICA_HEADER)
    fp = gw.fingerprint(body.model, replica) if lock else "base"
    events = _events(r, fp, body.model, lock, release_batch)
    return StreamingResponse(events, media_type="text/event-stream", headers=named(replica, fp))


async def _events(
    r: Any, fp: str, model: str, lock: SwapLock | None, release_batch: Release
) -> AsyncIterator[bytes]:
    """vLLM's events in mint's shape."""
    try:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                with contextlib.suppress(ValueError):  # not JSON: passed on as vLLM sent it
                    line = "data: " + json.dumps(
                        normalised(json.loads(line[6:]), fp, model), separators=(",", ":")
                    )
            if line:
                yield (line + "\n\n").encode()
    finally:  # the end of the stream, a client that went away, or a server shutting down
        await r.aclose()
        if lock is not None:
            await lock.release_read()
        await release_batch()
