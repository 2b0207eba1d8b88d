"""Training steps: check the prompts, start the training run (mint_core.rl.recipe) from the champions, then per
step one batched rollout, its check, and one batched GRPO update; with early stopping, a greedy probe of every
policy still training every few steps, and the plateau rule (`Plateau`) that leaves a policy out of the next
steps once its probe stops rising."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

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
from mint_core.eval.gate import discordant, mcnemar_p
from mint_core.eval.suites import check_eval
from mint_core.lifecycle.errors import LifecycleError
from mint_core.lifecycle.faults import fault
from mint_core.lifecycle.prompts import load_prompts, round_seed, with_replay
from mint_core.lifecycle.workspace import Workspace
from mint_core.rl.evaluate import heldout_correct
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe import Continuation, TrainingRun, dry_run_rewards, load_trainer
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
    specs: list[PolicySpec],
    parents: dict[str, str | None],
    grpo: GRPOConfig,
    seed: int,
    prompts: dict[str, list[Example]],
    steps: int,
    prompts_per_step: int,
    checkpoint_every: int,
    checkpoint_dir: Path,
    dry_run: int = 0,
    continuation: Continuation | None = None,
    mirror: str | None = None,
) -> TrainingRun:
    """Load the base, put every policy's parent (digest; None: fresh) in its slot, with the `continuation`
    recipe for those that have one (its rate share set by the champion's headroom on the round's own prompts), resume from a checkpoint (`mirror`: also kept there, for other hosts; a newer
    one there is taken); before a first step, the reward's dry run on `dry_run` prompts per policy
    (`recipe.dry_run_rewards`)."""
    store = ws.registry().store
    dirs = {name: None if digest is None else store.local_dir(digest) for name, digest in parents.items()}
    own = {s.name: [e for e in prompts[s.name] if e.task == s.task] for s in specs}  # not the replayed rows
    trainer = load_trainer(
        ws.base, specs, grpo, seed, dirs, device=ws.device, continuation=continuation, headroom_items=own
    )
    run = TrainingRun.start(
        trainer, prompts, steps, prompts_per_step, checkpoint_dir, checkpoint_every, mirror=mirror
    )
    if dry_run and trainer.steps == 0:
        dry_run_rewards(trainer, prompts, dry_run)
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


# ---- early stopping -------------------------------------------------------------------------------------------


class EarlyStop(BaseModel):
    """Stop training a policy whose reward on held-out probe items does not rise, so no compute goes into steps
    (or an evaluation) the gate would reject. The probe is greedy exact match on a few items of the policy's task
    that no training, held-out or eval-suite prompt is (`mint_core.data.revision.probe_examples`): cheap, and
    not the gate's items. Defaults from benchmarks/learning_curves.py on the built-in base (docs/lifecycle.md, "Retraining")."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(10, ge=1)
    """Probe every this many steps (and before the first, and after the last). At the built-in recipe's ~0.2 s
    per policy and step on one core, a 128-item probe (~0.15 s) costs under a tenth of the 10 steps between."""
    probe_items: int = Field(128, ge=16, le=2000)
    """Probe items per policy. 128: one item is 0.008 of reward, and a probe costs about one step's rollout."""
    patience: int = Field(3, ge=1)
    """Probes in a row without a rise of `min_delta` over the best so far after which the policy stops."""
    min_delta: float = Field(0.025, ge=0.0, le=1.0)
    """The rise that counts (greedy exact match, 0..1): 0.025 is 3 of 128 items, about one standard deviation
    of the paired change between two probes of nearby adapters, so noise alone seldom makes a rise. A policy
    that stops without its best probe rising this much over its step-0 probe has gained nothing the gate could
    pass: it is not exported, evaluated or gated."""
    after_rejections: int = Field(2, ge=1)
    """A policy whose last this many candidates were rejected (`PolicyRun.rejected`) gets a patience of 1: unless
    its first probe after step 0 rises `min_delta`, it stops there and is skipped (not exported or gated)."""
    stop_after_gain: bool = False
    """Also stop a policy that has risen, once `patience` probes in a row bring no further rise (a plateau after
    a gain), and gate it as it stands. Off by default: the learning rate decays linearly over the run's steps,
    and the last steps consolidate the gain while the probe looks flat; stopped at such a plateau (step 40),
    `add` and `reverse` first revisions gained +0.062 (p 0.06) and +0.016 on their suites against +0.084 and
    +0.056 (both promoted) when trained to step 100."""

    fall_p: float = Field(0.05, gt=0.0, le=1.0)
    """A policy whose probe falls below its first (its champion's, for a continuation) beyond noise, the paired
    change on the same items negative at exact McNemar p below this, stops at once and is not exported, evaluated
    or gated, whatever it gained before."""
    room_fall_p: float = Field(0.005, gt=0.0, le=1.0)
    """`fall_p` for a continuation whose champion has headroom (`Continuation.has_room`): it trains at the full
    rate, and its probe dips while AdamW's moments start again before it rises (`examples/shout`'s fresh-clone
    champion: -0.078 at step 20, p 0.031, of 128 items), so only a fall well beyond that dip stops it."""

    def patience_for(self, rejected: int, room: bool = False) -> int:
        """Probes without a rise before a policy stops. For a continuation whose champion has headroom
        (`Continuation.has_room`, measured tonight), the whole run: only a fall stops it, since its probe first dips
        as AdamW starts again and rises after about 100 steps (docs/training.md), so a probe or three say nothing
        yet, whatever its earlier candidates did. Else 1 after `after_rejections` rejections, and `patience`."""
        if room:
            return 10**6
        return 1 if rejected >= self.after_rejections else self.patience


