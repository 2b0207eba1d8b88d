"""The serving contract's bodies: OpenAI's completion and chat shapes and vLLM's LoRA admin routes.

Field and class names follow vLLM's `vllm/entrypoints/openai/protocol.py`, so a reader who knows vLLM's server
reads these unchanged and a client of either server sends the same JSON. Only the fields mint honours are
declared, plus vLLM's sampling fields the engine lacks (top_k, min_p, the penalties) for their bounds alone: an
out-of-range value gets the same 400 on both backends, an in-range one is ignored by mint serve and passed on by
the vLLM front. Unknown request fields are ignored, as vLLM does. Every bound is checked while the body is parsed,
and a body that does not fit answers 400 naming the field (`invalid_request`).
Responses carry exactly the fields mint has always sent: a field OpenAI's shape leaves out when it does not apply
is left out (`omit_if_none`), not sent as null.

mint's own extension (`/v1/mint/prefetch`) lives here too, under its own names.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from mint_core.engine.sampling import SamplingParams


class OpenAIBaseModel(BaseModel):
    """Unknown fields of a request are ignored (a newer client may send fields this server does not know).

    The fields a class names in `omit_if_none` are left out of its JSON while None: OpenAI's shapes have fields
    that are absent, not null, when they do not apply (a model card's `revision` for the base, a stream event's
    `usage` before the last one)."""

    model_config = ConfigDict(extra="ignore")
    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    # no return annotation: pydantic would take it for the serialised schema and lose the fields in OpenAPI
    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        data = handler(self)
        for name in self.omit_if_none:
            if name in data and data[name] is None:
                del data[name]
        return data


# ---- errors ---------------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body, with vLLM's types (BadRequestError, NotFoundError, InvalidUserInput, ...)."""

    error: ErrorInfo


class APIError(Exception):
    """An answer other than 2xx, raised anywhere below a route and turned into an ErrorResponse by the app."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param

    def response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        )


def invalid_request(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's errors of a body that does not fit its model, as one 400 that names the fields: `param` is the
    first one's path, the message gives each field (up to five) what is wrong and the value sent, such as
    `temperature: must be less than or equal to 2 (sent 3.5)`. A field of several accepted shapes (`prompt`) is
    reported once, with the shapes, not once per shape that failed."""
    fields: dict[tuple[object, ...], list[Mapping[str, Any]]] = {}
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if loc[:1] == ("body",):  # FastAPI's errors start at the body; the model's own at its fields
            loc = loc[1:]
        # pydantic names the union member it tried in the path ("prompt", "list[int]", 0): cut there
        cut = next((i for i, part in enumerate(loc) if _is_shape(part)), len(loc))
        fields.setdefault(loc[:cut], []).append({**err, "loc": loc})
    parts = []
    for path, errs in list(fields.items())[:5]:
        first = min(errs, key=lambda e: len(e["loc"]))  # the whole value, where a shape was tried on it
        shapes = list(dict.fromkeys(str(e["loc"][len(path)]) for e in errs if len(e["loc"]) > len(path)))
        if len(shapes) > 1:
            what = f"must be one of: {', '.join(shapes)}"
        else:
            what = str(first.get("msg", "is invalid")).removeprefix("Value error, ")
            what = re.sub(r"^(Input|List|String|Dictionary) should", "must", what).replace(
                "Field required", "required"
            )
        sent = "" if first.get("type") == "missing" else f" (sent {_short(first.get('input'))})"
        parts.append(f"{'.'.join(str(x) for x in path) or 'body'}: {what}{sent}")
    first_path = next(iter(fields), ())
    param = ".".join(str(x) for x in first_path) or None
    return APIError(400, "; ".join(parts) or "invalid request", "BadRequestError", param)


_SHAPES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_shape(part: object) -> bool:
    """Whether a part of an error's path is a union member pydantic tried (`list[int]`, `str`, a model's class
    name), not a field name (every field of the protocol is snake_case) or a list index."""
    return isinstance(part, str) and (not part.isidentifier() or part in _SHAPES or part[:1].isupper())


def _short(value: object, limit: int = 80) -> str:
    """A value for an error message, cut short: a prompt of megabytes must not come back whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# ---- shared pieces --------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    """Send one more event before [DONE] with the request's token counts."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


FinishReason = Literal["stop", "length", "abort"]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOPS = 16  # the engine's limit (SamplingParams.stop)
MAX_SEQUENCES = (
    4096  # prompts x n of one completion request: a body within max_body_bytes stays within memory
)


