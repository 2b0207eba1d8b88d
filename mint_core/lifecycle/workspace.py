"""Where the lifecycle reads and writes (`Workspace`): the registry, the adapter store and catalog, the serving
endpoint, the base and this host's own state."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.leases import LOCK_URL_ENV, Leases, leases_for
from mint_core.registry.mlflow_registry import Registry, RegistryConfig
from mint_core.registry.store import AdapterStore
from mint_core.serving.client import ServingClient
from mint_core.types import Device

WORK_DIR_ENV = "MINT_WORK_DIR"
"""The `work_dir` of the flow runs a worker starts (its own working directory, per host)."""


class ServingUnavailable(RuntimeError):
    """The serving endpoint did not answer its health check within `serving_start_s` (`Workspace.await_serving`).
    Not a transient error: the wait was the retry."""


class Workspace(BaseModel):
    """Where the lifecycle reads and writes: the registry, the adapter store and catalog, the serving endpoint,
    the base, and local state (checkpoints, cached task results). No secrets: the admin token of the serving
    endpoint comes from MINT_SERVE_ADMIN_TOKEN or `admin_token_file`."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str = Field(
        default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    )
    """The MLflow tracking server and registry (default $MLFLOW_TRACKING_URI)."""
    store: str = ".mint/store"
    """Adapter store root (a directory or an fsspec URL); the serving endpoint must read the same store."""
    catalog_url: str = "sqlite:///.mint/catalog.db"
    """SQLAlchemy URL of the catalog index."""
    base: Path = Field(default_factory=lambda: _default_base())
    """The base model directory (with its tokenizer) that the served base was loaded from. Default: what
    `mint up` serves, data/base when `dvc repro` has built it, else .mint/run/tiny-dense."""
    serving_url: str = "http://127.0.0.1:8000"
    """Root of the serving endpoint (`mint serve` or vLLM)."""
    admin_token_file: Path | None = Path(".mint/run/serve.token")
    """File holding the admin token of the serving endpoint (what `mint up` writes); MINT_SERVE_ADMIN_TOKEN wins."""
    serving_start_s: float = Field(0.0, ge=0)
    """How long a task that scores on the served API (an evaluation) waits for it to answer its health check
    before its first call, for a server still starting: the main job starts vLLM while its first wave trains, and
    the bare base's evaluation beside training waits for it. 0: no wait, a server that is down fails the task at
    once."""
    serving_path: Literal["digest", "path"] = "digest"
    """How a revision is named to the server: "digest" (`sha256:<hex>`, resolved in the server's own store, as
    `mint serve` does) or "path" (the store's local directory of the revision, for a vLLM sharing the disk)."""
    work_dir: Path = Field(default_factory=lambda: Path(os.environ.get(WORK_DIR_ENV) or ".mint/lifecycle"))
    """Training checkpoints (a killed run resumes from them) and Prefect's persisted task results (the cache of
    exports and evaluations): this host's own. Default $MINT_WORK_DIR (what a worker sets for the runs it starts,
    `mint worker --workdir`), else .mint/lifecycle."""
    checkpoint_url: str | None = None
    """Where training checkpoints are also kept for the other hosts: a directory or fsspec URL every worker
    reaches (`mint worker` sets `<store>/checkpoints` when the store is shared). A run that another host resumes
    (its first host died) starts from the newest checkpoint there. None: only in `work_dir`, so a run resumes from
    its checkpoints only on the host that wrote them."""
    run_lease_s: float = Field(60.0, gt=0)
    """A training flow run holds the lease `run/<flow run id>` in the catalog while it runs, renewed every third
    of this; a worker that starts again requeues the runs whose lease it held, or whose lease a dead host let
    expire (`mint_app.services.deployments.reclaim_runs`), and the resumed run waits out such a lease first."""
    device: Device = "cpu"
    """Where training loads the base and runs its updates: cpu, cuda or cuda:N."""
    lock_url: str | None = Field(
        default_factory=lambda: os.environ.get(LOCK_URL_ENV) or None, pattern=r"^rediss?://"
    )
    """Where leases live, the locks of registry writes and promotions (`mint_core.registry.leases`): None = the
    catalog (`catalog_url`); `redis://host:port/db` (or `rediss://`) = Redis. Default $MINT_LOCK_URL."""
    lock_hold_s: float = Field(300.0, gt=0)
    """Longest a promotion may hold its policy's lock; a holder that died frees it after this long."""

    @model_validator(mode="before")
    @classmethod
    def _redis_url_is_gone(cls, data: Any) -> Any:
        if isinstance(data, dict) and "redis_url" in data:
            raise ValueError(
                "workspace.redis_url is gone: locks are leases in the catalog unless `lock_url` names a Redis "
                "(lock_url: redis://host:port/db); rename the setting, or drop it to keep them in the catalog"
            )
        return data

    def registry(self) -> Registry:
        """The registry (MLflow + catalog + store) of this workspace; one per process and workspace."""
        key = self.model_dump_json()
        reg = _REGISTRIES.get(key)
        if reg is None:
            store = AdapterStore(self.store)
            catalog = Catalog(CatalogConfig(url=self.catalog_url))
            reg = Registry(
                store,
                catalog,
                RegistryConfig(tracking_uri=self.tracking_uri),
                leases_for(self.lock_url, catalog),
            )
            _REGISTRIES[key] = reg
        return reg

    def leases(self) -> Leases:
        """Where this workspace's locks live (`lock_url`): the registry's and the promotions' alike."""
        return self.registry().leases

    def admin_token(self) -> str | None:
        token = os.environ.get("MINT_SERVE_ADMIN_TOKEN")
        if token:
            return token
        if self.admin_token_file is not None and self.admin_token_file.is_file():
            return self.admin_token_file.read_text().strip() or None
        return None

    def client(self, timeout: float = 120.0) -> ServingClient:
        return ServingClient(
            self.serving_url,
            api_key=os.environ.get("MINT_SERVE_API_KEY"),
            admin_token=self.admin_token(),
            timeout=timeout,
        )

    def await_serving(self, poll_s: float = 1.0) -> None:
        """Return once the serving endpoint answers its health check, asking every `poll_s` for at most
        `serving_start_s`; raise ServingUnavailable naming the endpoint when it has not by then. With
        `serving_start_s` 0, return at once: the task's own first call finds a server that is down."""
        if not self.serving_start_s:
            return
        deadline = time.monotonic() + self.serving_start_s
        with ServingClient(self.serving_url, timeout=10.0) as client:
            while not client.health():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServingUnavailable(
                        f"the serving endpoint {self.serving_url} did not answer {self.serving_url}/health "
                        f"within {self.serving_start_s:.0f} s (is it running? `mint status`)"
                    )
                time.sleep(min(poll_s, left))

    def lora_path(self, digest: str) -> str:
        """How the serving endpoint is told where revision `digest` is."""
        if self.serving_path == "digest":
            return f"sha256:{digest}"
        return str(self.registry().store.local_dir(digest))


_REGISTRIES: dict[str, Registry] = {}


def _default_base() -> Path:
    builtin = Path("data/base")
    return builtin if (builtin / "config.json").is_file() else Path(".mint/run/tiny-dense")
