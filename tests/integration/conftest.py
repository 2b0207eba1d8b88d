"""A real serving endpoint for the contract tests, on each backend.

`endpoint` is parametrized over the two backends behind the one serving seam: `mint` (each test module gets mint's
embedded server, started as `mint serve` in a subprocess on a free loopback port, with an adapter store in a
temporary directory) and `vllm` (one real vLLM per test session, from `.venv-vllm`, behind mint's front, `mint
serve --backend vllm`; the module's adapters are unloaded when it ends). vLLM's CPU attention needs a head_dim of
32 or more, so the vLLM side serves `VLLM_BASE_NAME`, a tiny dense base with head_dim 32. Set MINT_SERVING_URL (and MINT_SERVING_API_KEY,
MINT_SERVING_ADMIN_TOKEN, MINT_SERVING_STORE = a directory that server can read as its adapter store, and
MINT_SERVING_BASE_DIR = the base model directory, so tests can build matching adapters) to run the same tests
against another server that speaks the contract, such as a vLLM deployment (infra/vllm/).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prefect.settings import PREFECT_API_URL, temporary_settings

from mint_app.service_config import Service, ServiceName, ServicesConfig
from mint_app.services import start, stop
from mint_core.engine.base import Base, build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.serving.client import ServingClient
from mint_core.serving.vllm_process import DEFAULT_PYTHON, VLLMConfig, vllm_available
from mint_core.types import Site

VLLM_PYTHON = Path(os.environ.get("MINT_VLLM_PYTHON", DEFAULT_PYTHON))
VLLM_BASE_NAME = "tiny-vllm"
VLLM_KEY = "vllm-key-for-tests"
RESOLVER_TOKEN = "resolver-token-for-tests"


def cli_env(unset: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a `mint` or `dvc` subprocess: this interpreter's commands first on PATH, a
    wide terminal (rich wraps no table row or URL), no telemetry, no hub; the variables named in `unset` left out,
    `extra` added."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "COLUMNS": "240",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DVC_NO_ANALYTICS": "1",
            "HF_HUB_OFFLINE": "1",
            **extra,
        }
    )
    return env


def mint_cli(
    *args: str,
    timeout: float = 300,
    check: bool = False,
    cwd: Path | None = None,
    unset: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """`mint <args>` in a subprocess of this interpreter, in `cli_env(unset)`."""
    return subprocess.run(
        [sys.executable, "-m", "mint_app.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=cli_env(unset),
        timeout=timeout,
        check=check,
    )


@dataclass
class Endpoint:
    backend: str  # "mint" or "vllm"
    url: str  # http://host:port
    api_key: str | None
    admin_token: str
    store: Path  # the server's adapter store (lora_path may be relative to it)
    base: Base  # a base equal to the served one, to build adapters for it
    base_name: str
    process: subprocess.Popen[str] | None = None
    vllm_url: str | None = None  # the vLLM behind the front (backend vllm), reached directly with VLLM_KEY

    def vllm_models(self) -> dict[str, dict[str, object]]:
        """What vLLM itself lists (backend vllm), asked past the front."""
        assert self.vllm_url is not None
        r = httpx.get(
            self.vllm_url + "/v1/models", headers={"Authorization": f"Bearer {VLLM_KEY}"}, timeout=30
        )
        r.raise_for_status()
        return {m["id"]: m for m in r.json()["data"]}

    def client(self) -> ServingClient:
        return ServingClient(self.url, api_key=self.api_key, admin_token=self.admin_token)

    @property
    def sites(self) -> dict[str, Site]:
        return self.base.sites

    def make_adapter(
        self, name: str, seed: int, rank: int = 8, std: float = 0.3, targets: list[str] | None = None
    ) -> Path:
        """Write a random adapter for the served base into the store; returns its directory."""
        targets = targets or ["q_proj", "k_proj", "v_proj", "o_proj"]
        a = random_adapter(
            self.sites, targets, rank, seed=seed, std=std, base_fingerprint=self.base.fingerprint
        )
        path = self.store / name
        save_adapter(a, path, self.sites)
        return path


def require(available: bool, what: str) -> None:
    """Skip the test when a service it needs is missing, except under CI=true (the CI entry point sets it), where
    a missing service fails it: CI must not go green with the test unrun."""
    if available:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {what}", pytrace=False)
    pytest.skip(what)


def vllm_tiny_base() -> Base:
    """The tiny dense base with the head_dim vLLM's CPU attention needs (32: two heads over 64 channels)."""
    return build_tiny_base(
        "dense", seed=0, tokenizer=byte_tokenizer(), num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )


def save_tiny_base(base_dir: Path, vllm: bool = False) -> Path:
    """The tiny dense test base (seed 0, byte tokenizer) written as a local Hugging Face model directory (with
    `vllm`, the variant vLLM can run)."""
    tiny = vllm_tiny_base() if vllm else build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    tiny.model.save_pretrained(base_dir)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(base_dir)
    return base_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LOGS: dict[int, Path] = {}


def server_log(proc: subprocess.Popen[str]) -> str:
    """What a server started by `start_server` has printed so far."""
    path = LOGS.get(proc.pid)
    return path.read_text(errors="replace") if path and path.exists() else ""


def launch(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """`cmd` with `env` over this environment less the project's own interpreter settings (a vLLM interpreter
    must not import this venv's packages), its output in `log` (read back with `server_log`)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen(
        cmd, env={**clean, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True
    )
    LOGS[proc.pid] = log
    return proc


def start_server(
    store: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    healthy_within_s: float = 90,
) -> tuple[subprocess.Popen[str], str]:
    """`mint serve` on the built-in tiny dense base; returns the process and its URL once healthy (within
    `healthy_within_s`: a benchmark's multi-GB base takes longer to load and fingerprint)."""
    port = port or free_port()
    # Output goes to a file: a pipe nobody reads would block the server once its buffer fills.
    log = tempfile.NamedTemporaryFile("w", prefix=f"mint-serve-{port}-", suffix=".log", delete=False)  # noqa: SIM115 (the server owns it)
    full_env = {**os.environ, "MINT_SERVE_ADMIN_TOKEN": "admin-secret", **(env or {})}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mint_app.cli",
            "serve",
            "--port",
            str(port),
            "--adapter-root",
            str(store),
            *extra,
        ],
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    LOGS[proc.pid] = Path(log.name)
    url = f"http://127.0.0.1:{port}"
    client = ServingClient(url)
    deadline = time.monotonic() + healthy_within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mint serve exited with {proc.returncode}:\n{server_log(proc)}")
        if client.health():
            return proc, url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"mint serve did not become healthy in {healthy_within_s:g} s")


def stop_server(proc: subprocess.Popen[str], timeout: float = 30) -> int:
    """SIGTERM, then SIGKILL after `timeout`; to the server's whole process group when it leads one (vLLM's engine
    core and worker would otherwise outlive a killed API server)."""

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        return proc.wait()


def run_fault_suite(*args: str, timeout: float = 3500) -> subprocess.CompletedProcess[str]:
    """`scripts/faults.py` with `args`. On a timeout, or when the test itself is stopped (pytest-timeout), the
    suite gets SIGTERM and time to stop the services its scenarios started; only then is it killed. (A bare
    `subprocess.run` timeout kills it at once, and its vLLM, front and servers run on.)"""
    cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "faults.py"), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@dataclass
class VLLMServer:
    """One vLLM for the test session, and mint's front before it (both subprocesses)."""

    vllm: subprocess.Popen[str]
    front: subprocess.Popen[str]
    url: str  # the front's
    vllm_url: str
    store: Path
    base_dir: Path
    catalog_url: str


