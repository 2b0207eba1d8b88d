"""Greedy held-out scores of a policy (or the bare base) on its task."""

from __future__ import annotations

from mint_core.data.rewards import builtin_scores
from mint_core.data.tasks import Example
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
