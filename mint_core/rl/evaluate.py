"""Greedy held-out scores of a policy (or the bare base) on its task, and its headroom: what sampling finds that
the greedy answer misses."""

from __future__ import annotations

from pydantic import BaseModel

from mint_core.data.generators import Example
from mint_core.data.rewards import builtin_scores
from mint_core.engine.chat import prompt_ids
from mint_core.engine.engine import Engine, Request
from mint_core.engine.sampling import SamplingParams


def _greedy_rewards(
    engine: Engine, adapter: str | None, examples: list[Example], reward: str, max_new_tokens: int
) -> list[float]:
    """The reward of each greedy answer to `examples` under `adapter` (None: the bare base), in one batch."""
    if not examples:
        raise ValueError("no examples to score")
    params = SamplingParams(max_tokens=max_new_tokens)
    out = engine.generate(
        [Request(prompt_ids(engine.tokenizer, ex.prompt), adapter, params) for ex in examples]
    )
    return builtin_scores(reward, examples, [c.text for c in out])


def heldout_correct(
    engine: Engine,
    adapter: str | None,
    examples: list[Example],
    reward: str = "exact_match",
    max_new_tokens: int = 12,
) -> list[bool]:
    """Whether each greedy answer earns the full reward, in the examples' order (so two adapters' lists pair up
    for a paired test)."""
    return [r >= 1.0 for r in _greedy_rewards(engine, adapter, examples, reward, max_new_tokens)]


def heldout_scores(
    engine: Engine,
    adapter: str | None,
    examples: list[Example],
    reward: str = "exact_match",
    max_new_tokens: int = 12,
) -> float:
    """Mean reward of greedy answers to `examples` under `adapter` (None: the bare base)."""
    rewards = _greedy_rewards(engine, adapter, examples, reward, max_new_tokens)
    return sum(rewards) / len(rewards)


class Headroom(BaseModel):
    """What GRPO could still teach a policy on some prompts: GRPO moves the greedy answer only where a group of
    samples holds a right answer and a wrong one, so the items a sample gets right and the greedy answer does
    not are the room it has."""

    items: int
    """Prompts measured."""
    greedy: float
    """Share answered right greedily (exact match)."""
    pass_k: float
    """Share where at least one of `k` samples is right: a group of size k would carry a right answer."""
    k: int
    """Samples per prompt (the GRPO group size)."""

    @property
    def gap(self) -> float:
        """pass@k - greedy: the items sampling finds and the greedy answer misses."""
        return self.pass_k - self.greedy


def headroom(
    engine: Engine,
    adapter: str | None,
    examples: list[Example],
    k: int,
    temperature: float,
    max_new_tokens: int = 12,
    seed: int = 0,
) -> Headroom:
    """Greedy exact match and pass@k at `temperature` of `adapter` on `examples` (their `answer` column), in two
    batches; the samples are seeded, so the same call measures the same."""
    greedy = [r >= 1.0 for r in _greedy_rewards(engine, adapter, examples, "exact_match", max_new_tokens)]
    reqs = [
        Request(
            prompt_ids(engine.tokenizer, ex.prompt),
            adapter,
            SamplingParams(
                max_tokens=max_new_tokens, temperature=temperature, seed=seed * 1_000_003 + k * i + j
            ),
        )
        for i, ex in enumerate(examples)
        for j in range(k)
    ]
    texts = [c.text for c in engine.generate(reqs)]
    right = builtin_scores("exact_match", [ex for ex in examples for _ in range(k)], texts)
    hit = [any(r >= 1.0 for r in right[i * k : (i + 1) * k]) for i in range(len(examples))]
    n = len(examples)
    return Headroom(items=n, greedy=sum(greedy) / n, pass_k=sum(hit) / n, k=k)
