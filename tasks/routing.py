"""Router steps of the `route` flow: find the routing dir and read its route log, gather the cold-start prompts,
load the serving router, fit and estimate a candidate, register it, move `champion` and make the server follow it
(each move with an undo for the transaction around them), and show the decision on the dashboard."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.transactions import Transaction, get_transaction
from pydantic import BaseModel

from mint_core.data.spec import SpecError
from mint_core.data.spec import registry as task_registry
from mint_core.lifecycle.routers import (
    LOG_FILE,
    EstimateDoc,
    Prompt,
    RouterGate,
    RouterReconciliation,
    TaskChoice,
    cold_start_prompts,
    reconcile_router,
    router_registry,
    routing_dir,
    served_router,
)
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.routers import RouterRefused, RouterVersion
from mint_core.routing.fit import fit_router
from mint_core.routing.log import RouteLog, RouteRecord
from mint_core.routing.ope import Estimate, dr
from mint_core.routing.router import Router
from mint_core.serving.client import ServingError
from tasks.common import RETRY_DELAYS, Timed, transient

logger = logging.getLogger(__name__)

_RETRY: dict[str, Any] = dict(retries=3, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)

REPORT_KEY = "route-report"
"""The key of the `route` flow's markdown artifact (the dashboard's Artifacts tab keeps each run's)."""


class RouterRef(BaseModel):
    """One version of the router's registered model, as the tasks pass it along."""

    model: str
    version: int
    revision: str

    @property
    def address(self) -> str:
        return f"{self.model}/v{self.version}"

    @classmethod
    def of(cls, rv: RouterVersion) -> RouterRef:
        return cls(model=rv.model, version=rv.version, revision=rv.revision)


class RouteLogs(Timed):
    """The decisions of the route logs read, joined with their rewards."""

    routing_dir: str
    files: list[str]
    records: list[RouteRecord]
    rewarded: int
    skipped: int
    """Malformed lines and rewards for unknown requests left out."""


class ColdStart(BaseModel):
    arms: dict[str, list[Prompt]]
    """Arm (a policy's served name) -> its task's held-out prompts."""
    task_of: dict[str, str]
    tasks: dict[str, list[Prompt]]
    """Every registered task's held-out prompts (the per-task view of the report)."""


class RouterMoved(Timed):
    model: str
    from_version: int | None
    to_version: int
    moved: bool


@task(cache_policy=NO_CACHE, **_RETRY)
def locate_routing(ws: Workspace, given: Path | None) -> Path:
    """The serving's routing dir: `given`, else the one the server names (`GET /v1/mint/router`), else the server's
    default beside the store (the server is not asked when it does not answer)."""
    if given is not None:
        return routing_dir(ws, None, given)
    try:
        with ws.client(timeout=30) as client:
            view = served_router(client)
    except ServingError as e:
        get_run_logger().info("the server does not answer (%s): its default routing dir is assumed", e)
        view = None
    return routing_dir(ws, view)


@task(cache_policy=NO_CACHE)
def read_route_logs(where: Path, extra: list[Path]) -> RouteLogs:
    """The route log of the routing dir (its rotated files too) and any `extra` ones (other hosts' copies), as
    one list in time order (a request id seen twice: its first decision)."""
    t0 = time.perf_counter()
    logs = [RouteLog(where / LOG_FILE)] + [RouteLog(Path(p)) for p in extra]
    seen: dict[str, RouteRecord] = {}
    skipped = 0
    for log in logs:
        for rec in log.records():
            seen.setdefault(rec.rid, rec)
        skipped += log.skipped
    records = sorted(seen.values(), key=lambda r: r.t)
    return RouteLogs(
        routing_dir=str(where),
        files=[str(f) for log in logs for f in log.files()],
        records=records,
        rewarded=sum(r.reward is not None for r in records),
        skipped=skipped,
        work_s=time.perf_counter() - t0,
    )


