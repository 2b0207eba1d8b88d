"""The router as a revisioned model, end to end on real servers (MLflow, Prefect, mint serve): the `route` flow on a
fresh stack registers and serves the router fitted on the held-out prompts alone; on a real route log (written by
the RouteLog API) it registers a candidate that beats the serving router off-policy, moves `champion` and the
server follows; a version whose files do not load is never champion and the server keeps its router; an alias
moved in MLflow directly (a reviewer's rollback) is what the server routes with after a reconcile.

One module-scoped story, in order: the tests build on the champion the one before left."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort

from flows.reconcile import reconcile
from flows.route import RouteConfig, promote_router, route
from mint_core.data.spec import registry as task_registry
from mint_core.engine.base import build_tiny_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lifecycle.routers import reconcile_router, router_registry, served_router
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter
from mint_core.registry.catalog import CHAMPION
from mint_core.registry.routers import GATE_TAG, OPE_TAG, ROUTER_MODEL, RouterRefused
from mint_core.routing import Featurizer, Router
from mint_core.routing.log import RouteLog, RouteRecord, sparse_features
from mint_core.serving.client import ServingError
from mint_testkit.harness import ADMIN_TOKEN, start_server, stop_server
from tasks.routing import REPORT_KEY, RouterRef
from tests.integration.conftest import running_service

pytestmark = pytest.mark.integration

BASE = "tiny-dense"
"""The served base's name: an arm of the route log beside the policies."""


@dataclass
class Stack:
    ws: Workspace
    routing: Path
    arms: dict[str, str]
    """Policy -> the task its champion was trained on."""


@pytest.fixture(scope="module")
def stack(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """mint serve with two policies whose champions are revisions of the `add` and `reverse` tasks. An MLflow of
    this module's own: `mint-router` is one name, and the cold start reads every policy's champion."""
    root = tmp_path_factory.mktemp("route")
    store = root / "store"
    store.mkdir()
    with (
        running_service("mlflow", root / "mlflow") as mlflow,
        _serving(store) as url,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("MINT_SERVE_ADMIN_TOKEN", ADMIN_TOKEN)
        ws = Workspace(
            tracking_uri=mlflow.url,
            store=str(store),
            catalog_url=f"sqlite:///{root / 'catalog.db'}",
            serving_url=url,
            admin_token_file=None,
            work_dir=root / "lifecycle",
        )
        reg = ws.registry()
        base = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())  # what mint serve serves
        arms = {}
        for i, task in enumerate(("add", "reverse")):
            name = f"rt-{task}-{uuid.uuid4().hex[:6]}"
            w = random_adapter(base.sites, ["q_proj"], 4, seed=i, base_fingerprint=base.fingerprint)
            digest = reg.store.put_weights(w, base.sites)
            rev = reg.create_revision(
                name, digest, base=base.fingerprint, rank=4, tags={"mint.task": task}, alias=None
            )
            reg.promote(name, rev.version, "the route test's champion")
            arms[name] = task
        yield Stack(ws, root / "routing", arms)


@contextmanager
def _serving(store: Path) -> Iterator[str]:
    proc, url = start_server(store)
    try:
        yield url
    finally:
        stop_server(proc)


def served(ws: Workspace) -> str:
    with ws.client() as client:
        view = served_router(client)
    assert view is not None
    return str(view["revision"])


def artifact(key: str) -> str:
    with get_client(sync_client=True) as client:
        shown = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            limit=1,
            sort=ArtifactSort.CREATED_DESC,
        )
    assert shown, f"no artifact {key}"
    return str(shown[0].data)


def write_log(stack: Stack, n: int, seed: int = 0) -> None:
    """`n` decisions a uniform router made over the two policies and the base, each rewarded: the base is
    best on every prompt (a decoy the cold start knows nothing of), a task's own policy second."""
    rng = np.random.default_rng(seed)
    feat = Featurizer()
    tasks = task_registry()
    prompts = {p: [r.prompt for r in tasks.get(t).heldout_rows()[:40]] for p, t in stack.arms.items()}
    candidates = [*stack.arms, BASE]
    log = RouteLog(stack.routing / "log.jsonl")
    for i in range(n):
        policy = list(stack.arms)[i % 2]
        prompt = prompts[policy][int(rng.integers(len(prompts[policy])))]
        x = feat.transform(prompt)
        choice = candidates[int(rng.integers(3))]
        mean = 0.95 if choice == BASE else 0.5 if choice == policy else 0.05
        rid = f"cmpl-{seed}-{i}"
        log.decided(
            RouteRecord(
                rid=rid,
                t=1e9 + i,
                router_revision="logger",
                features_digest=feat.digest(x),
                features=sparse_features(x),
                candidates=candidates,
                choice=choice,
                prob=1 / 3,
                explored=True,
            )
        )
        log.rewarded(rid, float(rng.random() < mean), "task")


def test_a_fresh_stack_registers_and_serves_the_router_of_the_held_out_prompts(stack: Stack) -> None:
    routers = router_registry(stack.ws, None)
    assert routers.champion() is None and not (stack.routing / "log.jsonl").exists()
    before = served(stack.ws)
    report = route(workspace=stack.ws)  # the deployment's default form, but where the servers are
    assert report.gate is not None and report.gate.decision == "promote" and report.promoted, report.gate
    assert report.records == 0 and set(stack.arms) <= set(report.arms)
    champ = routers.champion()
    assert champ is not None and report.candidate is not None and champ.version == report.candidate.version
    assert served(stack.ws) == champ.revision != before
    shown = artifact(REPORT_KEY)
    assert "**Decision: promote**" in shown and "| add |" in shown and "| reverse |" in shown
    # each task's prompts go to its own policy's arm
    choices = {c.task: c.choice for c in report.tasks}
    assert {choices[t]: t for t in stack.arms.values()} == stack.arms


