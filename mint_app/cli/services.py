"""`mint up`, `mint down`, `mint status`: the local MLflow, Prefect, serving (and vLLM) and Prefect worker
processes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import typer
from rich.table import Table

from mint_app.cli.help import with_default
from mint_app.cli.task import TasksOption, add_task_dirs
from mint_app.console import make_console, rule
from mint_app.services.config import (
    ALL_SERVICES,
    Service,
    ServiceError,
    ServiceName,
    ServicesConfig,
    parse_names,
    services_for,
)
from mint_app.services.control import ensure_access, start, status, stop, stop_started_redis
from mint_app.services.exposure import loopback
from mint_app.services.processes import follow_log, log_tail, rolled_logs, service_log
from mint_core import access

console = make_console()  # a kept log's tables keep their width

StateDir = Annotated[
    Path | None,
    typer.Option(
        help=with_default(
            "Pid files, logs and local databases (or MINT_SERVICES_STATE_DIR)", ServicesConfig, "state_dir"
        )
    ),
]
Only = Annotated[str | None, typer.Option(help=f"Comma-separated subset of {','.join(ALL_SERVICES)}.")]
ConfigFile = Annotated[Path | None, typer.Option(help="YAML or JSON file of ServicesConfig fields.")]
Auth = Annotated[
    bool | None,
    typer.Option(
        "--auth/--no-auth",
        help=with_default(
            "Each service with its auth (MLflow logins, Prefect's auth string, serving keys: the access file), "
            "loopback too; --no-auth: none asks, for a throwaway stack on loopback",
            ServicesConfig,
            "auth",
        ),
        show_default=False,
    ),
]
Insecure = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="With a --host other than loopback, start a service even without its auth (it then answers anyone "
        "on the network; mint status shows it in red). Without it, mint up refuses and says why (or "
        "MINT_SERVICES_INSECURE).",
    ),
]

TITLES = {
    "mlflow": "MLflow tracking + registry",
    "prefect": "Prefect server",
    "vllm": "vLLM (behind mint serve)",
    **{f"vllm-{i}": f"vLLM replica {i}" for i in range(1, 8)},
    "serve": "mint serve",
    "hooks": "MLflow webhook receiver",
    "worker": "Prefect worker",
}
OPEN = {
    "mlflow": "MLflow UI",
    "prefect": "Prefect dashboard",
    "vllm": "health",
    **{f"vllm-{i}": "health" for i in range(1, 8)},
    "serve": "served models",
    "hooks": "health",
    "worker": "health",
}
STYLE = {"running": "green", "unhealthy": "yellow", "stopped": "dim"}


def _up(text: str, field: str) -> str:
    """Help of a service flag: `text` and the services' default for `field` (ServicesConfig)."""
    return with_default(text, ServicesConfig, field)


def _names(only: str | None) -> list[ServiceName] | None:
    """The services --only names; None without it (each command's default: `services.services_for`)."""
    if not only:
        return None
    try:
        return parse_names(only)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--only") from None


def _config(config: Path | None, **overrides: object) -> ServicesConfig:
    try:
        return ServicesConfig.load(config, **overrides)
    except ValueError as e:  # pydantic's ValidationError included
        raise typer.BadParameter(str(e)) from None


def print_table(services: list[Service]) -> None:
    table = Table("service", "state", "pid", "url", "auth", "open", "log")
    for s in services:
        table.add_row(
            TITLES[s.name],
            f"[{STYLE[s.state]}]{s.state}[/]",
            str(s.pid or ""),
            s.api_url,
            auth_cell(s),
            f"{OPEN[s.name]}: {s.open_url}" if s.state != "stopped" else "",
            str(s.log),
        )
    console.print(table)
    for s in services:  # the reason in full: a cell of a narrow table would cut it
        if s.auth is False and s.state != "stopped":
            style = "red" if s.exposed else "yellow"
            console.print(f"[{style}]{TITLES[s.name]}: {s.without_auth}[/]", soft_wrap=True)


def auth_cell(s: Service) -> str:
    """`on`; `OFF` in red for a service exposed on the network without its auth (started with --insecure);
    `off` in yellow on loopback (any local user reaches it); empty when stopped or its record does not say."""
    if s.state == "stopped" or s.auth is None:
        return ""
    if s.auth:
        return "[green]on[/]"
    return "[bold red]OFF, on the network (--insecure)[/]" if s.exposed else "[yellow]off[/]"


