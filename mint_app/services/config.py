"""The settings of mint's local services (`ServicesConfig`, MINT_SERVICES_*), their names and what a service's
status reads (`Service`), and the database URLs they share."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from mint_core.errors import MintError
from mint_core.settings import Settings
from mint_core.types import Device

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

# `vllm` is the one vLLM, or replica 0 of a fleet; vllm-1 ... vllm-7 the other replicas (`replicas`)
ServiceName = Literal[
    "mlflow",
    "prefect",
    "vllm",
    "vllm-1",
    "vllm-2",
    "vllm-3",
    "vllm-4",
    "vllm-5",
    "vllm-6",
    "vllm-7",
    "serve",
    "hooks",
    "worker",
]
MAX_REPLICAS = 8
REPLICA_NAMES: tuple[ServiceName, ...] = (
    "vllm",
    "vllm-1",
    "vllm-2",
    "vllm-3",
    "vllm-4",
    "vllm-5",
    "vllm-6",
    "vllm-7",
)
"""The services of replica 0, 1, ... of a vLLM fleet (replica 0 is the `vllm` of a single vLLM)."""
VLLM_SIDE: tuple[ServiceName, ...] = REPLICA_NAMES
"""What runs in vLLM's environment, on loopback, behind mint serve."""
SERVICES: tuple[ServiceName, ...] = ("mlflow", "prefect", "serve", "hooks", "worker")
"""The services `mint up` starts by default (serving: mint); `services_for` adds vllm for serving: vllm."""
ALL_SERVICES: tuple[ServiceName, ...] = ("mlflow", "prefect", *VLLM_SIDE, "serve", "hooks", "worker")
"""Every service, in start order (stop goes the other way: mint serve before the vLLM it fronts)."""
ENV_PREFIX = "MINT_SERVICES_"
HEALTH_PATH: dict[ServiceName, str] = {
    "mlflow": "/health",
    "prefect": "/api/health",
    **dict.fromkeys(
        REPLICA_NAMES, "/health"
    ),  # sealed: asked with vLLM's key (HEALTH_KEY_ENV), as every route
    "serve": "/health",
    "hooks": "/health",
    "worker": "/health",  # the worker's healthcheck server: 200 while it polls its work pool
}
# The variables that may hold the key a service demands on its health route, the first set wins (mint's seal on
# vLLM covers every route; a replica given the routed key holds mint's full key in MINT_SEAL_KEY)
HEALTH_KEY_ENV: dict[ServiceName, tuple[str, ...]] = dict.fromkeys(
    REPLICA_NAMES, ("MINT_SEAL_KEY", "VLLM_API_KEY")
)
LOG_TAIL_LINES = 40
# The directory `dvc repro` builds the built-in base into (relative to the working directory).
BUILTIN_BASE = Path("data/base")
# The head sizes vLLM's CPU attention runs (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm_process.DEFAULT_PYTHON, not imported: that module's imports reach torch, which `mint up` never loads
VLLM_PYTHON = Path(".venv-vllm/bin/python")
# mint_core.lifecycle's WORK_DIR_ENV (workspace) and WORKER_ENV (leases), not imported: they load MLflow, which
# `mint up` does not (a unit test holds them equal)
WORK_DIR_ENV = "MINT_WORK_DIR"
WORKER_ENV = "MINT_WORKER_NAME"
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
    """Address every service binds to and is reached at (0.0.0.0 also exposes them to the network: then
    `mint up` refuses to start a service without its auth, unless `insecure`)."""
    auth: bool = True
    """Start each service with its auth: MLflow's auth app, the Prefect server's auth string, mint serve's
    serving keys, all from the access file (loopback too: any local user reaches a loopback port). False
    (`mint up --no-auth`): none asks, for a throwaway stack on loopback; on another host `mint up` then refuses
    (unless `insecure`)."""
    insecure: bool = False
    """Start a service on a non-loopback `host` even without its auth (`mint up --insecure`): it answers anyone
    on the network, and `mint status` shows it in red. Off: `mint up` refuses and says which service lacks what."""
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
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS)
    """With serving vllm: vLLM servers serving the same base (`mint up --replicas N`, `make up REPLICAS=N`).
    Replica i listens on 127.0.0.1:vllm_port+i (on a GPU host, on GPU i), each sealed with mint's key and
    supervised on its own; with N > 1, mint serve routes each request to one of them itself (consistent hashing
    on the served name: one adapter stays on one replica) and loads every revision on every replica, all or
    nothing. 1: one vLLM."""
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
    sets one: the largest rank of the built-in recipe (`add`'s 32, its spec's `recipe.rank`, a
    literal here so that `mint up` does not load torch; a test holds the two equal), above the serving default
    of 16 (vLLM's), so the main job's revisions load."""
    serve_device: Device | None = None
    """Device of `mint serve` (`--device`: cpu, cuda or cuda:N), and of the training of the flows it registers.
    Default: the serving config's device (cpu)."""
    hooks_port: int = Field(8001, ge=1, le=65535)
    """Port of the receiver of MLflow's alias webhook (`mint_app.services.webhooks`): serving follows `champion` moves."""
    hooks_sweep_s: float | None = Field(None, ge=0)
    """Seconds between the receiver's own reconcile passes over every policy and the router, its net for a missed
    alias event (`HooksConfig.sweep_s`); None: the receiver's default; 0: no sweep."""
    catalog_url: str | None = None
    """SQLAlchemy URL of the catalog the flows use (the receiver takes their promotion locks there). Default:
    sqlite:///<state_dir>/../catalog.db, the default Workspace's .mint/catalog.db."""
    worker_port: int = Field(4201, ge=1, le=65535)
    """Port of the Prefect worker's healthcheck server (`prefect worker start --with-healthcheck`)."""
    worker_name: str = Field(
        default_factory=lambda: f"mint-worker-{socket.gethostname()}", pattern=r"^[^@\s]+$"
    )
    """The worker's name in its work pool, one per worker: a worker that starts again requeues the runs that
    held their run lease under this name (docs/multi-host.md)."""
    worker_limit: int | None = Field(None, ge=1)
    """Flow runs the worker runs at once (`prefect worker start --limit`); None: no limit. 1 on a host that
    trains: one training run holds one base in memory."""
    prefect_url: str | None = None
    """The Prefect server when it runs on another host (http://host:4200): the worker polls it and registers
    the deployments there. None: this host's, on `prefect_port`."""
    mlflow_url: str | None = None
    """The MLflow server when it runs on another host (http://host:5000), for the flows the worker runs. None:
    this host's, on `mlflow_port`."""
    serve_url: str | None = None
    """The serving endpoint when it runs on another host (http://host:8000), where the flows evaluate and
    promote. None: this host's `mint serve`, on `serve_port`."""
    store_url: str | None = None
    """The adapter store the flows write, when every host shares it: an fsspec URL (s3://bucket/mint,
    file:///mnt/shared/store) or a directory. Training checkpoints are also kept under <store_url>/checkpoints,
    so a run whose host died resumes on another. None: mint serve's adapter root, checkpoints on this host only."""
    deployments: Path | None = Path("infra/prefect.yaml")
    """The prefect.yaml whose deployments (and their process work pool) `mint up` registers before it starts
    the worker; relative to the working directory, which flow runs start in. None: register none."""
    register_deployments: bool = True
    """Register the deployments file's deployments when the worker starts (once per change). False: a worker
    joining a pool whose deployments another host registered (`mint worker --no-register`)."""
    startup_timeout: float = Field(180.0, gt=0)
    """Seconds a service may take to answer its health check after it is launched."""
    stop_timeout: float = Field(30.0, gt=0)
    """Seconds between SIGTERM and SIGKILL when stopping (mint serve finishes requests in flight first)."""
    supervise: bool = True
    """Bring a service that crashes after it was healthy back up (`mint_app.services.supervise`: backing off 1-30 s, at
    most `max_restarts` within 10 minutes). Off: a crashed service stays down until the next `mint up`."""
    max_restarts: int = Field(5, ge=0)
    """Restarts within 10 minutes after which supervision gives up and the service stays down (reported)."""
    log_max_bytes: int = Field(20 * 2**20, ge=2**16)
    """A service's log rolls over at this size (<name>.log -> <name>.log.1 ...); logs are appended across
    restarts and `mint up`s, never truncated (`mint logs [service]` shows them)."""
    log_backups: int = Field(5, ge=1)
    """Rolled-over logs kept per service."""

    def port(self, name: ServiceName) -> int:
        if name in REPLICA_NAMES:
            return self.vllm_port + REPLICA_NAMES.index(name)
        ports = {"mlflow": self.mlflow_port, "prefect": self.prefect_port, "serve": self.serve_port}
        return {**ports, "hooks": self.hooks_port, "worker": self.worker_port}[name]

    def bind_host(self, name: ServiceName) -> str:
        """The address a service binds to: `host`, but loopback for vLLM (users reach it through the front)."""
        return "127.0.0.1" if name in VLLM_SIDE else self.host

    def vllm_services(self) -> list[ServiceName]:
        """The vLLM side `mint up` starts with serving vllm: one vLLM, or the replicas."""
        return list(REPLICA_NAMES[: self.replicas])

    def url(self, name: ServiceName) -> str:
        """The service's base URL (for Prefect the API is under /api): another host's where `prefect_url`,
        `mlflow_url` or `serve_url` names one."""
        remote = {"prefect": self.prefect_url, "mlflow": self.mlflow_url, "serve": self.serve_url}.get(name)
        if remote:
            return remote.rstrip("/").removesuffix("/api")
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
    auth: bool | None = None
    """Whether it runs with its auth (or has nothing to guard), as its record says; None: stopped, or started
    before records said."""
    without_auth: str | None = None
    """With auth False: why it answers anyone who reaches its port (`exposure.without_auth`)."""
    exposed: bool = False
    """It listens on a non-loopback address (its record): without its auth, it was started with --insecure."""

    @property
    def open_url(self) -> str:
        """The page a person opens: the MLflow UI, the Prefect dashboard, or the served models."""
        return self.url + "/v1/models" if self.name == "serve" else self.url

    @property
    def api_url(self) -> str:
        """What clients are configured with: MLFLOW_TRACKING_URI, PREFECT_API_URL, the serving base URL."""
        return self.url + "/api" if self.name == "prefect" else self.url


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
    vllm = config.vllm_services() if config.serving == "vllm" else []
    return [n for n in ALL_SERVICES if n not in VLLM_SIDE or n in vllm]


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


DEFAULT_POOL = "mint-process"


def deployments_file(config: ServicesConfig) -> dict[str, Any]:
    if config.deployments is None:
        return {}
    try:
        doc = yaml.safe_load(config.deployments.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ServiceError(f"worker: cannot read the deployments file {config.deployments}: {e}") from e
    return doc if isinstance(doc, dict) else {}


def work_pool(config: ServicesConfig) -> str:
    """The process work pool the deployments file names (one for all of them), else mint-process."""
    deployments = deployments_file(config).get("deployments") or []
    pools = {str(d["work_pool"]["name"]) for d in deployments if (d.get("work_pool") or {}).get("name")}
    if len(pools) > 1:
        raise ServiceError(
            f"worker: {config.deployments} names several work pools ({sorted(pools)}); one worker runs one"
        )
    return str(pools.pop()) if pools else DEFAULT_POOL
