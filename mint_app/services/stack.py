"""The stack `mint up` started for this workspace, found from its state dir (`.mint/run`, or
MINT_SERVICES_STATE_DIR): the `mint` commands that run a flow (`wave`, `lifecycle`, `canary`, `registry promote
--canary`) run it on that Prefect server, against that MLflow and mint serve, with no variable to export, and say
which servers they used. While the workspace's Prefect server is up they never start a temporary one (Prefect's
fallback without PREFECT_API_URL), so every run, its logs and its artifacts reach the dashboard.

A variable the user exported (PREFECT_API_URL, MLFLOW_TRACKING_URI) or a flag still wins: it is a choice. The
Prefect server asks its auth string: the commands send the state dir's (`prefect_auth.client_auth`), also to an
exported PREFECT_API_URL that is the workspace's own server, unless PREFECT_API_AUTH_STRING is exported too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mint_app.services.config import ServicesConfig
from mint_app.services.control import status
from mint_app.services.deployments import workspace_defaults
from mint_app.services.prefect_auth import AUTH_ENV, client_auth, prefect_api


@dataclass(frozen=True)
class Stack:
    """The servers of one state dir that answer now (None: not running)."""

    state_dir: Path
    prefect: str | None = None
    """The Prefect server's root URL (its API is under /api, its dashboard at the root)."""
    mlflow: str | None = None
    serve: str | None = None
    workspace: dict[str, Any] = field(default_factory=dict)
    """The flows' `workspace` parameter for these servers: what `mint up` gives its deployments."""
    prefect_auth: str | None = field(default=None, repr=False)
    """The Prefect server's auth string (the state dir's access file), None without one."""

    @property
    def prefect_api(self) -> str | None:
        return None if self.prefect is None else self.prefect + "/api"


def find_stack(config: ServicesConfig | None = None, with_workspace: bool = True) -> Stack:
    """The running MLflow, Prefect and mint serve of the state dir (records and health checks, as `mint status`),
    and with `with_workspace` the flows' workspace for them."""
    config = config or ServicesConfig.load(None)
    up = {s.name: s.url for s in status(config, ["mlflow", "prefect", "serve"]) if s.state == "running"}
    workspace: dict[str, Any] = {}
    if "serve" in up and with_workspace:  # its base, store and token are the ones `mint up` serves with
        workspace = {**workspace_defaults(config), "serving_url": up["serve"]}
        workspace["work_dir"] = str(
            config.state_dir.resolve().parent / "lifecycle"
        )  # this host's, as the worker's
    if "mlflow" in up:
        workspace["tracking_uri"] = up["mlflow"]
        # this process's MLflow clients log in to it as mint's service account (an exported login wins)
        from mint_app.services.mlflow_auth import service_env

        for key, value in service_env(config).items():
            os.environ.setdefault(key, value)
    auth = client_auth(config) if "prefect" in up else None
    return Stack(config.state_dir, up.get("prefect"), up.get("mlflow"), up.get("serve"), workspace, auth)


def flow_workspace(stack: Stack, given: dict[str, Any] | None) -> dict[str, Any]:
    """A flow's `workspace` parameter: the fields given (a --params file, flags) as they are, the rest from the
    running stack; an exported MLFLOW_TRACKING_URI keeps the tracking server it names."""
    out = dict(given or {})
    for key, value in stack.workspace.items():
        if key == "tracking_uri" and os.environ.get("MLFLOW_TRACKING_URI"):
            continue
        out.setdefault(key, value)
    return out


def tracking_uri(given: str | None, default: str) -> str:
    """The MLflow a command talks to: the flag or MLFLOW_TRACKING_URI, else the running stack's, else `default`."""
    if given:
        return given
    return find_stack(with_workspace=False).mlflow or default


@contextmanager
def on_stack(say: Callable[[str], None], config: ServicesConfig | None = None) -> Iterator[Stack]:
    """Flow runs of this process go to the workspace's Prefect server (unless PREFECT_API_URL names one); says
    which servers the flow uses."""
    stack = find_stack(config)
    exported = os.environ.get("PREFECT_API_URL")
    mlflow = os.environ.get("MLFLOW_TRACKING_URI") or stack.mlflow
    also = f"; MLflow {mlflow}" if mlflow else ""
    also += f"; mint serve {stack.serve}" if stack.serve else ""
    if exported and (exported.rstrip("/") != stack.prefect_api or os.environ.get(AUTH_ENV)):
        say(f"Prefect: {exported} (PREFECT_API_URL){also}")
        yield stack
    elif stack.prefect_api is not None:
        say(f"Prefect: {stack.prefect} (the workspace's, {stack.state_dir}){also}")
        with prefect_api(stack.prefect_api, stack.prefect_auth):
            yield stack
    else:
        say(
            f"no Prefect server of this workspace is running ({stack.state_dir}; `mint up` starts one): the flow "
            f"runs on a temporary server that Prefect starts and stops, which the dashboard never shows{also}"
        )
        yield stack


def flow_run_url(stack: Stack, flow_run_id: object) -> str:
    """The dashboard's page of a flow run (the exported PREFECT_API_URL's server, else the workspace's)."""
    api = os.environ.get("PREFECT_API_URL") or stack.prefect_api
    if not api:
        return f"flow run {flow_run_id} (on a temporary Prefect server, gone)"
    return f"{api.removesuffix('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"