@task(cache_policy=NO_CACHE, **_RETRY)
def cold_start(ws: Workspace, per_task: int) -> ColdStart:
    """The policies' arms with their tasks' held-out prompts, and every registered task's (for the report)."""
    arms, task_of = cold_start_prompts(ws, per_task)
    tasks: dict[str, list[Prompt]] = {}
    reg = task_registry()
    for name in reg.names():
        try:
            tasks[name] = [r.prompt for r in reg.get(name).heldout_rows()[: max(per_task, 1)]]
        except SpecError as e:
            get_run_logger().info("task %s: no held-out prompts for the report: %s", name, e)
    return ColdStart(arms=arms, task_of=task_of, tasks=tasks)


@task(cache_policy=NO_CACHE, **_RETRY)
def serving_router(ws: Workspace, where: Path, model: str) -> tuple[RouterRef | None, Router | None]:
    """The router `champion` names, loaded from the cache (downloaded when missing): (None, None) before the
    first; (its version, None) when it does not load, which the gate then treats as no serving router."""
    routers = router_registry(ws, where, model)
    champ = routers.champion()
    if champ is None:
        return None, None
    try:
        return RouterRef.of(champ), Router.load(routers.fetch(champ.version))
    except RouterRefused as e:
        get_run_logger().warning("the serving champion does not load; judged as no serving router: %s", e)
        return RouterRef.of(champ), None


@task(cache_policy=NO_CACHE)
def fit_candidate(records: list[RouteRecord], arms: dict[str, list[Prompt]]) -> Router:
    """A router fitted afresh on the logged rewards (time order), its arms warm-started from their tasks'
    held-out prompts: reproducible from the log and the registered tasks alone. Saved once (to a temporary
    directory) so it carries its revision, which says whether it is the serving router."""
    router = fit_router(records, cold_start=arms)
    with tempfile.TemporaryDirectory(prefix="router-") as tmp:
        router.save(Path(tmp) / "router")
    return router


@task(cache_policy=NO_CACHE)
def estimate(records: list[RouteRecord], router: Router | None) -> Estimate | None:
    """The router's doubly robust estimate of its mean reward per request on the logged decisions (95% CI)."""
    return None if router is None else dr(records, router)


@task(cache_policy=NO_CACHE, **_RETRY)
def register_router(
    ws: Workspace,
    model: str,
    router: Router,
    candidate: Estimate,
    serving: Estimate | None,
    gate: RouterGate,
    params: dict[str, str],
) -> RouterRef:
    """Save the router and register it as the next version of `model`, tagged with its estimate, the serving
    router's and the gate's decision (idempotent by revision)."""
    with tempfile.TemporaryDirectory(prefix="router-") as tmp:
        path = Path(tmp) / "router"
        router.save(path)
        rv = router_registry(ws, None, model).register(
            path,
            ope=EstimateDoc.of(candidate).model_dump(),
            baseline=None if serving is None else EstimateDoc.of(serving).model_dump(),
            gate=gate.model_dump(),
            params=params,
        )
    return RouterRef.of(rv)


@task(cache_policy=NO_CACHE, **_RETRY)
def move_router_champion(
    ws: Workspace, where: Path, model: str, version: int, expect: int | None
) -> RouterMoved:
    """`champion` := version once it loads from MLflow's copy, only if it still is `expect` (where the gate saw
    it); the undo moves it back."""
    t0 = time.perf_counter()
    move = router_registry(ws, where, model).promote(
        version, f"route flow: v{version} passed the gate", expect=expect
    )
    out = RouterMoved(
        model=model,
        from_version=move.from_version,
        to_version=move.to_version,
        moved=move.moved,
        work_s=time.perf_counter() - t0,
    )
    txn = get_transaction()
    if txn is not None:
        txn.set("workspace", ws)
        txn.set("routing_dir", where)
        txn.set("router_moved", out)
    return out


@move_router_champion.on_rollback
def _undo_router_alias(txn: Transaction) -> None:
    """Rollback hook: point `champion` back where it was (or unset it), only from where this move left it, and
    bring the server in line with it again (it may have taken the new router before the step that failed)."""
    ws: Workspace = txn.get("workspace")
    m: RouterMoved = txn.get("router_moved")
    if not m.moved:
        return
    routers = router_registry(ws, txn.get("routing_dir"), m.model)
    if routers.aliases().get("champion") != m.to_version:
        return
    reason = f"undo: serving did not follow v{m.to_version}"
    if m.from_version is None:
        routers.unset_champion(reason)
        return
    routers.promote(m.from_version, reason, expect=m.to_version)
    try:
        reconcile_router(ws, m.model)
    except Exception as e:  # the reconcile deployment tries again within its interval
        logger.error("the server could not be given %s/v%d back: %s", m.model, m.from_version, e)


@task(cache_policy=NO_CACHE, **_RETRY)
def refresh_router(ws: Workspace, model: str, where: Path | None) -> RouterReconciliation:
    """The server routes with the `champion` router (`PUT /v1/mint/router`), checked by reading it back; `where`:
    the routing dir (None: the one the server names)."""
    return reconcile_router(ws, model, where)


@task(cache_policy=NO_CACHE)
def publish_route_report(markdown: str) -> None:
    """The gate's decision and the router's choices per task, on the dashboard (artifact `route-report`)."""
    create_markdown_artifact(
        key=REPORT_KEY,
        markdown=markdown,
        description="the router's gate decision and its choices per task against the oracle of the route log",
    )


def report_markdown(
    gate: RouterGate | None,
    candidate: RouterRef | None,
    cand_est: Estimate | None,
    serving: RouterRef | None,
    serv_est: Estimate | None,
    logs: RouteLogs,
    choices: list[TaskChoice],
    promoted: bool,
) -> str:
    """The route flow's decision as the dashboard shows it."""

    def est(e: Estimate | None) -> str:
        return (
            "-" if e is None or e.n == 0 else f"{e.value:.3f} [{e.lo:.3f}, {e.hi:.3f}] (n={e.n}, {e.method})"
        )

    lines = ["### Router", ""]
    if gate is None:
        lines += ["Nothing to route to: no policy has a champion and the route log is empty.", ""]
    else:
        outcome = (
            "promoted to champion" if promoted else ("unchanged" if gate.decision == "unchanged" else "kept")
        )
        lines += [
            f"**Decision: {gate.decision}** ({outcome}): {gate.reason}",
            "",
            "| router | version | revision | estimate (95% CI) |",
            "| --- | --- | --- | --- |",
            f"| candidate | {candidate.address if candidate else '-'} | "
            f"{candidate.revision[:12] if candidate else '-'} | {est(cand_est)} |",
            f"| serving | {serving.address if serving else 'none'} | "
            f"{serving.revision[:12] if serving else '-'} | {est(serv_est)} |",
            "",
            f"Route log: {len(logs.records)} decisions, {logs.rewarded} rewarded, {logs.skipped} lines skipped "
            f"({', '.join(logs.files) or 'no log yet under ' + logs.routing_dir}). Rule: {gate.rule}.",
            "",
        ]
    if choices:
        lines += [
            "#### Choices per task against the oracle of the log",
            "",
            "| task | prompts | router's choice | serving's choice | oracle (logged mean) | choice's logged mean "
            "| agrees with oracle | logged |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in choices:

            def pick(name: str | None, share: float) -> str:
                return "-" if name is None else f"{name} ({share:.0%})"

            oracle = "-" if c.oracle is None else f"{c.oracle} ({c.oracle_reward:.3f})"
            mean = "-" if c.choice_reward is None else f"{c.choice_reward:.3f}"
            agree = "-" if c.agreement is None else f"{c.agreement:.0%}"
            cells = [c.task, str(c.prompts), pick(c.choice, c.share), pick(c.serving_choice, c.serving_share)]
            lines.append("| " + " | ".join([*cells, oracle, mean, agree, str(c.logged)]) + " |")
    return "\n".join(lines) + "\n"
