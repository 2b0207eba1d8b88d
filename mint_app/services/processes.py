"""The processes behind mint's services: each one's pid file, JSON record and log in the state directory, and
the process checks the supervisor makes (alive, its process group, stop, health, a free port)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil

if TYPE_CHECKING:
    pass
from mint_app.services.config import (
    LOG_TAIL_LINES,
    ServiceName,
    ServicesConfig,
)

logger = logging.getLogger(__name__)

# Processes started by this Python process; polling them reaps them, so an exited one is not left a zombie.
CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


# ---------------------------------------------------------------------------------------------------------
# state files


def state_files(config: ServicesConfig, name: ServiceName) -> tuple[Path, Path, Path]:
    d = config.state_dir
    return d / f"{name}.pid", d / f"{name}.json", d / f"{name}.log"


def read_record(config: ServicesConfig, name: ServiceName) -> dict[str, Any] | None:
    """The recorded pid, URL and process creation time of a service, or None if there is no (readable) record."""
    pid_file, info_file, _ = state_files(config, name)
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        info = json.loads(info_file.read_text())
    except (OSError, ValueError):
        info = {}
    return {**info, "pid": pid}


def write_record(
    config: ServicesConfig,
    name: ServiceName,
    pid: int,
    url: str,
    base: str | None = None,
    auth: dict[str, Any] | None = None,
) -> None:
    """The service's pid file and record; `auth`: whether it runs with its auth, and exposed (`mint status`)."""
    pid_file, info_file, log = state_files(config, name)
    info = {"url": url, "started_at": time.time(), "create_time": _create_time(pid), "log": str(log)}
    if base is not None:  # mint serve's: what the flows of this stack train on, read back by running_base
        info["base"] = str(Path(base).resolve())
    if auth is not None:
        info["auth"] = auth
    info_file.write_text(json.dumps(info, indent=1) + "\n")
    pid_file.write_text(f"{pid}\n")


def remove_record(config: ServicesConfig, name: ServiceName) -> None:
    pid_file, info_file, _ = state_files(config, name)
    pid_file.unlink(missing_ok=True)
    info_file.unlink(missing_ok=True)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip("\n").splitlines()[-lines:]) or "(empty log)"


def service_log(config: ServicesConfig, name: ServiceName) -> Path:
    """The log a service writes now (rolled-over ones: `rolled_logs`)."""
    return state_files(config, name)[2]


def rolled_logs(config: ServicesConfig, name: ServiceName) -> list[Path]:
    """A service's rolled-over logs, newest first (<name>.log.1, .2, ...: the standard library's rotation)."""
    log = service_log(config, name)
    return [p for i in range(1, config.log_backups + 1) if (p := log.with_name(f"{log.name}.{i}")).exists()]


def follow_log(path: Path, write: Callable[[str], None], poll_s: float = 0.5) -> None:
    """Print what is appended to `path` until interrupted, following it across a roll-over (the file is renamed
    and a new one started: it is reopened when its inode changes or it shrinks)."""
    f = path.open(errors="replace")
    f.seek(0, os.SEEK_END)
    try:
        while True:
            chunk = f.read()
            if chunk:
                write(chunk)
                continue
            time.sleep(poll_s)
            with contextlib.suppress(OSError):
                st = path.stat()
                if st.st_ino != os.fstat(f.fileno()).st_ino or st.st_size < f.tell():
                    write(f.read())  # what was written before the roll-over
                    f.close()
                    f = path.open(errors="replace")
    except KeyboardInterrupt:
        pass
    finally:
        f.close()


# ---------------------------------------------------------------------------------------------------------
# processes


def _create_time(pid: int) -> float | None:
    """When the process started; with its pid it names one process (a later process may be given the pid)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _reap_children() -> None:
    """Poll the processes started here: one that exited is reaped (not left a zombie) and forgotten."""
    for pid, child in list(CHILDREN.items()):
        if child.poll() is not None:
            CHILDREN.pop(pid, None)


def _running(proc: psutil.Process) -> bool:
    """The process has not ended; a zombie, which only waits to be reaped by its parent, has."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's process: it exists, its state cannot be read


def alive(pid: int, create_time: float | None = None) -> bool:
    """The process runs, and (when known) is the one recorded: its pid was not given to a later process."""
    _reap_children()
    try:
        proc = psutil.Process(pid)
        if create_time is not None and proc.create_time() != create_time:
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's process: it exists, when it started cannot be read
    return _running(proc)


def _group(pgid: int) -> list[psutil.Process]:
    """The running processes of a process group (psutil has no process-group attribute; os.getpgid tells)."""
    _reap_children()
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to ask about
            if os.getpgid(proc.pid) == pgid and _running(proc):
                members.append(proc)
    return members


def _wait_ended(members: Callable[[], list[psutil.Process]], timeout: float) -> bool:
    """Wait up to `timeout` s until `members()` is empty; True if it became so."""
    deadline = time.monotonic() + timeout
    while procs := members():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        psutil.wait_procs(procs, timeout=min(0.5, left))  # also reaps those that are children of this process
    return True


def terminate(pid: int, timeout: float) -> bool:
    """SIGTERM the service's process group (the process alone if it leads none), SIGKILL what is left after
    `timeout` s; True if it had to be killed."""
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return False

    def members() -> list[psutil.Process]:
        if group:
            return _group(pid)
        try:
            return [psutil.Process(pid)] if alive(pid) else []
        except psutil.NoSuchProcess:
            return []

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(pid, sig)

    send(signal.SIGTERM)
    if _wait_ended(members, timeout):
        return False
    logger.warning("pid %d did not stop within %.0f s of SIGTERM: sending SIGKILL", pid, timeout)
    send(signal.SIGKILL)
    _wait_ended(members, 10)
    return True


def healthy(url: str, path: str, timeout: float = 2.0, key: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        # trust_env=False: a proxy from the environment must not stand between us and a loopback service
        return httpx.get(url + path, timeout=timeout, trust_env=False, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR, as the servers themselves bind: a port left in TIME_WAIT by a stopped server is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
