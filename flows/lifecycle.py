"""The lifecycle of policies, as one recipe:

    validate data -> k x (rollout -> validate rollouts -> GRPO update) -> export (store + MLflow version,
    alias candidate) -> evaluate candidate vs champion (lm-eval on the served API) -> gate
    -> [transaction] promote + refresh serving + served smoke check; any failure rolls alias and serving back

`wave` runs N policies through it at once over one shared base: one batched rollout and one batched update per
step for all of them, then export, evaluation, gate and promotion per policy. `lifecycle` is a wave of one.

With `training.early_stop`, every few steps a greedy probe on a few held-out items (not the gate's) scores each
policy still training; a policy whose probe does not rise over its step-0 probe within `patience` probes
leaves the next steps and is not exported, evaluated or gated (status "stopped"). With `training.draw="fresh"`
each round trains on new prompts from the task generators, none of them a held-out or eval-suite prompt.

A run is identified by its idempotency key (policy spec, data revision, GRPO config, schedule, seed, base, round):
a rerun finds the version the key made and trains nothing twice, a run killed mid-training resumes from its last
checkpoint, and a run killed mid-promotion finishes the promotion it had started.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, cast
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.runtime import flow_run as prefect_flow_run
from prefect.utilities.annotations import quote

from flows.canary import run_canary
from flows.forms import (
    Policies,
    PolicyOutcome,
    PolicyRun,
    Status,
    StepTiming,
    Training,
    WaveFailed,
    WaveReport,
)
from flows.promotion import promote_and_refresh
from mint_core.data.checks import CheckParams
from mint_core.data.spec import registry as task_registry
from mint_core.eval.early_stop import EarlyStopping, Trained
from mint_core.eval.gate import GateDecision, GatePolicy, SuiteScore
from mint_core.eval.lm_eval_runner import EvalConfig
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.eval.suites import scorable
from mint_core.lifecycle.leases import held_run, run_lease
from mint_core.lifecycle.prompts import data_revision, round_seed
from mint_core.lifecycle.revisions import idempotency_key
from mint_core.lifecycle.workspace import Workspace
from mint_core.rl.builder import spec_changes
from mint_core.rl.checkpoints import drop_mirror
from mint_core.rl.recipe import RecipeConfig, TrainingRun
from tasks.common import RevisionRef, cached_in
from tasks.evaluation import BaseScores, evaluate, evaluate_base
from tasks.registry import current_champion, export, find_revision, gate, note_no_gain
from tasks.training import (
    PromptSet,
    grpo_update,
    probe,
    rollout,
    start_training,
    validate_data,
    validate_rollouts,
)

R = TypeVar("R")

# the attribute a GRPO step's log record carries (step, steps, reward per policy): a console can draw one
# progress bar from these records instead of printing a line per step (`mint run` does)
STEP_RECORD = "mint_step"


# ---- the recipe ------------------------------------------------------------------------------------------


@flow(name="lifecycle", log_prints=True)
def lifecycle(
    policy: PolicyRun,
    training: Training = Training(),
    evaluation: EvalConfig = EvalConfig(limit=EVAL_LIMIT, guard_limit=GUARD_LIMIT),
    checks: CheckParams = CheckParams(),
    workspace: Workspace = Workspace(),
) -> WaveReport:
    """Train one policy with GRPO, evaluate, gate and promote it, serving refreshed in place."""
    with run_held(workspace):
        return run_wave([policy], training, evaluation, checks, workspace)


@flow(name="wave", log_prints=True)
def wave(
    policies: Policies,
    training: Training = Training(),
    evaluation: EvalConfig = EvalConfig(limit=EVAL_LIMIT, guard_limit=GUARD_LIMIT),
    checks: CheckParams = CheckParams(),
    workspace: Workspace = Workspace(),
) -> WaveReport:
    """Train N policies at once over one base (one batched rollout and update per step), then evaluate, gate
    and promote each."""
    with run_held(workspace):
        return run_wave(policies, training, evaluation, checks, workspace)


@contextmanager
def run_held(ws: Workspace) -> Iterator[None]:
    """This flow run's lease in the catalog for the block (`mint_core.lifecycle.held_run`): while it is renewed
    the run is alive; when its host dies it expires, and a worker requeues the run, which resumes from its
    checkpoint (docs/multi-host.md)."""
    run_id = prefect_flow_run.id
    if not run_id:  # called as a plain function, outside a flow run
        yield
        return
    with held_run(ws, str(run_id)) as holder:
        get_run_logger().info("run lease %s held by %s", run_lease(str(run_id)), holder)
        yield


@dataclass
class _Wave:
    """What every part of one wave reads: its settings, its workspace, the clock of its task calls and its
    progress artifact."""

    training: Training
    evaluation: EvalConfig
    checks: CheckParams
    ws: Workspace
    clock: Clock
    progress: UUID


def run_wave(
    policies: list[PolicyRun],
    training: Training,
    evaluation: EvalConfig,
    checks: CheckParams,
    ws: Workspace,
) -> WaveReport:
    """The recipe behind both flows; raises `WaveFailed` naming the policies that failed (after finishing the
    others)."""
    log = get_run_logger()
    progress = cast(UUID, create_progress_artifact(0.0, key="wave-progress", description="wave: starting"))
    w = _Wave(training, evaluation, checks, ws, Clock(), progress)
    names = [p.name for p in policies]

    # what each policy starts from, its prompts, and the identity of this run
    champions = {p.name: w.clock(current_champion, ws=ws, policy=p.name) for p in policies}
    prompts = {p.name: _validate_prompts(w, p) for p in policies}
    data_rev = data_revision(training.data_dir, [ps.source for ps in prompts.values()])
    keys = {p.name: _key(w, p, data_rev) for p in policies}
    candidates = {p: w.clock(find_revision, ws=ws, policy=p, key=keys[p]) for p in names}
    to_train = [p for p in policies if candidates[p.name] is None]
    reused = [p for p in names if candidates[p]]
    log.info("data %s; reused: %s; to train: %s", data_rev, reused, [p.name for p in to_train])

    # training: every step is one batched rollout, its check, one batched update, for all policies at once;
    # meanwhile the bare base is evaluated on the served API, which needs nothing training makes
    curve: list[dict[str, Any]] = []
    resumed = 0
    trained: dict[str, Trained] = {}
    early: _Beside[BaseScores] | None = None
    if to_train:
        with _beside(_evaluate_base_call(w, policies)) as early:
            made, curve, resumed, trained = train(w, to_train, prompts, champions, keys, data_rev)
        candidates.update(made)

    # per policy: evaluate the candidate against the champion (or the base), gate, promote
    base = _base_scores(w, [p for p in policies if candidates[p.name] is not None], early)
    outcomes = []
    for i, p in enumerate(policies):
        outcome = _outcome(
            w, p, candidates[p.name], champions[p.name], trained.get(p.name), keys[p.name], base
        )
        outcome.reused = p.name not in {q.name for q in to_train}
        _account(outcome, p, trained.get(p.name))
        outcomes.append(outcome)
        update_progress_artifact(
            progress, 80.0 + 20.0 * (i + 1) / len(policies), description=f"{p.name}: {outcome.status}"
        )

    _wave_artifacts(outcomes, w.clock)
    report = WaveReport(outcomes=outcomes, curve=curve, timings=w.clock.timings, resumed_from=resumed)
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        raise WaveFailed("; ".join(f"{o.policy}: {' '.join(o.reasons)}" for o in failed))
    return report


def _validate_prompts(w: _Wave, p: PolicyRun) -> PromptSet:
    """The policy's training prompts, checked, and its probe items when early stopping probes it."""
    t = w.training
    return w.clock(
        validate_data,
        spec=p.spec,
        n=t.steps * t.prompts_per_step,
        seed=t.seed,
        data_dir=t.data_dir,
        bounds=w.checks.prompts,
        round_name=t.round_name(),
        fresh=t.draw == "fresh",
        suites_data=w.evaluation.suites_dir / "data",
        probe=t.early_stop.probe_items if t.early_stop else 0,
    )


