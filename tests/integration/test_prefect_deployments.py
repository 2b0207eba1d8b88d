"""infra/prefect.yaml registers on a real Prefect server with `prefect deploy --all`, as infra/README.md says, and
every deployment is there with the schedule, work pool and parameters the file gives (what the dashboard shows
and a data scientist starts a run from)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PREFECT_FILE = ROOT / "infra" / "prefect.yaml"


def prefect(*args: str, api_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    cli = Path(sys.executable).parent / "prefect"
    return subprocess.run(
        [str(cli), "--no-prompt", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # `prefect deploy --all` (19 s); `mint up` registers the same deployments in test_services.py
def test_deploy_all_registers_every_deployment_of_prefect_yaml(prefect_server: str) -> None:
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    wanted = {d["name"]: d for d in spec["deployments"]}
    pool = spec["definitions"]["work_pool"]["name"]

    made = prefect("work-pool", "create", pool, "--type", "process", "--overwrite", api_url=prefect_server)
    assert made.returncode == 0, made.stdout + made.stderr
    deployed = prefect("deploy", "--all", "--prefect-file", str(PREFECT_FILE), api_url=prefect_server)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]

    listed = prefect("deployment", "ls", api_url=prefect_server)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    for name in wanted:
        assert name in listed.stdout, (name, listed.stdout)

    # each as the file says: entrypoint, pool, schedules, parameters
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        got = {d.name: d for d in client.read_deployments()}
    assert set(got) == set(wanted)
    for name, d in wanted.items():
        dep = got[name]
        assert dep.entrypoint == d["entrypoint"] and dep.work_pool_name == pool, name
        assert dep.parameter_openapi_schema["properties"], name  # the dashboard's run form
        for key, value in (d.get("parameters") or {}).items():
            assert dep.parameters[key] == value, (name, key)
        crons = sorted(s.schedule.cron for s in dep.schedules if getattr(s.schedule, "cron", None))
        intervals = sorted(
            s.schedule.interval.total_seconds()
            for s in dep.schedules
            if getattr(s.schedule, "interval", None)
        )
        assert crons == sorted(s["cron"] for s in d.get("schedules", []) if "cron" in s), name
        assert intervals == sorted(float(s["interval"]) for s in d.get("schedules", []) if "interval" in s), (
            name
        )

    # the server's scheduler fills each active schedule ahead with runs: nightly retraining and the periodic
    # reconcile really get scheduled (with SQLAlchemy 2.1 prefect 3.8.8's scheduler failed every pass and no
    # scheduled run was ever made; pyproject pins SQLAlchemy below 2.1)
    scheduled = {n for n, d in wanted.items() if any(s.get("active", True) for s in d.get("schedules", []))}
    assert {"retrain", "reconcile"} <= scheduled
    ids = {got[n].id: n for n in scheduled}
    deadline = time.monotonic() + 90
    seen: set[str] = set()
    while time.monotonic() < deadline and seen != scheduled:
        with get_client(sync_client=True) as client:
            seen = {
                ids[r.deployment_id]
                for r in client.read_flow_runs()
                if r.auto_scheduled and r.deployment_id in ids
            }
        time.sleep(2)
    assert seen == scheduled, f"no scheduled runs for {sorted(scheduled - seen)}"


@pytest.mark.slow  # 24 s; a dashboard run on the worker: also test_prefect_dashboard.py (Quick run, in Chromium)
def test_a_run_started_like_the_dashboard_runs_on_a_process_worker(
    prefect_server: str, mlflow_server: str, tmp_path: Path
) -> None:
    """`prefect deployment run` (what the dashboard's Run button does) queues a run of a deployment from
    prefect.yaml; a process worker picks it up and runs the flow from the repository to completion. The
    deployment goes to a pool of this test's own (`--pool`), so no scheduled run of another deployment (the
    30 s reconcile) is picked up, and its workspace points at this session's MLflow and temporary folders."""
    import json
    import uuid

    from prefect.client.orchestration import get_client

    pool = f"mint-test-{uuid.uuid4().hex[:8]}"
    made = prefect("work-pool", "create", pool, "--type", "process", api_url=prefect_server)
    assert made.returncode == 0, made.stdout + made.stderr
    name = "prefetch"
    deployed = prefect(
        "deploy", "--prefect-file", str(PREFECT_FILE), "--name", name, "--pool", pool, api_url=prefect_server
    )
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]

    workspace = {
        "tracking_uri": mlflow_server,
        "store": str(tmp_path / "store"),
        "catalog_url": f"sqlite:///{tmp_path / 'catalog.db'}",
        "work_dir": str(tmp_path / "work"),
        "serving_url": "http://127.0.0.1:9",  # never called: no policy has a champion to warm
    }
    started = prefect(
        "deployment",
        "run",
        f"prefetch/{name}",
        "--param",
        "policies=[]",
        "--param",
        f"workspace={json.dumps(workspace)}",
        api_url=prefect_server,
    )
    assert started.returncode == 0, started.stdout + started.stderr

    worker = prefect(
        "worker", "start", "--pool", pool, "--type", "process", "--run-once", api_url=prefect_server
    )
    assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-3000:]
    with get_client(sync_client=True) as client:
        # the scheduler also fills the deployment's schedule ahead (auto-scheduled runs, in the future)
        runs = [r for r in client.read_flow_runs() if r.work_pool_name == pool and not r.auto_scheduled]
    assert len(runs) == 1, runs
    assert runs[0].state is not None and runs[0].state.is_completed(), (runs[0].state, worker.stdout[-3000:])
    assert runs[0].parameters["policies"] == []