def test_a_router_fitted_on_the_route_log_beats_the_serving_one_and_is_served(stack: Stack) -> None:
    first = router_registry(stack.ws, None).champion()
    assert first is not None
    write_log(stack, 300)
    config = RouteConfig(min_records=200)
    report = route(config=config, workspace=stack.ws)
    gate, cand = report.gate, report.candidate
    assert gate is not None and gate.decision == "promote" and report.promoted, gate
    assert report.serving is not None and report.serving.version == first.version
    assert report.rewarded == 300 and cand is not None and cand.version > first.version
    cand_est, serv_est = report.candidate_estimate, report.serving_estimate
    assert cand_est is not None and serv_est is not None and cand_est.n == serv_est.n == 300
    assert (
        cand_est.lo is not None and serv_est.value is not None and cand_est.lo >= serv_est.value
    )  # the gate
    rv = router_registry(stack.ws, None).version(cand.version)
    assert CHAMPION in rv.aliases and rv.ope is not None and rv.ope["n"] == 300
    assert rv.gate is not None and rv.gate["decision"] == "promote"
    assert served(stack.ws) == cand.revision
    # the base was best on every task's prompts in the log: the oracle, and the new router's choice
    for c in report.tasks:
        if c.task in stack.arms.values():
            assert (c.oracle, c.choice) == (BASE, BASE), c
            assert c.serving_choice in stack.arms and c.logged > 0
    shown = artifact(REPORT_KEY)
    assert "**Decision: promote**" in shown and f"| {BASE} (" in shown

    # the same log again fits the same router: nothing new is registered
    again = route(config=config, workspace=stack.ws)
    assert again.gate is not None and again.gate.decision == "unchanged" and not again.promoted
    assert max(v.version for v in router_registry(stack.ws, None).versions()) == cand.version


def test_a_version_that_does_not_load_is_refused_and_serving_keeps_its_router(
    stack: Stack, tmp_path: Path
) -> None:
    routers = router_registry(stack.ws, stack.routing)
    champ = routers.champion()
    assert champ is not None
    good = Router.load(routers.fetch(champ.version))
    broken = tmp_path / "broken"
    good.save(broken)
    (broken / "state.npz").write_bytes(b"corrupt")
    # a version made past the flow (a person's upload): its files do not load
    client = MlflowClient(stack.ws.tracking_uri)
    run = client.create_run(client.get_experiment_by_name("mint-router").experiment_id)  # type: ignore[union-attr]
    client.log_artifacts(run.info.run_id, str(broken), "router")
    mv = client.create_model_version(ROUTER_MODEL, f"{run.info.artifact_uri}/router", run_id=run.info.run_id)
    with pytest.raises(RouterRefused, match="does not load"):
        routers.promote(int(mv.version), "should be refused")
    assert routers.champion().version == champ.version  # type: ignore[union-attr]

    # a reviewer points champion at it in MLflow anyway: the server is not given it, and keeps its router
    client.set_registered_model_alias(ROUTER_MODEL, CHAMPION, mv.version)
    try:
        with pytest.raises(RouterRefused):
            reconcile_router(stack.ws)
        assert served(stack.ws) == champ.revision
    finally:
        client.set_registered_model_alias(ROUTER_MODEL, CHAMPION, str(champ.version))
    assert client.get_model_version(ROUTER_MODEL, mv.version).tags.get(GATE_TAG) is None


def test_a_promotion_the_server_does_not_take_moves_the_alias_back(stack: Stack, tmp_path: Path) -> None:
    """The transaction of the flow's promotion: the server refuses the router (here: a path outside its routing
    dir, 400), so `champion` goes back to where it was and the server keeps its router."""
    routers = router_registry(stack.ws, None)
    champ = routers.champion()
    assert champ is not None
    other = next(v for v in routers.versions() if v.version != champ.version and v.tags.get(OPE_TAG))

    @flow
    def promotion() -> None:  # as the route flow runs it
        promote_router(stack.ws, ROUTER_MODEL, tmp_path / "elsewhere", other.version, RouterRef.of(champ))

    with pytest.raises(ServingError, match="not inside the routing dir"):
        promotion()
    assert routers.champion().version == champ.version  # type: ignore[union-attr]
    assert served(stack.ws) == champ.revision


def test_moving_the_alias_in_mlflow_changes_the_serving_router(stack: Stack) -> None:
    """A reviewer's rollback in the MLflow UI (a bare MlflowClient call here): `champion` resolves to the older
    version, and the reconcile deployment's flow makes the server route with it."""
    routers = router_registry(stack.ws, None)
    now = routers.champion()
    older = [v for v in routers.versions() if v.revision and v.version < now.version and v.tags.get(OPE_TAG)]  # type: ignore[union-attr]
    assert now is not None and older
    back = older[0]
    MlflowClient(stack.ws.tracking_uri).set_registered_model_alias(ROUTER_MODEL, CHAMPION, str(back.version))
    assert routers.champion().version == back.version  # type: ignore[union-attr]
    reconcile(policies=[ROUTER_MODEL], workspace=stack.ws)
    assert served(stack.ws) == back.revision
    reconcile(policies=[ROUTER_MODEL], workspace=stack.ws)  # in line already: nothing to do
    assert served(stack.ws) == back.revision