def _key(w: _Wave, p: PolicyRun, data_rev: str) -> str:
    """The idempotency key of the policy's run in this wave (`mint_core.lifecycle.revisions.idempotency_key`)."""
    t = w.training
    return idempotency_key(
        p.spec,
        data_rev,
        t.grpo,
        t.steps,
        t.prompts_per_step,
        t.seed,
        str(Path(w.ws.base).resolve()),
        t.key_round(),
    )


def _base_scores(
    w: _Wave, gated: list[PolicyRun], early: _Beside[BaseScores] | None = None
) -> BaseScores | None:
    """The bare base is revision 0: a policy without a champion is gated against it, on the same suites; every
    report shows it (evaluated once per base and suites, then read from the cache). None: nothing to gate.

    `early`: the same evaluation started beside training over every policy of the wave's suites, a superset of
    the gated ones' (the gate reads the base's scores suite by suite); its error, if it failed, is raised here."""
    if not gated:
        if early is not None:  # nothing reads its scores; it still ends before the wave does
            early.wait()
            if early.error is not None:
                get_run_logger().warning(
                    "the bare base's evaluation failed (no policy is gated): %s", early.error
                )
        return None
    if early is not None:
        return early.result()
    return _evaluate_base_call(w, gated)()


def _evaluate_base_call(w: _Wave, policies: list[PolicyRun]) -> Callable[[], BaseScores]:
    """The bare base's evaluation over the suites that gate `policies`, as a call (timed on the wave's clock)."""
    suites = sorted({s for p in policies for s in evaluated_suites(p.gate_policy(), w.evaluation)})
    return lambda: w.clock(
        cached_in(evaluate_base, w.ws),
        ws=w.ws,
        config=w.evaluation.model_copy(update={"suites": suites}),
        bounds=w.checks.eval,
    )


