"""Services under supervision (`mint_app.services.supervise`), through `mint_app.services.control` as `mint up` runs them: a served
policy is listed by `/v1/models` as soon as `mint up` returns, and answered by its champion from the first request
after any restart (a kill -9 brought back by supervision, `mint down` then `mint up`), with no 404 while it comes
back; logs are appended across restarts and rolled over by size, never truncated; `mint logs` shows them."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from mint_app.services.config import ServiceName, ServicesConfig
from mint_app.services.control import start, status, stop
from mint_app.services.processes import rolled_logs, service_log
from mint_core.engine.base import load_base
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.store import AdapterStore
from mint_testkit.harness import free_port, mint_cli, save_tiny_base
from mint_testkit.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
POLICY = "sv-pol"
CHAMPIONS = (POLICY, "sv-pol-2")
"""Policies with a champion in the catalog before the server starts; "sv-cand" has a candidate only."""


class Load:
    """Requests for one policy in a loop from a thread: what each got (status or error kind) and which revision
    answered each 200."""

    def __init__(self, url: str, model: str, token: str):
        self.url, self.model, self.token = url, model, token
        self.outcomes: Counter[str] = Counter()
        self.revisions: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "add: 1+2 =", "max_tokens": 4, "temperature": 0}
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {self.token}"}) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(self.url + "/v1/completions", json=body)
                except httpx.TransportError as e:  # the server is down: refused or cut off, a clean error
                    self.outcomes[type(e).__name__] += 1
                    time.sleep(0.05)
                    continue
                self.outcomes[str(r.status_code)] += 1
                if r.status_code == 200:
                    self.revisions[r.json()["system_fingerprint"]] += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def wait_for(self, n_ok: int, timeout: float = 120) -> None:
        """Until `n_ok` more requests were answered 200."""
        want = self.outcomes["200"] + n_ok
        wait_until(
            lambda: self.outcomes["200"] >= want,
            timeout,
            lambda: f"{n_ok} more answered 200: {self.outcomes}",
        )


def admin_token(config: ServicesConfig) -> str:
    """The admin token `mint up` keeps in the state dir: mint's own credential (serving keys are on in a stack)."""
    return (config.state_dir / "serve.token").read_text().strip()


# vLLM takes 1-2 minutes to start on 2 cores, twice per test: the slow tier
@pytest.fixture(params=["mint", pytest.param("vllm", marks=pytest.mark.slow)])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServicesConfig, str]]:
    """`mint serve` as `mint up` starts it (serving mint, or vllm: the front and a vLLM behind it), over a store
    and a catalog where each of CHAMPIONS has a champion; nothing is loaded into the server by anyone: the name
    resolves on demand. Yields the config and the champions' digest."""
    vllm = request.param == "vllm"
    base_dir = save_tiny_base(tmp_path / "base", vllm=vllm)
    base = load_base(base_dir)
    store = AdapterStore(tmp_path / "store")
    adapter = random_adapter(
        base.sites, ["q_proj", "v_proj"], 8, seed=5, std=0.3, base_fingerprint=base.fingerprint
    )
    save_adapter(adapter, tmp_path / "rev", base.sites)
    digest = str(store.put_dir(tmp_path / "rev"))
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    cat = Catalog(CatalogConfig(url=catalog_url))
    for policy in (*CHAMPIONS, "sv-cand"):
        cat.register(digest, base.fingerprint, 8, str(store.local_dir(digest)), policy=policy)
        cat.set_alias(policy, "candidate" if policy == "sv-cand" else "champion", 1)
    config = ServicesConfig.model_validate(
        {
            "state_dir": tmp_path / "run",
            "serve_port": free_port(),
            "serve_base": str(base_dir),
            "serve_adapter_root": tmp_path / "store",
            "catalog_url": catalog_url,
            "log_max_bytes": 2**16,
            "log_backups": 2,
            **({"serving": "vllm", "vllm_port": free_port()} if vllm else {}),
        }
    )
    start(config, names_of(config))
    try:
        yield config, digest
    finally:
        stop(config, names_of(config))


def names_of(config: ServicesConfig) -> list[ServiceName]:
    return ["vllm", "serve"] if config.serving == "vllm" else ["serve"]


def engine_of(config: ServicesConfig) -> ServiceName:
    """The service that runs the model: vLLM behind the front, or mint serve itself."""
    return "vllm" if config.serving == "vllm" else "serve"


