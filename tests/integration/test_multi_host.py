"""Workers on more than one host (docs/multi-host.md), as two hosts would run them on one machine: two real
`prefect worker start` processes on one work pool, started as `mint worker` starts them, each with a working
directory of its own (its pid file, log, local checkpoints and cached results), sharing only what hosts on a
network share: the Prefect server, MLflow, the catalog on PostgreSQL (a throwaway database per module) and the
adapter store as a `file://` URL (checkpoints mirrored under it).

A wave of several policies spread over both (`flows/spread.py`, one `wave` deployment run per policy) makes
exactly one version per policy, in MLflow and in the catalog, with every GRPO step of each on record; both
workers ran some. Then one worker's host is killed (SIGKILL to the worker, its supervisor and its flow run) while
it trains: the other finishes its runs, and when the killed worker starts again it requeues its run, which
resumes from its mirrored checkpoint (the step is read from the MLflow run) and finishes, with no version twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import FlowRun, StateType

from flows.forms import PolicyRun, Training
from flows.spread import SpreadReport, spread
from mint_app.services.config import ServicesConfig
from mint_app.services.control import start, stop
from mint_app.services.processes import read_record, state_files
from mint_core.eval.gate import GatePolicy
from mint_core.eval.results import EvalConfig
from mint_core.eval.suites import standalone_suites
from mint_core.lifecycle.leases import run_lease
from mint_core.lifecycle.workspace import Workspace
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_testkit.harness import free_port, save_tiny_base, start_server, stop_server
from mint_testkit.skips import require
from tests.integration.conftest import PG_ADMIN_URL

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
PREFECT_FILE = ROOT / "infra" / "prefect.yaml"
ADMIN = "admin-secret"  # what start_server gives `mint serve`
GRPO = GRPOConfig(
    group_size=4, max_new_tokens=8, learning_rate=1e-2, weight_decay=0.5, drop_zero_variance=False
)
HOSTS = ("host-a", "host-b")


@dataclass
class Cluster:
    ws: Workspace
    suites: Path
    root: Path
    store: Path
    workers: dict[str, ServicesConfig]
    pool: str

    def evaluation(self) -> EvalConfig:
        return EvalConfig(limit=4, batch_size=16, suites_dir=self.suites)

    def log(self, host: str) -> str:
        _, _, log = state_files(self.workers[host], "worker")
        return log.read_text(errors="replace") if log.is_file() else ""

    def ran(self, host: str) -> set[str]:
        """The flow runs that ran on `host`: their own log lines, in its worker's log (appended across restarts),
        saying they hold their run lease as this worker (both workers may try to submit a run; one gets it)."""
        return set(re.findall(rf"run lease run/([0-9a-f-]{{36}}) held by {host}@", self.log(host)))


def port_of(url: str) -> int:
    return int(url.rstrip("/").removesuffix("/api").rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def catalog_url() -> Iterator[str]:
    """A throwaway PostgreSQL database for the module's catalog (and its leases), dropped at its end."""
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as e:
        admin.dispose()
        require(False, f"PostgreSQL not reachable at {PG_ADMIN_URL}: {str(e.orig).strip().splitlines()[0]}")
    name = f"mint_multihost_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(scope="module")