class ProbePoint(BaseModel):
    step: int
    score: float
    """Greedy exact match on the probe items after `step` steps."""


class Plateau:
    """The early-stop rule for one policy, fed one probe score at a time (the first at step 0). A score is a
    rise when it beats the best so far by at least `min_delta` (strictly, with `min_delta` 0); the policy has
    `gained` once its best beat its first that way. After `patience` probes in a row without a rise, a policy
    that has not gained stops ("no gain"), and with `stop_after_gain` one that has gained too ("plateau")."""

    def __init__(self, min_delta: float, patience: int, stop_after_gain: bool = False, fall_p: float = 0.05):
        if patience < 1 or min_delta < 0 or not 0 < fall_p <= 1:
            raise ValueError(
                f"patience {patience} must be >= 1, min_delta {min_delta} >= 0 and fall_p {fall_p} in (0, 1]"
            )
        self.min_delta = min_delta
        self.patience = patience
        self.stop_after_gain = stop_after_gain
        self.fall_p = fall_p
        self._first_correct: list[bool] | None = None
        self.fell: tuple[float, float] | None = None
        """(change, p) of the probe that fell below the first beyond noise and stopped the policy; None: none."""
        self.points: list[ProbePoint] = []
        self.best: ProbePoint | None = None
        self.waited = 0
        self.stopped_at: int | None = None

    @classmethod
    def of(cls, config: EarlyStop, rejected: int = 0, room: bool = False) -> Plateau:
        """The rule `config` sets for a policy whose last `rejected` candidates were rejected, and whose champion
        has headroom (`room`) or not."""
        fall_p = config.room_fall_p if room else config.fall_p
        return cls(config.min_delta, config.patience_for(rejected, room), config.stop_after_gain, fall_p)

    def add(self, step: int, score: float, correct: list[bool] | None = None) -> bool:
        """Record the probe after `step` steps; True when the policy stops here. `correct`: the probe item by
        item, the same items each time; with it, a probe that falls below the first beyond noise (`fall_p`)
        stops the policy at once."""
        if self.stopped_at is not None:
            raise ValueError(f"stopped at step {self.stopped_at}: no more probes")
        point = ProbePoint(step=step, score=score)
        self.points.append(point)
        if correct is not None:
            if self._first_correct is None:
                self._first_correct = list(correct)
            elif len(correct) == len(self._first_correct):
                change, p = probe_gain(self._first_correct, correct)
                if change < 0 and p < self.fall_p:
                    self.fell = (change, p)
                    self.stopped_at = step
                    return True
        if self.best is None or self._rises(score, self.best.score):
            self.best, self.waited = point, 0
        else:
            self.waited += 1
            if self.waited >= self.patience and (self.stop_after_gain or not self.gained):
                self.stopped_at = step
        return self.stopped_at is not None

    def _rises(self, score: float, over: float) -> bool:
        return score > over and score - over >= self.min_delta - 1e-9

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    @property
    def start(self) -> ProbePoint | None:
        return self.points[0] if self.points else None

    @property
    def exportable(self) -> bool:
        """Whether its adapter goes on to export and the gate: it trained to the end, or stopped after a gain
        without falling below its start."""
        return not self.stopped or (self.gained and self.fell is None)

    @property
    def gained(self) -> bool:
        """Whether the best probe rose `min_delta` over the first."""
        return (
            self.best is not None
            and self.start is not None
            and self._rises(self.best.score, self.start.score)
        )

    def reason(self, steps: int) -> str:
        """Why training of this policy ended, with the numbers; `steps`: the run's schedule."""
        if not self.points or self.best is None or self.start is None:
            return f"finished: all {steps} steps (not probed)"
        first, best, last = self.start, self.best, self.points[-1]
        curve = f"probe {first.score:.3f} at step {first.step}, best {best.score:.3f} at step {best.step}"
        if self.stopped_at is None:
            return f"finished: all {steps} steps ({curve}, {last.score:.3f} at the end)"
        if self.fell is not None:
            change, p = self.fell
            return (
                f"fell: probe {first.score:.3f} at step {first.step}, {last.score:.3f} at step {last.step} "
                f"({change:+.3f}, p {p:.2g} < {self.fall_p:g}): below where it started, not exported"
            )
        flat = f"no rise of {self.min_delta:g} in {self.patience} probe(s) to step {self.stopped_at}"
        if self.gained:
            return f"plateau: {curve}; {flat}"
        return f"no gain: {curve}; {flat}"


