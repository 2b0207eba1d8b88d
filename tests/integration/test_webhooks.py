"""MLflow -> serving within seconds: `mint up`'s webhook receiver, through real MLflow, `mint serve` and receiver
processes started as `mint up` starts them.

An alias moved with a bare `MlflowClient` (what the MLflow UI does) is served within 3 s, with no reconcile flow
running; a delivery with a bad or missing signature is refused with 401 and changes nothing; an event the
receiver has nothing to do for is logged and answered 2xx.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from mlflow import MlflowClient

from mint_app.services.control import start, status
from mint_app.services.webhooks import WEBHOOK_PATH, HooksConfig, Sweeper, create_app
from mint_core.lifecycle.leases import policy_lock
from mint_core.lifecycle.routers import router_registry, served_router
from mint_core.registry.routers import ROUTER_MODEL
from mint_core.registry.webhooks import WEBHOOK_NAME, ensure_alias_webhook, sign
from mint_core.routing import Router, fit_router
from mint_testkit.harness import free_port, mint_cli
from mint_testkit.waiting import wait_until
from tests.integration.alias_stack import BOUND_S, SERVICES, Stack, alias_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with alias_stack(tmp_path_factory.mktemp("alias")) as s:
        yield s


def secret(stack: Stack) -> str:
    return (stack.config.state_dir / "hooks.secret").read_text().strip()


def event(policy: str, alias: str = "champion", version: int | None = 2, action: str = "created") -> bytes:
    data: dict[str, str] = {"name": policy, "alias": alias}
    if version is not None:
        data["version"] = str(version)
    doc = {
        "entity": "model_version_alias",
        "action": action,
        "timestamp": datetime.now(UTC).isoformat(),
        "data": data,
    }
    return json.dumps(doc).encode()


def deliver(
    stack: Stack,
    body: bytes,
    key: str | None = None,
    ts: str | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST `body` to the receiver as MLflow does, signed with `key` (default: the real secret)."""
    delivery, ts = str(uuid.uuid4()), ts or str(int(time.time()))
    signed = {
        "X-MLflow-Delivery-Id": delivery,
        "X-MLflow-Timestamp": ts,
        "X-MLflow-Signature": sign(key or secret(stack), delivery, ts, body),
        "Content-Type": "application/json",
    }
    return httpx.post(stack.hooks + WEBHOOK_PATH, content=body, headers=headers or signed, timeout=60)


@pytest.fixture(scope="class")
def webhook_off(stack: Stack) -> Iterator[None]:
    """MLflow's webhook disabled for a class of tests (past MLflow's 2 s webhook cache), so only the tests' own
    deliveries reach the receiver; registered again afterwards as `mint up` does. Once per class: each switch
    waits out that cache, 5 s a test when it was per test."""
    client = MlflowClient(stack.mlflow)
    hook = next(w for w in client.list_webhooks() if w.name == WEBHOOK_NAME)
    client.update_webhook(hook.webhook_id, status="DISABLED")
    time.sleep(2.5)
    try:
        yield
    finally:
        ensure_alias_webhook(stack.mlflow, stack.hooks + WEBHOOK_PATH, secret(stack))
        time.sleep(2.5)


