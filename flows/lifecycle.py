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

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.runtime import flow_run as prefect_flow_run
from prefect.utilities.annotations import quote
from pydantic import BaseModel, Field

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
from mint_core.eval.gate import GateDecision, GatePolicy, SuiteScore
from mint_core.eval.lm_eval_runner import EvalConfig
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.eval.suites import scorable
from mint_core.lifecycle.leases import held_run, run_lease
from mint_core.lifecycle.prompts import data_revision, round_seed
from mint_core.lifecycle.revisions import idempotency_key
from mint_core.lifecycle.workspace import Workspace
from mint_core.rl.checkpoints import drop_mirror
from mint_core.rl.recipe import spec_changes
from tasks.common import RevisionRef, cached_in
from tasks.evaluation import BaseScores, evaluate, evaluate_base
from tasks.registry import current_champion, export, find_revision, gate, note_no_gain
from tasks.training import (
    Plateau,
    ProbeLog,
    ProbePoint,
    ProbeResult,
    PromptSet,
    freeze,
    grpo_update,
    probe,
    probe_gain,
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
    clock = Clock()
    n = training.steps * training.prompts_per_step
    progress = cast(UUID, create_progress_artifact(0.0, key="wave-progress", description="wave: starting"))
    names = [p.name for p in policies]

    # what each policy starts from, its prompts, and the identity of this run
    champions = {p.name: clock(current_champion, ws, p.name) for p in policies}
    early = training.early_stop
    prompts = {
        p.name: clock(
            validate_data,
            p.spec,
            n,
            training.seed,
            training.data_dir,
            checks.prompts,
            training.round_name(),
            training.draw == "fresh",
            evaluation.suites_dir / "data",
            early.probe_items if early else 0,
        )
        for p in policies
    }
    data_rev = data_revision(training.data_dir, [ps.source for ps in prompts.values()])
    keys = {
        p.name: idempotency_key(
            p.spec,
            data_rev,
            training.grpo,
            training.steps,
            training.prompts_per_step,
            training.seed,
            str(Path(ws.base).resolve()),
            training.key_round(),
        )
        for p in policies
    }
    candidates: dict[str, RevisionRef | None] = {p: clock(find_revision, ws, p, keys[p]) for p in names}
    to_train = [p for p in policies if candidates[p.name] is None]
    log.info(
        "data %s; reused: %s; to train: %s",
        data_rev,
        [p for p in names if candidates[p]],
        [p.name for p in to_train],
    )

    # training: every step is one batched rollout, its check, one batched update, for all policies at once
    curve: list[dict[str, Any]] = []
    resumed = 0
    trained: dict[str, Trained] = {}
    if to_train:
        made, curve, resumed, trained = train(
            to_train, prompts, champions, keys, data_rev, training, checks, ws, clock, progress
        )
        candidates.update(made)

    # the bare base is revision 0: a policy without a champion is gated against it, on the same suites; every
    # report shows it (evaluated once per base and suites, then read from the cache)
    gated = [p for p in policies if candidates[p.name] is not None]
    suites = sorted({s for p in gated for s in evaluated_suites(p.gate_policy(), evaluation)})
    base = None
    if gated:
        base = clock(
            cached_in(evaluate_base, ws), ws, evaluation.model_copy(update={"suites": suites}), checks.eval
        )

    # per policy: evaluate the candidate against the champion (or the base), gate, promote
    outcomes = []
    for i, p in enumerate(policies):
        cand = candidates[p.name]
        t = trained.get(p.name)
        try:
            if cand is None:  # early stopping ended its training without a gain: nothing to gate
                assert t is not None
                outcome = _stopped(p, champions[p.name], t)
                if champions[p.name] is not None:  # retraining counts it with the rejected candidates
                    clock(note_no_gain, ws, champions[p.name], t.reason)
            else:
                outcome = _evaluate_gate_promote(
                    p, cand, champions[p.name], keys[p.name], evaluation, checks, ws, clock, base
                )
        except Exception as e:
            log.error("%s: %s: %s", p.name, type(e).__name__, e)
            champ = champions[p.name]
            outcome = PolicyOutcome(
                policy=p.name,
                status="failed",
                candidate=cand.address if cand else None,
                champion_before=champ.address if champ else None,
                champion_after=champ.address if champ else None,
                reasons=[f"{type(e).__name__}: {e}"],
            )
        outcome.reused = p.name not in {q.name for q in to_train}
        _account(outcome, p, t)
        outcomes.append(outcome)
        update_progress_artifact(
            progress, 80.0 + 20.0 * (i + 1) / len(policies), description=f"{p.name}: {outcome.status}"
        )

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
    report = WaveReport(outcomes=outcomes, curve=curve, timings=clock.timings, resumed_from=resumed)
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        raise WaveFailed("; ".join(f"{o.policy}: {' '.join(o.reasons)}" for o in failed))
    return report


class Trained(BaseModel):
    """How one policy's training in this run went."""

    steps: int
    """GRPO steps it trained (the run's, or fewer where early stopping stopped it)."""
    reason: str
    """Why its training ended (`Plateau.reason`, or "finished: all N steps")."""
    exported: bool
    """False: stopped without a gain on the probe, so nothing was exported."""
    probe: list[ProbePoint] = Field(default_factory=list)
    probe_gain: float | None = None
    """The probe's paired change from its first probe to its last (None: not probed)."""
    probe_p: float | None = None


def train(
    to_train: list[PolicyRun],
    prompts: dict[str, PromptSet],
    champions: dict[str, RevisionRef | None],
    keys: dict[str, str],
    data_rev: str,
    training: Training,
    checks: CheckParams,
    ws: Workspace,
    clock: Clock,
    progress: UUID,
) -> tuple[dict[str, RevisionRef | None], list[dict[str, Any]], int, dict[str, Trained]]:
    """k x (one batched rollout -> its check -> one batched GRPO update) for all policies at once, with early
    stopping every few steps a probe of the policies still training, then export each that is worth gating:
    its candidate revisions (None: stopped without gain), the reward curve, the steps restored from a
    checkpoint, and how each policy's training went."""
    log = get_run_logger()
    names = [p.name for p in to_train]
    candidates: dict[str, RevisionRef | None] = {}
    parents = {p.name: _digest(champions[p.name]) for p in to_train}
    run_dir = ws.work_dir / "checkpoints" / "-".join(sorted(keys[p.name][:12] for p in to_train))
    # the same run's checkpoints for the other hosts: an attempt that another worker resumes starts from them
    mirror = f"{ws.checkpoint_url.rstrip('/')}/{run_dir.name}" if ws.checkpoint_url else None
    run_seed = round_seed(training.seed, training.round_name())
    run = clock(
        start_training,
        ws,
        [p.spec for p in to_train],
        parents,
        training.grpo,
        run_seed,
        quote({p.name: prompts[p.name].examples for p in to_train}),
        training.steps,
        training.prompts_per_step,
        training.checkpoint_every,
        run_dir / _parents_tag(parents),
        training.dry_run,
        training.continuation,
        f"{mirror}/{_parents_tag(parents)}" if mirror else None,
    )
    bounds = checks.rollouts.model_copy(
        update={
            "group_size": run.trainer.group_sizes(),
            "max_completion_len": training.grpo.max_new_tokens + 1,
        }
    )

    # early stopping: a probe of every policy still training before the first step, every `every` steps and
    # after the last; the rule (`Plateau`) takes a policy out of the next steps (its log survives a restart)
    early = training.early_stop
    items = {p.name: prompts[p.name].probe for p in to_train} if early else {}
    rejected = {p.name: p.rejected for p in to_train}
    room = {n: training.continuation.has_room(run.trainer.policies[n].headroom) for n in items}
    plateaus = {n: Plateau.of(early, rejected[n], room[n]) for n in items} if early else {}
    probe_file = run.checkpoint_dir / "probes.json"
    probes = ProbeLog.read(probe_file, items, run.trainer.steps)
    first: dict[str, list[bool]] = {}
    last: dict[str, list[bool]] = {}

    def watch(result: ProbeResult) -> None:
        stopping = []
        for name, got in result.correct.items():
            first.setdefault(name, got)
            last[name] = got
            if plateaus[name].add(result.step, result.score(name), got):
                stopping.append(name)
                log.info(
                    "%s stops after step %d: %s", name, result.step, plateaus[name].reason(training.steps)
                )
        freeze(run, stopping)

    def take_probe() -> None:
        result = clock(probe, run, quote({n: items[n] for n in run.prompts}))  # the policies still training
        probes.probes.append(result)
        probes.write(probe_file)
        log.info("probe after step %d: %s", result.step, _fmt({n: result.score(n) for n in result.correct}))
        watch(result)

    if early:
        for result in probes.probes:  # a resumed run: where each policy stood at its checkpoint
            watch(result)
        if not probes.probes:
            take_probe()

    def step() -> None:
        """One step of the recipe's loop as three tasks: the batched rollout, its check, the batched update."""
        # quote: hundreds of rows need no walk for upstream futures (tens of ms per task otherwise)
        batch = clock(rollout, run)
        clock(validate_rollouts, quote(batch), bounds)
        stats = clock(grpo_update, run, quote(batch))
        log.info(
            "step %d/%d: reward %s",
            stats.step,
            training.steps,
            _fmt(stats.reward),
            extra={STEP_RECORD: {"step": stats.step, "steps": training.steps, "reward": dict(stats.reward)}},
        )
        update_progress_artifact(
            progress,
            80.0 * stats.step / training.steps,
            description=f"GRPO step {stats.step}/{training.steps}",
        )
        if early and (stats.step % early.every == 0 or stats.step == training.steps):
            take_probe()

    # a policy continues from its champion with the champion's rank, alpha and targets, whatever the form says
    trained_specs = {p.name: run.trainer.policies[p.name].spec for p in to_train}
    overridden = {p.name: spec_changes(p.spec, trained_specs[p.name]) for p in to_train}
    for p in to_train:
        if overridden[p.name]:
            champ = champions[p.name]
            log.warning(
                "%s continues from its champion %s, which overrides the form: %s",
                p.name,
                champ.address if champ else None,
                "; ".join(overridden[p.name]),
            )

    if run.prompts:  # else early stopping had stopped every policy before the run was resumed
        run.run(step, stop=lambda: not run.prompts)
    curve = run.history
    went: dict[str, Trained] = {}
    for p in to_train:
        plateau = plateaus.get(p.name)
        done = run.trainer.steps
        if plateau is not None and plateau.stopped_at is not None:
            done = min(done, plateau.stopped_at)
        reason = plateau.reason(training.steps) if plateau else f"finished: all {training.steps} steps"
        if early and plateau is not None and plateau.stopped and rejected[p.name] >= early.after_rejections:
            reason = (
                f"its last {rejected[p.name]} candidates were rejected, so one probe to show a gain: {reason}"
            )
        gain, p_value = probe_gain(first[p.name], last[p.name]) if p.name in first else (None, None)
        went[p.name] = Trained(
            steps=done,
            reason=reason,
            exported=plateau is None or plateau.exportable,
            probe=plateau.points if plateau else [],
            probe_gain=gain,
            probe_p=p_value,
        )
        if not went[p.name].exported:
            log.info("%s: not exported or gated (%s)", p.name, reason)
            candidates[p.name] = None
            continue
        # a step where the policy took no update has no loss; steps after it stopped are not its own
        rows = [c for c in curve if c["policy"] == p.name and c["step"] <= done]
        own = [_curve_point(c) for c in rows]
        times = [c["time"] for c in rows] if rows and all(c.get("time") for c in rows) else None
        started = times[0] - float(rows[0]["seconds"]) if times else None
        params = {
            "policy": trained_specs[p.name].model_dump_json(),
            "grpo": training.grpo.model_dump_json(),
            "steps": str(training.steps),
            "prompts_per_step": str(training.prompts_per_step),
            "seed": str(training.seed),
            "round_seed": str(run_seed),
            "round": training.round_name(),
            "data_rev": data_rev,
            "resumed_from_step": str(run.resumed_step),
            "draw": training.draw,
            "prompts_source": prompts[p.name].source,
            "steps_trained": str(done),
            "stop_reason": reason,
        }
        task = task_registry().get(trained_specs[p.name].task)
        params |= {"task": task.name, "task_spec": task.digest(), "reward": task.reward_digest()}
        if prompts[p.name].fresh_seed is not None:
            params["fresh_seed"] = str(prompts[p.name].fresh_seed)
        if early is not None:
            params["early_stop"] = early.model_dump_json()
            params["probe"] = json.dumps([[q.step, q.score] for q in went[p.name].probe])
        if parents[p.name] is not None:
            # how it continued from its champion (also in `policy`: rate_scale, warmup_steps)
            params["continuation"] = training.continuation.model_dump_json()
        if overridden[p.name]:
            # `policy` is what trained (what retraining reads back); the form asked for this
            params["form_policy"] = p.spec.model_dump_json()
            params["overridden_by_champion"] = "; ".join(overridden[p.name])
        candidates[p.name] = clock(
            cached_in(export, ws),
            ws,
            run,
            p.name,
            trained_specs[p.name].rank,
            champions[p.name],
            data_rev,
            keys[p.name],
            own,
            params,
            times,
            started,
        )
    shutil.rmtree(run_dir, ignore_errors=True)  # exported: the checkpoints have done their job
    if mirror:
        drop_mirror(mirror)
    if curve:
        create_table_artifact(
            curve, key="reward-curve", description=f"GRPO reward per step ({', '.join(names)})"
        )
    if early is not None and probes.probes:
        create_table_artifact(
            [{"step": r.step} | {n: round(r.score(n), 4) for n in r.correct} for r in probes.probes],
            key="probe-curve",
            description=f"early stopping: greedy exact match on {early.probe_items} probe items per policy",
        )
    return candidates, curve, run.resumed_step, went


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
    p: PolicyRun,
    cand: RevisionRef,
    champ: RevisionRef | None,
    key: str,
    evaluation: EvalConfig,
    checks: CheckParams,
    ws: Workspace,
    clock: Clock,
    base: BaseScores | None = None,
) -> PolicyOutcome:
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
        clock(promote_and_refresh, ws, p.name, p.served, cand.version, cand.digest, cand.version, restore)
        return outcome(
            "promoted", cand.address, ["promoted by an earlier attempt of this run; serving refreshed"]
        )

    gate_policy = p.gate_policy()
    config = evaluation.model_copy(update={"suites": evaluated_suites(gate_policy, evaluation)})
    scored = cached_in(evaluate, ws)
    cand_scores = clock(scored, ws, cand, "candidate", config, checks.eval)
    scores["candidate"] = cand_scores.scores
    if base is not None:
        scores["base"] = {s: base.scores[s] for s in config.suite_names() if s in base.scores}
    if champ is not None:
        champ_scores = clock(scored, ws, champ, "champion", config, checks.eval)
        scores["champion"] = champ_scores.scores
        decision = clock(gate, ws, cand, gate_policy, cand_scores.scores, champ_scores.scores)
    elif base is not None:
        decision = clock(gate, ws, cand, gate_policy, cand_scores.scores, scores["base"], "base")
    else:
        decision = clock(gate, ws, cand, gate_policy, cand_scores.scores, None)
    if not decision.passed:
        log.info("%s rejected: %s", cand.address, "; ".join(decision.reasons))
        return outcome("rejected", before, decision.reasons)
    if p.canary is not None:
        # the gate passed it offline; live traffic decides whether it replaces the champion
        done = clock(run_canary, ws, p.name, cand.version, p.served, p.canary, f"{key}-canary")
        promoted = done.decision == "promoted"
        out = outcome(
            "promoted" if promoted else "rejected",
            cand.address if promoted else before,
            [*decision.reasons, f"canary {done.decision}: {done.reason}"],
        )
        out.canary = done
        return out
    expect = champ.version if champ else None
    clock(promote_and_refresh, ws, p.name, p.served, cand.version, cand.digest, expect, expect)
    log.info("%s promoted (champion was %s), served as %s", cand.address, before, p.served)
    return outcome("promoted", cand.address, decision.reasons)


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

    def __call__(self, fn: Callable[..., R], *args: Any) -> R:
        t0 = time.perf_counter()
        out = fn(*args)
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