class _Beside(Generic[R]):
    """A call running in a thread of its own beside the flow's (`_beside`), in a copy of the flow's context, so
    a Prefect task called there is a task run of the same flow run."""

    def __init__(self, fn: Callable[[], R]) -> None:
        self._fn = fn
        self._out: R | None = None
        self.error: BaseException | None = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="mint-beside", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out = self._fn()
        except BaseException as e:  # handed to whoever asks for the result
            self.error = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> R:
        self.wait()
        if self.error is not None:
            raise self.error
        return cast(R, self._out)


@contextmanager
def _beside(fn: Callable[[], R]) -> Iterator[_Beside[R]]:
    """Run `fn` beside the block: the bare base's evaluation beside training. It talks to the server, training
    to the flow's own copy of the base, so they share no state, and the first wave's gate has the base's scores
    when training ends (through vLLM on a 2-core CPU that is about 40 s of the first wave). When the block
    raises, this waits for `fn` to end, so nothing of the flow runs on after it, logs its error if it had one,
    and raises the block's."""
    running = _Beside(fn)
    try:
        yield running
    except BaseException:
        running.wait()
        if running.error is not None:
            get_run_logger().warning(
                "the evaluation beside the failed step failed too: %s: %s",
                type(running.error).__name__,
                running.error,
            )
        raise


def _outcome(
    w: _Wave,
    p: PolicyRun,
    cand: RevisionRef | None,
    champ: RevisionRef | None,
    t: Trained | None,
    key: str,
    base: BaseScores | None,
) -> PolicyOutcome:
    """What became of one policy: stopped without a gain, or its candidate evaluated, gated and promoted; a
    failure is its outcome ("failed"), not the wave's end."""
    log = get_run_logger()
    try:
        if cand is None:  # early stopping ended its training without a gain: nothing to gate
            assert t is not None
            if champ is not None:  # retraining counts it with the rejected candidates
                w.clock(note_no_gain, ws=w.ws, champ=champ, reason=t.reason)
            return _stopped(p, champ, t)
        return _evaluate_gate_promote(w, p, cand, champ, key, base)
    except Exception as e:
        log.error("%s: %s: %s", p.name, type(e).__name__, e)
        return PolicyOutcome(
            policy=p.name,
            status="failed",
            candidate=cand.address if cand else None,
            champion_before=champ.address if champ else None,
            champion_after=champ.address if champ else None,
            reasons=[f"{type(e).__name__}: {e}"],
        )