def test_mint_up_registers_one_webhook_and_reuses_it(stack: Stack) -> None:
    client = MlflowClient(stack.mlflow)
    hooks = [w for w in client.list_webhooks() if w.name == WEBHOOK_NAME]
    assert len(hooks) == 1
    assert hooks[0].url == stack.hooks + WEBHOOK_PATH
    assert {str(e) for e in hooks[0].events} == {"model_version_alias.created", "model_version_alias.deleted"}
    again = {s.name: s for s in start(stack.config, SERVICES)}
    assert all(s.reused for s in again.values())
    assert again["hooks"].detail and hooks[0].webhook_id in again["hooks"].detail
    assert [w.webhook_id for w in client.list_webhooks() if w.name == WEBHOOK_NAME] == [hooks[0].webhook_id]
    # `mint status` shows the receiver
    shown = {s.name: s.state for s in status(stack.config)}
    assert shown["hooks"] == "running"
    out = mint_cli("status", "--state-dir", str(stack.config.state_dir), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MLflow webhook receiver" in out.stdout and "running" in out.stdout


def test_an_alias_moved_with_a_bare_client_is_served_within_seconds(stack: Stack) -> None:
    client = MlflowClient(stack.mlflow)  # no mint code on the writer's side, as in the MLflow UI
    for version in (2, 3, 1, 3):
        client.set_registered_model_alias(stack.policy, "champion", str(version))
        took = stack.wait_served(version)
        assert took < BOUND_S
        with stack.ws.client() as serving:
            out = serving.complete(stack.policy, "add: 1+1 =", max_tokens=2, temperature=0.0)
        assert str(out["system_fingerprint"]).removeprefix("sha256:") == stack.digests[version].removeprefix(
            "sha256:"
        )
    # the catalog's index followed MLflow too (the move is logged as made in MLflow)
    assert stack.ws.registry().catalog.alias_moves(stack.policy, "champion", limit=1)[0].to_version == 3


def test_deleting_the_champion_alias_leaves_serving_as_it_is(stack: Stack) -> None:
    client = MlflowClient(stack.mlflow)
    client.set_registered_model_alias(stack.policy, "champion", "2")
    stack.wait_served(2)
    client.delete_registered_model_alias(stack.policy, "champion")
    r = deliver(stack, event(stack.policy, version=None, action="deleted"))
    assert r.status_code == 200, r.text
    assert r.json()["champion"] is None and r.json()["reloaded"] is False
    assert stack.served() == stack.digests[2]
    client.set_registered_model_alias(stack.policy, "champion", "1")
    stack.wait_served(1)


@pytest.mark.usefixtures("webhook_off")
class TestABadSignature:
    @pytest.mark.parametrize(
        ("case", "change", "expected"),
        [
            ("no signature", "headers", "missing"),
            ("another secret", "key", "does not match"),
            ("signed another body", "body", "does not match"),
            ("an hour old", "stale", "from now"),
            ("timestamp not a number", "garbled_ts", "not a Unix time"),
        ],
    )
    def test_is_refused_and_changes_nothing(
        self, stack: Stack, case: str, change: str, expected: str
    ) -> None:
        client = MlflowClient(stack.mlflow)
        before = stack.served()
        current = next(v for v, d in stack.digests.items() if d == before)
        target = next(v for v in stack.digests if v != current)
        client.set_registered_model_alias(
            stack.policy, "champion", str(target)
        )  # no delivery: webhook disabled
        body = event(stack.policy, version=target)
        if change == "headers":
            r = deliver(stack, body, headers={"Content-Type": "application/json"})
        elif change == "key":
            r = deliver(stack, body, key="not-the-secret")
        elif change == "body":
            delivery, ts = "d-1", str(int(time.time()))
            headers = {
                "X-MLflow-Delivery-Id": delivery,
                "X-MLflow-Timestamp": ts,
                "X-MLflow-Signature": sign(secret(stack), delivery, ts, event("other-policy")),
            }
            r = deliver(stack, body, headers=headers)
        elif change == "stale":
            r = deliver(stack, body, ts=str(int(time.time()) - 3600))
        else:
            r = deliver(stack, body, ts="yesterday")
        assert r.status_code == 401, (case, r.text)
        assert expected in r.json()["error"], case
        assert stack.served() == before, f"{case}: serving changed"
        # the same event, properly signed, is acted on; the receiver reconciles a policy's deliveries one at a
        # time, so what it found served then is what the refused delivery left, however late it had acted
        ok = deliver(stack, body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["served_before"] == before, f"{case}: serving changed"
        assert ok.json()["reloaded"] is True
        assert stack.served() == stack.digests[target]


def test_events_with_nothing_to_do_are_ignored_with_2xx(stack: Stack, tmp_path: Path) -> None:
    before = stack.served()
    client = MlflowClient(stack.mlflow)
    # a registered model that is no mint policy: its version has no mint.digest
    other = f"not-mint-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(other)
    client.create_model_version(other, "s3://bucket/some/model")
    client.set_registered_model_alias(other, "champion", "1")
    cases = {
        "unknown policy": event(f"nobody-{uuid.uuid4().hex[:6]}", version=1),
        "unknown version": event(stack.policy, version=99),
        "not a mint revision": event(other, version=1),
        "another alias": event(stack.policy, alias="candidate", version=2),
        "another event": json.dumps({"entity": "model_version", "action": "created", "data": {}}).encode(),
        "not JSON": b"hello",
    }
    for case, body in cases.items():
        r = deliver(stack, body)
        assert r.status_code == 200, (case, r.text)
        assert "ignored" in r.json(), (case, r.json())
        assert stack.served() == before, case
    log = (stack.config.state_dir / "hooks.log").read_text()
    assert "ignored" in log and "not a mint revision" in log


def test_the_router_s_champion_moved_in_mlflow_is_served_within_seconds(stack: Stack, tmp_path: Path) -> None:
    """`mint-router@champion` moved with a bare client (a reviewer's promotion or rollback in the MLflow UI): the
    receiver gives the server that router revision; a version whose files do not load is refused, and the server
    keeps its router."""
    routers = router_registry(stack.ws, None)
    versions = []
    for i, arms in enumerate(({"a": ["add 1 and 2"], "b": ["reverse abc"]}, {"a": ["add 3 and 4"]})):
        fit_router([], cold_start=arms).save(tmp_path / f"r{i}")
        versions.append(routers.register(tmp_path / f"r{i}"))
    client = MlflowClient(stack.mlflow)

    def router_served() -> str:
        with stack.ws.client(timeout=10) as serving:
            return str((served_router(serving) or {}).get("revision"))

    for rv in (versions[0], versions[1], versions[0]):
        client.set_registered_model_alias(ROUTER_MODEL, "champion", str(rv.version))
        wait_until(lambda rv=rv: router_served() == rv.revision, BOUND_S, f"router {rv.address} served")  # type: ignore[misc]

    broken = tmp_path / "broken"
    Router.load(tmp_path / "r1").save(broken)
    (broken / "state.npz").write_bytes(b"corrupt")
    run = client.create_run(client.get_experiment_by_name("mint-router").experiment_id)  # type: ignore[union-attr]
    client.log_artifacts(run.info.run_id, str(broken), "router")
    bad = client.create_model_version(ROUTER_MODEL, f"{run.info.artifact_uri}/router", run_id=run.info.run_id)
    client.set_registered_model_alias(ROUTER_MODEL, "champion", bad.version)
    r = deliver(stack, event(ROUTER_MODEL, version=int(bad.version)))
    assert r.status_code == 200 and "does not load" in r.json()["refused"], r.text
    assert router_served() == versions[0].revision
    client.set_registered_model_alias(ROUTER_MODEL, "champion", str(versions[0].version))


def test_the_receiver_waits_for_a_promotion_holding_the_policy_s_lease(stack: Stack) -> None:
    client = MlflowClient(stack.mlflow)
    before = stack.served()
    current = next(v for v, d in stack.digests.items() if d == before)
    target = next(v for v in stack.digests if v != current)
    logged = len(hooks_log(stack))
    with policy_lock(stack.ws, stack.policy, "a-promotion"):  # what a promote/rollback/reconcile flow holds
        client.set_registered_model_alias(stack.policy, "champion", str(target))
        # held for as long as an alias move takes to be served without a lease (the test above)
        held = time.monotonic() + BOUND_S
        while time.monotonic() < held:
            assert stack.served() == before  # the delivery waits for the lease
            time.sleep(0.05)
        held_until, released_at = time.perf_counter(), time.time()
    stack.wait_served(target)
    assert time.perf_counter() - held_until < BOUND_S
    # the receiver's log: the delivery that served it began before the release and ended after it, so the checks
    # above ran while it waited for the lease (not before it came)
    started, finished = wait_until(
        lambda: handled(stack, target, logged), 10, f"the receiver logged v{target} served"
    )
    assert started < released_at < finished, (started, released_at, finished)


def hooks_log(stack: Stack) -> str:
    return (stack.config.state_dir / "hooks.log").read_text()


def handled(stack: Stack, version: int, since: int) -> tuple[float, float] | None:
    """When the receiver began and finished the delivery that served `version`, logged after the first `since`
    characters of hooks.log (Unix times), or None before it has logged one."""
    line = re.compile(
        rf"^(\S+ \S+) INFO mint\.hooks: \S+ {re.escape(stack.policy)} v{version} \(delivery [^)]*\): "
        rf"serving \S+ -> \S+ in (\d+) ms$",
        re.M,
    )
    found = line.findall(hooks_log(stack)[since:])
    if not found:
        return None
    stamp, ms = found[-1]
    # local time, as logging writes it
    finished = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return finished - int(ms) / 1000, finished


@pytest.mark.usefixtures("webhook_off")
class TestTheSweep:
    """The receiver's own net for a missed event: every `sweep_s` it reconciles every policy and the router."""

    def test_serves_an_alias_moved_while_no_event_came(self, stack: Stack) -> None:
        client = MlflowClient(stack.mlflow)
        before = stack.served()
        current = next(v for v, d in stack.digests.items() if d == before)
        target = next(v for v in stack.digests if v != current)
        client.set_registered_model_alias(stack.policy, "champion", str(target))  # no delivery: webhook off
        config = HooksConfig(
            secret_file=stack.config.state_dir / "hooks.secret", workspace=stack.ws, sweep_s=0.5
        )
        with TestClient(create_app(config)) as app:  # the app's lifespan runs the sweep while it is served
            assert app.get("/health").status_code == 200
            stack.wait_served(target, bound=15)
        assert stack.served() == stack.digests[target]

    def test_reports_each_policy_and_leaves_a_locked_one_to_the_next_pass(self, stack: Stack) -> None:
        config = HooksConfig(secret_file=stack.config.state_dir / "hooks.secret", workspace=stack.ws)
        locks: dict[str, threading.Lock] = {}
        sweeper = Sweeper(config, lambda p: locks.setdefault(p, threading.Lock()))
        first = sweeper.sweep()  # whatever earlier tests left, in line after one pass
        assert stack.policy in first and ROUTER_MODEL in first
        # the registered model that is no mint policy (`test_events_with_nothing_to_do_are_ignored_with_2xx`)
        others = {n: r for n, r in first.items() if n.startswith("not-mint-")}
        assert all(r.startswith("ignored") for r in others.values()), others
        again = sweeper.sweep()
        assert again[stack.policy] == "in line" and again[ROUTER_MODEL] == "in line", again
        before = stack.served()
        current = next(v for v, d in stack.digests.items() if d == before)
        target = next(v for v in stack.digests if v != current)
        client = MlflowClient(stack.mlflow)
        with policy_lock(stack.ws, stack.policy, "a-promotion"):  # a promotion in flight
            client.set_registered_model_alias(stack.policy, "champion", str(target))
            assert sweeper.sweep()[stack.policy] == "busy"
            assert stack.served() == before
        assert sweeper.sweep()[stack.policy] == "reloaded"
        assert stack.served() == stack.digests[target]
        assert sweeper.passes == 4

    def test_a_server_not_answering_is_a_warning_once_then_the_sweep_recovers(
        self, stack: Stack, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The receiver starts before the server it drives (vLLM can take a minute): a pass that finds nothing
        listening warns once, not at every pass, and the first pass that reaches the server says so."""
        down = stack.ws.model_copy(update={"serving_url": f"http://127.0.0.1:{free_port()}"})
        config = HooksConfig(secret_file=stack.config.state_dir / "hooks.secret", workspace=down)
        sweeper = Sweeper(config, lambda p: threading.Lock())
        with caplog.at_level(logging.INFO, logger="mint.hooks"):
            first = sweeper.sweep()[stack.policy]
            assert first.startswith("failed: ServingError") and " 0 " in first, first
            sweeper.sweep()
            said = [r for r in caplog.records if stack.policy in r.getMessage()]
            assert [r.levelno for r in said] == [logging.WARNING], [r.getMessage() for r in said]
            sweeper.config = HooksConfig(secret_file=config.secret_file, workspace=stack.ws)
            assert sweeper.sweep()[stack.policy] in ("in line", "reloaded")
        assert any(f"{stack.policy} reconciles again" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
