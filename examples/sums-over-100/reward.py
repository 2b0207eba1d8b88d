"""This task's reward, in TRL's keyword convention: it reads the data's own `a` and `b` columns (the ground
truth as numbers), not a string answer."""

from __future__ import annotations

from typing import Any


def sum_reward(
    prompts: list[str], completions: list[str], a: list[int], b: list[int], **kwargs: Any
) -> list[float]:
    """1.0 for the right sum; 0.2 for a wrong three-digit number (the right shape: a signal before any sample
    is right); 0.0 otherwise."""
    out = []
    for text, x, y in zip(completions, a, b, strict=True):
        got = text.strip()
        if got.isdigit() and int(got) == x + y:
            out.append(1.0)
        elif got.isdigit() and len(got) == 3:
            out.append(0.2)
        else:
            out.append(0.0)
    return out