def _wave_artifacts(outcomes: list[PolicyOutcome], clock: Clock) -> None:
    """The wave's tables on the flow run: the per-policy summary and outcomes, and each task call's timing."""
    create_table_artifact(
        [o.summary() for o in outcomes],
        key="wave-summary",
        description="per policy: status, gain and p-value, GRPO steps spent, why its training stopped",
    )
    create_table_artifact(
        [o.model_dump(mode="json") | {"reasons": "; ".join(o.reasons)} for o in outcomes],
        key="wave-outcomes",
        description="per policy: candidate, gate, champion before and after",
    )
    create_table_artifact(
        [t.model_dump() | {"overhead_ms": _overhead_ms(t)} for t in clock.timings],
        key="wave-timings",
        description="each task call: wall time in the flow, mint_core work inside, Prefect overhead",
    )


# ---- training ------------------------------------------------------------------------------------------------


def train(
    w: _Wave,
    to_train: list[PolicyRun],
    prompts: dict[str, PromptSet],
    champions: dict[str, RevisionRef | None],
    keys: dict[str, str],
    data_rev: str,
) -> tuple[dict[str, RevisionRef | None], list[dict[str, Any]], int, dict[str, Trained]]:
    """k x (one batched rollout -> its check -> one batched GRPO update) for all policies at once, with early
    stopping every few steps a probe of the policies still training, then export each that is worth gating:
    its candidate revisions (None: stopped without gain), the reward curve, the steps restored from a
    checkpoint, and how each policy's training went."""
    log = get_run_logger()
    training = w.training
    parents = {p.name: _digest(champions[p.name]) for p in to_train}
    run_dir = w.ws.work_dir / "checkpoints" / "-".join(sorted(keys[p.name][:12] for p in to_train))
    # the same run's checkpoints for the other hosts: an attempt that another worker resumes starts from them
    mirror = f"{w.ws.checkpoint_url.rstrip('/')}/{run_dir.name}" if w.ws.checkpoint_url else None
    tag = _parents_tag(parents)
    recipe = _recipe(training, to_train, run_dir / tag, f"{mirror}/{tag}" if mirror else None)
    run = w.clock(
        start_training,
        ws=w.ws,
        recipe=recipe,
        parents=parents,
        prompts=quote({p.name: prompts[p.name].examples for p in to_train}),
    )
    _warn_overridden(to_train, champions, run)
    early = _early_stopping(w, run, to_train, prompts)
    if run.prompts:  # else early stopping had stopped every policy before the run was resumed
        step = _Step(w, run, early)
        run.train(step, stop=lambda: not run.prompts)

    candidates: dict[str, RevisionRef | None] = {}
    went: dict[str, Trained] = {}
    for p in to_train:
        went[p.name] = (
            early.trained(p.name, run.trainer.steps, training.steps)
            if early
            else Trained.finished(run.trainer.steps, training.steps)
        )
        if not went[p.name].exported:
            log.info("%s: not exported or gated (%s)", p.name, went[p.name].reason)
            candidates[p.name] = None
            continue
        candidates[p.name] = _export(
            w, p, run, went[p.name], champions[p.name], prompts[p.name], keys, data_rev
        )
    shutil.rmtree(run_dir, ignore_errors=True)  # exported: the checkpoints have done their job
    if mirror:
        drop_mirror(mirror)
    _training_artifacts(run, to_train, early)
    return candidates, run.history, run.resumed_step, went


