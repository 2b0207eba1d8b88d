"""The Prefect lifecycle end to end against real servers, all started by the fixtures: a Prefect server, an MLflow
registry and a `mint serve` subprocess on a tiny base (promotions lock through the catalog: no Redis), with a few
GRPO steps and a tiny evaluation.

Faults: a run killed (SIGKILL) during the update or during the promotion and then rerun, a serving refresh that
fails, a smoke check that fails, a gate that says no, two promotions of one policy racing, and an alias moved in
MLflow directly that reconcile must bring to serving.

On a random tiny base no rollout earns any reward, so GRPO here learns nothing; weight decay with
`drop_zero_variance=False` still moves the adapter a little every step, so each run makes a revision of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

from flows.forms import PolicyRun, Training, WaveFailed
from flows.lifecycle import lifecycle, wave
from flows.prefetch import prefetch
from flows.promotion import promote_flow, rollback_flow
from flows.reconcile import reconcile
from mint_core.engine.base import load_base
from mint_core.errors import DataCheckError
from mint_core.eval.gate import GatePolicy
from mint_core.eval.results import EvalConfig
from mint_core.eval.suites import standalone_suites
from mint_core.lifecycle.faults import InjectedFault
from mint_core.lifecycle.smoke import served_revision
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter
from mint_core.registry.mlflow_registry import AliasConflict, Registry, RegistryUnavailable, UnknownRevision
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.serving.client import ServingError
from mint_testkit.harness import free_port, save_tiny_base, start_front, start_server, stop_server, unload_all
from mint_testkit.waiting import wait_until
from tasks.common import is_transient
from tests.fault_points import FAULT_ENV, installed
from tests.integration.conftest import VLLMServer

pytestmark = pytest.mark.integration

ADMIN = "admin-secret"  # what start_server gives `mint serve`
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GRPO = GRPOConfig(
    group_size=4, max_new_tokens=8, learning_rate=1e-2, weight_decay=0.5, drop_zero_variance=False
)


@dataclass
class Stack:
    ws: Workspace
    base_dir: Path
    suites: Path
    root: Path

    def registry(self) -> Registry:
        return self.ws.registry()

    def served(self, name: str) -> str | None:
        with self.ws.client() as c:
            return served_revision(c, name)

    def answered_by(self, name: str) -> str:
        with self.ws.client() as c:
            return str(c.complete(name, "add: 1+2 =", max_tokens=2, temperature=0.0)["system_fingerprint"])

    def evaluation(self) -> EvalConfig:
        return EvalConfig(limit=4, batch_size=16, suites_dir=self.suites)

    def aliases(self, policy: str) -> dict[str, int]:
        rm = self.registry().client.get_registered_model(policy)
        return {k: int(v) for k, v in (rm.aliases or {}).items()}


# the flows on vLLM double this module's minutes: the slow tier (the contract tests cover vLLM by default)
@pytest.fixture(scope="module", params=["mint", pytest.param("vllm", marks=pytest.mark.slow)])
def stack(
    request: pytest.FixtureRequest,
    mlflow_server: str,
    prefect_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """The flows against real MLflow and Prefect servers and a served base: mint serve, or the session's vLLM
    behind a front of this module's own (its store and catalog). The flows cannot tell the two apart."""
    root = tmp_path_factory.mktemp("lifecycle")
    store = root / "store"
    store.mkdir()
    suites = standalone_suites(root, limit=20)
    if request.param == "vllm":
        server: VLLMServer = request.getfixturevalue("vllm_server")
        base_dir = server.base_dir
        # no catalog on the front, as on mint serve here: prefetch falls back to loads on both
        proc, url = start_front(server.vllm_url, store, base_dir, free_port(), None)
    else:
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
    # the fault points this module's tests name in $MINT_LIFECYCLE_FAULT fail in this process (none by default)
    with pytest.MonkeyPatch.context() as mp, installed():
        mp.setenv("MINT_SERVE_ADMIN_TOKEN", ADMIN)
        mp.delenv(FAULT_ENV, raising=False)
        try:
            yield Stack(ws, base_dir, suites, root)
        finally:
            if request.param == "vllm":
                unload_all(url)
            stop_server(proc)


# These tests check the plumbing of promotion (transactions, idempotency, faults, rollback) on a few eval items,
# far too few for the gate's paired test: they gate on floors and sample counts (`compare=False`). The statistics
# of the gate are tested in tests/unit/test_gate.py.
PLUMBING = {"compare": False}


def policy(name: str, gate: GatePolicy | None = None) -> PolicyRun:
    return PolicyRun(
        spec=PolicySpec(name=name, task="add", rank=4, alpha=8),
        gate=gate or GatePolicy(suite="add", **PLUMBING),
    )


def training(round: str, steps: int = 2, seed: int = 0) -> Training:
    return Training(
        steps=steps, prompts_per_step=4, grpo=GRPO, seed=seed, data_dir=None, round=round, dry_run=0
    )


def seed_champion(stack: Stack, name: str, seed: int) -> tuple[int, str]:
    """A random revision made the champion of `name` and served under it; returns (version, digest)."""
    reg = stack.registry()
    base = load_base(stack.base_dir)
    weights = random_adapter(
        base.sites, TARGETS, 4, alpha=8, seed=seed, std=0.05, base_fingerprint=base.fingerprint
    )
    digest = reg.store.put_weights(weights, base.sites)
    rev = reg.create_revision(name, digest, base=base.fingerprint, rank=4, alias=None)
    reg.promote(name, rev.version, "seeded by the test")
    with stack.ws.client() as c:
        c.load_adapter(name, f"sha256:{digest}", inplace=True)
    return rev.version, digest


def run_subprocess(
    stack: Stack, ws: Workspace, run: PolicyRun, train: Training, fault: str
) -> subprocess.CompletedProcess[str]:
    """`mint lifecycle --params FILE` in another process, with a fault injected (`tests.fault_points` installs
    the hook there, then runs the command)."""
    params = stack.root / f"{run.name}-{fault.replace(':', '_')}.json"
    doc = {
        "policy": run.model_dump(mode="json"),
        "training": train.model_dump(mode="json"),
        "evaluation": stack.evaluation().model_dump(mode="json"),
        "workspace": ws.model_dump(mode="json"),
    }
    params.write_text(json.dumps(doc))
    env = {**os.environ, FAULT_ENV: fault, "MINT_SERVE_ADMIN_TOKEN": ADMIN}
    return subprocess.run(
        [sys.executable, "-m", "tests.fault_points", "lifecycle", "--params", str(params)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---- retries ---------------------------------------------------------------------------------------------


def _caused(outer: Exception, cause: BaseException) -> Exception:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("case", "exc", "retry"),
    [
        ("connection refused", ConnectionRefusedError("refused"), True),
        ("httpx timeout", httpx.ReadTimeout("slow"), True),
        ("server unreachable", ServingError(0, "ConnectionError", "refused", "http://x"), True),
        ("server overloaded", ServingError(503, "Unavailable", "busy", "http://x"), True),
        ("registry down", RegistryUnavailable("unreachable"), True),
        ("wrapped connection error", _caused(RuntimeError("eval failed"), ConnectionResetError()), True),
        ("bad adapter", ServingError(400, "BadRequestError", "rank too large", "http://x"), False),
        ("lost alias race", AliasConflict("moved"), False),
        ("failed data check", DataCheckError("rollouts", None, ["reward out of range"]), False),
        ("injected fault", InjectedFault("boom"), False),
    ],
)
def test_only_transient_errors_are_retried(case: str, exc: BaseException, retry: bool) -> None:
    assert is_transient(exc) is retry, case


# ---- the lifecycle end to end ----------------------------------------------------------------------------


def test_lifecycle_end_to_end_then_rerun_then_next_round(stack: Stack) -> None:
    name = "lc-e2e"
    t0 = time.perf_counter()
    report = lifecycle(policy(name), training("r1"), stack.evaluation(), workspace=stack.ws)
    first_s = time.perf_counter() - t0
    (out,) = report.outcomes
    assert out.status == "promoted", out
    reg = stack.registry()
    v1 = reg.resolve(name)
    assert v1.version == 1 and out.champion_after == f"{name}/v1"
    assert v1.data_rev and v1.tags["mint.idempotency_key"] and v1.parent is None
    assert v1.gate is not None and v1.gate["passed"]
    run = reg.client.get_run(v1.run_id)
    assert "train/reward" in run.data.metrics and run.data.params["steps"] == "2"
    # every step's learning metrics, as a history (the update's own only for steps that took one)
    for metric in ("reward", "reward_std", "no_signal"):
        assert [m.step for m in reg.client.get_metric_history(v1.run_id, f"train/{metric}")] == [0, 1]
    updated = len(reg.client.get_metric_history(v1.run_id, "train/loss"))
    for metric in ("kl", "entropy", "grad_norm", "pg_objective", "clip_frac"):
        assert len(reg.client.get_metric_history(v1.run_id, f"train/{metric}")) == updated, metric
    assert all(m.value > 0 for m in reg.client.get_metric_history(v1.run_id, "train/entropy"))
    trained_s = sum(c["seconds"] for c in report.curve)
    assert run.info.end_time - run.info.start_time >= 0.9 * trained_s * 1000
    # the bare base is revision 0: it was scored on the same suites and sits beside the candidate's scores
    assert (
        set(out.scores) == {"candidate", "base"}
        and out.scores["base"].keys() == out.scores["candidate"].keys()
    )
    assert stack.served(name) == f"sha256:{v1.digest}"
    assert stack.answered_by(name) == v1.digest
    assert [t.step for t in report.timings].count("rollout") == 2

    # rerunning the finished run makes no second version
    again = lifecycle(policy(name), training("r1"), stack.evaluation(), workspace=stack.ws)
    assert again.outcomes[0].reused and again.outcomes[0].status == "promoted"
    assert [r.version for r in reg.revisions(name)] == [1]
    assert "rollout" not in [t.step for t in again.timings]

    # the next round trains from the champion and replaces it
    nxt = lifecycle(policy(name), training("r2"), stack.evaluation(), workspace=stack.ws)
    assert nxt.outcomes[0].status == "promoted", nxt.outcomes[0]
    v2 = reg.resolve(name)
    assert v2.version == 2 and v2.parent == f"{name}/v1" and v2.digest != v1.digest
    assert stack.answered_by(name) == v2.digest
    print(
        f"\nlifecycle: first run {first_s:.1f} s; steps: "
        + ", ".join(f"{t.step} {t.wall_s:.2f}" for t in report.timings)
    )


def test_bad_data_stops_the_run_before_training(stack: Stack, tmp_path: Path) -> None:
    """A planted bad training file (a null answer, a malformed answer, a duplicate id) fails the prompts suite:
    the flow stops before any rollout, names the failing expectations, keeps them with the flow run (a Prefect
    artifact), and creates no version."""
    name = "lc-bad-data"
    train_dir = tmp_path / "data" / "train"
    train_dir.mkdir(parents=True)
    rows: list[dict[str, object]] = [
        {"id": f"add-x-{i}", "task": "add", "prompt": f"add: {i}+1 =", "answer": str(i + 1)} for i in range(8)
    ]
    rows[2]["answer"] = None
    rows[3]["answer"] = "twelve"
    rows[5]["id"] = rows[4]["id"]
    (train_dir / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = training("bad").model_copy(update={"data_dir": tmp_path / "data"})
    with pytest.raises(DataCheckError) as e:
        lifecycle(policy(name), train, stack.evaluation(), workspace=stack.ws)
    text = str(e.value)
    assert "answer" in text and "id" in text and "twelve" in text
    with pytest.raises(UnknownRevision):
        stack.registry().revisions(name)  # nothing was registered

    # through Prefect's own client, which sends null limit/offset (refused under fastapi >= 0.151: pyproject.toml)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="check-failed"))
        )
    kept = {a.key: str(a.data) for a in found}
    assert any(name in key and "twelve" in body for key, body in kept.items()), kept


def test_wave_trains_policies_together(stack: Stack) -> None:
    runs = [
        policy("wv-add"),
        PolicyRun(
            spec=PolicySpec(name="wv-rev", task="reverse", rank=4, alpha=8),
            gate=GatePolicy(suite="reverse", **PLUMBING),
        ),
    ]
    state = wave(runs, training("w1", steps=2), stack.evaluation(), workspace=stack.ws, return_state=True)
    report = state.result()
    assert [o.status for o in report.outcomes] == ["promoted", "promoted"]
    steps = [t.step for t in report.timings]
    assert steps.count("rollout") == 2 and steps.count("grpo_update") == 2  # one batched step for both
    # the bare base is evaluated beside training, not after it: its task run starts before the last update ends
    with get_client(sync_client=True) as client:
        runs_of = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    started = {r.name.rsplit("-", 1)[0]: r.start_time for r in runs_of if r.name.startswith("evaluate_base")}
    updates_end = max(r.end_time for r in runs_of if r.name.startswith("grpo_update") and r.end_time)
    assert started.get("evaluate_base") is not None and started["evaluate_base"] < updates_end, (
        started,
        updates_end,
    )
    assert {c["policy"] for c in report.curve} == {"wv-add", "wv-rev"}
    for r in runs:
        assert stack.served(r.name) == f"sha256:{stack.registry().resolve(r.name).digest}"


# ---- faults --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a killed flow run and its rerun (13 s); scripts/faults.py kills real services too
def test_killed_during_update_then_rerun(stack: Stack) -> None:
    name = f"lc-kill-update-{stack.root.name}"  # the [mint] and [vllm] stacks share the session's MLflow
    proc = run_subprocess(stack, stack.ws, policy(name), training("k1", steps=3), "grpo_update:2:kill")
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert stack.registry().policies().count(name) == 0  # nothing was exported

    report = lifecycle(policy(name), training("k1", steps=3), stack.evaluation(), workspace=stack.ws)
    assert report.resumed_from == 1  # the checkpoint of step 1 survived the kill
    assert report.outcomes[0].status == "promoted"
    reg = stack.registry()
    assert [r.version for r in reg.revisions(name)] == [1]
    assert stack.aliases(name) == {"champion": 1, "candidate": 1}
    assert stack.served(name) == f"sha256:{reg.resolve(name).digest}"


@pytest.mark.slow  # a killed flow run and its rerun (19 s)
def test_killed_during_promotion_then_rerun(stack: Stack) -> None:
    name = f"lc-kill-promote-{stack.root.name}"  # the [mint] and [vllm] stacks share the session's MLflow
    old_version, old_digest = seed_champion(stack, name, seed=11)
    ws = stack.ws.model_copy(update={"lock_hold_s": 8.0})
    proc = run_subprocess(stack, ws, policy(name), training("k2"), "promote:kill")
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    reg = stack.registry()
    assert stack.aliases(name)["champion"] == 2  # moved, then the process died before serving it
    assert stack.served(name) == f"sha256:{old_digest}"

    t0 = time.perf_counter()
    report = lifecycle(policy(name), training("k2"), stack.evaluation(), workspace=ws)
    rerun_s = time.perf_counter() - t0
    assert report.outcomes[0].status == "promoted" and report.outcomes[0].reused
    assert [r.version for r in reg.revisions(name)] == [old_version, 2]
    assert stack.aliases(name) == {"champion": 2, "candidate": 2}
    assert stack.answered_by(name) == reg.resolve(name).digest
    print(f"\nrerun after a kill inside the promotion: {rerun_s:.1f} s (waited out the dead holder's lock)")


@pytest.mark.parametrize("point", ["refresh_serving", "smoke_check"])
def test_failed_refresh_leaves_alias_and_old_revision(
    stack: Stack, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"lc-fail-{point.replace('_', '-')}"
    old_version, old_digest = seed_champion(stack, name, seed=21)
    monkeypatch.setenv(FAULT_ENV, point)
    with pytest.raises(WaveFailed, match="injected fault"):
        lifecycle(policy(name), training("f1"), stack.evaluation(), workspace=stack.ws)
    reg = stack.registry()
    assert stack.aliases(name) == {"champion": old_version, "candidate": 2}
    assert reg.revision(name, 2).gate["passed"]  # type: ignore[index]
    assert stack.served(name) == f"sha256:{old_digest}"
    assert stack.answered_by(name) == old_digest


def test_a_base_evaluation_failing_beside_training_fails_the_wave_and_promotes_nothing(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"lc-base-fail-{stack.root.name}"
    # limit 3: no other test's cached base scores, so the evaluation runs (and fails) beside this training
    evaluation = stack.evaluation().model_copy(update={"limit": 3})
    monkeypatch.setenv(FAULT_ENV, "evaluate")
    with pytest.raises(InjectedFault):
        lifecycle(policy(name), training("bf1"), evaluation, workspace=stack.ws)
    assert stack.aliases(name) == {"candidate": 1}  # trained and exported; gated against nothing, not served
    assert stack.served(name) is None


def test_failed_gate_leaves_the_champion(stack: Stack) -> None:
    name = "lc-gate-no"
    old_version, old_digest = seed_champion(stack, name, seed=31)
    strict = GatePolicy(suite="add", floors={"add": 1.0}, **PLUMBING)
    report = lifecycle(policy(name, strict), training("g1"), stack.evaluation(), workspace=stack.ws)
    out = report.outcomes[0]
    assert out.status == "rejected" and any("floor:add" in r for r in out.reasons)
    reg = stack.registry()
    assert stack.aliases(name) == {"champion": old_version, "candidate": 2}
    assert reg.revision(name, 2).gate == {**reg.revision(name, 2).gate, "passed": False}  # type: ignore[dict-item]
    assert stack.served(name) == f"sha256:{old_digest}"


def test_racing_promotions_end_with_one_winner(stack: Stack) -> None:
    name = "lc-race"
    seed_champion(stack, name, seed=41)
    reg = stack.registry()
    base = load_base(stack.base_dir)
    versions = []
    for seed in (42, 43):
        w = random_adapter(base.sites, TARGETS, 4, alpha=8, seed=seed, base_fingerprint=base.fingerprint)
        versions.append(
            reg.create_revision(
                name, reg.store.put_weights(w, base.sites), base=base.fingerprint, rank=4
            ).version
        )
    code = (
        "import sys, json; from flows.promotion import promote_flow; from mint_core.lifecycle.workspace import Workspace; "
        "promote_flow(sys.argv[1], int(sys.argv[2]), expect=1, workspace=Workspace.model_validate_json(sys.argv[3]))"
    )
    env = {**os.environ, "MINT_SERVE_ADMIN_TOKEN": ADMIN}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, name, str(v), stack.ws.model_dump_json()],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for v in versions
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 1], outputs
    winner = versions[codes.index(0)]
    assert "AliasConflict" in outputs[codes.index(1)]
    assert stack.aliases(name)["champion"] == winner
    assert stack.answered_by(name) == reg.revision(name, winner).digest


# ---- serving follows the registry -----------------------------------------------------------------------


def test_reconcile_serves_an_alias_moved_in_mlflow(stack: Stack) -> None:
    name = "lc-reconcile"
    seed_champion(stack, name, seed=51)
    reg = stack.registry()
    base = load_base(stack.base_dir)
    w = random_adapter(base.sites, TARGETS, 4, alpha=8, seed=52, base_fingerprint=base.fingerprint)
    v2 = reg.create_revision(
        name, reg.store.put_weights(w, base.sites), base=base.fingerprint, rank=4, alias=None
    )

    t0 = time.perf_counter()
    MlflowClient(stack.ws.tracking_uri).set_registered_model_alias(name, "champion", str(v2.version))
    done = reconcile([name], workspace=stack.ws)
    # reconcile returned after its smoke check: no wait expected
    wait_until(lambda: stack.answered_by(name) == v2.digest, 30 - (time.perf_counter() - t0), "v2 answers")
    elapsed = time.perf_counter() - t0
    assert done[0].reloaded and done[0].alias_synced
    assert reg.catalog.alias_version(name, "champion") == v2.version
    again = reconcile([name], workspace=stack.ws)
    assert not again[0].reloaded
    print(
        f"\nalias moved in MLflow -> served after {elapsed:.2f} s: one reconcile flow run, of which "
        f"{done[0].work_s:.2f} s sync + in-place load + smoke check"
    )


def test_rollback_flow_and_prefetch(stack: Stack) -> None:
    name = "lc-rollback"
    v1, d1 = seed_champion(stack, name, seed=61)
    reg = stack.registry()
    base = load_base(stack.base_dir)
    w = random_adapter(base.sites, TARGETS, 4, alpha=8, seed=62, base_fingerprint=base.fingerprint)
    v2 = reg.create_revision(name, reg.store.put_weights(w, base.sites), base=base.fingerprint, rank=4)
    promote_flow(name, v2.version, workspace=stack.ws)
    assert stack.answered_by(name) == v2.digest

    out = rollback_flow(name, workspace=stack.ws)
    assert (out.alias.from_version, out.alias.to_version) == (v2.version, v1)
    assert stack.aliases(name)["champion"] == v1 and stack.answered_by(name) == d1

    with stack.ws.client() as c:
        c.unload_adapter(name)
    warm = prefetch([name], workspace=stack.ws)
    assert warm.route == "load" and warm.results == {f"{name}/v{v1}": "loaded"}  # no catalog on this server
    assert stack.served(name) == f"sha256:{d1}"
