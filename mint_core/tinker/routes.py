"""The HTTP routes of Tinker's API (the `tinker` SDK's `ServiceClient`, `TrainingClient`, `SamplingClient`).

Supported (every one checks the `X-API-Key` header):
  GET  /api/v1/healthz, /api/v1/get_server_capabilities
  POST /api/v1/client/config, /api/v1/client/dynamic_config, /api/v1/telemetry (accepted, dropped)
  POST /api/v1/create_session, /api/v1/session_heartbeat, /api/v1/sessions/{id}/finish
  POST /api/v1/create_model, /api/v1/get_info
  POST /api/v1/forward_backward (protobuf; `forward` is forward_only), /api/v1/optim_step
  POST /api/v1/save_weights, /api/v1/load_weights, /api/v1/save_weights_for_sampler
  POST /api/v1/create_sampling_session, /api/v1/asample;  GET /api/v1/samplers/{id}
  POST /api/v1/retrieve_future (long poll: waits up to 20 s for the result, then says try_again)
  GET  /api/v1/training_runs/{id};  DELETE /api/v1/training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}
Any other /api/v1 route answers 404 "not supported by this server" (see NOT_SUPPORTED).

Refusals are HTTP errors with `{"detail": message}`, which the SDK raises with the message; a call refused after
it was queued (its future) fails with a `RequestFailedResponse`, which the SDK raises as RequestFailedError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Future
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from tinker import types

from mint_core.engine.sampling import SamplingParams
from mint_core.serving.protocol import APIError
from mint_core.serving.server import Server
from mint_core.tinker.optim import AdamStep
from mint_core.tinker.records import Result, TinkerError
from mint_core.tinker.service import TinkerService
from mint_core.tinker.wire import (
    PROTO,
    Sampled,
    WireError,
    read_forward_backward,
    write_sample_response,
)

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/api/v1")
LONG_POLL_S = 20.0
MAX_SAMPLES = 64

# The SDK's routes this server leaves out; each answers 404 "not supported by this server".
NOT_SUPPORTED = (
    "auth/token (JWT exchange: this server takes API keys only)",
    "auth/apikey/me",
    "retrieve_futures, cancel_future, join_sampling_session (the client config turns these off)",
    "create_custom_loss (custom losses run in the SDK: forward_backward_custom works)",
    "save_weights_external, copy_weights, weights_info",
    "training_runs (listing), training_runs/{id}/checkpoints (listing), checkpoints, sessions (listing), "
    "billing/..., audit",
)

CLIENT_CONFIG = types.ClientConfigResponse(
    pjwt_auth_enabled=False,
    use_pyqwest_transport=True,
    proto_compress_fwdbwd=False,
    sample_use_retrieve_futures=False,
    custom_loss_server_side=False,
    sample_join_sampling_session=False,
)


def service_of(request: Request) -> TinkerService:
    return request.app.state.tinker  # type: ignore[no-any-return]


def owner(request: Request) -> str:
    return service_of(request).owner_of(request.headers.get("x-api-key"))


def error(e: TinkerError) -> JSONResponse:
    return JSONResponse({"detail": e.message}, status_code=e.status)


async def body_of(request: Request, model: type[Any]) -> Any:
    try:
        raw = await request.json()
    except ValueError:
        raise TinkerError(400, "the body is not JSON") from None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        parts = [f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5]]
        raise TinkerError(400, f"invalid {model.__name__}: " + "; ".join(parts)) from None


def future(svc: TinkerService, who: str, fut: Future[Any], model_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": svc.futures.track(who, fut)}
    if model_id is not None:
        out["model_id"] = model_id
    return out


def done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


# ---- service -----------------------------------------------------------------------------------------------


@router.get("/healthz")
async def healthz(request: Request) -> Any:
    owner(request)
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> Any:
    owner(request)
    svc = service_of(request)
    return {
        "supported_models": [
            {
                "model_name": svc.base_name,
                "max_context_length": svc.engine.max_model_len,
                "trainable": True,
                "sampleable": True,
            }
        ]
    }


@router.post("/client/config")
async def client_config(request: Request) -> Any:
    owner(request)
    return CLIENT_CONFIG.model_dump()


@router.post("/client/dynamic_config")
async def client_dynamic_config(request: Request) -> Any:
    owner(request)
    return types.ClientDynamicConfigResponse().model_dump()


@router.post("/telemetry")
async def telemetry(request: Request) -> Any:
    owner(request)
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(request: Request) -> Any:
    who = owner(request)
    await body_of(request, types.CreateSessionRequest)
    return {"type": "create_session", "session_id": service_of(request).create_session(who)}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.SessionHeartbeatRequest)
    service_of(request).heartbeat(who, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> Any:
    who = owner(request)
    await run(service_of(request).finish_session, who, session_id)
    return {}


async def run(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# ---- training --------------------------------------------------------------------------------------------


@router.post("/create_model")
async def create_model(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.CreateModelRequest)
    svc = service_of(request)
    if body.lora_config is None:
        raise TinkerError(400, "create_model needs a lora_config: this server trains LoRA adapters only")
    if getattr(body.optimizer_config, "type", "adamw") != "adamw":
        raise TinkerError(
            400, f"optimizer {body.optimizer_config.type!r} is not supported by this server (adamw only)"
        )
    meta = body.user_metadata or {}
    lc = body.lora_config
    m = await run(
        lambda: svc.create_model(
            who,
            body.session_id,
            body.model_seq_id,
            body.base_model,
            lc.rank,
            lc.seed,
            lc.train_attn,
            lc.train_mlp,
            str(meta["policy"]) if meta.get("policy") else None,
            {str(k): str(v) for k, v in meta.items()} or None,
        )
    )
    return future(svc, who, done(Result(json={"model_id": m.id, "type": "create_model"})), m.id)


@router.post("/get_info")
async def get_info(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.GetInfoRequest)
    svc = service_of(request)
    return svc.info(svc.model(who, body.model_id))


@router.post("/forward_backward")
async def forward_backward(request: Request) -> Any:
    who = owner(request)
    svc = service_of(request)
    try:
        fb = read_forward_backward(
            await request.body(), "zstd" in request.headers.get("content-encoding", "")
        )
    except WireError as e:
        raise TinkerError(400, str(e)) from None
    m = svc.model(who, fb.model_id)
    fut = svc.forward_backward(m, fb.data, fb.loss_fn, fb.config, fb.forward_only)
    return future(svc, who, fut, m.id)


@router.post("/optim_step")
async def optim_step(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.OptimStepRequest)
    svc = service_of(request)
    m = svc.model(who, body.model_id)
    p = body.optim_params
    if not isinstance(p, types.AdamParams):
        raise TinkerError(
            400, f"optimizer {getattr(p, 'type', '?')!r} is not supported by this server (AdamParams only)"
        )
    bad = [f"{k}={v}" for k, v in p.model_dump().items() if not np.isfinite(v) or v < 0]
    if not 0 <= p.beta1 < 1 or not 0 <= p.beta2 < 1:
        bad.append("beta1 and beta2 must be in [0, 1)")
    if bad:
        raise TinkerError(400, f"invalid AdamParams: {', '.join(bad)}")
    fut = svc.optim(m, AdamStep(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm))
    return future(svc, who, fut, m.id)


@router.post("/save_weights")
async def save_weights(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.SaveWeightsRequest)
    svc = service_of(request)
    m = svc.model(who, body.model_id)
    name = svc.check_name(body.path)
    return future(svc, who, svc.call(m, lambda: Result(json=svc.save_weights(m, name))), m.id)


@router.post("/load_weights")
async def load_weights(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.LoadWeightsRequest)
    svc = service_of(request)
    if body.model_id is not None:
        m = svc.model(who, body.model_id)
    else:  # create-via-load: a new model shaped like the checkpoint, then the load
        if body.session_id is None or body.model_seq_id is None:
            raise TinkerError(400, "load_weights needs model_id, or session_id with model_seq_id")
        ck = svc.checkpoint(who, body.path)
        attn = any(svc.engine.sites[s].short in _attn() for s in ck.sites)
        mlp = any(svc.engine.sites[s].short not in _attn() for s in ck.sites)
        meta = body.user_metadata or {}
        m = await run(
            lambda: svc.create_model(
                who,
                body.session_id,
                body.model_seq_id,
                body.base_model or svc.base_name,
                ck.rank,
                None,
                attn,
                mlp,
                str(meta["policy"]) if meta.get("policy") else None,
            )
        )
    svc.checkpoint(who, body.path)  # unknown path: refused now, before anything is queued
    fut = svc.call(m, lambda: Result(json=svc.load_weights(m, body.path, body.optimizer)))
    return future(svc, who, fut, m.id)


def _attn() -> frozenset[str]:
    from mint_core.tinker.records import ATTN

    return ATTN


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.SaveWeightsForSamplerRequest)
    svc = service_of(request)
    m = svc.model(who, body.model_id)
    if body.kind != "snapshot":
        raise TinkerError(
            400, f"sampling client kind {body.kind!r} is not supported by this server (snapshot only)"
        )
    name = svc.check_name(body.path) if body.path is not None else None
    return future(svc, who, svc.call(m, lambda: Result(json=svc.save_for_sampler(m, name))), m.id)


# ---- sampling --------------------------------------------------------------------------------------------


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.CreateSamplingSessionRequest)
    svc = service_of(request)
    sid = await run(svc.create_sampler, who, body.session_id, body.model_path, body.base_model)
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sampler_id:path}")
async def get_sampler(sampler_id: str, request: Request) -> Any:
    who = owner(request)
    svc = service_of(request)
    s = svc.sampler(who, sampler_id)
    return {"sampler_id": s.id, "base_model": svc.base_name, "model_path": s.model_path}


@router.post("/asample")
async def asample(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.SampleRequest)
    svc = service_of(request)
    server: Server = request.app.state.server
    if body.sampling_session_id is None:
        raise TinkerError(400, "asample needs a sampling_session_id (create_sampling_session)")
    sampler = svc.sampler(who, body.sampling_session_id)
    unsupported = [
        name
        for name, on in (
            ("topk_prompt_logprobs", body.topk_prompt_logprobs),
            ("topk_sample_logprobs", body.topk_sample_logprobs),
            ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
            ("prompt_logprobs_last_n", body.prompt_logprobs_last_n is not None),
            ("sampling_params.top_k", body.sampling_params.top_k not in (-1, 0)),
        )
        if on
    ]
    if unsupported:
        raise TinkerError(400, f"{', '.join(unsupported)}: not supported by this server")
    try:
        ids = body.prompt.to_ints()
    except ValueError:
        raise TinkerError(400, "the prompt must be text tokens only (no image chunks)") from None
    if not ids or any(not 0 <= t < svc.vocab for t in ids):
        raise TinkerError(400, f"the prompt must be 1 or more token ids in [0, {svc.vocab})")
    if not 1 <= body.num_samples <= MAX_SAMPLES:
        raise TinkerError(400, f"num_samples must be between 1 and {MAX_SAMPLES}")
    sp = body.sampling_params
    limit = svc.engine.max_model_len - len(ids)
    max_tokens = sp.max_tokens if sp.max_tokens is not None else max(1, min(256, limit))
    if not 1 <= max_tokens <= limit:
        raise TinkerError(
            400, f"max_tokens must be between 1 and {max(limit, 0)} for a prompt of {len(ids)} tokens"
        )
    stop = sp.stop
    stop_strs = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    stop_ids = {int(s) for s in stop or [] if isinstance(s, int)} if not isinstance(stop, str) else set()
    try:
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=sp.temperature,
                top_p=sp.top_p,
                seed=None if sp.seed is None else sp.seed + i,
                stop=stop_strs,
                logprobs=True,
                echo=bool(body.prompt_logprobs),
                ignore_eos=stop is not None and len(stop) == 0,
            )
            for i in range(body.num_samples)
        ]
    except ValidationError as e:
        raise TinkerError(
            400, f"invalid sampling_params: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}"
        ) from None
    wake: asyncio.Queue[None] = asyncio.Queue()
    try:
        seqs = await server.submit_all([(sampler.adapter, ids, p) for p in params], wake)
    except APIError as e:
        svc.sampler(who, body.sampling_session_id)  # its snapshot released meanwhile: a 410 that names it
        raise TinkerError(e.status if e.status < 500 else 503, str(e.message)) from None
    fut: Future[Any] = Future()
    rid = svc.futures.track(who, fut)

    async def finish() -> None:
        try:
            await server.wait(seqs, wake)
            out = []
            for s in seqs:
                toks, lps, stopped = list(s.out_ids), list(s.out_logprobs), s.finish_reason == "stop"
                for j, t in enumerate(toks):
                    if t in stop_ids:
                        toks, lps, stopped = toks[: j + 1], lps[: j + 1], True
                        break
                out.append(Sampled(toks, lps, stopped))
            prompt_lps = seqs[0].prompt_logprobs if body.prompt_logprobs else None
            fut.set_result(Result(proto=write_sample_response(out, prompt_lps)))
        except APIError as e:
            try:
                svc.sampler(who, sampler.id)  # its snapshot released while the sample waited: say so
            except TinkerError as gone:
                fut.set_exception(gone)
                return
            fut.set_exception(TinkerError(e.status, str(e.message)))
        except BaseException as e:
            fut.set_exception(e)

    task = asyncio.create_task(finish())
    request.app.state.tinker_tasks.add(task)
    task.add_done_callback(request.app.state.tinker_tasks.discard)
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(len(seqs))]}


# ---- training runs and their checkpoints ----------------------------------------------------------------


@router.get("/training_runs/{model_id}")
async def get_training_run(model_id: str, request: Request) -> Any:
    who = owner(request)
    return await run(service_of(request).training_run, who, model_id)


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(model_id: str, kind: str, name: str, request: Request) -> Any:
    """The SDK's `RestClient.delete_checkpoint(run, "sampler_weights/<name>")` (tinker-cookbook's cleanup)."""
    who = owner(request)
    svc = service_of(request)
    if kind not in ("weights", "sampler_weights"):
        raise TinkerError(400, f"checkpoint kind {kind!r} must be weights or sampler_weights")
    path = f"tinker://{model_id}/{kind}/{svc.check_name(name)}"
    return await run(svc.delete_checkpoint, who, path)


# ---- futures ---------------------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Any:
    who = owner(request)
    body = await body_of(request, types.FutureRetrieveRequest)
    svc = service_of(request)
    fut = svc.futures.get(who, body.request_id)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), LONG_POLL_S)
    if not fut.done():
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    e = fut.exception()
    if e is not None:
        if isinstance(e, TinkerError):
            return {"error": e.message, "category": "user" if e.status < 500 else "server"}
        if isinstance(e, ValueError):
            return {"error": str(e), "category": "user"}
        return {"error": f"{type(e).__name__}: {e}", "category": "server"}
    res: Result = fut.result()
    if res.proto is not None:
        return Response(res.proto, media_type=PROTO)
    return res.json


# ---- the rest ----------------------------------------------------------------------------------------------


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def not_supported(rest: str, request: Request) -> Any:
    owner(request)
    raise TinkerError(
        404,
        f"{request.method} /api/v1/{rest} is not supported by this server (mint's Tinker-compatible training API; "
        "it serves sessions, create_model, forward/forward_backward, optim_step, save/load weights, sampling, "
        "futures, get_training_run and delete_checkpoint)",
    )
