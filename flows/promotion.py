"""Moving `champion` and what serving answers with, together or not at all.

`promote_and_refresh` is the transaction every flow uses: alias move, in-place swap on the server, smoke check.
A failure at any point runs the undo hooks of the steps that had finished (alias back, previous revision served
again). Promotions of one policy run one at a time across processes (Prefect's SERIALIZABLE isolation over the
policy's lease, `tasks.common.LeaseLocks`: the catalog's, or Redis's where `workspace.lock_url` names one), and an alias move only happens from where the gate saw it, so of two promotions
racing for one policy the second finds the alias moved and loses with nothing changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefect import flow, get_run_logger
from prefect.transactions import IsolationLevel, transaction
from pydantic import BaseModel

from mint_core.lifecycle.workspace import Workspace
from mint_core.types import Digest
from tasks.common import AliasMoved, lock_store
from tasks.registry import current_champion, promote, rollback
from tasks.serving import Refreshed, Smoke, check_served, refresh_serving


class Promotion(BaseModel):
    """One transaction's outcome."""

    alias: AliasMoved
    refreshed: Refreshed
    smoke: Smoke
    lock_wait_s: float
    """Time spent waiting for the policy's lock (another promotion of it in flight)."""
    seconds: float
    """Lock taken to commit."""


def champion_transaction(
    ws: Workspace, policy: str, served_name: str, move: Callable[[], AliasMoved]
) -> Promotion:
    """[transaction, one per policy at a time] move `champion`, load its revision in place under the served name,
    smoke-check it; a failure anywhere undoes the steps that had finished, and re-raises."""
    t0 = time.perf_counter()
    with transaction(
        key=f"promote-{policy}",
        isolation_level=IsolationLevel.SERIALIZABLE,
        store=lock_store(ws),
        overwrite=True,  # a lock, not a cache: every promotion runs
        write_on_commit=False,
    ):
        t_lock = time.perf_counter()
        moved = move()
        refreshed = refresh_serving(ws, served_name, moved.to_digest)
        task = ws.registry().revision(policy, moved.to_version).tags.get("mint.task")
        smoke = check_served(ws, served_name, moved.to_digest, task)
    return Promotion(
        alias=moved,
        refreshed=refreshed,
        smoke=smoke,
        lock_wait_s=t_lock - t0,
        seconds=time.perf_counter() - t_lock,
    )


def promote_and_refresh(
    ws: Workspace,
    policy: str,
    served_name: str,
    version: int,
    digest: Digest,
    expect: int | None,
    restore: int | None,
) -> Promotion:
    """champion := version (only if it still is `expect`), served and smoke-checked; the undo restores `restore`."""
    return champion_transaction(
        ws, policy, served_name, lambda: promote(ws, policy, version, digest, expect, restore)
    )


@flow(name="promote", log_prints=True)
def promote_flow(
    policy: str,
    version: int,
    expect: int | None = None,
    served_name: str | None = None,
    workspace: Workspace = Workspace(),
) -> Promotion:
    """Make one version of a policy its champion and serve it (a person's promotion, or the end of a wave).
    `expect`: the champion the decision was made against; None means the champion now."""
    log = get_run_logger()
    champ = current_champion(workspace, policy)
    if expect is None and champ is not None:
        expect = champ.version
    rev = workspace.registry().revision(policy, version)
    out = promote_and_refresh(workspace, policy, served_name or policy, version, rev.digest, expect, expect)
    log.info("%s@champion: v%s -> v%d, served as %s", policy, expect, version, served_name or policy)
    return out


@flow(name="rollback", log_prints=True)
def rollback_flow(
    policy: str,
    to_version: int | None = None,
    served_name: str | None = None,
    reason: str = "rollback",
    workspace: Workspace = Workspace(),
) -> Promotion:
    """Move `champion` back (to `to_version`, or to the champion before the current one) and serve it."""
    out = champion_transaction(
        workspace, policy, served_name or policy, lambda: rollback(workspace, policy, to_version, reason)
    )
    moved = out.alias
    get_run_logger().info("%s@champion rolled back: v%s -> v%d", policy, moved.from_version, moved.to_version)
    return out
