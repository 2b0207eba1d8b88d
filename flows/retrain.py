"""Scheduled retraining: every policy that has a champion is trained one wave from it, then gated and promoted.

    policies with a champion -> leave out those being trained or promoted now -> one `wave` over the rest

The deployment (infra/prefect.yaml, `retrain`) runs it nightly with a concurrency limit of one and collision
strategy CANCEL_NEW, so two retraining runs never overlap: one still going when the next fires makes the new one
Cancelled. A policy already being trained by another run (a `wave` or `lifecycle` flow run Pending or Running
on the Prefect server, started from the dashboard or by `mint wave`), or whose promotion lease is held in the
catalog, is skipped with a log line. Rounds are named by the UTC date (`Training.round`), so a rerun the same
day finds the versions the first run made and trains nothing twice.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
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

from flows.lifecycle import PolicyRun, Training, WaveReport, wave
from mint_core.data.checks import CheckParams
from mint_core.eval.lm_eval_runner import EvalConfig
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.lifecycle import Workspace, champion
from mint_core.rl.trainer import PolicySpec
from tasks.common import RETRY_DELAYS, transient

TRAINING_FLOWS = ["wave", "lifecycle"]
"""Flows whose Pending or Running runs mark their policies as being trained."""


class Skipped(BaseModel):
    policy: str
    reason: str


class RetrainReport(BaseModel):
    trained: list[str] = Field(default_factory=list)
    """Policies the wave took."""
    skipped: list[Skipped] = Field(default_factory=list)
    wave: WaveReport | None = None


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
        runs.append(PolicyRun(spec=PolicySpec.model_validate_json(spec)))
    return runs, skipped


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
    training: Training = Training(),
    evaluation: EvalConfig = EvalConfig(limit=EVAL_LIMIT, guard_limit=GUARD_LIMIT),
    checks: CheckParams = CheckParams(),
    workspace: Workspace = Workspace(),
) -> RetrainReport:
    """Train every policy that has a champion (or the named ones) one wave from it, then gate and promote each;
    policies another run is training now are skipped."""
    log = get_run_logger()
    runs, skipped = champions_to_retrain(workspace, policies)
    for s in skipped:
        log.info("skipping %s: %s", s.policy, s.reason)
    busy = being_trained(workspace, [r.name for r in runs])
    for name, why in busy.items():
        log.info("skipping %s: already being trained (%s)", name, why)
        skipped.append(Skipped(policy=name, reason=f"already being trained: {why}"))
    runs = [r for r in runs if r.name not in busy]
    if not runs:
        log.info("nothing to retrain")
        return RetrainReport(skipped=skipped)
    log.info("retraining %s from their champions", ", ".join(r.name for r in runs))
    report = wave(runs, training, evaluation, checks, workspace)
    return RetrainReport(trained=[r.name for r in runs], skipped=skipped, wave=report)
