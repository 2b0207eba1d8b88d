"""Training steps: check the prompts, start the training run (mint_core.rl.recipe) from the champions, then per
step one batched rollout, its check, and one batched GRPO update."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import ConfigDict

from mint_core.data.checks import (
    CheckParams,
    PromptBounds,
    RolloutBounds,
    check,
    prompts_frame,
    rollout_frame,
)
from mint_core.data.tasks import Example
from mint_core.errors import DataCheckError
from mint_core.lifecycle import Workspace, fault, load_prompts
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.recipe import TrainingRun, load_trainer
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import PolicySpec
from tasks.common import Timed, artifact_key


@contextmanager
def _stored_on_failure(what: str) -> Iterator[None]:
    """A failing suite stops the work; its failing expectations and the full result are kept with the flow run
    (a Prefect artifact) before the error goes up."""
    try:
        yield
    except DataCheckError as e:
        result = json.dumps(e.result_json, indent=1, default=str)
        if len(result) > 50_000:
            result = result[:50_000] + "\n... (truncated)"
        body = "\n".join(f"- {f}" for f in e.failures)
        create_markdown_artifact(
            markdown=f"### {e.suite} check failed on {e.source or what}\n\n{body}\n\n```json\n{result}\n```",
            key=artifact_key("check-failed", what),
            description=f"Great Expectations: {len(e.failures)} failing expectation(s)",
        )
        raise


class PromptSet(Timed):
    """A policy's training prompts, checked."""

    policy: str
    examples: list[Example]
    source: str
    """The file they were read from, or how they were generated."""
    expectations: int
    """Great Expectations checks they passed."""


class RolloutBatch(Timed):
    """One batched rollout of every policy in training."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    step: int
    rows: list[RolloutRow]


class RolloutCheck(Timed):
    rows: int
    expectations: int


class StepResult(Timed):
    """One GRPO update of every policy."""

    step: int
    """Steps done after this update (1-based)."""
    reward: dict[str, float]
    """Mean rollout reward per policy (every policy in the batch, updated or not)."""
    loss: dict[str, float]
    """Per policy that was updated (a policy whose groups all had equal rewards gets no step)."""
    kept_groups: dict[str, int]
    """Groups with reward variance (the ones that teach anything) per policy."""


@task(cache_policy=NO_CACHE)
def validate_data(
    spec: PolicySpec,
    n: int,
    seed: int,
    data_dir: Path | None,
    bounds: PromptBounds,
    round_name: str | None = None,
) -> PromptSet:
    """Load a policy's training prompts (the round's draw, see `load_prompts`) and check them with the prompts
    suite (Great Expectations)."""
    t0 = time.perf_counter()
    examples, source = load_prompts(spec.task, n, seed, data_dir, round_name)
    with _stored_on_failure(f"prompts {spec.name}"):
        report = check(prompts_frame(examples), "prompts", CheckParams(prompts=bounds), source=source)
    return PromptSet(
        policy=spec.name,
        examples=examples,
        source=source,
        expectations=report.evaluated,
        work_s=time.perf_counter() - t0,
    )


@task(cache_policy=NO_CACHE)
def start_training(
    ws: Workspace,
    specs: list[PolicySpec],
    parents: dict[str, str | None],
    grpo: GRPOConfig,
    seed: int,
    prompts: dict[str, list[Example]],
    steps: int,
    prompts_per_step: int,
    checkpoint_every: int,
    checkpoint_dir: Path,
) -> TrainingRun:
    """Load the base, put every policy's parent (digest; None: fresh) in its slot, resume from a checkpoint."""
    store = ws.registry().store
    dirs = {name: None if digest is None else store.local_dir(digest) for name, digest in parents.items()}
    trainer = load_trainer(ws.base, specs, grpo, seed, dirs, device=ws.device)
    return TrainingRun.start(trainer, prompts, steps, prompts_per_step, checkpoint_dir, checkpoint_every)


@task(cache_policy=NO_CACHE)
def rollout(run: TrainingRun) -> RolloutBatch:
    """One batched rollout: G samples of every prompt of every policy, rewards attached."""
    t0 = time.perf_counter()
    rows = run.rollout()
    return RolloutBatch(step=run.trainer.steps + 1, rows=rows, work_s=time.perf_counter() - t0)


@task(cache_policy=NO_CACHE)
def validate_rollouts(batch: RolloutBatch, bounds: RolloutBounds) -> RolloutCheck:
    """Check a rollout batch with the rollouts suite before an update reads it."""
    t0 = time.perf_counter()
    with _stored_on_failure(f"rollouts step {batch.step}"):
        report = check(
            rollout_frame(batch.rows),
            "rollouts",
            CheckParams(rollouts=bounds),
            source=f"step {batch.step}",
            quick=True,
        )
    return RolloutCheck(rows=report.rows, expectations=report.evaluated, work_s=time.perf_counter() - t0)


@task(cache_policy=NO_CACHE)
def grpo_update(run: TrainingRun, batch: RolloutBatch) -> StepResult:
    """One batched GRPO update of every policy (each in its own slot)."""
    t0 = time.perf_counter()
    fault("grpo_update")
    stats = run.update(batch.rows)
    return StepResult(
        step=stats.step,
        reward=stats.reward,
        loss=stats.loss,
        kept_groups=stats.kept_groups,
        work_s=time.perf_counter() - t0,
    )
