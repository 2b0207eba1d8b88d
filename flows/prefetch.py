"""Warm the next wave before it starts: its policies' champions (the revisions the wave trains from, and what
serving will compare candidates against) are copied into the local store cache and cold-loaded on the server,
through `POST /v1/mint/prefetch` when the server has it (with a catalog) and by loading them under their served
names otherwise. Scheduled shortly before the wave (infra/prefect.yaml)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from mint_core.lifecycle.workspace import Workspace
from tasks.serving import Prefetched, prefetch_revisions


@flow(name="prefetch", log_prints=True)
def prefetch(
    policies: list[str],
    served_names: dict[str, str] | None = None,
    workspace: Workspace = Workspace(),
) -> Prefetched:
    """Schedule cold loads of the champions of the next wave's policies."""
    served = served_names or {}
    out = prefetch_revisions(workspace, {p: served.get(p, p) for p in policies})
    get_run_logger().info(
        "prefetched %d revisions via %s in %.2f s", len(out.addresses), out.route, out.seconds
    )
    return out
