"""mint's vLLM resolver plugin (vllm_plugin/) against a real vLLM: a catalog address vLLM has not loaded is resolved
through mint's front, validated there, and loaded on demand; anything the catalog does not name, or names but mint
refuses, is a 404 and never reaches vLLM; after vLLM restarts, a policy's first request is answered by its
champion."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import psutil
import pytest
from safetensors.torch import load_file, save_file

from mint_core.engine.base import load_base
from mint_core.lora.adapter import WEIGHTS_FILE, random_adapter, save_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.catalog_schema import Registration
from mint_core.registry.store import AdapterStore
from mint_testkit.harness import VLLM_KEY, free_port, save_tiny_base, start_front, start_vllm, stop_server
from tests.integration.conftest import VLLMServer

pytestmark = pytest.mark.integration


def vllm_lists(vllm_url: str) -> dict[str, dict[str, object]]:
    r = httpx.get(vllm_url + "/v1/models", headers={"Authorization": f"Bearer {VLLM_KEY}"}, timeout=30)
    r.raise_for_status()
    return {m["id"]: m for m in r.json()["data"]}


def ask(url: str, model: str) -> httpx.Response:
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def revision(store: AdapterStore, base_dir: Path, seed: int, tmp: Path, nan: bool = False) -> str:
    """A random rank-8 adapter for the served base, put into the store (NaN in one tensor with `nan`: the store
    takes any bytes; the front must refuse it)."""
    base = load_base(base_dir)
    a = random_adapter(
        base.sites, ["q_proj", "v_proj"], 8, seed=seed, std=0.3, base_fingerprint=base.fingerprint
    )
    d = tmp / f"rev-{seed}"
    save_adapter(a, d, base.sites)
    if nan:
        w = load_file(d / WEIGHTS_FILE)
        key = sorted(w)[0]
        w[key][0, 0] = float("nan")
        save_file(w, d / WEIGHTS_FILE, metadata={"format": "pt"})
    return str(store.put_dir(d))


@pytest.fixture(scope="module")
def catalog(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Policy `rs-add` (v1 champion, v2 candidate) and `rs-nan` (an invalid champion) in the front's catalog."""
    tmp = tmp_path_factory.mktemp("resolver")
    store = AdapterStore(vllm_server.store)
    fp = load_base(vllm_server.base_dir).fingerprint
    d1, d2 = (revision(store, vllm_server.base_dir, s, tmp) for s in (1, 2))
    bad = revision(store, vllm_server.base_dir, 3, tmp, nan=True)
    cat = Catalog(CatalogConfig(url=vllm_server.catalog_url))
    for d in (d1, d2):
        cat.register(d, fp, 8, str(store.local_dir(d)), policy="rs-add")
    cat.register(bad, fp, 8, str(vllm_server.store / "sha256" / bad[:2] / bad), policy="rs-nan")
    cat.set_alias("rs-add", "champion", 1)
    cat.set_alias("rs-add", "candidate", 2)
    cat.set_alias("rs-nan", "champion", 1)
    return {"v1": d1, "v2": d2, "bad": bad}


@pytest.mark.parametrize(
    ("address", "which"),
    [
        ("rs-add", "v1"),
        ("rs-add@champion", "v1"),
        ("rs-add/v2", "v2"),
        ("rs-add@candidate", "v2"),
        ("sha256:", "v1"),
    ],
)
def test_catalog_address_is_resolved_and_served_on_demand(
    vllm_server: VLLMServer, catalog: dict[str, str], address: str, which: str
) -> None:
    digest = catalog[which]
    if address == "sha256:":
        address += digest
    assert address not in vllm_lists(vllm_server.vllm_url)
    r = ask(vllm_server.url, address)
    assert r.status_code == 200, r.text
    assert r.json()["system_fingerprint"] == digest
    card = vllm_lists(vllm_server.vllm_url)[address]  # loaded by vLLM itself, through the plugin
    assert Path(str(card["root"])).name == digest
    listed = {m["id"]: m for m in httpx.get(vllm_server.url + "/v1/models", timeout=30).json()["data"]}
    assert listed[address]["revision"] == f"sha256:{digest}"


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("rs-unknown", "unknown"),
        ("rs-add/v99", "rs-add/v99"),
        ("rs-add@nope", "rs-add@nope"),
        ("rs add//", "rs add//"),
        ("rs-nan", "non-finite"),
    ],
)
def test_unknown_or_bad_address_is_404_and_never_loaded(
    vllm_server: VLLMServer, catalog: dict[str, str], address: str, says: str
) -> None:
    before = vllm_lists(vllm_server.vllm_url)
    r = ask(vllm_server.url, address)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "NotFoundError" and says in err["message"], err
    assert set(vllm_lists(vllm_server.vllm_url)) == set(before)


