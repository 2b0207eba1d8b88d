"""Canary steps: serve a candidate to a share of a policy's requests, watch its online scores against the
champion's with an always-valid sequential test (`mint_core.eval.online`), and end the canary."""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from mint_core.errors import MintError
from mint_core.eval.online import Estimate, OnlineTestConfig, SequentialTest
from mint_core.lifecycle.smoke import served_revision, smoke_check, smoke_prompt
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import CHAMPION
from mint_core.registry.runs import end_run, log_metrics, start_canary_run
from mint_core.registry.tags import json_tag
from mint_core.serving.client import ServingError
from mint_core.types import Digest
from tasks.common import RETRY_DELAYS, Timed, artifact_key, is_transient, transient

CANARY = "canary"
"""The MLflow alias of a policy's revision under canary."""
CANARY_TAG = "mint.canary"
"""Model-version tag: the canary's share, start, and (once ended) its decision and evidence, as JSON."""
_RETRY: dict[str, Any] = dict(retries=3, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)


class CanaryError(MintError):
    """A canary cannot start (or go on); says why, before anything changed."""


class CanaryConfig(BaseModel):
    """How a canary runs and decides (the `canary` flow's form)."""

    share: float = Field(0.1, gt=0.0, lt=1.0)
    """Fraction of the policy's request keys (users) the candidate answers; the champion answers the rest."""
    alpha: float = Field(0.05, gt=0.0, lt=1.0)
    """Level of the always-valid test: the chance it ever promotes a canary no better than the champion (or
    rolls back one no worse), however long it watches."""
    margin: float = Field(0.0, ge=-1.0, le=1.0)
    """Promote when the interval of (canary - champion) lies above it, roll back when it lies below."""
    min_per_arm: int = Field(100, ge=1)
    """Scores each arm needs before any decision. The test is asymptotic, and with skewed scores and a small
    share its early intervals are too narrow: simulated at equal quality with continuous monitoring (2,000
    streams of 3,000 requests), share 0.1 and both arms right 90-95% of the time, it decided wrongly in 7.6% of
    the streams with 30 scores per arm, 5.6-6.9% with 60, and 3.7-5.0% with 100 (alpha 0.05)."""
    max_requests: int = Field(20_000, ge=1)
    """Scored requests after which an undecided canary is rolled back as inconclusive."""
    max_minutes: float = Field(60.0, gt=0)
    """Time after which an undecided canary is rolled back as inconclusive (e.g. too little traffic)."""
    poll_s: float = Field(5.0, gt=0, le=300)
    """Seconds between reads of the server's scores (each read updates MLflow and the flow's artifact)."""

    def test(self) -> OnlineTestConfig:
        return OnlineTestConfig(
            share=self.share,
            alpha=self.alpha,
            margin=self.margin,
            min_per_arm=self.min_per_arm,
            max_requests=self.max_requests,
        )


class CanaryStarted(Timed):
    """A canary being served: who answers what."""

    policy: str
    version: int
    digest: Digest
    served: str
    """The name users ask for (the policy's served name)."""
    canary_name: str
    """The served name of the candidate: `<served>@canary`."""
    control: str
    """The served name of the rest: `served` (its champion), or the base's name while the policy has none."""
    control_revision: str
    """What the control arm's answers are served by: the champion's hex digest, or "base"."""
    champion: int | None
    share: float
    cursor: int
    """The server's score sequence when the split was put: the watch reads what comes after."""
    run_id: str
    """The MLflow run of this canary (experiment mint-canary)."""
    started: float


class CanaryWatch(Timed):
    estimate: Estimate
    decision: str
    """promote, rollback or inconclusive."""
    reason: str
    requests: int
    """Requests the server answered under the policy's name while the canary ran (scored or not)."""
    ignored: int
    """Scores left out: answered by a revision that was not the arm's (e.g. a swap by someone else)."""
    seconds: float
    history: list[dict[str, Any]]
    """The running estimate at each poll (n, diff, lo, hi, means): the curve the artifact shows."""


def _base_name(client: Any) -> str:
    bare = [m["id"] for m in client.models() if not m.get("parent")]
    if not bare:
        raise CanaryError(f"{client.base_url} lists no base model")
    return str(bare[0])


