"""Every training deployment's default form works on the state `make run` leaves (issue 27).

`make run` leaves each default policy with a champion at its built-in rank (`recipe_spec`: `add` at 32, the
others at 8), while the `wave` and `lifecycle` deployments' forms (infra/prefect.yaml) name the policies without
a rank (8). A Quick run from the dashboard used to fail within seconds: the trainer's engine was sized from the
form (max rank 8) and refused the rank-32 champion. The champion now fixes what its policy continues with.

Default tier: the champion state is built directly (a rank-32 `add` and rank-8 `reverse` and `sort`, each with a
training run naming its spec, registered, aliased champion and served, as the main job leaves them) on the tiny
base, and the real `wave` and `lifecycle` flows run with their deployments' parameters, as a Quick run sends
them; only what says where things are differs (the workspace, the suites' and prompts' directories, which `make
run` builds with DVC). Slow tier: a real main job, then every deployment whose form needs nothing more started
through the Prefect API and run by the job's worker.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from mlflow import MlflowClient
from prefect.states import State

from flows.lifecycle import lifecycle, wave
from flows.prefetch import prefetch
from flows.reconcile import reconcile
from flows.retrain import retrain
from flows.route import route
from mint_core.data.build import write_task_data
from mint_core.data.generators import GENERATORS
from mint_core.data.spec import registry as task_registry
from mint_core.engine.base import load_base
from mint_core.eval.suites import standalone_suites
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter
from mint_core.registry.runs import log_training_run
from mint_core.rl.builder import recipe_spec
from mint_testkit.harness import free_port, mint_cli, save_tiny_base, start_server, stop_server
from mint_testkit.skips import require
from tasks.registry import EXPERIMENT
from tests.fault_points import FAULT_ENV
from tests.integration.conftest import running_service

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = {
    d["name"]: d for d in yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())["deployments"]
}
ADMIN = "admin-secret"  # what start_server gives `mint serve`
POLICIES = [p["spec"]["name"] for p in DEPLOYMENTS["wave"]["parameters"]["policies"]]


@dataclass
class MainJobState:
    ws: Workspace
    suites: Path
    data: Path
    champions: dict[str, int]
    """Policy -> the version the main job left as its champion."""


@pytest.fixture(scope="module")
def main_job_state(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MainJobState]:
    """The policies of the deployments' forms with champions as the main job leaves them, on the tiny base. An
    MLflow of this module's own: the forms' policy names (add, reverse, sort) are fixed, and no other test's
    versions of them may be in the registry."""
    root = tmp_path_factory.mktemp("after-main-job")
    store = root / "store"
    store.mkdir()
    base_dir = save_tiny_base(root / "base")
    data = root / "data" / "tasks"
    write_task_data(
        data, list(GENERATORS), n_train=600, n_heldout=40, seed=0
    )  # the DVC `task_data` stage's layout
    suites = standalone_suites(root, limit=20, tasks_dir=data)
    # mint up serves up to rank 32 (serve_max_lora_rank): the main job's rank-32 `add` must load
    env = {"MINT_SERVE_TORCH_THREADS": "1", "MINT_SERVE_MAX_LORA_RANK": "32"}
    with running_service("mlflow", root / "mlflow") as mlflow:
        proc, url = start_server(store, "--base", str(base_dir), env=env)
        ws = Workspace(
            tracking_uri=mlflow.url,
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
                yield MainJobState(ws, suites, data, _champions_as_the_main_job_leaves_them(ws, base_dir))
            finally:
                stop_server(proc)


def _champions_as_the_main_job_leaves_them(ws: Workspace, base_dir: Path) -> dict[str, int]:
    reg = ws.registry()
    base = load_base(base_dir)
    versions = {}
    for i, name in enumerate(POLICIES):
        spec = recipe_spec(name, name)  # what mint_app.job.main trains: `add` at rank 32
        weights = random_adapter(
            base.sites,
            spec.targets,
            spec.rank,
            alpha=spec.alpha,
            seed=i,
            std=0.02,
            base_fingerprint=base.fingerprint,
        )
        digest = reg.store.put_weights(weights, base.sites)
        # the spec is a param of the champion's training run, where retraining reads it
        run_id = log_training_run(
            reg.client, EXPERIMENT, name, f"main-job-{name}", {"policy": spec.model_dump_json()}, []
        )
        rev = reg.create_revision(
            name, digest, base=base.fingerprint, rank=spec.rank, run_id=run_id, alias=None
        )
        reg.promote(name, rev.version, "the main job's first wave")
        with ws.client() as c:
            c.load_adapter(name, f"sha256:{digest}", inplace=True)
        versions[name] = rev.version
    return versions


def quick_run(state: MainJobState, deployment: str, flow: Any) -> dict[str, Any]:
    """The deployment's parameters as the dashboard's Quick run sends them, and the flows' defaults for the rest,
    but where things are: this test's servers and the DVC outputs it built."""
    params = json.loads(json.dumps(DEPLOYMENTS[deployment].get("parameters") or {}))
    takes = inspect.signature(flow.fn).parameters
    if "training" in takes:
        params.setdefault("training", {})["data_dir"] = str(state.data)
        params["training"]["dry_run"] = 0  # the tiny random base: its rewards have no signal to check
    if "evaluation" in takes:  # limits: the form's defaults (320, capped by the data)
        params["evaluation"] = {"suites_dir": str(state.suites)}
    params["workspace"] = state.ws.model_dump(mode="json")
    return params