def _recipe(
    training: Training, to_train: list[PolicyRun], checkpoint_dir: Path, mirror: str | None
) -> RecipeConfig:
    """The recipe the wave's form asks for (`mint_core.rl.recipe`), seeded by its round; the base, the device
    and the parents are the workspace's (`start_training`)."""
    return RecipeConfig(
        steps=training.steps,
        prompts_per_step=training.prompts_per_step,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=training.checkpoint_every,
        mirror=mirror,
        dry_run=training.dry_run,
        policies=[p.spec for p in to_train],
        grpo=training.grpo,
        seed=round_seed(training.seed, training.round_name()),
        continuation=training.continuation,
        compile_decode=training.compile_decode,
    )


def _warn_overridden(
    to_train: list[PolicyRun], champions: dict[str, RevisionRef | None], run: TrainingRun
) -> None:
    """A policy continues from its champion with the champion's rank, alpha and targets, whatever the form
    says: a warning names what the champion overrode."""
    for p in to_train:
        overridden = spec_changes(p.spec, run.trainer.policies[p.name].spec)
        if overridden:
            champ = champions[p.name]
            get_run_logger().warning(
                "%s continues from its champion %s, which overrides the form: %s",
                p.name,
                champ.address if champ else None,
                "; ".join(overridden),
            )


def _early_stopping(
    w: _Wave, run: TrainingRun, to_train: list[PolicyRun], prompts: dict[str, PromptSet]
) -> EarlyStopping | None:
    """With `training.early_stop`, each policy's rule (`mint_core.eval.early_stop`), where it stood at the
    checkpoint the run resumed from (its probe log survives a restart), or its probe before the first step."""
    config = w.training.early_stop
    if config is None:
        return None
    early = EarlyStopping(
        config,
        {p.name: prompts[p.name].probe for p in to_train},
        run.checkpoint_dir / "probes.json",
        run.trainer.steps,
        rejected={p.name: p.rejected for p in to_train},
        room={
            p.name: w.training.continuation.has_room(run.trainer.policies[p.name].headroom) for p in to_train
        },
    )
    _stop(run, early.replay(), early, w.training.steps)
    if not early.log.probes:
        _take_probe(w, run, early)
    return early


def _take_probe(w: _Wave, run: TrainingRun, early: EarlyStopping) -> None:
    """A probe of the policies still training, as a task; those whose rule it stops leave the run."""
    result = w.clock(probe, run=run, items=quote({n: early.items[n] for n in run.prompts}))
    get_run_logger().info(
        "probe after step %d: %s", result.step, _fmt({n: result.score(n) for n in result.correct})
    )
    _stop(run, early.record(result), early, w.training.steps)


def _stop(run: TrainingRun, names: list[str], early: EarlyStopping, steps: int) -> None:
    log = get_run_logger()
    for name in names:
        plateau = early.plateaus[name]
        log.info("%s stops after step %d: %s", name, plateau.stopped_at, plateau.reason(steps))
    run.freeze(names)


class _Step:
    """One step of the recipe's loop as three tasks: the batched rollout, its check, the batched update; then
    the progress artifact, and a probe when early stopping takes one."""

    def __init__(self, w: _Wave, run: TrainingRun, early: EarlyStopping | None):
        self.w, self.run, self.early = w, run, early
        self.bounds = w.checks.rollouts.model_copy(
            update={
                "group_size": run.trainer.group_sizes(),
                "max_completion_len": w.training.grpo.max_new_tokens + 1,
            }
        )

    def __call__(self) -> None:
        w, steps = self.w, self.w.training.steps
        # quote: hundreds of rows need no walk for upstream futures (tens of ms per task otherwise)
        batch = w.clock(rollout, run=self.run)
        w.clock(validate_rollouts, batch=quote(batch), bounds=self.bounds)
        stats = w.clock(grpo_update, run=self.run, batch=quote(batch))
        get_run_logger().info(
            "step %d/%d: reward %s",
            stats.step,
            steps,
            _fmt(stats.reward),
            extra={STEP_RECORD: {"step": stats.step, "steps": steps, "reward": dict(stats.reward)}},
        )
        update_progress_artifact(
            w.progress, 80.0 * stats.step / steps, description=f"GRPO step {stats.step}/{steps}"
        )
        if self.early is not None and self.early.due(stats.step, steps):
            _take_probe(w, self.run, self.early)