def cluster(
    mlflow_server: str, prefect_server: str, catalog_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("multi-host")
    base_dir = save_tiny_base(root / "base")
    store = root / "shared" / "store"
    store.mkdir(parents=True)
    store_url = f"file://{store}"
    proc, serve_url = start_server(
        store, "--base", str(base_dir), env={"MINT_SERVE_TORCH_THREADS": "1"}, healthy_within_s=300
    )
    # the shipped deployments, on a pool of this module's own and without schedules
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    pool = f"mint-test-{uuid.uuid4().hex[:8]}"
    for d in spec["deployments"]:
        d["work_pool"] = {**d["work_pool"], "name": pool}
        d.pop("schedules", None)
    deployments = root / "prefect.yaml"
    deployments.write_text(yaml.safe_dump(spec))
    workers = {}
    for i, host in enumerate(HOSTS):
        (root / host / "run").mkdir(parents=True)
        (root / host / "run" / "serve.token").write_text(ADMIN + "\n")  # each host's copy of the token
        workers[host] = ServicesConfig.model_validate(
            {
                "state_dir": root / host / "run",
                "worker_name": host,
                "worker_port": free_port(),
                "worker_limit": 1,
                "prefect_url": prefect_server,
                "mlflow_url": mlflow_server,
                "serve_url": serve_url,
                "catalog_url": catalog_url,
                "store_url": store_url,
                "serve_base": str(base_dir),
                "deployments": deployments,
                "register_deployments": i
                == 0,  # the first host registers the deployments, the second joins the pool
            }
        )
    ws = Workspace(
        tracking_uri=mlflow_server,
        store=store_url,
        catalog_url=catalog_url,
        base=base_dir,
        serving_url=serve_url,
        admin_token_file=None,
        checkpoint_url=f"{store_url}/checkpoints",
        lock_hold_s=60,
        run_lease_s=15,
    )
    try:
        for host in HOSTS:
            t0 = time.perf_counter()
            (svc,) = start(workers[host], ["worker"])
            print(f"\n{host}: worker healthy {time.perf_counter() - t0:.1f} s after start; {svc.detail}")
        yield Cluster(ws, standalone_suites(root, limit=20), root, store, workers, pool)
    finally:
        for host in HOSTS:
            stop(workers[host], ["worker"])
        stop_server(proc)


def policies(prefix: str, n: int) -> list[PolicyRun]:
    return [
        PolicyRun(
            spec=PolicySpec(name=f"{prefix}{i}", task="add", rank=4, alpha=8),
            gate=GatePolicy(suite="add", compare=False),  # plumbing: too few items for the paired test
        )
        for i in range(n)
    ]


def training(round: str, steps: int) -> Training:
    return Training(
        steps=steps, prompts_per_step=4, grpo=GRPO, data_dir=None, round=round, dry_run=0, checkpoint_every=1
    )


def pool_runs(pool: str, states: list[StateType] | None = None) -> list[FlowRun]:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=states)) if states else None
            ),
            limit=200,
        )


def check_versions(cluster: Cluster, names: list[str], steps: int) -> dict[str, Any]:
    """Each policy has exactly one version, in MLflow and in the catalog, whose training run recorded every
    step once; returns each version's MLflow run params."""
    reg = cluster.ws.registry()
    params = {}
    for name in names:
        revs = reg.revisions(name)
        assert [r.version for r in revs] == [1], (name, [r.address for r in revs])
        assert [e.version for e in reg.catalog.list(policy=name)] == [1], name
        run_id = revs[0].run_id
        assert run_id is not None, name
        run = reg.client.get_run(run_id)
        steps_seen = [m.step for m in reg.client.get_metric_history(run_id, "train/reward")]
        assert steps_seen == list(range(steps)), (name, steps_seen)  # no step lost, none twice
        params[name] = run.data.params
    return params


def spread_in_thread(
    cluster: Cluster, runs: list[PolicyRun], train: Training
) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(spread(runs, train, cluster.evaluation(), workspace=cluster.ws, poll_s=1.0))
        except BaseException as e:  # the test reports it
            out.append(e)

    # in this test's context: Prefect's settings (the session's server) live in a context variable
    thread = threading.Thread(target=contextvars.copy_context().run, args=(go,), daemon=True)
    thread.start()
    return thread, out


def test_a_wave_spread_over_two_workers_makes_each_version_once(cluster: Cluster) -> None:
    names = [p.name for p in policies("mh", 4)]
    t0 = time.perf_counter()
    report = spread(
        policies("mh", 4), training("w1", 3), cluster.evaluation(), workspace=cluster.ws, poll_s=1.0
    )
    seconds = time.perf_counter() - t0
    assert isinstance(report, SpreadReport)
    assert [g.policies for g in report.groups] == [[n] for n in names]
    assert all(g.state == "Completed" and g.runs == 1 for g in report.groups), report.groups
    params = check_versions(cluster, names, 3)
    assert all(p["resumed_from_step"] == "0" for p in params.values())
    runs = {g.flow_run_id for g in report.groups}
    ran = {host: cluster.ran(host) & runs for host in HOSTS}
    assert ran[HOSTS[0]] and ran[HOSTS[1]], ran  # both workers trained some of the wave
    assert ran[HOSTS[0]] | ran[HOSTS[1]] == runs and not ran[HOSTS[0]] & ran[HOSTS[1]]
    # the runs kept their work on their own host, and the mirror is emptied once every revision is exported
    for host in HOSTS:
        assert (cluster.root / host / "lifecycle").is_dir(), host
    assert not any((cluster.store / "checkpoints").rglob("COMPLETE"))
    print(
        f"\nspread wave of {len(names)} policies x 3 steps over 2 workers: {seconds:.1f} s; "
        f"{', '.join(f'{h}: {len(r)} run(s)' for h, r in ran.items())}"
    )