def vllm_command(
    base_dir: Path, port: int, resolver_url: str | None, max_loras: int = 4, seal: bool = True
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a test's vLLM (key VLLM_KEY, sealed unless `seal` is False)."""
    return VLLMConfig(
        python=VLLM_PYTHON,
        model=base_dir,
        served_model_name=base_dir.name,
        port=port,
        api_key=VLLM_KEY,
        max_loras=max_loras,
        max_lora_rank=16,  # as mint serve's default, so the contract's rank checks read the same
        max_model_len=512,
        resolver_url=resolver_url,
        resolver_token=RESOLVER_TOKEN,
        seal=seal,
    ).command()


def vllm_healthy(url: str) -> bool:
    """vLLM answers /health (asked with its key: the seal refuses every route without it)."""
    try:
        r = httpx.get(url + "/health", headers={"Authorization": f"Bearer {VLLM_KEY}"}, timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def start_vllm(
    base_dir: Path,
    port: int,
    resolver_url: str | None,
    log: Path,
    max_loras: int = 4,
    timeout_s: float = 300,
    seal: bool = True,
) -> subprocess.Popen[str]:
    """vLLM from `.venv-vllm` on loopback `port` (its key VLLM_KEY), once it answers /health. (Not in a session of
    its own: started so, `test_late_joiner_is_served_right[vllm]` failed its overlap check twice in two runs.)"""
    cmd, env = vllm_command(base_dir, port, resolver_url, max_loras, seal)
    out = log.open("w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, text=True)
    LOGS[proc.pid] = log
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-5000:]}")
        if vllm_healthy(f"http://127.0.0.1:{port}"):
            return proc
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vLLM did not become healthy in {timeout_s:g} s:\n{log.read_text()[-5000:]}")


def start_front(
    vllm_url: str,
    store: Path,
    base_dir: Path,
    port: int,
    catalog_url: str | None,
    *extra: str,
    api_key: str | None = None,
    golden_interval_s: float = 0,
) -> tuple[subprocess.Popen[str], str]:
    """`mint serve --backend vllm` before the vLLM at `vllm_url` (inference keyed with `api_key` if given). Its
    golden probe is off unless `golden_interval_s` is given: the session's vLLM is not supervised (a poisoned one
    would be killed for good), and tests that count vLLM's requests must see only their own."""
    env = {
        "MINT_SERVE_BACKEND": "vllm",
        "MINT_SERVE_VLLM_URL": vllm_url,
        "MINT_SERVE_VLLM_API_KEY": VLLM_KEY,
        "MINT_SERVE_RESOLVER_TOKEN": RESOLVER_TOKEN,
        "MINT_SERVE_MAX_LORA_RANK": "16",
        "MINT_SERVE_GOLDEN_INTERVAL_S": str(golden_interval_s),
    }
    if catalog_url:
        env["MINT_SERVE_CATALOG_URL"] = catalog_url
    if api_key:
        env["MINT_SERVE_API_KEY"] = api_key
    return start_server(store, "--base", str(base_dir), *extra, env=env, port=port)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A real vLLM (loopback, its own key, mint's resolver plugin on) and mint's front, for the session."""
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
    root = tmp_path_factory.mktemp("vllm")
    base_dir = save_tiny_base(root / VLLM_BASE_NAME, vllm=True)
    store = root / "store"
    store.mkdir()
    catalog_url = f"sqlite:///{root / 'catalog.db'}"
    vport, fport = free_port(), free_port()
    vllm = start_vllm(base_dir, vport, f"http://127.0.0.1:{fport}", root / "vllm.log")
    try:
        front, url = start_front(f"http://127.0.0.1:{vport}", store, base_dir, fport, catalog_url)
        try:
            yield VLLMServer(vllm, front, url, f"http://127.0.0.1:{vport}", store, base_dir, catalog_url)
        finally:
            stop_server(front)
    finally:
        stop_server(vllm, timeout=60)


def unload_all(url: str) -> None:
    """Unload every adapter the server at `url` lists (vLLM's adapters are shared by every front before it)."""
    http = httpx.Client(base_url=url, timeout=60)
    admin = {"Authorization": "Bearer admin-secret"}
    for card in http.get("/v1/models").json()["data"]:
        if card.get("parent"):
            http.post("/v1/unload_lora_adapter", json={"lora_name": card["id"]}, headers=admin)


@pytest.fixture(scope="module", params=["mint", "vllm"])
def endpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    url = os.environ.get("MINT_SERVING_URL")
    if url:
        if request.param != "mint":
            pytest.skip("MINT_SERVING_URL names the one server under test")
        store = Path(os.environ["MINT_SERVING_STORE"])
        base = load_base(os.environ["MINT_SERVING_BASE_DIR"])
        yield Endpoint(
            "external",
            url,
            os.environ.get("MINT_SERVING_API_KEY"),
            os.environ["MINT_SERVING_ADMIN_TOKEN"],
            store,
            base,
            os.environ.get("MINT_SERVING_BASE_NAME", Path(os.environ["MINT_SERVING_BASE_DIR"]).name),
        )
        return
    if request.param == "vllm":
        server: VLLMServer = request.getfixturevalue("vllm_server")
        unload_all(server.url)
        try:
            yield Endpoint(
                "vllm",
                server.url,
                None,
                "admin-secret",
                server.store,
                load_base(server.base_dir),  # as the front fingerprints it
                VLLM_BASE_NAME,
                server.front,
                server.vllm_url,
            )
        finally:
            unload_all(server.url)
        return
    store = tmp_path_factory.mktemp("store")
    proc, url = start_server(store)
    try:
        # the same weights `mint serve --base tiny-dense` builds (seed 0), so adapters made here fit it
        base = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
        yield Endpoint("mint", url, None, "admin-secret", store, base, "tiny-dense", proc)
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------------------------------------------
# Real MLflow and Prefect servers, one of each per test session, started through mint_app.services (what
# `mint up` runs) on free loopback ports with their state in temporary directories.

PG_ADMIN_URL = os.environ.get("MINT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@contextmanager
def running_service(name: ServiceName, state_dir: Path, **settings: object) -> Iterator[Service]:
    """One service from mint_app.services, started in `state_dir` on a free port, stopped afterwards."""
    config = ServicesConfig.model_validate({"state_dir": state_dir, f"{name}_port": free_port(), **settings})
    service = start(config, [name])[0]
    try:
        yield service
    finally:
        stop(config, [name])


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real MLflow tracking server + registry (SQLite store, proxied artifacts, temporary dir)."""
    with running_service("mlflow", tmp_path_factory.mktemp("mlflow")) as s:
        yield s.url


@pytest.fixture(scope="session")
def mlflow_server_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real MLflow server whose store is a fresh PostgreSQL database (127.0.0.1:5432, user
    postgres, or MINT_TEST_PG_URL), created for the session and dropped at its end. Skips without PostgreSQL (fails
    under CI=true)."""
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as e:
        admin.dispose()
        require(False, f"PostgreSQL not reachable at {PG_ADMIN_URL}: {str(e.orig).strip().splitlines()[0]}")
    name = f"mint_mlflow_{uuid.uuid4().hex[:16]}"
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    try:
        # the database does not exist yet: starting the service creates it
        with running_service("mlflow", tmp_path_factory.mktemp("mlflow-pg"), mlflow_backend_url=url) as s:
            yield s.url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """API URL (http://127.0.0.1:<port>/api) of a real Prefect server with its own PREFECT_HOME. For the
    session, PREFECT_API_URL points at it, in os.environ (subprocesses) and in Prefect's settings of this
    process (read once at import), so flows run by tests report to it; both are restored afterwards."""
    with running_service("prefect", tmp_path_factory.mktemp("prefect")) as s:
        previous = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = s.api_url
        try:
            with temporary_settings(updates={PREFECT_API_URL: s.api_url}):
                yield s.api_url
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous
