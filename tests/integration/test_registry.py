"""The MLflow registry against a real MLflow server (SQLite backend; PostgreSQL backend at the end).

Policy = registered model, revision = model version with mint.* tags and its store URI as source, champion and
candidate aliases, rollback, lineage, the alias-move log, concurrent writers, and the errors people meet.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.mlflow_registry import (
    AliasConflict,
    Registry,
    RegistryConfig,
    RegistryError,
    RegistryUnavailable,
    UnknownRevision,
    source_location,
)
from mint_core.registry.store import AdapterStore
from mint_core.registry.store import UnknownRevision as StoreUnknownRevision
from mint_core.types import Site

pytestmark = pytest.mark.integration

BASE = "f" * 64


SITES = {"model.layers.0.self_attn.q_proj": Site("model.layers.0.self_attn.q_proj", 16, 16)}


def _put(store: AdapterStore, tmp: Path, seed: int) -> str:
    weights = random_adapter(SITES, ["q_proj"], rank=2, seed=seed, base_fingerprint=BASE)
    out = tmp / f"a{seed}-{uuid.uuid4().hex[:6]}"
    save_adapter(weights, out, SITES)
    return store.put_dir(out)


@pytest.fixture
def reg(mlflow_server: str, tmp_path: Path) -> Registry:
    store = AdapterStore(tmp_path / "store")
    catalog = Catalog(CatalogConfig(url=f"sqlite:///{tmp_path}/catalog.db"))
    return Registry(store, catalog, RegistryConfig(tracking_uri=mlflow_server))


def _policy() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"


def test_revision_is_a_tagged_version_with_its_store_uri(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    d = _put(reg.store, tmp_path, 1)
    rev = reg.create_revision(p, d, base=BASE, rank=2, data_rev="abc123")
    assert rev.version == 1 and rev.aliases == ("candidate",)
    mv = MlflowClient(reg.uri).get_model_version(p, "1")
    assert mv.tags["mint.digest"] == d and mv.tags["mint.base"] == BASE and mv.tags["mint.rank"] == "2"
    assert mv.tags["mint.data_rev"] == "abc123" and mv.tags["mint.parent"] == ""
    assert source_location(mv.source) == reg.store.path(d)
    # mirrored into the catalog under the same number
    assert reg.catalog.resolve(f"{p}/v1").digest == d
    assert reg.catalog.resolve(f"{p}@candidate").digest == d


def test_rerun_creates_no_second_version(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    d = _put(reg.store, tmp_path, 1)
    a = reg.create_revision(p, d, base=BASE, rank=2)
    b = reg.create_revision(p, d, base=BASE, rank=2)
    assert a.version == b.version == 1
    assert [r.version for r in reg.revisions(p)] == [1]


def test_promote_rollback_and_move_log(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    v1 = reg.create_revision(p, _put(reg.store, tmp_path, 1), base=BASE, rank=2)
    reg.promote(p, v1.version, reason="first")
    v2 = reg.create_revision(p, _put(reg.store, tmp_path, 2), base=BASE, rank=2, parent=v1.address)
    reg.promote(p, v2.version, reason="gate passed", expect=1)
    assert reg.resolve(p).version == 2
    assert reg.catalog.resolve(p).version == 2

    move = reg.rollback(p, reason="bad answers")
    assert (move.from_version, move.to_version) == (2, 1)
    assert reg.resolve(p).version == 1 and reg.catalog.resolve(f"{p}@champion").version == 1
    moves = reg.history(p, "champion")
    assert [(m.from_version, m.to_version, m.reason) for m in moves] == [
        (2, 1, "bad answers"),
        (1, 2, "gate passed"),
        (None, 1, "first"),
    ]
    rm = MlflowClient(reg.uri).get_registered_model(p)
    assert (
        "v2 -> v1" in rm.tags["mint.last_move.champion"]
        and "bad answers" in rm.tags["mint.last_move.champion"]
    )

    # lineage: v2's parent is v1
    assert [r.version for r in reg.lineage(p, 2)] == [2, 1]


def test_stale_expectation_moves_nothing(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    reg.create_revision(p, _put(reg.store, tmp_path, 1), base=BASE, rank=2)
    reg.create_revision(p, _put(reg.store, tmp_path, 2), base=BASE, rank=2)
    reg.promote(p, 1, reason="first")
    with pytest.raises(AliasConflict, match="expected unset, found v1"):
        reg.promote(p, 2, reason="late", expect=None)
    assert reg.resolve(p).version == 1
    assert len(reg.history(p, "champion")) == 1


def test_bad_input_changes_nothing(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    with pytest.raises(StoreUnknownRevision, match=r"no adapter revision sha256:a{64} in the store"):
        reg.create_revision(p, "a" * 64, base=BASE, rank=2)
    with pytest.raises(UnknownRevision):
        reg.revisions(p)  # nothing was created, not even the registered model
    reg.create_revision(p, _put(reg.store, tmp_path, 1), base=BASE, rank=2)
    with pytest.raises(UnknownRevision, match=r"v7"):
        reg.promote(p, 7, reason="no such version")
    with pytest.raises(RegistryError, match="needs a reason"):
        reg.promote(p, 1, reason=" ")
    with pytest.raises(UnknownRevision, match="no alias 'champion'"):
        reg.resolve(p)
    with pytest.raises(UnknownRevision, match="no earlier champion"):
        reg.rollback(p)
    with pytest.raises(RegistryError, match="reserved"):
        reg.create_revision(p, _put(reg.store, tmp_path, 2), base=BASE, rank=2, tags={"mint.digest": "x"})
    assert [r.version for r in reg.revisions(p)] == [1]
    assert reg.history(p, "champion") == []


def test_alias_of_a_deleted_version_is_a_clear_error(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    reg.create_revision(p, _put(reg.store, tmp_path, 1), base=BASE, rank=2)
    reg.promote(p, 1, reason="first")
    MlflowClient(reg.uri).delete_model_version(p, "1")
    with pytest.raises(UnknownRevision, match=r"last pointed at v1.*no longer has that version"):
        reg.resolve(p)


def test_moved_in_the_mlflow_ui_reaches_the_catalog(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    reg.create_revision(p, _put(reg.store, tmp_path, 1), base=BASE, rank=2)
    reg.create_revision(p, _put(reg.store, tmp_path, 2), base=BASE, rank=2)
    reg.promote(p, 2, reason="first")
    MlflowClient(reg.uri).set_registered_model_alias(p, "champion", "1")  # what the UI does
    assert reg.catalog.resolve(p).version == 2
    move = reg.sync_alias(p)
    # the actor is the MLflow login that moved it (this test's client logs in as mint's service account)
    assert move is not None and (move.from_version, move.to_version, move.actor) == (2, 1, "mint")
    assert reg.catalog.resolve(p).version == 1
    assert reg.sync_alias(p) is None


def test_concurrent_writers_lose_nothing(reg: Registry, tmp_path: Path) -> None:
    p = _policy()
    digests = [_put(reg.store, tmp_path, i) for i in range(8)]
    errors: list[BaseException] = []

    def write(d: str) -> None:
        try:
            Registry(reg.store, Catalog(reg.catalog.config), reg.config).create_revision(
                p, d, base=BASE, rank=2
            )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(d,)) for d in digests + digests[:3]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    revs = reg.revisions(p)
    assert sorted(r.digest for r in revs) == sorted(digests)  # each once: the repeats made no second version
    assert [r.version for r in revs] == list(range(1, 9))
    for r in revs:
        assert reg.catalog.resolve(r.address).digest == r.digest

    # racing promotions with the same expectation: exactly one wins
    outcomes: list[str] = []

    def promote(v: int) -> None:
        try:
            reg.promote(p, v, reason=f"race {v}", expect=None)
            outcomes.append(f"won {v}")
        except AliasConflict:
            outcomes.append("lost")

    threads = [threading.Thread(target=promote, args=(v,)) for v in (3, 5, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes)[:2] == ["lost", "lost"] and len(outcomes) == 3
    won = int(next(o for o in outcomes if o.startswith("won")).split()[1])
    assert reg.resolve(p).version == won and len(reg.history(p, "champion")) == 1


def test_unreachable_registry_is_a_clear_error(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    catalog = Catalog(CatalogConfig(url=f"sqlite:///{tmp_path}/catalog.db"))
    with pytest.raises(RegistryUnavailable, match=r"127\.0\.0\.1:9.*unreachable"):
        Registry(store, catalog, RegistryConfig(tracking_uri="http://127.0.0.1:9"))


def test_postgres_backend(mlflow_server_pg: str, tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    catalog = Catalog(CatalogConfig(url=f"sqlite:///{tmp_path}/catalog.db"))
    reg = Registry(store, catalog, RegistryConfig(tracking_uri=mlflow_server_pg))
    p = _policy()
    reg.create_revision(p, _put(store, tmp_path, 1), base=BASE, rank=2)
    reg.create_revision(p, _put(store, tmp_path, 2), base=BASE, rank=2, parent=f"{p}/v1")
    reg.promote(p, 2, reason="pg")
    reg.rollback(p, reason="pg rollback", to_version=1)
    assert reg.resolve(p).version == 1
    assert [r.version for r in reg.lineage(p, 2)] == [2, 1]


def test_command_line(reg: Registry, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mint_app.cli.app import app

    p = _policy()
    d1, d2 = _put(reg.store, tmp_path, 1), _put(reg.store, tmp_path, 2)
    # in the store, referenced by nothing (a seed no other test uses: the session shares one MLflow server)
    orphan = _put(reg.store, tmp_path, 10_000 + uuid.uuid4().int % 1_000_000)
    reg.create_revision(p, d1, base=BASE, rank=2)
    reg.create_revision(p, d2, base=BASE, rank=2, parent=f"{p}/v1")
    env = {
        "MINT_CATALOG_URL": reg.catalog.config.url,
        "MINT_STORE": reg.store.root_url,
        "MLFLOW_TRACKING_URI": reg.uri,
        "COLUMNS": "200",
    }
    runner = CliRunner()

    def mint(*args: str, code: int = 0) -> str:
        r = runner.invoke(app, list(args), env=env)
        assert r.exit_code == code, r.output
        return r.output

    assert "unset -> v1" in mint("registry", "promote", p, "1", "-m", "first")
    assert "first" in mint("registry", "history", p, "--alias", "champion")
    assert "v1 -> v2" in mint("registry", "promote", p, "v2", "-m", "better")
    out = mint("registry", "ls", p)
    assert "champion" in out and d2[:16] in out and f"{p}/v1" in out
    assert p in mint("registry", "ls")
    assert f"{p}/v2" in mint("registry", "lineage", f"{p}/v2") and d1[:16] in mint(
        "registry", "lineage", f"{p}/v2"
    )
    assert "v2 -> v1" in mint("registry", "rollback", p, "-m", "regressed")
    assert "regressed" in mint("registry", "history", p)
    assert d1 in mint("catalog", "resolve", p)
    assert d2 in mint("catalog", "resolve", f"{p}/v2")
    assert "no alias 'nope'" in mint("catalog", "resolve", f"{p}@nope", code=1)
    assert "error" in mint("catalog", "resolve", "bad address!", code=1)
    assert f"{p}/v1" in mint("catalog", "ls", "--policy", p)
    assert "regressed" in mint("catalog", "show", p)
    out = mint("catalog", "gc", "--dry-run")
    assert orphan in out and d1 not in out and d2 not in out
    mint("catalog", "gc")
    assert not reg.store.exists(orphan) and reg.store.exists(d1) and reg.store.exists(d2)
    assert "has no version v9 (its versions: v1..v2)" in mint(
        "registry", "promote", p, "9", "-m", "x", code=1
    )


def test_catalog_rebuild_restores_what_mlflow_says(reg: Registry, tmp_path: Path) -> None:
    import sqlalchemy as sa
    from typer.testing import CliRunner

    from mint_app.cli.app import app
    from mint_core.registry.catalog_schema import aliases, revisions, versions
    from mint_core.registry.index import rebuild_catalog

    p = _policy()
    d1, d2 = _put(reg.store, tmp_path, 1), _put(reg.store, tmp_path, 2)
    reg.create_revision(p, d1, base=BASE, rank=2)
    reg.create_revision(p, d2, base=BASE, rank=2, parent=f"{p}/v1")
    reg.promote(p, 1, reason="first")

    def damage() -> None:
        with reg.catalog.engine.begin() as conn:
            conn.execute(sa.delete(aliases).where(aliases.c.policy == p))
            conn.execute(sa.delete(versions).where(versions.c.policy == p, versions.c.version == 1))
            conn.execute(
                sa.update(versions).where(versions.c.policy == p, versions.c.version == 2).values(digest=d1)
            )
            conn.execute(sa.update(revisions).where(revisions.c.digest == d2).values(location="/wrong"))
        reg.catalog.set_alias(p, "champion", 2)

    def agrees() -> None:
        for r in reg.revisions(p):
            got = reg.catalog.resolve(r.address)
            assert (got.digest, got.location) == (r.digest, reg.store.path(r.digest)), r.address
        for alias in ("champion", "candidate"):
            assert reg.catalog.resolve(f"{p}@{alias}").version == reg.alias_version(p, alias), alias

    damage()
    assert reg.catalog.resolve(p).version == 2 and reg.catalog.resolve(f"{p}/v2").digest == d1
    report = rebuild_catalog(reg.reader, reg.catalog, reg.store, [p])
    assert report.policies == 1 and len(report.changes) >= 5, report.changes
    assert [(m.alias, m.from_version, m.to_version, m.actor) for m in report.moves] == [
        ("candidate", None, 2, "mint"),  # the MLflow login that moved each (mint's service account)
        ("champion", 2, 1, "mint"),
    ]
    agrees()
    assert rebuild_catalog(reg.reader, reg.catalog, reg.store, [p]).changes == []  # idempotent

    # the command does the same and says what it changed
    damage()
    env = {
        "MINT_CATALOG_URL": reg.catalog.config.url,
        "MINT_STORE": reg.store.root_url,
        "MLFLOW_TRACKING_URI": reg.uri,
        "COLUMNS": "200",
    }
    out = CliRunner().invoke(app, ["catalog", "rebuild", p, "--dry-run"], env=env)
    assert out.exit_code == 0 and f"{p}@champion: v2 -> v1" in out.output, out.output
    assert reg.catalog.resolve(p).version == 2  # dry: nothing changed
    out = CliRunner().invoke(app, ["catalog", "rebuild"], env=env)  # every policy
    assert out.exit_code == 0 and f"{p}@champion: v2 -> v1" in out.output, out.output
    agrees()
    out = CliRunner().invoke(app, ["catalog", "rebuild", p], env=env)
    assert "changed 0 row(s)" in out.output, out.output


def test_read_commands_import_no_mlflow_torch_or_transformers(reg: Registry, tmp_path: Path) -> None:
    """Against the live server: `mint registry ls/lineage` and the catalog reads leave no heavy module loaded."""
    import json
    import os
    import subprocess
    import sys

    p = _policy()
    reg.create_revision(p, _put(reg.store, tmp_path, 1), base=BASE, rank=2)
    reg.create_revision(p, _put(reg.store, tmp_path, 2), base=BASE, rank=2, parent=f"{p}/v1")
    script = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from mint_app.cli.app import app\n"
        "codes = [CliRunner().invoke(app, a).exit_code for a in json.loads(sys.argv[1])]\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'mlflow'})\n"
        "print(json.dumps([codes, heavy]))\n"
    )
    commands = [
        ["registry", "ls"],
        ["registry", "ls", p],
        ["registry", "lineage", f"{p}/v2"],
        ["registry", "history", p],
        ["catalog", "resolve", f"{p}@candidate"],
        ["catalog", "show", f"{p}/v1"],
    ]
    env = {
        **os.environ,
        "MINT_CATALOG_URL": reg.catalog.config.url,
        "MINT_STORE": reg.store.root_url,
        "MLFLOW_TRACKING_URI": reg.uri,
    }
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(commands)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    codes, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert codes == [0] * len(commands) and heavy == [], out.stdout
