"""Serving follows the registry's `champion` aliases.

A person may move an alias anywhere MLflow lets them (the UI, `MlflowClient`): that is a rollback or a
promotion by hand. `reconcile` re-indexes the policy in the catalog from MLflow (the truth) and brings the
served revision in line with MLflow's alias, policy by policy, under the same per-policy catalog lock as
promotions (so it never interleaves with one). MLflow's alias webhook reaches mint's receiver
(`mint_app.services.webhooks`), which runs the same `mint_core.lifecycle.reconcile` for the one policy within seconds,
and sweeps every policy every 30 s for an event that was missed; this flow, deployed on an interval of 10 minutes
(infra/prefect.yaml), is the net for when the receiver is not running.

The router of `model: "auto"` (MLflow's `mint-router`, not a policy) is followed the same way: when its `champion`
names another router revision than the server routes with, the server is given it (`PUT /v1/mint/router`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import IsolationLevel, Transaction, transaction

from mint_core.lifecycle.leases import promotion_lock
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.routers import ROUTER_MODEL
from tasks.common import RETRY_DELAYS, lock_store, transient
from tasks.routing import refresh_router
from tasks.serving import Reconciled, reconcile_policy


class ReconcileFailed(RuntimeError):
    """Some policies could not be brought in line; the others were."""


@task(cache_policy=NO_CACHE, retries=3, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)
def list_policies(ws: Workspace) -> list[str]:
    """Every policy the registry holds."""
    return ws.registry().policies()


@flow(name="reconcile", log_prints=True)
def reconcile(
    policies: list[str] | None = None,
    served_names: dict[str, str] | None = None,
    workspace: Workspace = Workspace(),
) -> list[Reconciled]:
    """Make each policy's served revision its MLflow `champion` (all policies unless named), and the server's
    router the `mint-router` champion (unless policies are named without it); `served_names` maps a policy to the
    adapter name it is served under when that is not its own name."""
    log = get_run_logger()
    names = [p for p in policies if p != ROUTER_MODEL] if policies else list_policies(workspace)
    served = served_names or {}
    done: list[Reconciled] = []
    failed: list[str] = []
    for policy in names:
        try:
            with _serialized(workspace, policy):
                r = reconcile_policy(workspace, policy, served.get(policy, policy))
        except Exception as e:
            log.error("%s: %s: %s", policy, type(e).__name__, e)
            failed.append(f"{policy}: {e}")
            continue
        done.append(r)
        if r.reloaded:
            log.info(
                "%s: serving %s -> %s (champion v%s)", policy, r.served_before, r.served_after, r.champion
            )
    log.info("%d policies checked, %d reloaded", len(done), sum(r.reloaded for r in done))
    if not policies or ROUTER_MODEL in policies:
        try:
            with _serialized(workspace, ROUTER_MODEL):
                rr = refresh_router(workspace, ROUTER_MODEL, None)
            if rr.reloaded:
                log.info("router: %s -> %s (champion v%s)", rr.served_before, rr.served_after, rr.champion)
        except Exception as e:
            log.error("%s: %s: %s", ROUTER_MODEL, type(e).__name__, e)
            failed.append(f"{ROUTER_MODEL}: {e}")
    if failed:
        raise ReconcileFailed("; ".join(failed))
    return done


def _serialized(ws: Workspace, name: str) -> AbstractContextManager[Transaction]:
    """The transaction that makes one reconcile of `name` run alone: on its promotion lock, as promotions do."""
    return transaction(
        key=promotion_lock(name),
        isolation_level=IsolationLevel.SERIALIZABLE,
        store=lock_store(ws),
        overwrite=True,
        write_on_commit=False,
    )
