"""Sampling parameters and per-row token choice (greedy, temperature, top-p, seeded)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request is decoded."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=0, le=1_000_000)
    """Most tokens to generate (0: score the prompt only, with echo)."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """0 is greedy; otherwise logits are divided by it before sampling."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Seed of this request's own generator, so its sample does not depend on the rest of the batch."""
    stop: list[str] = Field(default_factory=list, max_length=16)
    """Generation ends as soon as the text contains any of these; the text returned stops before it
    (token_ids and logprobs keep the tokens that completed it)."""
    logprobs: bool = False
    """Return the log-probability of each generated token (under the model, before temperature)."""
    echo: bool = False
    """Also return the prompt's tokens with their log-probabilities."""
    top_logprobs: int = Field(0, ge=0, le=20)
    """Also return, per returned logprob, the k most likely tokens and their log-probabilities."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks)."""

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


def filter_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's nucleus. logits [n, V], top_p [n]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # a token is dropped if the mass before it already reaches top_p (the top token always stays)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def choose_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Next token per row. logits [n, V] (float32)."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    out = logits.argmax(dim=-1)
    sampled = (temps > 0).nonzero().flatten().tolist()
    if not sampled:
        return out
    sub = logits[sampled] / temps[sampled, None]
    top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
    if bool((top_p < 1).any()):
        sub = filter_top_p(sub, top_p)
    # inverse CDF, all rows at once: one uniform per row from the row's own generator (so a seeded row draws
    # the same whatever else is in the batch), then the first token whose cumulative mass passes it (scaled
    # by the row's total, so rounding never lands past the last token that has mass). A loop of one
    # `multinomial` per row cost more than the rest of choosing tokens.
    cdf = sub.softmax(dim=-1).cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=generators[i], device=logits.device) for i in sampled])
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    out[torch.tensor(sampled, device=logits.device)] = picked.clamp(max=logits.shape[-1] - 1)
    return out
