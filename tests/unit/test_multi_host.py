"""The parts of workers on several hosts that need no servers (the whole: tests/integration/test_multi_host.py):
checkpoints mirrored through an fsspec URL and pulled on another host, a run's lease renewed while it runs and
left to expire when its host dies, and which runs a starting worker takes for orphans."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mint_app.services import config as service_config
from mint_app.services import deployments
from mint_app.services.deployments import _orphaned
from mint_core.lifecycle.leases import RUN_LEASE_PREFIX, WORKER_ENV, held_run, holder_worker, run_lease
from mint_core.lifecycle.workspace import WORK_DIR_ENV, Workspace
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.leases import LockTimeout, leases_for
from mint_core.rl.checkpoints import (
    MIRRORED,
    drop_mirror,
    latest_checkpoint,
    pull_checkpoint,
    push_checkpoint,
)
from mint_testkit.waiting import wait_until


def fake_checkpoint(where: Path, step: int, body: str) -> Path:
    path = where / f"step-{step:05d}"
    (path / "sub").mkdir(parents=True)
    (path / "state.json").write_text(f'{{"steps": {step}}}')
    (path / "sub" / "weights.bin").write_text(body)
    return path


def test_a_checkpoint_mirrored_on_one_host_is_pulled_whole_on_another(tmp_path: Path) -> None:
    mirror = f"file://{tmp_path / 'shared' / 'run'}"
    host_a, host_b = tmp_path / "a", tmp_path / "b"
    assert pull_checkpoint(mirror, host_b) is None  # nothing mirrored yet
    for step in (1, 2, 3):
        push_checkpoint(fake_checkpoint(host_a, step, f"w{step}"), mirror, keep=2)
    shared = tmp_path / "shared" / "run"
    assert sorted(p.name for p in shared.iterdir()) == [
        "step-00002",
        "step-00003",
    ]  # pruned like the local ones
    # a copy a kill interrupted (no marker) is never taken, even when it is the newest
    (shared / "step-00004" / "sub").mkdir(parents=True)
    got = pull_checkpoint(mirror, host_b)
    assert got == host_b / "step-00003" and latest_checkpoint(host_b) == got
    assert (got / "sub" / "weights.bin").read_text() == "w3" and not (got / MIRRORED).exists()
    # the host that got further keeps its own; an older local one is replaced by the newer mirrored one
    assert pull_checkpoint(mirror, host_b) is None
    fake_checkpoint(tmp_path / "c", 1, "old")
    assert pull_checkpoint(mirror, tmp_path / "c") == tmp_path / "c" / "step-00003"
    drop_mirror(mirror)
    assert not shared.exists()


def sqlite_ws(tmp_path: Path, **extra: Any) -> Workspace:
    return Workspace(
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}", store=str(tmp_path / "store"), **extra
    )


def test_a_run_lease_is_renewed_while_held_and_names_its_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WORKER_ENV, "host-a")
    ws = sqlite_ws(tmp_path, run_lease_s=0.6)
    leases = leases_for(None, Catalog(CatalogConfig(url=ws.catalog_url)))
    with held_run(ws, "run-1") as holder:
        assert holder_worker(holder) == "host-a"
        time.sleep(1.5)  # past the lease's length: renewed meanwhile
        assert leases.holder(run_lease("run-1")) == holder
        # another attempt of the same run waits for it, and gives up while it is alive
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match="run/run-1"), held_run(ws, "run-1", wait_s=0.3):
            pass
        assert time.monotonic() - t0 >= 0.3
    assert leases.holder(run_lease("run-1")) is None  # released at the end


def test_a_dead_attempts_lease_expires_and_the_next_attempt_takes_it(tmp_path: Path) -> None:
    ws = sqlite_ws(tmp_path, run_lease_s=0.5)
    leases = leases_for(None, Catalog(CatalogConfig(url=ws.catalog_url)))
    assert leases.acquire(
        run_lease("run-2"), "host-a@h:1:dead", 0, 0.5
    )  # an attempt that died: never renewed
    t0 = time.monotonic()
    with held_run(ws, "run-2") as holder:
        assert leases.holder(run_lease("run-2")) == holder
    assert 0.2 < time.monotonic() - t0 < 3


def run(state: str, seconds_ago: float, tags: list[str] | None = None) -> dict[str, Any]:
    """A flow run as the Prefect API lists it, in `state` since `seconds_ago`: the age is kept and stamped when
    the test runs (`stamped`), not at collection, which on a loaded machine is minutes earlier."""
    return {"id": "r", "state_type": state, "tags": tags or [], "seconds_ago": seconds_ago}


def stamped(flow_run: dict[str, Any]) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - flow_run["seconds_ago"]))
    return {**{k: v for k, v in flow_run.items() if k != "seconds_ago"}, "state": {"timestamp": stamp}}


TRAINING = ["mint", "training"]


@pytest.mark.parametrize(
    ("case", "flow_run", "others", "holder", "orphan"),
    [
        ("its lease names the starting worker", run("RUNNING", 5, TRAINING), ["b"], "a@h:1:x", True),
        ("its own lease, expired", run("RUNNING", 5, TRAINING), ["b"], ("a@h:1:x", False), True),
        ("another worker's live lease", run("RUNNING", 900, TRAINING), ["b"], "b@h:1:x", False),
        # a host that never came back: its expired lease still names it, and the grace rule decides
        ("training, another's lease expired", run("RUNNING", 90, TRAINING), ["b"], ("c@h:1:x", False), True),
        (
            "training, another's lease just expired",
            run("RUNNING", 10, TRAINING),
            ["b"],
            ("c@h:1:x", False),
            False,
        ),
        ("one worker: another's expired lease", run("RUNNING", 1, ["mint"]), [], ("c@h:1:x", False), True),
        ("one worker: whatever it left", run("RUNNING", 1, ["mint"]), [], None, True),
        ("training, lease expired", run("RUNNING", 90, TRAINING), ["b"], None, True),
        ("training, just started", run("RUNNING", 10, TRAINING), ["b"], None, False),
        ("training, pending long", run("PENDING", 400, TRAINING), ["b"], None, True),
        ("training, pending a while", run("PENDING", 90, TRAINING), ["b"], None, False),
        ("no lease, other workers", run("RUNNING", 900, ["mint"]), ["b"], None, False),
    ],
)
def test_which_runs_a_starting_worker_requeues(
    case: str,
    flow_run: dict[str, Any],
    others: list[str],
    holder: str | tuple[str, bool] | None,
    orphan: bool,
) -> None:
    """`holder`: a live holder, or (holder, held now)."""
    held = holder if isinstance(holder, tuple) else (holder, holder is not None)
    assert (_orphaned(stamped(flow_run), "a", others, *held) is not None) is orphan, case


def test_the_app_names_what_the_library_names() -> None:
    """mint up loads no MLflow, so the app holds copies of the library's names: the same."""
    assert service_config.WORK_DIR_ENV == WORK_DIR_ENV
    assert service_config.WORKER_ENV == WORKER_ENV
    assert deployments.RUN_LEASE_PREFIX == RUN_LEASE_PREFIX


