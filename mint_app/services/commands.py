"""What each of mint's services runs: its command line and environment (`command`), and what those need: the
secrets kept in the state directory, the base that mint serve and vLLM serve, vLLM's settings, and the
registration of MLflow's alias webhook."""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mint_core.access import access_path
from mint_core.access import ensure as ensure_access
from mint_core.errors import MintError
from mint_core.serving.config import ServingConfig

if TYPE_CHECKING:
    from mint_core.serving.vllm_process import VLLMConfig
from mint_app.services.config import (
    BUILTIN_BASE,
    HEALTH_KEY_ENV,
    HEALTH_PATH,
    REPLICA_NAMES,
    VLLM_CPU_HEAD_DIMS,
    WORK_DIR_ENV,
    WORKER_ENV,
    ServiceError,
    ServiceName,
    ServicesConfig,
    work_pool,
)
from mint_app.services.exposure import strip_auth
from mint_app.services.prefect_auth import (
    AUTH_ENV,
    SERVER_AUTH_ENV,
    client_auth,
    server_auth,
    write_client_settings,
)
from mint_app.services.processes import (
    alive,
    healthy,
    read_record,
)

logger = logging.getLogger(__name__)


def health_key(config: ServicesConfig, name: ServiceName) -> str | None:
    """The key `name`'s health route demands: vLLM's (its seal refuses /health without it), else none."""
    return _vllm_key(config) if name in HEALTH_KEY_ENV else None


def console_script(tool: str) -> str:
    """A console script of this environment (mlflow, prefect), next to the running interpreter."""
    path = Path(sys.executable).parent / tool
    if not path.exists():
        raise ServiceError(f"{tool} is not installed next to {sys.executable}")
    return str(path)


def serve_token(config: ServicesConfig) -> str:
    """The admin token of `mint serve` under this state dir: generated once, kept readable by its owner only."""
    path = config.state_dir / "serve.token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
    return path.read_text().strip()


def _state_secret(config: ServicesConfig, filename: str, make: Callable[[], str]) -> str:
    """A secret kept in the state dir: made once by `make()`, readable by its owner only."""
    path = config.state_dir / filename
    if not path.exists():
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make() + "\n")
    return path.read_text().strip()


def _hooks_secret_file(config: ServicesConfig) -> Path:
    """The file of the webhook secret that `mint up` registers with MLflow and the receiver checks."""
    _state_secret(config, "hooks.secret", lambda: secrets.token_urlsafe(32))
    return config.state_dir / "hooks.secret"


def hooks_workspace(config: ServicesConfig) -> dict[str, Any]:
    """The Workspace (fields) the receiver reconciles in: the services of this state dir, the flows' catalog."""
    store = config.serve_adapter_root or ServingConfig.load(config.serve_config).adapter_root
    catalog = config.catalog_url or f"sqlite:///{(config.state_dir.parent / 'catalog.db').resolve()}"
    return {
        "tracking_uri": config.url("mlflow"),
        "serving_url": config.url("serve"),
        "store": str(Path(store).resolve()),
        "catalog_url": catalog,
        "admin_token_file": str((config.state_dir / "serve.token").resolve()),
    }


def register_webhook(config: ServicesConfig) -> str:
    """Point MLflow's alias webhook at the receiver (idempotent); what was done, for `mint up` to show."""
    if not healthy(config.url("mlflow"), HEALTH_PATH["mlflow"]):
        return "MLflow is not running here: no webhook registered (the reconcile deployment still runs)"
    # MLflow's client is only imported here: `mint --help` and the other services never load it
    from mint_app.services.mlflow_auth import as_service
    from mint_app.services.webhooks import WEBHOOK_PATH
    from mint_core.registry.webhooks import ensure_alias_webhook

    url = config.url("hooks") + WEBHOOK_PATH
    try:
        secret = _hooks_secret_file(config).read_text().strip()
        with as_service(config):  # webhooks are an admin's to manage
            hook = ensure_alias_webhook(config.url("mlflow"), url, secret)
    except MintError as e:
        raise ServiceError(f"hooks: {e}") from e
    return f"MLflow alias webhook {hook} -> {url}"


def running_base(config: ServicesConfig) -> str | None:
    """The base the running mint serve of this state dir was started on (its record), unless the config names
    one: so `mint up --base DIR` and a later command with no --base agree on what the flows train."""
    if config.serve_base is not None:
        return None
    record = read_record(config, "serve") or {}
    return record.get("base") if record and alive(record["pid"], record.get("create_time")) else None


