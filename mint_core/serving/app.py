"""Build and run the embedded server from a ServingConfig (what `mint serve` does)."""

from __future__ import annotations

import logging
from pathlib import Path

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
    server.run()
