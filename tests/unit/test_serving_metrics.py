"""The embedded server's /metrics, in process: vLLM's metric names (types, labels, buckets) move with the requests
served, and every completion request refused at validation is counted once in `mint_requests_total` with its
outcome."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from mint_core.engine.sampling import SamplingParams
from mint_core.engine.sequence import Request as GenRequest
from mint_core.engine.sequence import Sequence
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.serving.app import build_app, load_serving_base
from mint_core.serving.config import ServingConfig
from mint_core.serving.server import Server

BASE = "tiny-dense"
MAX_MODEL_LEN = 256
ADMIN = "admin-secret"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# vLLM's name -> its Prometheus type (vllm/v1/metrics/loggers.py)
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:lora_requests_info": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
# vLLM's bucket boundaries, written out from vllm/v1/metrics/loggers.py: a dashboard's quantiles mean the same
# on either server
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [
        *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
        *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    ],
    "vllm:inter_token_latency_seconds": [
        *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
        *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    ],
    "vllm:e2e_request_latency_seconds": [
        *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
        *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    ],
}
ENGINE_LABELS = (("engine", "0"), ("model_name", BASE))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """One server, two adapters (alpha, beta); max_num_seqs=1, so a second request in flight always waits."""
    store = tmp_path_factory.mktemp("store")
    config = ServingConfig(
        adapter_root=store,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1,
        admin_token=ADMIN,
        torch_threads=1,
    )
    base = load_serving_base(config)
    for seed, name in enumerate(("alpha", "beta"), start=1):
        a = random_adapter(base.sites, ["q_proj", "v_proj"], 4, seed=seed, base_fingerprint=base.fingerprint)
        save_adapter(a, Path(store) / name, base.sites)
    with TestClient(build_app(config, base)) as c:
        for name in ("alpha", "beta"):
            r = c.post(
                "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": name},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            assert r.status_code == 200, r.text
        yield c


def scrape(c: TestClient) -> tuple[dict[str, str], Samples]:
    """(metric family -> type, (sample name, sorted labels) -> value)."""
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    types, samples = {}, {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def lora_info(samples: Samples) -> list[tuple[dict[str, str], float]]:
    return [(dict(k[1]), v) for k, v in samples.items() if k[0] == "vllm:lora_requests_info"]


# ---- vLLM's names ---------------------------------------------------------------------------------------


def test_vllm_names_types_labels_and_buckets(client: TestClient) -> None:
    types, samples = scrape(client)
    for name, type_ in VLLM_TYPES.items():
        assert types.get(name) == type_, (name, types.get(name))
    assert samples[("vllm:num_requests_running", ENGINE_LABELS)] == 0
    assert samples[("vllm:num_requests_waiting", ENGINE_LABELS)] == 0
    assert ("vllm:prompt_tokens_total", ENGINE_LABELS) in samples
    assert ("vllm:generation_tokens_total", ENGINE_LABELS) in samples
    for reason in ("stop", "length", "abort"):
        key = tuple(sorted((*ENGINE_LABELS, ("finished_reason", reason))))
        assert ("vllm:request_success_total", key) in samples
    for name, buckets in VLLM_BUCKETS.items():
        les = sorted(
            float(dict(k[1])["le"])
            for k in samples
            if k[0] == f"{name}_bucket" and dict(k[1])["model_name"] == BASE
        )
        assert les == [*buckets, float("inf")], name
    ((labels, value),) = lora_info(samples)  # one series: vLLM's three labels only
    assert labels == {"max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(value - time.time()) < 60  # a timestamp, as vLLM sets it


def test_vllm_metrics_move_with_the_requests_served(client: TestClient) -> None:
    _, before = scrape(client)
    usages = []
    for model in (BASE, "alpha"):
        r = client.post(
            "/v1/completions",
            json={"model": model, "prompt": "Once upon", "max_tokens": 5, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "beta",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    usages.append(r.json()["usage"])
    with client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": "alpha",
            "prompt": "a stream",
            "max_tokens": 7,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as s:
        events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usages.append(json.loads(events[-2])["usage"])
    _, after = scrape(client)

    def delta(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 5 + 5 + 3 + 7
    assert delta("vllm:prompt_tokens_total", *ENGINE_LABELS) == prompt
    assert delta("vllm:generation_tokens_total", *ENGINE_LABELS) == generated
    assert delta("mint_prompt_tokens_total") == prompt  # mint's own counters agree
    assert delta("mint_generation_tokens_total") == generated
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert delta(name, *ENGINE_LABELS) == 4, name
    assert delta("vllm:inter_token_latency_seconds_count", *ENGINE_LABELS) == generated - 4
    assert delta("vllm:request_success_total", *ENGINE_LABELS, ("finished_reason", "length")) == 4
    assert after[("vllm:num_requests_running", ENGINE_LABELS)] == 0
    assert after[("vllm:num_requests_waiting", ENGINE_LABELS)] == 0
    ((labels, _),) = lora_info(after)
    assert labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == ""
    for model in (BASE, "alpha", "beta"):
        assert delta("mint_requests_total", ("model", model), ("outcome", "200")) == (
            2 if model == "alpha" else 1
        )


def test_lora_requests_info_names_the_adapters_running_and_waiting(client: TestClient) -> None:
    """With one sequence per batch, alpha runs and beta waits behind it; the gauges and vLLM's LoRA info say so
    while it lasts, and return to nothing after."""
    server: Server = client.app.state.server  # type: ignore[attr-defined]
    ids = server.tokenize("long")
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - len(ids), ignore_eos=True)
    seqs: list[Sequence] = [server.loop.submit(GenRequest(ids, name, params)) for name in ("alpha", "beta")]
    try:
        deadline = time.monotonic() + 30
        while not seqs[0].out_ids and time.monotonic() < deadline:
            time.sleep(0.005)
        _, during = scrape(client)
        assert not seqs[0].finished, "alpha finished before the scrape: make it longer"
    finally:
        for s in seqs:
            server.loop.cancel(s)
    ((labels, _),) = lora_info(during)
    assert labels == {"max_lora": "8", "running_lora_adapters": "alpha", "waiting_lora_adapters": "beta"}
    assert during[("vllm:num_requests_running", ENGINE_LABELS)] == 1
    assert during[("vllm:num_requests_waiting", ENGINE_LABELS)] == 1
    deadline = time.monotonic() + 30
    while not all(s.finished for s in seqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    _, after = scrape(client)
    ((labels, _),) = lora_info(after)
    assert labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == ""
    assert after[("vllm:num_requests_running", ENGINE_LABELS)] == 0
    assert after[("vllm:num_requests_waiting", ENGINE_LABELS)] == 0


# ---- refusals are counted, once each ----------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
REFUSED: list[tuple[str, str, Any, int, str]] = [
    # (case, route, body (bytes: sent raw), status, the `model` label it is counted under)
    ("malformed JSON", "/v1/completions", b'{"model": "tiny-dense", "prompt": ', 400, "_unknown"),
    ("not a JSON object", "/v1/completions", b"[1, 2]", 400, "_unknown"),
    ("missing field", "/v1/completions", {"model": BASE}, 400, BASE),
    ("field of the wrong type", "/v1/completions", {"model": BASE, "prompt": 5}, 400, BASE),
    ("field out of bounds", "/v1/completions", {"model": BASE, "prompt": "hi", "n": 0}, 400, BASE),
    (
        "bad stream_options",
        "/v1/completions",
        {"model": BASE, "prompt": "hi", "stream": True, "stream_options": {"include_usage": "maybe"}},
        400,
        BASE,
    ),
    ("chat without messages", "/v1/chat/completions", {"model": BASE, "messages": []}, 400, BASE),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "_unknown"),
    ("unknown model, invalid body", "/v1/completions", {"model": "nope"}, 400, "_unknown"),
    ("prompt too long", "/v1/completions", {"model": BASE, "prompt": "x" * (MAX_MODEL_LEN + 1)}, 400, BASE),
    (
        "max_tokens beyond the context",
        "/v1/chat/completions",
        {"model": "alpha", "messages": MSG, "max_tokens": MAX_MODEL_LEN},
        400,
        "alpha",
    ),
    ("bad sampling params", "/v1/completions", {"model": BASE, "prompt": "hi", "temperature": -1}, 400, BASE),
    ("empty stop string", "/v1/completions", {"model": "beta", "prompt": "hi", "stop": [""]}, 400, "beta"),
    ("empty prompt", "/v1/completions", {"model": BASE, "prompt": ""}, 400, BASE),
    ("token id past the vocab", "/v1/completions", {"model": BASE, "prompt": [72, 300]}, 400, BASE),
    (
        "echo with stream",
        "/v1/completions",
        {"model": BASE, "prompt": "hi", "echo": True, "stream": True},
        400,
        BASE,
    ),
]


@pytest.mark.parametrize(("case", "route", "body", "status", "model"), REFUSED, ids=[c[0] for c in REFUSED])
def test_every_refusal_is_counted_once_with_its_outcome(
    case: str, route: str, body: Any, status: int, model: str, client: TestClient
) -> None:
    _, before = scrape(client)
    if isinstance(body, bytes):
        r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(route, json=body)
    assert r.status_code == status, r.text
    _, after = scrape(client)
    moved = {
        dict(k[1])["model"] + " " + dict(k[1])["outcome"]: after[k] - before.get(k, 0.0)
        for k in after
        if k[0] == "mint_requests_total" and after[k] != before.get(k, 0.0)
    }
    assert moved == {f"{model} {status}": 1.0}
    # a refusal generates nothing
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert after[(name, ENGINE_LABELS)] == before[(name, ENGINE_LABELS)]
