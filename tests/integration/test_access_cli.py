"""`mint access` and the access file on a stack: first start writes it and says where (no secret printed),
the commands check their input before they change anything, keys rotate and revoke as mint serve's KeyRing sees
them, a user change reaches MLflow's auth app; on a non-loopback --host `mint up` refuses a service without its
auth and starts nothing, and with --insecure `mint status` shows it in red."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from mint_app.cli.app import app
from mint_app.cli.services import auth_cell
from mint_app.job.report import credentials_line
from mint_app.services.config import Service, ServicesConfig
from mint_app.services.control import start, status, stop
from mint_app.services.mlflow_auth import AUTH_CACHE_S
from mint_core import access
from mint_core.access import KeyRing
from mint_testkit.harness import cli_env, free_port
from mint_testkit.waiting import wait_until

pytestmark = pytest.mark.integration

RUNNER = CliRunner()


def _mint(*args: str, rc: int = 0) -> str:
    """`mint ARGS` in this process (the same command line), its output; asserts its exit status."""
    r = RUNNER.invoke(app, list(args))
    assert r.exit_code == rc, f"mint {' '.join(args)}: {r.exit_code}\n{r.output}"
    return r.output


def _flat(output: str) -> str:
    """The output as one line: typer's error box and its wrapping taken out."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def _secret(output: str) -> str:
    found = re.search(r"(?:secret \(Authorization: Bearer \.\.\.\)|password of \S+): (\S+)", output)
    assert found, output
    return found.group(1)


def test_user_commands_check_first_and_change_only_what_they_say(tmp_path: Path) -> None:
    sd = ("--state-dir", str(tmp_path / "run"))
    path = access.access_path(tmp_path / "run")
    out = _mint(
        "access", "users", "add", "rita", "--role", "reviewer", "--policies", "shout, tenant-a/*", *sd
    )
    assert f"wrote {path}" in out  # no file yet: made with the admin and default key, then changed
    found = access.load(path)
    assert found.users["rita"].role == "reviewer" and found.users["rita"].policies == ["shout", "tenant-a/*"]
    assert _secret(out) == found.users["rita"].password
    assert "admin" in found.users and "default" in found.keys
    before = path.read_bytes()
    refused = {
        ("users", "add", "vic", "--role", "viewer", "--policies", "x"): "--policies is for reviewers",
        ("users", "add", "rev", "--role", "reviewer"): "a reviewer needs --policies",
        ("users", "add", "bo", "--role", "boss"): "'boss' is not a role: choose one of viewer, reviewer",
        ("users", "add", "b b", "--role", "viewer"): "'b b' is not a valid user name",
        ("users", "add", "rita", "--role", "viewer"): "a user named 'rita' exists (reviewer)",
        ("users", "add", "mint", "--role", "viewer"): "'mint' is mint's own MLflow account",
        ("users", "set-role", "admin", "--role", "viewer"): "'admin' is the last admin",
        ("users", "remove", "admin"): "'admin' is the last admin",
        ("users", "remove", "nobody"): "no user named 'nobody' (users: admin, rita)",
        ("users", "reset-password", "nobody"): "no user named 'nobody'",
        ("keys", "add", "k", "--policies", "a,,b"): "none empty",
        ("keys", "add", "default", "--policies", "*"): "a key named 'default' exists",
        ("keys", "rotate", "nope"): "no serving key named 'nope' (keys: default)",
    }
    for args, says in refused.items():
        r = RUNNER.invoke(app, ["access", *args, *sd])
        assert r.exit_code != 0 and says in _flat(r.output), (args, r.output)
    assert path.read_bytes() == before  # nothing written by a refused command
    old = found.users["rita"].password
    _mint("access", "users", "set-role", "rita", "--role", "operator", *sd)
    new = _secret(_mint("access", "users", "reset-password", "rita", *sd))
    after = access.load(path).users["rita"]
    assert (after.role, after.policies, after.password) == ("operator", [], new) and new != old
    _mint("access", "users", "set-role", "rita", "--role", "admin", *sd)
    _mint("access", "users", "remove", "admin", *sd)  # another admin now: allowed
    assert sorted(access.load(path).users) == ["rita"]


