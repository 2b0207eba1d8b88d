"""The router's lifecycle in the library: where its files are, what a fitted router starts from, the gate that lets
one replace the serving router, the servers following its `champion` (`reconcile_router`), and what it chooses
per task against the oracle of the logged rewards.

Where: the server keeps its route log and loads routers only inside its routing dir (`ServingConfig.routing_dir`,
by default `<adapter store>/../routing`). `GET /v1/mint/router` names the log, so the routing dir is read from the
server when it answers (its own setting wins), else derived from the workspace's store as the server's default
does. Versions of the router are downloaded to `<routing dir>/registry/<revision>`, where the server may load them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from mint_core.data.spec import SpecError
from mint_core.data.spec import registry as task_registry
from mint_core.lifecycle.errors import LifecycleError
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import CHAMPION
from mint_core.registry.routers import ROUTER_MODEL, RouterRegistry
from mint_core.routing.log import LOG_NAME, RouteRecord
from mint_core.routing.ope import Estimate
from mint_core.routing.router import Router
from mint_core.serving.client import ServingClient, ServingError

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, str]]

ROUTE_MIN_RECORDS = 200
"""Rewarded decisions in the route log below which no router's off-policy estimate is trusted: with fewer, a
candidate is registered but not promoted (unless there is no serving router and no record at all: a cold start)."""
COLD_START_PROMPTS = 64
"""Held-out prompts per registered task that warm-start its policy's arm in a fitted router."""
CACHE_DIR = "registry"
"""The folder of the routing dir that holds the router versions downloaded from MLflow, one per revision."""
LOG_FILE = Path(LOG_NAME).name
"""The route log's file name inside the routing dir (`mint_core.routing.log.LOG_NAME`)."""
GATE_RULE = (
    "promote when the candidate's 95% lower bound (doubly robust, on the logged rewards) is at least the serving "
    "router's point estimate on the same records, over at least min_records rewarded decisions; with no serving "
    "router yet, promote when it loads and there are at least min_records rewarded decisions, or none at all (a "
    "router fitted on the registered tasks' held-out prompts only)"
)
"""The gate of the `route` flow, as its decision records it."""


# ---- where -------------------------------------------------------------------------------------------------


def default_routing_dir(ws: Workspace) -> Path:
    """The server's default routing dir for this workspace's store: `<store>/../routing`."""
    if "://" in ws.store:
        raise LifecycleError(
            f"the store {ws.store} is not a local directory: name the serving's routing dir "
            "(its route log and router files), e.g. the route flow's `config.routing_dir`"
        )
    return Path(ws.store).resolve().parent / "routing"


def routing_dir(ws: Workspace, view: Mapping[str, Any] | None, given: Path | None = None) -> Path:
    """The routing dir: `given`, else the one the server's `GET /v1/mint/router` names (the folder of its log,
    when absolute), else `default_routing_dir`."""
    if given is not None:
        return Path(given).resolve()
    log = (view or {}).get("log")
    if log and Path(log).is_absolute():
        return Path(log).parent
    return default_routing_dir(ws)


def router_registry(ws: Workspace, where: Path | None, model: str = ROUTER_MODEL) -> RouterRegistry:
    """The router's registry for this workspace, caching versions under `<where>/registry` (None: no cache, for
    reads and registrations)."""
    reg = ws.registry()
    cache = None if where is None else where / CACHE_DIR
    return RouterRegistry(ws.tracking_uri, reg.leases, cache, model, reg.actor)


# ---- the server's router -----------------------------------------------------------------------------------


def served_router(client: ServingClient) -> dict[str, Any] | None:
    """`GET /v1/mint/router`: the revision serving `model: "auto"` and its log; None from a server without it."""
    try:
        return dict(client._call("GET", "/v1/mint/router").json())
    except ServingError as e:
        if e.status == 404:
            return None
        raise


def serve_router(client: ServingClient, path: Path, revision: str) -> dict[str, Any]:
    """`PUT /v1/mint/router`: serve the router at `path` (inside the server's routing dir), which must hold
    `revision`; a 422 (it does not load there) leaves the serving router as it was."""
    body = {"path": str(path), "revision": revision}
    return dict(client._call("PUT", "/v1/mint/router", admin=True, json=body).json())


class RouterReconciliation(BaseModel):
    """The server's router brought in line with the registry's `champion`."""

    model: str
    champion: int | None
    """The version `champion` names (None: unset; the server keeps what it has)."""
    revision: str | None
    """The champion's router revision."""
    served_before: str | None
    """The revision the server routed with before (`cold` for a router it started with no saved state)."""
    path_before: str | None
    """Where that router was loaded from (None: started cold), so an undo can serve it again."""
    served_after: str | None
    reloaded: bool


