"""Build and run the embedded server from a ServingConfig (what `mint serve` does)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import torch
import uvicorn
from fastapi import FastAPI

from mint_core.engine.base import Base, build_tiny_base, load_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.serving.config import ServingConfig
from mint_core.serving.server import create_app

logger = logging.getLogger(__name__)
BUILTIN = {"tiny-dense": "dense", "tiny-moe": "moe", "tiny-mla": "mla"}


def load_serving_base(config: ServingConfig) -> Base:
    if config.base in BUILTIN:
        return build_tiny_base(BUILTIN[config.base], seed=0, tokenizer=byte_tokenizer())  # type: ignore[arg-type]
    path = Path(config.base)
    if not path.is_dir():
        raise FileNotFoundError(
            f"base {config.base!r} is neither a local model directory nor a built-in base ({', '.join(BUILTIN)})"
        )
    return load_base(path, dtype=getattr(torch, config.dtype), device=config.device)


def build_app(config: ServingConfig, base: Base | None = None) -> FastAPI:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    base = base or load_serving_base(config)
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
    name = config.served_model_name or (config.base if config.base in BUILTIN else Path(config.base).name)
    return create_app(engine, config, name)


def serve(config: ServingConfig) -> None:
    app = build_app(config)
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