def print_access(cfg: ServicesConfig, services: list[Service]) -> None:
    """Whether the running services ask who you are, where the stack's credentials are (the access file) and
    what it holds; never a secret."""
    running = [s for s in services if s.state != "stopped"]
    if off := [s.name for s in running if s.auth is False]:
        console.print(f"[red]auth OFF for {', '.join(off)}[/]: anyone who reaches their port may use them")
    elif running and all(s.auth for s in running):
        console.print("auth on: every running service asks who you are")
    path = access.access_path(cfg.state_dir)
    if not path.exists():
        console.print(f"access: no access file at {path} yet (mint up writes it, with an admin and a key)")
        return
    try:
        found = access.load(path)
    except access.AccessError as e:
        console.print(f"[red]access: {e}[/]")
        return
    users = ", ".join(f"{n} ({u.role})" for n, u in sorted(found.users.items())) or "none"
    keys = ", ".join(sorted(found.keys)) or "none"
    console.print(
        f"access: credentials in {path} (users: {users}; serving keys: {keys}); mint access show [--secrets]",
        soft_wrap=True,
    )


def up(
    only: Only = None,
    state_dir: StateDir = None,
    config: ConfigFile = None,
    host: Annotated[str | None, typer.Option(help="Address the services bind to.")] = None,
    mlflow_port: Annotated[int | None, typer.Option(help=_up("MLflow port", "mlflow_port"))] = None,
    prefect_port: Annotated[int | None, typer.Option(help=_up("Prefect port", "prefect_port"))] = None,
    serve_port: Annotated[int | None, typer.Option(help=_up("mint serve port", "serve_port"))] = None,
    serving: Annotated[
        Literal["mint", "vllm"] | None,
        typer.Option(
            help=_up(
                "Who runs the served model: mint's embedded engine, or a vLLM server (from .venv-vllm, `make "
                "vllm-venv`) that mint serve fronts",
                "serving",
            )
        ),
    ] = None,
    vllm_port: Annotated[
        int | None, typer.Option(help=_up("Port of vLLM, on 127.0.0.1, with --serving vllm", "vllm_port"))
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=8,
            help=_up(
                "vLLM replicas (with --serving vllm): N > 1 starts N vLLMs at vllm-port, vllm-port+1, ...; "
                "mint serve routes each request to one (by served name) and loads every revision on every replica",
                "replicas",
            ),
        ),
    ] = None,
    hooks_port: Annotated[
        int | None, typer.Option(help=_up("Port of the receiver of MLflow's alias webhook", "hooks_port"))
    ] = None,
    mlflow_backend_url: Annotated[
        str | None, typer.Option(help="MLflow store: SQLAlchemy URL (default SQLite in the state dir).")
    ] = None,
    prefect_database_url: Annotated[
        str | None, typer.Option(help="Prefect database URL (default SQLite in the state dir).")
    ] = None,
    serve_base: Annotated[
        str | None,
        typer.Option(
            "--base",
            "--serve-base",
            help="The base: a Hugging Face causal-LM directory with its tokenizer (and chat template), which "
            "mint serve (or vLLM) serves and the registered flows train on (default data/base, else a tiny "
            "dense base). Checked before anything starts.",
        ),
    ] = None,
    serve_config: Annotated[Path | None, typer.Option(help="ServingConfig file for mint serve.")] = None,
    serve_adapter_root: Annotated[Path | None, typer.Option(help="Adapter store of mint serve.")] = None,
    worker_port: Annotated[
        int | None, typer.Option(help=_up("Healthcheck port of the Prefect worker", "worker_port"))
    ] = None,
    auth: Auth = None,
    insecure: Insecure = False,
    tasks: TasksOption = None,
) -> None:
    """Start the local services (MLflow, Prefect, mint serve, a Prefect worker running the deployments of
    infra/prefect.yaml, registered first) in the background; reuse those already up. With --serving vllm, a vLLM
    server on loopback first, which mint serve fronts (validation, auth, revision identity). With --tasks, the
    worker's flows and the servers' canary scoring know those tasks too."""
    add_task_dirs(tasks)
    cfg = _config(
        config,
        state_dir=state_dir,
        host=host,
        mlflow_port=mlflow_port,
        prefect_port=prefect_port,
        serve_port=serve_port,
        serving=serving,
        vllm_port=vllm_port,
        replicas=replicas,
        hooks_port=hooks_port,
        mlflow_backend_url=mlflow_backend_url,
        prefect_database_url=prefect_database_url,
        serve_base=serve_base,
        serve_config=serve_config,
        serve_adapter_root=serve_adapter_root,
        worker_port=worker_port,
        auth=auth,
        insecure=insecure or None,  # unset: the config file's or MINT_SERVICES_INSECURE
    )
    names = _names(only) or services_for(cfg)
    _say_access(cfg)
    with console.status(f"starting {', '.join(names)} ..."):
        try:
            # a slow service (vLLM: 30-100 s on 2 cores) is reported every 10 s above the spinner
            started = start(cfg, names, progress=lambda msg: console.print(f"  {msg}"))
        except ServiceError as e:
            console.print(f"[red]{e}[/]")
            raise typer.Exit(1) from None
    _say_up(cfg, names, started)


