"""The embedded server: OpenAI completions/chat and vLLM's LoRA admin routes over one resident engine.

Routes (the serving contract shared with a vLLM deployment, see infra/vllm/):
  POST /v1/completions, POST /v1/chat/completions   (stream too; `model` = adapter name or the base's name)
  GET  /v1/models
  POST /v1/load_lora_adapter   {"lora_name", "lora_path", "load_inplace"}   (admin bearer token)
  POST /v1/unload_lora_adapter {"lora_name"}                               (admin bearer token)
  GET  /health, GET /metrics
Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with vLLM's types and codes.
Every response names the adapter revision that served it in `system_fingerprint` (its sha256, or "base").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from mint_core.engine.engine import Engine
from mint_core.engine.loader import AdapterLoader
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.sequence import Request as GenRequest
from mint_core.engine.sequence import RequestError, Sequence
from mint_core.errors import AdapterError, MintError, UnknownAdapter
from mint_core.registry.catalog import AddressError, Catalog, CatalogConfig, UnknownAddress, parse_address
from mint_core.registry.store import AdapterStore, StoreError, UnknownRevision
from mint_core.serving.config import ServingConfig
from mint_core.serving.loop import EngineLoop
from mint_core.serving.metrics import Metrics

logger = logging.getLogger(__name__)


# catalog addresses a load request may name (a bare policy name stays a store path): policy@alias, policy/vN
_CATALOG_ADDRESS = re.compile(r"^[^/@]+(@[^/@]*|/v[^/]*)$")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param


def error_body(status: int, message: str, type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": status}}


# ---- request bodies (unknown fields are ignored, as vLLM does) ---------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CompletionBody(_Body):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False


class LoadBody(_Body):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class PrefetchBody(_Body):
    addresses: list[str] = Field(default_factory=list, max_length=100_000)
    wait: bool = False


class UnloadBody(_Body):
    lora_name: str = ""
    lora_int_id: int | None = None


# ---- the app --------------------------------------------------------------------------------------------


class Server:
    """State shared by the routes: the engine, its loop, config, metrics."""

    def __init__(self, engine: Engine, config: ServingConfig, base_name: str):
        self.engine = engine
        self.config = config
        self.base_name = base_name
        self.loop = EngineLoop(engine, config.max_num_seqs)
        self.root = Path(config.adapter_root).resolve()
        self.store = AdapterStore(self.root)
        self.catalog = Catalog(CatalogConfig(url=config.catalog_url)) if config.catalog_url else None
        # with a catalog, any catalog address is a model name: loaded on demand by the loader's threads
        self.loader = (
            AdapterLoader(engine, self.catalog, self.store, workers=config.loader_workers)
            if self.catalog is not None
            else None
        )
        self.metrics = Metrics(engine, self.loop, self.loader)
        self.sources: dict[str, str] = {}  # adapter name -> the lora_path it was loaded from
        self.created = int(time.time())

    # -- auth ------------------------------------------------------------------------------------------

    def check_api_key(self, request: Request) -> None:
        if self.config.api_key is not None:
            self._bearer(request, self.config.api_key.get_secret_value(), "api key")

    def check_admin(self, request: Request) -> None:
        self._bearer(request, self.config.admin_secret(), "admin token")

    @staticmethod
    def _bearer(request: Request, secret: str, what: str) -> None:
        header = request.headers.get("authorization", "")
        if header != f"Bearer {secret}":
            raise APIError(401, f"missing or wrong {what} (Authorization: Bearer ...)", "Unauthorized")

    # -- adapters ------------------------------------------------------------------------------------------

    async def resolve_model(self, model: str) -> str | None:
        """None for the base; the adapter name otherwise. A catalog address not loaded yet is loaded now (this
        request waits, the batch does not); 404 for anything unknown."""
        if model == self.base_name:
            return None
        ws = self.engine.working_set
        loaded = ws.get(model) is not None
        if self.loader is None or (loaded and not ws.is_ephemeral(model)):
            if loaded:
                return model
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return await self._ensure(model, hold=False)

    async def _ensure(self, model: str, hold: bool) -> str:
        assert self.loader is not None
        try:
            return await asyncio.wrap_future(self.loader.ensure(model, hold=hold))
        except AddressError:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model") from None
        except (UnknownAddress, UnknownRevision) as e:
            raise APIError(
                404, f"The model `{model}` does not exist: {e}", "NotFoundError", "model"
            ) from None
        except AdapterError as e:
            raise APIError(
                400, f"The model `{model}` cannot be loaded: {e}", "BadRequestError", "model"
            ) from None
        except (StoreError, MintError) as e:
            raise APIError(
                503, f"The model `{model}` cannot be loaded now: {e}", "ServiceUnavailableError"
            ) from None

    def resolve_path(self, lora_path: str) -> Path:
        """A directory inside the adapter store, or a content address `sha256:<hex>` of a stored revision
        (digest verified on the way out)."""
        if lora_path.startswith("sha256:"):
            try:
                return self.store.local_dir(lora_path)
            except ValueError as e:
                raise APIError(400, str(e), "BadRequestError", "lora_path") from None
            except UnknownRevision:
                raise APIError(
                    404,
                    f"No adapter found at {lora_path!r} in the adapter store {self.root}",
                    "NotFoundError",
                ) from None
            except StoreError as e:
                raise APIError(400, str(e), "BadRequestError", "lora_path") from None
        p = Path(lora_path)
        if self.catalog is not None and not (self.root / p).exists() and _CATALOG_ADDRESS.match(lora_path):
            try:
                return self.store.local_dir(self.catalog.resolve(lora_path).digest)
            except AddressError as e:
                raise APIError(400, str(e), "BadRequestError", "lora_path") from None
            except (UnknownAddress, UnknownRevision) as e:
                raise APIError(404, f"No adapter found at {lora_path!r}: {e}", "NotFoundError") from None
            except StoreError as e:
                raise APIError(400, str(e), "BadRequestError", "lora_path") from None
        real = (p if p.is_absolute() else self.root / p).resolve()
        if real != self.root and self.root not in real.parents:
            raise APIError(
                400,
                f"lora_path {lora_path!r} is outside the adapter store {self.root}",
                "BadRequestError",
                "lora_path",
            )
        return real

    # -- generation ------------------------------------------------------------------------------------

    def sampling(
        self,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        seed: int | None,
        stop: str | list[str] | None,
        logprobs: bool,
        top_logprobs: int,
        echo: bool,
        ignore_eos: bool,
        prompt_len: int,
    ) -> SamplingParams:
        limit = self.engine.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = max(1, min(16, limit))
        if max_tokens < (0 if echo else 1) or max_tokens > limit:
            if limit < 1 and not echo:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.engine.max_model_len} tokens; the prompt has "
                    f"{prompt_len}.",
                    "BadRequestError",
                    "prompt",
                )
            raise APIError(
                400,
                f"max_tokens must be between {0 if echo else 1} and {max(limit, 0)} for this prompt, got {max_tokens}",
                "BadRequestError",
                "max_tokens",
            )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if temperature is None else temperature,
                top_p=1.0 if top_p is None else top_p,
                seed=seed,
                stop=stops,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                echo=echo,
                ignore_eos=ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e).replace("\n", " "), "BadRequestError") from None

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.engine._encode(prompt) if prompt else []
        if not ids:
            raise APIError(400, "prompt is empty", "BadRequestError", "prompt")
        vocab = self.engine.base.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "BadRequestError", "prompt")
        return ids

    async def submit(
        self,
        adapter: str | None,
        ids: list[int],
        params: SamplingParams,
        wake: asyncio.Queue[None],
    ) -> Sequence:
        """Queue one sequence; `wake` gets an item whenever it makes progress (one queue per HTTP request)."""
        aloop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        state = {"last": t0, "n": 0}

        def on_event(seq: Sequence) -> None:  # engine-loop thread
            now = time.perf_counter()
            if len(seq.out_ids) > state["n"]:
                if state["n"] == 0:
                    self.metrics.ttft.observe(now - t0)
                else:
                    self.metrics.itl.observe(now - state["last"])
                state["n"], state["last"] = len(seq.out_ids), now
            if seq.finished:
                self.metrics.e2e.observe(now - t0)
            # RuntimeError: the event loop is gone (shutdown); the sequence still finishes
            with contextlib.suppress(RuntimeError):
                aloop.call_soon_threadsafe(wake.put_nowait, None)

        ws = self.engine.working_set
        if adapter is not None and ws.is_ephemeral(adapter):
            # hold the on-demand name until admission, so a burst of other loads cannot evict it in between
            held: str | None = adapter
            if not ws.hold(adapter):
                await self._ensure(adapter, hold=True)
        else:
            held = None
        try:
            seq = self.loop.submit(GenRequest(ids, adapter, params), on_event, held=held)
        except BaseException as e:
            if held is not None:
                ws.unhold(held)
            if isinstance(e, UnknownAdapter):
                raise APIError(404, str(e), "NotFoundError", "model") from None
            if isinstance(e, RequestError):
                raise APIError(400, str(e), "BadRequestError", "prompt") from None
            if isinstance(e, MintError):
                raise APIError(503, str(e), "ServiceUnavailableError") from None
            raise
        return seq

    async def wait(self, seqs: list[Sequence], wake: asyncio.Queue[None]) -> None:
        """Until every sequence finished; cancels them all if the request goes away first."""
        try:
            while not all(s.finished for s in seqs):
                await wake.get()
        except BaseException:
            for s in seqs:
                self.loop.cancel(s)
            raise
        for s in seqs:
            if s.error is not None:
                raise APIError(500, f"generation failed: {s.error}", "InternalServerError")

    async def submit_all(
        self, jobs: list[tuple[str | None, list[int], SamplingParams]], wake: asyncio.Queue[None]
    ) -> list[Sequence]:
        seqs: list[Sequence] = []
        try:
            for adapter, ids, params in jobs:
                seqs.append(await self.submit(adapter, ids, params, wake))
        except BaseException:
            for s in seqs:
                self.loop.cancel(s)
            raise
        return seqs

    async def run(
        self,
        model: str,
        jobs: list[tuple[str | None, list[int], SamplingParams]],
        rid: str,
        obj: str,
        stream_options: dict[str, Any] | None,
        render: ChoiceRender,
    ) -> StreamingResponse | list[Sequence]:
        """Submit the request's sequences; a stream when `stream_options` is not None (the request asked to
        stream), else wait for all of them and return them finished."""
        wake: asyncio.Queue[None] = asyncio.Queue()
        seqs = await self.submit_all(jobs, wake)
        if stream_options is not None:
            usage = bool(stream_options.get("include_usage"))
            events = _stream(self, model, obj, rid, seqs, wake, usage, render)
            return StreamingResponse(events, media_type="text/event-stream")
        await self.wait(seqs, wake)
        self.count(model, seqs, "200")
        return seqs

    def count(self, model: str, seqs: list[Sequence], outcome: str) -> None:
        self.metrics.requests.labels(model=model, outcome=outcome).inc()
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in seqs))
        self.metrics.generation_tokens.inc(sum(len(s.out_ids) for s in seqs))

    def fingerprint(self, seqs: list[Sequence]) -> str:
        revs = {s.revision or "base" for s in seqs}
        return ",".join(sorted(revs))


def _token_text(engine: Engine, ids: list[int]) -> list[str]:
    return [engine.decode([t]) for t in ids]


def _completion_logprobs(engine: Engine, s: Sequence, prefix_len: int) -> dict[str, Any]:
    ids: list[int] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    want_top = s.params.top_logprobs > 0
    if s.params.echo:
        ids += s.prompt_ids
        lps += s.prompt_logprobs or [None] * len(s.prompt_ids)
        tops += [
            None if t is None else {engine.decode([k]): v for k, v in t.items()}
            for t in (s.prompt_top or [None] * len(s.prompt_ids))
        ]
    ids += s.out_ids
    lps += list(s.out_logprobs)
    tops += (
        [{engine.decode([k]): v for k, v in t.items()} for t in s.top]
        if want_top
        else [None] * len(s.out_ids)
    )
    texts = _token_text(engine, ids)
    offsets, pos = [], prefix_len
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": tops if want_top else None,
        "text_offset": offsets,
    }


def _chat_prompt(engine: Engine, messages: list[ChatMessage]) -> str:
    msgs = []
    for m in messages:
        content = (
            m.content
            if isinstance(m.content, str)
            else "".join(part.get("text", "") for part in (m.content or []) if isinstance(part, dict))
        )
        msgs.append({"role": m.role, "content": content})
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        return str(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class _Deltas:
    """Text a stream may send so far: whole characters only, and nothing a stop string could still claim."""

    def __init__(self, engine: Engine, seq: Sequence):
        self.engine, self.seq, self.sent = engine, seq, 0
        self.hold = max((len(x) for x in seq.params.stop), default=1) - 1

    def next(self) -> tuple[str, bool]:
        """(text to send now, whether the sequence had finished when it was read).

        The engine thread may finish the sequence while this runs, so callers must use the flag returned here,
        not read `seq.finished` again: text read before the last token must not go out as the final chunk.
        """
        s = self.seq
        if s.finished:  # out_ids and cut_text are complete once finish_reason is set
            text = s.cut_text if s.cut_text is not None else self.engine.decode(s.out_ids)
            out, self.sent = text[self.sent :], len(text)
            return out, True
        text = self.engine.decode(s.out_ids)
        ready = len(text) - self.hold
        while ready > self.sent and text[ready - 1] == "\ufffd":  # a character still being spelled in bytes
            ready -= 1
        if ready <= self.sent:
            return "", False
        out, self.sent = text[self.sent : ready], ready
        return out, False


def create_app(engine: Engine, config: ServingConfig, base_name: str) -> FastAPI:
    server = Server(engine, config, base_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        logger.info("serving %s with %d adapter slots", base_name, engine.config.max_loras)
        yield
        await run_in_threadpool(server.loop.stop)  # finish what is queued and running
        if server.loader is not None:
            server.loader.close()

    app = FastAPI(title="mint", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        if e.status >= 400 and request.url.path.startswith("/v1/") and "completions" in request.url.path:
            # label only names the server serves: a client must not be able to mint label values
            model = getattr(request.state, "model", None)
            known = model == server.base_name or model in engine.working_set.names()
            server.metrics.requests.labels(model=model if known else "_unknown", outcome=str(e.status)).inc()
        return JSONResponse(error_body(e.status, e.message, e.type, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        if any(err.get("type") == "json_invalid" for err in errs):
            msg = f"malformed JSON body: {errs[0].get('ctx', {}).get('error', 'cannot be parsed')}"
        else:
            parts = []
            for err in errs[:5]:
                field = ".".join(str(x) for x in err.get("loc", ())[1:]) or "body"
                parts.append(f"{field}: {err.get('msg')}")
            msg = "; ".join(parts) or "invalid request"
        return JSONResponse(error_body(400, msg, "BadRequestError"), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        if not server.loop.alive:
            return JSONResponse(
                error_body(503, "engine loop is not running", "ServiceUnavailableError"), status_code=503
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = server.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.check_api_key(request)
        cards = [
            {
                "id": base_name,
                "object": "model",
                "created": server.created,
                "owned_by": "mint",
                "root": base_name,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
        ]
        for name, digest in sorted(engine.working_set.names().items()):
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "mint",
                    "root": server.sources.get(name, f"sha256:{digest}"),
                    "parent": base_name,
                    "revision": f"sha256:{digest}",
                }
            )
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request, body: LoadBody) -> Response:
        server.check_admin(request)
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if body.lora_name == base_name:
            raise APIError(400, f"'{base_name}' is the base model's name", "InvalidUserInput", "lora_name")
        path = server.resolve_path(body.lora_path)
        if body.lora_name in engine.working_set.names() and not body.load_inplace:
            raise APIError(
                400, f"The lora adapter '{body.lora_name}' has already been loaded.", "InvalidUserInput"
            )
        if not path.exists():
            raise APIError(
                404,
                f"No adapter found at {body.lora_path!r} (in the adapter store {server.root})",
                "NotFoundError",
            )
        try:
            await run_in_threadpool(engine.load_adapter, body.lora_name, path, body.load_inplace)
        except AdapterError as e:
            raise APIError(400, str(e), "BadRequestError", "lora_path") from None
        server.sources[body.lora_name] = body.lora_path
        logger.info(
            "loaded adapter %s from %s (in place: %s)", body.lora_name, body.lora_path, body.load_inplace
        )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/mint/prefetch")
    async def prefetch(request: Request, body: PrefetchBody) -> dict[str, Any]:
        """mint's extension: schedule cold loads of catalog addresses ahead of need (admin). With `wait`,
        answer once they are loaded, with each address's outcome."""
        server.check_admin(request)
        if server.loader is None:
            raise APIError(400, "this server has no catalog (set catalog_url)", "BadRequestError")
        bad = []
        for a in body.addresses:
            try:
                parse_address(a)
            except AddressError as e:
                bad.append(str(e))
        if bad:
            raise APIError(400, "; ".join(bad[:5]), "BadRequestError", "addresses")
        futures = server.loader.prefetch(body.addresses)
        if not body.wait:
            return {"scheduled": len(futures)}
        results: dict[str, str] = {}
        for a, f in zip(body.addresses, futures, strict=True):
            try:
                await asyncio.wrap_future(f)
                results[a] = "loaded"
            except Exception as e:
                results[a] = f"error: {e}"
        return {"scheduled": len(futures), "results": results}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request, body: UnloadBody) -> Response:
        server.check_admin(request)
        if not body.lora_name:
            raise APIError(400, "'lora_name' needs to be provided.", "InvalidUserInput")
        if not engine.unload_adapter(body.lora_name):
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError")
        server.sources.pop(body.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, body: CompletionBody) -> Response | dict[str, Any]:
        server.check_api_key(request)
        request.state.model = body.model
        adapter = await server.resolve_model(body.model)
        prompts: list[str | list[int]]
        if isinstance(body.prompt, str):
            prompts = [body.prompt]
        elif body.prompt and isinstance(body.prompt[0], int):
            prompts = [list(body.prompt)]  # type: ignore[arg-type]
        else:
            prompts = list(body.prompt)  # type: ignore[arg-type]
        if not prompts:
            raise APIError(400, "prompt is empty", "BadRequestError", "prompt")
        if body.stream and body.echo:
            raise APIError(400, "echo is not supported with stream", "BadRequestError", "echo")
        jobs = []
        for p in prompts:
            ids = server.tokenize(p)
            for j in range(body.n):
                params = server.sampling(
                    body.max_tokens,
                    body.temperature,
                    body.top_p,
                    None if body.seed is None else body.seed + j,
                    body.stop,
                    body.logprobs is not None,
                    body.logprobs or 0,
                    body.echo,
                    body.ignore_eos,
                    len(ids),
                )
                jobs.append((p, ids, params))
        rid = f"cmpl-{uuid.uuid4().hex}"
        opts = (body.stream_options or {}) if body.stream else None
        ran = await server.run(
            body.model,
            [(adapter, i, p) for _, i, p in jobs],
            rid,
            "text_completion",
            opts,
            _completion_choices,
        )
        if isinstance(ran, StreamingResponse):
            return ran
        seqs = ran
        choices = []
        for i, ((p, _, params), s) in enumerate(zip(jobs, seqs, strict=True)):
            text = s.completion(engine.decode).text
            prefix = ""
            if params.echo:
                prefix = p if isinstance(p, str) else engine.decode(list(p))
            choices.append(
                {
                    "index": i,
                    "text": prefix + text,
                    "logprobs": _completion_logprobs(engine, s, 0) if params.logprobs else None,
                    "finish_reason": s.finish_reason,
                    "stop_reason": None,
                }
            )
        usage = _usage(seqs)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": server.fingerprint(seqs),
            "choices": choices,
            "usage": usage,
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, body: ChatBody) -> Response | dict[str, Any]:
        server.check_api_key(request)
        request.state.model = body.model
        adapter = await server.resolve_model(body.model)
        ids = server.tokenize(_chat_prompt(engine, body.messages))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        jobs = []
        for j in range(body.n):
            params = server.sampling(
                max_tokens,
                body.temperature,
                body.top_p,
                None if body.seed is None else body.seed + j,
                body.stop,
                body.logprobs,
                body.top_logprobs or 0,
                False,
                body.ignore_eos,
                len(ids),
            )
            jobs.append((adapter, ids, params))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        opts = (body.stream_options or {}) if body.stream else None
        ran = await server.run(body.model, jobs, rid, "chat.completion.chunk", opts, _chat_choices)
        if isinstance(ran, StreamingResponse):
            return ran
        seqs = ran
        choices = []
        for i, s in enumerate(seqs):
            lp = None
            if body.logprobs:
                toks = _token_text(engine, s.out_ids)
                lp = {
                    "content": [
                        {
                            "token": t,
                            "logprob": v,
                            "bytes": list(t.encode()),
                            "top_logprobs": [
                                {"token": engine.decode([k]), "logprob": x}
                                for k, x in (s.top[n] if n < len(s.top) else {}).items()
                            ],
                        }
                        for n, (t, v) in enumerate(zip(toks, s.out_logprobs, strict=False))
                    ]
                }
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": s.completion(engine.decode).text},
                    "logprobs": lp,
                    "finish_reason": s.finish_reason,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": server.fingerprint(seqs),
            "choices": choices,
            "usage": _usage(seqs),
        }

    return app