@task(cache_policy=NO_CACHE, **_RETRY)
def start_canary(
    ws: Workspace, policy: str, version: int, served: str, share: float, key: str
) -> CanaryStarted:
    """Check, then: load the candidate as `<served>@canary`, smoke-check it, point `canary` at it in MLflow, and
    put the split on the server. A candidate that is the champion, or a policy with another canary, is refused
    before anything changes."""
    t0 = time.perf_counter()
    reg = ws.registry()
    rev = reg.revision(policy, version)  # an unknown version: UnknownRevision naming it, nothing changed
    champ = reg.alias_version(policy, CHAMPION)
    if champ == version:
        raise CanaryError(
            f"{policy}/v{version} is already {policy}@{CHAMPION}: there is nothing to compare it with"
        )
    other = reg.alias_version(policy, CANARY)
    if other is not None and other != version:
        raise CanaryError(
            f"{policy}@{CANARY} is v{other}, whose canary has not ended: end it first "
            f"(mint registry canary {policy} --end) or wait for its watch"
        )
    canary_name = f"{served}@{CANARY}"
    with ws.client() as client:
        champ_digest = reg.revision(policy, champ).digest if champ is not None else None
        if champ_digest is not None:
            control, control_rev = served, str(champ_digest)
            if served_revision(client, served) != f"sha256:{champ_digest}":  # serving follows the registry
                client.load_adapter(served, ws.lora_path(champ_digest), inplace=True)
        else:
            control, control_rev = _base_name(client), "base"
        client.load_adapter(canary_name, ws.lora_path(rev.digest), inplace=True)
        smoke_check(client, canary_name, rev.digest, smoke_prompt(rev.tags.get("mint.task")))
        reg.set_alias(policy, CANARY, version, f"canary: {share:.0%} of {served}'s requests", expect=other)
        started = time.time()
        tag = {"share": share, "started": started, "control": control, "champion": champ}
        reg.set_tag(policy, version, CANARY_TAG, json_tag(tag))
        run_id = start_canary_run(
            reg.client,
            policy,
            key,
            {
                "policy": policy,
                "canary": f"v{version}",
                "champion": f"v{champ}" if champ else "base",
                "share": share,
            },
        )
        client.put_canary(served, canary_name, control, share)
        cursor = int(client.canary(served, after=2**62)["next"])
    get_run_logger().info(
        "canary: %s/v%d answers %.0f%% of %s's requests (the rest: %s)",
        policy,
        version,
        share * 100,
        served,
        control,
    )
    return CanaryStarted(
        policy=policy,
        version=version,
        digest=rev.digest,
        served=served,
        canary_name=canary_name,
        control=control,
        control_revision=control_rev,
        champion=champ,
        share=share,
        cursor=cursor,
        run_id=run_id,
        started=started,
        work_s=time.perf_counter() - t0,
    )


def _markdown(started: CanaryStarted, est: Estimate, history: list[dict[str, Any]]) -> str:
    champ = f"v{started.champion}" if started.champion else "the base"
    lines = [
        f"# canary {started.policy}/v{started.version} vs {champ} ({started.share:.0%} of requests)",
        "",
        f"**{est.decision}**: {est.reason}",
        "",
        "| scored | canary | champion | difference | always-valid interval |",
        "|---:|---:|---:|---:|---|",
    ]
    for h in history[-25:]:
        lines.append(
            f"| {h['n']} | {_f(h['mean_canary'])} ({h['n_canary']}) | {_f(h['mean_control'])} ({h['n_control']}) "
            f"| {_f(h['diff'], True)} | {_f(h['lo'], True)} .. {_f(h['hi'], True)} |"
        )
    return "\n".join(lines)


def _f(x: float | None, signed: bool = False) -> str:
    return "-" if x is None else (f"{x:+.3f}" if signed else f"{x:.3f}")


