"""Verifiable rewards, found by name. Each maps (example, completion text) to a float in [0, 1]."""

from __future__ import annotations

from collections.abc import Callable

from mint_core.data.tasks import Example, is_well_formed

RewardFn = Callable[[Example, str], float]


def exact_match(example: Example, completion: str) -> float:
    """1 if the completion (surrounding whitespace ignored) is exactly the answer."""
    return float(completion.strip() == example.answer)


def well_formed(example: Example, completion: str) -> float:
    """1 if the completion has the shape of an answer to its task (digits for sums, a word for words, ...)."""
    return float(is_well_formed(example.task, completion))


def match_and_format(example: Example, completion: str) -> float:
    """0.8 for an exact answer plus 0.2 for a well-formed one: a gradient even when no sample is right yet."""
    return 0.8 * exact_match(example, completion) + 0.2 * well_formed(example, completion)


def char_overlap(example: Example, completion: str) -> float:
    """Fraction of answer positions the completion gets right (partial credit for long answers)."""
    got, want = completion.strip(), example.answer
    if not want:
        return float(not got)
    hits = sum(a == b for a, b in zip(got, want, strict=False))
    return hits / max(len(want), len(got))


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "well_formed": well_formed,
    "match_and_format": match_and_format,
    "char_overlap": char_overlap,
}


def reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; known: {', '.join(REWARDS)}")
    return REWARDS[name]
