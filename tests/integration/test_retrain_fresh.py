"""Issue 28, item 5, through the real flows: fresh prompts, early stopping and the per-policy report.

Against real Prefect and MLflow servers and a `mint serve` on a tiny random base (the fixtures of
tests/integration/conftest.py). On that base no rollout and no probe earns any reward, so every probe scores 0:
with early stopping a policy stops at its first probes without gain and is neither exported nor gated, and a
policy trained to its last step records its fresh draw and the data revision on its MLflow run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.forms import PolicyRun, Training
from flows.lifecycle import wave
from flows.retrain import retrain
from mint_core.data.build import write_task_data
from mint_core.engine.base import load_base
from mint_core.eval.early_stop import EarlyStop
from mint_core.eval.gate import GATE_TAG, GatePolicy
from mint_core.eval.results import EvalConfig
from mint_core.eval.suites import standalone_suites
from mint_core.lifecycle.prompts import round_seed
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter
from mint_core.registry.mlflow_registry import UnknownRevision
from mint_core.registry.runs import log_training_run, tag_version
from mint_core.rl.builder import Continuation
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_testkit.harness import save_tiny_base, start_server, stop_server
from tasks.registry import EXPERIMENT, NO_GAIN_TAG
from tests.fault_points import FAULT_ENV

pytestmark = pytest.mark.integration

ADMIN = "admin-secret"  # what start_server gives `mint serve`
GRPO = GRPOConfig(
    group_size=4, max_new_tokens=8, learning_rate=1e-2, weight_decay=0.5, drop_zero_variance=False
)
PLUMBING: dict[str, Any] = {
    "compare": False,
    "guard_tasks": [],
    "guard_suites": [],
}  # a few eval items: gate on
# sample counts (the statistics: test_gate.py); its stack builds suites for add and reverse only, so no guards


@dataclass
class Stack:
    ws: Workspace
    data: Path
    suites: Path

    def evaluation(self) -> EvalConfig:
        return EvalConfig(limit=4, batch_size=16, suites_dir=self.suites)

    def training(self, round: str, steps: int, early_stop: EarlyStop | None) -> Training:
        return Training(
            steps=steps,
            prompts_per_step=4,
            grpo=GRPO,
            data_dir=self.data,
            round=round,
            draw="fresh",
            dry_run=0,  # a random base: its rewards have no signal to check
            early_stop=early_stop,
        )


@pytest.fixture(scope="module")
def stack(
    mlflow_server: str, prefect_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("retrain-fresh")
    store = root / "store"
    store.mkdir()
    data = root / "data" / "tasks"
    write_task_data(data, ["add", "reverse"], n_train=200, n_heldout=40, seed=0)
    suites = standalone_suites(root, limit=20, tasks_dir=data)
    base_dir = save_tiny_base(root / "base")
    proc, url = start_server(store, "--base", str(base_dir), env={"MINT_SERVE_TORCH_THREADS": "1"})
    ws = Workspace(
        tracking_uri=mlflow_server,
        store=str(store),
        catalog_url=f"sqlite:///{root / 'catalog.db'}",
        base=base_dir,
        serving_url=url,
        admin_token_file=None,
        work_dir=root / "work",
        lock_hold_s=60,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINT_SERVE_ADMIN_TOKEN", ADMIN)
        mp.delenv(FAULT_ENV, raising=False)
        try:
            yield Stack(ws, data, suites)
        finally:
            stop_server(proc)


def policy(name: str, task: str = "add", rejected: int = 0) -> PolicyRun:
    return PolicyRun(
        spec=PolicySpec(name=name, task=task, rank=4, alpha=8),
        gate=GatePolicy(suite=task, **PLUMBING),
        rejected=rejected,
    )


def artifact(key: str, mentioning: str) -> str:
    """The artifact `key` that names `mentioning` (the Prefect server is the test session's: other tests' flows
    write artifacts under the same keys)."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=key)))
    mine = [str(a.data) for a in found if mentioning in str(a.data)]
    assert mine, f"no artifact {key} names {mentioning!r} (of {len(found)})"
    return mine[-1]


def test_a_policy_without_gain_stops_early_and_is_not_gated(stack: Stack) -> None:
    stop = EarlyStop(every=1, patience=2, min_delta=0.0, probe_items=16)
    report = wave(
        [policy("rf-flat")],
        stack.training("f1", steps=6, early_stop=stop),
        stack.evaluation(),
        workspace=stack.ws,
    )
    (out,) = report.outcomes
    assert out.status == "stopped" and out.candidate is None and out.decision is None, out
    assert out.steps == 2 and out.stop_reason is not None and out.stop_reason.startswith("no gain:"), out
    assert [p.score for p in out.probe] == [0.0, 0.0, 0.0] and [p.step for p in out.probe] == [0, 1, 2]
    assert (out.gain, out.p_value, out.gain_on) == (0.0, 1.0, "probe")
    assert [t.step for t in report.timings].count("rollout") == 2  # no step after the stop
    assert "evaluate" not in {t.step for t in report.timings}  # nor any evaluation
    with pytest.raises(UnknownRevision):
        stack.ws.registry().revisions("rf-flat")  # nothing exported
    assert "no gain" in artifact("wave-summary", "rf-flat")