def _usage(seqs: list[Sequence]) -> dict[str, int]:
    prompt = sum(len(s.prompt_ids) for s in seqs)
    completion = sum(len(s.out_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _progress(seqs: list[Sequence], wake: asyncio.Queue[None]) -> AsyncIterator[None]:
    """Yields whenever any of the sequences made progress, until all finished, then once more: a sequence can
    finish while the caller handles the previous yield, after it was read as running."""
    while not all(s.finished for s in seqs):
        await wake.get()
        while not wake.empty():
            wake.get_nowait()
        yield
    yield


ChoiceRender = Callable[[int, Sequence, str, bool, bool], list[dict[str, Any]]]


async def _stream(
    server: Server,
    model: str,
    obj: str,
    rid: str,
    seqs: list[Sequence],
    wake: asyncio.Queue[None],
    include_usage: bool,
    render: ChoiceRender,
) -> AsyncIterator[str]:
    """The SSE loop both endpoints share: each choice's new text as it comes (`render` shapes it), usage if asked,
    then [DONE]; if the client goes away, whatever is still running is cancelled."""
    created = int(time.time())
    deltas = [_Deltas(server.engine, s) for s in seqs]
    reported = [False] * len(seqs)

    def event(
        choices: list[dict[str, Any]], fp: str | None = None, usage: dict[str, int] | None = None
    ) -> str:
        e: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
        if fp is not None:
            e["system_fingerprint"] = fp
        e["choices"] = choices
        if usage is not None:
            e["usage"] = usage
        return _sse(e)

    try:
        for i, s in enumerate(seqs):
            for c in render(i, s, "", False, True):
                yield event([c], s.revision or "base")
        async for _ in _progress(seqs, wake):
            for i, (s, d) in enumerate(zip(seqs, deltas, strict=True)):
                if reported[i]:
                    continue
                text, done = d.next()  # one read of `finished`: the text is final when done
                for c in render(i, s, text, done, False):
                    yield event([c], s.revision or "base")
                reported[i] = done
        server.count(model, seqs, "200")
        if include_usage:
            yield event([], usage=_usage(seqs))
        yield _sse("[DONE]")
    finally:
        for s in seqs:
            if not s.finished:
                server.loop.cancel(s)


def _completion_choices(i: int, s: Sequence, text: str, done: bool, first: bool) -> list[dict[str, Any]]:
    if first or not (text or done):
        return []
    return [{"index": i, "text": text, "logprobs": None, "finish_reason": s.finish_reason if done else None}]


def _chat_choices(i: int, s: Sequence, text: str, done: bool, first: bool) -> list[dict[str, Any]]:
    if first:
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    out = []
    if text:
        out.append({"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None})
    if done:
        out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": s.finish_reason})
    return out
