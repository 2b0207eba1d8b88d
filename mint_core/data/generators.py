"""The generators of the five built-in tasks' rows (synthetic, with verifiable answers: the built-in base is
pretrained on them, policies learn them), and the row itself (`Example`), as the task data files hold it.

Every example is a prompt `"<task>: <input> ="` and an answer `" <output>"` ending with the tokenizer's EOS.
Inputs are drawn by a seeded generator, so a task's train and held-out sets are reproducible; held-out sets use
a disjoint seed range and exclude every train prompt.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class Generator:
    """How a built-in task's rows are made and what a well-formed answer looks like."""

    name: str
    make: Callable[[random.Random], tuple[str, str]]  # rng -> (input, output)
    answer_pattern: str  # a well-formed answer matches this (the format reward)
    description: str
    miss: Callable[[str, str], str] = lambda inp, ans: ans
    """(input, right answer) -> the wrong answer a model typically gives (the guard group's log-likelihood items,
    `mint_core.eval.suites.near_miss`); the right answer itself where the task has no typical mistake."""


def _off_by_one(inp: str, ans: str) -> str:
    n = int(ans)
    return str(n + 1) if len(str(n + 1)) == len(ans) else str(n - 1)


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}", str(a + b)


def _word(rng: random.Random, lo: int = 3, hi: int = 7) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return w, w[::-1]


def _copy(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return w, w


def _upper(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return w, w.upper()


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 6)))
    return digits, "".join(sorted(digits))


GENERATORS: dict[str, Generator] = {
    t.name: t
    for t in (
        Generator("add", _add, r"\d{1,3}", "the sum of two numbers below 100", _off_by_one),
        # copied, not reversed; reversed, not copied; left in lower case; sorted the wrong way
        Generator(
            "reverse", _reverse, r"[a-z]{3,7}", "a lowercase word spelled backwards", lambda inp, ans: inp
        ),
        Generator("copy", _copy, r"[a-z]{3,7}", "a lowercase word repeated", lambda inp, ans: inp[::-1]),
        Generator("upper", _upper, r"[A-Z]{3,7}", "a lowercase word in capitals", lambda inp, ans: inp),
        Generator(
            "sort",
            _sort,
            r"\d{3,6}",
            "digits in ascending order",
            lambda inp, ans: "".join(sorted(inp, reverse=True)),
        ),
    )
}


Prompt = str | list[dict[str, str]]
"""Plain text, or chat messages ({role, content}) that the base's chat template renders."""


@dataclass(frozen=True)
class Example:
    """One row of a task: a prompt, the `answer` column (empty where the data has none; without the leading
    space or EOS), and every other column of the row, which the rewards see as keywords."""

    id: str
    task: str
    prompt: Prompt
    answer: str
    columns: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_json(self) -> str:
        doc: dict[str, Any] = {"id": self.id, "task": self.task, "prompt": self.prompt, "answer": self.answer}
        return json.dumps({**doc, "columns": self.columns} if self.columns else doc)


def has_generator(name: str) -> bool:
    """Whether a task's rows come from a generator here (the built-ins) rather than only from its spec's files."""
    return name in GENERATORS


def generator(name: str) -> Generator:
    if name not in GENERATORS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(GENERATORS)}")
    return GENERATORS[name]


def prompt_of(task_name: str, inp: str) -> str:
    return f"{task_name}: {inp} ="


def examples(task_name: str, seed: int, exclude: set[str] | None = None) -> Iterator[Example]:
    """An endless reproducible stream of distinct examples of one task (none whose prompt is in `exclude`)."""
    t = generator(task_name)
    rng = random.Random(f"{task_name}:{seed}")
    seen = set(exclude or ())
    i = 0
    misses = 0
    while True:
        inp, out = t.make(rng)
        prompt = prompt_of(task_name, inp)
        if prompt in seen:
            misses += 1
            if misses > 100_000:
                raise ValueError(f"task {task_name} has no more distinct prompts (seed {seed})")
            continue
        seen.add(prompt)
        yield Example(f"{task_name}-{seed}-{i}", task_name, prompt, out)
        i += 1


def take(stream: Iterable[Example], n: int) -> list[Example]:
    out: list[Example] = []
    for ex in stream:
        if len(out) == n:
            break
        out.append(ex)
    return out


def split(task_name: str, n_train: int, n_heldout: int, seed: int) -> tuple[list[Example], list[Example]]:
    """Train and held-out sets of one task; no held-out prompt appears in train."""
    train = take(examples(task_name, seed), n_train)
    heldout = take(examples(task_name, seed + 1_000_003, exclude={str(e.prompt) for e in train}), n_heldout)
    return train, heldout


_SOLVERS: dict[str, Callable[[str], str]] = {
    "add": lambda inp: str(sum(int(x) for x in inp.split("+"))),
    "reverse": lambda inp: inp[::-1],
    "copy": lambda inp: inp,
    "upper": lambda inp: inp.upper(),
    "sort": lambda inp: "".join(sorted(inp)),
}
_PROMPT = re.compile(r"^(?P<task>[a-z]+): (?P<input>\S+) =$")
_INPUTS = {
    "add": r"\d{1,2}\+\d{1,2}",
    "reverse": "[a-z]+",
    "copy": "[a-z]+",
    "upper": "[a-z]+",
    "sort": r"\d+",
}


def example_of(prompt: str) -> Example | None:
    """The built-in task example a prompt asks, with its answer, or None when the prompt is not one (any other
    text): what lets a server score its own answers to built-in tasks with the task's reward."""
    m = _PROMPT.match(prompt.strip())
    if m is None or m["task"] not in _SOLVERS or not re.fullmatch(_INPUTS[m["task"]], m["input"]):
        return None
    return Example(f"served-{m['task']}", m["task"], prompt.strip(), _SOLVERS[m["task"]](m["input"]))


def is_well_formed(task_name: str, completion: str) -> bool:
    return re.fullmatch(generator(task_name).answer_pattern, completion.strip()) is not None


def write_jsonl(path: Path, rows: Iterable[Example]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for r in rows:
            f.write(r.to_json() + "\n")
            n += 1
    return n


def read_jsonl(path: Path) -> list[Example]:
    with Path(path).open() as f:
        return [Example(**json.loads(line)) for line in f if line.strip()]
