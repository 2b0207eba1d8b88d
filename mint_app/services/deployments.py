"""The Prefect deployments that mint's worker runs (infra/prefect.yaml): their work pool, registration (once per
change of the deployments or the workspace), and the requeue of runs that a stopped worker left."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from mint_core.serving.config import ServingConfig

if TYPE_CHECKING:
    pass
from mint_app.services.commands import console_script, hooks_workspace, running_base, serve_base
from mint_app.services.config import (
    HEALTH_PATH,
    ServiceError,
    ServicesConfig,
    deployments_file,
    work_pool,
)
from mint_app.services.prefect_auth import AUTH_ENV, basic_auth, client_auth
from mint_app.services.processes import (
    healthy,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------
# deployments (what the worker runs)


def workspace_defaults(config: ServicesConfig) -> dict[str, str]:
    """The `workspace` parameter of every deployment: the servers of this state dir (or the other hosts'
    `prefect_url`, `mlflow_url`, `serve_url` name), the store (`store_url` when the hosts share one) and the
    catalog (`catalog_url`, else .mint/catalog.db beside the state dir), so a run started from the dashboard or a
    schedule reaches them from any worker. Not `work_dir`: each worker's runs keep their work on their own host
    (the worker's MINT_WORK_DIR); with a shared store, checkpoints are also kept under <store_url>/checkpoints."""
    store = config.serve_adapter_root or ServingConfig.load(config.serve_config).adapter_root
    out = {
        "tracking_uri": config.url("mlflow"),
        "serving_url": config.url("serve"),
        "admin_token_file": str(config.state_dir.resolve() / "serve.token"),
        "store": config.store_url or str(store.resolve()),
        "catalog_url": hooks_workspace(config)["catalog_url"],
        "base": str(Path(running_base(config) or serve_base(config)).resolve()),
        "device": config.serve_device or ServingConfig.load(config.serve_config).device,
    }
    if config.store_url:
        out["checkpoint_url"] = f"{config.store_url.rstrip('/')}/checkpoints"
    return out


def _deployments_for(config: ServicesConfig) -> str:
    """The deployments file with each deployment's `workspace` defaulting to this state dir's (unless it sets
    one), as YAML."""
    doc = deployments_file(config)
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


BACKGROUND_NICE = 10
"""The niceness `prefect deploy` runs at: registration is background work (the main job runs it beside its
waves), and on two cores its 20 s of CPU otherwise take turns with training and evaluation at equal weight."""


def _prefect_cli(
    *args: str, api: str, auth: str | None, timeout: float = 300, background: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if auth:
        env[AUTH_ENV] = auth
    nice = shutil.which("nice") if background else None
    return subprocess.run(
        [
            *([nice, "-n", str(BACKGROUND_NICE)] if nice else []),
            console_script("prefect"),
            "--no-prompt",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _prefect_answers(config: ServicesConfig, within_s: float = 30.0) -> bool:
    """Whether the Prefect server answers its health check within `within_s`. Asked once with a 2 s timeout, a
    server that was up but busy (two vLLM replicas starting beside it on two cores) read as not running, and a
    fresh clone's `make run SERVING=vllm REPLICAS=2` failed its last step after its waves had passed."""
    deadline = time.monotonic() + within_s
    while True:
        if healthy(config.url("prefect"), HEALTH_PATH["prefect"], timeout=10.0):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(2.0)


def register_deployments(config: ServicesConfig) -> str:
    """Create the work pool and register every deployment of `config.deployments` on the Prefect server of this
    state dir (`prefect deploy --all`, once), each with `workspace_defaults` as its workspace; skipped when the
    file, the code and the server are those of the last registration and every deployment is still there. Says
    what it did."""
    if config.deployments is None:
        return "no deployments file"
    if not config.register_deployments:
        return "deployments left as registered (register_deployments: false)"
    api = config.url("prefect") + "/api"
    if not _prefect_answers(config):
        raise ServiceError(
            f"worker: the Prefect server at {api} is not running (start it too: mint up --only prefect,worker)"
        )
    names = sorted(d["name"] for d in deployments_file(config).get("deployments") or [])
    pool = work_pool(config)
    record = config.state_dir / "deployments.json"
    derived = config.state_dir / "prefect.yaml"
    text = _deployments_for(config)
    fingerprint = _fingerprint(config, api, text)
    auth = client_auth(config)
    try:
        last = json.loads(record.read_text())
    except (OSError, ValueError):
        last = {}
    found = httpx.post(
        f"{api}/deployments/filter",
        json={"deployments": {"name": {"any_": names}}, "limit": 200, "offset": 0},
        timeout=10,
        trust_env=False,
        auth=basic_auth(auth),
    )
    there = {d["name"] for d in found.json()} if found.status_code == 200 else set()
    if last.get("fingerprint") == fingerprint and set(names) <= there:
        return f"{len(names)} deployments unchanged"
    t0 = time.monotonic()
    pool_there = httpx.get(f"{api}/work_pools/{pool}", timeout=10, trust_env=False, auth=basic_auth(auth))
    if pool_there.status_code == 404:
        made = _prefect_cli("work-pool", "create", pool, "--type", "process", api=api, auth=auth)
        if made.returncode != 0:
            raise ServiceError(
                f"worker: could not create work pool {pool}:\n{made.stdout[-2000:]}{made.stderr[-2000:]}"
            )
    derived.write_text(
        f"# {config.deployments} as `mint up` registered it (workspace: this state dir's)\n{text}"
    )
    waits = (2.0, 5.0, 10.0, 20.0, 0.0)  # seconds before the next try; 0: the last
    for wait in waits:  # `deploy --all` is idempotent: repeat it past a busy server's 503
        deployed = _prefect_cli(
            "deploy", "--all", "--prefect-file", str(derived.resolve()), api=api, auth=auth, background=True
        )
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
    """The runs this worker left behind, back to Scheduled before it starts again (`reclaim_runs`): the
    lifecycle resumes from its checkpoint and, keyed by its idempotency key, makes no second version. Called only
    when no worker of this state dir runs; returns how many."""
    api = config.url("prefect") + "/api"
    catalog = hooks_workspace(config)["catalog_url"]
    return reclaim_runs(api, work_pool(config), config.worker_name, catalog, auth=client_auth(config))


TRAINING_TAG = "training"
"""The tag of the deployments whose flows hold a run lease while they run (wave, lifecycle, retrain)."""
RUN_LEASE_PREFIX = "run/"
"""mint_core.lifecycle.leases.RUN_LEASE_PREFIX, not imported (that module loads MLflow; a unit test holds them
equal)."""
RECLAIM_GRACE_S = {"RUNNING": 60.0, "PENDING": 180.0}
"""A run tagged `TRAINING_TAG` that has been Running this long without its run lease held is an orphan: its host
stopped renewing the lease (a run takes it in its first seconds). Pending this long: its process died before it
started (a process starts in well under this on a busy 2-core machine)."""


def reclaim_runs(
    api: str,
    pool: str,
    worker: str,
    catalog_url: str | None = None,
    crashed_since: float | None = None,
    auth: str | None = None,
) -> int:
    """Flow runs of `pool` whose worker is gone, back to Scheduled (any worker of the pool then runs them again,
    and they resume from their checkpoints); returns how many. `worker` is the worker about to start, so none
    of its own runs is alive. A Pending or Running run is an orphan when its run lease in the catalog
    (`mint_core.lifecycle.leases.held_run`) names `worker`, or when it is a training run (`TRAINING_TAG`) whose lease
    nobody has held for `RECLAIM_GRACE_S`, or, with no other worker of the pool online, whatever it is (one
    worker: every run it had is gone). With `crashed_since` (epoch s), runs that crashed since then (taken down
    with their worker) too, unless another worker's lease names them. The supervisor of the worker calls it
    before it starts the worker again after a crash (`python -m mint_app.services.control requeue ...`). `auth`:
    the server's auth string (default: PREFECT_API_AUTH_STRING, as the worker's supervisor has it)."""
    basic = basic_auth(auth or os.environ.get(AUTH_ENV))
    types = ["PENDING", "RUNNING"] + (["CRASHED"] if crashed_since is not None else [])
    query = {
        "work_pools": {"name": {"any_": [pool]}},
        "flow_runs": {"state": {"type": {"any_": types}}},
        "limit": 200,
        "offset": 0,
    }
    try:
        found = httpx.post(f"{api}/flow_runs/filter", json=query, timeout=10, trust_env=False, auth=basic)
    except httpx.HTTPError as e:
        logger.warning("could not list the flow runs of pool %s at %s: %s", pool, api, e)
        return 0
    if found.status_code != 200:
        return 0
    others = _other_workers_online(api, pool, worker, basic)
    holder = _lease_holders(catalog_url)
    n = 0
    for run in found.json():
        if run["state_type"] == "CRASHED":
            when = _epoch(run.get("end_time") or (run.get("state") or {}).get("timestamp"))
            if crashed_since is None or when is None or when < crashed_since:
                continue  # crashed before this worker died: not ours to run again
        why = _orphaned(run, worker, others, *holder(str(run["id"])))
        if why is not None and _requeue(api, run, why, basic):
            n += 1
    return n


def _orphaned(
    run: dict[str, Any], worker: str, others: list[str], holder: str | None, live: bool = True
) -> str | None:
    """Why `run` is an orphan of a dead worker, or None when it may be alive (see `reclaim_runs`). `holder`: who
    holds its run lease, or held it last and never released it (`live` False: it expired)."""
    if holder is not None and holder.split("@", 1)[0] == worker:
        return f"its run lease names {worker}, which is starting again"
    if holder is not None and live:
        return None  # another worker holds it now: the run is alive
    if not others:
        return "no other worker of its pool is online"
    grace = RECLAIM_GRACE_S.get(run["state_type"])
    if TRAINING_TAG in (run.get("tags") or []) and grace is not None:
        since = _epoch((run.get("state") or {}).get("timestamp"))
        if since is not None and time.time() - since > grace:
            return f"{run['state_type']} for over {grace:.0f} s and its run lease not held (its host is gone)"
    return None


def _requeue(api: str, run: dict[str, Any], why: str, auth: httpx.BasicAuth | None) -> bool:
    state = {
        "type": "SCHEDULED",
        "name": "Rescheduled",
        "message": f"its worker was gone ({why}); requeued to resume from its checkpoint",
    }
    done = httpx.post(
        f"{api}/flow_runs/{run['id']}/set_state",
        json={"state": state, "force": True},
        timeout=10,
        trust_env=False,
        auth=auth,
    )
    if done.status_code not in (200, 201):
        return False
    logger.info("requeued flow run %s (%s), left %s: %s", run["name"], run["id"], run["state_type"], why)
    return True


def _other_workers_online(api: str, pool: str, worker: str, auth: httpx.BasicAuth | None) -> list[str]:
    """The names of the pool's other workers that Prefect sees online (heartbeat within its timeout)."""
    try:
        found = httpx.post(
            f"{api}/work_pools/{pool}/workers/filter",
            json={"limit": 200},
            timeout=10,
            trust_env=False,
            auth=auth,
        )
    except httpx.HTTPError:
        return []
    if found.status_code != 200:
        return []
    return [w["name"] for w in found.json() if w.get("status") == "ONLINE" and w.get("name") != worker]


def _lease_holders(catalog_url: str | None) -> Callable[[str], tuple[str | None, bool]]:
    """Who holds a flow run's run lease, or last held it and never released it (its host died; with the catalog's
    leases, whose rows keep an expired holder), and whether the lease is held now. (None, False): nobody, or no
    catalog to ask."""
    if not catalog_url:
        return lambda run_id: (None, False)
    # only here: `mint up` on its own never loads the catalog (SQLAlchemy tables, the lease backends)
    from mint_core.registry.catalog import Catalog, CatalogConfig
    from mint_core.registry.leases import default_leases

    try:
        leases = default_leases(Catalog(CatalogConfig(url=catalog_url)))
    except Exception as e:  # no catalog to ask: every run looks unleased (the one-worker rule still holds)
        logger.warning("could not open the catalog %s to read run leases: %s", catalog_url, e)
        return lambda run_id: (None, False)

    def holder(run_id: str) -> tuple[str | None, bool]:
        name = f"{RUN_LEASE_PREFIX}{run_id}"
        try:  # held now, or expired unreleased: a host that died names its runs until another takes them
            last = leases.last_holder(name)
            return last, last is not None and leases.holder(name) == last
        except Exception as e:
            logger.warning("could not read the run lease of %s: %s", run_id, e)
            return None, False

    return holder


def _epoch(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