def test_keys_add_rotate_revoke_as_mint_serve_sees_them(tmp_path: Path) -> None:
    sd = ("--state-dir", str(tmp_path / "run"))
    path = access.access_path(tmp_path / "run")
    first = access.ensure(path)[0].keys["default"].secret
    ring = KeyRing(path, recheck_s=0.05)  # what mint serve checks bearer keys with
    out = _mint("access", "keys", "add", "tenant-a", "--policies", "tenant-a/*", *sd)
    secret = _secret(out)
    got = wait_until(lambda: ring.match(secret), timeout=5, what="the new key is read")
    assert (
        got is not None
        and got[0] == "tenant-a"
        and got[1].allows("tenant-a/sum")
        and not got[1].allows("tenant-b/sum")
    )
    rotated = _secret(_mint("access", "keys", "rotate", "tenant-a", *sd))
    now = wait_until(lambda: ring.match(rotated), timeout=5, what="the rotated key is read")
    assert now is not None and ring.match(secret) is None and now[1].policies == ["tenant-a/*"]
    _mint("access", "keys", "revoke", "tenant-a", *sd)
    wait_until(lambda: ring.match(rotated) is None, timeout=5, what="the revoked key is refused")
    assert ring.match(first) is not None  # the others untouched
    shown = _mint("access", "show", *sd)
    assert str(path) in shown and "default" in shown and first not in shown
    assert "admin" in shown and access.load(path).users["admin"].password not in shown
    secrets = _mint("access", "show", "--secrets", *sd)
    assert first in secrets and access.load(path).users["admin"].password in secrets
    assert _mint("access", "keys", "secret", *sd) == first + "\n"  # KEY=$(mint access keys secret)
    assert "no serving key named 'tenant-a'" in _flat(
        _mint("access", "keys", "secret", "tenant-a", *sd, rc=1)
    )


def test_show_without_a_file_says_mint_up_writes_it(tmp_path: Path) -> None:
    out = _mint("access", "show", "--state-dir", str(tmp_path / "run"), rc=1)
    assert "mint up writes it on first start" in out and not (tmp_path / "run" / "access.json").exists()


