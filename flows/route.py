"""The router of `model: "auto"` as a revisioned model: fit a candidate from the route log, gate it by an
off-policy estimate against the serving router, register it in MLflow, and move `champion` when it wins.

    routing dir (the server's) -> route log(s) -> cold-start prompts (each policy's task's held-out prompts)
    -> serving router (MLflow `mint-router@champion`) -> fit a candidate -> doubly robust estimates, 95% CI
    -> gate -> register a version -> [promote: champion := it, the server routes with it] -> dashboard artifact

The gate (`mint_core.lifecycle.routers.GATE_RULE`): the candidate replaces the serving router when its 95% lower
bound is at least the serving router's point estimate, both on the same logged rewards, over at least
`min_records` of them. With no serving router yet, it becomes the first champion when it loads and either there
are at least `min_records` rewarded decisions, or none at all: on a fresh clone, before any `model: "auto"`
traffic, the router fitted on the registered tasks' held-out prompts alone is registered and served. Every
candidate is registered (a kept one too, with its decision), so MLflow shows what was tried.

Serving follows `champion` wherever it moves: here (alias move and `PUT /v1/mint/router` in one transaction, the
alias moved back when the server does not take it), in the MLflow UI (a reviewer's rollback: the webhook receiver),
or missed (the `reconcile` deployment). The deployment (infra/prefect.yaml, `route`) runs nightly.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.transactions import IsolationLevel, transaction
from pydantic import BaseModel, ConfigDict, Field

from mint_core.lifecycle.leases import promotion_lock
from mint_core.lifecycle.routers import (
    COLD_START_PROMPTS,
    ROUTE_MIN_RECORDS,
    EstimateDoc,
    RouterGate,
    RouterReconciliation,
    TaskChoice,
    choices_per_task,
    estimate_doc,
    router_gate,
)
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.routers import ROUTER_MODEL
from tasks.common import lock_store
from tasks.routing import (
    RouterMoved,
    RouterRef,
    cold_start,
    estimate,
    fit_candidate,
    locate_routing,
    move_router_champion,
    publish_route_report,
    read_route_logs,
    refresh_router,
    register_router,
    report_markdown,
    serving_router,
)


class RouteConfig(BaseModel):
    """What the `route` flow reads, how it gates, and whether it promotes."""

    model_config = ConfigDict(extra="forbid")

    min_records: int = Field(ROUTE_MIN_RECORDS, ge=1)
    """Rewarded decisions the off-policy estimates need before a router is judged by them."""
    cold_start_prompts: int = Field(COLD_START_PROMPTS, ge=0)
    """Held-out prompts per task that warm-start each policy's arm (and make the per-task view)."""
    routing_dir: Path | None = None
    """The serving's routing dir (its route log, where router versions are cached for it to load). Default: the
    one the server names, else `<store>/../routing`."""
    extra_logs: list[Path] = Field(default_factory=list)
    """More route logs to learn from (other hosts' copies), besides the routing dir's."""
    promote: bool = True
    """Move `champion` and the servers when the gate passes; False: register and report only."""
    model: str = Field(ROUTER_MODEL, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    """The MLflow registered model of the router (change it only to keep two routers apart)."""


class RouteReport(BaseModel):
    """What a `route` run found, decided and did."""

    records: int
    rewarded: int
    arms: list[str] = Field(default_factory=list)
    candidate: RouterRef | None = None
    candidate_estimate: EstimateDoc | None = None
    serving: RouterRef | None = None
    """The champion when the run started (None: none yet)."""
    serving_estimate: EstimateDoc | None = None
    gate: RouterGate | None = None
    promoted: bool = False
    moved: RouterMoved | None = None
    served: RouterReconciliation | None = None
    tasks: list[TaskChoice] = Field(default_factory=list)


@flow(name="route", log_prints=True)
def route(config: RouteConfig = RouteConfig(), workspace: Workspace = Workspace()) -> RouteReport:
    """Fit a router from the route log (and the policies' tasks' held-out prompts), gate it by a doubly robust
    off-policy estimate against the serving router, register it in MLflow (`mint-router`), and when it passes make
    it `champion` and the router the server routes `model: "auto"` with."""
    log = get_run_logger()
    where = locate_routing(workspace, config.routing_dir)
    logs = read_route_logs(where, config.extra_logs)
    log.info(
        "route log under %s: %d decisions, %d rewarded (%d lines skipped)",
        where, len(logs.records), logs.rewarded, logs.skipped,
    )  # fmt: skip
    cold = cold_start(workspace, config.cold_start_prompts)
    log.info("cold start: %s", ", ".join(f"{a} ({cold.task_of[a]})" for a in cold.arms) or "no policy arm")
    serving_ref, serving = serving_router(workspace, where, config.model)
    log.info("serving router: %s", serving_ref.address if serving_ref else "none yet")
    report = RouteReport(records=len(logs.records), rewarded=logs.rewarded, serving=serving_ref)
    if not cold.arms and not logs.records:
        log.info("nothing to route to: no policy has a champion and the route log is empty")
        publish_route_report(report_markdown(None, None, None, serving_ref, None, logs, [], False))
        return report

    candidate = fit_candidate(logs.records, cold.arms)
    report.arms = candidate.arms()
    cand_est, serv_est = estimate(logs.records, candidate), estimate(logs.records, serving)
    assert cand_est is not None
    same = serving_ref is not None and serving is not None and serving.revision == candidate.revision
    gate = router_gate(cand_est, serv_est, config.min_records, same=same)
    log.info("gate: %s: %s", gate.decision, gate.reason)
    report.gate, report.candidate_estimate, report.serving_estimate = (
        gate, estimate_doc(cand_est), estimate_doc(serv_est),
    )  # fmt: skip
    report.tasks = choices_per_task(candidate, logs.records, cold.tasks, serving)
    if gate.decision == "unchanged":
        report.candidate = serving_ref
    else:
        params = {
            "records": str(len(logs.records)),
            "rewarded": str(logs.rewarded),
            "logs": ",".join(logs.files),
        }
        report.candidate = register_router(
            workspace, config.model, candidate, cand_est, serv_est, gate, params
        )
        log.info("registered %s (router %s)", report.candidate.address, report.candidate.revision[:12])
    if gate.passed and config.promote and report.candidate is not None:
        report.moved, report.served = promote_router(
            workspace, config.model, where, report.candidate.version, serving_ref
        )
        report.promoted = True
        log.info(
            "%s@champion: %s -> v%d; the server routes with %s",
            config.model, f"v{report.moved.from_version}" if report.moved.from_version else "unset",
            report.moved.to_version, report.served.served_after,
        )  # fmt: skip
    publish_route_report(
        report_markdown(
            gate, report.candidate, cand_est, serving_ref, serv_est, logs, report.tasks, report.promoted
        )
    )
    return report


def promote_router(
    ws: Workspace, model: str, where: Path, version: int, serving: RouterRef | None
) -> tuple[RouterMoved, RouterReconciliation]:
    """[transaction, one at a time with every other move of the router] `champion` := version (only from where the
    gate saw it), then the server routes with it; a failure of either undoes both, and re-raises."""
    with transaction(
        key=promotion_lock(model),
        isolation_level=IsolationLevel.SERIALIZABLE,
        store=lock_store(ws),
        overwrite=True,  # a lock, not a cache: every promotion runs
        write_on_commit=False,
    ):
        moved = move_router_champion(ws, where, model, version, serving.version if serving else None)
        served = refresh_router(ws, model, where)
    return moved, served
