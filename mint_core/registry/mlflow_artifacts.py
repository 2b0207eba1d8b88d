"""MLflow reads a revision in a local adapter store: an artifact repository for `mint-store://<dir>` sources.

MLflow refuses a bare local path as a model version's source, so a local-store revision is registered as
`mint-store:///abs/dir` (see `reader.source_uri`). Without a repository for that scheme, MLflow's server fails
every version page with "Could not find a registered artifact repository". This one, registered through MLflow's
`mlflow.artifact_repository` entry point (pyproject.toml), serves the directory read-only: the MLflow UI, `mlflow
artifacts download` and `MlflowClient` see the adapter's files (`adapter_config.json`, `adapter_model.safetensors`).

A store is content-addressed and a revision immutable, so writing through MLflow is refused.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from mlflow.exceptions import MlflowException
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

from mint_core.registry.reader import LOCAL_SCHEME

SCHEME = LOCAL_SCHEME.removesuffix("://")


class StoreArtifactRepository(LocalArtifactRepository):
    """A local-store revision's directory, as MLflow's artifact repository (read-only)."""

    def __init__(self, artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None):
        # MLflow rewrites `mint-store:///dir` as `mint-store:/dir` on the way (an empty authority is dropped)
        parts = urlsplit(artifact_uri)
        if parts.scheme != SCHEME or parts.netloc or not parts.path.startswith("/"):
            raise MlflowException(
                f"not a mint store URI (want {LOCAL_SCHEME}/<absolute dir>): {artifact_uri}"
            )
        super().__init__("file://" + parts.path, tracking_uri, registry_uri)

    def _read_only(self, *_: Any, **__: Any) -> None:
        raise MlflowException(
            f"{self.artifact_uri}: a mint store revision is immutable; MLflow may only read it"
        )

    log_artifact = _read_only
    log_artifacts = _read_only
    delete_artifacts = _read_only
