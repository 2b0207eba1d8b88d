"""Scheduled retraining: every policy that has a champion is trained one wave from it, then gated and promoted.

    policies with a champion -> leave out those being trained or promoted now -> one `wave` over the rest

The deployment (infra/prefect.yaml, `retrain`) runs it nightly with a concurrency limit of one and collision
strategy CANCEL_NEW, so two retraining runs never overlap: one still going when the next fires makes the new one
Cancelled. A policy already being trained by another run (a `wave` or `lifecycle` flow run Pending or Running
on the Prefect server, started from the dashboard or by `mint wave`), or whose promotion lease is held in the
catalog, is skipped with a log line. Rounds are named by the UTC date (`Training.round`), so a rerun the same
day finds the versions the first run made and trains nothing twice.

A retrain that keeps paying, or says why not (issues 28, 33): by default (`RETRAIN_TRAINING`) each round trains on
fresh prompts from the task generators (a seed per round, no held-out or eval-suite prompt among them, recorded
on the MLflow run as `fresh_seed` beside `data_rev`), continues each champion with the continuation recipe (a
quarter of the rate, warmed up: `Training.continuation`), and stops a policy whose greedy probe of held-out reward
does not rise within a few probes, or falls below the champion's beyond noise (`EarlyStop`), skipping its export
and evaluation; a policy whose last attempts failed (candidates rejected, or waves stopped without gain:
`no_gain_waves`) gets one probe to show a gain. The report says, per policy, its gain and p-value, the steps it
trained and why it stopped (`RetrainReport.policies`, the `retrain-report` artifact).
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from pydantic import BaseModel, Field

from flows.forms import PolicyRun, Training, WaveReport
from flows.lifecycle import run_held, wave
from mint_core.data.checks import CheckParams
from mint_core.eval.early_stop import EarlyStop
from mint_core.eval.gate import GATE_TAG
from mint_core.eval.lm_eval_runner import EvalConfig
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.lifecycle.revisions import champion
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.mlflow_registry import Registry
from mint_core.registry.reader import Revision
from mint_core.rl.policy import PolicySpec
from tasks.common import RETRY_DELAYS, transient
from tasks.registry import NO_GAIN_TAG

RETRAIN_STEPS = 200
"""Most GRPO steps a nightly wave gives each policy. A saturated champion's continuation (`rl.builder.Continuation`:
a quarter of the rate, warmed up) keeps it, within noise, and early stopping ends most such waves after 30 steps (3
probes without a rise) whatever this budget (`benchmarks/learning_curves.py`, `add`, `sort` and `reverse`, 3 seeds;
docs/training.md, "The continuation recipe"). A champion with headroom (its pass@G well above its greedy score on
the night's prompts: `Continuation.min_headroom`) continues at the full rate, and early stopping waits for it
(only a fall stops it): its probe dips for the first 40-60 steps while AdamW's moments start again, and rises after
about 100. On `examples/shout`'s first champion (greedy 0.475 on the gate's items) 100 steps gained +0.031 to +0.047
(one of three seeds at p < 0.05), 200 steps +0.050 and +0.088 (p 0.02, 0.0003): hence 200."""

RETRAIN_TRAINING = Training(steps=RETRAIN_STEPS, draw="fresh", early_stop=EarlyStop())
"""The nightly wave's training: fresh prompts each round, early stopping on the default probe."""

TRAINING_FLOWS = ["wave", "lifecycle"]
"""Flows whose Pending or Running runs mark their policies as being trained."""


class Skipped(BaseModel):
    policy: str
    reason: str


