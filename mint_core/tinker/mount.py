"""Mount Tinker's training API on the embedded server's app: the same process, engine and base as `mint serve`.

The training API sits above serving: it builds serving's app and adds its routes, so serving never imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mint_core.engine.base import Base
from mint_core.serving import app as serving_app
from mint_core.serving.config import ServingConfig
from mint_core.serving.server import Server
from mint_core.tinker import routes
from mint_core.tinker.records import Checkpoint, TinkerError, TrainModel, read_keys
from mint_core.tinker.service import TinkerService

logger = logging.getLogger(__name__)


def state_dir(config: ServingConfig) -> Path:
    return config.tinker_state_dir or Path(config.adapter_root).resolve().parent / "tinker"


class Registrar:
    """The registry side of TinkerService: `register(model, checkpoint, name)` makes a saved sampler revision the
    next MLflow version of the model's policy (alias candidate, `mint.parent`, the session as `tinker.session`; a
    policy it creates is tagged `mint.kind=tinker`), `unregister(checkpoint)` deletes that version and its catalog
    rows again. MLflow is imported when the first revision is registered."""

    def __init__(self, config: ServingConfig, server: Server):
        self.config = config
        self.server = server
        self._registry: Any = None

    @property
    def registry(self) -> Any:
        if self._registry is None:
            from mint_core.registry.catalog import Catalog, CatalogConfig
            from mint_core.registry.mlflow_registry import Registry, RegistryConfig

            config, server = self.config, self.server
            url = (
                config.tinker_catalog_url
                or config.catalog_url
                or f"sqlite:///{state_dir(config) / 'catalog.db'}"
            )
            catalog = (
                server.catalog
                if server.catalog is not None and url == config.catalog_url
                else Catalog(CatalogConfig(url=url))
            )
            assert config.tinker_registry_uri is not None
            self._registry = Registry(
                server.store, catalog, RegistryConfig(tracking_uri=config.tinker_registry_uri)
            )
        return self._registry

    def register(self, m: TrainModel, ck: Checkpoint, name: str) -> str:
        from mint_core.registry.mlflow_registry import TINKER_KIND

        rev = self.registry.create_revision(
            m.policy,
            ck.digest,
            base=self.server.engine.base.fingerprint,
            rank=m.rank,
            parent=m.parent,
            tags={"tinker.session": m.session_id, "tinker.model_id": m.id, "tinker.path": ck.path},
            reason=f"tinker save_weights_for_sampler {name!r}",
            kind=TINKER_KIND,
        )
        # the version's address serves it too, as the rest of mint names revisions
        self.server.engine.load_adapter(rev.address, self.server.store.local_dir(ck.digest), replace=True)
        return str(rev.address)

    def unregister(self, ck: Checkpoint) -> str | None:
        """Delete the checkpoint's version; None when deleted (or already gone), else why it stays. The candidate
        alias follows every save, so only the other aliases protect a version's ancestors here."""
        from mint_core.registry.mlflow_registry import CANDIDATE

        assert ck.address is not None
        policy, _, version = ck.address.partition("/v")
        plan = self.registry.delete_versions(
            policy,
            [int(version)],
            f"tinker checkpoint {ck.path} deleted",
            lineage_of=lambda alias: alias != CANDIDATE,
        )
        return plan.keep.get(int(version))


def registrar(config: ServingConfig, server: Server) -> Registrar | None:
    """The Registrar for TinkerService; None without a registry (`tinker_registry_uri` unset)."""
    return Registrar(config, server) if config.tinker_registry_uri else None


def build_app(config: ServingConfig, base: Base | None = None) -> FastAPI:
    """Serving's app for `config`, with the Tinker API mounted when it is on (`tinker`) and the engine runs in
    this process (the front of a vLLM server trains nothing)."""
    app = serving_app.build_app(config, base)
    if config.tinker and config.backend == "mint":
        mount(app, app.state.server, config)
    return app


def mount(app: FastAPI, server: Server, config: ServingConfig) -> TinkerService:
    keys = read_keys(config.tinker_keys().get_secret_value(), config.tinker_api_keys_file)
    if not keys:
        raise ValueError(
            "the Tinker API is on but no API key is configured (tinker_api_keys / tinker_api_keys_file)"
        )
    reg = registrar(config, server)
    svc = TinkerService(
        server.engine,
        server.store,
        server.base_name,
        state_dir(config),
        keys,
        window_ms=config.tinker_window_ms,
        lora_alpha=config.tinker_lora_alpha,
        register=reg.register if reg else None,
        unregister=reg.unregister if reg else None,
        keep_sampler_saves=config.tinker_keep_sampler_saves,
        keep_snapshots=config.tinker_keep_snapshots,
        result_ttl_s=config.tinker_result_ttl_s,
    )
    server.metrics.registry.register(TinkerCollector(svc))
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietPolls) for f in access.filters):
        access.addFilter(QuietPolls())
    app.state.tinker = svc
    app.state.on_close.append(svc.close)
    app.state.tinker_tasks = set()
    app.add_exception_handler(TinkerError, _tinker_error)  # type: ignore[arg-type]
    app.include_router(routes.router)
    return svc


GAUGES = {
    "sessions": "Tinker sessions held (live, and finished ones until tinker_result_ttl_s after they ended)",
    "training_models": "Tinker training models open (each pins an adapter slot)",
    "sampling_sessions": "Tinker sampling sessions held",
    "snapshots": "Unnamed Tinker snapshots live (at most tinker_keep_snapshots per training run)",
    "futures": "Tinker call results held for retrieve_future",
}
"""Help of each `mint_tinker_*` gauge."""


class TinkerCollector(Collector):
    """`mint_tinker_<what>` gauges on /metrics: what the Tinker API holds in memory now (`TinkerService.counts`),
    each bounded by the retention settings (a server that runs for months watches these stay flat)."""

    def __init__(self, svc: TinkerService):
        self.svc = svc

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for what, value in self.svc.counts().items():
            yield GaugeMetricFamily(f"mint_tinker_{what}", GAUGES[what], value=value)


class QuietPolls(logging.Filter):
    """Leaves the SDK's answered retrieve_future polls out of uvicorn's access log: a training step makes two (one
    per queued call), and writing their lines cost the event loop about as much as answering them."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and args[2] == "/api/v1/retrieve_future":
            return not isinstance(args[4], int) or args[4] >= 400
        return True


async def _tinker_error(request: Request, e: TinkerError) -> JSONResponse:
    return routes.error(e)
