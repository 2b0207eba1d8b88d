"""MLflow reads local-store revisions: the `mint-store://` artifact repository plugin, through a real server.

Before it, every model version page of a local-store revision answered 500 ("Could not find a registered
artifact repository for: mint-store://...").
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import mlflow.artifacts
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.mlflow_registry import Registry, RegistryConfig
from mint_core.registry.store import AdapterStore
from mint_core.types import Site

pytestmark = pytest.mark.integration

SITES = {"model.layers.0.self_attn.q_proj": Site("model.layers.0.self_attn.q_proj", 16, 16)}
FILES = {"adapter_config.json", "adapter_model.safetensors"}


@pytest.fixture
def revision(mlflow_server: str, tmp_path: Path) -> tuple[str, int, Path]:
    store = AdapterStore(tmp_path / "store")
    reg = Registry(
        store,
        Catalog(CatalogConfig(url=f"sqlite:///{tmp_path}/catalog.db")),
        RegistryConfig(tracking_uri=mlflow_server),
    )
    weights = random_adapter(SITES, ["q_proj"], rank=2, seed=3, base_fingerprint="f" * 64)
    save_adapter(weights, tmp_path / "a", SITES)
    digest = store.put_dir(tmp_path / "a")
    policy = f"p-{uuid.uuid4().hex[:8]}"
    rev = reg.create_revision(policy, digest, base="f" * 64, rank=2)
    assert rev.source.startswith("mint-store://")
    return policy, rev.version, Path(store.path(digest))


def test_the_server_serves_a_version_s_files(mlflow_server: str, revision: tuple[str, int, Path]) -> None:
    policy, version, where = revision
    for name in FILES:
        r = httpx.get(
            f"{mlflow_server}/model-versions/get-artifact",
            params={"name": policy, "version": str(version), "path": name},
            # MLflow asks who you are: the session server's service login (its fixture exports it)
            auth=(os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.content == (where / name).read_bytes()


def test_clients_download_a_version(
    mlflow_server: str, revision: tuple[str, int, Path], tmp_path: Path
) -> None:
    policy, version, where = revision
    uri = MlflowClient(mlflow_server).get_model_version_download_uri(policy, str(version))
    out = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "dl"))
    assert {p.name for p in Path(out).iterdir()} == FILES
    assert all((Path(out) / n).read_bytes() == (where / n).read_bytes() for n in FILES)


def test_a_store_revision_is_read_only(revision: tuple[str, int, Path], tmp_path: Path) -> None:
    _, _, where = revision
    repo = get_artifact_repository(f"mint-store://{where}")
    assert {f.path for f in repo.list_artifacts()} == FILES
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(MlflowException, match="immutable"):
        repo.log_artifact(str(tmp_path / "x.txt"))
    assert {f.path for f in repo.list_artifacts()} == FILES