def reconcile_router(
    ws: Workspace, model: str = ROUTER_MODEL, given_dir: Path | None = None
) -> RouterReconciliation:
    """Make the server route with the router `champion` names: download the version into the routing dir, load
    it to check it, `PUT /v1/mint/router`, and read back that it serves. Nothing happens without a champion, and
    nothing changes when the server already serves it. `RouterRefused` (the version does not load) and
    `ServingError` (the server refused it) leave the server's router as it was. Idempotent; the caller holds the
    model's promotion lock."""
    champ = router_registry(ws, None, model).champion()
    if champ is None:
        return RouterReconciliation(
            model=model, champion=None, revision=None, served_before=None, path_before=None,
            served_after=None, reloaded=False,
        )  # fmt: skip
    with ws.client() as client:
        view = served_router(client)
        if view is None:
            raise LifecycleError(
                f"{client.base_url} has no router route (GET /v1/mint/router is 404): it cannot follow "
                f"{model}@{CHAMPION}"
            )
        before, after, reloaded = str(view.get("revision")), str(view.get("revision")), False
        if before != champ.revision:
            where = routing_dir(ws, view, given_dir)
            path = router_registry(ws, where, model).fetch(champ.version)
            serve_router(client, path, champ.revision)
            after = str((served_router(client) or {}).get("revision"))
            if after != champ.revision:
                raise LifecycleError(
                    f"{client.base_url} serves router {after} after it was given {champ.address} "
                    f"({champ.revision})"
                )
            reloaded = True
            logger.info(
                "router %s -> %s (%s) on %s", before, champ.revision[:12], champ.address, client.base_url
            )
    return RouterReconciliation(
        model=model,
        champion=champ.version,
        revision=champ.revision,
        served_before=before,
        path_before=view.get("path"),
        served_after=after,
        reloaded=reloaded,
    )


# ---- what a router starts from -----------------------------------------------------------------------------


def cold_start_prompts(
    ws: Workspace, per_task: int = COLD_START_PROMPTS
) -> tuple[dict[str, list[Prompt]], dict[str, str]]:
    """The arms a fitted router warm-starts, each with its task's first `per_task` held-out prompts: every policy
    with a champion whose task is registered here (its champion's `mint.task` tag, else a task of the policy's
    own name, as the built-in policies are). Returns ({arm: prompts}, {arm: task}); one read of the registry."""
    tasks = task_registry()
    aliased, revisions = ws.registry().reader.everything()
    champions = {(p, a[CHAMPION]) for p, a in aliased.items() if CHAMPION in a}
    prompts: dict[str, list[Prompt]] = {}
    task_of: dict[str, str] = {}
    for rev in revisions:
        if (rev.policy, rev.version) not in champions:
            continue
        task = rev.tags.get("mint.task") or (rev.policy if rev.policy in tasks else None)
        if task is None or task not in tasks:
            logger.info(
                "%s: no registered task to warm-start its arm from (learned online only)", rev.address
            )
            continue
        try:
            rows = tasks.get(task).heldout_rows()[:per_task]
        except SpecError as e:
            logger.warning("%s: task %s has no held-out prompts: %s", rev.address, task, e)
            continue
        prompts[rev.policy], task_of[rev.policy] = [r.prompt for r in rows], task
    return prompts, task_of


# ---- the gate ----------------------------------------------------------------------------------------------


class RouterGate(BaseModel):
    """Whether a fitted router replaces the serving one, and why."""

    passed: bool
    decision: str
    """`promote`, `keep` (not shown better, or too few records), or `unchanged` (the serving router's revision)."""
    reason: str
    rule: str = GATE_RULE


class EstimateDoc(BaseModel):
    """An off-policy estimate as a report and a tag hold it (a NaN of an empty estimate as None)."""

    value: float | None
    lo: float | None
    hi: float | None
    n: int
    method: str

    @classmethod
    def of(cls, est: Estimate) -> EstimateDoc:
        def num(v: float) -> float | None:
            return None if math.isnan(v) else float(v)

        return cls(value=num(est.value), lo=num(est.lo), hi=num(est.hi), n=est.n, method=est.method)


def estimate_doc(est: Estimate | None) -> EstimateDoc | None:
    return None if est is None else EstimateDoc.of(est)


