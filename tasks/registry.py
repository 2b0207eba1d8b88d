"""Registry steps: find what a run already made, export a revision (store + MLflow version + training run),
gate it, and move `champion` (promote, rollback) with an undo for the transaction around them."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.transactions import Transaction, get_transaction

from mint_core.eval.gate import GATE_TAG, Baseline, GateDecision, GatePolicy, SuiteScore, decide
from mint_core.lifecycle.faults import fault
from mint_core.lifecycle.figures import curve_figure
from mint_core.lifecycle.revisions import champion, find_by_key
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import CHAMPION
from mint_core.registry.runs import IDEMPOTENCY_TAG, log_metrics, log_training_run, tag_version
from mint_core.registry.tags import json_tag
from mint_core.rl.recipe import TrainingRun
from mint_core.types import Digest
from tasks.common import RETRY_DELAYS, AliasMoved, RevisionRef, artifact_key, transient

EXPERIMENT = "mint-lifecycle"
"""MLflow experiment of the training runs."""

_RETRY: dict[str, Any] = dict(retries=3, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)


@task(cache_policy=NO_CACHE, **_RETRY)
def current_champion(ws: Workspace, policy: str) -> RevisionRef | None:
    """The policy's champion now (None before its first promotion)."""
    rev = champion(ws.registry(), policy)
    return None if rev is None else RevisionRef.of(rev)


@task(cache_policy=NO_CACHE, **_RETRY)
def find_revision(ws: Workspace, policy: str, key: str) -> RevisionRef | None:
    """The version an earlier run with this idempotency key made, so a rerun trains nothing twice."""
    rev = find_by_key(ws.registry(), policy, key)
    return None if rev is None else RevisionRef.of(rev)


def _export_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    ws: Workspace = parameters["ws"]
    where = hashlib.sha256(f"{ws.tracking_uri}|{ws.store}".encode()).hexdigest()[:8]
    return f"export-{parameters['policy']}-{parameters['key']}-{where}"


TASK_TAGS = ("task", "task_spec", "reward")
"""Run parameters that also tag the version: `mint.task` (its task's name), `mint.task_spec` (sha256 of the spec
file) and `mint.reward` (sha256 of the rewards' definitions and their source files)."""


@task(cache_key_fn=_export_cache_key, persist_result=True, **_RETRY)
def export(
    ws: Workspace,
    session: TrainingRun,
    policy: str,
    rank: int,
    parent: RevisionRef | None,
    data_rev: str,
    key: str,
    curve: list[dict[str, float]],
    params: dict[str, str],
    times: list[float] | None = None,
    started: float | None = None,
) -> RevisionRef:
    """Store the policy's revision, log its training run, and register it as the next version (alias candidate)."""
    t0 = time.perf_counter()
    reg = ws.registry()
    trainer = session.trainer
    digest = reg.store.put_weights(trainer.weights(policy), trainer.engine.sites)
    figure = curve_figure(policy, curve) if curve else None
    run_id = log_training_run(reg.client, EXPERIMENT, policy, key, params, curve, figure, times, started)
    rev = reg.create_revision(
        policy,
        digest,
        base=trainer.engine.base.fingerprint,
        rank=rank,
        parent=parent.address if parent else None,
        data_rev=data_rev,
        run_id=run_id,
        tags={IDEMPOTENCY_TAG: key} | {f"mint.{k}": params[k] for k in TASK_TAGS if params.get(k)},
        reason=f"trained: {len(curve)} GRPO steps (run {key[:8]})",
    )
    fault("export")
    exp = reg.client.get_experiment_by_name(EXPERIMENT)
    if exp is not None:
        create_link_artifact(
            f"{ws.tracking_uri.rstrip('/')}/#/experiments/{exp.experiment_id}/runs/{run_id}",
            link_text=f"training run of {rev.address}: reward, KL, entropy curves and their plot",
            key=artifact_key("training", policy),
            description=f"{rev.address}: the MLflow run of its {len(curve)} GRPO steps",
        )
    create_link_artifact(
        f"{ws.tracking_uri.rstrip('/')}/#/models/{policy}/versions/{rev.version}",
        link_text=f"{rev.address} in MLflow",
        key=artifact_key("mlflow", policy),
        description=f"{rev.address}: {digest.prefixed[:23]}, parent {parent.address if parent else 'none'}",
    )
    ref = RevisionRef.of(rev)
    ref.work_s = time.perf_counter() - t0
    return ref


NO_GAIN_TAG = "mint.no_gain"
"""On a champion version: how many waves from it in a row early stopping ended without a gain (nothing exported,
so no version records them), `{"count": n, "last": reason}`. Retraining counts them with the rejected candidates
(`flows.retrain.failed_in_a_row`)."""