class SamplingRequest(OpenAIBaseModel):
    """The sampling fields completions and chat share, with the bounds both backends enforce: OpenAI's where it
    states one, vLLM's (`SamplingParams._verify_args`) otherwise. NaN and infinities are refused."""

    model_config = ConfigDict(allow_inf_nan=False)

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """0 is greedy; unset: 1."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """Nucleus sampling; unset: 1."""
    top_k: int | None = Field(None, ge=-1)
    """vLLM's: sample from the k most likely tokens (0 or -1: all). Checked; mint serve does not implement it."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """vLLM's: drop tokens below min_p x the top token's probability. Checked; not implemented by mint serve."""
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    """Checked; not implemented by mint serve."""
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    """Checked; not implemented by mint serve."""
    repetition_penalty: float | None = Field(None, gt=0.0)
    """vLLM's (1: none). Checked; not implemented by mint serve."""
    n: int = Field(1, ge=1, le=64)
    """Completions per prompt; choice j is seeded `seed + j`."""
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    """Up to 16 non-empty strings; the text returned ends before the first one generated."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end-of-sequence token."""

    @field_validator("stop")
    @classmethod
    def _stops_fit(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = _stops(v)
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v


# ---- /v1/completions ------------------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    model: str
    """An adapter's name, a catalog address (with a catalog), or the base's name for no adapter."""
    prompt: str | list[str] | list[int] | list[list[int]]
    """One prompt or a batch of them, as text or token ids."""
    max_tokens: int | None = Field(16, ge=0)
    """0 with `echo`: score the prompt only. Prompt + max_tokens must fit the context (checked per prompt)."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """Return each token's logprob and this many top alternatives (0: the token's own only)."""
    echo: bool = False
    """Return the prompt before the completion, with its logprobs when asked."""

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one entry each (a flat list of ints is one tokenised prompt); APIError 400 when
        they and `n` ask for more than MAX_SEQUENCES sequences (each is queued and answered on its own)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]
        if len(self.prompt) * self.n > MAX_SEQUENCES:
            raise APIError(
                400,
                f"{len(self.prompt)} prompts x n={self.n} is over the limit of {MAX_SEQUENCES} sequences a request",
                "BadRequestError",
                "prompt",
            )
        return list(self.prompt)  # type: ignore[arg-type]

    def to_sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """The engine's parameters for choice `choice` of this request, `max_tokens` already fitted to the
        prompt (ValueError, naming the field, for anything the engine refuses)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=_stops(self.stop),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            echo=self.echo,
            ignore_eos=self.ignore_eos,
        )


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    """The adapter revisions that served the request (sha256 hex, comma-separated), or "base"."""
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    omit_if_none = frozenset({"system_fingerprint", "usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions -------------------------------------------------------------------------------


class ChatCompletionMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    """Text, or OpenAI's content parts (their `text` parts are joined)."""

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in (self.content or []) if isinstance(part, dict))


class ChatCompletionRequest(SamplingRequest):
    model: str
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of max_completion_tokens, which wins when both are set."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """Top alternatives per token; needs `logprobs` (as OpenAI and vLLM)."""

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """As CompletionRequest's (chat has no echo)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=_stops(self.stop),
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            echo=False,
            ignore_eos=self.ignore_eos,
        )


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str


class ChatCompletionLogProb(OpenAIBaseModel):
    omit_if_none = frozenset({"bytes"})  # the top alternatives carry no bytes

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    omit_if_none = frozenset({"role", "content"})

    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    omit_if_none = frozenset({"system_fingerprint", "usage"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/models and the LoRA admin routes -----------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    omit_if_none = frozenset({"max_model_len", "revision"})

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mint"
    root: str | None = None
    """The base's name, or for an adapter the `lora_path` it was loaded from (its revision if on demand)."""
    parent: str | None = None
    """None for the base; the base's name for an adapter."""
    max_model_len: int | None = None
    revision: str | None = None
    """mint's addition for adapters: `sha256:<hex>` of the revision the name serves now."""


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    # empty rather than required, so a missing field gets vLLM's InvalidUserInput answer, not a validation error
    lora_name: str = ""
    lora_path: str = ""
    """A directory inside the adapter store, `sha256:<hex>` of a stored revision, or (with a catalog) a catalog
    address such as `policy@champion` or `policy/v3`."""
    load_inplace: bool = False
    """Swap the revision under an existing name; requests already running finish on the old one."""


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None
    """Accepted for vLLM clients; mint names adapters only by `lora_name`."""


# ---- mint's extension ------------------------------------------------------------------------------------


class PrefetchRequest(OpenAIBaseModel):
    addresses: list[str] = Field(default_factory=list, max_length=100_000)
    """Catalog addresses to load ahead of need."""
    wait: bool = False
    """Answer once they are loaded, with each address's outcome."""


class PrefetchResponse(OpenAIBaseModel):
    omit_if_none = frozenset({"results"})

    scheduled: int
    results: dict[str, str] | None = None
    """With `wait`: "loaded" or "error: <why>" per address."""


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
