"""mint serve's `vllm:*` metrics against a real vLLM 0.32's, scraped after the same requests on the same base:
every family mint exports under vLLM's prefix exists in vLLM's scrape with the same type and the same label
names, so a vLLM dashboard or alert reads `mint serve` unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mint_core.engine.base import load_base
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_testkit.harness import start_server, stop_server
from tests.integration.conftest import VLLMServer

pytestmark = pytest.mark.integration
ADMIN = {"Authorization": "Bearer admin-secret"}


def families(text: str) -> dict[str, tuple[str, set[frozenset[str]], set[str]]]:
    """family name -> (type, the label-name sets of its samples (`le` aside), a histogram's bucket bounds)."""
    out: dict[str, tuple[str, set[frozenset[str]], set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created"):  # prometheus_client's creation-time series, not a family of vLLM's
            continue
        samples = [s for s in fam.samples if not s.name.endswith("_created")]
        labels = {frozenset(k for k in s.labels if k != "le") for s in samples}
        out[fam.name] = (fam.type, labels, {s.labels["le"] for s in samples if "le" in s.labels})
    return out


@pytest.fixture(scope="module")
def mint_serve(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """mint serve on the base the session's vLLM serves, under the same name; its URL and store."""
    store = tmp_path_factory.mktemp("mint-store")
    proc, url = start_server(store, "--base", str(vllm_server.base_dir))
    try:
        yield url, store
    finally:
        stop_server(proc)


def exercise(url: str, store: Path, base_dir: Path, base_name: str) -> str:
    """The same traffic on one server (an adapter, the base, a stream), then its scrape."""
    base = load_base(base_dir)
    a = random_adapter(
        base.sites, ["q_proj", "v_proj"], 8, seed=5, std=0.3, base_fingerprint=base.fingerprint
    )
    save_adapter(a, store / "m-alpha", base.sites)
    with httpx.Client(base_url=url, timeout=120) as h:
        r = h.post(
            "/v1/load_lora_adapter", json={"lora_name": "m-alpha", "lora_path": "m-alpha"}, headers=ADMIN
        )
        assert r.status_code == 200, r.text
        for model in (base_name, "m-alpha"):
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}
            assert h.post("/v1/completions", json=body).status_code == 200
            with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                assert s.status_code == 200
                s.read()
        text = h.get("/metrics").text
        h.post("/v1/unload_lora_adapter", json={"lora_name": "m-alpha"}, headers=ADMIN)
    return text


def test_vllm_families_match_the_real_vllm(vllm_server: VLLMServer, mint_serve: tuple[str, Path]) -> None:
    name = vllm_server.base_dir.name
    ours = families(exercise(*mint_serve, vllm_server.base_dir, name))
    theirs = families(exercise(vllm_server.url, vllm_server.store, vllm_server.base_dir, name))
    shared = sorted(f for f in ours if f.startswith("vllm:"))
    assert shared, "mint exports no vllm:* family"
    problems = []
    for fam in shared:
        if fam not in theirs:
            problems.append(f"{fam}: vLLM 0.32 has no such family")
            continue
        (t1, l1, b1), (t2, l2, b2) = ours[fam], theirs[fam]
        if t1 != t2:
            problems.append(f"{fam}: type {t1} in mint, {t2} in vLLM")
        if l1 != l2:
            problems.append(
                f"{fam}: labels {sorted(map(sorted, l1))} in mint, {sorted(map(sorted, l2))} in vLLM"
            )
        if b1 != b2:
            problems.append(
                f"{fam}: buckets {sorted(b1, key=float)} in mint, {sorted(b2, key=float)} in vLLM"
            )
    assert not problems, "\n".join(problems)