def _export(
    w: _Wave,
    p: PolicyRun,
    run: TrainingRun,
    went: Trained,
    champ: RevisionRef | None,
    prompts: PromptSet,
    keys: dict[str, str],
    data_rev: str,
) -> RevisionRef:
    """The policy's candidate: its adapter in the store and an MLflow version with its training run (its curve
    up to where it stopped, and what it trained with)."""
    # a step where the policy took no update has no loss; steps after it stopped are not its own
    rows = [c for c in run.history if c["policy"] == p.name and c["step"] <= went.steps]
    times = [c["time"] for c in rows] if rows and all(c.get("time") for c in rows) else None
    return w.clock(
        cached_in(export, w.ws),
        ws=w.ws,
        session=run,
        policy=p.name,
        rank=run.trainer.policies[p.name].spec.rank,
        parent=champ,
        data_rev=data_rev,
        key=keys[p.name],
        curve=[_curve_point(c) for c in rows],
        params=_run_params(w.training, p, run, went, prompts, data_rev, continued=champ is not None),
        times=times,
        started=times[0] - float(rows[0]["seconds"]) if times else None,
    )


def _run_params(
    training: Training,
    p: PolicyRun,
    run: TrainingRun,
    went: Trained,
    prompts: PromptSet,
    data_rev: str,
    continued: bool,
) -> dict[str, str]:
    """The MLflow training run's parameters: what the policy trained with, on what, and how it ended."""
    trained = run.trainer.policies[p.name].spec
    params = {
        "policy": trained.model_dump_json(),
        "grpo": training.grpo.model_dump_json(),
        "steps": str(training.steps),
        "prompts_per_step": str(training.prompts_per_step),
        "seed": str(training.seed),
        "round_seed": str(run.config.seed),
        "round": training.round_name(),
        "data_rev": data_rev,
        "resumed_from_step": str(run.resumed_step),
        "draw": training.draw,
        "prompts_source": prompts.source,
        "steps_trained": str(went.steps),
        "stop_reason": went.reason,
    }
    task = task_registry().get(trained.task)
    params |= {"task": task.name, "task_spec": task.digest(), "reward": task.reward_digest()}
    if prompts.fresh_seed is not None:
        params["fresh_seed"] = str(prompts.fresh_seed)
    if training.early_stop is not None:
        params["early_stop"] = training.early_stop.model_dump_json()
        params["probe"] = json.dumps([[q.step, q.score] for q in went.probe])
    if continued:
        # how it continued from its champion (also in `policy`: rate_scale, warmup_steps)
        params["continuation"] = training.continuation.model_dump_json()
    overridden = spec_changes(p.spec, trained)
    if overridden:
        # `policy` is what trained (what retraining reads back); the form asked for this
        params["form_policy"] = p.spec.model_dump_json()
        params["overridden_by_champion"] = "; ".join(overridden)
    return params


def _training_artifacts(run: TrainingRun, to_train: list[PolicyRun], early: EarlyStopping | None) -> None:
    """The run's reward curve and, with early stopping, its probes, as tables on the flow run."""
    names = ", ".join(p.name for p in to_train)
    if run.history:
        create_table_artifact(run.history, key="reward-curve", description=f"GRPO reward per step ({names})")
    if early is not None and early.log.probes:
        create_table_artifact(
            [{"step": r.step} | {n: round(r.score(n), 4) for n in r.correct} for r in early.log.probes],
            key="probe-curve",
            description=f"early stopping: greedy exact match on {early.config.probe_items} probe items per policy",
        )


