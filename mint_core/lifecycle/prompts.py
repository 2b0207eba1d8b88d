"""Which prompts a training run trains on: a round's seed, its prompts (the DVC task data, a generator, or a user
task's train file), the replay of the tasks its gate guards, and the data revision they make."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from mint_core.data.generators import Example, has_generator, read_jsonl, split
from mint_core.data.revision import data_rev
from mint_core.data.spec import registry as task_registry
from mint_core.lifecycle.errors import LifecycleError


def round_seed(seed: int, round_name: str | None) -> int:
    """The seed of one training round: derived from the run's seed and the round's name, so every round draws
    its own prompts, adapter initialisation and rollout samples, and rerunning a round draws the same again.
    Without a round, the seed itself."""
    if round_name is None:
        return seed
    digest = hashlib.sha256(f"{seed}:{round_name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def load_prompts(
    task: str, n: int, seed: int, data_dir: Path | None, round_name: str | None = None
) -> tuple[list[Example], str]:
    """`n` training examples of a task and where they came from: `data_dir/train/<task>.jsonl` (the DVC
    `task_data` output) when given, else generated from `seed`. Without a round, the first `n`; with one, `n`
    drawn without replacement by the round's seed (`round_seed`), in the order drawn: a new round trains on new
    prompts, the same round on the same ones. A task that no generator here makes (a user's spec) reads its
    spec's train file, wherever `data_dir` points: the first `n` rows (passes over the file when it has fewer),
    or, with a round, `n` in the order the round's seed shuffles them."""
    if not has_generator(task):
        spec = task_registry().get(task)
        rows = spec.train_rows()
        source = spec.resolve(spec.data.train)
        order = list(range(len(rows)))
        if round_name is not None:
            random.Random(round_seed(seed, round_name)).shuffle(order)
            source += f"#round={round_name}"
        return [rows[order[i % len(rows)]] for i in range(n)], source
    if data_dir is not None:
        path = Path(data_dir) / "train" / f"{task}.jsonl"
        if not path.is_file():
            raise LifecycleError(f"no training data for task {task!r} at {path} (run `dvc repro task_data`)")
        rows = read_jsonl(path)
        if len(rows) < n:
            raise LifecycleError(f"{path} has {len(rows)} examples; the run needs {n}")
        if round_name is None:
            return rows[:n], str(path)
        picked = random.Random(round_seed(seed, round_name)).sample(range(len(rows)), n)
        return [rows[i] for i in picked], f"{path}#round={round_name}"
    if round_name is None:
        return split(task, n, 0, seed)[0], f"generated:{task}:seed={seed}"
    rs = round_seed(seed, round_name)
    return split(task, n, 0, rs)[0], f"generated:{task}:seed={rs}"


def train_and_heldout(task: str, n: int, n_heldout: int, seed: int) -> tuple[list[Example], list[Example]]:
    """A standalone run's `n` train prompts and `n_heldout` held-out rows of a registered task (`mint train`): a
    generated task's distinct prompts at `seed` (ValueError when it has fewer); a user's task's train file
    (passes over it when it has fewer rows, shuffled by `seed`) and its held-out file's first rows."""
    if has_generator(task):
        return split(task, n, n_heldout, seed)
    spec = task_registry().get(task)
    train, _ = load_prompts(task, n, seed, None, round_name=f"train-{seed}")
    return train, spec.heldout_rows()[:n_heldout]


def with_replay(
    task: str,
    examples: list[Example],
    replay: float,
    seed: int,
    data_dir: Path | None,
    round_name: str | None = None,
) -> list[Example]:
    """`examples` with a `replay` share of them replaced by those of the tasks its gate guards (the spec's
    `gate.guards`; `PolicySpec.replay`), as
    evenly as the count allows, all drawn the way `load_prompts` draws (the train split: never an evaluated
    prompt), and shuffled by the round's seed so each step's slice carries about the same mix."""
    n_replay = round(len(examples) * replay)
    others = list(task_registry().get(task).gate.guards)
    if n_replay == 0 or not others:
        return examples
    mixed = list(examples[: len(examples) - n_replay])
    for i, other in enumerate(others):
        k = n_replay // len(others) + (i < n_replay % len(others))
        if k:
            mixed += load_prompts(other, k, seed, data_dir, round_name)[0]
    random.Random(round_seed(seed, round_name) + 1).shuffle(mixed)
    return mixed


def data_revision(data_dir: Path | None, sources: list[str], repo_root: Path = Path(".")) -> str:
    """`mint.data_rev` of a run: the DVC data revision when the prompts come from the DVC outputs (and
    dvc.lock is there), else a hash of the generated sources."""
    if data_dir is not None and (repo_root / "dvc.lock").is_file():
        return data_rev(repo_root)
    return "gen-" + hashlib.sha256("\n".join(sorted(sources)).encode()).hexdigest()[:12]
