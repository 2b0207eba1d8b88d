"""A benchmark that starts servers stops them when it is killed with SIGTERM (`kill`, `timeout`, `pkill`):
`_common.stop_servers_on_kill` turns the signal into SystemExit, so its `finally` blocks and exit stacks run. The
benchmarks that start vLLM or `mint serve` call it first thing."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mint_testkit.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys
sys.path.insert(0, {bench!r})
from _common import stop_servers_on_kill
{install}
try:  # `ready` is made inside the try: a signal that comes as soon as it exists lands here too
    open({ready!r}, "w").close()
    sys.stdin.read()  # blocks (the test never writes) until the signal comes
finally:
    open({cleaned!r}, "w").close()
"""
# what a benchmark that starts a server, a vLLM or mint's services calls
STARTS = re.compile(r"start_server\(|start_vllm\(|start_front\(|subprocess\.Popen\(|services\.control import")


@pytest.mark.parametrize("install", [True, False])
def test_a_sigterm_runs_the_cleanup_only_with_the_helper(tmp_path: Path, install: bool) -> None:
    ready, cleaned = tmp_path / "ready", tmp_path / "cleaned"
    code = CHILD.format(
        bench=str(ROOT / "benchmarks"),
        install="stop_servers_on_kill()" if install else "",
        ready=str(ready),
        cleaned=str(cleaned),
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        wait_until(ready.exists, timeout=30, what="the child to start")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert cleaned.exists() is install  # without it Python's default handler ends the process at once
    assert rc == (143 if install else -signal.SIGTERM)


def test_every_benchmark_that_starts_servers_installs_it_first_thing() -> None:
    """Scripts whose own code, or the `_`-module they import, starts a server call the helper right after parsing
    their arguments."""
    scripts = sorted((ROOT / "benchmarks").glob("[a-z]*.py"))
    helpers = {p.stem: p.read_text() for p in (ROOT / "benchmarks").glob("_*.py")}
    starting = []
    for path in scripts:
        text = path.read_text()
        used = [h for h in helpers if re.search(rf"^\s*from {h} import", text, re.M)]
        if STARTS.search(text) or any(STARTS.search(helpers[h]) for h in used):
            starting.append(path.name)
            main = text.split("\ndef main(", 1)[1]
            after = main.split("args = ap.parse_args()\n", 1)[1].lstrip().split("\n", 1)[0]
            assert after == "stop_servers_on_kill()", (path.name, after)
    assert {"replicas.py", "routing.py", "serving_load.py", "alias_to_serving.py"} <= set(starting), starting
