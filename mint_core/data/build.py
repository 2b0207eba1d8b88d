"""Write the task datasets and the pretraining corpus of the built-in base (the `task_data` DVC stage).

Layout of `out_dir`:

    train/<task>.jsonl      examples the base is pretrained on (and RL may sample from)
    heldout/<task>.jsonl    disjoint examples for evaluation (no prompt of train appears here)
    corpus.txt              every train example as one line: prompt + " " + answer + EOS, tasks interleaved
    manifest.json           what was asked for and what was written
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mint_core.data.generators import GENERATORS, Example, read_jsonl, split, write_jsonl

EOS = "<eos>"  # the byte tokenizer's end-of-sequence token, written literally in the corpus
TRAIN, HELDOUT, CORPUS = "train", "heldout", "corpus.txt"


class DataParams(BaseModel):
    """The `data:` section of params.yaml."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(default_factory=lambda: list(GENERATORS))
    n_train: int = Field(5000, ge=1)
    n_heldout: int = Field(450, ge=1)
    """Held-out examples per task: enough for a task's eval suite and its share of the guard (params.yaml's
    `eval_suites`); the same as params.yaml's `data.n_heldout`, which a unit test holds this default to."""
    seed: int = 0

    @field_validator("tasks")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in GENERATORS]
        if unknown or not v:
            raise ValueError(f"unknown tasks {unknown}; known: {', '.join(GENERATORS)}")
        return v


def render(example: Example, eos: str = EOS) -> str:
    """One corpus line: the prompt, then the answer as the model must produce it (leading space, EOS)."""
    return f"{example.prompt} {example.answer}{eos}"


def parse_line(line: str, eos: str = EOS) -> tuple[str, str]:
    """Inverse of `render`: (prompt, answer) with the answer's leading space and EOS removed."""
    body = line.rstrip("\n").removesuffix(eos)
    prompt, sep, answer = body.partition(" = ")
    if not sep:
        raise ValueError(f"not a corpus line (no ' = '): {line!r}")
    return prompt + " =", answer


def write_task_data(
    out_dir: str | Path, tasks: Sequence[str], n_train: int, n_heldout: int, seed: int
) -> dict[str, Any]:
    """Write train/held-out JSONL per task and the shuffled pretraining corpus; returns the manifest."""
    out = Path(out_dir)
    counts: dict[str, dict[str, int]] = {}
    train_all: list[Example] = []
    for name in tasks:
        train, heldout = split(name, n_train, n_heldout, seed)
        counts[name] = {
            TRAIN: write_jsonl(out / TRAIN / f"{name}.jsonl", train),
            HELDOUT: write_jsonl(out / HELDOUT / f"{name}.jsonl", heldout),
        }
        train_all.extend(train)
    random.Random(seed).shuffle(train_all)  # interleave tasks; reproducible
    n_lines = write_corpus(out / CORPUS, train_all)
    manifest = {
        "tasks": list(tasks),
        "n_train": n_train,
        "n_heldout": n_heldout,
        "seed": seed,
        "counts": counts,
        "corpus_lines": n_lines,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_corpus(path: Path, examples: Iterable[Example]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for ex in examples:
            f.write(render(ex) + "\n")
            n += 1
    return n


def read_corpus(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a corpus file, in file order."""
    with Path(path).open() as f:
        return [parse_line(line) for line in f if line.strip()]


def read_split(data_dir: str | Path, which: str = HELDOUT) -> dict[str, list[Example]]:
    """Every task's examples of one split (`train` or `heldout`), by task name."""
    d = Path(data_dir) / which
    if not d.is_dir():
        raise FileNotFoundError(f"no {which}/ directory under {data_dir}")
    return {p.stem: read_jsonl(p) for p in sorted(d.glob("*.jsonl"))}