def _say_access(cfg: ServicesConfig) -> None:
    """The access file, made on first start before any service: where the credentials are, never a secret."""
    try:
        path, found, made = ensure_access(cfg)
    except ServiceError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    if made:
        key = f"serving key {access.DEFAULT_KEY!r} (every policy)" if access.DEFAULT_KEY in found.keys else ""
        console.print(
            f"access: first start, wrote {path} (readable by you only): admin user {access.ADMIN_USER!r}, "
            f"{key}, mint's service account; their secrets: mint access show --secrets",
            soft_wrap=True,
        )
    if not cfg.auth:
        console.print("[yellow]--no-auth: no service asks who you are (any local user reaches them)[/]")
    if not loopback(cfg.host) and cfg.insecure:
        console.print(f"[bold red]--insecure: on {cfg.host}, a service without its auth answers anyone[/]")


def _say_up(cfg: ServicesConfig, names: list[ServiceName], started: list[Service]) -> None:
    """What `mint up` started or reused, the services' status table, and how other tools reach them."""
    for s in started:
        how = "already running" if s.reused else f"started in {s.startup_s:.1f} s"
        console.print(f"{TITLES[s.name]}: {how} at {s.api_url} (pid {s.pid})")
        if s.detail:
            console.print(f"  {s.detail}")
    found = status(cfg, names)
    print_table(found)
    print_access(cfg, found)
    by_name = {s.name: s for s in started}
    if "mlflow" in by_name or "prefect" in by_name:
        console.print("the mint commands run in this directory use these servers; for other tools:")
    if "mlflow" in by_name:
        console.print(f"export MLFLOW_TRACKING_URI={by_name['mlflow'].api_url}")
    if "prefect" in by_name:
        console.print(f"export PREFECT_API_URL={by_name['prefect'].api_url}")
    if "serve" in by_name:
        token = cfg.state_dir / "serve.token"
        where = f"in {token}" if token.exists() else "as configured"
        console.print(f"mint serve admin token (load/unload) {where}")


def down(only: Only = None, state_dir: StateDir = None, config: ConfigFile = None) -> None:
    """Stop the local services started by `mint up` (SIGTERM, then SIGKILL after a timeout), and the redis-server
    that an earlier `mint run` started for its promotion locks, if one is still running (not with --only)."""
    names = _names(only)
    cfg = _config(config, state_dir=state_dir)
    for s in stop(cfg, names):
        console.print(f"{TITLES[s.name]}: " + (f"stopped (pid {s.pid})" if s.pid else "was not running"))
    if only is None:
        redis = stop_started_redis(cfg)
        if redis is not None:
            console.print(f"Redis (started by mint run): stopped (pid {redis})")


def status_cmd(only: Only = None, state_dir: StateDir = None, config: ConfigFile = None) -> None:
    """Show each local service: state, pid, URL, the page to open, and its log; with vLLM replicas, each
    replica's health, the revisions it holds and its load, as mint serve sees them."""
    cfg = _config(config, state_dir=state_dir)
    found = status(cfg, _names(only))
    print_table(found)
    print_access(cfg, found)
    serve = next((s for s in found if s.name == "serve" and s.state == "running"), None)
    if serve is not None and any(s.name == "vllm-1" for s in found):
        print_replicas(cfg, serve.url)


def print_replicas(cfg: ServicesConfig, url: str) -> None:
    """mint serve's view of each replica (GET /v1/mint/replicas with its admin token): health, or why the golden
    probe took it out of rotation, its load, its share of the requests mint serve routed, and the revisions it
    holds."""
    token = cfg.state_dir / "serve.token"
    headers = {"Authorization": f"Bearer {token.read_text().strip()}"} if token.is_file() else {}
    try:
        r = httpx.get(url + "/v1/mint/replicas", headers=headers, timeout=30)
        r.raise_for_status()
        report = r.json()
    except (httpx.HTTPError, ValueError) as e:
        console.print(f"[yellow]the replicas: mint serve did not say ({e})[/]")
        return
    table = Table("replica", "health", "running", "waiting", "requests (share)", "revisions held")
    for row in report["replicas"]:
        held = ", ".join(f"{n} {rev.removeprefix('sha256:')[:12]}" for n, rev in row["revisions"].items())
        out = row.get("out_of_rotation")  # the golden probe took it out (its answers changed)
        health = "[green]healthy[/]" if row["healthy"] else "[red]down[/]"
        table.add_row(
            row["replica"],
            f"[red]out of rotation: {out}[/]" if out else health,
            "" if row["running"] is None else f"{row['running']:g}",
            "" if row["waiting"] is None else f"{row['waiting']:g}",
            _share(row),
            held or "-",
        )
    console.print(table)


