"""mint's seal on a vLLM it starts: every request without mint's key is refused, on every route.

vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and /cohere
(`vllm/entrypoints/serve/middleware/authenticate.py`, 0.32). Everything else answers anyone who reaches the port:
the SageMaker adapter routes (`POST /adapters` registers an adapter from any path on the host, and one NaN adapter
poisons every tenant of the server until it restarts), `/invocations`, `/tokenize`, `/metrics`, `/docs`. Loopback
keeps out other hosts, not other users or containers on the same host. mint starts vLLM with
`--middleware mint_vllm_seal.Seal`: vLLM's own seam for outside middleware, added last and so the outermost of
vLLM's middlewares. It asks every HTTP request and websocket, on every path and method (OPTIONS, /health and
/metrics included), for `Authorization: Bearer <key>`, the key mint gave vLLM in VLLM_API_KEY; anything else is
answered 401 before vLLM's app sees it.

Why a key rather than a Unix socket (`--uds` in a 0700 directory): mint's replica fleet puts `vllm-router` before
the replicas, and the router reaches its workers over TCP only (`http://host:port` worker URLs, requests built with
reqwest as `format!("{}{}", worker_url, route)`, vllm-project/router `src/routers/http/router.rs`); a socket would
keep the router out as well. A key works over any transport, on one host or many, and passes the router: it copies
the incoming request's headers onto the request to the worker, so the key mint's front sends reaches the replica.
The router health-checks a worker with a bare `GET <url>/health` (no header, `src/core/worker.rs`), so a fleet
behind it starts its replicas with MINT_SEAL_OPEN_HEALTH=1, which lets exactly `GET`/`HEAD /health` through unkeyed
(it changes nothing and tells nothing beyond "up"); mint's single vLLM keeps /health sealed too. Checked with
vllm-router 0.1.17 before one sealed replica: fully sealed, the router never sees it healthy and exits; with
MINT_SEAL_OPEN_HEALTH=1, a completion through the router with mint's key is 200, without it 401, and
`POST /adapters` through the router 401. A socket in a
private directory would add little on top of the key: it keeps out other users, as the key does, not mint's own.

A replica of a fleet is started with MINT_REPLICA=<host:port>: every answer it gives (the refusals too) carries it
in an `x-mint-replica` header, which the router passes back, so mint's front can name the replica that answered.

A replica also takes a second, narrower key (MINT_SEAL_ROUTED_KEY): the one the front's requests carry through the
router. It opens inference only (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`), never an
adapter route. The router's own routes take no key (`/add_worker` included), so a local process could add a worker
of its own and receive the front's requests with their key; with the routed key that costs inference, not the
poisoning of every tenant. Loads go from the front to each replica directly, with the full key (MINT_SEAL_KEY,
which then replaces VLLM_API_KEY: vLLM's own check of /v1 knows one key, and would refuse the routed one).

The standard library only: it runs inside vLLM's environment, and mint's tests run it in mint's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger(__name__)
KEY_ENV = "VLLM_API_KEY"
SEAL_KEY_ENV = "MINT_SEAL_KEY"
ROUTED_KEY_ENV = "MINT_SEAL_ROUTED_KEY"
ROUTED_ROUTES = frozenset(
    {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")}
)
OPEN_HEALTH_ENV = "MINT_SEAL_OPEN_HEALTH"
REPLICA_ENV = "MINT_REPLICA"
REPLICA_HEADER = b"x-mint-replica"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Seal:
    """Pure ASGI middleware: 401 for any http or websocket request that lacks mint's bearer key."""

    def __init__(
        self,
        app: ASGIApp,
        key: str | None = None,
        open_health: bool | None = None,
        routed_key: str | None = None,
    ) -> None:
        if key is None:
            key = os.environ.get(SEAL_KEY_ENV) or os.environ.get(KEY_ENV, "")
        if not key:
            # fail closed, and loudly: vLLM does not start rather than start unsealed
            raise RuntimeError(f"mint_vllm_seal: {KEY_ENV} is not set; refusing to serve vLLM unsealed")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()
        routed_key = os.environ.get(ROUTED_KEY_ENV, "") if routed_key is None else routed_key
        self._routed = hashlib.sha256(routed_key.encode()).digest() if routed_key else None
        if open_health is None:
            open_health = os.environ.get(OPEN_HEALTH_ENV, "") == "1"
        self.open_health = open_health
        replica = os.environ.get(REPLICA_ENV, "")
        self.replica = replica.encode("latin-1") if replica else None
        logger.info("mint seal: every route needs the key%s", " (GET /health open)" if open_health else "")

    def allowed(self, scope: Scope) -> bool:
        probe = (
            scope["type"] == "http"
            and scope.get("method") in ("GET", "HEAD")
            and scope.get("path") == "/health"
        )
        if self.open_health and probe:
            return True
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                # hashed first: compare_digest then compares equal lengths, so timing tells nothing
                got = hashlib.sha256(token.encode()).digest()
                if secrets.compare_digest(got, self._digest):
                    return True
                return (
                    self._routed is not None
                    and secrets.compare_digest(got, self._routed)
                    and (scope.get("method"), scope.get("path")) in ROUTED_ROUTES
                )
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.replica is not None and scope["type"] == "http":
            send = self._named(send)
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)  # lifespan, or a request with the key
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation, before accept
            return
        body = json.dumps(
            {
                "error": {
                    "message": "Unauthorized: mint's key is required",
                    "type": "Unauthorized",
                    "code": 401,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _named(self, send: Send) -> Send:
        """`send` with this replica's name added to the response's headers."""
        replica = self.replica

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, replica)]}
            await send(message)

        return named
