"""One policy's serving brought in line with its `champion` alias (`reconcile`)."""

from __future__ import annotations

from pydantic import BaseModel

from mint_core.lifecycle.smoke import served_revision, smoke_check, smoke_prompt
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import CHAMPION


class Reconciliation(BaseModel):
    """One policy's serving brought in line with its `champion` alias."""

    policy: str
    champion: int | None
    """The version MLflow's `champion` names (None: unset; serving is then left as it is)."""
    served_before: str | None
    """`sha256:<hex>` served under the policy's name before (None: not loaded)."""
    served_after: str | None
    reloaded: bool
    alias_synced: bool
    """The catalog's alias had to follow a move made in MLflow directly."""


def reconcile(ws: Workspace, policy: str, name: str | None = None) -> Reconciliation:
    """Follow the registry for one policy: sync the catalog's `champion` with MLflow's, and when the server holds
    another revision under `name` (default: the policy's name), load the champion in place and smoke-check it.
    Idempotent; the caller holds `policy_lock` (or the flows' transaction on `promotion_lock`)."""
    name = name or policy
    reg = ws.registry()
    synced = reg.sync_alias(policy, CHAMPION) is not None
    version = reg.alias_version(policy, CHAMPION)
    with ws.client() as client:
        before = served_revision(client, name)
        after, reloaded = before, False
        if version is not None:
            rev = reg.revision(policy, version)
            digest = rev.digest
            if before != f"sha256:{digest}":
                client.load_adapter(name, ws.lora_path(digest), inplace=True)
                smoke_check(client, name, digest, smoke_prompt(rev.tags.get("mint.task")))
                after, reloaded = f"sha256:{digest}", True
    return Reconciliation(
        policy=policy,
        champion=version,
        served_before=before,
        served_after=after,
        reloaded=reloaded,
        alias_synced=synced,
    )