@task(cache_policy=NO_CACHE, **_RETRY)
def note_no_gain(ws: Workspace, champ: RevisionRef, reason: str) -> int:
    """Count one more wave from `champ` that stopped without a gain, on its version's `NO_GAIN_TAG`; returns
    the count."""
    reg = ws.registry()
    rev = reg.revision(champ.policy, champ.version)
    try:
        count = int(json.loads(rev.tags.get(NO_GAIN_TAG, "{}")).get("count", 0)) + 1
    except (ValueError, AttributeError, TypeError):
        count = 1
    reg.set_tag(
        champ.policy, champ.version, NO_GAIN_TAG, json_tag({"count": count, "last": reason}, shrink=("last",))
    )
    return count


@task(cache_policy=NO_CACHE, **_RETRY)
def gate(
    ws: Workspace,
    candidate: RevisionRef,
    policy: GatePolicy,
    candidate_scores: dict[str, SuiteScore],
    champion_scores: dict[str, SuiteScore] | None,
    baseline: Baseline = "champion",
) -> GateDecision:
    """Decide whether the candidate may replace its baseline (the champion, or the bare base for a first
    revision: `baseline="base"` with the base's scores as `champion_scores`), and record the decision."""
    decision = decide(
        policy,
        candidate_scores.values(),
        None if champion_scores is None else champion_scores.values(),
        baseline=baseline,
    )
    client = ws.registry().client
    tag_version(client, candidate.policy, candidate.version, GATE_TAG, decision.tag_value())
    if (
        candidate.run_id
    ):  # the change on every suite compared, guards and side effects alike, beside its scores
        effects = {f"change.{c.name.split(':', 1)[1]}": c.stats.effect for c in decision.checks if c.stats}
        log_metrics(client, candidate.run_id, effects, step=0)
    failed = ", ".join(c.name for c in decision.failed())
    verdict = "passed" if decision.passed else f"failed ({failed})"
    create_markdown_artifact(
        f"### {candidate.address}{f' vs {decision.baseline}' if decision.baseline else ''}\n\n"
        + decision.markdown(),
        key=artifact_key("gate", candidate.policy),
        description=f"gate of {candidate.address}: {verdict}",
    )
    return decision


@task(cache_policy=NO_CACHE, **_RETRY)
def promote(
    ws: Workspace, policy: str, version: int, digest: Digest, expect: int | None, restore: int | None
) -> AliasMoved:
    """`champion` := version, only if it still points where the gate saw it (`expect`); the undo restores `restore`."""
    t0 = time.perf_counter()
    reg = ws.registry()
    current = reg.alias_version(policy, CHAMPION)
    moved = current != version  # equal: an earlier attempt (or a retry) already moved it
    if moved:
        reg.promote(policy, version, f"promoted v{version} (gate passed)", expect=expect)
    out = AliasMoved(policy=policy, from_version=restore, to_version=version, to_digest=digest, moved=moved)
    _remember(ws, out)
    fault("promote")
    out.work_s = time.perf_counter() - t0
    return out


@task(cache_policy=NO_CACHE, **_RETRY)
def rollback(ws: Workspace, policy: str, to_version: int | None, reason: str) -> AliasMoved:
    """`champion` := a named version, or the champion before the current one."""
    t0 = time.perf_counter()
    reg = ws.registry()
    move = reg.rollback(policy, to_version, reason)
    assert move.to_version is not None
    digest = reg.revision(policy, move.to_version).digest
    out = AliasMoved(
        policy=policy,
        from_version=move.from_version,
        to_version=move.to_version,
        to_digest=digest,
        moved=True,
    )
    _remember(ws, out)
    out.work_s = time.perf_counter() - t0
    return out


def _remember(ws: Workspace, moved: AliasMoved) -> None:
    txn = get_transaction()
    if txn is not None:
        txn.set("workspace", ws)
        txn.set("alias_moved", moved)


def _undo_alias(txn: Transaction) -> None:
    """Rollback hook: point `champion` back where it was (or unset it), only from where this move left it."""
    ws: Workspace = txn.get("workspace")
    m: AliasMoved = txn.get("alias_moved")
    reg = ws.registry()
    if m.from_version == m.to_version or reg.alias_version(m.policy, CHAMPION) == m.from_version:
        return
    reg.set_alias(
        m.policy,
        CHAMPION,
        m.from_version,
        f"undo: the promotion to v{m.to_version} failed",
        expect=m.to_version,
    )


promote.on_rollback(_undo_alias)
rollback.on_rollback(_undo_alias)