def serve_base(config: ServicesConfig) -> str:
    """The base `mint serve` loads; builds the tiny default into the state dir the first time it is needed."""
    if config.serve_base is not None:
        return config.serve_base
    if (BUILTIN_BASE / "config.json").is_file():
        return str(BUILTIN_BASE.resolve())
    out = (config.state_dir / "tiny-dense").resolve()  # its directory name is the served model name
    if not (out / "config.json").is_file():
        logger.info("data/base is not built (dvc repro): writing a tiny dense base to %s", out)
        tmp = out.with_name(out.name + ".tmp")
        # `mint base build-tiny` (the DVC tiny_base stage's command) in a child: the supervisor never loads torch
        cmd = [sys.executable, "-m", "mint_app.cli.app", "base", "build-tiny", str(tmp), "--family", "dense"]
        made = subprocess.run([*cmd, "--seed", "0"], capture_output=True, text=True)
        if made.returncode != 0:
            raise ServiceError(f"could not write a tiny dense base to {tmp}:\n{made.stdout}{made.stderr}")
        tmp.rename(out)
    return str(out)


def _vllm_base(config: ServicesConfig) -> Path:
    """The base vLLM serves: `serve_base(config)`, refused (ServiceError) unless it is a model directory vLLM can
    run. Checked from its config.json, before anything is built or started."""
    fix = (
        "build data/base (`dvc repro`, or `mint run`, which builds it first), or pass --serve-base a model "
        "directory vLLM can run"
    )
    if config.serve_base is None and not (BUILTIN_BASE / "config.json").is_file():
        raise ServiceError(
            f"vllm: {BUILTIN_BASE} is not built, and the tiny-dense base mint serve falls back to (head_dim 16) "
            f"cannot run on vLLM, whose CPU attention needs a head_dim in {list(VLLM_CPU_HEAD_DIMS)}: {fix}"
        )
    base = Path(serve_base(config))
    try:
        cfg = json.loads((base / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ServiceError(
            f"vllm: the base {str(base)!r} is not a Hugging Face model directory vLLM can load ({e}): {fix}"
        ) from None
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    device = config.serve_device or ServingConfig.load(config.serve_config).device
    if device == "cpu" and head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ServiceError(
            f"vllm: the base {base} has head_dim {head_dim}; vLLM's CPU attention runs only head_dim "
            f"{list(VLLM_CPU_HEAD_DIMS)}: {fix}"
        )
    return base.resolve()


def vllm_config(config: ServicesConfig, name: ServiceName = "vllm") -> VLLMConfig:
    """The vLLM server behind `mint serve` (serving vllm): the same base, rank limit and model length as the
    serving config, on 127.0.0.1:vllm_port, its key and the resolver plugin's token kept in the state dir. `name`:
    which replica of a fleet (`replicas` > 1: each at its own port, on its own cores).
    ServiceError when vLLM's environment is missing or the base is one vLLM cannot run."""
    from mint_core.serving.vllm_process import (  # only here: it reaches torch
        CPU_BIND_ENV,
        VLLMConfig,
        replica_cpus,
        vllm_available,
    )

    if not vllm_available(config.vllm_python):
        raise ServiceError(
            f"vllm: vLLM's environment is missing ({config.vllm_python} is not an interpreter): run `make "
            "vllm-venv` (or bash scripts/bootstrap_vllm.sh), or set vllm_python (MINT_SERVICES_VLLM_PYTHON)"
        )
    base = _vllm_base(config)
    serving = ServingConfig.load(config.serve_config)
    positions = json.loads((base / "config.json").read_text()).get("max_position_embeddings")
    device = config.serve_device or serving.device
    return VLLMConfig(
        python=config.vllm_python.absolute(),  # not resolve(): the venv's python is a symlink out of the venv
        model=base,
        served_model_name=serving.served_model_name or base.name,  # the front's name for it
        host=config.bind_host(name),
        port=config.port(name),
        api_key=_vllm_key(config),
        max_loras=serving.max_loras,
        max_cpu_loras=serving.max_cpu_loras or 4 * serving.max_loras,
        max_lora_rank=_serve_max_lora_rank(config, serving),
        # vLLM refuses a length beyond the base's positions (the embedded engine does not check)
        max_model_len=min(serving.max_model_len, int(positions or serving.max_model_len)),
        dtype=serving.dtype,
        device="cpu" if device == "cpu" else "cuda",
        resolver_url=config.url("serve"),
        resolver_token=_resolver_token(config),
        replica=config.replicas > 1,
        routed_key=_vllm_routed_key(config) if config.replicas > 1 else None,
        # each replica on its own cores (a binding set in the environment wins)
        cpus=replica_cpus(REPLICA_NAMES.index(name), config.replicas)
        if config.replicas > 1 and device == "cpu" and CPU_BIND_ENV not in os.environ
        else None,
    )


def replica_urls(config: ServicesConfig) -> list[str]:
    """The replicas of a fleet (replicas > 1), as mint serve reaches them."""
    return [config.url(n) for n in REPLICA_NAMES[: config.replicas]]


def _vllm_key(config: ServicesConfig) -> str:
    """vLLM's --api-key (given in its environment): only mint serve, its front, knows it."""
    return _state_secret(config, "vllm.key", lambda: secrets.token_urlsafe(24))


def _vllm_routed_key(config: ServicesConfig) -> str:
    """The narrower key the requests mint serve routes to the replicas carry: inference only on them."""
    return _state_secret(config, "vllm-routed.key", lambda: secrets.token_urlsafe(24))


def _resolver_token(config: ServicesConfig) -> str:
    """The bearer token vLLM's resolver plugin asks mint serve's /v1/mint/resolve with."""
    return _state_secret(config, "resolver.token", lambda: secrets.token_urlsafe(24))


def _serve_max_lora_rank(config: ServicesConfig, serving: ServingConfig) -> int:
    """The serving config's max_lora_rank (file or MINT_SERVE_MAX_LORA_RANK) when it sets one, else the one
    `mint up` gives mint serve (serve_max_lora_rank)."""
    return (
        serving.max_lora_rank if "max_lora_rank" in serving.model_fields_set else config.serve_max_lora_rank
    )


def command(name: ServiceName, config: ServicesConfig) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start one service (secrets go in the environment)."""
    host, port = config.host, str(config.port(name))
    env = {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": os.environ.get("MLFLOW_DISABLE_TELEMETRY", "true"),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    }
    if name in REPLICA_NAMES:
        return _replica_command(name, config, env)
    if name in ("serve", "hooks", "worker"):  # they log in to MLflow as mint's service account
        from mint_app.services.mlflow_auth import service_env

        env.update(service_env(config))
    by_name = {
        "mlflow": _mlflow_command,
        "prefect": _prefect_command,
        "hooks": _hooks_command,
        "worker": _worker_command,
    }
    cmd, env = by_name.get(name, _serve_command)(config, host, port, env)
    return (cmd, env) if config.auth else strip_auth(name, cmd, env)  # `mint up --no-auth`


def _mlflow_command(
    config: ServicesConfig, host: str, port: str, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The MLflow server: its store URL (which may hold a password) and webhook settings in the environment."""
    artifacts = config.mlflow_artifacts or str((config.state_dir / "mlflow-artifacts").resolve())
    # the store URL may hold a password: passed in the environment, not on the command line `ps` shows
    env["MLFLOW_BACKEND_STORE_URI"] = config.mlflow_backend()
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "true" if config.mlflow_jobs else "false"
    # alias webhooks to the receiver on this machine (http, a private address); the webhook list is cached
    # for a few seconds only, so a webhook registered by `mint up` fires at once; one key encrypts the stored
    # secret across restarts and uvicorn workers (MLflow makes one per process if none is given)
    env["MLFLOW_WEBHOOK_ALLOWED_SCHEMES"] = "http,https"
    env["MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS"] = "true"
    env["MLFLOW_WEBHOOK_CACHE_TTL"] = "2"
    env["MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY"] = os.environ.get(
        "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY"
    ) or _state_secret(
        config, "mlflow-webhook.key", lambda: base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
    )
    # behind mint's auth app (MLflow's basic-auth, users and rights from the access file: mlflow_auth)
    from mint_app.services.mlflow_auth import ACCESS_FILE_ENV, APP_NAME, QUIET_IMPORT_WARNING, write_ini

    # MLflow's own import of an API Starlette deprecated: a line in its log for nothing the user can change
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), QUIET_IMPORT_WARNING) if w)

    env["MLFLOW_AUTH_CONFIG_PATH"] = str(write_ini(config).resolve())
    env[ACCESS_FILE_ENV] = str(access_path(config.state_dir).resolve())
    env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = _state_secret(
        config, "mlflow-flask.key", lambda: secrets.token_hex(32)
    )
    cmd = [console_script("mlflow"), "server", "--artifacts-destination", artifacts, "--serve-artifacts"]
    cmd += ["--host", host, "--port", port, "--workers", str(config.mlflow_workers), "--app-name", APP_NAME]
    if config.mlflow_allowed_hosts:
        cmd += ["--allowed-hosts", config.mlflow_allowed_hosts]
    return cmd, env


