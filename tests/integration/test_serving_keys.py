"""Serving keys that scope policies (issue #47, part 4), on both backends: mint serve's embedded engine and mint's
front over a real vLLM, each started once per module with an access file (`MINT_SERVE_ACCESS_FILE`).

Three keys: `ka` calls the policy `keys-alpha` (and its canary `keys-alpha@canary`), `kb` calls `keys-beta`, `all`
calls everything (the base too). The admin token calls everything and alone reads /metrics and the admin routes.
"""

from __future__ import annotations

import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mint_app.services.commands import command
from mint_app.services.config import ServicesConfig
from mint_core.access import Access, ServingKey, load, new_secret, save
from mint_core.engine.base import Base, build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_BASE_NAME,
    free_port,
    start_front,
    start_server,
    stop_server,
)
from mint_testkit.waiting import wait_until

ALPHA, BETA = "keys-alpha", "keys-beta"
CANARY = f"{ALPHA}@canary"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class Keyed:
    backend: str
    url: str
    access: Path
    base_name: str
    secrets: dict[str, str]  # key name -> secret

    def auth(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[key]}"}


def _access(path: Path) -> dict[str, str]:
    keys = {"ka": [ALPHA], "kb": [BETA], "all": ["*"]}
    access = Access(
        keys={name: ServingKey(secret=new_secret("mint-"), policies=p) for name, p in keys.items()}
    )
    save(path, access)
    return {name: k.secret for name, k in access.keys.items()}


