"""The `mint` commands that run a flow find the stack `mint up` started for the workspace (its records in
`.mint/run`): run from a clean environment (no PREFECT_API_URL, no MLFLOW_TRACKING_URI, no state dir variable) in
the workspace's directory, each says which Prefect server it used, and its flow run is on that server, with the
workspace's MLflow as its tracking server; none starts a temporary Prefect server."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mint_app.services.config import ServicesConfig
from mint_app.services.control import start, stop
from mint_app.services.prefect_auth import auth_header
from mint_core.access import access_path, load
from mint_testkit.harness import cli_env, free_port

pytestmark = pytest.mark.integration

UNSET = (
    "PREFECT_API_URL",
    "MLFLOW_TRACKING_URI",
    "MINT_SERVICES_STATE_DIR",
    "MINT_CATALOG_URL",
    "PREFECT_HOME",
)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServicesConfig]]:
    """A workspace directory whose `.mint/run` holds a running MLflow and Prefect server, as `mint up` leaves it
    (on free ports: the defaults may be taken on a shared machine)."""
    home = tmp_path_factory.mktemp("workspace")
    config = ServicesConfig.model_validate(
        {"state_dir": home / ".mint" / "run", "mlflow_port": free_port(), "prefect_port": free_port()}
    )
    start(config, ["mlflow", "prefect"])
    try:
        yield home, config
    finally:
        stop(config, ["mlflow", "prefect"])


# each command runs its flow for a policy nobody registered: the flow run is made, then fails fast
COMMANDS = {
    "canary": (("canary", "nosuch", "1", "--share", "0.5"), "canary"),
    "registry promote --canary": (
        ("registry", "promote", "nosuch", "1", "--canary", "0.5", "-m", "tried"),
        "canary",
    ),
    "lifecycle": (("lifecycle", "--params", "bad.yaml"), "lifecycle"),
    "wave": (("wave", "--params", "bad.yaml"), "wave"),
}


# wave and lifecycle: 14 s each, in the slow tier (canary and registry keep the default tier on the stack)
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in ("wave", "lifecycle") else c for c in COMMANDS]
)
def test_flow_command_runs_on_the_workspace_stack(case: str, workspace: tuple[Path, ServicesConfig]) -> None:
    home, config = workspace
    args, flow_name = COMMANDS[case]
    # a policy whose base does not exist: the flow run starts, then fails before any training
    (home / "bad.yaml").write_text("training: {steps: 1}\nworkspace: {base: no-such-base}\n")
    env_home = home / f"prefect-home-{flow_name}"  # a user who never configured Prefect
    out = subprocess.run(
        [sys.executable, "-m", "mint_app.cli.app", *args],
        cwd=home,
        capture_output=True,
        text=True,
        env=cli_env(UNSET, PREFECT_HOME=str(env_home)),
        timeout=300,
    )
    text = out.stdout + out.stderr
    prefect = config.url("prefect")
    assert f"Prefect: {prefect} (the workspace's" in text, text[-3000:]
    assert "temporary" not in text.lower(), text[-3000:]
    found = re.search(rf"flow run: {re.escape(prefect)}/runs/flow-run/([0-9a-f-]{{36}})", text)
    assert found, text[-3000:]
    assert out.returncode != 0, text[-3000:]  # the flow failed: nobody registered the policy
    api = config.url("prefect") + "/api"
    asks = auth_header(load(access_path(config.state_dir)).service.prefect_auth)  # the server asks it
    run = httpx.get(f"{api}/flow_runs/{found.group(1)}", headers=asks, timeout=10, trust_env=False)
    assert run.status_code == 200, run.text
    got = httpx.get(f"{api}/flows/{run.json()['flow_id']}", headers=asks, timeout=10, trust_env=False)
    flow = got.json()
    assert flow["name"] == flow_name
    workspace_param = run.json()["parameters"].get("workspace") or {}
    assert workspace_param.get("tracking_uri") == config.url("mlflow"), run.json()["parameters"]


def test_registry_commands_use_the_workspace_mlflow(workspace: tuple[Path, ServicesConfig]) -> None:
    """`mint registry promote` / `rollback` / `ls` from a clean environment read and move the aliases of the
    workspace's MLflow (not the default :5000), with the catalog and store beside the state dir."""
    from mlflow import MlflowClient

    from mint_app.services.mlflow_auth import as_service
    from mint_core.registry.catalog import Catalog, CatalogConfig
    from mint_core.registry.mlflow_registry import Registry
    from mint_core.registry.reader import RegistryConfig
    from mint_core.registry.store import AdapterStore
    from tests.integration.test_registry import BASE, _put

    home, config = workspace
    mlflow = config.url("mlflow")
    # this process logs in to the stack's MLflow as mint's service account; the CLI finds the login itself
    with as_service(config):
        store = AdapterStore(home / ".mint" / "store")
        catalog = Catalog(CatalogConfig(url=f"sqlite:///{home}/.mint/catalog.db"))
        reg = Registry(store, catalog, RegistryConfig(tracking_uri=mlflow))
        for seed in (1, 2):
            reg.create_revision("pol", _put(store, home, seed), base=BASE, rank=2)

        def mint(*args: str) -> str:
            out = subprocess.run(
                [sys.executable, "-m", "mint_app.cli.app", *args],
                cwd=home,
                capture_output=True,
                text=True,
                # without this process's login: the CLI logs in itself (the stack's access file)
                env=cli_env((*UNSET, "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")),
                timeout=300,
            )
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stdout

        assert "unset -> v1" in mint("registry", "promote", "pol", "1", "-m", "first")
        assert "v1 -> v2" in mint("registry", "promote", "pol", "2", "-m", "better")
        assert "v2 -> v1" in mint("registry", "rollback", "pol", "-m", "regressed")
        assert "champion" in mint("registry", "ls", "pol")
        assert MlflowClient(mlflow).get_model_version_by_alias("pol", "champion").version == "1"
