"""The local services: `mint up` / `status` / `down` through the command line, and the session fixtures other
integration tests use (MLflow on SQLite and on PostgreSQL, Prefect)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import sqlalchemy as sa
from mlflow import MlflowClient
from prefect import flow

from mint_app.job.main import redis_up
from mint_app.services import config as service_config
from mint_app.services import control as services
from mint_app.services.config import SERVICES, ServicesConfig
from mint_app.services.control import REDIS_PIDFILE, stop, stop_started_redis
from mint_app.services.prefect_auth import auth_header
from mint_core.access import access_path, load
from mint_testkit.harness import free_port, mint_cli
from mint_testkit.skips import require
from tests.integration.conftest import PG_ADMIN_URL

pytestmark = pytest.mark.integration
FLOWS = ("wave", "lifecycle", "promote", "rollback", "reconcile", "retrain", "prefetch", "canary", "route")
"""A deployment of each, registered by `mint up` from infra/prefect.yaml."""


def mint(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return mint_cli(*args, timeout=timeout)


def gone(pid: int) -> bool:
    """No such process, or only a zombie waiting to be reaped by whoever adopted it."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow  # 65 s: a whole stack up, status, up again, down through the CLI
def test_up_status_down_through_the_cli(tmp_path: Path) -> None:
    state = tmp_path / "run"
    ports = {name: free_port() for name in SERVICES}
    flags = ["--state-dir", str(state), "--serve-adapter-root", str(tmp_path / "store")]
    flags += [f"--{name}-port={port}" for name, port in ports.items()]
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        up = mint("up", *flags)
        assert up.returncode == 0, up.stdout + up.stderr
        assert up.stdout.count("started in") == len(SERVICES), up.stdout
        pids = {name: int((state / f"{name}.pid").read_text()) for name in ports}

        assert httpx.get(urls["mlflow"] + "/health", trust_env=False).status_code == 200
        assert httpx.get(urls["prefect"] + "/api/health", trust_env=False).json() is True
        token = (state / "serve.token").read_text().strip()
        admin = {"Authorization": f"Bearer {token}"}  # serving keys are on: mint's own credential
        assert httpx.get(urls["serve"] + "/v1/models", trust_env=False).status_code == 401
        models = httpx.get(urls["serve"] + "/v1/models", headers=admin, trust_env=False).json()
        # data/base when `dvc repro` has built it, else the tiny dense base `mint up` wrote into the state dir
        built = (service_config.BUILTIN_BASE / "config.json").is_file()
        assert [m["id"] for m in models["data"]] == ["base" if built else "tiny-dense"]
        unload = httpx.post(
            urls["serve"] + "/v1/unload_lora_adapter",
            json={"lora_name": "none"},
            headers={"Authorization": f"Bearer {token}"},
            trust_env=False,
        )
        assert unload.status_code == 404  # the admin token in the state dir is the server's

        status = mint("status", "--state-dir", str(state))
        assert status.returncode == 0, status.stderr
        rows = [
            line for line in status.stdout.splitlines() if "running" in line and "│" in line
        ]  # table rows
        assert len(rows) == len(SERVICES), status.stdout
        for name, url in urls.items():
            assert str(pids[name]) in status.stdout
            assert url in status.stdout
        assert f"{urls['serve']}/v1/models" in status.stdout
        assert f"{urls['prefect']}/api" in status.stdout

        # the worker's deployments: every flow, registered once, with this state dir's workspace
        assert re.search(rf"registered {len(FLOWS)} deployments in \d", up.stdout), up.stdout
        api = urls["prefect"] + "/api"
        prefect = auth_header(load(access_path(state)).service.prefect_auth)  # the server asks its string
        found = httpx.post(api + "/deployments/filter", json={"limit": 50}, headers=prefect, trust_env=False)
        found = found.json()
        assert {d["name"] for d in found} == {*FLOWS}, found
        for d in found:
            assert d["description"] and d["work_pool_name"] == "mint-process", d
            assert d["parameters"]["workspace"]["serving_url"] == urls["serve"], d
            assert d["parameter_openapi_schema"]["properties"], d

        again = mint("up", *flags)  # idempotent: reuses every service, registers nothing again
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.count("already running") == len(SERVICES), again.stdout
        assert f"{len(FLOWS)} deployments unchanged" in again.stdout, again.stdout
        assert len(
            httpx.post(
                api + "/deployments/filter", json={"limit": 50}, headers=prefect, trust_env=False
            ).json()
        ) == len(FLOWS)
        assert {name: int((state / f"{name}.pid").read_text()) for name in ports} == pids

        down = mint("down", "--state-dir", str(state))
        assert down.returncode == 0, down.stderr
        assert not list(state.glob("*.pid"))
        assert all(gone(pid) for pid in pids.values())
        after = mint("status", "--state-dir", str(state))
        assert after.stdout.count("stopped") == len(SERVICES), after.stdout
    finally:
        stop(ServicesConfig(state_dir=state))  # whatever an assertion left running


