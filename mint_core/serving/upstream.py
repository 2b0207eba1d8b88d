"""The front's HTTP client of vLLM: httpx's interface over aiohttp's connection pool.

Every request the front relays goes through one of these, so its cost per request is the front's cost. Profiled
with py-spy under 16 concurrent streams, httpx's own pool (httpcore) was the largest part of the front's CPU: for
each request it walks every pooled connection and polls each socket for readability (`has_expired`), in Python;
and httpx's layers above it (URL merging, request building, auth, redirects, hooks, response streaming) were a
third as much again. aiohttp keeps idle connections in a queue per host and parses answers in C.

The code beside the front (the golden probe, the fleet, tests) keeps httpx's types: `client()` is an
`httpx.AsyncClient`, its answers `httpx.Response`, its failures `httpx.HTTPError` subclasses. Under it:
- `AiohttpTransport`, httpx's transport seam over an aiohttp session: every request httpx builds (streams too);
- `Client.request` sends a plain request (a path; a JSON body or bytes; headers; a timeout: what the front relays)
  on that session directly, past httpx's layers, and answers an `httpx.Response` read whole.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
from httpx._client import USE_CLIENT_DEFAULT

CHUNK = 64 * 1024
_PLAIN = frozenset({"content", "json", "headers", "timeout"})
"""What `Client.request` sends directly; any other argument goes through httpx's layers."""


def client(url: str, key: str, keepalive_s: float = 2.0, connections: int = 100) -> Client:
    """An httpx client of the server at `url` that sends `key` as its bearer token, over `AiohttpTransport`.

    vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request sent on one as vLLM closes it
    fails ("Server disconnected", a 503 here), so idle connections are dropped well before (`keepalive_s`)."""
    return Client(
        base_url=url.rstrip("/"),
        headers={"Authorization": f"Bearer {key}"},
        timeout=httpx.Timeout(600.0, connect=5.0),
        transport=AiohttpTransport(keepalive_s, connections),
        trust_env=False,  # loopback: no proxy from the environment in between
    )


class Client(httpx.AsyncClient):
    """httpx's client, whose plain requests go straight to its aiohttp session (module docstring)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._named_requests: dict[tuple[str, str], httpx.Request] = {}

    async def request(self, method: str, url: httpx.URL | str, **kw: Any) -> httpx.Response:  # type: ignore[override]
        transport = self._transport
        body = kw.get("content")
        plain = (
            isinstance(transport, AiohttpTransport)
            and isinstance(url, str)
            and url.startswith("/")
            and _PLAIN.issuperset(kw)
            and isinstance(body, bytes | str | None)
        )
        if not plain:
            return await super().request(method, url, **kw)
        assert isinstance(transport, AiohttpTransport) and isinstance(url, str)
        headers = self.headers.copy()
        if kw.get("json") is not None:  # encoded as httpx encodes it (httpx._content.encode_json)
            text = jsonlib.dumps(kw["json"], ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            body = text.encode()
            headers["Content-Type"] = "application/json"
        elif isinstance(body, str):
            body = body.encode()
        if kw.get("headers"):
            headers.update(kw["headers"])
        timeout = kw.get("timeout", USE_CLIENT_DEFAULT)
        t = self.timeout if timeout is USE_CLIENT_DEFAULT else httpx.Timeout(timeout)
        return await transport.whole(
            self._named(method, str(self.base_url).rstrip("/") + url), headers, body, t
        )

    def _named(self, method: str, url: str) -> httpx.Request:
        """The request an answer to `method url` names (`Response.request`, errors): made once per route."""
        key = (method, url)
        if key not in self._named_requests:
            self._named_requests[key] = httpx.Request(method, url)
        return self._named_requests[key]


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's transport seam over an aiohttp session, made on first use (aiohttp binds it to the running event
    loop, which does not run yet when the front is built) and made again on a later loop (tests run one each)."""

    def __init__(self, keepalive_s: float, connections: int):
        self.keepalive_s, self.connections = keepalive_s, connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _session_now(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        s = self._session
        if s is None or s.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(
                limit=self.connections, keepalive_timeout=self.keepalive_s, use_dns_cache=False
            )
            # httpx decodes the content itself (its Response), and states the headers it means to send (aiohttp
            # would add a content type to a body without one)
            s = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("Content-Type",)
            )
            self._session, self._loop = s, loop
        return s

    async def _send(
        self, request: httpx.Request, headers: httpx.Headers, body: bytes | None, timeout: httpx.Timeout
    ) -> aiohttp.ClientResponse:
        try:
            return await self._session_now().request(
                request.method,
                str(request.url),
                data=body or None,
                headers=headers.multi_items(),
                allow_redirects=False,  # httpx follows redirects itself when asked
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=timeout.connect, sock_read=timeout.read
                ),
            )
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _httpx_error(e, request) from e

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout", {})
        timeout = httpx.Timeout(None, connect=t.get("connect"), read=t.get("read"))
        r = await self._send(request, request.headers, await request.aread(), timeout)
        return _response(r, request, stream=_Body(r, request))

    async def whole(
        self, request: httpx.Request, headers: httpx.Headers, body: bytes | None, timeout: httpx.Timeout
    ) -> httpx.Response:
        """`request` (its method and URL) sent with `headers` and `body`, its answer read whole."""
        r = await self._send(request, headers, body, timeout)
        try:
            content = await r.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _httpx_error(e, request) from e
        finally:
            r.release()
        return _response(r, request, content=content)

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _response(r: aiohttp.ClientResponse, request: httpx.Request, **body: Any) -> httpx.Response:
    return httpx.Response(
        r.status,
        headers=r.raw_headers,
        request=request,
        extensions={"http_version": b"HTTP/1.1", "reason_phrase": (r.reason or "").encode()},
        **body,
    )


class _Body(httpx.AsyncByteStream):
    """An aiohttp answer's body as httpx reads one: in chunks as they arrive, released when closed."""

    def __init__(self, r: aiohttp.ClientResponse, request: httpx.Request):
        self.r, self.request = r, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.r.content.iter_chunked(CHUNK):
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _httpx_error(e, self.request) from e

    async def aclose(self) -> None:
        self.r.release()


def _httpx_error(e: BaseException, request: httpx.Request) -> httpx.TransportError:
    """aiohttp's error as the httpx error a caller of httpx catches (every one an `httpx.HTTPError`)."""
    kind: Any = httpx.TransportError
    if isinstance(e, aiohttp.ClientConnectorError):  # the request never reached the server (fleet.py retries)
        kind = httpx.ConnectError
    elif isinstance(e, aiohttp.ConnectionTimeoutError):
        kind = httpx.ConnectTimeout
    elif isinstance(e, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        kind = httpx.ReadTimeout
    elif isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        kind = httpx.RemoteProtocolError
    elif isinstance(e, aiohttp.ClientOSError):
        kind = httpx.ReadError
    return kind(str(e) or type(e).__name__, request=request)  # type: ignore[no-any-return]
