"""The largest request body a server reads (`ServingConfig.max_body_bytes`), refused with 413 before any JSON is
parsed: by its Content-Length when it states one, else as soon as that many bytes have arrived. Both backends
(the embedded server and the vLLM front) wrap their app in it."""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mint_core.serving.protocol import APIError

PREFIX = "/v1/"  # the contract's routes; Tinker's training API (/api/v1/...) carries its own, larger payloads


class BodyLimit:
    """ASGI middleware: a request under `/v1/` with a body over `max_bytes` gets OpenAI's error shape with 413,
    and the app never sees it; `refused(path)` is told (for the request counters). A body within the limit is
    read whole here and handed on unchanged (every route of the contract reads its body whole anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int, refused: Callable[[str], None] | None = None):
        self.app, self.max_bytes, self.refused = app, max_bytes, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        stated = dict(scope["headers"]).get(b"content-length", b"")
        if stated.isdigit() and int(stated) > self.max_bytes:
            await self._refuse(scope, send, f"request body of {int(stated)} bytes")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, send, "request body")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:  # after the body: what the server says next (a disconnect, for streams)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, what: str) -> None:
        """413 without reading the rest: uvicorn drops what is still coming and the client reads the answer."""
        if self.refused is not None:
            self.refused(scope["path"])
        error = APIError(
            413, f"{what} is over the limit of {self.max_bytes} bytes (max_body_bytes)", "BadRequestError"
        )
        payload = json.dumps(error.response().model_dump()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