def test_start_reports_a_service_that_dies_with_the_tail_of_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dies(name: str, config: ServicesConfig) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", "import sys; print('no base at /nowhere'); sys.exit(3)"], {}

    monkeypatch.setattr(services, "command", dies)
    config = ServicesConfig(state_dir=tmp_path / "run", serve_port=free_port())
    with pytest.raises(
        service_config.ServiceError, match=r"(?s)serve exited with status 3 .*no base at /nowhere"
    ):
        services.start(config, ["serve"])
    assert not (tmp_path / "run" / "serve.pid").exists()
    assert [s.state for s in services.status(config)] == ["stopped"] * len(SERVICES)

    # a pid file left by a process that is gone is stale: reported stopped, and removed
    exited = subprocess.Popen(["true"])
    exited.wait()
    (tmp_path / "run" / "serve.pid").write_text(f"{exited.pid}\n")
    assert services.status(config, ["serve"])[0].state == "stopped"
    assert not (tmp_path / "run" / "serve.pid").exists()


def test_a_recorded_pid_now_held_by_another_process_is_left_alone(tmp_path: Path) -> None:
    """The pid of a record is another process's now (the service exited, the pid was reused): the service is
    stopped, its record removed, and the process that holds the pid is never signalled."""
    config = ServicesConfig(state_dir=tmp_path)
    other = subprocess.Popen(["sleep", "60"])
    try:
        for name in ("serve", "mlflow"):
            (tmp_path / f"{name}.pid").write_text(f"{other.pid}\n")
            earlier = psutil.Process(other.pid).create_time() - 60  # when the recorded process started
            (tmp_path / f"{name}.json").write_text(json.dumps({"url": "http://x", "create_time": earlier}))
        assert services.status(config, ["serve"])[0].state == "stopped"
        assert not (tmp_path / "serve.pid").exists()
        assert services.stop(config, ["mlflow"])[0].pid is None
        assert not (tmp_path / "mlflow.pid").exists()
        assert other.poll() is None  # still running
    finally:
        other.kill()
        other.wait()