def _prefect_command(
    config: ServicesConfig, host: str, port: str, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The Prefect server, its state in the state dir and its dashboard calling its own port, behind the access
    file's auth string (every API route but its health probes; the dashboard asks for it at a login prompt)."""
    env["PREFECT_HOME"] = str((config.state_dir / "prefect").resolve())
    # the server's own clients send it too (over a prefect.toml of the working directory, which may be another's)
    env[SERVER_AUTH_ENV] = env[AUTH_ENV] = server_auth(config)
    write_client_settings(config)  # the owner's Prefect clients in the project's directory
    # the dashboard's API calls go here: left unset, the UI calls port 4200 whatever port the server is on
    env["PREFECT_UI_API_URL"] = config.url("prefect") + "/api"
    database = config.prefect_database()
    if database is not None:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database
    if database is None or database.startswith("sqlite"):  # Prefect's busy-heartbeat ERROR, said as harmless
        env["PREFECT_LOGGING_SETTINGS_PATH"] = str(_prefect_logging(config))
    return [
        console_script("prefect"),
        "server",
        "start",
        "--host",
        host,
        "--port",
        port,
        "--analytics-off",
    ], env


def _hooks_command(
    config: ServicesConfig, host: str, port: str, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """mint's alias-webhook receiver."""
    env["MINT_HOOKS_HOST"], env["MINT_HOOKS_PORT"] = host, port
    env["MINT_HOOKS_SECRET_FILE"] = str(_hooks_secret_file(config).resolve())
    env["MINT_HOOKS_WORKSPACE"] = json.dumps(hooks_workspace(config))
    if config.hooks_sweep_s is not None:
        env["MINT_HOOKS_SWEEP_S"] = str(config.hooks_sweep_s)
    return [sys.executable, "-m", "mint_app.services.webhooks"], env


def _worker_command(
    config: ServicesConfig, host: str, port: str, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The Prefect process worker that runs the deployments' flows against this state dir's servers."""
    # flow runs inherit this environment (and the job variables of infra/prefect.yaml): the servers of this
    # state dir, so a deployment's default Workspace reaches them
    env["PREFECT_API_URL"] = config.url("prefect") + "/api"
    if auth := client_auth(config):  # its flow runs inherit it
        env[AUTH_ENV] = auth
    env["PREFECT_HOME"] = str((config.state_dir / "prefect").resolve())
    env["PREFECT_WORKER_WEBSERVER_HOST"] = host
    env["PREFECT_WORKER_WEBSERVER_PORT"] = port
    # a run created from the dashboard waits for the worker's next poll: every 2 s, not Prefect's 10
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", os.environ.get("PREFECT_WORKER_QUERY_SECONDS", "2"))
    env["MLFLOW_TRACKING_URI"] = config.url("mlflow")
    token = config.state_dir / "serve.token"
    if token.is_file() and "MINT_SERVE_ADMIN_TOKEN" not in os.environ:
        env["MINT_SERVE_ADMIN_TOKEN"] = token.read_text().strip()
    # the runs it starts keep their work on this host (checkpoints, cached results) and name their worker in
    # their run lease, so this worker, started again, knows which runs were its own (docs/multi-host.md)
    env[WORK_DIR_ENV] = str((config.state_dir.parent / "lifecycle").resolve())
    env[WORKER_ENV] = config.worker_name
    cmd = [console_script("prefect"), "worker", "start", "--pool", work_pool(config), "--type", "process"]
    cmd += ["--name", config.worker_name, "--with-healthcheck", "--install-policy", "never"]
    return cmd + (["--limit", str(config.worker_limit)] if config.worker_limit else []), env


def _replica_command(
    name: ServiceName, config: ServicesConfig, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """One vLLM replica, on its own GPU where there are several."""
    vllm = vllm_config(config, name)
    try:
        cmd, vllm_env = vllm.command()
    except ValueError as e:  # a base whose modules vLLM cannot be told (no readable safetensors)
        raise ServiceError(f"{name}: {e}") from None
    env.update(vllm_env)
    device = config.serve_device or ServingConfig.load(config.serve_config).device
    if config.replicas > 1 and device.startswith("cuda"):  # replica i on GPU i (from cuda:N: N + i)
        first = int(device.removeprefix("cuda:")) if device.startswith("cuda:") else 0
        env["CUDA_VISIBLE_DEVICES"] = str(first + REPLICA_NAMES.index(name))
    elif device.startswith("cuda:"):  # vLLM takes the first GPU it sees
        env["CUDA_VISIBLE_DEVICES"] = device.removeprefix("cuda:")
    return cmd, env


def _serve_command(
    config: ServicesConfig, host: str, port: str, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """mint serve: the embedded engine with the Tinker training API, or the front of the vLLM service."""
    cmd = [sys.executable, "-m", "mint_app.cli.app", "serve", "--host", host, "--port", port]
    cmd += ["--base", serve_base(config)]
    if config.serve_config is not None:
        cmd += ["--config", str(config.serve_config.resolve())]
    if config.serve_adapter_root is not None:
        cmd += ["--adapter-root", str(config.serve_adapter_root.resolve())]
    if config.serve_device is not None:
        cmd += ["--device", config.serve_device]
    # a token from the environment or the serving config wins; else one kept in the state dir, so the admin
    # routes of a server started by `mint up` have a token that can be read back
    serving = ServingConfig.load(config.serve_config)
    if "max_lora_rank" not in serving.model_fields_set:
        env["MINT_SERVE_MAX_LORA_RANK"] = str(config.serve_max_lora_rank)
    if serving.admin_token is None:
        env["MINT_SERVE_ADMIN_TOKEN"] = serve_token(config)
    if serving.access_file is None and serving.api_key is None:
        # serving keys, on by default (loopback too: any local user reaches the port); made on first start
        access = access_path(config.state_dir).resolve()
        ensure_access(access)
        env["MINT_SERVE_ACCESS_FILE"] = str(access)
    if serving.catalog_url is None:
        # a policy name resolves to its champion in the flows' catalog on demand: after any restart, the first
        # request for a policy is answered by its champion (no 404 until reconcile loads it)
        env["MINT_SERVE_CATALOG_URL"] = hooks_workspace(config)["catalog_url"]
    if config.serving == "vllm":
        # the front of the vLLM service (vLLM's resolver plugin asks it for names it does not hold). The Tinker
        # training API is the embedded engine's: not here.
        env["MINT_SERVE_BACKEND"] = "vllm"
        env["MINT_SERVE_VLLM_URL"] = config.url("vllm")
        if config.replicas > 1:  # the front routes over the replicas itself
            env["MINT_SERVE_VLLM_REPLICAS"] = json.dumps(replica_urls(config))
            env["MINT_SERVE_VLLM_ROUTED_KEY"] = _vllm_routed_key(config)
        env["MINT_SERVE_VLLM_API_KEY"] = _vllm_key(config)
        env["MINT_SERVE_RESOLVER_TOKEN"] = _resolver_token(config)
        return cmd, env
    # the Tinker training API: a key kept in the state dir (unless keys are configured), and a named
    # save_weights_for_sampler becomes an MLflow version indexed in the flows' catalog
    if serving.tinker_api_keys is None and serving.tinker_api_keys_file is None:
        env["MINT_SERVE_TINKER_API_KEYS_FILE"] = str(tinker_keys_file(config).resolve())
    if serving.tinker_registry_uri is None:
        env["MINT_SERVE_TINKER_REGISTRY_URI"] = config.url("mlflow")
        env["MINT_SERVE_TINKER_CATALOG_URL"] = hooks_workspace(config)["catalog_url"]
    return cmd, env


def _prefect_logging(config: ServicesConfig) -> Path:
    """The Prefect server's logging config (`mint_app.services.prefect_logging`), written into the state dir."""
    from mint_app.services.prefect_logging import write_config

    default = Path(
        console_script("prefect")
    ).parent.parent  # the environment Prefect is installed in: find its logging.yml
    found = next(default.glob("lib/python*/site-packages/prefect/logging/logging.yml"), None)
    if found is None:
        raise ServiceError(f"prefect: its logging.yml is not under {default} (is Prefect installed there?)")
    return write_config(found, (config.state_dir / "prefect-logging.yml").resolve())


def tinker_keys_file(config: ServicesConfig) -> Path:
    """The Tinker API key of `mint serve` under this state dir (`tml-...`, made once, readable by its owner)."""
    _state_secret(config, "tinker.keys", lambda: "tml-" + secrets.token_urlsafe(24))
    return config.state_dir / "tinker.keys"
