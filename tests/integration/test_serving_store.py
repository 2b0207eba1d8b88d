"""The load route accepts a content address from the adapter store, verified on the way in."""

from __future__ import annotations

import httpx
import pytest

from mint_core.engine.base import build_tiny_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.catalog_schema import Registration
from mint_core.registry.packs import write_pack
from mint_core.registry.store import AdapterStore
from mint_testkit.harness import start_server, stop_server
from tests.integration.conftest import Endpoint

pytestmark = pytest.mark.integration
ADMIN = {"Authorization": "Bearer admin-secret"}


def test_load_by_content_address(endpoint: Endpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    if endpoint.process is None:
        pytest.skip("content addresses are mint's store, not part of the vLLM contract")
    src = endpoint.make_adapter("staging-a", seed=41)
    digest = AdapterStore(endpoint.store).put_dir(src)
    with httpx.Client(base_url=endpoint.url, timeout=60) as http:
        r = http.post(
            "/v1/load_lora_adapter",
            headers=ADMIN,
            json={"lora_name": "by-digest", "lora_path": f"sha256:{digest}"},
        )
        assert r.status_code == 200, r.text
        out = http.post(
            "/v1/completions", json={"model": "by-digest", "prompt": "hi", "max_tokens": 2, "temperature": 0}
        )
        assert out.json()["system_fingerprint"] == digest
        unknown = http.post(
            "/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "x", "lora_path": "sha256:" + "0" * 64}
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
        bad = http.post(
            "/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "x", "lora_path": "sha256:xyz"}
        )
        assert bad.status_code == 400 and "xyz" in bad.json()["error"]["message"]
        names = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert "x" not in names


def test_load_by_catalog_address(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store_root = tmp_path / "store"
    store_root.mkdir()
    base = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    store = AdapterStore(store_root)
    digests = []
    for seed in (1, 2):
        a = random_adapter(
            base.sites, ["q_proj", "v_proj"], 4, seed=seed, std=0.3, base_fingerprint=base.fingerprint
        )
        save_adapter(a, tmp_path / f"src{seed}", base.sites)
        digests.append(store.put_dir(tmp_path / f"src{seed}"))
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(CatalogConfig(url=url)) as cat:
        for d in digests:
            cat.register(d, base.fingerprint, 4, store.path(d), policy="pol")
        cat.set_alias("pol", "champion", 2)
    proc, server = start_server(store_root, env={"MINT_SERVE_CATALOG_URL": url})
    try:
        with httpx.Client(base_url=server, timeout=60) as http:

            def load(path: str) -> httpx.Response:
                return http.post(
                    "/v1/load_lora_adapter",
                    headers=ADMIN,
                    json={"lora_name": "p", "lora_path": path, "load_inplace": True},
                )

            assert load("pol@champion").status_code == 200
            fp = http.post("/v1/completions", json={"model": "p", "prompt": "hi", "max_tokens": 1}).json()
            assert fp["system_fingerprint"] == digests[1]
            assert load("pol/v1").status_code == 200  # a rollback is loading the earlier version in place
            fp = http.post("/v1/completions", json={"model": "p", "prompt": "hi", "max_tokens": 1}).json()
            assert fp["system_fingerprint"] == digests[0]
            missing = load("pol/v9")
            assert missing.status_code == 404 and "v9" in missing.json()["error"]["message"]
            assert load("pol@nosuch").status_code == 404
            assert load("bad name@champion").status_code == 400
    finally:
        stop_server(proc)


def test_catalog_addresses_are_models_loaded_on_demand(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a catalog, `model` may be any catalog address: the first request cold-loads it through the loader
    (packs included), later ones hit; prefetch loads ahead of need; the metrics count hits and cold loads."""

    store_root = tmp_path / "store"
    store_root.mkdir()
    base = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    store = AdapterStore(store_root)
    adapters = [
        random_adapter(
            base.sites, ["q_proj", "v_proj"], 2, seed=s, std=0.3, base_fingerprint=base.fingerprint
        )
        for s in range(6)
    ]
    save_adapter(adapters[0], tmp_path / "src0", base.sites)
    d0 = store.put_dir(tmp_path / "src0")
    packed = write_pack(store_root / "packs" / "0.safetensors", adapters[1:], base.sites)
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(CatalogConfig(url=url)) as cat:
        cat.register(d0, base.fingerprint, 2, store.path(d0), policy="tenant0")
        cat.set_alias("tenant0", "champion", 1)
        cat.register_many(
            [
                Registration(
                    d, base.fingerprint, 2, f"{store_root}/packs/0.safetensors#{i}", policy=f"tenant{i + 1}"
                )
                for i, d in enumerate(packed)
            ]
        )
    proc, server = start_server(store_root, "--max-loras", "2", env={"MINT_SERVE_CATALOG_URL": url})
    try:
        with httpx.Client(base_url=server, timeout=60) as http:

            def complete(model: str) -> httpx.Response:
                return http.post(
                    "/v1/completions",
                    json={"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0},
                )

            for model, digest in [("tenant0", d0), ("tenant0/v1", d0), ("tenant3/v1", packed[2])]:
                r = complete(model)
                assert r.status_code == 200, r.text
                assert r.json()["system_fingerprint"] == digest and r.json()["model"] == model
            assert complete(f"sha256:{packed[4]}").json()["system_fingerprint"] == packed[4]
            assert complete("tenant3/v1").status_code == 200  # a hit now
            missing = complete("tenant9/v1")
            assert missing.status_code == 404 and "tenant9" in missing.json()["error"]["message"]
            assert complete("not an address").status_code == 404

            r = http.post("/v1/mint/prefetch", json={"addresses": ["tenant1/v1"]})
            assert r.status_code == 401  # admin only
            r = http.post(
                "/v1/mint/prefetch",
                headers=ADMIN,
                json={"addresses": ["tenant1/v1", "tenant2/v1", "tenant9/v1"], "wait": True},
            )
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert results["tenant1/v1"] == "loaded" and results["tenant2/v1"] == "loaded"
            assert results["tenant9/v1"].startswith("error")
            bad = http.post("/v1/mint/prefetch", headers=ADMIN, json={"addresses": ["a b"]})
            assert bad.status_code == 400

            # many addresses through two slots: every request answered by its own revision
            for i in range(1, 6):
                assert complete(f"tenant{i}/v1").json()["system_fingerprint"] == packed[i - 1]
            metrics = http.get("/metrics").text
            values = {
                line.split()[0]: float(line.split()[1])
                for line in metrics.splitlines()
                if line.startswith("mint_") and not line.startswith("#")
            }
            assert values["mint_catalog_cold_loads_total"] >= 6
            assert values["mint_catalog_hits_total"] >= 1
            assert values["mint_lora_evictions_total"] >= 1
            assert values["mint_catalog_prefetches_total"] == 3
    finally:
        stop_server(proc)
