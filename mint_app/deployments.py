"""The Prefect deployments that mint's worker runs (infra/prefect.yaml): their work pool, registration (once per
change of the deployments or the workspace), and the requeue of runs that a stopped worker left."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import yaml

from mint_core.serving.config import ServingConfig

if TYPE_CHECKING:
    pass
from mint_app.processes import (
    healthy,
)
from mint_app.service_commands import console_script, running_base, serve_base
from mint_app.service_config import (
    HEALTH_PATH,
    ServiceError,
    ServicesConfig,
    deployments_file,
    work_pool,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------
# deployments (what the worker runs)


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


def _prefect_cli(*args: str, api: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run(
        [console_script("prefect"), "--no-prompt", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def register_deployments(config: ServicesConfig) -> str:
    """Create the work pool and register every deployment of `config.deployments` on the Prefect server of this
    state dir (`prefect deploy --all`, once), each with `workspace_defaults` as its workspace; skipped when the
    file, the code and the server are those of the last registration and every deployment is still there. Says
    what it did."""
    if config.deployments is None:
        return "no deployments file"
    api = config.url("prefect") + "/api"
    if not healthy(config.url("prefect"), HEALTH_PATH["prefect"]):
        raise ServiceError(
            f"worker: the Prefect server at {api} is not running (start it too: mint up --only prefect,worker)"
        )
    names = sorted(d["name"] for d in deployments_file(config).get("deployments") or [])
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
    waits = (2.0, 5.0, 10.0, 20.0, 0.0)  # seconds before the next try; 0: the last
    for wait in waits:  # `deploy --all` is idempotent: repeat it past a busy server's 503
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
