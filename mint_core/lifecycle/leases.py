"""The leases of the lifecycle: a policy's promotion lock (promotions, rollbacks, reconciles) and a training run's
lease, renewed while its process lives."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.index import new_holder
from mint_core.registry.leases import Leases, held, leases_for

logger = logging.getLogger(__name__)

WORKER_ENV = "MINT_WORKER_NAME"
"""The name of the worker whose process runs this flow run (set by `mint worker` / `mint up`)."""


def promotion_lock(policy: str) -> str:
    """The lease that serialises everything that changes what `policy` serves: promotions, rollbacks,
    reconciles (the key of the flows' SERIALIZABLE transactions, and what the webhook receiver takes)."""
    return f"promote-{policy}"


@contextmanager
def policy_lock(ws: Workspace, policy: str, holder: str, timeout_s: float | None = 60.0) -> Iterator[None]:
    """Hold `policy`'s promotion lock for the block, outside Prefect (the flows' SERIALIZABLE transactions take
    the same lease); `mint_core.registry.leases.LockTimeout` when it stays taken for `timeout_s`."""
    with held(ws.leases(), promotion_lock(policy), new_holder(holder), timeout_s, ws.lock_hold_s):
        yield


RUN_LEASE_PREFIX = "run/"
"""The lease a training flow run holds while it runs: `run/<flow run id>` (`held_run`)."""


def run_lease(flow_run_id: str) -> str:
    return f"{RUN_LEASE_PREFIX}{flow_run_id}"


def run_holder() -> str:
    """Who holds a run's lease: the worker that started this process (`WORKER_ENV`; `local` outside a worker),
    then the machine and process, so a worker that starts again knows the leases its dead runs held."""
    return new_holder(os.environ.get(WORKER_ENV) or "local")


def holder_worker(holder: str) -> str:
    """The worker named in a `run_holder()` string."""
    return holder.split("@", 1)[0]


@contextmanager
def held_run(ws: Workspace, flow_run_id: str, wait_s: float | None = None) -> Iterator[str]:
    """Hold `run/<flow_run_id>` for the block, renewed every third of `ws.run_lease_s` by a thread, so the catalog
    says the run is alive while its process is; a run whose host died lets it expire, and a worker then requeues
    it (`mint_app.services.deployments.reclaim_runs`). A run started again waits out its dead attempt's lease (`wait_s`,
    default three lease lengths); `LockTimeout` when another live process still holds it. Yields the holder."""
    # the catalog's leases (or Redis's) without the registry: holding a run's lease needs no MLflow
    catalog = Catalog(CatalogConfig(url=ws.catalog_url))
    try:
        leases = leases_for(ws.lock_url, catalog)
        name, holder, hold = run_lease(flow_run_id), run_holder(), ws.run_lease_s
        before = leases.holder(name)
        if before is not None:
            logger.info("run lease %s held by %s (an earlier attempt); waiting for it", name, before)
        with (
            held(leases, name, holder, 3 * hold if wait_s is None else wait_s, hold),
            _renewed(leases, name, holder, hold),
        ):
            yield holder
    finally:
        catalog.close()


@contextmanager
def _renewed(leases: Leases, name: str, holder: str, hold: float) -> Iterator[None]:
    """Renew a held lease every third of `hold` from a thread for the block."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(hold / 3):
            try:
                if not leases.acquire(name, holder, 0, hold):
                    logger.error("lease %s was taken by %s", name, leases.holder(name))
            except Exception as e:  # a catalog hiccup: the next renewal tries again, well within `hold`
                logger.warning("could not renew lease %s: %s", name, e)

    thread = threading.Thread(target=renew, name=f"renew-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=hold)
