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

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from mint_app.services.config import Service, ServiceName, ServicesConfig
from mint_app.services.control import start, stop
from mint_app.services.mlflow_auth import as_service
from mint_core import access
from mint_core.access import Access, access_path, save
from mint_core.engine.base import Base, build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.serving.client import ServingClient
from mint_core.serving.vllm_process import vllm_available
from mint_core.types import Site
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_BASE_NAME,
    VLLM_KEY,
    VLLM_PYTHON,
    free_port,
    save_tiny_base,
    start_front,
    start_server,
    start_vllm,
    stop_server,
    unload_all,
)
from mint_testkit.skips import require


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
                ADMIN_TOKEN,
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
        yield Endpoint("mint", url, None, ADMIN_TOKEN, store, base, "tiny-dense", proc)
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------------------------------------------
# Real MLflow and Prefect servers, one of each per test session, started through mint_app.services.control (what
# `mint up` runs) on free loopback ports with their state in temporary directories.

PG_ADMIN_URL = os.environ.get("MINT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


_SESSION_ACCESS = Access.first()
"""The access file of every server `running_service` starts in this test process."""


@contextmanager
def running_service(name: ServiceName, state_dir: Path, **settings: object) -> Iterator[Service]:
    """One service from mint_app.services.control, started in `state_dir` on a free port, stopped afterwards."""
    config = ServicesConfig.model_validate({"state_dir": state_dir, f"{name}_port": free_port(), **settings})
    # every server of this test process asks the same service login (one access file's), so the login exported
    # for one session server is right for the others (the SQLite and the PostgreSQL MLflow share a process)
    if not access_path(config.state_dir).exists():
        save(access_path(config.state_dir), _SESSION_ACCESS)
    service = start(config, [name])[0]
    try:
        # MLflow asks a login: this process's clients log in as mint's service account, as mint's services do
        with as_service(config) if name == "mlflow" else nullcontext():
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
    """API URL (http://127.0.0.1:<port>/api) of a real Prefect server with its own PREFECT_HOME, behind its auth
    string. For the session, PREFECT_API_URL points at it and PREFECT_API_AUTH_STRING is its string, in
    os.environ (subprocesses) and in Prefect's settings of this process (read once at import), so flows run by
    tests report to it; both are restored afterwards."""
    state_dir = tmp_path_factory.mktemp("prefect")
    with running_service("prefect", state_dir) as s:
        # the server asks its auth string (the state dir's access file): the session's clients send it
        auth = access.load(access.access_path(state_dir)).service.prefect_auth
        values = {"PREFECT_API_URL": s.api_url, "PREFECT_API_AUTH_STRING": auth}
        previous = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            with temporary_settings(updates={PREFECT_API_URL: s.api_url, PREFECT_API_AUTH_STRING: auth}):
                yield s.api_url
        finally:
            for k, v in previous.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
