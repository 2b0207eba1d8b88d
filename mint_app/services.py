"""mint's local services as background processes: the MLflow tracking server and model registry, a Prefect
server, the serving engine (`mint serve`: the embedded engine, or with `serving: vllm` mint's front before a vLLM
server, the `vllm` service, on loopback), the receiver of MLflow's alias webhook (`hooks`: serving
follows a `champion` moved in the MLflow UI within seconds; `mint up` registers the webhook), and a Prefect worker
that runs the deployments of infra/prefect.yaml (registered, with their work pool, before it starts).

Each service gets a log file, a pid file and a small JSON record (URL, start time) in one state directory, so
`start` is idempotent across invocations (a healthy service already recorded there is reused), `status` can be
asked from any shell, and `stop` finds what an earlier `mint up` started. A service is started in a session of
its own, so stopping it signals its whole process group (MLflow runs uvicorn under its CLI).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import psutil
import yaml
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from mint_core.errors import BaseError, MintError
from mint_core.serving.config import ServingConfig
from mint_core.settings import Settings
from mint_core.types import Device

if TYPE_CHECKING:
    from mint_core.serving.vllm_process import VLLMConfig

logger = logging.getLogger(__name__)

ServiceName = Literal["mlflow", "prefect", "vllm", "serve", "hooks", "worker"]
SERVICES: tuple[ServiceName, ...] = ("mlflow", "prefect", "serve", "hooks", "worker")
"""The services `mint up` starts by default (serving: mint); `services_for` adds vllm for serving: vllm."""
ALL_SERVICES: tuple[ServiceName, ...] = ("mlflow", "prefect", "vllm", "serve", "hooks", "worker")
"""Every service, in start order (stop goes the other way: mint serve before the vLLM it fronts)."""
ENV_PREFIX = "MINT_SERVICES_"
HEALTH_PATH: dict[ServiceName, str] = {
    "mlflow": "/health",
    "prefect": "/api/health",
    "vllm": "/health",  # sealed: asked with vLLM's key (HEALTH_KEY_ENV), as every route of it
    "serve": "/health",
    "hooks": "/health",
    "worker": "/health",  # the worker's healthcheck server: 200 while it polls its work pool
}
# The variable holding the key a service demands on its health route (mint's seal on vLLM covers every route)
HEALTH_KEY_ENV: dict[ServiceName, str] = {"vllm": "VLLM_API_KEY"}
LOG_TAIL_LINES = 40
# The directory `dvc repro` builds the built-in base into (relative to the working directory).
BUILTIN_BASE = Path("data/base")
# The head sizes vLLM's CPU attention runs (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm_process.DEFAULT_PYTHON, not imported: that module's imports reach torch, which `mint up` never loads
VLLM_PYTHON = Path(".venv-vllm/bin/python")
PROGRESS_EVERY_S = 10.0
"""While a service takes longer than this to answer, `start` says so this often."""

State = Literal["running", "unhealthy", "stopped"]


class ServiceError(MintError):
    """A service did not start, stop or answer; names the service, and ends with the tail of its log."""


class ServicesConfig(Settings):
    """Where mint's local services run, what they store where, and how long to wait for them.

    `ServicesConfig.load(file, **flags)` reads the file, then MINT_SERVICES_<FIELD> environment variables, then
    flags."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    state_dir: Path = Path(".mint/run")
    """Pid files, logs, the local databases (MLflow, Prefect) and generated secrets."""
    host: str = "127.0.0.1"
    """Address every service binds to and is reached at (0.0.0.0 also exposes them to the network)."""
    mlflow_port: int = Field(5000, ge=1, le=65535)
    """Port of the MLflow tracking server, its registry and its UI."""
    mlflow_backend_url: str | None = None
    """SQLAlchemy URL of MLflow's tracking and registry store. Default: sqlite:///<state_dir>/mlflow.db.
    PostgreSQL: postgresql+psycopg://user[:password]@host:5432/mlflow (a URL without a driver gets psycopg, the
    PostgreSQL driver mint installs); the database is created if it does not exist."""
    mlflow_artifacts: str | None = None
    """Where the server keeps run artifacts (--artifacts-destination, served through the server's proxy): a
    directory or an fsspec/cloud URL such as s3://bucket/mlflow. Default: <state_dir>/mlflow-artifacts."""
    mlflow_workers: int = Field(1, ge=1)
    """uvicorn worker processes of the MLflow server (MLflow's own default is 4)."""
    mlflow_allowed_hosts: str | None = None
    """Comma-separated Host headers MLflow accepts (--allowed-hosts); MLflow's default is localhost and private
    addresses. Set it when the UI is opened through a DNS name."""
    mlflow_jobs: bool = False
    """Run MLflow's server-side job executor (a Huey consumer per job kind, for MLflow's GenAI features);
    off by default: mint does not use it and it costs several processes."""
    prefect_port: int = Field(4200, ge=1, le=65535)
    """Port of the Prefect server: its API (under /api) and dashboard."""
    prefect_database_url: str | None = None
    """Prefect's database. Default: SQLite in <state_dir>/prefect. PostgreSQL:
    postgresql+asyncpg://user[:password]@host:5432/prefect (Prefect needs the asyncpg driver; a URL without a
    driver gets it); the database is created if it does not exist."""
    serve_port: int = Field(8000, ge=1, le=65535)
    """Port of `mint serve` (the OpenAI/vLLM-compatible API under /v1)."""
    serving: Literal["mint", "vllm"] = "mint"
    """Who runs the served model: `mint`, the embedded engine inside `mint serve`; `vllm`, a vLLM server (the
    `vllm` service, from `vllm_python`'s environment, on loopback) with `mint serve` as its front on serve_port
    (validation, auth, revision identity). The base must be one vLLM can run (on CPU: a head_dim vLLM's attention
    supports, so data/base, not the tiny-dense fallback)."""
    vllm_port: int = Field(8100, ge=1, le=65535)
    """Port of the vLLM server (serving: vllm), always on 127.0.0.1: only mint's front reaches it."""
    vllm_python: Path = VLLM_PYTHON
    """The interpreter of vLLM's own environment (`make vllm-venv`, scripts/bootstrap_vllm.sh)."""
    vllm_start_timeout_s: float = Field(300.0, gt=0)
    """Seconds vLLM may take to answer its health check (it loads and profiles the model: 30-100 s on 2 cores)."""
    serve_base: str | None = None
    """Base of `mint serve`: a model directory or a built-in name (tiny-dense, ...). Default: data/base when
    `dvc repro` has built it, else a tiny dense base written once into <state_dir>/tiny-dense."""
    serve_config: Path | None = None
    """A ServingConfig file (YAML/JSON) for `mint serve`; host, port and base above take precedence over it."""
    serve_adapter_root: Path | None = None
    """Adapter store of `mint serve` (load requests may only name paths inside it). Default: the serving
    config's adapter_root (.mint/store)."""
    serve_max_lora_rank: int = Field(32, ge=1)
    """Largest adapter rank `mint serve` accepts when neither its serving config nor MINT_SERVE_MAX_LORA_RANK
    sets one: the largest rank of the built-in recipe (`add`'s 32 in `mint_core.rl.recipe.BUILTIN_TASK_RANKS`, a
    literal here so that `mint up` does not load torch; a test holds the two equal), above the serving default
    of 16 (vLLM's), so the main job's revisions load."""
    serve_device: Device | None = None
    """Device of `mint serve` (`--device`: cpu, cuda or cuda:N), and of the training of the flows it registers.
    Default: the serving config's device (cpu)."""
    hooks_port: int = Field(8001, ge=1, le=65535)
    """Port of the receiver of MLflow's alias webhook (`mint_app.webhooks`): serving follows `champion` moves."""
    catalog_url: str | None = None
    """SQLAlchemy URL of the catalog the flows use (the receiver takes their promotion locks there). Default:
    sqlite:///<state_dir>/../catalog.db, the default Workspace's .mint/catalog.db."""
    worker_port: int = Field(4201, ge=1, le=65535)
    """Port of the Prefect worker's healthcheck server (`prefect worker start --with-healthcheck`)."""
    deployments: Path | None = Path("infra/prefect.yaml")
    """The prefect.yaml whose deployments (and their process work pool) `mint up` registers before it starts
    the worker; relative to the working directory, which flow runs start in. None: register none."""
    startup_timeout: float = Field(180.0, gt=0)
    """Seconds a service may take to answer its health check after it is launched."""
    stop_timeout: float = Field(30.0, gt=0)
    """Seconds between SIGTERM and SIGKILL when stopping (mint serve finishes requests in flight first)."""
    supervise: bool = True
    """Bring a service that crashes after it was healthy back up (`mint_app.supervise`: backing off 1-30 s, at
    most `max_restarts` within 10 minutes). Off: a crashed service stays down until the next `mint up`."""
    max_restarts: int = Field(5, ge=0)
    """Restarts within 10 minutes after which supervision gives up and the service stays down (reported)."""
    log_max_bytes: int = Field(20 * 2**20, ge=2**16)
    """A service's log rolls over at this size (<name>.log -> <name>.log.1 ...); logs are appended across
    restarts and `mint up`s, never truncated (`mint logs [service]` shows them)."""
    log_backups: int = Field(5, ge=1)
    """Rolled-over logs kept per service."""

    def port(self, name: ServiceName) -> int:
        ports = {"mlflow": self.mlflow_port, "prefect": self.prefect_port, "serve": self.serve_port}
        return {**ports, "vllm": self.vllm_port, "hooks": self.hooks_port, "worker": self.worker_port}[name]

    def bind_host(self, name: ServiceName) -> str:
        """The address a service binds to: `host`, but loopback for vLLM (users reach it through the front)."""
        return "127.0.0.1" if name == "vllm" else self.host

    def url(self, name: ServiceName) -> str:
        """The service's base URL (for Prefect the API is under /api)."""
        host = self.bind_host(name)
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port(name)}"

    def mlflow_backend(self) -> str:
        if self.mlflow_backend_url is None:
            return f"sqlite:///{(self.state_dir / 'mlflow.db').resolve()}"
        return with_driver(self.mlflow_backend_url, "psycopg")

    def prefect_database(self) -> str | None:
        return (
            None if self.prefect_database_url is None else with_driver(self.prefect_database_url, "asyncpg")
        )


@dataclass
class Service:
    """One service as found (or left) by start/stop/status."""

    name: ServiceName
    state: State
    url: str
    pid: int | None
    log: Path
    reused: bool = False
    """start found it already running."""
    startup_s: float | None = None
    """Seconds from launch to a healthy answer (None when reused or not started here)."""
    detail: str | None = None
    """What else start did for it (the worker: the deployments it registered or found unchanged)."""

    @property
    def open_url(self) -> str:
        """The page a person opens: the MLflow UI, the Prefect dashboard, or the served models."""
        return self.url + "/v1/models" if self.name == "serve" else self.url

    @property
    def api_url(self) -> str:
        """What clients are configured with: MLFLOW_TRACKING_URI, PREFECT_API_URL, the serving base URL."""
        return self.url + "/api" if self.name == "prefect" else self.url


# Processes started by this Python process; polling them reaps them, so an exited one is not left a zombie.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def parse_names(only: str | None) -> list[ServiceName]:
    """`mlflow,serve` -> ["mlflow", "serve"] in start order; None or "" -> the default services (SERVICES)."""
    if not only:
        return list(SERVICES)
    wanted = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(wanted - set(ALL_SERVICES))
    if unknown:
        raise ValueError(f"unknown service(s) {', '.join(unknown)}: choose from {', '.join(ALL_SERVICES)}")
    return [n for n in ALL_SERVICES if n in wanted]


def services_for(config: ServicesConfig) -> list[ServiceName]:
    """What `mint up` starts by default: SERVICES, and with serving vllm the vLLM server before mint serve."""
    return [n for n in ALL_SERVICES if n != "vllm" or config.serving == "vllm"]


def _known_names(config: ServicesConfig) -> list[ServiceName]:
    """What status and stop look at by default: `services_for(config)`, and a vLLM recorded in the state dir
    whatever `serving` says now (`mint down` stops what `mint up --serving vllm` started)."""
    recorded = _read_record(config, "vllm") is not None
    return [n for n in ALL_SERVICES if n in services_for(config) or (n == "vllm" and recorded)]


def with_driver(url: str, driver: str) -> str:
    """A PostgreSQL URL without a driver (postgresql://, postgres://) gets `driver`; others are unchanged."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return f"postgresql+{driver}://" + url[len(scheme) :]
    return url


def ensure_postgres_database(url: str, timeout: float = 5.0) -> bool:
    """Create the database a PostgreSQL URL names if it does not exist; True if it was created.

    Connects to the server's `postgres` maintenance database with the URL's credentials.
    """
    import sqlalchemy as sa  # only for a PostgreSQL URL: `mint --help`, `mint up` on SQLite never import it

    target = sa.make_url(with_driver(url, "psycopg"))
    name = target.database
    if not name:
        raise ServiceError(f"{target.render_as_string()}: the URL names no database")
    admin_url = target.set(drivername="postgresql+psycopg", database="postgres")
    engine = sa.create_engine(
        admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": timeout}
    )
    try:
        with engine.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).first()
            if exists:
                return False
            quoted = conn.dialect.identifier_preparer.quote_identifier(name)
            conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
            logger.info("created PostgreSQL database %s", name)
            return True
    except sa.exc.DBAPIError as e:
        raise ServiceError(
            f"could not create database {name!r} on PostgreSQL at {admin_url.render_as_string()}: "
            f"{str(e.orig).strip()}"
        ) from e
    finally:
        engine.dispose()


# ---------------------------------------------------------------------------------------------------------
# state files


def _paths(config: ServicesConfig, name: ServiceName) -> tuple[Path, Path, Path]:
    d = config.state_dir
    return d / f"{name}.pid", d / f"{name}.json", d / f"{name}.log"


def _read_record(config: ServicesConfig, name: ServiceName) -> dict[str, Any] | None:
    """The recorded pid, URL and process creation time of a service, or None if there is no (readable) record."""
    pid_file, info_file, _ = _paths(config, name)
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        info = json.loads(info_file.read_text())
    except (OSError, ValueError):
        info = {}
    return {**info, "pid": pid}


def _write_record(config: ServicesConfig, name: ServiceName, pid: int, url: str) -> None:
    pid_file, info_file, log = _paths(config, name)
    info = {"url": url, "started_at": time.time(), "create_time": _create_time(pid), "log": str(log)}
    if name == "serve":  # what the flows of this stack train on (`mint up --base`), read back by running_base
        info["base"] = str(Path(serve_base(config)).resolve())
    info_file.write_text(json.dumps(info, indent=1) + "\n")
    pid_file.write_text(f"{pid}\n")


def _remove_record(config: ServicesConfig, name: ServiceName) -> None:
    pid_file, info_file, _ = _paths(config, name)
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
    return _paths(config, name)[2]


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
    for pid, child in list(_CHILDREN.items()):
        if child.poll() is not None:
            _CHILDREN.pop(pid, None)


def _running(proc: psutil.Process) -> bool:
    """The process has not ended; a zombie, which only waits to be reaped by its parent, has."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's process: it exists, its state cannot be read


def _alive(pid: int, create_time: float | None = None) -> bool:
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


def _terminate(pid: int, timeout: float) -> bool:
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
            return [psutil.Process(pid)] if _alive(pid) else []
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