def _scale(vllm_server: VLLMServer, catalog: dict[str, str], n: int) -> None:
    """n addressable policies (sharing two real revisions) registered at once; a random one is served."""
    store = AdapterStore(vllm_server.store)
    fp = load_base(vllm_server.base_dir).fingerprint
    cat = Catalog(CatalogConfig(url=vllm_server.catalog_url))
    digests = [catalog["v1"], catalog["v2"]]
    tag = f"rs-scale{n}"
    t0 = time.perf_counter()
    cat.register_many(
        Registration(digests[i % 2], fp, 8, str(store.local_dir(digests[i % 2])), None, f"{tag}-{i}")
        for i in range(n)
    )
    print(f"\nregistered {n} policies in {time.perf_counter() - t0:.1f} s")
    for i in random.Random(n).sample(range(n), 2):
        address = f"{tag}-{i}/v1"  # each id is a policy's version 1 (no alias set)
        r = ask(vllm_server.url, address)
        assert r.status_code == 200, r.text
        assert r.json()["system_fingerprint"] == digests[i % 2]
        httpx.post(
            vllm_server.url + "/v1/unload_lora_adapter",
            json={"lora_name": address},
            headers={"Authorization": "Bearer admin-secret"},
            timeout=30,
        )


def test_any_id_of_a_large_catalog_is_servable(vllm_server: VLLMServer, catalog: dict[str, str]) -> None:
    _scale(vllm_server, catalog, 10_000)


@pytest.mark.slow
def test_any_id_of_a_million_catalog_is_servable(vllm_server: VLLMServer, catalog: dict[str, str]) -> None:
    _scale(vllm_server, catalog, 1_000_000)


@pytest.mark.slow
def test_after_vllm_restarts_the_first_request_is_answered_by_the_champion(tmp_path: Path) -> None:
    """A vLLM and a front of this test's own: vLLM killed -9 (the front answers 503, cleanly), started again on
    its port, and the very first request for the policy is answered by its champion: no 404 in between."""
    base_dir = save_tiny_base(tmp_path / "tiny-vllm", vllm=True)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    store = AdapterStore(store_dir)
    champion = revision(store, base_dir, 7, tmp_path)
    cat = Catalog(CatalogConfig(url=catalog_url))
    cat.register(champion, load_base(base_dir).fingerprint, 8, str(store.local_dir(champion)), policy="add")
    cat.set_alias("add", "champion", 1)
    vport, fport = free_port(), free_port()
    vllm = start_vllm(base_dir, vport, f"http://127.0.0.1:{fport}", tmp_path / "vllm-1.log")
    front, url = start_front(f"http://127.0.0.1:{vport}", store_dir, base_dir, fport, catalog_url)
    try:
        first = ask(url, "add")
        assert first.status_code == 200 and first.json()["system_fingerprint"] == champion, first.text
        for p in [*psutil.Process(vllm.pid).children(recursive=True), psutil.Process(vllm.pid)]:
            p.kill()  # the API server, its engine core and worker: none outlives it
        vllm.wait()
        down = ask(url, "add")  # vLLM gone: a clean answer, not a hang
        assert down.status_code == 503 and down.json()["error"]["type"] == "ServiceUnavailableError", (
            down.text
        )
        vllm = start_vllm(base_dir, vport, f"http://127.0.0.1:{fport}", tmp_path / "vllm-2.log")
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        again = ask(url, "add")
        assert again.status_code == 200, again.text
        assert again.json()["system_fingerprint"] == champion
    finally:
        stop_server(front)
        stop_server(vllm, timeout=60)
