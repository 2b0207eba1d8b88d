"""What the front relays, in mint's shape: a request's parse, vLLM's answers and errors as mint serve gives them,
and the headers that name who answered (serving/gateway.py is the front itself)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from mint_core.serving.protocol import APIError, CompletionRequest, invalid_request


def named(replica: str | None, fp: str) -> dict[str, str] | None:
    """The headers that name who answered, with a fleet: the replica and the revision it served."""
    if replica is None:
        return None
    return {"X-Mint-Replica": replica, "X-Mint-Revision": fp if fp == "base" else f"sha256:{fp}"}


def relayed(r: httpx.Response) -> APIError:
    """vLLM's error answer as the front's (vLLM already answers in OpenAI's shape)."""
    try:
        err = r.json()["error"]
        return APIError(r.status_code, str(err.get("message")), str(err.get("type")), err.get("param"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(r.status_code, f"vLLM answered {r.status_code}: {r.text[:300]}", "BackendError")


def prompt_only(tokenizer: Any, out: dict[str, Any], body: CompletionRequest) -> dict[str, Any]:
    """A completion of one token cut back to its echoed prompt: what max_tokens 0 with echo answers."""
    prompts = [
        p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompts() for _ in range(body.n)
    ]
    for choice, prompt in zip(out.get("choices", []), prompts, strict=False):
        choice["text"] = prompt
        choice["finish_reason"] = "length"
        lp = choice.get("logprobs")
        if isinstance(lp, dict):
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if isinstance(lp.get(key), list) and lp[key]:
                    lp[key] = lp[key][:-1]
    usage = out.get("usage")
    if isinstance(usage, dict):
        usage["completion_tokens"] = 0
        usage["total_tokens"] = usage.get("prompt_tokens", 0)
    return out


def normalised(out: dict[str, Any], fingerprint: str, model: str) -> dict[str, Any]:
    """A vLLM completion (or stream event) in mint's shape: `system_fingerprint` names the revision that answered,
    and `usage` carries the token counts only (vLLM adds null `*_tokens_details`)."""
    out["system_fingerprint"] = fingerprint
    out["model"] = model  # the name asked for (the base travels to vLLM as its zero adapter)
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: v for k, v in out["usage"].items() if v is not None}
    return out


def decoded(raw: bytes) -> dict[str, Any]:
    """A request's JSON body: 400 when it is not JSON, or not an object."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", "BadRequestError") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", "BadRequestError")
    return data


def validated(data: dict[str, Any], model: type[BaseModel]) -> Any:
    """`data` parsed by mint's protocol: 400 naming the fields that do not fit."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise invalid_request(e.errors()) from None


def parse(raw: bytes, model: type[BaseModel]) -> tuple[dict[str, Any], Any]:
    """The JSON body and its parse by mint's protocol (`decoded`, then `validated`)."""
    data = decoded(raw)
    return data, validated(data, model)