def test_stop_kills_a_service_that_ignores_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    code = (
        "import functools, http.server as h, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"h.ThreadingHTTPServer(('127.0.0.1', {port}), "
        f"functools.partial(h.SimpleHTTPRequestHandler, directory={str(tmp_path / 'www')!r})).serve_forever()"
    )
    monkeypatch.setattr(services, "command", lambda name, config: ([sys.executable, "-c", code], {}))
    config = ServicesConfig(state_dir=tmp_path / "run", serve_port=port, stop_timeout=1)
    [up] = services.start(config, ["serve"])
    assert (up.state, up.reused, up.url) == ("running", False, f"http://127.0.0.1:{port}")
    [again] = services.start(config, ["serve"])
    assert (again.pid, again.reused) == (up.pid, True)
    [was] = services.stop(config, ["serve"])
    assert (was.state, was.pid) == ("running", up.pid)
    assert up.pid is not None and gone(up.pid)  # SIGKILL after stop_timeout
    assert not (tmp_path / "run" / "serve.pid").exists()
    assert not (tmp_path / "run" / "serve.json").exists()


def _registry_round_trip(url: str, tmp: Path) -> str:
    """Create a policy with a version and a champion alias, and a run with an artifact; returns the policy."""
    client = MlflowClient(tracking_uri=url, registry_uri=url)
    name = f"policy-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(name, tags={"mint.base": "tiny-dense"})
    # A tracking server refuses a local path (file://..., /...) as a version's source unless it lies inside the
    # run's artifacts, and any source whose URI path is not absolute (so not `sha256:<hex>` either).
    digest = "ab" * 32
    source = f"mint-store:///sha256/{digest}"
    version = client.create_model_version(name, source=source, tags={"mint.digest": digest})
    client.set_registered_model_alias(name, "champion", version.version)
    got = client.get_model_version_by_alias(name, "champion")
    assert (got.version, got.source, got.tags["mint.digest"]) == (version.version, source, digest)
    tags = client.get_registered_model(name).tags
    # mint's auth app records the login that moved each alias on the model (mint's service account here)
    mover = json.loads(tags.pop("mint.alias_mover.champion"))
    assert tags == {"mint.base": "tiny-dense"} and mover["user"] == os.environ["MLFLOW_TRACKING_USERNAME"]
    # a run with a metric and an artifact, through the server's artifact proxy
    run = client.create_run(client.create_experiment(f"exp-{name}"))
    client.log_metric(run.info.run_id, "reward", 0.5)
    client.log_text(run.info.run_id, "hello", "note.txt")
    client.set_terminated(run.info.run_id)
    assert client.get_run(run.info.run_id).data.metrics == {"reward": 0.5}
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # stored by the server, not by this process
    local = client.download_artifacts(run.info.run_id, "note.txt", dst_path=str(tmp))
    assert Path(local).read_text() == "hello"
    return name


def test_mlflow_server_sqlite(mlflow_server: str, tmp_path: Path) -> None:
    _registry_round_trip(mlflow_server, tmp_path)


def test_mlflow_server_on_postgres(mlflow_server_pg: str, tmp_path: Path) -> None:
    policy = _registry_round_trip(mlflow_server_pg, tmp_path)
    # the registry really lives in PostgreSQL: the policy is a row of one of the fixture's databases
    admin = sa.create_engine(PG_ADMIN_URL)
    with admin.connect() as conn:
        sql = sa.text("SELECT datname FROM pg_database WHERE datname LIKE :p")
        databases = [r[0] for r in conn.execute(sql, {"p": "mint_mlflow_%"})]
    admin.dispose()
    holders = []
    for db in databases:
        engine = sa.create_engine(admin.url.set(database=db))
        try:
            with engine.connect() as conn:
                sql = sa.text("SELECT 1 FROM registered_models WHERE name = :n")
                if conn.execute(sql, {"n": policy}).first():
                    holders.append(db)
        except sa.exc.DBAPIError:
            pass  # another session's database, being created or dropped
        finally:
            engine.dispose()
    assert len(holders) == 1


def test_flow_run_reports_to_prefect_server(prefect_server: str) -> None:
    @flow(name="mint-services-smoke")
    def add_one(x: int) -> int:
        return x + 1

    assert os.environ["PREFECT_API_URL"] == prefect_server
    state = add_one(41, return_state=True)
    assert state.result() == 42
    run_id = state.state_details.flow_run_id
    prefect = auth_header(os.environ["PREFECT_API_AUTH_STRING"])  # the session server's, as the flow sent it
    run = httpx.get(f"{prefect_server}/flow_runs/{run_id}", headers=prefect, trust_env=False).json()
    assert run["state"]["type"] == "COMPLETED"
    flows = httpx.post(f"{prefect_server}/flows/filter", json={}, headers=prefect, trust_env=False).json()
    assert "mint-services-smoke" in [f["name"] for f in flows]


def test_down_stops_the_redis_that_an_earlier_mint_run_started(tmp_path: Path) -> None:
    """`mint run` used to start a redis-server for its promotion locks (they are in the catalog now): `mint down`
    still stops one left running, found by its pid file in the state dir."""
    server = shutil.which("redis-server")
    require(server is not None, "redis-server is not installed")
    assert server is not None
    port, run_dir = free_port(), tmp_path / "run"
    run_dir.mkdir()
    cmd = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--daemonize", "yes"]
    subprocess.run(
        [*cmd, "--pidfile", str(run_dir / REDIS_PIDFILE), "--logfile", str(run_dir / "log")], check=True
    )
    deadline = time.monotonic() + 10
    while not (redis_up("127.0.0.1", port) and (run_dir / REDIS_PIDFILE).is_file()):
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.1)
    pid = int((run_dir / REDIS_PIDFILE).read_text())
    try:
        down = mint("down", "--state-dir", str(run_dir))
        assert down.returncode == 0, down.stderr
        assert f"Redis (started by mint run): stopped (pid {pid})" in down.stdout, down.stdout
        assert gone(pid) and not redis_up("127.0.0.1", port)
        again = mint("down", "--state-dir", str(run_dir))  # nothing left to stop: no Redis line
        assert again.returncode == 0 and "Redis" not in again.stdout, again.stdout
    finally:
        if not gone(pid):
            os.kill(pid, 9)


def test_down_leaves_a_process_that_is_not_redis_alone(tmp_path: Path) -> None:
    """A pid file naming some other live process (the pid was reused) or a process that is gone is removed and
    nothing is killed."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (other.pid, 2**22 + 1):
            (tmp_path / REDIS_PIDFILE).write_text(f"{pid}\n")
            assert stop_started_redis(ServicesConfig(state_dir=tmp_path)) is None
            assert not (tmp_path / REDIS_PIDFILE).exists()
        assert other.poll() is None  # still running
    finally:
        other.kill()
        other.wait()