def run_like_a_deployment(flow: Any, params: dict[str, Any]) -> State[Any]:
    """The way a flow run from a deployment takes its parameters: validated against the flow's models first."""
    return cast(State[Any], flow(**flow.validate_parameters(params), return_state=True))


def test_the_forms_ask_for_less_than_the_champions_have() -> None:
    """What this module is about: the main job's `add` champion has a higher rank than the forms give it."""
    assert (task_registry().get("add").recipe.rank or 8) > 8
    assert {"spec": {"name": "add", "task": "add"}} in DEPLOYMENTS["wave"]["parameters"]["policies"]
    assert DEPLOYMENTS["lifecycle"]["parameters"]["policy"] == {"spec": {"name": "add", "task": "add"}}


@pytest.mark.parametrize("deployment", ["wave", "lifecycle"])
def test_a_quick_run_with_the_default_form_completes_after_the_main_job(
    main_job_state: MainJobState, deployment: str
) -> None:
    flow = {"wave": wave, "lifecycle": lifecycle}[deployment]
    t0 = time.perf_counter()
    state = run_like_a_deployment(flow, quick_run(main_job_state, deployment, flow))
    took = time.perf_counter() - t0
    assert state.is_completed(), (state.type, state.message)
    report = state.result()
    names = [o.policy for o in report.outcomes]
    assert names == (POLICIES if deployment == "wave" else ["add"])
    assert all(o.status in ("promoted", "rejected", "unchanged") for o in report.outcomes), report.outcomes

    # `add` continued from its rank-32 champion at rank 32: the candidate is its child, at the champion's rank,
    # and its training run records what the form asked for and what the champion made of it
    reg = main_job_state.ws.registry()
    add = next(o for o in report.outcomes if o.policy == "add")
    assert add.champion_before is not None and add.candidate is not None
    cand = reg.revision("add", int(add.candidate.rsplit("/v", 1)[1]))
    assert cand.parent == add.champion_before and cand.rank == task_registry().get("add").recipe.rank
    assert cand.run_id is not None
    logged = MlflowClient(main_job_state.ws.tracking_uri).get_run(cand.run_id).data.params
    trained = json.loads(logged["policy"])
    assert (trained["rank"], trained["alpha"]) == (32, 64.0)
    assert (
        json.loads(logged["form_policy"])["rank"] == 8 and "rank: 8 -> 32" in logged["overridden_by_champion"]
    )
    print(f"\n{deployment} with its default form: {state.type.value} in {took:.0f} s")


@pytest.mark.parametrize(
    "deployment",
    [pytest.param("retrain", marks=pytest.mark.slow), "prefetch", "route", "reconcile"],  # retrain: 26 s
)
def test_the_other_deployments_default_forms_complete_after_the_main_job(
    main_job_state: MainJobState, deployment: str
) -> None:
    """Retraining takes every champion's recorded spec (`add` at rank 32); prefetch warms the champions; route,
    with no route log yet, registers and serves the router fitted on the policies' held-out prompts; reconcile
    finds serving (the router too) in line with the aliases. After the wave and lifecycle tests of this module."""
    flow = {"retrain": retrain, "prefetch": prefetch, "route": route, "reconcile": reconcile}[deployment]
    t0 = time.perf_counter()
    state = run_like_a_deployment(flow, quick_run(main_job_state, deployment, flow))
    assert state.is_completed(), (state.type, state.message)
    if deployment == "retrain":
        report = state.result()
        assert report.trained == POLICIES and report.wave is not None, report
        assert all(o.status != "failed" for o in report.wave.outcomes), report.wave.outcomes
    if deployment == "route":
        routed = state.result()
        assert routed.records == 0 and set(POLICIES) <= set(routed.arms), routed
        assert routed.promoted and routed.served is not None, routed.gate
        assert routed.served.served_after == routed.candidate.revision
    print(f"\n{deployment} with its default form: {state.type.value} in {time.perf_counter() - t0:.0f} s")


# ---- after a real main job --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_deployment_with_its_default_form_completes_after_a_real_main_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mint run` (the main job, on the built-in base), then every deployment whose form needs nothing more
    started through the Prefect API as the dashboard's Quick run does (/work/shared/tools/deployments_defaults.py
    is the same check by hand), run by the job's worker: each must end Completed."""
    built = (ROOT / "data" / "base" / "config.json").is_file() and (ROOT / "eval_suites" / "data").is_dir()
    require(built, "the built-in base and eval suites are not built (dvc repro)")
    from prefect.client.orchestration import get_client

    from mint_app.services.prefect_auth import prefect_api
    from mint_core.access import access_path, load

    state = tmp_path / "mint"
    ports = {"mlflow": free_port(), "prefect": free_port(), "serve": free_port()}
    monkeypatch.setenv("MINT_RUN_WORKER_PORT", str(free_port()))
    monkeypatch.setenv("MINT_SERVICES_HOOKS_PORT", str(free_port()))
    flags = ["--state-dir", str(state), "--no-build", *(f"--{n}-port={p}" for n, p in ports.items())]

    def mint(*args: str) -> subprocess.CompletedProcess[str]:
        return mint_cli(*args, timeout=2400, cwd=ROOT, unset=("MINT_SERVE_ADMIN_TOKEN",))

    try:
        job = mint("run", *flags)
        assert job.returncode == 0, job.stdout[-6000:] + job.stderr[-4000:]
        final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
        ended: dict[str, str] = {}
        api = f"http://127.0.0.1:{ports['prefect']}/api"
        auth = load(access_path(state / "run")).service.prefect_auth  # the job's Prefect server asks it
        with prefect_api(api, auth), get_client(sync_client=True) as client:
            for d in sorted(client.read_deployments(), key=lambda d: d.name):
                required = set((d.parameter_openapi_schema or {}).get("required", []))
                if required - set(d.parameters or {}):
                    continue  # promote, rollback: the form needs a policy and a version
                run = client.create_flow_run_from_deployment(d.id)
                deadline = time.monotonic() + 900
                while time.monotonic() < deadline:
                    r = client.read_flow_run(run.id)
                    if r.state and r.state.type.value in final:
                        break
                    time.sleep(2)
                ended[d.name] = (
                    f"{r.state.type.value if r.state else 'UNKNOWN'} {r.state.message if r.state else ''}"
                )
        assert {"wave", "lifecycle", "retrain", "prefetch", "route", "reconcile"} <= set(ended), ended
        assert all(s.startswith("COMPLETED") for s in ended.values()), ended
    finally:
        mint("down", "--state-dir", str(state / "run"))
