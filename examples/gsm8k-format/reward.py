"""A user's reward for GSM8K's format, in TRL's keyword convention: the completion's final answer (after `####`,
else its last number) is graded against the `answer` column's `#### N` with math-verify."""

from __future__ import annotations

import re
from typing import Any

from math_verify import parse, verify

FINAL = re.compile(r"####\s*(-?[0-9][0-9.,]*)")
NUMBER = re.compile(r"-?[0-9][0-9.,]*")


def _final(text: str) -> str | None:
    m = FINAL.search(text)
    if m:
        return m.group(1).replace(",", "").rstrip(".")
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def final_answer(
    prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any
) -> list[float | None]:
    """1.0 where the completion's final number equals the gold one (math-verify), else 0.0; None where the gold
    answer has no `#### N` (the row does not apply)."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        want = _final(gold) if "####" in gold else None
        if want is None:
            out.append(None)
            continue
        got = _final(text)
        try:
            out.append(float(got is not None and verify(parse(want), parse(got))))
        except Exception:  # math-verify's parser on a garbled number: not a right answer
            out.append(0.0)
    return out
