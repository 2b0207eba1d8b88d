"""Canary promotion: a candidate answers a share of a policy's live requests, and an always-valid sequential test
on their scores promotes it or rolls it back on its own.

    start: load <policy>@canary, smoke-check, alias `canary`, split on the server
    -> watch: the server's scores (task rewards, POST /v1/feedback) -> sequential test -> MLflow + artifact
    -> promote (the champion transaction of flows/promotion.py) or roll back; then end the split

Whatever happens after the split is put (a failed watch, a lost alias race at promotion), the split ends and the
`canary` alias goes, so no share of traffic stays on a candidate nobody watches.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows.promotion import Promotion, promote_and_refresh
from mint_core.lifecycle.workspace import Workspace
from tasks.canary import CanaryConfig, CanaryWatch, end_canary, start_canary, watch_canary


class CanaryOutcome(BaseModel):
    """What a canary decided, on what evidence, after how many requests."""

    policy: str
    version: int
    champion_before: int | None
    decision: str
    """promoted, rolled back (the canary was worse), or inconclusive (rolled back: not shown better in time)."""
    reason: str
    requests: int
    """Requests answered under the policy's name while the canary ran."""
    scored: int
    """Of them, scored (what the test read)."""
    diff: float | None
    lo: float | None
    hi: float | None
    seconds: float
    promotion: Promotion | None = None


DECIDED = {"promote": "promoted", "rollback": "rolled back", "inconclusive": "inconclusive"}


def run_canary(
    ws: Workspace, policy: str, version: int, served: str, config: CanaryConfig, key: str
) -> CanaryOutcome:
    """The canary steps inside whatever flow runs them (the `canary` flow, or a wave's promote step)."""
    started = start_canary(ws, policy, version, served, config.share, key)
    promotion: Promotion | None = None
    try:
        watched: CanaryWatch = watch_canary(ws, started, config)
        if watched.decision == "promote":
            promotion = promote_and_refresh(
                ws, policy, served, version, started.digest, started.champion, started.champion
            )
    except BaseException as e:
        end_canary(ws, started, "aborted", f"{type(e).__name__}: {e}", None)
        raise
    decision = DECIDED[watched.decision]
    end_canary(ws, started, decision, watched.reason, watched.estimate)
    est = watched.estimate
    return CanaryOutcome(
        policy=policy,
        version=version,
        champion_before=started.champion,
        decision=decision,
        reason=watched.reason,
        requests=watched.requests,
        scored=est.n,
        diff=est.diff,
        lo=est.lo,
        hi=est.hi,
        seconds=watched.seconds,
        promotion=promotion,
    )


@flow(name="canary", log_prints=True)
def canary_flow(
    policy: str,
    version: int,
    canary: CanaryConfig = CanaryConfig(),
    served_name: str | None = None,
    workspace: Workspace = Workspace(),
) -> CanaryOutcome:
    """Serve version `version` of `policy` to `canary.share` of its requests beside the champion, and let the
    online test promote it or roll it back (a person's canary, `mint registry promote --canary`, or a wave's)."""
    key = f"{policy}-v{version}-{flow_run.get_id() or 'local'}"
    out = run_canary(workspace, policy, version, served_name or policy, canary, key)
    get_run_logger().info(
        "canary %s/v%d %s after %d scored requests: %s", policy, version, out.decision, out.scored, out.reason
    )
    return out
