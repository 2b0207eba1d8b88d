"""`mint registry retain` against a real MLflow server: a dry run lists what would go and changes nothing;
`--apply` deletes from MLflow and the catalog exactly the versions no rule keeps (aliased versions, the lineage of
aliased versions across policies, the newest N), re-links the lineage over what it deleted, and `mint catalog gc`
then frees their bytes and nothing else."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from mint_core.registry.catalog import Catalog, CatalogConfig, UnknownAddress
from mint_core.registry.mlflow_registry import Registry, RegistryConfig
from mint_core.registry.store import AdapterStore
from mint_testkit.harness import mint_cli

pytestmark = pytest.mark.integration

BASE = "f" * 64


def test_retain_keeps_aliased_their_lineage_and_the_newest_and_deletes_the_rest(
    mlflow_server: str, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    catalog_url = f"sqlite:///{tmp_path}/catalog.db"
    reg = Registry(store, Catalog(CatalogConfig(url=catalog_url)), RegistryConfig(tracking_uri=mlflow_server))
    p, q = f"ret-{uuid.uuid4().hex[:8]}", f"ret-{uuid.uuid4().hex[:8]}"
    digests = {}
    # p: v1 <- v2 <- v3 <- v4, and v3 <- v5 <- v6 <- v7 (v5 trained again from v3)
    parents = {1: None, 2: 1, 3: 2, 4: 3, 5: 3, 6: 5, 7: 6}
    for v, up in parents.items():
        digests[v] = store.put_bytes(f'{{"v": {v}, "p": "{p}"}}'.encode(), f"weights {v}".encode())
        reg.create_revision(p, digests[v], base=BASE, rank=2, parent=f"{p}/v{up}" if up else None, alias=None)
    reg.promote(p, 3, "the best so far")  # keeps v3 and its ancestors v2, v1
    qd = store.put_bytes(b'{"q": 1}', b"q weights")
    reg.create_revision(q, qd, base=BASE, rank=2, parent=f"{p}/v5", alias="champion")  # keeps p/v5 (and up)

    args = ("--catalog", catalog_url, "--store", str(store.root), "--tracking-uri", mlflow_server)
    dry = mint_cli("registry", "retain", "--policy", p, "--keep-last", "1", *args)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "would delete 2 version(s)" in dry.stdout
    row = next(line for line in dry.stdout.splitlines() if p in line)
    assert "v4, v6" in row and f"ancestor of {q}/v1 (champion)" in row and "alias champion" in row
    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    assert len(client.search_model_versions(f"name='{p}'")) == 7  # a dry run changes nothing

    done = mint_cli("registry", "retain", "--policy", p, "--keep-last", "1", "--apply", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deleted 2 version(s)" in done.stdout
    left = {int(mv.version): mv for mv in client.search_model_versions(f"name='{p}'")}
    assert sorted(left) == [1, 2, 3, 5, 7]
    # the lineage runs over the deleted version: v7's parent was v6
    assert left[7].tags["mint.parent"] == f"{p}/v5"
    assert [r.address for r in reg.lineage(p, 7)] == [f"{p}/v{v}" for v in (7, 5, 3, 2, 1)]
    cat = Catalog(CatalogConfig(url=catalog_url))
    for gone in (4, 6):
        with pytest.raises(UnknownAddress):
            cat.resolve(f"{p}/v{gone}")
    assert cat.resolve(f"{p}@champion").version == 3

    gc = mint_cli("catalog", "gc", *args)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert set(store.list()) == {digests[v] for v in (1, 2, 3, 5, 7)} | {qd}

    again = mint_cli("registry", "retain", "--policy", p, "--keep-last", "1", "--apply", *args)
    assert again.returncode == 0 and "deleted 0 version(s)" in again.stdout  # idempotent


def test_retain_refuses_an_unknown_policy_and_changes_nothing(mlflow_server: str, tmp_path: Path) -> None:
    out = mint_cli(
        "registry",
        "retain",
        "--policy",
        "no-such-policy-here",
        "--keep-last",
        "1",
        "--apply",
        "--tracking-uri",
        mlflow_server,
        "--catalog",
        f"sqlite:///{tmp_path}/catalog.db",
    )
    assert out.returncode != 0 and "no such policy: no-such-policy-here" in out.stdout + out.stderr
