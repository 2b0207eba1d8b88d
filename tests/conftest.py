"""Shared fixtures: tiny random bases of each family (built from configs, no download) and engines over them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mint_core.engine.base import FAMILIES as ALL_FAMILIES
from mint_core.engine.base import Base, Family, build_tiny_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.types import Site

FAMILIES: list[Family] = list(ALL_FAMILIES)

# as mint_app does: MLflow's telemetry thread edits os.environ while Prefect's settings iterate it (a KeyError)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# Short names targeted per family in tests. On MoE models PEFT 0.21 rewrites target_modules named
# gate_proj/up_proj/down_proj into fused expert parameters, so dense-MLP and shared-expert linears of MoE
# bases are left out of adapters that PEFT must load (mint itself serves them).
TARGETS: dict[str, list[str]] = {
    "dense": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
    "mla": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj"],
    # DSA: MLA's projections; its indexer is frozen (mint_core.engine.base.FROZEN_MODULES)
    "dsa": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj"],
}


NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False on this machine"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
"""Parametrise a test with `device` over these: the cheap cpu run in every suite, the same check on CUDA where a GPU
is visible (skipped with the reason elsewhere, CI included: a skip, never a failure)."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


def peft_loadable_sites(family: str, sites: dict[str, Site]) -> dict[str, Site]:
    if family == "dense":
        return dict(sites)
    return {
        k: s for k, s in sites.items() if s.experts or not k.endswith(("gate_proj", "up_proj", "down_proj"))
    }


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tokenizer():  # type: ignore[no-untyped-def]
    return byte_tokenizer()


@pytest.fixture
def make_base(tokenizer) -> Callable[..., Base]:  # type: ignore[no-untyped-def]
    """make_base(family, seed=0, device="cpu"): a fresh tiny base (same seed -> same weights and fingerprint, on
    any device)."""

    def make(family: Family = "dense", seed: int = 0, device: str = "cpu", **overrides) -> Base:  # type: ignore[no-untyped-def]
        return build_tiny_base(family, seed=seed, tokenizer=tokenizer, device=device, **overrides)

    return make


@pytest.fixture
def make_engine(make_base) -> Callable[..., Engine]:  # type: ignore[no-untyped-def]
    """make_engine(family="dense", seed=0, device="cpu", **EngineConfig fields)."""

    def make(family: Family = "dense", seed: int = 0, device: str = "cpu", **config) -> Engine:  # type: ignore[no-untyped-def]
        config.setdefault("max_loras", 4)
        config.setdefault("max_lora_rank", 16)
        return Engine(make_base(family, seed, device), EngineConfig(**config))

    return make


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    d = tmp_path / "adapters"
    d.mkdir()
    return d
