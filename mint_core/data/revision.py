"""Which data a training run or a revision was built from: the `mint.data_rev` it records.

`data_rev(repo_root)` is a short hash of the outputs that `dvc.lock` pins: for every stage, each output's path
and content hash (md5 of a file, or of a directory listing). So it names the data itself, not how it was made:
a lock whose outputs are byte-for-byte the same gives the same revision even if a command or a code dependency
changed around them, and any rebuilt output that came out different gives a new one. It reads the lock as it is
on disk (committed or not); `dvc status` says whether the working tree still matches it, and
`git log -- dvc.lock` finds the commit that introduced a revision.

Training need not read its prompts from those files: a round can draw fresh ones from the task generators
(`fresh_examples`), named by the round's seed beside the data revision, and watch its progress on a small fixed
probe set (`probe_examples`). Neither ever holds a prompt that evaluation reads (`evaluated_prompts`: the
held-out split and the eval suites' items), so evaluation stays honest whatever a round draws.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from mint_core.data.build import HELDOUT, TRAIN, read_split
from mint_core.data.generators import Example, examples, has_generator, read_jsonl, take
from mint_core.data.spec import prompt_text, registry

DATA_REV_TAG = "mint.data_rev"
"""Tag (MLflow run and model version) holding the data revision."""
DATA_REV_CHARS = 12
PROBE_SEED = 7_000_001
"""Generator seed of the probe sets (`probe_examples`): fixed, so every round probes the same items. Far from the
seeds of the DVC splits (`params.yaml` data.seed and held-out's seed + 1_000_003); the probe excludes their
prompts anyway."""


def lock_outputs(repo_root: str | Path = ".") -> dict[str, dict[str, str]]:
    """Every stage's outputs in dvc.lock: stage -> output path -> content hash."""
    lock = Path(repo_root) / "dvc.lock"
    if not lock.is_file():
        raise FileNotFoundError(f"no dvc.lock in {Path(repo_root).resolve()}: run `dvc repro` first")
    doc = yaml.safe_load(lock.read_text()) or {}
    stages: dict[str, Any] = doc.get("stages") or {}
    return {
        name: {out["path"]: _content_hash(out) for out in (stage or {}).get("outs", [])}
        for name, stage in sorted(stages.items())
    }


def data_rev(repo_root: str | Path = ".") -> str:
    """A short hash (12 hex digits) of dvc.lock's stage outputs and their content hashes."""
    canonical = json.dumps(lock_outputs(repo_root), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:DATA_REV_CHARS]


def _content_hash(out: dict[str, Any]) -> str:
    kind = out.get("hash", "md5")  # DVC 3 names the algorithm, then stores the value under that key
    for key in (kind, "md5", "etag", "checksum"):
        if out.get(key):
            return f"{key}:{out[key]}"
    # no content hash (an output never built): its whole entry, so that building it changes the revision
    return json.dumps(out, sort_keys=True, default=str)


# ---- fresh draws and probes ---------------------------------------------------------------------------------


def evaluated_prompts(data_dir: str | Path, *more: str | Path) -> set[str]:
    """Every prompt that evaluation may read: those of `data_dir/heldout/*.jsonl` (the DVC `task_data` output)
    and of every JSONL row with a `prompt` in the directories `more` that exist (the eval suites' `data/`,
    whatever they were built from)."""
    out = {prompt_text(ex.prompt) for rows in read_split(data_dir, HELDOUT).values() for ex in rows}
    for d in more:
        for path in sorted(Path(d).glob("*.jsonl")):
            with path.open() as f:
                out.update(json.loads(line)["prompt"] for line in f if '"prompt"' in line)
    return out


def train_prompts(data_dir: str | Path, task: str) -> set[str]:
    """The prompts of `data_dir/train/<task>.jsonl` (the examples the built-in base was pretrained on); empty
    when there is no such file."""
    path = Path(data_dir) / TRAIN / f"{task}.jsonl"
    return {prompt_text(ex.prompt) for ex in read_jsonl(path)} if path.is_file() else set()


def probe_examples(task: str, n: int, exclude: set[str]) -> list[Example]:
    """A task's probe set: the first `n` examples of its generator at `PROBE_SEED` whose prompt is not in
    `exclude` (the evaluated prompts and the train split: the probe asks what a policy does on prompts it was
    never trained on). The same arguments give the same items. A task with no generator (a spec's data files
    alone) sets the last `n` rows of its train file aside instead: `fresh_examples` never draws them."""
    if not has_generator(task):
        return _file_rows(task, exclude)[-n:] if n else []
    return take(examples(task, PROBE_SEED, exclude), n)


def fresh_examples(task: str, n: int, seed: int, exclude: set[str]) -> list[Example]:
    """`n` new training examples of a task from its generator with `seed` (a round's own), none whose prompt is
    in `exclude` (the evaluated prompts and the probe's). Not a fixed pool like the train split: each seed draws
    its own prompts from the whole task, and the same seed the same ones again."""
    if not has_generator(task):
        return _epochs(task, n, seed, exclude)
    try:
        return take(examples(task, seed, exclude), n)
    except ValueError as e:
        raise ValueError(
            f"cannot draw {n} fresh {task} prompts outside the {len(exclude)} excluded: {e}"
        ) from e


def _file_rows(task: str, exclude: set[str]) -> list[Example]:
    """A spec task's train rows whose prompt is not in `exclude`, in file order."""
    rows = [e for e in registry().get(task).train_rows() if prompt_text(e.prompt) not in exclude]
    if not rows:
        raise ValueError(f"task {task!r} has no train rows outside the {len(exclude)} excluded prompts")
    return rows


def _epochs(task: str, n: int, seed: int, exclude: set[str]) -> list[Example]:
    """`n` rows of a spec task's train file for a round: passes over the file (less the probe's rows, the last
    ones) in an order that the round's seed shuffles, so consecutive rounds see all of it before any row again;
    never a row whose prompt is in `exclude`."""
    import random

    spec_rows = registry().get(task).train_rows()
    pool = [e for e in spec_rows if prompt_text(e.prompt) not in exclude]
    if not pool:
        raise ValueError(
            f"task {task!r}: every train row is held out, probed or evaluated; nothing to train on"
        )
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    return [pool[order[i % len(pool)]] for i in range(n)]
