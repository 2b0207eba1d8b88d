"""The main job's settings (`mint run`'s --config file, then MINT_RUN_*) and its error."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from mint_core.data.spec import demo_policies
from mint_core.errors import MintError
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.rl.recipe_defaults import RECIPE
from mint_core.settings import Settings
from mint_core.types import Device

ENV_PREFIX = "MINT_RUN_"
"""`mint run` reads MainJobConfig fields from MINT_RUN_<FIELD> environment variables (after its --config file)."""


class MainJobError(MintError):
    """The main job could not go on; says which step and what to do."""


class MainJobConfig(Settings):
    """What `mint run` does and where.

    `MainJobConfig.load(file, **flags)` reads the file, then MINT_RUN_<FIELD> environment variables, then flags."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    policies: list[str] = Field(default_factory=lambda: list(demo_policies()), min_length=1)
    """Registered tasks (`mint task list`; a user's with `--tasks DIR`), one policy per task, named after it.
    Default: the built-in demo's (`mint_core/data/builtin/demo.yaml`: the built-in tasks GRPO measurably improves
    on the built-in base)."""
    steps: int = Field(40, ge=1)
    """GRPO steps of the wave that trains every policy from its champion."""
    first_steps: int = Field(RECIPE.steps, ge=1)
    """GRPO steps of the first wave, for the policies that have no champion yet (trained from the base)."""
    prompts_per_step: int = Field(RECIPE.prompts_per_step, ge=1)
    """Prompts per policy per step, each sampled `group_size` times."""
    group_size: int = Field(RECIPE.group_size, ge=2)
    """GRPO group size G."""
    learning_rate: float = Field(RECIPE.learning_rate, gt=0)
    """AdamW learning rate of every policy's adapter."""
    temperature: float = Field(RECIPE.temperature, gt=0)
    """Sampling temperature of the rollouts."""
    rank: int | None = Field(None, ge=1)
    """LoRA rank of every policy (alpha = 2 x rank). Default: each task's spec's `recipe.rank`, else
    `RecipeDefaults.rank` (`rl.builder.recipe_spec`), with the learning rate scaled to it. The server the job starts accepts up to 32
    unless its serving config says otherwise (`ServicesConfig.serve_max_lora_rank`)."""
    eval_limit: int = Field(EVAL_LIMIT, ge=20)
    """Items per lm-eval task in the evaluation the gate reads (the suites hold 320, params.yaml
    eval_suites.limit; checks.eval wants >= 20). Why 320: mint_core.eval.results.EVAL_LIMIT."""
    guard_limit: int = Field(GUARD_LIMIT, ge=20)
    """Items per task of the guard group (generation, choice) in the gate's evaluation; the suites hold 320
    (params.yaml eval_suites.guard_limit). Why 320: mint_core.eval.results.GUARD_LIMIT."""
    seed: int = RECIPE.seed
    """Seeds the adapters' initialisation and the rollouts."""
    canary: list[str] | None = None
    """Policies whose first revision, once the gate passes it, is promoted through a canary (the online test on
    live traffic: users asking its task's held-out prompts) instead of at once. None: the first of `policies`;
    [] none. Names not in `policies` are ignored."""

    def canaried(self) -> list[str]:
        """The policies whose first revision goes through a canary (`canary`)."""
        return self.policies[:1] if self.canary is None else list(self.canary)

    canary_share: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of a policy's users (request keys) a canary answers, in the job's canaries."""
    canary_demo: bool = True
    """End with a canary of a deliberately worse candidate (the first policy's step-0 checkpoint: an adapter
    as PEFT initialises it, which answers as the base), which the online test rolls back."""
    traffic_concurrency: int = Field(8, ge=1)
    """Requests the built-in traffic generator keeps in flight to policies under a canary."""
    round: str | None = None
    """Names this run's training rounds (idempotency keys); default: a UTC timestamp, so every run trains."""
    state_dir: Path = Path(".mint")
    """Everything the job writes: run/ (services: pids, logs, databases, admin token), store/ (adapter store),
    catalog.db, lifecycle/ (checkpoints, cached task results)."""
    base: Path = Path("data/base")
    """The base the waves train and mint serve (or vLLM) serves: any Hugging Face causal-LM directory with its
    tokenizer (chat prompts use its chat template). Default: the built-in base (the DVC builtin_base stage's
    output)."""
    data_dir: Path = Path("data/tasks")
    """The task data (the DVC task_data stage's output)."""
    build: bool = True
    """Run the DVC step (off: use data/ as it is)."""
    host: str = "127.0.0.1"
    """Address the services bind to and are reached at."""
    mlflow_port: int = Field(5000, ge=1, le=65535)
    """MLflow tracking server, registry and UI."""
    prefect_port: int = Field(4200, ge=1, le=65535)
    """Prefect API and dashboard."""
    serve_port: int = Field(8000, ge=1, le=65535)
    """`mint serve` (the OpenAI/vLLM-compatible API)."""
    serving: Literal["mint", "vllm"] = "mint"
    """Who serves the policies (evaluation, promotion, completions): `mint`, the embedded engine in `mint serve`;
    `vllm`, a vLLM server from .venv-vllm (`make vllm-venv`) with `mint serve` as its front
    (`ServicesConfig.serving`). Training runs in this process either way."""
    replicas: int = Field(1, ge=1, le=8)
    """With serving vllm: vLLM replicas mint serve routes over, every revision loaded on each, all or nothing
    (`ServicesConfig.replicas`)."""
    worker_port: int = Field(4201, ge=1, le=65535)
    """Healthcheck of the Prefect worker that runs the deployments (dashboard runs, nightly retraining)."""
    torch_threads: int | None = Field(1, ge=1)
    """CPU threads of torch in this process (the trainer) and in a `mint serve` started here; None: torch's
    choice. 1 because on a 2-core machine shared with other busy processes OpenMP's spinning threads stall each
    other: a wave's GRPO step measured 1.2-2.2 s with 1 thread and 8-14 s with 2."""
    device: Device = "cpu"
    """Where the base, the adapters and the GRPO updates of the waves run, and what `mint serve` serves on: cpu,
    cuda or cuda:N; a CUDA device that is not visible stops the job before it starts anything."""
