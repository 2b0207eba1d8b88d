"""The front's client of vLLM (serving/upstream.py): httpx's interface over aiohttp's pool, against a real HTTP
server on loopback. What the front and the fleet rely on: a plain request carries the key, the body as httpx
encodes it and its own headers; any status comes back as it was sent; a stream arrives event by event; a server
that refuses the connection is an `httpx.ConnectError` (the fleet tries the next replica), one that drops it after
the request is another `httpx.TransportError` (the request may have run); and the client outlives an event loop."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from aiohttp import web

from mint_core.serving.upstream import client

KEY = "upstream-key"


@asynccontextmanager
async def server(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """An aiohttp server on a free loopback port answering every route with `handler`; its URL."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def echo(request: web.Request) -> web.Response:
    """The request as the server saw it, with the status `?status=` asks for."""
    seen = {
        "method": request.method,
        "path": request.path,
        "query": dict(request.query),
        "headers": {k.lower(): v for k, v in request.headers.items()},
        "body": (await request.read()).decode(),
    }
    return web.json_response(seen, status=int(request.query.get("status", 200)))


def test_a_plain_request_carries_the_key_the_body_and_its_own_headers() -> None:
    body = {"model": "a0", "prompt": "é\u2028", "max_tokens": 4}

    async def go() -> tuple[httpx.Response, dict[str, Any]]:
        async with server(echo) as url:
            http = client(url, KEY)
            r = await http.request("POST", "/v1/completions", json=body, headers={"X-Mint-Route": "a0"})
            await http.aclose()
            return r, r.json()

    r, seen = asyncio.run(go())
    assert isinstance(r, httpx.Response) and r.status_code == 200
    assert seen["method"] == "POST" and seen["path"] == "/v1/completions"
    assert seen["headers"]["authorization"] == f"Bearer {KEY}"
    assert seen["headers"]["content-type"] == "application/json"
    assert seen["headers"]["x-mint-route"] == "a0"
    assert seen["body"] == httpx.Request("POST", "/", json=body).content.decode()  # as httpx encodes it
    assert r.headers["content-type"].startswith("application/json")
    assert str(r.request.url).endswith("/v1/completions")


def test_any_status_and_any_request_httpx_builds_come_back_as_sent() -> None:
    async def go() -> list[httpx.Response]:
        async with server(echo) as url:
            http = client(url, KEY)
            out = [
                await http.get("/v1/models", params={"status": 404}),  # not plain: through httpx's own layers
                await http.post("/v1/unload_lora_adapter", content=b"raw", timeout=5),
                await http.request("GET", "/health"),
            ]
            await http.aclose()
            return out

    missing, raw, health = asyncio.run(go())
    assert missing.status_code == 404 and missing.json()["query"] == {"status": "404"}
    assert missing.json()["headers"]["authorization"] == f"Bearer {KEY}"
    assert raw.status_code == 200 and raw.json()["body"] == "raw"
    assert "content-type" not in raw.json()["headers"]  # none stated, none added
    assert health.json()["method"] == "GET" and health.json()["body"] == ""


def test_a_stream_arrives_event_by_event() -> None:
    """The second event is sent only once the client has read the first: nothing waits for the whole body."""

    async def go() -> list[str]:
        first_read = asyncio.Event()

        async def events(request: web.Request) -> web.StreamResponse:
            r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await r.prepare(request)
            await r.write(b"data: 1\n\n")
            await asyncio.wait_for(first_read.wait(), 10)
            await r.write(b"data: 2\n\ndata: [DONE]\n\n")
            return r

        async with server(events) as url:
            http = client(url, KEY)
            r = await http.send(http.build_request("POST", "/v1/completions", json={}), stream=True)
            lines = []
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                    first_read.set()
            await r.aclose()
            await http.aclose()
            return lines

    assert asyncio.run(go()) == ["data: 1", "data: 2", "data: [DONE]"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_connection_is_a_connect_error(stream: bool) -> None:
    async def go() -> None:
        http = client(f"http://127.0.0.1:{closed_port()}", KEY)
        try:
            if stream:
                await http.send(http.build_request("POST", "/v1/completions", json={}), stream=True)
            else:
                await http.post("/v1/completions", json={})
        finally:
            await http.aclose()

    with pytest.raises(httpx.ConnectError) as e:
        asyncio.run(go())
    assert str(e.value.request.url).endswith("/v1/completions")


def test_a_connection_dropped_after_the_request_is_a_transport_error_not_a_connect_error() -> None:
    async def go() -> None:
        got = asyncio.Event()

        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            got.set()
            writer.close()

        srv = await asyncio.start_server(drop, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        http = client(f"http://127.0.0.1:{port}", KEY)
        try:
            await http.post("/v1/completions", json={})
        finally:
            await http.aclose()
            srv.close()
            assert got.is_set()

    with pytest.raises(httpx.TransportError) as e:
        asyncio.run(go())
    assert not isinstance(e.value, httpx.ConnectError)


def test_one_client_serves_one_event_loop_after_another() -> None:
    """The front makes its client before its event loop runs; tests run a loop each."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        http = client(f"http://127.0.0.1:{srv.server_address[1]}", KEY)  # outside any loop
        answers = [asyncio.run(http.get("/health")).text for _ in range(2)]
        asyncio.run(http.aclose())
    finally:
        srv.shutdown()
    assert answers == ["ok", "ok"]
