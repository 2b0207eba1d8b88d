"""A benchmark that starts servers stops them when it is killed with SIGTERM (`kill`, `timeout`, `pkill`):
`_common.stop_servers_on_kill` turns the signal into SystemExit, so its `finally` blocks and exit stacks run. The
benchmarks that start vLLM or `mint serve` call it first thing."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mint_testkit.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time
sys.path.insert(0, {bench!r})
from _common import stop_servers_on_kill
{install}
open({ready!r}, "w").close()
try:
    time.sleep(60)
finally:
    open({cleaned!r}, "w").close()
"""


@pytest.mark.parametrize("install", [True, False])
def test_a_sigterm_runs_the_cleanup_only_with_the_helper(tmp_path: Path, install: bool) -> None:
    ready, cleaned = tmp_path / "ready", tmp_path / "cleaned"
    code = CHILD.format(
        bench=str(ROOT / "benchmarks"),
        install="stop_servers_on_kill()" if install else "",
        ready=str(ready),
        cleaned=str(cleaned),
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_until(ready.exists, timeout=30, what="the child to start")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert cleaned.exists() is install  # without it Python's default handler ends the process at once
    assert rc == (143 if install else -signal.SIGTERM)


@pytest.mark.parametrize("script", ["replicas.py", "eval_backends.py", "routing.py", "vllm_bad_adapters.py"])
def test_the_benchmarks_that_start_servers_install_it(script: str) -> None:
    main = (ROOT / "benchmarks" / script).read_text().split("\ndef main(", 1)[1]
    assert "stop_servers_on_kill()" in main.split("args = ap.parse_args()", 1)[1].split("\n", 2)[1]
