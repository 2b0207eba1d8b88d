"""The serving protocol's models: a request becomes the engine's sampling parameters, a field out of its range is a
400 that names it, responses serialise to exactly OpenAI's keys (fields that do not apply are absent, not null);
the body limit both backends put before their routes; the warning for an adapter that names another base."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError
from safetensors.torch import save_file

from mint_core.lora.adapter import CONFIG_FILE, FINGERPRINT_KEY, WEIGHTS_FILE
from mint_core.lora.validate import recorded_base
from mint_core.serving.body_limit import BodyLimit
from mint_core.serving.protocol import (
    APIError,
    ChatCompletionLogProb,
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    DeltaMessage,
    ModelCard,
    PrefetchResponse,
    SamplingRequest,
    UsageInfo,
    invalid_request,
)
from mint_core.serving.routes.models import other_base_warning


def test_completion_request_to_sampling_params() -> None:
    body = CompletionRequest(model="m", prompt="hi", seed=7, stop="\n", logprobs=3, echo=True)
    p = body.to_sampling_params(max_tokens=5, choice=2)
    assert (p.max_tokens, p.seed, p.stop, p.logprobs, p.top_logprobs, p.echo) == (5, 9, ["\n"], True, 3, True)
    assert (p.temperature, p.top_p) == (1.0, 1.0)  # OpenAI's defaults when unset

    plain = CompletionRequest(model="m", prompt="hi", temperature=0).to_sampling_params(
        max_tokens=1, choice=0
    )
    assert (plain.temperature, plain.seed, plain.stop, plain.logprobs, plain.top_logprobs) == (
        0,
        None,
        [],
        False,
        0,
    )
    # logprobs=0: each token's own logprob, no alternatives
    zero = CompletionRequest(model="m", prompt="hi", logprobs=0).to_sampling_params(max_tokens=1, choice=0)
    assert (zero.logprobs, zero.top_logprobs) == (True, 0)


def test_chat_request_to_sampling_params() -> None:
    body = ChatCompletionRequest(
        model="m",
        messages=[ChatCompletionMessageParam(role="user", content="hi")],
        max_tokens=9,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    assert body.requested_max_tokens() == 4  # OpenAI's newer field wins
    p = body.to_sampling_params(max_tokens=4, choice=0)
    assert (p.logprobs, p.top_logprobs, p.echo) == (True, 2, False)


OUT_OF_RANGE: list[tuple[str, type[SamplingRequest], dict[str, Any], str, str]] = [
    # (case, request model, fields, `param`, message substring: the field, the bound and the value sent)
    (
        "negative temperature",
        CompletionRequest,
        {"temperature": -1},
        "temperature",
        "greater than or equal to 0",
    ),
    (
        "temperature above 2",
        ChatCompletionRequest,
        {"temperature": 2.5},
        "temperature",
        "less than or equal to 2",
    ),
    ("NaN temperature", CompletionRequest, {"temperature": float("nan")}, "temperature", "finite number"),
    ("top_p above 1", CompletionRequest, {"top_p": 2}, "top_p", "less than or equal to 1 (sent 2)"),
    ("top_p of zero", ChatCompletionRequest, {"top_p": 0}, "top_p", "greater than 0 (sent 0)"),
    ("top_k below -1", CompletionRequest, {"top_k": -2}, "top_k", "greater than or equal to -1 (sent -2)"),
    ("fractional top_k", ChatCompletionRequest, {"top_k": 1.5}, "top_k", "valid integer"),
    ("min_p above 1", CompletionRequest, {"min_p": 1.5}, "min_p", "less than or equal to 1 (sent 1.5)"),
    ("negative min_p", ChatCompletionRequest, {"min_p": -0.1}, "min_p", "greater than or equal to 0"),
    ("n=0", CompletionRequest, {"n": 0}, "n", "greater than or equal to 1 (sent 0)"),
    ("n above 64", ChatCompletionRequest, {"n": 65}, "n", "less than or equal to 64 (sent 65)"),
    (
        "negative max_tokens",
        CompletionRequest,
        {"max_tokens": -1},
        "max_tokens",
        "greater than or equal to 0",
    ),
    (
        "chat max_tokens 0",
        ChatCompletionRequest,
        {"max_tokens": 0},
        "max_tokens",
        "greater than or equal to 1",
    ),
    (
        "max_completion_tokens 0",
        ChatCompletionRequest,
        {"max_completion_tokens": 0},
        "max_completion_tokens",
        "greater than or equal to 1 (sent 0)",
    ),
    (
        "logprobs above 20",
        CompletionRequest,
        {"logprobs": 21},
        "logprobs",
        "less than or equal to 20 (sent 21)",
    ),
    ("negative logprobs", CompletionRequest, {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    (
        "top_logprobs above 20",
        ChatCompletionRequest,
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "less than or equal to 20 (sent 21)",
    ),
    (
        "top_logprobs without logprobs",
        ChatCompletionRequest,
        {"top_logprobs": 2},
        "top_logprobs",
        "needs logprobs set to true",
    ),
    (
        "presence_penalty above 2",
        CompletionRequest,
        {"presence_penalty": 3},
        "presence_penalty",
        "less than or equal to 2 (sent 3)",
    ),
    (
        "frequency_penalty below -2",
        ChatCompletionRequest,
        {"frequency_penalty": -2.5},
        "frequency_penalty",
        "greater than or equal to -2 (sent -2.5)",
    ),
    (
        "repetition_penalty of zero",
        CompletionRequest,
        {"repetition_penalty": 0},
        "repetition_penalty",
        "greater than 0 (sent 0)",
    ),
    (
        "infinite repetition_penalty",
        ChatCompletionRequest,
        {"repetition_penalty": float("inf")},
        "repetition_penalty",
        "finite number",
    ),
    ("seed beyond int64", CompletionRequest, {"seed": 2**63}, "seed", f"less than or equal to {2**63 - 1}"),
    ("empty stop string", CompletionRequest, {"stop": [""]}, "stop", "stop strings must be non-empty"),
    ("empty stop", ChatCompletionRequest, {"stop": ""}, "stop", "stop strings must be non-empty"),
    ("17 stop strings", CompletionRequest, {"stop": ["a"] * 17}, "stop", "at most 16 stop strings, got 17"),
    (
        "stop of the wrong type",
        CompletionRequest,
        {"stop": 5},
        "stop",
        "must be one of: str, list[str] (sent 5)",
    ),
]


@pytest.mark.parametrize(
    ("case", "model", "fields", "param", "message"), OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE]
)
def test_out_of_range_field_is_a_400_that_names_it(
    case: str, model: type[SamplingRequest], fields: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    error = invalid_request(e.value.errors())
    assert error.response().model_dump() == {
        "error": {"message": error.message, "type": "BadRequestError", "param": param, "code": 400}
    }
    assert error.message.startswith(f"{param}: "), error.message
    assert message in error.message, error.message


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "n": 64, "logprobs": 20, "max_tokens": 0},
        {
            "temperature": 2,
            "top_p": 1e-6,
            "top_k": 0,
            "min_p": 1,
            "presence_penalty": -2,
            "frequency_penalty": 2,
        },
        {"repetition_penalty": 1e-3, "seed": -(2**63), "stop": ["a"] * 16, "top_k": 50},
        {"seed": 2**63 - 1, "stop": "\n", "presence_penalty": 2, "frequency_penalty": -2},
    ],
)
def test_every_bound_is_inclusive_where_vllm_s_is(fields: dict[str, Any]) -> None:
    CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})
    chat = {k: v for k, v in fields.items() if k not in ("logprobs", "max_tokens")}
    ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **chat}
    )


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        # a field of several shapes is reported once, with the shapes, not once per shape tried
        (
            {"prompt": 5},
            "prompt",
            "prompt: must be one of: str, list[str], list[int], list[list[int]] (sent 5)",
        ),
        ({}, "prompt", "prompt: required"),
        (
            # every field wrong is named, in the model's order; `param` is the first
            {"prompt": "hi", "n": 0, "top_p": 3},
            "top_p",
            "top_p: must be less than or equal to 1 (sent 3); n: must be greater than or equal to 1 (sent 0)",
        ),
        ({"prompt": "x" * 10_000, "temperature": -1}, "temperature", "(sent -1)"),
    ],
)
def test_the_message_reads_field_what_and_value(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", **body})
    error = invalid_request(e.value.errors())
    assert (error.status, error.param) == (400, param)
    assert message in error.message, error.message


def test_nested_fields_are_named_by_their_path_and_long_values_cut_short() -> None:
    messages = [{"role": "user", "content": 5}, {"content": "x" * 10_000}]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, "stream_options": {"include_usage": "q"}}
        )
    error = invalid_request(e.value.errors())
    assert error.param == "stream_options.include_usage"
    assert error.message.split("; ") == [
        "stream_options.include_usage: must be a valid boolean, unable to interpret input (sent 'q')",
        "messages.0.content: must be one of: str, list[dict[str,any]] (sent 5)",
        "messages.1.role: required",
    ]
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": ["x" * 10_000, 7]})
    assert len(invalid_request(e.value.errors()).message) < 300  # a prompt of megabytes does not come back


def test_prompts_times_n_is_bounded() -> None:
    body = CompletionRequest(model="m", prompt=["a"] * 65, n=64)
    with pytest.raises(APIError) as e:
        body.prompts()
    assert (e.value.status, e.value.param) == (400, "prompt")
    assert "65 prompts x n=64 is over the limit of 4096 sequences" in e.value.message
    assert len(CompletionRequest(model="m", prompt=["a"] * 64, n=64).prompts()) == 64


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [("hi", ["hi"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]), ([], [])],
)
def test_prompts(prompt: object, prompts: list) -> None:
    assert CompletionRequest(model="m", prompt=prompt).prompts() == prompts  # type: ignore[arg-type]


def test_chat_content_parts_are_joined() -> None:
    m = ChatCompletionMessageParam(role="user", content=[{"type": "text", "text": "a"}, {"text": "b"}, {}])
    assert m.text() == "ab"


def test_absent_fields_are_left_out_not_null() -> None:
    base = ModelCard(id="b", created=1, root="b", parent=None, max_model_len=8)
    adapter = ModelCard(id="a", created=1, root="a", parent="b", revision="sha256:00")
    assert base.model_dump() == {
        "id": "b",
        "object": "model",
        "created": 1,
        "owned_by": "mint",
        "root": "b",
        "parent": None,  # OpenAI's shape: null for the base
        "max_model_len": 8,
    }
    assert set(adapter.model_dump()) == {"id", "object", "created", "owned_by", "root", "parent", "revision"}

    opening = ChatCompletionStreamResponse(
        id="c",
        created=1,
        model="m",
        system_fingerprint="base",
        choices=[
            ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
        ],
    )
    assert json.loads(opening.model_dump_json()) == {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "system_fingerprint": "base",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    usage = ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[], usage=UsageInfo())
    assert set(usage.model_dump()) == {"id", "object", "created", "model", "choices", "usage"}
    assert DeltaMessage().model_dump() == {}
    assert ChatCompletionLogProb(token="a", logprob=-1.0).model_dump() == {"token": "a", "logprob": -1.0}
    assert PrefetchResponse(scheduled=2).model_dump() == {"scheduled": 2}


# ---- the body limit ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[TestClient, list[str]]]:
    """An app that answers the size of the body it read, behind a 1 KiB BodyLimit; the paths refused so far."""
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/api/v1/forward_backward")
    async def size(request: Request) -> dict[str, int]:
        return {"read": len(await request.body())}

    refused: list[str] = []
    app.add_middleware(BodyLimit, max_bytes=1024, refused=refused.append)
    with TestClient(app) as c:
        yield c, refused


def test_a_body_over_the_limit_is_a_413_the_app_never_reads(limited: tuple[TestClient, list[str]]) -> None:
    c, refused = limited
    assert c.post("/v1/completions", content=b"x" * 1024).json() == {"read": 1024}
    stated = c.post("/v1/completions", content=b"x" * 1025)
    assert stated.status_code == 413
    assert stated.json() == {
        "error": {
            "message": "request body of 1025 bytes is over the limit of 1024 bytes (max_body_bytes)",
            "type": "BadRequestError",
            "param": None,
            "code": 413,
        }
    }
    # no Content-Length: refused once the bytes that arrived pass the limit
    chunked = c.post("/v1/completions", content=iter([b"x" * 600, b"x" * 600, b"x" * 600]))
    assert chunked.status_code == 413
    assert (
        chunked.json()["error"]["message"] == "request body is over the limit of 1024 bytes (max_body_bytes)"
    )
    assert refused == ["/v1/completions", "/v1/completions"]
    # Tinker's training API carries its own payloads
    assert c.post("/api/v1/forward_backward", content=b"x" * 5000).json() == {"read": 5000}


# ---- an adapter that names another base -------------------------------------------------------------------


def _adapter_files(d: Path, base_name: str | None, fingerprint: str | None) -> Path:
    """The two files `recorded_base` reads, as mint's exporter or PEFT writes them (one tensor is enough)."""
    d.mkdir()
    (d / CONFIG_FILE).write_text(
        json.dumps({"peft_type": "LORA", "r": 1, "base_model_name_or_path": base_name})
    )
    meta = {"format": "pt"} | ({FINGERPRINT_KEY: fingerprint} if fingerprint else {})
    save_file({"base_model.model.q.lora_A.weight": torch.zeros(1, 2)}, str(d / WEIGHTS_FILE), metadata=meta)
    return d


