"""Serving steps: swap a policy's served revision in place (with an undo), check what is served, bring serving in
line with the registry, and warm the next wave's revisions."""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import Transaction, get_transaction
from pydantic import BaseModel

from mint_core.lifecycle.faults import fault
from mint_core.lifecycle.prefetch import prefetch, prefetch_route
from mint_core.lifecycle.reconcile import Reconciliation, reconcile
from mint_core.lifecycle.smoke import served_revision, smoke_check, smoke_prompt
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import CHAMPION
from mint_core.serving.client import ServingError
from tasks.common import RETRY_DELAYS, Timed, transient

_RETRY: dict[str, Any] = dict(retries=3, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)


class Refreshed(Timed):
    """What a served name held before a refresh and holds after it."""

    name: str
    before: str | None
    """`sha256:<hex>` served before (None: the name was not loaded)."""
    after: str


class Smoke(Timed):
    name: str
    revision: str
    latency_s: float


class Reconciled(Reconciliation, Timed):
    """One policy's serving brought in line with its `champion` alias (`mint_core.lifecycle.reconcile`)."""


class Prefetched(BaseModel):
    route: str
    """"prefetch" (the server's /v1/mint/prefetch) or "load" (loaded under the served names)."""
    addresses: list[str]
    results: dict[str, str]
    seconds: float


@task(cache_policy=NO_CACHE, **_RETRY)
def refresh_serving(ws: Workspace, name: str, digest: str) -> Refreshed:
    """Load revision `digest` in place under the served `name` (requests never fail across the swap)."""
    t0 = time.perf_counter()
    with ws.client() as client:
        before = served_revision(client, name)
        fault("refresh_serving")
        if before != f"sha256:{digest}":
            client.load_adapter(name, ws.lora_path(digest), inplace=True)
    out = Refreshed(name=name, before=before, after=f"sha256:{digest}", work_s=time.perf_counter() - t0)
    txn = get_transaction()
    if txn is not None:
        txn.set("workspace", ws)
        txn.set("refreshed", out)
    return out


@refresh_serving.on_rollback
def _undo_refresh(txn: Transaction) -> None:
    """Rollback hook: serve what was served before (or unload the name if nothing was)."""
    ws: Workspace = txn.get("workspace")
    r: Refreshed = txn.get("refreshed")
    with ws.client() as client:
        if r.before is None:
            client.unload_adapter(r.name)
        elif r.before != r.after:
            client.load_adapter(r.name, ws.lora_path(r.before.removeprefix("sha256:")), inplace=True)


@task(cache_policy=NO_CACHE, **_RETRY)
def check_served(ws: Workspace, name: str, digest: str, task: str | None = None) -> Smoke:
    """Served smoke check: `name` is listed with revision `digest`, and it answers a held-out prompt of its
    `task` (`smoke_prompt`)."""
    t0 = time.perf_counter()
    fault("smoke_check")
    with ws.client(timeout=30) as client:
        latency = smoke_check(client, name, digest, smoke_prompt(task))
    return Smoke(name=name, revision=f"sha256:{digest}", latency_s=latency, work_s=time.perf_counter() - t0)


@task(cache_policy=NO_CACHE, **_RETRY)
def reconcile_policy(ws: Workspace, policy: str, name: str) -> Reconciled:
    """Follow the registry: sync the catalog's alias with MLflow's, and load the champion if serving differs."""
    t0 = time.perf_counter()
    r = reconcile(ws, policy, name)
    return Reconciled(**r.model_dump(), work_s=time.perf_counter() - t0)


@task(cache_policy=NO_CACHE, **_RETRY)
def prefetch_revisions(ws: Workspace, names: dict[str, str]) -> Prefetched:
    """Warm the champions of the given policies (policy -> served name): in the local store cache (the trainer
    reads them), and on the server, through its prefetch route when it has one, else by loading them."""
    t0 = time.perf_counter()
    reg = ws.registry()
    champions = {p: reg.resolve(p, CHAMPION) for p in names if reg.alias_version(p, CHAMPION) is not None}
    for rev in champions.values():
        reg.store.local_dir(rev.digest)
    addresses = [rev.address for rev in champions.values()]
    with ws.client() as client:
        if addresses and prefetch_route(client):
            try:
                got = prefetch(client, addresses, wait=True)
                results = {k: str(v) for k, v in (got.get("results") or {}).items()}
                return Prefetched(
                    route="prefetch", addresses=addresses, results=results, seconds=time.perf_counter() - t0
                )
            except ServingError as e:  # a server without a catalog answers 400: load them instead
                get_run_logger().info("prefetch route refused (%s): loading under the served names", e)
        results = {}
        for p, rev in champions.items():
            if served_revision(client, names[p]) != f"sha256:{rev.digest}":
                client.load_adapter(names[p], ws.lora_path(rev.digest), inplace=True)
                results[rev.address] = "loaded"
            else:
                results[rev.address] = "already served"
    return Prefetched(route="load", addresses=addresses, results=results, seconds=time.perf_counter() - t0)
