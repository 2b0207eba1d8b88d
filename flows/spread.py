"""A wave spread over the workers of a pool: the policies split into groups, each group one run of the `wave`
deployment, which whichever worker is free takes.

    policies -> groups of `per_run` -> one `wave` deployment run each (to the pool) -> wait for all -> report

A `wave` run trains its group in one process over one resident base (one batched rollout and update per step),
so a group is the unit a host trains; more groups than workers queue in the pool until a worker is free. Each
group's run is created with an idempotency key made of this run's id and the group, so a rerun of this flow run
(its worker died and another requeued it) finds the runs it had made instead of making them twice. A group run
whose worker dies is requeued by a worker (its run lease expired, or its worker starts again:
`mint_app.services.deployments.reclaim_runs`) and resumes from its checkpoint (mirrored at `workspace.checkpoint_url`,
so any host can resume it); its policies' versions are keyed by their idempotency keys, so none is made twice.
"""

from __future__ import annotations

import time
from typing import Annotated
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.runtime import flow_run as prefect_flow_run
from pydantic import BaseModel, Field

from flows.forms import Policies, PolicyRun, Training
from flows.lifecycle import run_held
from mint_core.data.checks import CheckParams
from mint_core.errors import MintError
from mint_core.eval.lm_eval_runner import EvalConfig
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.lifecycle.workspace import Workspace

WAVE_DEPLOYMENT = "wave/wave"
"""The deployment each group runs as (infra/prefect.yaml, `wave`)."""


class SpreadFailed(MintError):
    """A group's wave run did not complete; names each such group, its flow run and its state."""


class GroupRun(BaseModel):
    """One group of the spread wave: its policies and the flow run that trained them."""

    policies: list[str]
    flow_run_id: str
    flow_run_name: str
    state: str
    """The run's final state name (Completed, Failed, Crashed, Cancelled)."""
    runs: int
    """Times the run was started (more than 1: a worker requeued it after its first worker died)."""


class SpreadReport(BaseModel):
    groups: list[GroupRun]
    seconds: float
    """From the first group's submission to the last group's end."""


def groups_of(policies: list[PolicyRun], per_run: int) -> list[list[PolicyRun]]:
    """The policies in groups of `per_run`, in order (the last may be smaller)."""
    return [policies[i : i + per_run] for i in range(0, len(policies), per_run)]


@flow(name="spread", log_prints=True)
def spread(
    policies: Policies,
    training: Training = Training(),
    evaluation: EvalConfig = EvalConfig(limit=EVAL_LIMIT, guard_limit=GUARD_LIMIT),
    checks: CheckParams = CheckParams(),
    workspace: Workspace = Workspace(),
    per_run: Annotated[int, Field(ge=1)] = 1,
    deployment: str = WAVE_DEPLOYMENT,
    poll_s: Annotated[float, Field(gt=0)] = 2.0,
) -> SpreadReport:
    """Spread a wave over the pool's workers: one `deployment` run per group of `per_run` policies, all
    submitted at once, each trained, evaluated, gated and promoted by whichever worker takes it; waits for all.
    Each run uses its worker's own working directory (`workspace.work_dir` is left to the worker)."""
    log = get_run_logger()
    with run_held(workspace):
        # one round for every group, whatever the date when a worker gets to it
        training = training.model_copy(update={"round": training.round_name()})
        shared = {
            "training": training.model_dump(mode="json"),
            "evaluation": evaluation.model_dump(mode="json"),
            "checks": checks.model_dump(mode="json"),
            "workspace": workspace.model_dump(mode="json", exclude={"work_dir"}),
        }
        parent = str(prefect_flow_run.id or "local")
        t0 = time.monotonic()
        submitted: list[tuple[list[str], UUID]] = []
        for i, group in enumerate(groups_of(list(policies), per_run)):
            names = [p.name for p in group]
            params = {"policies": [p.model_dump(mode="json") for p in group], **shared}
            run = run_deployment(  # sync in a sync flow (Prefect's async_dispatch)
                deployment,
                parameters=params,
                timeout=0,
                idempotency_key=f"spread-{parent}-{i}-{'+'.join(names)}",
                as_subflow=True,
            )
            assert isinstance(run, FlowRun)
            log.info("group %d (%s): flow run %s (%s)", i, ", ".join(names), run.name, run.id)
            submitted.append((names, run.id))
        groups = _wait(submitted, poll_s)
        report = SpreadReport(groups=groups, seconds=round(time.monotonic() - t0, 1))
    failed = [g for g in groups if g.state != "Completed"]
    if failed:
        raise SpreadFailed(
            "; ".join(
                f"{', '.join(g.policies)}: flow run {g.flow_run_name} ({g.flow_run_id}) {g.state}"
                for g in failed
            )
        )
    return report


def _wait(
    submitted: list[tuple[list[str], UUID]], poll_s: float, say_every_s: float = 60.0
) -> list[GroupRun]:
    """Poll the group runs until each is in a final state; a requeued run (Scheduled again) is waited for too.
    Every `say_every_s` the log says how many are still waiting for a worker, and how many run."""
    done: dict[str, GroupRun] = {}
    said = time.monotonic()
    with get_client(sync_client=True) as client:
        while len(done) < len(submitted):
            states: list[str] = []
            for names, run_id in submitted:
                if str(run_id) in done:
                    continue
                run = client.read_flow_run(run_id)
                states.append(run.state.type.value if run.state else "NONE")
                if run.state is not None and run.state.is_final():
                    done[str(run_id)] = GroupRun(
                        policies=names,
                        flow_run_id=str(run_id),
                        flow_run_name=run.name,
                        state=run.state.name or run.state.type.value,
                        runs=run.run_count,
                    )
            if len(done) < len(submitted):
                if time.monotonic() - said >= say_every_s:
                    said = time.monotonic()
                    waiting = states.count("SCHEDULED") + states.count("PENDING")
                    get_run_logger().info(
                        "%d of %d group(s) done; %d waiting for a worker of the pool, %d running",
                        len(done),
                        len(submitted),
                        waiting,
                        states.count("RUNNING"),
                    )
                time.sleep(poll_s)
    return [done[str(run_id)] for _, run_id in submitted]