SERVED = ("Qwen2.5-0.5B", "/models/Qwen2.5-0.5B")
BASE_WARNINGS: list[tuple[str, str | None, str | None, str | None]] = [
    # (case, base_model_name_or_path, recorded fingerprint, warning substring; None: no warning)
    ("mint's export: fingerprint, no name", None, "ab" * 32, None),
    ("fingerprint (it matched) outweighs another name", "meta-llama/Llama-3-8B", "ab" * 32, None),
    ("PEFT's: the served base under a hub id", "Qwen/Qwen2.5-0.5B", None, None),
    ("PEFT's: the served base under another path", "/home/me/ckpt/qwen2.5-0.5b/", None, None),
    ("PEFT's: no name, no fingerprint", None, None, None),
    (
        "PEFT's: another base",
        "meta-llama/Llama-3-8B",
        None,
        "names base_model_name_or_path 'meta-llama/Llama-3-8B'",
    ),
]


@pytest.mark.parametrize(
    ("case", "name", "fingerprint", "warning"), BASE_WARNINGS, ids=[c[0] for c in BASE_WARNINGS]
)
def test_other_base_warning(
    case: str, name: str | None, fingerprint: str | None, warning: str | None, tmp_path: Path
) -> None:
    d = _adapter_files(tmp_path / "a", name, fingerprint)
    assert recorded_base(d) == (name, fingerprint)
    got = other_base_warning(d, SERVED)
    if warning is None:
        assert got is None
    else:
        assert got is not None and warning in got and "/models/Qwen2.5-0.5B, Qwen2.5-0.5B" in got
        assert "records no base fingerprint" in got


def test_recorded_base_of_unreadable_files_is_unknown(tmp_path: Path) -> None:
    d = tmp_path / "a"
    d.mkdir()
    (d / CONFIG_FILE).write_text("{not json")
    (d / WEIGHTS_FILE).write_bytes(b"\xff" * 8 + b"x")
    assert recorded_base(d) == (None, None)
    assert recorded_base(tmp_path / "missing") == (None, None)
