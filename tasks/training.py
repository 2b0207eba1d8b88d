"""Training steps: check the prompts, start the training run (mint_core.rl.recipe) from the champions, then per
step one batched rollout, its check, and one batched GRPO update; with early stopping, a greedy probe of every
policy still training every few steps (the rule that reads it: `mint_core.eval.early_stop`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import ConfigDict, Field

from mint_core.data.checks import (
    CheckParams,
    PromptBounds,
    RolloutBounds,
    check,
    check_task,
    prompts_frame,
    rollout_frame,
)
from mint_core.data.generators import Example, has_generator
from mint_core.data.revision import evaluated_prompts, fresh_examples, probe_examples, train_prompts
from mint_core.data.rewards import check_rewards
from mint_core.data.spec import prompt_text
from mint_core.data.spec import registry as task_registry
from mint_core.errors import DataCheckError
from mint_core.eval.early_stop import Probe, take_probe
from mint_core.eval.suites import check_eval
from mint_core.lifecycle.errors import LifecycleError
from mint_core.lifecycle.faults import fault
from mint_core.lifecycle.prompts import load_prompts, round_seed, with_replay
from mint_core.lifecycle.workspace import Workspace
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe import RecipeConfig, TrainingRun
from mint_core.rl.rollout import RolloutRow
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
    """A policy's training prompts, checked, and its probe items."""

    policy: str
    examples: list[Example]
    source: str
    """The file they were read from, or how they were generated."""
    expectations: int
    """Great Expectations checks they passed."""
    fresh_seed: int | None = None
    """The generator seed of a fresh draw (None: read from the train split)."""
    probe: list[Example] = Field(default_factory=list)
    """Held-out items early stopping probes the policy on (empty: no probe); none is a training prompt, an
    evaluated prompt or a train-split prompt."""


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
    fresh: bool = False,
    suites_data: Path | None = None,
    probe: int = 0,
) -> PromptSet:
    """Draw a policy's training prompts and check them with the prompts suite (Great Expectations): the round's
    draw from the train split (`load_prompts`), or with `fresh` new ones from the task's generator at the round's
    seed (`round_seed`), leaving out every prompt evaluation reads (`data_dir/heldout`, the suites' data in
    `suites_data`) and the probe's. `probe`: that many probe items for early stopping, outside those and the
    train split."""
    t0 = time.perf_counter()
    if (fresh or probe) and data_dir is None:
        raise LifecycleError(
            f"{spec.name}: fresh prompts and probes need data_dir (the DVC task data) to leave its held-out "
            "prompts out"
        )
    evaluated: set[str] = set()
    if data_dir is not None and (fresh or probe):
        evaluated = evaluated_prompts(data_dir, *[d for d in [suites_data] if d])
    probe_items: list[Example] = []
    if probe and data_dir is not None:
        probe_items = probe_examples(spec.task, probe, evaluated | train_prompts(data_dir, spec.task))
    fresh_seed = round_seed(seed, round_name) if fresh else None
    if fresh_seed is not None:
        examples = fresh_examples(
            spec.task, n, fresh_seed, evaluated | {prompt_text(e.prompt) for e in probe_items}
        )
        source = f"fresh:{spec.task}:seed={fresh_seed}"
    else:
        examples, source = load_prompts(spec.task, n, seed, data_dir, round_name)
    if spec.replay:
        examples = with_replay(spec.task, examples, spec.replay, seed, data_dir, round_name)
        source += f"+replay={spec.replay:g}"
    with _stored_on_failure(f"prompts {spec.name}"):
        task = task_registry().get(spec.task)
        if has_generator(
            spec.task
        ):  # the built-in generators' formats and lengths (params.yaml checks.prompts)
            report = check(prompts_frame(examples), "prompts", CheckParams(prompts=bounds), source=source)
        else:  # the task's own suite over its files, its rewards import with a signature the data fits, and
            # lm-eval builds its eval: a broken file fails the run here, before anything trains
            report = check_task(task)
            check_rewards(task)
            check_eval(task)
    return PromptSet(
        policy=spec.name,
        examples=examples,
        source=source,
        expectations=report.evaluated,
        fresh_seed=fresh_seed,
        probe=probe_items,
        work_s=time.perf_counter() - t0,
    )


@task(cache_policy=NO_CACHE)
def start_training(
    ws: Workspace,
    recipe: RecipeConfig,
    parents: dict[str, str | None],
    prompts: dict[str, list[Example]],
) -> TrainingRun:
    """Set up the recipe on the workspace's base and device, every policy's parent (digest; None: fresh) in its
    slot: resumed from a checkpoint when there is one, else the reward's dry run before the first step
    (`RecipeConfig`)."""
    store = ws.registry().store
    dirs = {name: None if digest is None else store.local_dir(digest) for name, digest in parents.items()}
    run = TrainingRun(recipe.model_copy(update={"base": ws.base, "device": ws.device, "parents": dirs}))
    run.setup(prompts)
    return run


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


# ---- early stopping (the rule is mint_core.eval.early_stop's) -----------------------------------------------


class ProbeResult(Timed, Probe):
    """Greedy exact match of each probed policy on its probe items, after `step` steps."""


@task(cache_policy=NO_CACHE)
def probe(run: TrainingRun, items: dict[str, list[Example]]) -> ProbeResult:
    """Greedy exact match of each named policy on its probe items now."""
    t0 = time.perf_counter()
    got = take_probe(run.trainer.engine, items, run.trainer.steps)
    return ProbeResult(step=got.step, correct=got.correct, work_s=time.perf_counter() - t0)