def _share(row: dict[str, Any]) -> str:
    """`120 (48%)`: requests mint serve routed to a replica since it started, and their share of all."""
    share = row.get("share")
    return f"{row.get('requests', 0)}" + ("" if share is None else f" ({share:.0%})")


def logs_cmd(
    service: Annotated[
        str | None, typer.Argument(help=f"One of {', '.join(ALL_SERVICES)}; default: each one.")
    ] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, help="Lines from the end of each log.")] = 40,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing what the service writes.")
    ] = False,
    rolled: Annotated[bool, typer.Option(help="Also list the rolled-over logs kept (<name>.log.N).")] = False,
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Show the services' logs (appended across restarts and rolled over at log_max_bytes, never truncated)."""
    cfg = _config(config, state_dir=state_dir)
    names = _names(service) if service else [s.name for s in status(cfg) if s.log.exists()]
    if not names:
        raise typer.BadParameter(f"no service has a log in {cfg.state_dir} (mint up starts them)")
    if follow and len(names) != 1:
        raise typer.BadParameter("--follow takes one service (mint logs serve -f)")
    for name in names:
        log = service_log(cfg, name)
        if len(names) > 1 or rolled:
            rule(console, f"{TITLES[name]}: {log}")
        if rolled:
            for old in rolled_logs(cfg, name):
                console.print(f"  rolled over: {old} ({old.stat().st_size} bytes)")
        console.print(log_tail(log, lines), markup=False, highlight=False, soft_wrap=True)
    if follow:
        follow_log(
            service_log(cfg, names[0]),
            lambda text: console.print(text, end="", markup=False, highlight=False),
        )


def worker_cmd(
    workdir: Annotated[
        Path,
        typer.Option(
            help="This worker's own directory: its pid file and log (DIR/run) and its runs' local checkpoints "
            "and cached results (DIR/lifecycle)."
        ),
    ] = Path(".mint"),
    name: Annotated[
        str | None,
        typer.Option(help="Its name in the pool, one per worker (default mint-worker-<hostname>)."),
    ] = None,
    port: Annotated[int | None, typer.Option(help=_up("Healthcheck port", "worker_port"))] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="Flow runs at once (default: no limit; 1 where it trains).")
    ] = None,
    prefect_url: Annotated[str | None, typer.Option(help="The Prefect server (http://host:4200).")] = None,
    mlflow_url: Annotated[str | None, typer.Option(help="The MLflow server (http://host:5000).")] = None,
    serve_url: Annotated[str | None, typer.Option(help="The serving endpoint (http://host:8000).")] = None,
    catalog_url: Annotated[
        str | None, typer.Option(help="The shared catalog: postgresql://user@host:5432/mint.")
    ] = None,
    store_url: Annotated[
        str | None, typer.Option(help="The shared adapter store: an fsspec URL (s3://..., file:///...).")
    ] = None,
    register: Annotated[
        bool | None,
        typer.Option(help="Register the deployments (--no-register where another host registered them)."),
    ] = None,
    stop_it: Annotated[bool, typer.Option("--stop", help="Stop this directory's worker instead.")] = False,
    config: ConfigFile = None,
    tasks: TasksOption = None,
) -> None:
    """Start a Prefect worker on the deployments' pool with a working directory of its own, against servers
    that may run on other hosts (docs/multi-host.md): `mint up --only worker` with the shared settings as flags.
    Started again after its host died, it first requeues the runs it had, which resume from their checkpoints."""
    add_task_dirs(tasks)
    cfg = _config(
        config,
        state_dir=workdir / "run",
        worker_name=name,
        worker_port=port,
        worker_limit=limit,
        prefect_url=prefect_url,
        mlflow_url=mlflow_url,
        serve_url=serve_url,
        catalog_url=catalog_url,
        store_url=store_url,
        register_deployments=register,
    )
    if stop_it:
        print_table(stop(cfg, ["worker"]))
        return
    try:
        (svc,) = start(cfg, ["worker"])
    except ServiceError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    how = "already running" if svc.reused else f"started in {svc.startup_s:.1f} s"
    console.print(f"worker {cfg.worker_name}: {how} (pid {svc.pid}), polling {cfg.url('prefect')}/api")
    if svc.detail:
        console.print(f"  {svc.detail}")
    print_table(status(cfg, ["worker"]))


def register(app: typer.Typer) -> None:
    """Add up/down/status/logs/worker to the `mint` command line."""
    app.command("worker")(worker_cmd)
    app.command("up")(up)
    app.command("down")(down)
    app.command("status")(status_cmd)
    app.command("logs")(logs_cmd)