def _healthy(url: str, path: str, timeout: float = 2.0, key: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        # trust_env=False: a proxy from the environment must not stand between us and a loopback service
        return httpx.get(url + path, timeout=timeout, trust_env=False, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def _health_key(config: ServicesConfig, name: ServiceName) -> str | None:
    """The key `name`'s health route demands: vLLM's (its seal refuses /health without it), else none."""
    return _vllm_key(config) if name in HEALTH_KEY_ENV else None


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR, as the servers themselves bind: a port left in TIME_WAIT by a stopped server is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _bin(tool: str) -> str:
    """A console script of this environment (mlflow, prefect), next to the running interpreter."""
    path = Path(sys.executable).parent / tool
    if not path.exists():
        raise ServiceError(f"{tool} is not installed next to {sys.executable}")
    return str(path)


def _serve_token(config: ServicesConfig) -> str:
    """The admin token of `mint serve` under this state dir: generated once, kept readable by its owner only."""
    path = config.state_dir / "serve.token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
    return path.read_text().strip()


def _state_secret(config: ServicesConfig, filename: str, make: Callable[[], str]) -> str:
    """A secret kept in the state dir: made once by `make()`, readable by its owner only."""
    path = config.state_dir / filename
    if not path.exists():
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make() + "\n")
    return path.read_text().strip()


def _hooks_secret_file(config: ServicesConfig) -> Path:
    """The file of the webhook secret that `mint up` registers with MLflow and the receiver checks."""
    _state_secret(config, "hooks.secret", lambda: secrets.token_urlsafe(32))
    return config.state_dir / "hooks.secret"


def hooks_workspace(config: ServicesConfig) -> dict[str, Any]:
    """The Workspace (fields) the receiver reconciles in: the services of this state dir, the flows' catalog."""
    store = config.serve_adapter_root or ServingConfig.load(config.serve_config).adapter_root
    catalog = config.catalog_url or f"sqlite:///{(config.state_dir.parent / 'catalog.db').resolve()}"
    return {
        "tracking_uri": config.url("mlflow"),
        "serving_url": config.url("serve"),
        "store": str(Path(store).resolve()),
        "catalog_url": catalog,
        "admin_token_file": str((config.state_dir / "serve.token").resolve()),
    }


def register_webhook(config: ServicesConfig) -> str:
    """Point MLflow's alias webhook at the receiver (idempotent); what was done, for `mint up` to show."""
    if not _healthy(config.url("mlflow"), HEALTH_PATH["mlflow"]):
        return "MLflow is not running here: no webhook registered (the reconcile deployment still runs)"
    # MLflow's client is only imported here: `mint --help` and the other services never load it
    from mint_app.webhooks import WEBHOOK_PATH
    from mint_core.registry.webhooks import ensure_alias_webhook

    url = config.url("hooks") + WEBHOOK_PATH
    try:
        secret = _hooks_secret_file(config).read_text().strip()
        hook = ensure_alias_webhook(config.url("mlflow"), url, secret)
    except MintError as e:
        raise ServiceError(f"hooks: {e}") from e
    return f"MLflow alias webhook {hook} -> {url}"


def running_base(config: ServicesConfig) -> str | None:
    """The base the running mint serve of this state dir was started on (its record), unless the config names
    one: so `mint up --base DIR` and a later command with no --base agree on what the flows train."""
    if config.serve_base is not None:
        return None
    record = _read_record(config, "serve") or {}
    return record.get("base") if record and _alive(record["pid"], record.get("create_time")) else None


def serve_base(config: ServicesConfig) -> str:
    """The base `mint serve` loads; builds the tiny default into the state dir the first time it is needed."""
    if config.serve_base is not None:
        return config.serve_base
    if (BUILTIN_BASE / "config.json").is_file():
        return str(BUILTIN_BASE.resolve())
    out = (config.state_dir / "tiny-dense").resolve()  # its directory name is the served model name
    if not (out / "config.json").is_file():
        logger.info("data/base is not built (dvc repro): writing a tiny dense base to %s", out)
        tmp = out.with_name(out.name + ".tmp")
        # `mint base build-tiny` (the DVC tiny_base stage's command) in a child: the supervisor never loads torch
        cmd = [sys.executable, "-m", "mint_app.cli", "base", "build-tiny", str(tmp), "--family", "dense"]
        made = subprocess.run([*cmd, "--seed", "0"], capture_output=True, text=True)
        if made.returncode != 0:
            raise ServiceError(f"could not write a tiny dense base to {tmp}:\n{made.stdout}{made.stderr}")
        tmp.rename(out)
    return str(out)


def _vllm_base(config: ServicesConfig) -> Path:
    """The base vLLM serves: `serve_base(config)`, refused (ServiceError) unless it is a model directory vLLM can
    run. Checked from its config.json, before anything is built or started."""
    fix = (
        "build data/base (`dvc repro`, or `mint run`, which builds it first), or pass --serve-base a model "
        "directory vLLM can run"
    )
    if config.serve_base is None and not (BUILTIN_BASE / "config.json").is_file():
        raise ServiceError(
            f"vllm: {BUILTIN_BASE} is not built, and the tiny-dense base mint serve falls back to (head_dim 16) "
            f"cannot run on vLLM, whose CPU attention needs a head_dim in {list(VLLM_CPU_HEAD_DIMS)}: {fix}"
        )
    base = Path(serve_base(config))
    try:
        cfg = json.loads((base / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ServiceError(
            f"vllm: the base {str(base)!r} is not a Hugging Face model directory vLLM can load ({e}): {fix}"
        ) from None
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    device = config.serve_device or ServingConfig.load(config.serve_config).device
    if device == "cpu" and head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ServiceError(
            f"vllm: the base {base} has head_dim {head_dim}; vLLM's CPU attention runs only head_dim "
            f"{list(VLLM_CPU_HEAD_DIMS)}: {fix}"
        )
    return base.resolve()


def vllm_config(config: ServicesConfig) -> VLLMConfig:
    """The vLLM server behind `mint serve` (serving vllm): the same base, rank limit and model length as the
    serving config, on 127.0.0.1:vllm_port, its key and the resolver plugin's token kept in the state dir.
    ServiceError when vLLM's environment is missing or the base is one vLLM cannot run."""
    from mint_core.serving.vllm_process import VLLMConfig, vllm_available  # only here: it reaches torch

    if not vllm_available(config.vllm_python):
        raise ServiceError(
            f"vllm: vLLM's environment is missing ({config.vllm_python} is not an interpreter): run `make "
            "vllm-venv` (or bash scripts/bootstrap_vllm.sh), or set vllm_python (MINT_SERVICES_VLLM_PYTHON)"
        )
    base = _vllm_base(config)
    serving = ServingConfig.load(config.serve_config)
    positions = json.loads((base / "config.json").read_text()).get("max_position_embeddings")
    device = config.serve_device or serving.device
    return VLLMConfig(
        python=config.vllm_python.absolute(),  # not resolve(): the venv's python is a symlink out of the venv
        model=base,
        served_model_name=serving.served_model_name or base.name,  # the front's name for it
        host=config.bind_host("vllm"),
        port=config.vllm_port,
        api_key=_vllm_key(config),
        max_loras=serving.max_loras,
        max_cpu_loras=serving.max_cpu_loras or 4 * serving.max_loras,
        max_lora_rank=_serve_max_lora_rank(config, serving),
        # vLLM refuses a length beyond the base's positions (the embedded engine does not check)
        max_model_len=min(serving.max_model_len, int(positions or serving.max_model_len)),
        dtype=serving.dtype,
        device="cpu" if device == "cpu" else "cuda",
        resolver_url=config.url("serve"),
        resolver_token=_resolver_token(config),
    )


def _vllm_key(config: ServicesConfig) -> str:
    """vLLM's --api-key (given in its environment): only mint serve, its front, knows it."""
    return _state_secret(config, "vllm.key", lambda: secrets.token_urlsafe(24))


def _resolver_token(config: ServicesConfig) -> str:
    """The bearer token vLLM's resolver plugin asks mint serve's /v1/mint/resolve with."""
    return _state_secret(config, "resolver.token", lambda: secrets.token_urlsafe(24))


def _serve_max_lora_rank(config: ServicesConfig, serving: ServingConfig) -> int:
    """The serving config's max_lora_rank (file or MINT_SERVE_MAX_LORA_RANK) when it sets one, else the one
    `mint up` gives mint serve (serve_max_lora_rank)."""
    return (
        serving.max_lora_rank if "max_lora_rank" in serving.model_fields_set else config.serve_max_lora_rank
    )


def command(name: ServiceName, config: ServicesConfig) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start one service (secrets go in the environment)."""
    host, port = config.host, str(config.port(name))
    env = {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    }
    if name == "mlflow":
        artifacts = config.mlflow_artifacts or str((config.state_dir / "mlflow-artifacts").resolve())
        # the store URL may hold a password: passed in the environment, not on the command line `ps` shows
        env["MLFLOW_BACKEND_STORE_URI"] = config.mlflow_backend()
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "true" if config.mlflow_jobs else "false"
        # alias webhooks to the receiver on this machine (http, a private address); the webhook list is cached
        # for a few seconds only, so a webhook registered by `mint up` fires at once; one key encrypts the stored
        # secret across restarts and uvicorn workers (MLflow makes one per process if none is given)
        env["MLFLOW_WEBHOOK_ALLOWED_SCHEMES"] = "http,https"
        env["MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS"] = "true"
        env["MLFLOW_WEBHOOK_CACHE_TTL"] = "2"
        env["MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY"] = os.environ.get(
            "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY"
        ) or _state_secret(
            config, "mlflow-webhook.key", lambda: base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
        )
        cmd = [_bin("mlflow"), "server", "--artifacts-destination", artifacts, "--serve-artifacts"]
        cmd += ["--host", host, "--port", port, "--workers", str(config.mlflow_workers)]
        if config.mlflow_allowed_hosts:
            cmd += ["--allowed-hosts", config.mlflow_allowed_hosts]
        return cmd, env
    if name == "prefect":
        env["PREFECT_HOME"] = str((config.state_dir / "prefect").resolve())
        # the dashboard's API calls go here: left unset, the UI calls port 4200 whatever port the server is on
        env["PREFECT_UI_API_URL"] = config.url("prefect") + "/api"
        database = config.prefect_database()
        if database is not None:
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database
        if database is None or database.startswith(
            "sqlite"
        ):  # Prefect's busy-heartbeat ERROR, said as harmless
            env["PREFECT_LOGGING_SETTINGS_PATH"] = str(_prefect_logging(config))
        return [_bin("prefect"), "server", "start", "--host", host, "--port", port, "--analytics-off"], env
    if name == "hooks":
        env["MINT_HOOKS_HOST"], env["MINT_HOOKS_PORT"] = host, port
        env["MINT_HOOKS_SECRET_FILE"] = str(_hooks_secret_file(config).resolve())
        env["MINT_HOOKS_WORKSPACE"] = json.dumps(hooks_workspace(config))
        return [sys.executable, "-m", "mint_app.webhooks"], env
    if name == "worker":
        # flow runs inherit this environment (and the job variables of infra/prefect.yaml): the servers of this
        # state dir, so a deployment's default Workspace reaches them
        env["PREFECT_API_URL"] = config.url("prefect") + "/api"
        env["PREFECT_HOME"] = str((config.state_dir / "prefect").resolve())
        env["PREFECT_WORKER_WEBSERVER_HOST"] = host
        env["PREFECT_WORKER_WEBSERVER_PORT"] = port
        # a run created from the dashboard waits for the worker's next poll: every 2 s, not Prefect's 10
        env.setdefault("PREFECT_WORKER_QUERY_SECONDS", os.environ.get("PREFECT_WORKER_QUERY_SECONDS", "2"))
        env["MLFLOW_TRACKING_URI"] = config.url("mlflow")
        token = config.state_dir / "serve.token"
        if token.is_file() and "MINT_SERVE_ADMIN_TOKEN" not in os.environ:
            env["MINT_SERVE_ADMIN_TOKEN"] = token.read_text().strip()
        cmd = [_bin("prefect"), "worker", "start", "--pool", work_pool(config), "--type", "process"]
        return [*cmd, "--name", "mint-worker", "--with-healthcheck", "--install-policy", "never"], env
    if name == "vllm":
        vllm = vllm_config(config)
        cmd, vllm_env = vllm.command()
        env.update(vllm_env)
        device = config.serve_device or ServingConfig.load(config.serve_config).device
        if device.startswith("cuda:"):  # vLLM takes the first GPU it sees
            env["CUDA_VISIBLE_DEVICES"] = device.removeprefix("cuda:")
        return cmd, env
    cmd = [sys.executable, "-m", "mint_app.cli", "serve", "--host", host, "--port", port]
    cmd += ["--base", serve_base(config)]
    if config.serve_config is not None:
        cmd += ["--config", str(config.serve_config.resolve())]
    if config.serve_adapter_root is not None:
        cmd += ["--adapter-root", str(config.serve_adapter_root.resolve())]
    if config.serve_device is not None:
        cmd += ["--device", config.serve_device]
    # a token from the environment or the serving config wins; else one kept in the state dir, so the admin
    # routes of a server started by `mint up` have a token that can be read back
    serving = ServingConfig.load(config.serve_config)
    if "max_lora_rank" not in serving.model_fields_set:
        env["MINT_SERVE_MAX_LORA_RANK"] = str(config.serve_max_lora_rank)
    if serving.admin_token is None:
        env["MINT_SERVE_ADMIN_TOKEN"] = _serve_token(config)
    if serving.catalog_url is None:
        # a policy name resolves to its champion in the flows' catalog on demand: after any restart, the first
        # request for a policy is answered by its champion (no 404 until reconcile loads it)
        env["MINT_SERVE_CATALOG_URL"] = hooks_workspace(config)["catalog_url"]
    if config.serving == "vllm":
        # the front of the vLLM service (vLLM's resolver plugin asks it for names it does not hold). The Tinker
        # training API is the embedded engine's: not here.
        env["MINT_SERVE_BACKEND"] = "vllm"
        env["MINT_SERVE_VLLM_URL"] = config.url("vllm")
        env["MINT_SERVE_VLLM_API_KEY"] = _vllm_key(config)
        env["MINT_SERVE_RESOLVER_TOKEN"] = _resolver_token(config)
        return cmd, env
    # the Tinker training API: a key kept in the state dir (unless keys are configured), and a named
    # save_weights_for_sampler becomes an MLflow version indexed in the flows' catalog
    if serving.tinker_api_keys is None and serving.tinker_api_keys_file is None:
        env["MINT_SERVE_TINKER_API_KEYS_FILE"] = str(tinker_keys_file(config).resolve())
    if serving.tinker_registry_uri is None:
        env["MINT_SERVE_TINKER_REGISTRY_URI"] = config.url("mlflow")
        env["MINT_SERVE_TINKER_CATALOG_URL"] = hooks_workspace(config)["catalog_url"]
    return cmd, env


def _prefect_logging(config: ServicesConfig) -> Path:
    """The Prefect server's logging config (`mint_app.prefect_logging`), written into the state dir."""
    from mint_app.prefect_logging import write_config

    default = Path(
        _bin("prefect")
    ).parent.parent  # the environment Prefect is installed in: find its logging.yml
    found = next(default.glob("lib/python*/site-packages/prefect/logging/logging.yml"), None)
    if found is None:
        raise ServiceError(f"prefect: its logging.yml is not under {default} (is Prefect installed there?)")
    return write_config(found, (config.state_dir / "prefect-logging.yml").resolve())


def tinker_keys_file(config: ServicesConfig) -> Path:
    """The Tinker API key of `mint serve` under this state dir (`tml-...`, made once, readable by its owner)."""
    _state_secret(config, "tinker.keys", lambda: "tml-" + secrets.token_urlsafe(24))
    return config.state_dir / "tinker.keys"


# ---------------------------------------------------------------------------------------------------------
# deployments (what the worker runs)

DEFAULT_POOL = "mint-process"


def _deployments_file(config: ServicesConfig) -> dict[str, Any]:
    if config.deployments is None:
        return {}
    try:
        doc = yaml.safe_load(config.deployments.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ServiceError(f"worker: cannot read the deployments file {config.deployments}: {e}") from e
    return doc if isinstance(doc, dict) else {}


def work_pool(config: ServicesConfig) -> str:
    """The process work pool the deployments file names (one for all of them), else mint-process."""
    deployments = _deployments_file(config).get("deployments") or []
    pools = {str(d["work_pool"]["name"]) for d in deployments if (d.get("work_pool") or {}).get("name")}
    if len(pools) > 1:
        raise ServiceError(
            f"worker: {config.deployments} names several work pools ({sorted(pools)}); one worker runs one"
        )
    return str(pools.pop()) if pools else DEFAULT_POOL


def workspace_defaults(config: ServicesConfig) -> dict[str, str]:
    """The `workspace` parameter of every deployment: the servers of this state dir, and the store, catalog and
    lifecycle folder beside it (`.mint/` for the default `.mint/run`, as the flows' own Workspace defaults and
    `mint run` lay them out), so a run started from the dashboard or a schedule reaches these servers."""
    home = config.state_dir.resolve().parent
    store = config.serve_adapter_root or ServingConfig.load(config.serve_config).adapter_root
    return {
        "tracking_uri": config.url("mlflow"),
        "serving_url": config.url("serve"),
        "admin_token_file": str(config.state_dir.resolve() / "serve.token"),
        "store": str(store.resolve()),
        "catalog_url": f"sqlite:///{home / 'catalog.db'}",
        "work_dir": str(home / "lifecycle"),
        "base": str(Path(running_base(config) or serve_base(config)).resolve()),
        "device": config.serve_device or ServingConfig.load(config.serve_config).device,
    }


def _deployments_for(config: ServicesConfig) -> str:
    """The deployments file with each deployment's `workspace` defaulting to this state dir's (unless it sets
    one), as YAML."""
    doc = _deployments_file(config)
    for d in doc.get("deployments") or []:
        params = d.setdefault("parameters", {}) or {}
        params.setdefault("workspace", workspace_defaults(config))
        d["parameters"] = params
    return yaml.safe_dump(doc, sort_keys=False)


def _fingerprint(config: ServicesConfig, api: str, deployments: str) -> str:
    """What the registered deployments are made of: the file (with its workspace), the flows' code (their
    signatures make the parameter forms), the server and the directory runs start in. Not the library's config
    models under them, which change far more often than the forms: after changing one of those, delete
    <state_dir>/deployments.json and `mint up` registers again."""
    h = hashlib.sha256(f"{api}\n{Path.cwd()}\n".encode())
    h.update(deployments.encode())
    for path in sorted(Path("flows").glob("*.py")):
        h.update(str(path).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _prefect_cli(*args: str, api: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run(
        [_bin("prefect"), "--no-prompt", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def register_deployments(config: ServicesConfig) -> str:
    """Create the work pool and register every deployment of `config.deployments` on the Prefect server of this
    state dir (`prefect deploy --all`, once), each with `workspace_defaults` as its workspace; skipped when the
    file, the code and the server are those of the last registration and every deployment is still there. Says
    what it did."""
    if config.deployments is None:
        return "no deployments file"
    api = config.url("prefect") + "/api"
    if not _healthy(config.url("prefect"), HEALTH_PATH["prefect"]):
        raise ServiceError(
            f"worker: the Prefect server at {api} is not running (start it too: mint up --only prefect,worker)"
        )
    names = sorted(d["name"] for d in _deployments_file(config).get("deployments") or [])
    pool = work_pool(config)
    record = config.state_dir / "deployments.json"
    derived = config.state_dir / "prefect.yaml"
    text = _deployments_for(config)
    fingerprint = _fingerprint(config, api, text)
    try:
        last = json.loads(record.read_text())
    except (OSError, ValueError):
        last = {}
    found = httpx.post(
        f"{api}/deployments/filter",
        json={"deployments": {"name": {"any_": names}}, "limit": 200, "offset": 0},
        timeout=10,
        trust_env=False,
    )
    there = {d["name"] for d in found.json()} if found.status_code == 200 else set()
    if last.get("fingerprint") == fingerprint and set(names) <= there:
        return f"{len(names)} deployments unchanged"
    t0 = time.monotonic()
    if httpx.get(f"{api}/work_pools/{pool}", timeout=10, trust_env=False).status_code == 404:
        made = _prefect_cli("work-pool", "create", pool, "--type", "process", api=api)
        if made.returncode != 0:
            raise ServiceError(
                f"worker: could not create work pool {pool}:\n{made.stdout[-2000:]}{made.stderr[-2000:]}"
            )
    derived.write_text(
        f"# {config.deployments} as `mint up` registered it (workspace: this state dir's)\n{text}"
    )
    for wait in (2.0, 5.0, 0.0):  # `deploy --all` is idempotent: repeat it past a busy server's 503
        deployed = _prefect_cli("deploy", "--all", "--prefect-file", str(derived.resolve()), api=api)
        busy = "503 Service Unavailable" in deployed.stdout + deployed.stderr
        if deployed.returncode == 0 or not busy or not wait:
            break
        # the SQLite-backed server answers 503 while its database is locked by the waves' writes
        logger.warning(
            "worker: the Prefect server was busy (503) registering the deployments; again in %.0f s", wait
        )
        time.sleep(wait)
    if deployed.returncode != 0:
        raise ServiceError(
            f"worker: prefect deploy --all --prefect-file {config.deployments} failed:\n"
            f"{deployed.stdout[-3000:]}{deployed.stderr[-3000:]}"
        )
    seconds = time.monotonic() - t0
    record.write_text(
        json.dumps({"fingerprint": fingerprint, "deployments": names, "seconds": seconds}) + "\n"
    )
    logger.info("registered %d deployments on %s in %.1f s", len(names), api, seconds)
    return f"registered {len(names)} deployments in {seconds:.1f} s"


def requeue_orphaned_runs(config: ServicesConfig) -> int:
    """Flow runs of the worker's pool left Pending or Running by a worker that is gone (killed, or stopped while
    their process died with it) go back to Scheduled, so the worker about to start runs them again: the lifecycle
    resumes from its checkpoint and, keyed by its idempotency key, makes no second version. Called only when no
    worker of this state dir runs (one worker per pool here); returns how many."""
    return requeue_runs(config.url("prefect") + "/api", work_pool(config))


def requeue_runs(api: str, pool: str, crashed_since: float | None = None) -> int:
    """Flow runs of `pool` left Pending or Running, and with `crashed_since` (epoch s) those that crashed since
    then (taken down with their worker), back to Scheduled; returns how many. The supervisor of the worker calls
    it before it starts the worker again after a crash (`python -m mint_app.services requeue ...`)."""
    types = ["PENDING", "RUNNING"] + (["CRASHED"] if crashed_since is not None else [])
    query = {
        "work_pools": {"name": {"any_": [pool]}},
        "flow_runs": {"state": {"type": {"any_": types}}},
        "limit": 200,
        "offset": 0,
    }
    try:
        found = httpx.post(f"{api}/flow_runs/filter", json=query, timeout=10, trust_env=False)
    except httpx.HTTPError as e:
        logger.warning("could not list the flow runs of pool %s at %s: %s", pool, api, e)
        return 0
    if found.status_code != 200:
        return 0
    n = 0
    for run in found.json():
        if run["state_type"] == "CRASHED":
            ended = run.get("end_time") or (run.get("state") or {}).get("timestamp")
            when = _epoch(ended)
            if crashed_since is None or when is None or when < crashed_since:
                continue  # crashed before this worker died: not ours to run again
        state = {
            "type": "SCHEDULED",
            "name": "Rescheduled",
            "message": "its worker was gone; requeued to resume from its checkpoint",
        }
        done = httpx.post(
            f"{api}/flow_runs/{run['id']}/set_state",
            json={"state": state, "force": True},
            timeout=10,
            trust_env=False,
        )
        if done.status_code in (200, 201):
            n += 1
            logger.info(
                "requeued flow run %s (%s), left %s by a worker that is gone",
                run["name"],
                run["id"],
                run["state_type"],
            )
    return n


def _epoch(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _prepare(name: ServiceName, config: ServicesConfig) -> None:
    """Create what a service needs before its first start (PostgreSQL databases)."""
    if name == "mlflow" and config.mlflow_backend_url and config.mlflow_backend().startswith("postgresql"):
        ensure_postgres_database(config.mlflow_backend())
    database = config.prefect_database()
    if name == "prefect" and database and database.startswith("postgresql"):
        ensure_postgres_database(database)


def _launch(name: ServiceName, config: ServicesConfig) -> subprocess.Popen[bytes]:
    cmd, extra_env = command(name, config)
    _, _, log = _paths(config, name)
    env = {**os.environ, **extra_env}
    if name == "prefect":
        env.pop("PREFECT_API_URL", None)  # the server must not think of itself as a client of another one
    if name == "vllm":  # its own environment: nothing of mint's may reach its imports
        for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(key, None)
    if config.supervise:  # it copies the service's output into the rotating log and restarts it after a crash
        cmd = [
            *(sys.executable, "-m", "mint_app.supervise", "--log", str(log)),
            *("--max-bytes", str(config.log_max_bytes), "--backups", str(config.log_backups)),
            *("--health-url", config.url(name) + HEALTH_PATH[name]),
            # the key the service itself was started with (in its environment, never on a command line)
            *(("--health-key-env", HEALTH_KEY_ENV[name]) if env.get(HEALTH_KEY_ENV.get(name, "")) else ()),
            *("--max-restarts", str(config.max_restarts)),
            # the worker's flow runs are given 30 s to report their own end after a crash of the worker
            *("--orphans", "wait 30" if name == "worker" else "kill"),
            # the runs a crashed worker took down with it are requeued before it starts again (they resume)
            *(("--before-restart", _requeue_command(config)) if name == "worker" else ()),
            *("--", *cmd),
        ]
    # appended, never truncated: the supervisor writes through its rotating handler, and what it says itself
    # (it is small; a traceback of its own) lands here too
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    _CHILDREN[proc.pid] = proc
    _write_record(config, name, proc.pid, config.url(name))
    logger.info("started %s (pid %d), log %s", name, proc.pid, log)
    return proc


def _requeue_command(config: ServicesConfig) -> str:
    api, pool = config.url("prefect") + "/api", work_pool(config)
    return shlex.join([sys.executable, "-m", "mint_app.services", "requeue", api, pool])


def startup_timeout(config: ServicesConfig, name: ServiceName) -> float:
    """Seconds `name` may take to answer its health check after it is launched."""
    return config.vllm_start_timeout_s if name == "vllm" else config.startup_timeout


def _check_serving(config: ServicesConfig, names: list[ServiceName]) -> None:
    """With serving vllm: refuse what cannot work before anything starts (vLLM's environment, a base vLLM
    cannot run, a front with no vLLM behind it); vllm with serving mint is refused too (nothing would front it)."""
    if config.serving == "mint":
        if "vllm" in names:
            raise ServiceError("vllm: it runs behind mint serve with serving vllm (mint up --serving vllm)")
    elif "vllm" in names:
        vllm_config(config)  # raises ServiceError naming what is wrong
    elif "serve" in names and status(config, ["vllm"])[0].state == "stopped":
        raise ServiceError(
            "serve: with serving vllm, mint serve fronts the vLLM server, which is not running "
            "(start it too: mint up --serving vllm --only vllm,serve)"
        )
    _check_base(config, names)


def _check_base(config: ServicesConfig, names: list[ServiceName]) -> None:
    """The base that serve (and vllm) will load, checked before either starts: its files and what the serving
    backend runs (vLLM: its architectures and CPU head sizes). ServiceError naming the directory and every
    problem. The tokenizer itself is checked where torch loads anyway (the flows' check_base, mint serve)."""
    from mint_core.serving.base_check import check_base  # reads files only here: no torch in the supervisor

    starting = [
        s.name for s in status(config, [n for n in ("vllm", "serve") if n in names]) if s.state == "stopped"
    ]
    base = Path(serve_base(config)) if starting else None
    if base is None or not base.is_dir():
        return
    device = config.serve_device or ServingConfig.load(config.serve_config).device
    try:
        check_base(
            base, serving=config.serving, vllm_python=config.vllm_python, device=device, load_tokenizer=False
        )
    except BaseError as e:
        raise ServiceError(f"{starting[0]}: {e}") from None


# ---------------------------------------------------------------------------------------------------------
# the three operations


def status(config: ServicesConfig, names: list[ServiceName] | None = None) -> list[Service]:
    """What runs under the state dir; a record left by a process that is gone is removed."""
    out = []
    for name in names or _known_names(config):
        _, _, log = _paths(config, name)
        record = _read_record(config, name)
        if record is None or not _alive(record["pid"], record.get("create_time")):
            if record is not None:
                _remove_record(config, name)
            out.append(Service(name, "stopped", config.url(name), None, log))
            continue
        url = record.get("url") or config.url(name)
        state: State = (
            "running" if _healthy(url, HEALTH_PATH[name], key=_health_key(config, name)) else "unhealthy"
        )
        out.append(Service(name, state, url, record["pid"], log))
    return out


def start(
    config: ServicesConfig,
    names: list[ServiceName] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Service]:
    """Start the named services (by default `services_for(config)`) and wait until each answers its health check.

    A service already running under the state dir is reused (waited for if still starting). Services are
    launched together and waited for together (vLLM first, then its front); if any fails, the others stay up and
    one ServiceError names every failure with the tail of its log. A service slower than PROGRESS_EVERY_S is
    reported every PROGRESS_EVERY_S through `progress` (default: the log).
    """
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    names = names or services_for(config)
    if "worker" in names and len(names) > 1:  # the worker's deployments are registered on a Prefect server up
        first = {s.name: s for s in start(config, [n for n in names if n != "worker"], progress)}
        first["worker"] = start(config, ["worker"], progress)[0]
        return [first[n] for n in names]
    _check_serving(config, names)
    if "vllm" in names and "serve" in names:  # the front answers its health check once vLLM does
        first = {s.name: s for s in start(config, [n for n in names if n != "serve"], progress)}
        first["serve"] = start(config, ["serve"], progress)[0]
        return [first[n] for n in names]
    detail = register_deployments(config) if names == ["worker"] else None
    found = {s.name: s for s in status(config, names)}
    if detail is not None and found["worker"].state == "stopped" and (n := requeue_orphaned_runs(config)):
        detail += f"; requeued {n} run(s) a stopped worker had left Running"
    launched: dict[ServiceName, tuple[subprocess.Popen[bytes] | None, float]] = {}
    errors: list[str] = []
    for name in names:
        s = found[name]
        if s.state != "stopped":
            assert s.pid is not None
            launched[name] = (None, time.monotonic())  # wait for it like a fresh one, but never kill it
            continue
        port, host = config.port(name), config.bind_host(name)
        if not _port_free(host, port):
            errors.append(
                f"{name}: port {port} on {host} is already in use by a process not recorded in "
                f"{config.state_dir} (stop it, or choose another port: --{name}-port)"
            )
            continue
        try:
            _prepare(name, config)
            launched[name] = (_launch(name, config), time.monotonic())
        except (ServiceError, OSError, ValueError) as e:  # ValueError: a bad serving config file
            errors.append(f"{name}: {e}")
    results: dict[ServiceName, Service] = {}
    said = {name: t0 for name, (_, t0) in launched.items()}  # when each was last reported as still starting
    while launched:
        for name, (proc, t0) in list(launched.items()):
            record = _read_record(config, name) or {}
            url = record.get("url") or config.url(name)
            pid = proc.pid if proc is not None else int(record.get("pid", 0))
            _, _, log = _paths(config, name)
            if (proc is not None and proc.poll() is not None) or (proc is None and not _alive(pid)):
                del launched[name]
                code = f" with status {proc.returncode}" if proc is not None else ""
                errors.append(
                    f"{name} exited{code} before answering {url}{HEALTH_PATH[name]}:\n{log_tail(log)}"
                )
                _remove_record(config, name)
            elif _healthy(url, HEALTH_PATH[name], key=_health_key(config, name)):
                del launched[name]
                ms = None if proc is None else time.monotonic() - t0
                results[name] = Service(name, "running", url, pid, log, reused=proc is None, startup_s=ms)
                if ms is not None:
                    logger.info("%s healthy at %s after %.1f s", name, url, ms)
        now = time.monotonic()
        for name, (proc, t0) in list(launched.items()):
            timeout = startup_timeout(config, name)
            _, _, log = _paths(config, name)
            if now - t0 > timeout:
                del launched[name]
                errors.append(
                    f"{name} did not answer {config.url(name)}{HEALTH_PATH[name]} within "
                    f"{timeout:.0f} s:\n{log_tail(log)}"
                )
                if proc is not None:  # ours and broken: do not leave it half started
                    _terminate(proc.pid, config.stop_timeout)
                    _remove_record(config, name)
            elif now - said[name] >= PROGRESS_EVERY_S:
                said[name] = now
                msg = f"{name}: still starting after {now - t0:.0f} s (at most {timeout:.0f} s; log {log})"
                (progress or logger.info)(msg)
        if launched:
            time.sleep(0.25)
    if errors:
        raise ServiceError("\n\n".join(errors))
    if "worker" in results:
        results["worker"].detail = detail
    if "hooks" in results:
        results["hooks"].detail = register_webhook(config)
    return [results[n] for n in names]


# Pid file (in the state dir) of the redis-server that `mint run` started for its promotion locks before they
# moved into the catalog; `mint down` still stops one left running by such a run.
REDIS_PIDFILE = "redis.pid"


def stop_started_redis(config: ServicesConfig) -> int | None:
    """Stop the redis-server that an earlier `mint run` started (its pid file in the state dir); returns its pid,
    or None when there was none. A Redis that mint did not start (a system service) has no pid file there and is left
    alone, as is a pid now held by some other program."""
    pidfile = config.state_dir / REDIS_PIDFILE
    try:
        pid = int(pidfile.read_text().strip())
        ours = "redis-server" in " ".join(psutil.Process(pid).cmdline())
    except (OSError, ValueError, psutil.Error):
        ours = False
    if not ours:
        pidfile.unlink(missing_ok=True)
        return None
    _terminate(pid, config.stop_timeout)
    pidfile.unlink(missing_ok=True)
    logger.info("stopped redis-server (pid %d)", pid)
    return pid


def stop(config: ServicesConfig, names: list[ServiceName] | None = None) -> list[Service]:
    """Stop the named services (by default those of `serving`, and a recorded vLLM; serve first, MLflow last):
    SIGTERM, then SIGKILL after stop_timeout. Returns what was running before (an empty state for those that were
    not)."""
    out = []
    order = {n: i for i, n in enumerate(ALL_SERVICES)}
    for name in sorted(names or _known_names(config), key=order.__getitem__, reverse=True):
        _, _, log = _paths(config, name)
        record = _read_record(config, name)
        if record is None or not _alive(record["pid"], record.get("create_time")):
            _remove_record(config, name)
            out.append(Service(name, "stopped", config.url(name), None, log))
            continue
        pid = record["pid"]
        killed = _terminate(pid, config.stop_timeout)
        _CHILDREN.pop(pid, None)
        _remove_record(config, name)
        logger.info("stopped %s (pid %d)%s", name, pid, ", killed" if killed else "")
        out.append(Service(name, "running", record.get("url") or config.url(name), pid, log))
    return out[::-1]


if (
    __name__ == "__main__"
):  # `python -m mint_app.services requeue API POOL`: the worker's supervisor, after a crash
    if sys.argv[1:2] != ["requeue"] or len(sys.argv) != 4:
        sys.exit(
            "usage: python -m mint_app.services requeue PREFECT_API_URL POOL  (MINT_SUPERVISE_LAST_START: since)"
        )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    since = float(os.environ.get("MINT_SUPERVISE_LAST_START", "0")) or None
    print(
        f"requeued {requeue_runs(sys.argv[2], sys.argv[3], crashed_since=since)} run(s) of pool {sys.argv[3]}"
    )
