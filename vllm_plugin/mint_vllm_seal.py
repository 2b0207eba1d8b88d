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

Why a key rather than a Unix socket (`--uds` in a 0700 directory): a key works over any transport, on one host or
many, and the supervisor, the golden probe and the fault suite find a replica by its TCP port. A socket in a
private directory would add one thing on top of the key: while a replica is down, no other process could take its
address (docs/serving.md, "A fleet of replicas", names that window).

A replica of a fleet is started with MINT_REPLICA=<host:port>: every answer it gives (the refusals too) carries it
in an `x-mint-replica` header, so mint's front can name the replica that answered.

A replica also takes a second, narrower key (MINT_SEAL_ROUTED_KEY): the one the requests mint's front routes to it
carry. It opens inference only (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`), never an
adapter route: a process that took a dead replica's port would receive requests with a key that cannot load an
adapter anywhere. Loads go from the front to each replica with the full key (MINT_SEAL_KEY, which then replaces
VLLM_API_KEY: vLLM's own check of /v1 knows one key, and would refuse the routed one).

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
        replica = os.environ.get(REPLICA_ENV, "")
        self.replica = replica.encode("latin-1") if replica else None
        logger.info("mint seal: every route needs the key")

    def allowed(self, scope: Scope) -> bool:
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
