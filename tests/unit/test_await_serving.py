"""`Workspace.await_serving`: an evaluation waits for a serving endpoint that is still starting (the main job starts
vLLM beside its first wave's training), up to `serving_start_s`, and names the endpoint when it never answers."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from mint_core.lifecycle.workspace import ServingUnavailable, Workspace
from mint_testkit.harness import free_port
from tasks.common import is_transient


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _server_after(port: int, delay_s: float) -> Iterator[threading.Event]:
    """A server answering /health on `port` from `delay_s` on; the event is set once it listens."""
    listening = threading.Event()
    holder: list[http.server.HTTPServer] = []

    def serve() -> None:
        srv = http.server.HTTPServer(("127.0.0.1", port), _Health)
        holder.append(srv)
        listening.set()
        srv.serve_forever(poll_interval=0.05)

    timer = threading.Timer(delay_s, serve)
    timer.start()
    try:
        yield listening
    finally:
        timer.cancel()
        if listening.wait(timeout=10) and holder:
            holder[0].shutdown()
            holder[0].server_close()


def test_waits_for_a_server_that_starts_later() -> None:
    port = free_port()
    ws = Workspace(serving_url=f"http://127.0.0.1:{port}", serving_start_s=30)
    with _server_after(port, 1.5) as listening:
        assert not listening.is_set()  # nothing answers when the wait begins
        t0 = time.monotonic()
        ws.await_serving(poll_s=0.1)
        assert listening.is_set()
        assert time.monotonic() - t0 < 30


def test_a_server_that_never_answers_is_named_after_the_deadline() -> None:
    port = free_port()
    ws = Workspace(serving_url=f"http://127.0.0.1:{port}", serving_start_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ServingUnavailable, match=rf"127\.0\.0\.1:{port}/health within 1 s"):
        ws.await_serving(poll_s=0.1)
    assert time.monotonic() - t0 >= 1.0
    assert not is_transient(ServingUnavailable("x"))  # the wait was the retry: the task does not wait again


def test_no_wait_by_default() -> None:
    """Without `serving_start_s` nothing is asked: the task's own first call finds a server that is down."""
    ws = Workspace(serving_url=f"http://127.0.0.1:{free_port()}")
    assert ws.serving_start_s == 0
    t0 = time.monotonic()
    ws.await_serving()
    assert time.monotonic() - t0 < 0.5


def test_serving_start_s_is_checked() -> None:
    with pytest.raises(ValueError, match="serving_start_s"):
        Workspace(serving_start_s=-1)
