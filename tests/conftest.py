"""Shared fixtures: tiny random bases of each family (built from configs, no download) and engines over them."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


# ---- two workers (`make test` runs `pytest -n 2`, pytest-xdist) -----------------------------------------------
# A module runs whole on one worker, so its module-scoped stack starts once, and the modules that reach the
# session's vLLM all run on the same worker, so a session starts one vLLM, not one per worker. (xdist's own
# `--dist loadgroup` cannot say this under pytest 9: its group suffix is written to an attribute pytest 9 no longer
# reads, so a scheduler of our own groups the node ids.)

SHARED_VLLM_MODULES = frozenset(
    {
        "test_canary_flow.py",
        "test_canary_serving.py",
        "test_hot_swap.py",
        "test_lifecycle.py",
        "test_metrics_vs_vllm.py",
        "test_routing_serving.py",
        "test_serving_contract.py",
        "test_serving_keys.py",
        "test_serving_store.py",
        "test_vllm_golden.py",
        "test_vllm_resolver.py",
        "test_vllm_seal.py",
    }
)
"""The modules that use the session's vLLM (`vllm_server`, or `endpoint` through its vllm parameter)."""


SHARED_MLFLOW_PG_MODULES = frozenset({"test_registry.py", "test_services.py"})
"""The modules that use the session's MLflow on PostgreSQL (`mlflow_server_pg`): on one worker, it starts once."""


def room(nodeid: str) -> str:
    """What one worker runs whole: a test's module, "vllm" for every module of SHARED_VLLM_MODULES, "mlflow-pg" for
    every module of SHARED_MLFLOW_PG_MODULES."""
    module = nodeid.split("::", 1)[0]
    name = Path(module).name
    if name in SHARED_VLLM_MODULES:
        return "vllm"
    return "mlflow-pg" if name in SHARED_MLFLOW_PG_MODULES else module


@functools.cache
def asks_for_session_vllm(path: Path) -> bool:
    """The module asks for the session's vLLM by name at run time (`request.getfixturevalue`); read once."""
    return 'getfixturevalue("vllm_server")' in path.read_text()


def uses_session_vllm(item: pytest.Item) -> bool:
    if any(name in item.fixturenames for name in ("vllm_server", "endpoint")):
        return True
    return item.path.suffix == ".py" and asks_for_session_vllm(item.path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A module that uses the session's vLLM (or MLflow on PostgreSQL) but is missing from SHARED_VLLM_MODULES (or
    SHARED_MLFLOW_PG_MODULES) would start a second one on the other worker: refuse to run, naming it."""
    missing = sorted({item.path.name for item in items if uses_session_vllm(item)} - SHARED_VLLM_MODULES)
    if missing:
        raise pytest.UsageError(
            f"{', '.join(missing)} use the session's vLLM: add them to SHARED_VLLM_MODULES in tests/conftest.py"
        )
    missing = sorted(
        {item.path.name for item in items if "mlflow_server_pg" in getattr(item, "fixturenames", ())}
        - SHARED_MLFLOW_PG_MODULES
    )
    if missing:
        raise pytest.UsageError(
            f"{', '.join(missing)} use the session's MLflow on PostgreSQL: add them to SHARED_MLFLOW_PG_MODULES in "
            "tests/conftest.py"
        )


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is a dev dependency; without it tests run in one process
    pass
else:

    class RoomScheduling(LoadScopeScheduling):
        """xdist's load-by-scope scheduling with `room` as the scope, in collection order: the vLLM room (the
        longest, from the second integration module) and the stacks of the integration modules first, the unit
        modules' many short tests last, where they fill the end of the run evenly. (xdist's default order, by the
        number of tests in a scope, would leave a stack of few tests for the end.)"""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            return room(nodeid)

    TERMINAL = ("COLUMNS", "LINES")

    def pytest_configure_node(node: Any) -> None:
        """The controller's terminal variables, for its workers: they start with COLUMNS=80 in their environment
        where the controller has none, and a console made in a worker would then cut a table at 80 columns."""
        node.workerinput["terminal"] = {name: os.environ.get(name) for name in TERMINAL}

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
        if (
            config.getvalue("dist") != "loadgroup"
        ):  # the grouping `make test` asks for; any other --dist is kept
            return None
        return RoomScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, the terminal variables are the controller's (pytest_configure_node)."""
    terminal = getattr(config, "workerinput", {}).get("terminal", {})
    for name, value in terminal.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


@pytest.fixture
def register_tasks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Register task folders for one test ($MINT_TASK_DIRS, the registry read again), and forget them after."""
    from mint_core.data.spec import TASK_DIRS_ENV, reload_registry

    def register(*folders: Path) -> None:
        monkeypatch.setenv(TASK_DIRS_ENV, ":".join(str(f) for f in folders))
        reload_registry()

    yield register
    monkeypatch.delenv(TASK_DIRS_ENV, raising=False)
    reload_registry()
