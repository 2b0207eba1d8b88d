"""The serving protocol's models: a request becomes the engine's sampling parameters, and responses serialise to
exactly OpenAI's keys (fields that do not apply are absent, not null)."""

from __future__ import annotations

import json

import pytest

from mint_core.serving.protocol import (
    ChatCompletionLogProb,
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    DeltaMessage,
    ModelCard,
    PrefetchResponse,
    UsageInfo,
)


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


@pytest.mark.parametrize(
    ("case", "fields", "message"),
    [
        ("negative temperature", {"temperature": -0.5}, "temperature"),
        ("empty stop string", {"stop": [""]}, "stop"),
        ("top_p of zero", {"top_p": 0}, "top_p"),
    ],
)
def test_what_the_engine_refuses_names_the_field(case: str, fields: dict, message: str) -> None:
    body = CompletionRequest(model="m", prompt="hi", **fields)
    with pytest.raises(ValueError, match=message):
        body.to_sampling_params(max_tokens=1, choice=0)


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