def _load(url: str, base: Base, store: Path) -> None:
    """keys-alpha, its canary and keys-beta: three random adapters, loaded with the admin token."""
    for seed, name in enumerate((ALPHA, CANARY, BETA)):
        a = random_adapter(
            base.sites, ["q_proj", "v_proj"], 4, seed=seed, std=0.3, base_fingerprint=base.fingerprint
        )
        path = store / f"keys-{seed}"
        save_adapter(a, path, base.sites)
        r = httpx.post(
            url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path), "load_inplace": True},
            headers=ADMIN,
            timeout=120,
        )
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module", params=["mint", "vllm"])
def keyed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    root = tmp_path_factory.mktemp(f"keys-{request.param}")
    access = root / "access.json"
    secrets = _access(access)
    proc: subprocess.Popen[str]
    if request.param == "mint":
        store = root / "store"
        store.mkdir()
        proc, url = start_server(store, env={"MINT_SERVE_ACCESS_FILE": str(access)})
        base, base_name = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer()), "tiny-dense"
    else:
        server = request.getfixturevalue("vllm_server")  # the session's vLLM, behind a front of this module's
        store = server.store
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MINT_SERVE_ACCESS_FILE", str(access))
            proc, url = start_front(server.vllm_url, store, server.base_dir, free_port(), None)
        base, base_name = load_base(server.base_dir), VLLM_BASE_NAME
    try:
        _load(url, base, store)
        yield Keyed(request.param, url, access, base_name, secrets)
    finally:
        for name in (ALPHA, CANARY, BETA):  # vLLM is the session's: leave it as found
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN, timeout=60)
        assert stop_server(proc) == 0


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    """OpenAI's error shape with this status."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == status, body
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return dict(body["error"])


def _complete(k: Keyed, model: str, headers: dict[str, str], **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0.0, **extra}
    return httpx.post(k.url + "/v1/completions", json=body, headers=headers, timeout=120)


def _ids(k: Keyed, headers: dict[str, str]) -> set[str]:
    r = httpx.get(k.url + "/v1/models", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def _metric(k: Keyed, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (the admin token reads /metrics)."""
    r = httpx.get(k.url + "/metrics", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return sum(
        s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name == name and all(s.labels.get(a) == b for a, b in labels.items())
    )


def test_no_key_or_a_wrong_key_is_401_on_every_read_and_inference_route(keyed: Keyed) -> None:
    k = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": k.secrets["ka"]}):
        _error(_complete(k, ALPHA, headers), 401)
        _error(httpx.get(k.url + "/v1/models", headers=headers, timeout=30), 401)
        _error(httpx.get(k.url + "/v1/mint/canary", headers=headers, timeout=30), 401)
        _error(httpx.get(k.url + "/metrics", headers=headers, timeout=30), 401)
    assert httpx.get(k.url + "/health", timeout=30).status_code == 200  # probes need no key
    # a key is not the admin token: 403 on the admin routes and /metrics (a credential without the right)
    load = {"lora_name": "x", "lora_path": "x"}
    _error(httpx.post(k.url + "/v1/load_lora_adapter", json=load, headers=k.auth("all"), timeout=30), 403)
    _error(httpx.get(k.url + "/metrics", headers=k.auth("all"), timeout=30), 403)


def test_a_key_calls_its_policies_only_and_403_names_nothing_else(keyed: Keyed) -> None:
    k = keyed
    generated = "mint_generation_tokens_total" if k.backend == "mint" else "vllm:generation_tokens_total"
    r = _complete(k, ALPHA, k.auth("ka"), user="u1")
    assert r.status_code == 200 and r.json()["model"] == ALPHA, r.text
    before = _metric(k, generated)
    other = _error(_complete(k, BETA, k.auth("ka")), 403)
    missing = _error(_complete(k, "keys-gamma", k.auth("ka")), 403)  # a name nothing serves: the same 403
    base = _error(_complete(k, k.base_name, k.auth("ka")), 403)  # the base: keys of every policy (`*`) only
    assert other == missing == base, (other, missing, base)
    assert other["type"] == "PermissionDeniedError" and BETA not in other["message"]
    assert _metric(k, generated) == before  # nothing was generated for a refused request
    chat = {"model": BETA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(k.url + "/v1/chat/completions", json=chat, headers=k.auth("ka"), timeout=60)
    assert _error(r, 403) == other
    assert _complete(k, BETA, k.auth("kb")).status_code == 200
    assert _complete(k, k.base_name, k.auth("all")).status_code == 200
    assert _complete(k, BETA, ADMIN).status_code == 200  # the admin token: mint's own components


def test_models_lists_only_what_the_key_may_call(keyed: Keyed) -> None:
    k = keyed
    assert _ids(k, k.auth("ka")) == {ALPHA, CANARY}
    assert _ids(k, k.auth("kb")) == {BETA}
    assert {k.base_name, ALPHA, CANARY, BETA} <= _ids(k, k.auth("all"))
    assert {k.base_name, ALPHA, CANARY, BETA} <= _ids(k, ADMIN)


def test_the_canary_split_stays_inside_the_key(keyed: Keyed) -> None:
    k = keyed
    split = {"canary": CANARY, "control": ALPHA, "share": 0.5}
    put = httpx.put(f"{k.url}/v1/mint/canary/{ALPHA}", json=split, headers=ADMIN, timeout=30)
    assert put.status_code == 200, put.text
    try:
        arms = {_complete(k, ALPHA, k.auth("ka"), user=f"u{i}").json()["model"] for i in range(12)}
        assert arms == {ALPHA, CANARY}, arms  # both arms answer the key, both are its policy's
        _error(_complete(k, ALPHA, k.auth("kb"), user="u0"), 403)  # another key: neither arm
        assert set(httpx.get(k.url + "/v1/mint/canary", headers=k.auth("kb"), timeout=30).json()) == set()
        assert set(httpx.get(k.url + "/v1/mint/canary", headers=k.auth("ka"), timeout=30).json()) == {ALPHA}
        _error(httpx.get(f"{k.url}/v1/mint/canary/{ALPHA}", headers=k.auth("kb"), timeout=30), 403)
        # a split that would send alpha's requests to beta's adapter: the key gets a 403, never beta's answer
        rogue = {"canary": BETA, "control": ALPHA, "share": 0.5}
        put = httpx.put(f"{k.url}/v1/mint/canary/{ALPHA}", json=rogue, headers=ADMIN, timeout=30)
        assert put.status_code == 200, put.text
        got = [_complete(k, ALPHA, k.auth("ka"), user=f"u{i}") for i in range(12)]
        assert {r.status_code for r in got} == {200, 403}, [r.status_code for r in got]
        assert {r.json()["model"] for r in got if r.status_code == 200} == {ALPHA}
    finally:
        httpx.delete(f"{k.url}/v1/mint/canary/{ALPHA}", headers=ADMIN, timeout=30)


def test_a_rotated_key_takes_effect_without_a_restart(keyed: Keyed) -> None:
    k = keyed
    old = k.secrets["kb"]
    access = load(k.access)
    access.keys["kb"] = ServingKey(secret=new_secret("mint-"), policies=[BETA])
    save(k.access, access)
    new = access.keys["kb"].secret
    k.secrets["kb"] = new

    def refused_and_accepted() -> bool:
        a = _complete(k, BETA, {"Authorization": f"Bearer {old}"}).status_code
        b = _complete(k, BETA, {"Authorization": f"Bearer {new}"}).status_code
        return a == 401 and b == 200

    wait_until(refused_and_accepted, 30, "the old key refused and the new one accepted")
    # revoked: the key's name gone from the file
    del access.keys["kb"]
    save(k.access, access)
    wait_until(lambda: _complete(k, BETA, k.auth("kb")).status_code == 401, 30, "a revoked key refused")
    access.keys["kb"] = ServingKey(secret=new_secret("mint-"), policies=[BETA])  # back, for the other tests
    save(k.access, access)
    k.secrets["kb"] = access.keys["kb"].secret
    wait_until(lambda: _complete(k, BETA, k.auth("kb")).status_code == 200, 30, "a key added back accepted")


def test_requests_are_counted_per_key(keyed: Keyed) -> None:
    k = keyed
    series = "mint_key_requests_total"
    before = {key: _metric(k, series, key=key, outcome="200") for key in ("ka", "all", "admin")}
    refused = _metric(k, series, key="ka", outcome="403")
    unidentified = _metric(k, series, key="_none", outcome="401")
    for _ in range(3):
        assert _complete(k, ALPHA, k.auth("ka"), user="u1").status_code == 200
    assert _complete(k, k.base_name, k.auth("all")).status_code == 200
    assert _complete(k, ALPHA, ADMIN).status_code == 200
    _error(_complete(k, BETA, k.auth("ka")), 403)
    _error(_complete(k, ALPHA, {}), 401)
    assert _metric(k, series, key="ka", outcome="200") == before["ka"] + 3
    assert _metric(k, series, key="all", outcome="200") == before["all"] + 1
    assert _metric(k, series, key="admin", outcome="200") == before["admin"] + 1
    assert _metric(k, series, key="ka", outcome="403") == refused + 1
    assert _metric(k, series, key="_none", outcome="401") == unidentified + 1


@pytest.mark.parametrize("serving", ["mint", "vllm"])
def test_mint_up_starts_serve_with_the_access_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, serving: str
) -> None:
    """`mint up` passes `<state dir>/access.json` to mint serve (either backend), written 0600 on first start and
    kept after; a serving config with its own `api_key` keeps that one key."""
    for var in ("MINT_SERVE_ACCESS_FILE", "MINT_SERVE_API_KEY", "MINT_SERVE_ADMIN_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    cfg = ServicesConfig(state_dir=tmp_path / "state", serving=serving)  # type: ignore[arg-type]
    cfg.state_dir.mkdir(parents=True)
    _, env = command("serve", cfg)
    path = Path(env["MINT_SERVE_ACCESS_FILE"])
    assert path == (cfg.state_dir / "access.json").resolve()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = load(path)
    assert first.keys["default"].policies == ["*"]
    _, again = command("serve", cfg)  # a restart keeps the keys it made
    assert again["MINT_SERVE_ACCESS_FILE"] == str(path) and load(path) == first
    own = tmp_path / "serve.yaml"
    own.write_text("api_key: one-key-for-every-route\n")
    _, keyed = command("serve", cfg.model_copy(update={"serve_config": own}))
    assert "MINT_SERVE_ACCESS_FILE" not in keyed