@task(cache_policy=NO_CACHE)
def watch_canary(ws: Workspace, started: CanaryStarted, config: CanaryConfig) -> CanaryWatch:
    """Read the served answers' scores until the sequential test decides (or the limits end it); log the running
    estimate to MLflow (the canary's run, and `online/reward` on each version's training run) and to the flow's
    artifact."""
    log = get_run_logger()
    t0 = time.perf_counter()
    reg = ws.registry()
    test = SequentialTest(config.test())
    runs = {
        "canary": reg.revision(started.policy, started.version).run_id,
        "control": reg.revision(started.policy, started.champion).run_id if started.champion else None,
    }
    want = {"canary": started.digest, "control": started.control_revision}
    after, ignored, history = started.cursor, 0, []
    key = artifact_key("canary", started.policy)
    last_artifact = 0.0
    deadline = time.monotonic() + config.max_minutes * 60
    requests = 0
    while True:
        try:
            with ws.client(timeout=30) as client:
                view = client.canary(started.served, after=after)
                # the server restarted (the split lives in its memory): put it back
                if view.get("split") is None:
                    log.warning("the split of %s was gone from the server: putting it back", started.served)
                    client.put_canary(started.served, started.canary_name, started.control, started.share)
        except ServingError as e:
            if not is_transient(e):
                raise
            log.warning("reading the canary's scores failed (%s); retrying", e)
            time.sleep(config.poll_s)
            continue
        for event in view["events"]:
            arm = event["arm"]
            if arm not in want:
                continue
            if str(event["revision"]).removeprefix("sha256:") != want[arm]:
                ignored += 1
                continue
            test.update(arm, float(event["score"]))
        after = int(view["next"])
        requests = sum(int(a.get("requests", 0)) for k, a in view.get("arms", {}).items() if k in want)
        est = test.estimate()
        decision, reason = est.decision, est.reason
        if decision == "continue" and time.monotonic() > deadline:
            decision = "inconclusive"
            reason = f"no decision within {config.max_minutes:g} min: {est.reason}"
        row = {k: v for k, v in est.row().items() if k not in ("decision", "reason")}
        history.append(row)
        metrics = {f"online/{k}": v for k, v in row.items() if isinstance(v, (int, float))}
        log_metrics(reg.client, started.run_id, metrics, step=est.n)
        for arm, run_id in runs.items():
            mean = est.mean_canary if arm == "canary" else est.mean_control
            if run_id and mean is not None:
                log_metrics(
                    reg.client,
                    run_id,
                    {"online/reward": mean},
                    step=est.n_canary if arm == "canary" else est.n_control,
                )
        now = time.monotonic()
        if decision != "continue" or now - last_artifact > 10:
            create_markdown_artifact(
                key=key, markdown=_markdown(started, est, history), description=f"canary of {started.policy}"
            )
            last_artifact = now
        if decision != "continue":
            log.info("canary %s/v%d: %s", started.policy, started.version, reason)
            return CanaryWatch(
                estimate=est,
                decision=decision,
                reason=reason,
                requests=requests,
                ignored=ignored,
                seconds=time.perf_counter() - t0,
                history=history,
                work_s=time.perf_counter() - t0,
            )
        time.sleep(config.poll_s)


@task(cache_policy=NO_CACHE, **_RETRY)
def end_canary(
    ws: Workspace, started: CanaryStarted, decision: str, reason: str, estimate: Estimate | None
) -> None:
    """Send every request to the policy's name again, unload the candidate's canary name, remove the `canary`
    alias, and record the decision and its evidence on the version and the canary's MLflow run."""
    reg = ws.registry()
    with ws.client() as client:
        client.clear_canary(started.served)
        time.sleep(1.0)  # requests routed to the canary just before the split ended finish first
        try:
            client.unload_adapter(started.canary_name)
        except ServingError as e:
            if e.status != 404:
                raise
    if reg.alias_version(started.policy, CANARY) == started.version:
        reg.set_alias(
            started.policy, CANARY, None, f"canary {decision}: {reason}"[:500], expect=started.version
        )
    doc: dict[str, Any] = {
        "share": started.share,
        "started": started.started,
        "ended": time.time(),
        "control": started.control,
        "champion": started.champion,
        "decision": decision,
        "reason": reason,
        "run_id": started.run_id,
    }
    if estimate is not None:
        doc.update({k: v for k, v in estimate.row().items() if k not in ("decision", "reason")})
    reg.set_tag(started.policy, started.version, CANARY_TAG, json_tag(doc, shrink=("reason",)))
    end_run(
        reg.client,
        started.run_id,
        {"mint.canary.decision": decision, "mint.canary.reason": reason},
        failed=decision == "aborted",
    )
    logging.getLogger(__name__).info("canary %s/v%d ended: %s", started.policy, started.version, decision)
