"""Supervision of one service: `python -m mint_app.services.supervise --log LOG [options] -- COMMAND...`.

`mint up` starts each service under this small process (in a session of its own: stopping the service signals the
group, this process and the service alike). It

- writes the service's output to LOG through the standard library's `RotatingFileHandler` (appended across
  restarts, rolled over at `--max-bytes` with `--backups` old files kept), each line as the service wrote it, plus
  lines of its own prefixed `[supervise]`;
- brings the service back when it ends on its own (a crash, a kill -9, an out-of-memory kill) after it had been
  healthy once (`--health-url`, asked with the bearer key in the variable `--health-key-env` names where the
  service demands one on every route, as mint's sealed vLLM does), backing off 1, 2, 4 ... s up to 30 s; a run that stays up for `--stable-s`
  resets the back-off. A service that ends before it was ever healthy is not restarted: this process exits
  with its status, and `mint up` reports the failure with the log's tail. More than `--max-restarts` restarts
  within `--window-s` also ends supervision (a service that cannot stay up is reported, not looped forever).
- on SIGTERM or SIGINT passes the signal on, waits for the service and exits: stopping is never a crash.
- with `--orphans kill` (the default) is the subreaper of the service's processes (Linux): what the service
  started and left behind when it died (MLflow's and Prefect's uvicorn under their CLIs, holding the port) is
  killed before the restart. `--orphans wait N` (the Prefect worker) gives them N s to end on their own first
  (its flow runs: Prefect's runner takes them down with the worker, and they report themselves Crashed), so that
  `--before-restart` (the worker's: requeue those runs, which resume from their checkpoints) never runs a flow
  run twice at once.

The standard library and psutil only: it starts next to MLflow, Prefect and vLLM and must stay small.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import logging.handlers
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import psutil

DEFAULT_MAX_BYTES = 20 * 2**20
DEFAULT_BACKUPS = 5
MAX_BACKOFF_S = 30.0
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Orphaned descendants are reparented to this process instead of init (Linux >= 3.4); False elsewhere."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def log_handler(path: Path, max_bytes: int, backups: int) -> logging.Handler:
    """The rotating file a service's lines go to (its messages are written as they are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
    )
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler


class Supervisor:
    """Runs `command`, copies its output to `out`, restarts it after a crash (see the module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        out: logging.Logger,
        health_url: str | None = None,
        max_restarts: int = 5,
        window_s: float = 600.0,
        stable_s: float = 60.0,
        kill_orphans: bool = True,
        orphans_grace_s: float = 0.0,
        health_key: str | None = None,
    ):
        self.command = list(command)
        self.out = out
        self.health_url = health_url
        self.health_key = health_key
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.stable_s = stable_s
        self.kill_orphans = kill_orphans
        self.orphans_grace_s = orphans_grace_s
        self.before_restart: list[str] = []
        self.started_at = 0.0  # epoch s of the newest start
        self.stopping = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        self.restarts: deque[float] = deque()

    def say(self, msg: str) -> None:
        self.out.info("[supervise %s] %s", time.strftime("%Y-%m-%d %H:%M:%S"), msg)

    def stop(self, signum: int, _frame: object = None) -> None:
        self.stopping.set()
        child = self.child
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # SIGTERM: uvicorn takes a second one as a first
                child.send_signal(signal.SIGTERM)

    def _copy(self, child: subprocess.Popen[bytes]) -> None:
        assert child.stdout is not None
        for raw in iter(child.stdout.readline, b""):
            self.out.info("%s", raw.decode("utf-8", errors="replace").rstrip("\n"))

    def _healthy(self) -> bool:
        if self.health_url is None:
            return True
        headers = {"Authorization": f"Bearer {self.health_key}"} if self.health_key else {}
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.health_url, headers=headers), timeout=2
            ) as r:
                return bool(200 <= r.status < 300)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _run_once(self) -> tuple[int, bool, float]:
        """Start the service and wait for it: (exit status, whether it was healthy once, seconds it ran)."""
        t0 = time.monotonic()
        self.started_at = time.time()
        child = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.child = child
        self.say(f"started pid {child.pid}: {' '.join(self.command[:3])} ...")
        copier = threading.Thread(target=self._copy, args=(child,), daemon=True)
        copier.start()
        healthy = False
        while child.poll() is None:
            if not healthy and not self.stopping.is_set():
                healthy = self._healthy()
                if healthy:  # from now on a crash is restarted (tests and the fault suite wait for this line)
                    self.say(f"pid {child.pid} healthy after {time.monotonic() - t0:.1f} s")
            if self.stopping.wait(0.25 if not healthy else 0.5):
                break
            if self.kill_orphans:
                self._reap()
        code = child.wait()
        if self.kill_orphans:
            self._kill_orphans()
        copier.join(timeout=5)
        return code, healthy, time.monotonic() - t0

    def _before_restart(self) -> None:
        """Run the --before-restart command (told when the dead run started: MINT_SUPERVISE_LAST_START)."""
        env = {**os.environ, "MINT_SUPERVISE_LAST_START": f"{self.started_at:.3f}"}
        try:
            done = subprocess.run(self.before_restart, env=env, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.say(f"before restart: {e}")
            return
        said = (done.stdout + done.stderr).strip().replace("\n", "; ")
        self.say(f"before restart: exit {done.returncode}: {said[-500:]}")

    def _kill_orphans(self) -> None:
        """Kill what the service left behind (reparented here as its subreaper) and reap it."""
        left = psutil.Process().children(recursive=True)
        if left and self.orphans_grace_s > 0 and not self.stopping.is_set():  # stopping: they got SIGTERM too
            gone, left = psutil.wait_procs(left, timeout=self.orphans_grace_s)
            if gone:
                self.say(f"{len(gone)} process(es) the service left behind ended on their own")
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        gone, alive = psutil.wait_procs(left, timeout=10)
        if gone:
            self.say(f"killed {len(gone)} process(es) the service left behind")
        if alive:
            self.say(
                f"{len(alive)} process(es) the service left behind did not end: {[p.pid for p in alive]}"
            )

    def _reap(self) -> None:
        """Reap exited orphans (zombies of this subreaper), never the service itself (Popen reaps it)."""
        child = self.child
        for p in psutil.Process().children():
            if child is not None and p.pid == child.pid:
                continue
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if p.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(p.pid, os.WNOHANG)

    def run(self) -> int:
        backoff = 1.0
        while True:
            code, healthy, ran = self._run_once()
            if self.stopping.is_set():
                self.say(f"stopped (status {code})")
                return 0
            self.say(
                f"pid {self.child.pid if self.child else '?'} exited with status {code} after {ran:.0f} s"
            )
            if not healthy:
                self.say("it never answered its health check: not restarted")
                return code if code > 0 else 1
            now = time.monotonic()
            if ran >= self.stable_s:
                backoff = 1.0
            while self.restarts and now - self.restarts[0] > self.window_s:
                self.restarts.popleft()
            if len(self.restarts) >= self.max_restarts:
                self.say(f"{len(self.restarts)} restarts within {self.window_s:.0f} s: giving up")
                return code if code > 0 else 1
            self.restarts.append(now)
            self.say(
                f"restarting in {backoff:.0f} s (restart {len(self.restarts)} of at most {self.max_restarts})"
            )
            if self.stopping.wait(backoff):
                return 0
            if self.before_restart:
                self._before_restart()
            backoff = min(backoff * 2, MAX_BACKOFF_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mint_app.services.supervise", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--log", type=Path, required=True, help="the service's log file (rotated)")
    parser.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="roll the log over at this size"
    )
    parser.add_argument(
        "--backups", type=int, default=DEFAULT_BACKUPS, help="old logs kept (LOG.1 ... LOG.N)"
    )
    parser.add_argument("--health-url", help="restart only a service that answered this URL once")
    parser.add_argument(
        "--health-key-env",
        help="the environment variable holding the bearer key the health check sends (never on the command line)",
    )
    parser.add_argument("--max-restarts", type=int, default=5, help="restarts allowed within --window-s")
    parser.add_argument("--window-s", type=float, default=600.0)
    parser.add_argument("--stable-s", type=float, default=60.0, help="a run this long resets the back-off")
    parser.add_argument(
        "--orphans",
        default="kill",
        help="what the service left behind when it died: kill, or wait N (seconds, then kill)",
    )
    parser.add_argument(
        "--before-restart",
        help="a command run before each restart (MINT_SUPERVISE_LAST_START: the dead run's start)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the service's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (-- COMMAND ...)")
    out = logging.getLogger(f"mint.supervise.{os.getpid()}")
    out.propagate = False
    out.setLevel(logging.INFO)
    out.addHandler(log_handler(args.log, args.max_bytes, args.backups))
    grace = 0.0
    if args.orphans != "kill":
        try:
            grace = float(args.orphans.removeprefix("wait").strip())
        except ValueError:
            parser.error(f"--orphans: kill, or wait N (seconds); got {args.orphans!r}")
    health_key = None
    if args.health_key_env:
        health_key = os.environ.get(args.health_key_env)
        if not health_key:
            parser.error(f"--health-key-env: {args.health_key_env} is not set in the environment")
    kill_orphans = become_subreaper()
    sup = Supervisor(
        command,
        out,
        args.health_url,
        args.max_restarts,
        args.window_s,
        args.stable_s,
        kill_orphans,
        grace,
        health_key=health_key,
    )
    sup.before_restart = shlex.split(args.before_restart) if args.before_restart else []
    signal.signal(signal.SIGTERM, sup.stop)
    signal.signal(signal.SIGINT, sup.stop)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
