"""`model: "auto"` on both backends (serving/routing.py): mint serve's embedded engine and mint's front over a real
vLLM, each started once per module with an access file and its own routing dir.

Keys: `ka` calls `route-alpha` only, `kg` every `route-*` policy, `kw` `add` and `route-beta` (`add` names a
registered task, so its arm starts warm from the task's held-out prompts), `kn` nothing served, `all` everything
(the base too). What answers a routed request is named as for any request (`model`, `system_fingerprint`), plus
`X-Mint-Routed` and `X-Mint-Router`.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from mint_core.access import Access, ServingKey, new_secret, save
from mint_core.data.spec import read_rows, registry
from mint_core.engine.base import Base, build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.routing.log import RouteLog, RouteRecord
from mint_core.routing.router import Router
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_BASE_NAME,
    free_port,
    start_front,
    start_server,
    stop_server,
)
from mint_testkit.waiting import wait_until

pytestmark = pytest.mark.integration

ALPHA, BETA, ADD = "route-alpha", "route-beta", "add"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
KEYS = {"ka": [ALPHA], "kg": ["route-*"], "kw": [ADD, BETA], "kn": ["nothing-*"], "all": ["*"]}
PROMPT = "Tell me something nice."  # no registered task's prompt: scored by feedback only


@dataclass
class Routed:
    backend: str
    url: str
    base_name: str
    routing_dir: Path
    secrets: dict[str, str]

    def auth(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[key]}"}

    def oai(self, key: str) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=self.secrets[key], max_retries=0, timeout=120)

    def complete(self, key: str, model: str = "auto", prompt: str = PROMPT, **extra: Any) -> httpx.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, **extra}
        return httpx.post(self.url + "/v1/completions", json=body, headers=self.auth(key), timeout=120)

    def router(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/v1/mint/router", headers=self.auth("all"), timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def put_router(self, headers: dict[str, str] = ADMIN, **body: Any) -> httpx.Response:
        return httpx.put(self.url + "/v1/mint/router", json=body, headers=headers, timeout=60)


def _load(url: str, base: Base, store: Path) -> None:
    for seed, name in enumerate((ALPHA, BETA, ADD)):
        a = random_adapter(
            base.sites, ["q_proj", "v_proj"], 4, seed=40 + seed, std=0.3, base_fingerprint=base.fingerprint
        )
        path = store / f"routing-{name}"
        save_adapter(a, path, base.sites)
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module", params=["mint", "vllm"])
def routed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    root = tmp_path_factory.mktemp(f"routing-{request.param}")
    access = Access(keys={n: ServingKey(secret=new_secret("mint-"), policies=p) for n, p in KEYS.items()})
    save(root / "access.json", access)
    routing_dir = root / "routing"
    env = {
        "MINT_SERVE_ACCESS_FILE": str(root / "access.json"),
        "MINT_SERVE_ROUTING_DIR": str(routing_dir),
        "MINT_SERVE_ROUTE_SEED": "7",
    }
    proc: subprocess.Popen[str]
    if request.param == "mint":
        store = root / "store"
        store.mkdir()
        proc, url = start_server(store, env=env)
        base, base_name = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer()), "tiny-dense"
    else:
        server = request.getfixturevalue("vllm_server")  # the session's vLLM, behind a front of this module's
        store = server.store
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            proc, url = start_front(server.vllm_url, store, server.base_dir, free_port(), None)
        base, base_name = load_base(server.base_dir), VLLM_BASE_NAME
    try:
        _load(url, base, store)
        secrets = {n: k.secret for n, k in access.keys.items()}
        yield Routed(request.param, url, base_name, routing_dir, secrets)
    finally:
        for name in (ALPHA, BETA, ADD):  # vLLM is the session's: leave it as found
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN, timeout=60)
        assert stop_server(proc) == 0


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == status, body
    return dict(body["error"])


def _metrics(k: Routed) -> list[tuple[str, dict[str, str], float]]:
    r = httpx.get(k.url + "/metrics", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(r.text) for s in f.samples]


def test_the_openai_client_gets_answers_named_by_the_adapter_that_answered(routed: Routed) -> None:
    k = routed
    served = {ALPHA, BETA, ADD, k.base_name}
    revision = k.router()["revision"]
    oai = k.oai("all")
    raw = oai.completions.with_raw_response.create(model="auto", prompt=PROMPT, max_tokens=3, temperature=0)
    r = raw.parse()
    assert r.model in served and raw.headers["x-mint-routed"] == r.model, (r.model, raw.headers)
    assert raw.headers["x-mint-router"] == revision and r.system_fingerprint
    raw_chat = oai.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": PROMPT}], max_tokens=3, temperature=0
    )
    chat = raw_chat.parse()
    assert chat.model in served and raw_chat.headers["x-mint-routed"] == chat.model
    stream = oai.completions.create(model="auto", prompt=PROMPT, max_tokens=3, stream=True)
    assert {c.model for c in stream} <= served


def test_a_key_is_routed_inside_its_policies_only(routed: Routed) -> None:
    k = routed
    for _ in range(12):
        r = k.complete("ka")
        assert r.status_code == 200 and r.json()["model"] == ALPHA, r.text
    assert k.oai("ka").completions.create(model="auto:route-*", prompt=PROMPT, max_tokens=2).model == ALPHA
    r = httpx.get(k.url + "/v1/mint/router", headers=k.auth("ka"), timeout=30)
    assert r.status_code == 200 and set(r.json()["arms"]) <= {ALPHA}, r.text  # arms it may call, no others


def test_auto_patterns_narrow_the_choice(routed: Routed) -> None:
    k = routed
    assert {k.complete("all", f"auto:{BETA}").json()["model"] for _ in range(8)} == {BETA}
    got = {k.complete("all", "auto:route-a*,route-b*").json()["model"] for _ in range(16)}
    assert got <= {ALPHA, BETA}, got
    assert {k.complete("kg").json()["model"] for _ in range(16)} <= {ALPHA, BETA}  # no base: not a `*` key


def test_nothing_to_route_to_is_a_404_naming_only_the_pattern(routed: Routed) -> None:
    k = routed
    err = _error(k.complete("kn"), 404)
    assert err["type"] == "NotFoundError" and "no policy to route to" in err["message"], err
    hidden = _error(k.complete("ka", f"auto:{BETA}"), 404)  # served, but not this key's: as if absent
    assert BETA in hidden["message"] and ALPHA not in hidden["message"], hidden
    assert _error(k.complete("ka", "auto:nope-*"), 404)["message"].replace("nope-*", "") == hidden[
        "message"
    ].replace(BETA, "")
    for bad in ("auto:", "auto:a,,b"):
        assert _error(k.complete("all", bad), 400)["param"] == "model"
    _error(httpx.post(k.url + "/v1/completions", json={"model": "auto", "prompt": "x"}, timeout=30), 401)
    r = httpx.post(
        k.url + "/v1/feedback", json={"id": "cmpl-nosuch", "score": 1.0}, headers=k.auth("all"), timeout=30
    )
    assert _error(r, 404)["param"] == "id"
    load = {"lora_name": "auto", "lora_path": f"routing-{ALPHA}"}
    assert _error(httpx.post(k.url + "/v1/load_lora_adapter", json=load, headers=ADMIN, timeout=30), 400)


def test_feedback_moves_the_choice_and_is_logged(routed: Routed) -> None:
    k = routed
    rewarded = []
    for _ in range(40):
        r = k.complete("kg", prompt="Write a haiku about rain.")
        assert r.status_code == 200, r.text
        arm, rid = r.headers["x-mint-routed"], r.json()["id"]
        fb = httpx.post(
            k.url + "/v1/feedback",
            json={"id": rid, "score": 1.0 if arm == BETA else 0.0},
            headers=k.auth("kg"),
        )
        assert fb.status_code == 200, fb.text
        rewarded.append(rid)
    after = Counter(k.complete("kg", prompt="Write a haiku about snow.").json()["model"] for _ in range(20))
    assert after[BETA] >= 16, after
    records = {r.rid: r for r in RouteLog(k.routing_dir / "log.jsonl").records()}
    got = [records[rid] for rid in rewarded]
    assert all(r.reward_source == "feedback" and r.reward in (0.0, 1.0) for r in got), got[:3]
    assert all(0 < r.prob <= 1 and set(r.candidates) == {ALPHA, BETA} and r.features_digest for r in got)


def test_task_answers_are_scored_after_the_answer_and_reach_the_router(routed: Routed) -> None:
    k = routed
    rids = []
    for row in read_rows(registry().get(ADD), "heldout")[:4]:
        assert isinstance(row.prompt, str)
        r = k.complete("kw", prompt=row.prompt, max_tokens=4)
        assert r.status_code == 200, r.text
        rids.append(r.json()["id"])

    def scored() -> list[RouteRecord]:
        records = {r.rid: r for r in RouteLog(k.routing_dir / "log.jsonl").records()}
        return [records[rid] for rid in rids if rid in records and records[rid].reward is not None]

    wait_until(lambda: len(scored()) == len(rids), 30, "task scores of the routed answers")
    got = scored()
    assert {r.reward_source for r in got} == {"task"}
    # the add arm started warm from its task's held-out prompts: greedy on the first of them (decided before any
    # score came), where a cold arm ties with route-beta's prior (probability about one half)
    first = got[0]
    assert (first.choice == ADD and first.prob > 0.9) or first.explored, first


def test_put_router_swaps_and_a_broken_one_is_422_and_kept(routed: Routed, tmp_path: Path) -> None:
    k = routed
    router = Router()
    rng = np.random.default_rng(0)
    x = router.featurizer.transform(PROMPT)
    for _ in range(20):
        router.update(BETA, x, 1.0)
        router.update(ALPHA, x, float(rng.random() < 0.1))
    revision = router.save(k.routing_dir / "r1")
    assert k.put_router(path="r1", headers=k.auth("all")).status_code == 403  # a key is not the admin token
    r = k.put_router(path="r1", revision=revision)
    assert r.status_code == 200 and r.json()["revision"] == revision, r.text
    assert k.router()["revision"] == revision
    assert k.complete("all").headers["x-mint-router"] == revision
    broken = k.routing_dir / "broken"
    shutil.copytree(k.routing_dir / "r1", broken)
    (broken / "state.npz").write_bytes(b"not a zip")
    err = _error(k.put_router(path="broken"), 422)
    assert "state.npz" in err["message"] and revision in err["message"], err
    _error(k.put_router(path="r1", revision="0" * 64), 422)
    _error(k.put_router(path=str(tmp_path)), 400)  # outside the routing dir
    assert k.router()["revision"] == revision
    assert k.put_router(path="r1", revision=revision).status_code == 200  # the same again: a no-op


def test_routing_metrics(routed: Routed) -> None:
    k = routed
    assert k.complete("ka").status_code == 200
    samples = _metrics(k)
    routed_arms = {lb["arm"]: v for n, lb, v in samples if n == "mint_routed_requests_total"}
    assert routed_arms.get(ALPHA, 0) >= 1, routed_arms
    revision = k.router()["revision"]
    assert [lb["revision"] for n, lb, v in samples if n == "mint_router_revision" and v == 1] == [revision]
    assert any(n == "mint_routed_explored_total" for n, _, _ in samples)
    count = sum(v for n, _, v in samples if n == "mint_route_decision_seconds_count")
    assert count >= sum(routed_arms.values()), (count, routed_arms)


def test_a_restarted_server_serves_the_router_it_learned(tmp_path: Path) -> None:
    """mint serve saves its router as it learns and at a clean shutdown (`route_save_interval_s`); started again
    on the same routing dir, it serves what it learned, known by the revision it was put as."""
    store, routing_dir = tmp_path / "store", tmp_path / "routing"
    store.mkdir()
    env = {"MINT_SERVE_ROUTING_DIR": str(routing_dir), "MINT_SERVE_ROUTE_SEED": "3"}
    proc, url = start_server(store, env=env)
    try:
        router = Router()
        router.update(ALPHA, router.featurizer.transform(PROMPT), 1.0)
        revision = router.save(routing_dir / "r1")
        put = httpx.put(url + "/v1/mint/router", json={"path": "r1", "revision": revision}, headers=ADMIN)
        assert put.status_code == 200, put.text
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={"model": "auto", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, r.text
            fb = httpx.post(url + "/v1/feedback", json={"id": r.json()["id"], "score": 1.0})
            assert fb.status_code == 200, fb.text
        base_name = r.headers["x-mint-routed"]  # the base: the only name served
    finally:
        assert stop_server(proc) == 0
    assert (routing_dir / "online" / "manifest.json").is_file()  # the last save, at the shutdown
    proc, url = start_server(store, env=env)
    try:
        view = httpx.get(url + "/v1/mint/router", timeout=30).json()
        assert view["revision"] == revision and view["path"] == str((routing_dir / "online").resolve()), view
        assert set(view["arms"]) == {ALPHA, base_name}, view  # r1 knew alpha; the base arm was learned online
    finally:
        assert stop_server(proc) == 0