def kill_host(config: ServicesConfig) -> int:
    """SIGKILL everything the worker's host runs for mint: its supervisor, the worker and its flow runs."""
    record = read_record(config, "worker")
    assert record is not None
    top = psutil.Process(int(record["pid"]))
    procs = [top, *top.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    return len(procs)


def test_a_killed_worker_comes_back_and_its_run_resumes_from_its_checkpoint(cluster: Cluster) -> None:
    victim, survivor = HOSTS
    runs, steps = policies("mk", 3), 8
    names = [p.name for p in runs]
    thread, out = spread_in_thread(cluster, runs, training("k1", steps))

    # wait until the victim has checkpointed its run past step 2 (and mirrored it), then kill its host
    local = cluster.root / victim / "lifecycle" / "checkpoints"
    deadline = time.monotonic() + 600
    while not list(local.glob("*/*/step-0000[2-7]")):
        assert time.monotonic() < deadline and not out, out
        time.sleep(0.1)
    running = pool_runs(cluster.pool, [StateType.RUNNING])
    leases = cluster.ws.leases()
    mine = [r for r in running if (leases.holder(run_lease(str(r.id))) or "").startswith(f"{victim}@")]
    assert len(mine) == 1, [(r.name, leases.holder(run_lease(str(r.id)))) for r in running]
    killed = mine[0]
    killed_policy = killed.parameters["policies"][0]["spec"]["name"]
    t_kill = time.perf_counter()
    n = kill_host(cluster.workers[victim])

    # the survivor finishes every other run of the wave while the victim is down; the killed run stays Running
    others = set(names) - {killed_policy}
    while True:
        done = {
            r.parameters["policies"][0]["spec"]["name"]
            for r in pool_runs(cluster.pool, [StateType.COMPLETED])
            if r.parameters["policies"][0]["spec"]["name"] in names
        }
        if others <= done:
            break
        assert time.monotonic() < deadline, done
        time.sleep(1)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(killed.id).state
    assert state is not None and state.is_running(), state  # nobody reported the dead host's run
    survivor_s = time.perf_counter() - t_kill

    # the victim starts again: it requeues the run its lease names, and the run resumes and finishes
    (svc,) = start(cluster.workers[victim], ["worker"])
    assert "requeued 1 run" in str(svc.detail), svc.detail
    thread.join(timeout=600)
    assert out and isinstance(out[0], SpreadReport), out
    report: SpreadReport = out[0]
    by_policy = {g.policies[0]: g for g in report.groups}
    assert all(g.state == "Completed" for g in report.groups), report.groups
    assert by_policy[killed_policy].runs >= 2 and all(by_policy[p].runs == 1 for p in others), report.groups
    params = check_versions(cluster, names, steps)
    resumed = int(params[killed_policy]["resumed_from_step"])
    assert 2 <= resumed < steps, params[killed_policy]
    assert all(params[p]["resumed_from_step"] == "0" for p in others)
    assert cluster.ran(survivor) & {g.flow_run_id for g in report.groups}, "the survivor ran nothing"
    print(
        f"\nkilled {victim} ({n} processes) at {killed_policy}'s step {resumed}+; {survivor} finished the other "
        f"{len(others)} run(s) {survivor_s:.1f} s after the kill; after the restart {killed_policy} resumed "
        f"from step {resumed} (run count {by_policy[killed_policy].runs}); wave {report.seconds:.1f} s"
    )