class PolicyReport(BaseModel):
    """One policy's night: what became of it, what it gained, what it cost, why it stopped."""

    policy: str
    status: str
    """The wave's outcome ("promoted", "rejected", "unchanged", "failed", "stopped"), or "skipped" when the wave
    did not take it."""
    gain: float | None = None
    """Paired effect of its candidate over its champion on its own suite (the gate's); for "stopped", the
    probe's change over the steps it trained."""
    p_value: float | None = None
    """Exact two-sided McNemar p of `gain`."""
    gain_on: str | None = None
    """`suite:<name>` or `probe`."""
    steps: int | None = None
    """GRPO steps it trained tonight (None: none)."""
    stop_reason: str | None = None
    """Why its training ended, or why it was skipped."""
    rejected_before: int = 0
    """Its attempts from its champion that failed before tonight: candidates rejected in a row, and waves early
    stopping ended without a gain (`no_gain_waves`). From `EarlyStop.after_rejections` of them on, one probe
    interval decides whether it trains on."""


class RetrainReport(BaseModel):
    trained: list[str] = Field(default_factory=list)
    """Policies the wave took."""
    skipped: list[Skipped] = Field(default_factory=list)
    wave: WaveReport | None = None
    policies: list[PolicyReport] = Field(default_factory=list)
    """Per policy, those the wave took and those it did not: status, gain, p-value, steps, why it stopped."""


@task(cache_policy=NO_CACHE, retries=3, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)
def champions_to_retrain(ws: Workspace, names: list[str] | None) -> tuple[list[PolicyRun], list[Skipped]]:
    """Every policy (or the named ones) that has a champion, with the spec its champion was trained with (the
    `policy` parameter of the champion's MLflow training run); the others, with why they are left out."""
    reg = ws.registry()
    runs: list[PolicyRun] = []
    skipped: list[Skipped] = []
    for name in names if names is not None else reg.policies():
        rev = champion(reg, name)
        if rev is None:
            skipped.append(Skipped(policy=name, reason="no champion"))
            continue
        spec = None
        if rev.run_id:
            params = reg.client.get_run(rev.run_id).data.params
            spec = params.get("policy")
        if spec is None:
            skipped.append(Skipped(policy=name, reason=f"{rev.address} has no training run naming its spec"))
            continue
        rejected = rejected_in_a_row(reg, name, rev) + no_gain_waves(rev)
        runs.append(PolicyRun(spec=PolicySpec.model_validate_json(spec), rejected=rejected))
    return runs, skipped


def rejected_in_a_row(reg: Registry, policy: str, champ: Revision) -> int:
    """How many of the policy's newest versions after its champion the gate rejected, newest first, up to one it
    passed (or one it never gated: an attempt that failed before the gate neither counts nor breaks the run)."""
    n = 0
    for rev in sorted(reg.revisions(policy), key=lambda r: r.version, reverse=True):
        if rev.version <= champ.version:
            break
        tag = rev.tags.get(GATE_TAG)
        if tag is None:
            continue
        try:
            passed = bool(json.loads(tag).get("passed"))
        except (ValueError, AttributeError):
            continue
        if passed:
            break
        n += 1
    return n


def no_gain_waves(champ: Revision) -> int:
    """How many waves from the champion early stopping ended without a gain (its `NO_GAIN_TAG`): failed
    attempts that made no version, counted with the rejected ones."""
    try:
        return int(json.loads(champ.tags.get(NO_GAIN_TAG, "{}")).get("count", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


def _policies_of(parameters: dict[str, Any]) -> set[str]:
    """The policies a wave or lifecycle run's parameters name."""
    runs = list(parameters.get("policies") or [])
    if parameters.get("policy"):
        runs.append(parameters["policy"])
    return {str(r["spec"]["name"]) for r in runs if isinstance(r, dict) and isinstance(r.get("spec"), dict)}


@task(cache_policy=NO_CACHE, retries=3, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)
def being_trained(ws: Workspace, names: list[str]) -> dict[str, str]:
    """Of `names`, those another run is training now (policy -> what holds it): a Pending or Running `wave` or
    `lifecycle` flow run on the Prefect server that names it, or its promotion lease held (`workspace.leases()`)."""
    busy: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        active = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=TRAINING_FLOWS)),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING])
                )
            ),
            limit=200,
        )
    for run in active:
        for name in _policies_of(run.parameters) & set(names):
            busy.setdefault(name, f"flow run {run.name} ({run.id}) is training it")
    leases = ws.leases()  # where promotions take it: the catalog, or Redis where lock_url names one
    for name in names:
        holder = leases.holder(f"promote-{name}")
        if holder is not None and name not in busy:
            busy[name] = f"its promotion lease is held by {holder}"
    return busy


