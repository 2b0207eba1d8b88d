"""`mint status`'s replica table reads mint serve's `GET /v1/mint/replicas`: a replica the golden probe took out of
rotation says so, and why, beside the healthy one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from mint_app.cli import services as services_cli
from mint_app.services.config import ServicesConfig

REPORT = {
    "routing": "consistent_hash on the served name",
    "replicas": [
        {
            "replica": "127.0.0.1:8100",
            "url": "http://127.0.0.1:8100",
            "healthy": True,
            "running": 1.0,
            "waiting": 0.0,
            "revisions": {"add": "sha256:227a18a6d575aa"},
            "requests": 30,
            "share": 0.75,
            "out_of_rotation": None,
        },
        {
            "replica": "127.0.0.1:8101",
            "url": "http://127.0.0.1:8101",
            "healthy": True,
            "running": 0.0,
            "waiting": 0.0,
            "revisions": {},
            "requests": 10,
            "share": 0.25,
            "out_of_rotation": "golden answers changed (base: '!!!!')",
        },
    ],
}


@pytest.fixture
def front() -> Iterator[str]:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps(REPORT).encode()
            self.send_response(200 if self.path == "/v1/mint/replicas" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    assert seen == ["Bearer tok"]  # the admin token from the state dir


def test_a_replica_out_of_rotation_says_why(
    front: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "serve.token").write_text("tok\n")
    out = Console(record=True, width=200)
    monkeypatch.setattr(services_cli, "console", out)
    services_cli.print_replicas(ServicesConfig(state_dir=tmp_path), front)
    text = out.export_text()
    row0 = next(line for line in text.splitlines() if "127.0.0.1:8100" in line)
    row1 = next(line for line in text.splitlines() if "127.0.0.1:8101" in line)
    assert "healthy" in row0 and "add 227a18a6d575" in row0 and "30 (75%)" in row0
    assert "out of rotation: golden answers changed" in row1 and "healthy" not in row1
