"""The front mint puts before a vLLM server: the same HTTP contract as the embedded server, on mint's terms.

vLLM runs the base and the adapters; it listens on loopback with a key only this front knows. Users and flows
reach the front, which adds what vLLM lacks (measured on vLLM 0.32, infra/vllm/README.md):

- **Validation before any revision reaches vLLM.** vLLM accepts NaN weights, wrong shapes, another base's
  adapter, and one NaN adapter poisons every tenant of the server until it restarts. Every load (the admin route,
  prefetch, and on-demand names through the resolver plugin) is read and checked here first with mint's own
  validator (`read_adapter`: safetensors only, header, finite, rank, shapes, modules, base fingerprint), then vLLM
  is handed the verified content-addressed copy in the store (`<store>/sha256/xx/<hex>`).
- **Auth that covers every route.** Only the contract's routes exist here (everything else vLLM serves, such as
  its unkeyed `POST /adapters`, `/invocations` and `/tokenize`, is unreachable); inference needs a serving key of
  the access file that may call the model (or the API key when one is set), load and unload the admin token, the
  resolver callback its own token (serving/admin.py `Auth`).
- **Revision identity.** vLLM lists an adapter's `root` (the path it was loaded from); the front loads only
  content-addressed paths, so the digest the front reports is read off vLLM's own state. `/v1/models` carries
  `revision`, and every completion's `system_fingerprint` names the revision that answered (as on mint serve).
- **A golden probe** (serving/golden.py): vLLM's greedy answers to a few fixed prompts, under the base and one
  champion, asked at a steady interval and after every load; a replica whose answers change is taken out of
  rotation (503), its evidence logged, and its process killed for its supervisor to restart
  (serving/replica_control.py).
- **A fleet** (serving/fleet.py, `vllm_replicas`): N replicas the front routes over itself, each request to one
  replica by rendezvous hashing on the served name so that one adapter stays on one replica; loads and unloads go
  to every replica, all or nothing; each answer names its replica (`X-Mint-Replica`) and the revision that replica
  served it with.
- **Atomic swaps.** vLLM overwrites an adapter's weights in place, so a request running during an in-place load
  can mix two revisions. The front holds a per-name read/write lock: requests under a name share it, a swap of
  that name waits for them to finish and holds new ones back until vLLM has the new revision. Every request is
  served wholly by one revision, and its `system_fingerprint` is exact. The cost is that a swap waits for the
  longest request in flight under that name.

This module assembles the front's app from its parts in serving/front/: the backend behind one protocol (one vLLM,
or a fleet: `front/backends.py`), the state its routes share, and the routes, one module each, with mint serve's
checks (serving/admin.py) and error answers (serving/http_errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import Scope

from mint_core.lora.validate import BaseSpec
from mint_core.serving.body_limit import BodyLimit
from mint_core.serving.canary import CanaryMiddleware, CanaryState
from mint_core.serving.config import ServingConfig
from mint_core.serving.front import completions, extensions, health, models
from mint_core.serving.front.models import champions_of
from mint_core.serving.front.state import BASE_ADAPTER, Gateway
from mint_core.serving.http_errors import install_error_handlers, is_completion
from mint_core.serving.keys import KeyCounter, key_requests
from mint_core.serving.protocol import APIError
from mint_core.serving.routes import canary, routing
from mint_core.serving.routing import RoutingMiddleware, RoutingState, policy_name
from mint_core.serving.server import PromptLimits

__all__ = ["BASE_ADAPTER", "create_gateway"]
logger = logging.getLogger(__name__)


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
        await gw.backend.close()

    def refused(path: str, model: object, status: int) -> None:
        if is_completion(path):  # each refusal once: the handlers or the body limit, never the route too
            gw.count(model, status)

    app = FastAPI(title="mint (vLLM backend)", lifespan=lifespan)
    app.state.gateway = gw
    install_error_handlers(app, refused)
    app.state.canary, app.state.auth, app.state.base_name = CanaryState(), gw.auth, base_name
    app.add_middleware(CanaryMiddleware, state=app.state.canary, served=lambda name: name != base_name)
    app.state.routing = RoutingState.start(config, gw.registry)
    app.state.canary.on_score.append(app.state.routing.scored)

    async def served(scope: Scope) -> dict[str, bool]:
        """Every policy a request could name: the catalog's champions (cold) and the names vLLM holds (resident)."""
        out = dict.fromkeys(await champions_of(Request(scope), gw).get(), False)
        out.update((n, True) for n in list(gw.served) if policy_name(n) and n != BASE_ADAPTER)
        return out

    app.add_middleware(  # outside the canary: the split and the key checks see the name the router chose
        RoutingMiddleware,
        state=app.state.routing,
        auth=gw.auth,
        base_name=base_name,
        served=served,
        refused=refused,
    )
    # a body over the limit is refused before anything reads it (so its model is unknown)
    app.add_middleware(
        BodyLimit, max_bytes=config.max_body_bytes, refused=lambda path: refused(path, None, 413)
    )
    app.add_middleware(
        KeyCounter, requests=key_requests(gw.registry)
    )  # outermost: every answer, by the key that asked
    for routes in (completions, models, health, extensions, canary, routing):
        app.include_router(routes.router)
    return app