def test_a_finished_run_records_its_fresh_draw_and_data_revision(stack: Stack) -> None:
    stop = EarlyStop(every=1, patience=5, min_delta=0.0, probe_items=16)
    train = stack.training("f2", steps=2, early_stop=stop)
    report = wave([policy("rf-fresh", "reverse")], train, stack.evaluation(), workspace=stack.ws)
    (out,) = report.outcomes
    assert out.status == "promoted" and out.steps == 2, out
    assert out.stop_reason is not None and out.stop_reason.startswith("finished: all 2 steps"), out
    reg = stack.ws.registry()
    rev = reg.resolve("rf-fresh")
    assert rev.run_id is not None
    params = reg.client.get_run(rev.run_id).data.params
    assert rev.data_rev and rev.data_rev == params["data_rev"]  # the `mint.data_rev` tag and the run's param
    assert params["fresh_seed"] == str(round_seed(0, "f2"))
    assert params["draw"] == "fresh" and params["steps_trained"] == "2"
    assert params["prompts_source"] == f"fresh:reverse:seed={params['fresh_seed']}"
    assert json.loads(params["probe"]) == [[0, 0.0], [1, 0.0], [2, 0.0]]
    assert params["stop_reason"] == out.stop_reason
    assert len(report.curve) == 2  # (that no drawn prompt is evaluated: tests/unit/test_retrain_plan.py)


def test_retrain_gives_a_rejected_policy_one_probe_and_reports_why(stack: Stack) -> None:
    """A champion whose last two candidates the gate rejected: tonight it gets one probe, shows no gain, and is
    skipped before export; the report and its artifact say so, with the steps it spent."""
    name = "rf-stuck"
    reg = stack.ws.registry()
    base = load_base(stack.ws.base)
    spec = PolicySpec(name=name, task="add", rank=4, alpha=8)
    versions = []
    for seed in range(3):
        weights = random_adapter(
            base.sites, spec.targets, 4, alpha=8, seed=seed, std=0.02, base_fingerprint=base.fingerprint
        )
        digest = reg.store.put_weights(weights, base.sites)
        run_id = log_training_run(
            reg.client, EXPERIMENT, name, f"seeded-{name}-{seed}", {"policy": spec.model_dump_json()}, []
        )
        versions.append(
            reg.create_revision(name, digest, base=base.fingerprint, rank=4, run_id=run_id, alias=None)
        )
    reg.promote(name, versions[0].version, "seeded champion")
    for v in versions[1:]:
        tag_version(
            reg.client, name, v.version, GATE_TAG, json.dumps({"passed": False, "reasons": ["seeded"]})
        )
    with stack.ws.client() as c:
        c.load_adapter(name, f"sha256:{versions[0].digest}", inplace=True)

    train = stack.training("f3", steps=20, early_stop=EarlyStop(every=5, probe_items=16))
    report = retrain([name], training=train, evaluation=stack.evaluation(), workspace=stack.ws)
    (row,) = report.policies
    assert row.status == "stopped" and row.rejected_before == 2 and row.steps == 5, row
    assert row.stop_reason is not None and row.stop_reason.startswith(
        "its last 2 candidates were rejected"
    ), row
    assert row.gain_on == "probe" and row.gain == 0.0
    assert [r.version for r in reg.revisions(name)] == [v.version for v in versions]  # nothing new
    md = artifact("retrain-report", f"| {name} |")
    assert f"| {name} | stopped |" in md and "| 5 | 2 |" in md
    # the stop made no version, so the champion's version counts it: the next night sees 3 failed attempts
    champ = reg.revision(name, versions[0].version)
    assert json.loads(champ.tags[NO_GAIN_TAG])["count"] == 1
    again = retrain(
        [name],
        training=stack.training("f3b", steps=20, early_stop=EarlyStop(every=5, probe_items=16)),
        evaluation=stack.evaluation(),
        workspace=stack.ws,
    )
    assert again.policies[0].rejected_before == 3, again.policies[0]


def test_a_continuation_trains_with_the_continuation_recipe_and_records_it(stack: Stack) -> None:
    """A policy continued from its champion trains at the recipe's share of the rate with its warmup; the
    version's MLflow run records both (in `policy` and in `continuation`), so a version says how it was trained."""
    first = wave(
        [policy("rf-cont", "reverse")],
        stack.training("f4", steps=2, early_stop=None),
        stack.evaluation(),
        workspace=stack.ws,
    )
    assert first.outcomes[0].status == "promoted", first.outcomes[0]
    recipe = Continuation(rate_scale=0.5, warmup_steps=3)
    train = stack.training("f5", steps=2, early_stop=None).model_copy(update={"continuation": recipe})
    second = wave([policy("rf-cont", "reverse")], train, stack.evaluation(), workspace=stack.ws)
    (out,) = second.outcomes
    assert out.candidate is not None and out.champion_before == first.outcomes[0].champion_after, out
    reg = stack.ws.registry()
    cand = reg.revision("rf-cont", int(out.candidate.rsplit("/v", 1)[1]))
    assert cand.run_id is not None
    params = reg.client.get_run(cand.run_id).data.params
    trained = PolicySpec.model_validate_json(params["policy"])
    assert (trained.rate_scale, trained.warmup_steps) == (0.5, 3)
    assert Continuation.model_validate_json(params["continuation"]) == recipe
    assert "overridden_by_champion" not in params  # the recipe is not the champion overriding the form
    first_run = reg.client.get_run(reg.revision("rf-cont", 1).run_id).data.params  # type: ignore[arg-type]
    assert (
        "continuation" not in first_run
        and PolicySpec.model_validate_json(first_run["policy"]).rate_scale == 1.0
    )