class ProbeResult(Timed):
    """Greedy exact match of each probed policy on its probe items, after `step` steps."""

    step: int
    correct: dict[str, list[bool]]
    """Per policy, item by item (the same items in every probe, so two probes pair up)."""

    def score(self, policy: str) -> float:
        got = self.correct[policy]
        return sum(got) / len(got)


@task(cache_policy=NO_CACHE)
def probe(run: TrainingRun, items: dict[str, list[Example]]) -> ProbeResult:
    """Greedy exact match of each named policy on its probe items now."""
    t0 = time.perf_counter()
    engine = run.trainer.engine
    correct = {name: heldout_correct(engine, name, examples) for name, examples in items.items()}
    return ProbeResult(step=run.trainer.steps, correct=correct, work_s=time.perf_counter() - t0)


def probe_gain(first: list[bool], last: list[bool]) -> tuple[float, float]:
    """The probe's paired change from `first` to `last` (the same items): effect and exact McNemar p."""
    gained, lost = discordant(last, first)
    return (gained - lost) / len(first), mcnemar_p(gained, lost)


def freeze(run: TrainingRun, names: list[str]) -> None:
    """Leave policies out of the run's next rollouts, and so out of its updates: their adapters stay as they are
    (`TrainingRun.batch` takes the prompts of the policies in `run.prompts`)."""
    for name in names:
        run.prompts.pop(name, None)


class ProbeLog(BaseModel):
    """The probes of a run so far, kept beside its checkpoints so that a resumed run knows where each policy
    stands (a probe is re-taken when the checkpoint is older than it)."""

    items: str
    """Digest of the probe items, so a log of other items is not read back."""
    probes: list[ProbeResult] = Field(default_factory=list)

    @staticmethod
    def digest(items: dict[str, list[Example]]) -> str:
        doc = {name: [e.prompt for e in examples] for name, examples in sorted(items.items())}
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]

    @classmethod
    def read(cls, path: Path, items: dict[str, list[Example]], upto: int) -> ProbeLog:
        """The log at `path` for these items, without probes after step `upto` (the run's resumed step)."""
        log = cls(items=cls.digest(items))
        if path.is_file():
            saved = cls.model_validate_json(path.read_text())
            if saved.items == log.items:
                log.probes = [p for p in saved.probes if p.step <= upto]
        return log

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json())
        tmp.replace(path)