def _stopped(p: PolicyRun, champ: RevisionRef | None, t: Trained) -> PolicyOutcome:
    """The outcome of a policy early stopping ended without a gain: nothing exported, the champion stays."""
    before = champ.address if champ else None
    return PolicyOutcome(
        policy=p.name,
        status="stopped",
        candidate=None,
        champion_before=before,
        champion_after=before,
        reasons=[f"{t.reason}; not exported, evaluated or gated"],
    )


def _account(outcome: PolicyOutcome, p: PolicyRun, t: Trained | None) -> None:
    """Fill in what the per-policy report shows: its gain and p-value (the gate's on its own suite, else the
    probe's), the steps it trained and why it stopped."""
    check = outcome.decision.check(f"gain:{p.gate_policy().suite}") if outcome.decision else None
    if check is not None and check.stats is not None:
        outcome.gain, outcome.p_value = check.stats.effect, check.stats.p_value
        outcome.gain_on = f"suite:{p.gate_policy().suite}"
    elif t is not None and t.probe_gain is not None:
        outcome.gain, outcome.p_value, outcome.gain_on = t.probe_gain, t.probe_p, "probe"
    if t is None:
        outcome.stop_reason = "reused: an earlier run with this idempotency key made the candidate"
        return
    outcome.steps, outcome.stop_reason, outcome.probe = t.steps, t.reason, t.probe


def _evaluate_gate_promote(
    w: _Wave,
    p: PolicyRun,
    cand: RevisionRef,
    champ: RevisionRef | None,
    key: str,
    base: BaseScores | None = None,
) -> PolicyOutcome:
    """The candidate scored beside its champion (or the base), gated, and promoted: at once, or after a canary
    when the policy asks for one."""
    log = get_run_logger()
    before = champ.address if champ else None
    decision: GateDecision | None = None
    scores: dict[str, dict[str, SuiteScore]] = {}

    def outcome(status: Status, after: str | None, reasons: list[str]) -> PolicyOutcome:
        return PolicyOutcome(
            policy=p.name,
            status=status,
            candidate=cand.address,
            champion_before=before,
            champion_after=after,
            reasons=reasons,
            decision=decision,
            scores=scores,
        )

    if champ is not None and champ.version == cand.version:
        if cand.idempotency_key != key or not cand.gate_passed:
            return outcome("unchanged", before, ["training left the champion's bytes unchanged"])
        # an earlier attempt of this run gated and promoted it, and may have died before serving it
        restore = int(cand.parent.rsplit("/v", 1)[1]) if cand.parent else None
        log.info("%s is already champion (an earlier attempt promoted it): refreshing serving", cand.address)
        _promote(w, p, cand, expect=cand.version, restore=restore)
        return outcome(
            "promoted", cand.address, ["promoted by an earlier attempt of this run; serving refreshed"]
        )

    decision = _score_and_gate(w, p, cand, champ, base, scores)
    if not decision.passed:
        log.info("%s rejected: %s", cand.address, "; ".join(decision.reasons))
        return outcome("rejected", before, decision.reasons)
    if p.canary is not None:
        # the gate passed it offline; live traffic decides whether it replaces the champion
        done = w.clock(
            run_canary,
            ws=w.ws,
            policy=p.name,
            version=cand.version,
            served=p.served,
            config=p.canary,
            key=f"{key}-canary",
        )
        promoted = done.decision == "promoted"
        out = outcome(
            "promoted" if promoted else "rejected",
            cand.address if promoted else before,
            [*decision.reasons, f"canary {done.decision}: {done.reason}"],
        )
        out.canary = done
        return out
    expect = champ.version if champ else None
    _promote(w, p, cand, expect=expect, restore=expect)
    log.info("%s promoted (champion was %s), served as %s", cand.address, before, p.served)
    return outcome("promoted", cand.address, decision.reasons)


