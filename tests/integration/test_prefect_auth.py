"""The Prefect server `mint up` starts asks its auth string (the access file's `service.prefect_auth`) on every API
route but its health probe: no string or a wrong one gets a 401 and changes nothing, a flow run started without
it is refused and none is made; the owner's own Prefect clients in the project's directory, with only
PREFECT_API_URL set, read deployments and start runs (the `prefect.toml` `mint up` writes there, 0600, ignored by
git); a client anywhere else, without the string, is refused."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mint_app.services.prefect_auth import CLIENT_SETTINGS, MARK, auth_header
from mint_core.access import access_path, load
from mint_testkit.harness import cli_env, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# a user of this machine who configured nothing: no Prefect variable of this test process reaches the clients
UNSET = (
    "PREFECT_API_URL",
    "PREFECT_API_AUTH_STRING",
    "MINT_SERVICES_STATE_DIR",
    "PREFECT_HOME",
    "PREFECT_PROFILE",
)


@dataclass(frozen=True)
class Stack:
    home: Path  # the project's directory `mint up` ran in
    api: str  # http://127.0.0.1:<port>/api
    auth: str  # the access file's service.prefect_auth


def _mint(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mint_app.cli.app", *args],
        cwd=home,
        capture_output=True,
        text=True,
        env=cli_env(UNSET),
        timeout=300,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`mint up --only prefect` run in a project directory of its own (state dir `.mint/run` there), on a free
    port; `mint down` afterwards."""
    home = tmp_path_factory.mktemp("project")
    port = free_port()
    up = _mint(home, "up", "--only", "prefect", "--prefect-port", str(port))
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        auth = load(access_path(home / ".mint" / "run")).service.prefect_auth
        yield Stack(home, f"http://127.0.0.1:{port}/api", auth)
    finally:
        _mint(home, "down", "--only", "prefect")


def _client(cwd: Path, api: str, script: str) -> subprocess.CompletedProcess[str]:
    """A plain Prefect client, as a user runs one: this interpreter, in `cwd`, only PREFECT_API_URL set (a
    PREFECT_HOME of its own: no profile of this machine's user)."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=cli_env(UNSET, PREFECT_API_URL=api, PREFECT_HOME=str(cwd / ".prefect-home")),
        timeout=120,
    )


# reads the deployments, makes one (a flow of its own), starts a run of it; prints the count of its runs
START_A_RUN = """
import json, sys, uuid
from prefect.client.orchestration import get_client
name = sys.argv[1] if len(sys.argv) > 1 else "probe"
with get_client(sync_client=True) as c:
    before = len(c.read_deployments())
    flow_id = c.create_flow_from_name(f"auth-probe-{uuid.uuid4().hex[:6]}")
    dep = c.create_deployment(flow_id=flow_id, name="probe")
    run = c.create_flow_run_from_deployment(dep)
    print(json.dumps({"deployments": before, "run": str(run.id)}))
"""


def _count_runs(stack: Stack) -> int:
    found = httpx.post(
        f"{stack.api}/flow_runs/count", json={}, headers=auth_header(stack.auth), timeout=10, trust_env=False
    )
    assert found.status_code == 200, found.text
    return int(found.json())


def test_the_api_asks_the_string_and_the_health_probe_does_not(stack: Stack) -> None:
    route = f"{stack.api}/deployments/filter"
    no = httpx.post(route, json={}, timeout=10, trust_env=False)
    wrong = httpx.post(
        route, json={}, headers=auth_header("mint:not-the-password"), timeout=10, trust_env=False
    )
    user, _, password = stack.auth.partition(":")
    other_user = httpx.post(
        route, json={}, headers=auth_header(f"admin:{password}"), timeout=10, trust_env=False
    )
    right = httpx.post(route, json={}, headers=auth_header(stack.auth), timeout=10, trust_env=False)
    assert (no.status_code, wrong.status_code, other_user.status_code) == (401, 401, 401)
    assert user == "mint" and right.status_code == 200, right.text
    assert httpx.get(f"{stack.api}/health", timeout=10, trust_env=False).status_code == 200
    # the dashboard knows to ask for it (its login prompt)
    ui = httpx.get(stack.api.removesuffix("/api") + "/ui-settings", timeout=10, trust_env=False)
    assert ui.json()["auth"] == "BASIC"


def test_a_flow_run_started_without_the_string_is_refused_and_none_is_made(stack: Stack) -> None:
    headers = auth_header(stack.auth)
    flow = httpx.post(
        f"{stack.api}/flows/", json={"name": f"refused-{uuid.uuid4().hex[:6]}"}, headers=headers, timeout=10
    )
    assert flow.status_code in (200, 201), flow.text
    dep = httpx.post(
        f"{stack.api}/deployments/",
        json={"name": "refused", "flow_id": flow.json()["id"]},
        headers=headers,
        timeout=10,
    )
    assert dep.status_code in (200, 201), dep.text
    before = _count_runs(stack)
    route = f"{stack.api}/deployments/{dep.json()['id']}/create_flow_run"
    for header in ({}, auth_header("mint:wrong"), {"Authorization": "Bearer " + stack.auth}):
        refused = httpx.post(route, json={}, headers=header, timeout=10, trust_env=False)
        assert refused.status_code == 401, (header.keys(), refused.text)
    # and through Prefect's own client, as a user without the string runs it (another directory: no prefect.toml)
    elsewhere = stack.home.parent / f"elsewhere-{uuid.uuid4().hex[:6]}"
    elsewhere.mkdir()
    out = _client(elsewhere, stack.api, START_A_RUN)
    assert out.returncode != 0 and "401" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert _count_runs(stack) == before


def test_the_owners_plain_client_in_the_project_reads_deployments_and_starts_runs(stack: Stack) -> None:
    settings = stack.home / CLIENT_SETTINGS
    assert settings.read_text().startswith(MARK)
    assert stat.S_IMODE(settings.stat().st_mode) == 0o600
    before = _count_runs(stack)
    out = _client(stack.home, stack.api, START_A_RUN)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run_id = json.loads(out.stdout.strip().splitlines()[-1])["run"]
    assert _count_runs(stack) == before + 1
    run = httpx.get(f"{stack.api}/flow_runs/{run_id}", headers=auth_header(stack.auth), timeout=10)
    assert run.status_code == 200 and run.json()["state_type"] == "SCHEDULED", run.text


def test_git_ignores_the_client_settings_of_the_repository_root() -> None:
    """`mint up` in the repository writes prefect.toml there: git must never see the secret in it."""
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", CLIENT_SETTINGS], cwd=ROOT, capture_output=True, timeout=30
    )
    assert ignored.returncode == 0, f"{CLIENT_SETTINGS} is not in .gitignore"
