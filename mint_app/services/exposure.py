"""Whether a service would run with its auth, read from the command line and environment it is started with
(`commands.command`): the one place that says what "with its auth" means per service, for `mint up`'s refusal
to expose a service without it on a non-loopback host, and for the auth column of `mint status`."""

from __future__ import annotations

import ipaddress

from mint_app.services.config import ServiceName, ServicesConfig
from mint_core.serving.config import ServingConfig

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
AUTH_ENV = {
    "prefect": ("PREFECT_SERVER_API_AUTH_STRING",),
    "serve": ("MINT_SERVE_ACCESS_FILE",),
}
"""What turns a service's auth on in its environment (mlflow's is its command line's --app-name)."""


def loopback(host: str) -> bool:
    """Whether binding to `host` reaches this machine only: 127.0.0.0/8, ::1, localhost. Anything else (a name
    that resolves elsewhere, 0.0.0.0, ::, an interface's address) counts as the network."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def without_auth(
    name: ServiceName, cmd: list[str], env: dict[str, str], config: ServicesConfig
) -> str | None:
    """Why `name`, started with `cmd` and the whole environment `env`, would answer anyone who reaches its
    port; None when it runs with its auth (or has nothing to guard):

    - mlflow: MLflow's auth app (`--app-name`, users from the access file);
    - prefect: the server's auth string (PREFECT_SERVER_API_AUTH_STRING);
    - serve: serving keys (the access file, MINT_SERVE_ACCESS_FILE or the serving config's access_file), or
      one API key for every route (api_key);
    - hooks: the receiver takes only deliveries signed with its secret (MINT_HOOKS_SECRET_FILE);
    - worker: its port answers a health check only; vLLM: loopback only, sealed with mint's key.
    """
    if name == "mlflow" and "--app-name" not in cmd:
        return "MLflow would run without its auth app (--app-name): anyone could move any policy's champion"
    if name == "prefect" and not env.get(AUTH_ENV["prefect"][0]):
        return (
            "the Prefect server would run without its auth string (PREFECT_SERVER_API_AUTH_STRING): anyone "
            "could start, cancel and delete runs"
        )
    if name == "serve" and not _serve_keys(env, config):
        return (
            "mint serve would answer any caller (no serving keys: MINT_SERVE_ACCESS_FILE or the serving "
            "config's access_file, nor an api_key)"
        )
    if name == "hooks" and not env.get("MINT_HOOKS_SECRET_FILE"):
        return "the webhook receiver would take unsigned deliveries (no MINT_HOOKS_SECRET_FILE)"
    return None


def _serve_keys(env: dict[str, str], config: ServicesConfig) -> bool:
    """Whether mint serve started with `env` (and the serving config file `mint up` gives it) asks for keys."""
    if env.get(AUTH_ENV["serve"][0]) or env.get("MINT_SERVE_API_KEY"):
        return True
    serving = ServingConfig.load(config.serve_config)  # the file, and this process's MINT_SERVE_* variables
    return serving.access_file is not None or serving.api_key is not None


def strip_auth(name: ServiceName, cmd: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `name` without what `mint up` adds to turn its auth on (`auth:
    false`, `mint up --no-auth`: a throwaway stack on loopback). Auth a serving config file or the caller's
    environment asks for stays: `without_auth` reads what is left."""
    if name == "mlflow" and "--app-name" in cmd:
        i = cmd.index("--app-name")
        cmd = cmd[:i] + cmd[i + 2 :]
    return cmd, {k: v for k, v in env.items() if k not in AUTH_ENV.get(name, ())}
