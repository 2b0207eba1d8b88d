"""The serving contract's bodies: OpenAI's completion and chat shapes and vLLM's LoRA admin routes.

Field and class names follow vLLM's `vllm/entrypoints/openai/protocol.py`, so a reader who knows vLLM's server
reads these unchanged and a client of either server sends the same JSON. Only the fields mint honours are
declared; unknown request fields are ignored, as vLLM does. Responses carry exactly the fields mint has always
sent: a field OpenAI's shape leaves out when it does not apply is left out (`omit_if_none`), not sent as null.

mint's own extension (`/v1/mint/prefetch`) lives here too, under its own names.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

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


# ---- shared pieces --------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    """Send one more event before [DONE] with the request's token counts."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


FinishReason = Literal["stop", "length", "abort"]


# ---- /v1/completions ------------------------------------------------------------------------------------


class CompletionRequest(OpenAIBaseModel):
    model: str
    """An adapter's name, a catalog address (with a catalog), or the base's name for no adapter."""
    prompt: str | list[str] | list[int] | list[list[int]]
    """One prompt or a batch of them, as text or token ids."""
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    """Completions per prompt; choice j is seeded `seed + j`."""
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    """Return each token's logprob and this many top alternatives (0: the token's own only)."""
    echo: bool = False
    """Return the prompt before the completion, with its logprobs when asked."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end-of-sequence token."""

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one entry each (a flat list of ints is one tokenised prompt)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]
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


class ChatCompletionRequest(OpenAIBaseModel):
    model: str
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens, which wins when both are set."""
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

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
