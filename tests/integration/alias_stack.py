"""What the alias tests share: MLflow, `mint serve` and the webhook receiver as `mint up` starts them (free ports,
a temporary state dir, MLflow's alias webhook registered), and a policy with a few registered revisions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from mint_app.services.commands import hooks_workspace
from mint_app.services.config import Service, ServiceName, ServicesConfig
from mint_app.services.control import start, stop
from mint_app.services.mlflow_auth import as_service, sync_users
from mint_core import access
from mint_core.access import Role
from mint_core.engine.base import build_tiny_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lifecycle.leases import policy_lock
from mint_core.lifecycle.reconcile import reconcile
from mint_core.lifecycle.smoke import served_revision
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.store import AdapterStore
from mint_testkit.harness import free_port

SERVICES: list[ServiceName] = ["mlflow", "serve", "hooks"]
BOUND_S = 3.0
"""The issue's bound from an alias move to serving answering with that revision."""


@dataclass
class Stack:
    config: ServicesConfig
    services: dict[ServiceName, Service]
    ws: Workspace
    policy: str
    digests: dict[int, str]
    """version -> `sha256:<hex>` served for it."""

    @property
    def mlflow(self) -> str:
        return self.services["mlflow"].url

    @property
    def hooks(self) -> str:
        return self.services["hooks"].url

    def served(self) -> str | None:
        with self.ws.client(timeout=10) as client:
            return served_revision(client, self.policy)

    def wait_served(self, version: int, bound: float = BOUND_S) -> float:
        """Seconds until the server lists the policy with `version`'s digest; AssertionError after `bound` s."""
        t0 = time.perf_counter()
        while (got := self.served()) != self.digests[version]:
            assert time.perf_counter() - t0 < bound, (
                f"v{version} not served {bound} s after the move: serving {got}, want {self.digests[version]}"
            )
            time.sleep(0.02)
        return time.perf_counter() - t0


def services_config(state: Path) -> ServicesConfig:
    return ServicesConfig.model_validate(
        {
            "state_dir": state / "run",
            "mlflow_port": free_port(),
            "serve_port": free_port(),
            "hooks_port": free_port(),
            # no sweep: the tests move aliases with MLflow's webhook off and check that only a delivery acts
            "hooks_sweep_s": 0,
            "serve_base": "tiny-dense",
            "serve_adapter_root": state / "store",
            "stop_timeout": 10,
        }
    )


@contextmanager
def alias_stack(state: Path, versions: int = 3) -> Iterator[Stack]:
    """The services in `state`, a policy with `versions` revisions, `champion` on v1 and served."""
    config = services_config(state)
    login: AbstractContextManager[dict[str, str]] | None = None
    try:
        services = {s.name: s for s in start(config, SERVICES)}
        # MLflow asks a login: the test's clients log in as mint's service account, as mint's services do
        login = as_service(config)
        login.__enter__()
        ws = Workspace.model_validate(hooks_workspace(config))
        reg = ws.registry()
        store = AdapterStore(ws.store)
        # the weights `mint serve --base tiny-dense` builds (seed 0), so these adapters fit the served base
        base = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
        policy = f"p-{uuid.uuid4().hex[:6]}"
        digests = {}
        for i in range(versions):
            weights = random_adapter(
                base.sites, ["q_proj", "v_proj"], 4, seed=10 + i, base_fingerprint=base.fingerprint
            )
            save_adapter(weights, state / f"a{i}", base.sites)
            rev = reg.create_revision(policy, store.put_dir(state / f"a{i}"), base=base.fingerprint, rank=4)
            digests[rev.version] = f"sha256:{rev.digest}"
        reg.promote(policy, min(digests), "test start")
        with policy_lock(ws, policy, "test"):
            reconcile(ws, policy)
        yield Stack(config, services, ws, policy, digests)
    finally:
        if login is not None:
            login.__exit__(None, None, None)
        stop(config, SERVICES)


def add_users(stack: Stack, users: dict[str, tuple[Role, list[str]]]) -> dict[str, str]:
    """Users (name -> role, policy patterns) added to the stack's access file and synced into MLflow; their
    passwords."""
    with access.edit(access.access_path(stack.config.state_dir)) as (found, _):
        for name, (role, policies) in users.items():
            found.users[name] = access.User(role=role, password=access.new_secret(), policies=policies)
        passwords = {name: found.users[name].password for name in users}
    sync_users(stack.config)
    return passwords