def test_the_job_s_report_says_where_the_credentials_are_and_no_secret(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert credentials_line(run).startswith(f"no credentials: {run / 'access.json'}: cannot read")
    found, _ = access.ensure(access.access_path(run))
    line = credentials_line(run)
    assert line.startswith(f"{run / 'access.json'} (admin: admin; serving keys: default;")
    assert line.endswith(f"mint access show --secrets --state-dir {run}")
    assert found.users["admin"].password not in line and found.keys["default"].secret not in line


def test_on_the_network_without_auth_mint_up_refuses_and_starts_nothing(tmp_path: Path) -> None:
    """First start writes the access file and says where (no secret); then every service that would run
    without its auth on 0.0.0.0 is named with what it lacks, and none starts."""
    run = tmp_path / "run"
    ports = {f"--{n}-port": str(free_port()) for n in ("mlflow", "prefect", "serve")}
    args = ["up", "--host", "0.0.0.0", "--no-auth", "--state-dir", str(run), "--only", "mlflow,prefect,serve"]
    args += ["--base", str(tmp_path / "base"), *(x for kv in ports.items() for x in kv)]
    out = subprocess.run(
        [sys.executable, "-m", "mint_app.cli.app", *args],
        capture_output=True,
        text=True,
        env=cli_env(("MINT_SERVICES_STATE_DIR", "MINT_SERVICES_INSECURE", "MINT_SERVICES_AUTH")),
        timeout=300,
    )
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 1, text
    path = access.access_path(run)
    found = access.load(path)
    assert f"first start, wrote {path}" in text and "admin user 'admin'" in text and "key 'default'" in text
    for secret in (found.users["admin"].password, found.keys["default"].secret, found.service.prefect_auth):
        assert secret not in text
    assert "refused to start any service: --host 0.0.0.0 is not loopback" in text
    assert "mlflow: MLflow would run without its auth app" in text
    assert "prefect: the Prefect server would run without its auth string" in text
    assert "serve: mint serve would answer any caller" in text
    assert "--insecure" in text
    assert not list(run.glob("*.pid"))  # nothing was launched
    config = ServicesConfig.model_validate({"state_dir": run, "mlflow_port": int(ports["--mlflow-port"])})
    assert [s.state for s in status(config, ["mlflow"])] == ["stopped"]


def _ansi(markup: str) -> str:
    """The markup as a terminal shows it (ANSI colours)."""
    console = Console(force_terminal=True, color_system="standard", width=200)
    with console.capture() as cap:
        console.print(markup)
    return cap.get()


def test_the_status_cell_shows_a_service_exposed_without_auth_in_red(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    exposed = Service("mlflow", "running", "http://h:1", 1, log, auth=False, exposed=True, without_auth="why")
    local = Service("mlflow", "running", "http://h:1", 1, log, auth=False, exposed=False, without_auth="why")
    on = Service("mlflow", "running", "http://h:1", 1, log, auth=True)
    assert "\x1b[1;31mOFF, on the network" in _ansi(auth_cell(exposed))
    assert "\x1b[33moff" in _ansi(auth_cell(local))
    assert "\x1b[32mon" in _ansi(auth_cell(on))
    assert auth_cell(Service("mlflow", "stopped", "http://h:1", None, log)) == ""


@pytest.mark.slow
def test_insecure_starts_it_and_status_shows_it_in_red(tmp_path: Path) -> None:
    """--insecure on 0.0.0.0: MLflow starts without its auth, its record says so, `mint status` paints it red;
    the API answers with no login at all."""
    run, port = tmp_path / "run", free_port()
    config = ServicesConfig.model_validate(
        {"state_dir": run, "mlflow_port": port, "host": "0.0.0.0", "auth": False, "insecure": True}
    )
    try:
        start(config, ["mlflow"])
        record = json.loads((run / "mlflow.json").read_text())
        assert record["auth"]["on"] is False and record["auth"]["exposed"] is True
        r = httpx.get(f"http://127.0.0.1:{port}/api/2.0/mlflow/registered-models/search", timeout=30)
        assert r.status_code == 200  # no login asked: what --insecure means
        out = subprocess.run(
            [sys.executable, "-m", "mint_app.cli.app", "status", "--state-dir", str(run), "--only", "mlflow"],
            capture_output=True,
            text=True,
            env=cli_env(("MINT_SERVICES_STATE_DIR",), FORCE_COLOR="1"),
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "\x1b[1;31mOFF, on the network" in out.stdout, out.stdout
        assert "auth OFF for mlflow" in out.stdout
    finally:
        stop(config, ["mlflow"])


@pytest.mark.slow
def test_a_user_change_reaches_mlflow_at_once(tmp_path: Path) -> None:
    """With the stack's MLflow running, `mint access users add` lets the new login in at once,
    `reset-password` turns the old password away and `remove` the login (within MLflow's AUTH_CACHE_S)."""
    run, port = tmp_path / "run", free_port()
    config = ServicesConfig.model_validate({"state_dir": run, "mlflow_port": port})
    url = f"http://127.0.0.1:{port}/api/2.0/mlflow/registered-models/search"
    sd = ("--state-dir", str(run))
    try:
        (mlflow,) = start(config, ["mlflow"])
        assert mlflow.url.endswith(str(port))
        assert httpx.get(url, timeout=30).status_code == 401
        password = _secret(_mint("access", "users", "add", "vic", "--role", "viewer", *sd))
        assert httpx.get(url, auth=("vic", password), timeout=30).status_code == 200
        new = _secret(_mint("access", "users", "reset-password", "vic", *sd))
        assert httpx.get(url, auth=("vic", new), timeout=30).status_code == 200
        # a login MLflow checked is trusted for AUTH_CACHE_S: the old password lasts that long at most
        turned_away = lambda pw: httpx.get(url, auth=("vic", pw), timeout=30).status_code == 401  # noqa: E731
        wait_until(lambda: turned_away(password), timeout=AUTH_CACHE_S + 20, what="the old password refused")
        _mint("access", "users", "remove", "vic", *sd)
        wait_until(lambda: turned_away(new), timeout=AUTH_CACHE_S + 20, what="the removed user refused")
    finally:
        stop(config, ["mlflow"])
