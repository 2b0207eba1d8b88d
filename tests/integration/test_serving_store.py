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
