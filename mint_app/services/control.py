"""mint's local services as background processes: the MLflow tracking server and model registry, a Prefect
server, the serving engine (`mint serve`: the embedded engine, or with `serving: vllm` mint's front before a vLLM
server, the `vllm` service, on loopback), the receiver of MLflow's alias webhook (`hooks`: serving
follows a `champion` moved in the MLflow UI within seconds; `mint up` registers the webhook), and a Prefect worker
that runs the deployments of infra/prefect.yaml (registered, with their work pool, before it starts).

Each service gets a log file, a pid file and a small JSON record (URL, start time) in one state directory, so
`start` is idempotent across invocations (a healthy service already recorded there is reused), `status` can be
asked from any shell, and `stop` finds what an earlier `mint up` started. A service is started in a session of
its own, so stopping it signals its whole process group (MLflow runs uvicorn under its CLI).

The settings are in `service_config.py`, each service's command line in `service_commands.py`, the Prefect
deployments the worker runs in `deployments.py`, the pid files, records and process checks in `processes.py`; this
module starts, stops and reports them.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from mint_core import access
from mint_core.errors import BaseError
from mint_core.serving.config import ServingConfig

if TYPE_CHECKING:
    pass
from mint_app.services.commands import (
    command,
    health_key,
    hooks_workspace,
    register_webhook,
    serve_base,
    vllm_config,
)
from mint_app.services.config import (
    ALL_SERVICES,
    HEALTH_KEY_ENV,
    HEALTH_PATH,
    PROGRESS_EVERY_S,
    VLLM_SIDE,
    Service,
    ServiceError,
    ServiceName,
    ServicesConfig,
    State,
    ensure_postgres_database,
    services_for,
    work_pool,
)
from mint_app.services.deployments import reclaim_runs, register_deployments, requeue_orphaned_runs
from mint_app.services.exposure import loopback, without_auth
from mint_app.services.processes import (
    CHILDREN,
    alive,
    healthy,
    log_tail,
    port_free,
    read_record,
    remove_record,
    state_files,
    terminate,
    write_record,
)

logger = logging.getLogger(__name__)


def _known_names(config: ServicesConfig) -> list[ServiceName]:
    """What status and stop look at by default: `services_for(config)`, and a vLLM recorded in the state dir
    whatever `serving` says now (`mint down` stops what `mint up --serving vllm` started)."""
    recorded = {n for n in VLLM_SIDE if read_record(config, n) is not None}
    return [n for n in ALL_SERVICES if n in services_for(config) or n in recorded]


def _prepare(name: ServiceName, config: ServicesConfig) -> None:
    """Create what a service needs before its first start (PostgreSQL databases)."""
    if name == "mlflow" and config.mlflow_backend_url and config.mlflow_backend().startswith("postgresql"):
        ensure_postgres_database(config.mlflow_backend())
    if name == "mlflow":  # its users and their rights, from the access file, before it answers anyone
        from mint_app.services.mlflow_auth import sync_users

        sync_users(config)
    database = config.prefect_database()
    if name == "prefect" and database and database.startswith("postgresql"):
        ensure_postgres_database(database)


def ensure_access(config: ServicesConfig) -> tuple[Path, access.Access, bool]:
    """The stack's access file (`<state dir>/access.json`), written on first start before any service starts:
    (its path, what it holds, whether it was made now)."""
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = access.access_path(config.state_dir)
    try:
        found, made = access.ensure(path)
    except access.AccessError as e:
        raise ServiceError(str(e)) from None
    return path, found, made


def _check_exposure(config: ServicesConfig, names: list[ServiceName]) -> None:
    """On a host other than loopback, refuse to start any service if one that would start runs without its
    auth (`exposure.without_auth`, from the command line and environment it would start with), naming each and
    why; with `insecure`, start them anyway (their records say so, `mint status` shows it in red)."""
    if loopback(config.host):
        return
    missing = []
    for s in status(config, [n for n in names if not loopback(config.bind_host(n))]):
        if s.state != "stopped":
            continue  # already running: checked when it started
        try:
            cmd, extra_env = command(s.name, config)
        except ServiceError:
            continue  # its launch says what is wrong
        reason = without_auth(s.name, cmd, {**os.environ, **extra_env}, config)
        if reason is not None:
            missing.append(f"{s.name}: {reason}")
    if not missing:
        return
    if config.insecure:
        logger.warning("--insecure: on %s without auth: %s", config.host, "; ".join(missing))
        return
    raise ServiceError(
        f"refused to start any service: --host {config.host} is not loopback, so anyone on the network could "
        "reach them, and these would run without their auth:\n  "
        + "\n  ".join(missing)
        + "\nstart them with their auth, or bind to 127.0.0.1; --insecure (MINT_SERVICES_INSECURE=true) starts "
        "them anyway (shown in red by mint status)"
    )


def _launch(name: ServiceName, config: ServicesConfig) -> subprocess.Popen[bytes]:
    cmd, extra_env = command(name, config)
    _, _, log = state_files(config, name)
    env = {**os.environ, **extra_env}
    reason = without_auth(name, cmd, env, config)  # the command line it starts with, before the supervisor's
    auth = {"on": reason is None, "without": reason, "exposed": not loopback(config.bind_host(name))}
    if name == "prefect":
        env.pop("PREFECT_API_URL", None)  # the server must not think of itself as a client of another one
    if name in VLLM_SIDE:  # its own environment: nothing of mint's may reach its imports
        for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(key, None)
    if config.supervise:  # it copies the service's output into the rotating log and restarts it after a crash
        cmd = [
            *(sys.executable, "-m", "mint_app.services.supervise", "--log", str(log)),
            *("--max-bytes", str(config.log_max_bytes), "--backups", str(config.log_backups)),
            *("--health-url", config.url(name) + HEALTH_PATH[name]),
            # the key the service itself was started with (in its environment, never on a command line)
            *(("--health-key-env", key_env) if (key_env := _health_key_env(name, env)) else ()),
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
    CHILDREN[proc.pid] = proc
    # mint serve's record keeps its base: what the flows of this stack train on (`mint up --base`)
    write_record(
        config, name, proc.pid, config.url(name), serve_base(config) if name == "serve" else None, auth
    )
    logger.info("started %s (pid %d), log %s", name, proc.pid, log)
    return proc


def _health_key_env(name: ServiceName, env: dict[str, str]) -> str | None:
    """The variable of `env` that holds the key `name` demands on its health route, if any."""
    return next((k for k in HEALTH_KEY_ENV.get(name, ()) if env.get(k)), None)


def _requeue_command(config: ServicesConfig) -> str:
    api, pool = config.url("prefect") + "/api", work_pool(config)
    catalog = hooks_workspace(config)["catalog_url"]
    return shlex.join(
        [sys.executable, "-m", "mint_app.services.control", "requeue", api, pool, config.worker_name, catalog]
    )


def startup_timeout(config: ServicesConfig, name: ServiceName) -> float:
    """Seconds `name` may take to answer its health check after it is launched."""
    return config.vllm_start_timeout_s if name in VLLM_SIDE else config.startup_timeout


def check_serving(config: ServicesConfig, names: list[ServiceName]) -> None:
    """With serving vllm: refuse what cannot work before anything starts (vLLM's environment, a base vLLM
    cannot run, a front with no vLLM behind it); vllm with serving mint is refused too (nothing would front it)."""
    vllm_side = [n for n in names if n in VLLM_SIDE]
    if config.serving == "mint":
        if vllm_side:
            raise ServiceError(
                f"{vllm_side[0]}: it runs behind mint serve with serving vllm (mint up --serving vllm)"
            )
    elif vllm_side:
        for name in vllm_side:  # raises ServiceError naming what is wrong
            vllm_config(config, name)
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
        _, _, log = state_files(config, name)
        record = read_record(config, name)
        if record is None or not alive(record["pid"], record.get("create_time")):
            if record is not None:
                remove_record(config, name)
            out.append(Service(name, "stopped", config.url(name), None, log))
            continue
        url = record.get("url") or config.url(name)
        state: State = (
            "running" if healthy(url, HEALTH_PATH[name], key=health_key(config, name)) else "unhealthy"
        )
        auth = record.get("auth") or {}
        out.append(
            Service(
                name,
                state,
                url,
                record["pid"],
                log,
                auth=auth.get("on"),
                without_auth=auth.get("without"),
                exposed=bool(auth.get("exposed")),
            )
        )
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
    ensure_access(config)  # on first start, before any service: the services read their credentials there
    names = names or services_for(config)
    _check_exposure(config, names)  # on the network, none starts unless each runs with its auth
    if "worker" in names and len(names) > 1:  # the worker's deployments are registered on a Prefect server up
        first = {s.name: s for s in start(config, [n for n in names if n != "worker"], progress)}
        first["worker"] = start(config, ["worker"], progress)[0]
        return [first[n] for n in names]
    check_serving(config, names)
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
        if not port_free(host, port):
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
            record = read_record(config, name) or {}
            url = record.get("url") or config.url(name)
            pid = proc.pid if proc is not None else int(record.get("pid", 0))
            _, _, log = state_files(config, name)
            if (proc is not None and proc.poll() is not None) or (proc is None and not alive(pid)):
                del launched[name]
                code = f" with status {proc.returncode}" if proc is not None else ""
                errors.append(
                    f"{name} exited{code} before answering {url}{HEALTH_PATH[name]}:\n{log_tail(log)}"
                )
                remove_record(config, name)
            elif healthy(url, HEALTH_PATH[name], key=health_key(config, name)):
                del launched[name]
                ms = None if proc is None else time.monotonic() - t0
                results[name] = Service(name, "running", url, pid, log, reused=proc is None, startup_s=ms)
                if ms is not None:
                    logger.info("%s healthy at %s after %.1f s", name, url, ms)
        now = time.monotonic()
        for name, (proc, t0) in list(launched.items()):
            timeout = startup_timeout(config, name)
            _, _, log = state_files(config, name)
            if now - t0 > timeout:
                del launched[name]
                errors.append(
                    f"{name} did not answer {config.url(name)}{HEALTH_PATH[name]} within "
                    f"{timeout:.0f} s:\n{log_tail(log)}"
                )
                if proc is not None:  # ours and broken: do not leave it half started
                    terminate(proc.pid, config.stop_timeout)
                    remove_record(config, name)
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
    terminate(pid, config.stop_timeout)
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
        _, _, log = state_files(config, name)
        record = read_record(config, name)
        if record is None or not alive(record["pid"], record.get("create_time")):
            remove_record(config, name)
            out.append(Service(name, "stopped", config.url(name), None, log))
            continue
        pid = record["pid"]
        killed = terminate(pid, config.stop_timeout)
        CHILDREN.pop(pid, None)
        remove_record(config, name)
        logger.info("stopped %s (pid %d)%s", name, pid, ", killed" if killed else "")
        out.append(Service(name, "running", record.get("url") or config.url(name), pid, log))
    return out[::-1]


if (
    __name__ == "__main__"
):  # `python -m mint_app.services.control requeue API POOL WORKER CATALOG`: the worker's supervisor, after a crash
    if sys.argv[1:2] != ["requeue"] or len(sys.argv) != 6:
        sys.exit(
            "usage: python -m mint_app.services.control requeue PREFECT_API_URL POOL WORKER CATALOG_URL  "
            "(MINT_SUPERVISE_LAST_START: since)"
        )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    since = float(os.environ.get("MINT_SUPERVISE_LAST_START", "0")) or None
    api, pool, worker, catalog = sys.argv[2:6]
    print(f"requeued {reclaim_runs(api, pool, worker, catalog, crashed_since=since)} run(s) of pool {pool}")