def router_gate(
    candidate: Estimate, serving: Estimate | None, min_records: int = ROUTE_MIN_RECORDS, same: bool = False
) -> RouterGate:
    """`GATE_RULE`: `candidate` and `serving` (None: no serving router) estimated on the same rewarded records
    (`candidate.n` of them); `same`: the candidate is the serving router's revision."""
    n = candidate.n
    if same:
        return RouterGate(
            passed=False, decision="unchanged", reason="the fit is the serving router's revision"
        )
    if serving is None:
        if n == 0:
            return RouterGate(
                passed=True,
                decision="promote",
                reason="no serving router and no logged reward yet: the router fitted on the registered tasks' "
                "held-out prompts becomes the first champion",
            )
        if n < min_records:
            return RouterGate(
                passed=False,
                decision="keep",
                reason=f"no serving router yet, and {n} rewarded decisions < min_records {min_records}: too few "
                "to judge a router fitted on them",
            )
        return RouterGate(
            passed=True,
            decision="promote",
            reason=f"no serving router yet; estimated {candidate.value:.3f} [{candidate.lo:.3f}, "
            f"{candidate.hi:.3f}] over {n} rewarded decisions",
        )
    if n < min_records:
        return RouterGate(
            passed=False,
            decision="keep",
            reason=f"{n} rewarded decisions < min_records {min_records}: too few to estimate either router",
        )
    verdict = ">=" if candidate.lo >= serving.value else "<"
    return RouterGate(
        passed=verdict == ">=",
        decision="promote" if verdict == ">=" else "keep",
        reason=f"candidate's lower bound {candidate.lo:.3f} {verdict} serving's estimate {serving.value:.3f} "
        f"(candidate {candidate.value:.3f} [{candidate.lo:.3f}, {candidate.hi:.3f}], n={n})",
    )


# ---- choices per task against the oracle ---------------------------------------------------------------------


class TaskChoice(BaseModel):
    """What a router chooses for one task's held-out prompts, and what the logged rewards say was best."""

    task: str
    prompts: int
    choice: str | None
    """The arm the router picks most often (greedily) for the task's prompts."""
    share: float
    """Of the task's prompts, the share it picks `choice` for."""
    serving_choice: str | None = None
    serving_share: float = 0.0
    logged: int = 0
    """Rewarded decisions in the log whose prompt is one of the task's (matched by feature digest)."""
    oracle: str | None = None
    """The arm with the highest mean logged reward on the task's prompts (None: nothing logged)."""
    oracle_reward: float | None = None
    choice_reward: float | None = None
    """The mean logged reward of `choice` on the task's prompts (None: never logged there)."""
    agreement: float | None = None
    """Share of the task's prompts on which the router picks `oracle`."""


def _greedy(router: Router, xs: np.ndarray, arms: Sequence[str]) -> list[str]:
    return [arms[int(np.argmax(router.probs(x, arms)))] for x in xs]


def _top(picks: list[str]) -> tuple[str | None, float]:
    if not picks:
        return None, 0.0
    names, counts = np.unique(np.array(picks), return_counts=True)
    i = int(np.argmax(counts))
    return str(names[i]), float(counts[i]) / len(picks)


def choices_per_task(
    router: Router,
    records: Sequence[RouteRecord],
    task_prompts: Mapping[str, Sequence[Prompt]],
    serving: Router | None = None,
) -> list[TaskChoice]:
    """Per task: the router's (and the serving router's) greedy choice over the task's prompts, against the oracle
    of the log: the arm whose logged rewards on those prompts are highest. A logged decision belongs to a task
    when its features' digest is that of one of the task's prompts (the rewards the server scores by task
    lookup are exactly these)."""
    feat = router.featurizer
    arms = router.arms()
    xs = {t: feat.transform_many(list(ps)) for t, ps in task_prompts.items()}
    owner = {feat.digest(x): t for t, rows in xs.items() for x in rows}
    sums: dict[str, dict[str, list[float]]] = {t: {} for t in task_prompts}
    for rec in records:
        t = owner.get(rec.features_digest)
        if t is not None and rec.reward is not None:
            sums[t].setdefault(rec.choice, []).append(rec.reward)
    out = []
    for task, rows in xs.items():
        picks = _greedy(router, rows, arms) if arms and len(rows) else []
        choice, share = _top(picks)
        row = TaskChoice(task=task, prompts=len(rows), choice=choice, share=share)
        if serving is not None and serving.arms() and len(rows):
            row.serving_choice, row.serving_share = _top(_greedy(serving, rows, serving.arms()))
        means = {arm: float(np.mean(r)) for arm, r in sums[task].items()}
        row.logged = sum(len(r) for r in sums[task].values())
        if means:
            row.oracle = max(means, key=lambda a: (means[a], a))
            row.oracle_reward = means[row.oracle]
            row.choice_reward = means.get(choice) if choice is not None else None
            row.agreement = sum(p == row.oracle for p in picks) / len(picks) if picks else None
        out.append(row)
    return out