@flow(name="retrain", log_prints=True)
def retrain(
    policies: list[str] | None = None,
    training: Training = RETRAIN_TRAINING,
    evaluation: EvalConfig = EvalConfig(limit=EVAL_LIMIT, guard_limit=GUARD_LIMIT),
    checks: CheckParams = CheckParams(),
    workspace: Workspace = Workspace(),
) -> RetrainReport:
    """Train every policy that has a champion (or the named ones) one wave from it, on fresh prompts, each
    stopped when its held-out probe does not rise, then gate and promote each; policies another run is training
    now are skipped. Reports per policy its gain, p-value, steps and why it stopped."""
    with run_held(workspace):
        return _retrain(policies, training, evaluation, checks, workspace)


def _retrain(
    policies: list[str] | None,
    training: Training,
    evaluation: EvalConfig,
    checks: CheckParams,
    workspace: Workspace,
) -> RetrainReport:
    log = get_run_logger()
    runs, skipped = champions_to_retrain(workspace, policies)
    for s in skipped:
        log.info("skipping %s: %s", s.policy, s.reason)
    busy = being_trained(workspace, [r.name for r in runs])
    for name, why in busy.items():
        log.info("skipping %s: already being trained (%s)", name, why)
        skipped.append(Skipped(policy=name, reason=f"already being trained: {why}"))
    runs = [r for r in runs if r.name not in busy]
    for r in runs:
        if r.rejected:
            log.info("%s: its last %d candidate(s) were rejected", r.name, r.rejected)
    report = RetrainReport(trained=[r.name for r in runs], skipped=skipped)
    if runs:
        log.info("retraining %s from their champions", ", ".join(r.name for r in runs))
        report.wave = wave(runs, training, evaluation, checks, workspace)
    else:
        log.info("nothing to retrain")
    report.policies = policy_reports(runs, skipped, report.wave)
    create_markdown_artifact(
        markdown=report_markdown(report.policies),
        key="retrain-report",
        description="per policy: status, gain and p-value, GRPO steps, why it stopped or was skipped",
    )
    return report


def policy_reports(
    runs: list[PolicyRun], skipped: list[Skipped], report: WaveReport | None
) -> list[PolicyReport]:
    """The night per policy: the wave's outcomes, then the policies it did not take."""
    rejected = {r.name: r.rejected for r in runs}
    out = [
        PolicyReport(
            policy=o.policy,
            status=o.status,
            gain=o.gain,
            p_value=o.p_value,
            gain_on=o.gain_on,
            steps=o.steps,
            stop_reason=o.stop_reason,
            rejected_before=rejected.get(o.policy, 0),
        )
        for o in (report.outcomes if report else [])
    ]
    out += [PolicyReport(policy=s.policy, status="skipped", stop_reason=s.reason) for s in skipped]
    return out


def report_markdown(rows: list[PolicyReport]) -> str:
    """The per-policy report as a markdown table."""
    if not rows:
        return "### Retrain\n\nNo policy to retrain.\n"
    lines = [
        "### Retrain",
        "",
        "| policy | status | gain | p | on | steps | failed before | why it stopped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        gain = "-" if r.gain is None else f"{r.gain:+.3f}"
        p = "-" if r.p_value is None else f"{r.p_value:.3g}"
        why = (r.stop_reason or "").replace("|", "/")
        steps = "-" if r.steps is None else str(r.steps)
        cells = [r.policy, r.status, gain, p, r.gain_on or "-", steps, str(r.rejected_before), why]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
