"""Build and run the embedded server: the FastAPI app over one engine, from a ServingConfig (`mint serve`).

Routes (the serving contract shared with a vLLM deployment, see infra/vllm/; one router each in serving/routes/):
  POST /v1/completions, POST /v1/chat/completions   (stream too; `model` = adapter name or the base's name)
  GET  /v1/models
  POST /v1/load_lora_adapter   {"lora_name", "lora_path", "load_inplace"}   (admin bearer token)
  POST /v1/unload_lora_adapter {"lora_name"}                               (admin bearer token)
  GET  /health, GET /metrics                                                (metrics: admin token with keys)
  POST /v1/mint/prefetch {"addresses", "wait"}                             (mint's extension, admin)
  PUT/DELETE/GET /v1/mint/canary/{name}, POST /v1/feedback                 (canary splits, scores: routes/canary.py)
  PUT/GET /v1/mint/router                                                  (`model: "auto"`'s router: routes/routing.py)
The Tinker training API (/api/v1/...) is not served from here: `mint_core.tinker.mount.build_app` builds this app
and mounts it (`mint serve` does), so serving never imports the training API that sits above it.
A /v1 body over `max_body_bytes` is refused with 413 before it is parsed (serving/body_limit.py).
Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with vLLM's types and codes; a field out
of its range is a 400 whose `param` names it (protocol.invalid_request).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType

import torch
import uvicorn
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from mint_core.engine.base import FAMILIES, Base, build_tiny_base, load_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.validate import BaseSpec
from mint_core.serving.base_check import check_base
from mint_core.serving.body_limit import BodyLimit
from mint_core.serving.canary import CanaryMiddleware, CanaryState
from mint_core.serving.config import ServingConfig
from mint_core.serving.http_errors import install_error_handlers, is_completion
from mint_core.serving.keys import KeyCounter, key_requests
from mint_core.serving.routes import canary, completions, extensions, health, models, routing
from mint_core.serving.routing import RoutingMiddleware, RoutingState, policy_name
from mint_core.serving.server import PromptLimits, Server

logger = logging.getLogger(__name__)
BUILTIN = {f"tiny-{family}": family for family in FAMILIES}


def load_serving_base(config: ServingConfig) -> Base:
    if config.base in BUILTIN:
        return build_tiny_base(
            BUILTIN[config.base],  # type: ignore[arg-type]
            seed=0,
            tokenizer=byte_tokenizer(),
            device=config.device,
        )
    path = Path(config.base)
    if not path.is_dir():
        raise FileNotFoundError(
            f"base {config.base!r} is neither a local model directory nor a built-in base ({', '.join(BUILTIN)})"
        )
    check_base(path, load_tokenizer=False)  # BaseError naming the directory and every problem, before loading
    return load_base(path, dtype=getattr(torch, config.dtype), device=config.device)


def build_app(config: ServingConfig, base: Base | None = None) -> FastAPI:
    """The server of `config.backend`: the engine in this process, or the front of a vLLM server (the one place
    where the two differ; both answer the same contract)."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    base = base or load_serving_base(config)
    name = config.served_model_name or (config.base if config.base in BUILTIN else Path(config.base).name)
    if config.backend == "vllm":
        from mint_core.serving.gateway import create_gateway

        # the front keeps what adapters are checked against (fingerprint, LoRA sites), not the weights
        spec = BaseSpec(
            base.fingerprint,
            base.sites,
            config.max_lora_rank,
            frozenset(base.sites) | {s.module_path for s in base.sites.values()},
        )
        positions = getattr(base.config, "max_position_embeddings", None) or config.max_model_len
        tok = base.tokenizer or byte_tokenizer()
        limits = PromptLimits(
            lambda p: list(tok(p)["input_ids"]),
            base.config.vocab_size,
            min(config.max_model_len, int(positions)),
        )
        del base
        return create_gateway(config, spec, name, tok, limits)
    root = Path(config.adapter_root)
    root.mkdir(parents=True, exist_ok=True)
    engine = Engine(
        base,
        EngineConfig(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_lora_rank=config.max_lora_rank,
            max_model_len=config.max_model_len,
            allowed_roots=[root.resolve()],
        ),
    )
    return create_app(engine, config, name)


def create_app(engine: Engine, config: ServingConfig, base_name: str) -> FastAPI:
    """The server over `engine`, serving the bare base as `base_name`."""
    server = Server(engine, config, base_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        logger.info("serving %s with %d adapter slots", base_name, engine.config.max_loras)
        yield
        for close in app.state.on_close:  # what was mounted on the app stops before the engine loop does
            await run_in_threadpool(close)
        await run_in_threadpool(server.close)  # finish what is queued and running

    app = FastAPI(title="mint", lifespan=lifespan)
    app.state.server = server
    app.state.on_close = []  # callables run at shutdown, before the server closes (a mounted API's own close)
    # each refusal reaches exactly one of the error handlers or the body limit (a body over it is never read, so
    # its model is unknown), and a route counts only what it answers itself: each is counted once
    install_error_handlers(app, lambda path, model, status: _count(server, path, model, status))
    app.state.canary, app.state.auth, app.state.base_name = CanaryState(), server.auth, base_name
    app.add_middleware(CanaryMiddleware, state=app.state.canary, served=lambda name: name != base_name)
    app.state.routing = RoutingState.start(config, server.metrics.registry)
    app.state.canary.on_score.append(app.state.routing.scored)

    async def served(scope: Scope) -> dict[str, bool]:
        """Every policy a request could name: the catalog's champions (cold) and the names held (resident)."""
        out = dict.fromkeys(await server.champions.get(), False)
        out.update((n, True) for n in server.engine.working_set.names() if policy_name(n) and n != base_name)
        return out

    app.add_middleware(  # outside the canary: the split and the key checks see the name the router chose
        RoutingMiddleware,
        state=app.state.routing,
        auth=server.auth,
        base_name=base_name,
        served=served,
        refused=lambda path, model, status: _count(server, path, model, status),
    )
    app.add_middleware(  # a body over the limit is refused before anything reads it
        BodyLimit,
        max_bytes=config.max_body_bytes,
        refused=lambda path: _count(server, path, None, 413),
    )
    app.add_middleware(
        KeyCounter, requests=key_requests(server.metrics.registry)
    )  # outermost: every answer, by key
    for routes in (completions, models, health, extensions, canary, routing):
        app.include_router(routes.router)
    return app


def _count(server: Server, path: str, model: object, status: int) -> None:
    """Count a completion request answered with an error."""
    if is_completion(path):
        server.metrics.refused(server.model_label(model), status)


def serve(config: ServingConfig, build: Callable[[ServingConfig], FastAPI] = build_app) -> None:
    """Run the app that `build` makes from `config` (`mint serve` passes the one with the Tinker API mounted)."""
    app = build(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=30
        )
    )
    # On SIGTERM uvicorn stops accepting, finishes the requests in flight (streams included), shuts the engine
    # loop down, then raises the signal again under the handler it found. With Python's default handler that
    # kills the process after the clean shutdown (status -15, as if it had been killed mid-request); a handler
    # of our own turns the re-raised signal into exit status 0. A SIGTERM before uvicorn installs its own
    # handlers exits 0 too: nothing is in flight yet.
    if threading.current_thread() is not threading.main_thread():
        server.run()
        return
    previous = signal.signal(signal.SIGTERM, _exit_after_shutdown)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_after_shutdown(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)