def test_a_worker_keeps_its_runs_work_on_its_own_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "host-b" / "lifecycle"))
    assert Workspace().work_dir == tmp_path / "host-b" / "lifecycle"
    monkeypatch.delenv(WORK_DIR_ENV)
    assert Workspace().work_dir == Path(".mint/lifecycle")


def test_a_spread_wave_groups_its_policies_in_order() -> None:
    from flows.forms import PolicyRun
    from flows.spread import groups_of
    from mint_core.rl.policy import PolicySpec

    runs = [PolicyRun(spec=PolicySpec(name=f"p{i}", task="add")) for i in range(5)]
    assert [[r.name for r in g] for g in groups_of(runs, 2)] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert [[r.name for r in g] for g in groups_of(runs, 9)] == [[f"p{i}" for i in range(5)]]


def test_a_run_lease_reads_as_its_last_holder_and_whether_it_is_held(tmp_path: Path) -> None:
    ws = sqlite_ws(tmp_path, run_lease_s=0.5)
    leases = leases_for(None, Catalog(CatalogConfig(url=ws.catalog_url)))
    holder = deployments._lease_holders(ws.catalog_url)
    assert holder("r1") == (None, False)
    assert leases.acquire(run_lease("r1"), "c@h:1:x", 0, 60)
    assert leases.acquire(run_lease("r2"), "c@h:1:y", 0, 0.2)
    wait_until(lambda: leases.holder(run_lease("r2")) is None, 10, "r2's 0.2 s lease expired")
    assert holder("r1") == ("c@h:1:x", True)
    assert holder("r2") == ("c@h:1:y", False)  # expired, never released: its host died
    assert leases.release(run_lease("r1"), "c@h:1:x")
    assert holder("r1") == (None, False)
    assert deployments._lease_holders(None)("r1") == (None, False)  # no catalog to ask
