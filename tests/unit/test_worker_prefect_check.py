"""The worker's start asks whether the Prefect server answers before it registers the deployments: a busy server
(slow to answer, as beside two vLLM replicas starting on two cores) is running; no server at all is not. The
registration itself runs niced."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mint_app.services import deployments
from mint_app.services.config import ServicesConfig
from mint_app.services.deployments import BACKGROUND_NICE, _prefect_answers
from mint_app.services.processes import port_free


@pytest.fixture
def slow_prefect() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(3.0)  # past the 2 s a single check used to wait
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_a_busy_prefect_server_is_running(slow_prefect: int, tmp_path: Path) -> None:
    config = ServicesConfig(state_dir=tmp_path, prefect_port=slow_prefect)
    assert _prefect_answers(config, within_s=5.0)


def test_no_prefect_server_is_not_running(tmp_path: Path) -> None:
    port = next(p for p in range(47301, 47400) if port_free("127.0.0.1", p))
    t0 = time.monotonic()
    assert not _prefect_answers(ServicesConfig(state_dir=tmp_path, prefect_port=port), within_s=1.0)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize(("background", "raised"), [(True, BACKGROUND_NICE), (False, 0)])
def test_the_registration_runs_at_a_lower_priority(
    background: bool, raised: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefect deploy` beside the main job's waves is background work: its process is niced; other Prefect
    commands run at this process's own priority."""
    prefect = tmp_path / "prefect"
    prefect.write_text(f"#!{sys.executable}\nimport os\nprint(os.nice(0))\n")
    prefect.chmod(0o755)
    monkeypatch.setattr(deployments, "console_script", lambda name: str(prefect))
    done = deployments._prefect_cli("deploy", api="http://127.0.0.1:1/api", auth=None, background=background)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == os.nice(0) + raised