def supervised_healthy(config: ServicesConfig, name: ServiceName, timeout: float = 60) -> None:
    """Until the service's supervisor has seen it healthy (a crash before that is not restarted, by design)."""
    wait_until(
        lambda: "healthy after" in service_log(config, name).read_text(),
        timeout,
        f"{name}'s supervisor saw it healthy",
    )


def serve_child(config: ServicesConfig, name: ServiceName = "serve") -> psutil.Process:
    """The service's own process under its supervisor (the recorded pid)."""
    sup = psutil.Process(status(config, [name])[0].pid or 0)
    (child,) = sup.children()
    return child


def assert_every_champion_listed(config: ServicesConfig, digest: str) -> None:
    """What a new user's first `models.list()` shows right after `mint up` returns: every champion, before any
    request or reconcile names it (checked inside a test that starts the stack anyway: no start of its own)."""
    client = openai.OpenAI(base_url=config.url("serve") + "/v1", api_key=admin_token(config), max_retries=0)
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert {m for m, card in listed.items() if card.get("parent")} == set(CHAMPIONS), listed
    for policy in CHAMPIONS:
        assert listed[policy]["root"] == f"sha256:{digest}", listed[policy]
        assert "revision" not in listed[policy], listed[
            policy
        ]  # nothing holds it yet: reconcile will load it


def test_a_killed_server_is_brought_back_and_answers_with_the_champion(
    served: tuple[ServicesConfig, str],
) -> None:
    config, digest = served
    assert_every_champion_listed(config, digest)  # `mint up` (control.start) has just returned
    url = config.url("serve")
    engine = engine_of(config)
    with Load(url, POLICY, admin_token(config)) as load:
        load.wait_for(5)
        supervised_healthy(config, engine)
        first = serve_child(config, engine)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        load.outcomes.clear()  # what follows the kill
        load.wait_for(10, timeout=400)
    assert serve_child(config, engine).pid != first.pid
    # while it is down: refused or cut off (mint serve), 502/503 from the front (vLLM); never a 404
    clean = {"200", "ConnectError", "ReadError", "RemoteProtocolError", "502", "503"}
    assert load.outcomes["404"] == 0 and set(load.outcomes) <= clean, load.outcomes
    assert set(load.revisions) == {digest}, load.revisions
    log = service_log(config, engine).read_text()
    assert f"pid {first.pid} exited with status -9" in log and "restarting in 1 s" in log
    assert (
        f"pid {first.pid} healthy" in log.split(f"pid {first.pid} exited")[0]
    )  # the first run's lines are kept


def test_down_then_up_under_load_has_no_gap(served: tuple[ServicesConfig, str]) -> None:
    config, digest = served
    url = config.url("serve")
    with Load(url, POLICY, admin_token(config)) as load:
        load.wait_for(5)
        stop(config, names_of(config))
        load.outcomes.clear()
        assert all(s.state == "running" for s in start(config, names_of(config)))
        load.wait_for(10, timeout=400)
    assert load.outcomes["404"] == 0 and load.outcomes["200"] >= 10, load.outcomes
    assert set(load.revisions) == {digest}, load.revisions
    # both runs' output in the log (appended), which rolled over at 64 KiB into at most 2 old files
    text = "".join(
        p.read_text() for p in [*reversed(rolled_logs(config, "serve")), service_log(config, "serve")]
    )
    assert text.count("] stopped (status") >= 1 and text.count("Uvicorn running") >= 2


def test_logs_roll_over_by_size_and_mint_logs_shows_them(served: tuple[ServicesConfig, str]) -> None:
    config, _ = served
    if config.serving == "vllm":
        pytest.skip("the same supervisor and logs as with serving mint")
    url = config.url("serve")
    with httpx.Client(timeout=10) as c:  # each request is an access-log line: fill more than the 64 KiB limit
        for _ in range(1200):
            c.get(url + "/health")
    old = rolled_logs(config, "serve")
    assert old and len(old) <= config.log_backups
    assert all(p.stat().st_size <= config.log_max_bytes for p in [*old, service_log(config, "serve")])
    out = mint_cli("logs", "serve", "-n", "3", "--rolled", "--state-dir", str(config.state_dir))
    assert out.returncode == 0, out.stderr
    assert '"GET /health HTTP/1.1" 200' in out.stdout and "rolled over:" in out.stdout
    bad = mint_cli("logs", "nosuch", "--state-dir", str(config.state_dir))
    assert bad.returncode == 2 and "nosuch" in bad.stderr