def _score_and_gate(
    w: _Wave,
    p: PolicyRun,
    cand: RevisionRef,
    champ: RevisionRef | None,
    base: BaseScores | None,
    scores: dict[str, dict[str, SuiteScore]],
) -> GateDecision:
    """The candidate's scores and its champion's (into `scores`, beside the base's), and the gate's decision:
    against the champion, else the base, else on the gate's own rules."""
    gate_policy = p.gate_policy()
    config = w.evaluation.model_copy(update={"suites": evaluated_suites(gate_policy, w.evaluation)})
    scored = cached_in(evaluate, w.ws)
    bounds = w.checks.eval
    cand_scores = w.clock(scored, ws=w.ws, revision=cand, role="candidate", config=config, bounds=bounds)
    scores["candidate"] = cand_scores.scores
    if base is not None:
        scores["base"] = {s: base.scores[s] for s in config.suite_names() if s in base.scores}
    if champ is not None:
        champ_scores = w.clock(scored, ws=w.ws, revision=champ, role="champion", config=config, bounds=bounds)
        scores["champion"] = champ_scores.scores
    against, baseline = scores.get("champion"), "champion"
    if champ is None and base is not None:
        against, baseline = scores["base"], "base"
    return w.clock(
        gate,
        ws=w.ws,
        candidate=cand,
        policy=gate_policy,
        candidate_scores=cand_scores.scores,
        champion_scores=against,
        baseline=baseline,
    )


def _promote(w: _Wave, p: PolicyRun, cand: RevisionRef, expect: int | None, restore: int | None) -> None:
    """champion := the candidate (only if it still is `expect`), served and smoke-checked; the undo restores
    `restore` (`flows.promotion.promote_and_refresh`)."""
    w.clock(
        promote_and_refresh,
        ws=w.ws,
        policy=p.name,
        served_name=p.served,
        version=cand.version,
        digest=cand.digest,
        expect=expect,
        restore=restore,
    )


# ---- small helpers ------------------------------------------------------------------------------------------


def evaluated_suites(policy: GatePolicy, evaluation: EvalConfig) -> list[str]:
    """What a candidate is scored on: every suite its gate reads, and, when it compares with a baseline, those it
    only reports (`info_suites`) that this workspace can score (a suite without its data is left out of the
    report, not a failed run; with `compare=False` there is no change to report)."""
    if not policy.compare:
        return policy.gated_suites()
    return [*policy.gated_suites(), *scorable(policy.info_suites or [], evaluation.suites_dir)]


class Clock:
    """Calls a task (or a function) and records its wall time beside the work time the result reports."""

    def __init__(self) -> None:
        self.timings: list[StepTiming] = []

    def __call__(self, fn: Callable[..., R], /, **kwargs: Any) -> R:
        """`fn(**kwargs)`, timed: keyword arguments only, so a call names what it passes."""
        t0 = time.perf_counter()
        out = fn(**kwargs)
        wall = time.perf_counter() - t0
        work = getattr(out, "work_s", None)
        name = getattr(fn, "name", None) or getattr(fn, "__name__", "step")
        self.timings.append(
            StepTiming(step=name, wall_s=round(wall, 4), work_s=None if work is None else round(work, 4))
        )
        return out


def _overhead_ms(t: StepTiming) -> float | None:
    """None where unknown, or where the result came from Prefect's cache (wall < the cached work)."""
    if t.work_s is None or t.wall_s < t.work_s:
        return None
    return round(1000 * (t.wall_s - t.work_s), 1)


def _parents_tag(parents: dict[str, str | None]) -> str:
    """Checkpoints are only good for the parents they started from."""
    return hashlib.sha256(json.dumps(sorted(parents.items())).encode()).hexdigest()[:12]


def _digest(rev: RevisionRef | None) -> str | None:
    return None if rev is None else rev.digest


def _curve_point(row: dict[str, Any]) -> dict[str, float]:
    """A step of the run's curve as the MLflow run's metrics: every number but the step's bookkeeping (a
    step where the policy took no update has no loss and no update metrics)."""
    skip = {"step", "policy", "kept_groups", "time"}
    return {k: float(v) for k, v in row.items() if k not in skip and isinstance(v, int | float)}


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in values.items())
