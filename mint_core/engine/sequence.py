"""Requests, the per-request state the batcher advances, and what comes back."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from mint_core.engine.sampling import SamplingParams
from mint_core.errors import MintError

FinishReason = Literal["stop", "length", "abort"]


class RequestError(MintError):
    """A generation request that cannot be served as asked (prompt too long, empty prompt, ...)."""


@dataclass
class Request:
    prompt: str | list[int]
    adapter: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    adapter: str | None
    revision: str | None  # digest of the adapter revision that served this request (None: bare base)
    prompt_token_ids: list[int]
    logprobs: list[float] | None = None
    prompt_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request in flight: its slot (held from admission to finish), its tokens so far, its fate."""

    request: Request
    prompt_ids: list[int]
    generator: torch.Generator | None
    on_event: Callable[[Sequence], None] | None = (
        None  # called after each token and at finish (batcher thread)
    )
    slot: int = -1
    revision: str | None = None
    id: int = field(default_factory=lambda: next(_ids))
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    top: list[dict[int, float]] = field(default_factory=list)  # per generated token, if top_logprobs
    prompt_top: list[dict[int, float] | None] | None = None
    finish_reason: FinishReason | None = None
    cut_text: str | None = None  # the text up to a stop string, once one was seen
    error: BaseException | None = None
    cancelled: bool = False  # set by the caller (client went away); the batcher retires it at the next step
    held: str | None = None  # an on-demand adapter name held for this sequence until it is admitted

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, decode: Callable[[list[int]], str]) -> Completion:
        text = self.cut_text if self.cut_text is not None else decode(self.out_ids)
        return Completion(
            text=text,
            token_ids=list(self.out_ids),
            finish_reason=self.finish_reason or "abort",
            adapter=self.request.adapter,
            revision=self.revision,
            prompt_token_ids=self.prompt_ids,
            logprobs=list(self.out_logprobs) if self.params.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
            top_logprobs=list(self.top) if self.params.top_logprobs else None,
            prompt_top_logprobs=self.prompt_top,
        )
