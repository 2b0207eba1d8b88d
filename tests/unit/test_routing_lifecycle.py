"""The router as a revisioned model: the gate of a fitted router, its choices per task against the oracle of the
route log, and its registered model in MLflow (a real SQLite-backed registry): versions with their files and
estimate, `champion` moved only to a version that loads, moved back, and kept out of the policy listings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from mint_core.lifecycle.routers import GATE_RULE, choices_per_task, router_gate
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.leases import default_leases
from mint_core.registry.reader import RegistryConfig, RegistryReader
from mint_core.registry.routers import (
    GATE_TAG,
    OPE_TAG,
    REVISION_TAG,
    ROUTER_MODEL,
    RouterRefused,
    RouterRegistry,
)
from mint_core.routing import Featurizer, Router, fit_router
from mint_core.routing.log import RouteLog, RouteRecord, sparse_features
from mint_core.routing.ope import Estimate

FEAT = Featurizer(dim=64)
TASKS = {
    "add": [f"What is {a} plus {b}?" for a, b in zip(range(10), range(20, 30), strict=True)],
    "reverse": [f"Reverse the word {w}." for w in ("apple", "river", "stone", "cloud", "maple", "tiger")],
}


def est(value: float, half: float, n: int) -> Estimate:
    return Estimate(value, value - half, value + half, n, "dr")


@pytest.mark.parametrize(
    ("case", "candidate", "serving", "same", "decision"),
    [
        ("cold start, nothing logged", est(float("nan"), 0, 0), None, False, "promote"),
        ("no serving router, too few records", est(0.8, 0.1, 50), None, False, "keep"),
        ("no serving router, enough records", est(0.8, 0.05, 400), None, False, "promote"),
        (
            "lower bound above the serving estimate",
            est(0.8, 0.05, 400),
            est(0.7, 0.05, 400),
            False,
            "promote",
        ),
        ("lower bound below the serving estimate", est(0.72, 0.05, 400), est(0.7, 0.05, 400), False, "keep"),
        ("better, but too few records", est(0.9, 0.01, 100), est(0.5, 0.05, 100), False, "keep"),
        ("the serving router itself", est(0.8, 0.05, 400), est(0.8, 0.05, 400), True, "unchanged"),
    ],
)
def test_the_gate(
    case: str, candidate: Estimate, serving: Estimate | None, same: bool, decision: str
) -> None:
    gate = router_gate(candidate, serving, min_records=200, same=same)
    assert gate.decision == decision, (case, gate.reason)
    assert gate.passed == (decision == "promote") and gate.rule == GATE_RULE and gate.reason


def logged(tmp_path: Path, rows: list[tuple[str, str, float]]) -> list[RouteRecord]:
    """Decisions and their rewards written through the RouteLog API, read back joined."""
    log = RouteLog(tmp_path / "routing" / "log.jsonl")
    for i, (prompt, arm, reward) in enumerate(rows):
        x = FEAT.transform(prompt)
        log.decided(
            RouteRecord(
                rid=f"r{i}",
                t=float(i),
                router_revision="",
                features_digest=FEAT.digest(x),
                features=sparse_features(x),
                candidates=["add", "reverse"],
                choice=arm,
                prob=0.5,
                explored=False,
            )
        )
        log.rewarded(f"r{i}", reward, "task")
    return log.records()


def test_choices_per_task_against_the_oracle_of_the_log(tmp_path: Path) -> None:
    """A router warm-started on each arm's task picks that arm for its task; the oracle is the arm whose logged
    rewards on the task's prompts are highest; records of prompts of no task count for none."""
    router = fit_router([], cold_start=TASKS, featurizer=FEAT)
    rows = [(p, "add", 1.0) for p in TASKS["add"]] + [(p, "reverse", 0.0) for p in TASKS["add"][:3]]
    rows += [(p, "add", 0.2) for p in TASKS["reverse"]] + [("hello there", "reverse", 1.0)]
    records = logged(tmp_path, rows)
    got = {c.task: c for c in choices_per_task(router, records, TASKS)}
    add, rev = got["add"], got["reverse"]
    assert (add.choice, add.share, add.prompts) == ("add", 1.0, len(TASKS["add"]))
    assert (add.oracle, add.oracle_reward, add.choice_reward, add.agreement) == ("add", 1.0, 1.0, 1.0)
    assert add.logged == len(TASKS["add"]) + 3
    assert (
        rev.choice == "reverse" and rev.oracle == "add" and rev.agreement == 0.0 and rev.choice_reward is None
    )
    assert rev.logged == len(TASKS["reverse"])  # "hello there" is no task's prompt


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One SQLite-backed MLflow for the module (its migrations take seconds); each test its own model name."""
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # a SQLite-backed MLflow keeps run artifacts under ./mlruns
        yield f"sqlite:///{root / 'mlflow.db'}", root


@pytest.fixture
def routers(mlflow_db: tuple[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> RouterRegistry:
    uri, root = mlflow_db
    leases = default_leases(Catalog(CatalogConfig(url=f"sqlite:///{root / 'catalog.db'}")))
    model = f"{ROUTER_MODEL}-{request.node.name[:40].replace('_', '-')}"
    return RouterRegistry(uri, leases, tmp_path / "routing" / "registry", model)


def saved(tmp_path: Path, name: str, arms: dict[str, list[str]]) -> Path:
    fit_router([], cold_start=arms, featurizer=FEAT).save(tmp_path / name)
    return tmp_path / name


def test_versions_carry_files_and_estimate_and_champion_moves_only_to_what_loads(
    routers: RouterRegistry, tmp_path: Path
) -> None:
    one = routers.register(
        saved(tmp_path, "one", TASKS),
        ope={"value": 0.8, "lo": 0.7, "hi": 0.9, "n": 300, "method": "dr"},
        gate={"passed": True, "decision": "promote", "reason": "first"},
    )
    assert one.version == 1 and one.revision == Router.load(tmp_path / "one").revision
    assert one.ope == {"value": 0.8, "lo": 0.7, "hi": 0.9, "n": 300, "method": "dr"}
    assert one.gate is not None and one.gate["decision"] == "promote"
    assert routers.register(tmp_path / "one").version == 1  # the same bytes: no second version
    two = routers.register(saved(tmp_path, "two", {"add": TASKS["add"]}))
    assert two.version == 2 and two.revision != one.revision
    assert routers.champion() is None

    moved = routers.promote(1, "first router")
    assert (moved.from_version, moved.to_version, moved.moved) == (None, 1, True)
    assert (
        routers.cache_dir is not None
        and moved.path == routers.cache_dir / one.revision
        and Router.load(moved.path).revision == one.revision
    )
    routers.promote(2, "a better one", expect=1)
    assert routers.champion().version == 2  # type: ignore[union-attr]
    routers.promote(1, "rolled back", expect=2)
    champ = routers.champion()
    assert champ is not None and (champ.version, champ.revision) == (1, one.revision)
    last = MlflowClient(routers.uri).get_registered_model(routers.model).tags["mint.last_move.champion"]
    assert "v2 -> v1" in last and "rolled back" in last


def test_a_version_that_does_not_load_is_refused_and_the_champion_stays(
    routers: RouterRegistry, tmp_path: Path
) -> None:
    good = routers.register(saved(tmp_path, "good", TASKS))
    routers.promote(good.version, "first router")
    bad = saved(tmp_path, "bad", {"add": TASKS["add"]})
    manifest = json.loads((bad / "manifest.json").read_text())
    with pytest.raises(RouterRefused, match="does not load"):  # registering it is refused, nothing written
        (bad / "state.npz").write_bytes(b"not an npz")
        routers.register(bad)
    assert [v.version for v in routers.versions()] == [good.version]
    # a version made past mint (a person's upload) whose files do not load: never champion
    client = MlflowClient(routers.uri)
    mv = client.create_model_version(
        routers.model, str(bad), tags={REVISION_TAG: manifest["revision"], GATE_TAG: "{}"}
    )
    with pytest.raises(RouterRefused, match=f"v{mv.version} does not load"):
        routers.promote(int(mv.version), "should not move")
    assert routers.champion().version == good.version  # type: ignore[union-attr]
    assert routers.cache_dir is not None and not (routers.cache_dir / manifest["revision"]).exists()


def test_the_router_is_no_policy_in_the_listings(routers: RouterRegistry, tmp_path: Path) -> None:
    routers.register(saved(tmp_path, "one", TASKS), ope={"value": 0.5})
    client = MlflowClient(routers.uri)
    client.create_registered_model("add")
    reader = RegistryReader(RegistryConfig(tracking_uri=routers.uri))
    assert routers.model in [m.name for m in client.search_registered_models()]
    assert reader.policies() == ["add"]  # the routers of the other tests too are left out
    aliased, revisions = reader.everything()
    assert list(aliased) == ["add"] and revisions == []
    assert json.loads(routers.version(1).tags[OPE_TAG]) == {"value": 0.5}


def test_two_routers_fitted_alike_have_one_revision(tmp_path: Path) -> None:
    """The flow's `unchanged`: a fit from the same log and prompts is the same revision."""
    a = fit_router([], cold_start=TASKS, featurizer=FEAT)
    b = fit_router([], cold_start=TASKS, featurizer=FEAT)
    assert a.save(tmp_path / "a") == b.save(tmp_path / "b")
    assert np.array_equal(a.probs(FEAT.transform("What is 1 plus 2?"), ["add", "reverse"]),
                          b.probs(FEAT.transform("What is 1 plus 2?"), ["add", "reverse"]))  # fmt: skip
