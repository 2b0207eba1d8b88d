"""The load route accepts a content address from the adapter store, verified on the way in."""

from __future__ import annotations

import httpx
import pytest

from mint_core.registry.store import AdapterStore
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
    from mint_core.engine.base import build_tiny_base
    from mint_core.engine.tokenizer import byte_tokenizer
    from mint_core.lora.adapter import random_adapter, save_adapter
    from mint_core.registry.catalog import Catalog, CatalogConfig
    from tests.integration.conftest import start_server, stop_server

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
