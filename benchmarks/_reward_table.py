"""The reward table the routing benchmark replays: every held-out prompt of the registered tasks, and a paraphrase
of each, answered greedily by every served arm (the bare base, each task's policy, older revisions, decoys) and
by the revisions the replay swaps in, scored by each task's own rewards (its spec's, `Rewarder`).

The arms are trained here with mint's own GRPO recipe on the built-in base (no download: the base and the task
data are the DVC outputs under data/), in one multi-policy run:
- one specialist policy per task (`recipe_spec`, with no replay of other tasks: a catalog's policies are
  specialists, so the task's policy is worth routing to and another task's is not);
- an older, weaker revision of some of them (the same policy's adapter after `old_steps` steps), served beside
  the champion as `<task>-v1`;
- decoys named like real policies: `<task>-expert`, trained on another task; `<task>-pro`, a random LoRA;
- revisions that only the online replay serves: each task's policy with noise added to its B factors
  (`<task>@regressed`, a revision that regresses) and its older revision (`<task>@v1`, the revision a better one
  replaces).

Greedy decoding, so the table is a pure function of its inputs; it is cached under a folder named by a digest of
them (the base's and the task files' bytes, the settings, this file's source), so a rerun reads it back.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mint_core.data.generators import Example
from mint_core.data.spec import prompt_text, registry

TABLE_FORMAT = 2
"""Bumped whenever the table's layout or the way it is built changes (part of the cache key, which otherwise
holds the settings and the bytes of the base and the task files)."""

BASE_ARM = "base"
"""The bare base's arm: every router may answer with no adapter."""

_PROMPT = re.compile(r"^(?P<verb>[A-Za-z][\w-]*):\s*(?P<arg>.*?)\s*=\s*$", re.S)

PARAPHRASES = (
    " {verb}: {arg} =",
    "{verb}:  {arg} =",
    "{verb} : {arg} =",
    "{verb}:\t{arg} =",
    "# {verb}: {arg} =",
    "{verb}: {arg}  =",
    "to {verb}: {arg} =",
    "{verb} it: {arg} =",
)
"""Wordings of a `verb: arg =` prompt that no task's data uses: the same answer is right, and a router trained on
the original wording never saw them. Spacing and small additions: the built-in base answers these some of the
time (0.15-0.6 exact on the bare base), and rewordings beyond them (another verb, a capital, a question mark) not
at all, which would leave every arm tied at zero. A prompt of another shape is wrapped instead (`_GENERIC`)."""

_GENERIC = ("please answer: {prompt}", "{prompt} ", "Q: {prompt}")


@dataclass(frozen=True)
class TableConfig:
    """What the table is built from; every field is part of its cache key."""

    base: Path = Path("data/base")
    data: Path = Path("data/tasks")
    tasks: tuple[str, ...] = ()
    """Registered tasks (empty: every registered task)."""
    steps: int = 300
    """GRPO steps of each task's policy (its champion). At most a task's train rows / 16 prompts a step (312 for
    the built-in tasks' 5,000): each step reads fresh prompts."""
    learning_rate: float = 2e-3
    """The GRPO rate (for rank 8; `recipe_spec` scales it for a spec's other rank), decayed linearly to 0 over
    `steps`: twice the recipe's `BUILTIN_RECIPE.learning_rate`, for a catalog whose specialists are clearly
    better than the base on their own task (see docs/routing.md)."""
    rank: int | None = None
    """LoRA rank of every policy (None: each task's spec's `recipe.rank`, else the recipe's default)."""
    old_steps: int = 30
    """Steps of the older revision (`<task>-v1`, `<task>@v1`)."""
    old_tasks: int = 3
    """How many tasks also serve their older revision as an arm."""
    heldout: int = 200
    """Held-out prompts per task (each also paraphrased)."""
    seed: int = 0
    decoy_scale: float = 0.2
    """Standard deviation of a random decoy's B factors."""
    regress_scale: float = 0.1
    """Standard deviation of the noise added to a policy's B factors for its regressed revision."""
    device: str = "cpu"


@dataclass
class RewardTable:
    """Rewards of every prompt (rows) under every column (a served arm, or a revision the replay swaps in)."""

    prompts: list[str]
    tasks: list[str]
    """The task each prompt belongs to (its reward's)."""
    wording: list[str]
    """"heldout" (the task's own wording) or "paraphrase"."""
    source: list[int]
    """Row of the held-out prompt a paraphrase rewrites (its own row for a held-out prompt)."""
    columns: list[str]
    rewards: np.ndarray
    """float32, rows x columns, in [0, 1]."""
    arms: list[str]
    """The columns served as arms (the rest are revisions only the online replay serves)."""
    claims: dict[str, str | None]
    """The task each arm is named for (what its cold start reads; a decoy claims the task its name says)."""
    revisions: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per arm, its other revisions' columns: {"v1": column, "regressed": column}."""
    meta: dict[str, Any] = field(default_factory=dict)

    def column(self, name: str) -> np.ndarray:
        return self.rewards[:, self.columns.index(name)]

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "rewards.npy", self.rewards)
        rest = {k: v for k, v in asdict(self).items() if k != "rewards"}
        (folder / "table.json").write_text(json.dumps(rest, indent=1, sort_keys=True))

    @classmethod
    def load(cls, folder: Path) -> RewardTable:
        rest = json.loads((folder / "table.json").read_text())
        return cls(rewards=np.load(folder / "rewards.npy"), **rest)


def paraphrase(ex: Example, k: int) -> Example:
    """`ex` in the `k`th wording of PARAPHRASES (the last user message of a chat prompt), the same answer right."""

    def reword(text: str) -> str:
        m = _PROMPT.match(text)
        if m is None:
            return _GENERIC[k % len(_GENERIC)].format(prompt=text)
        verb, arg = m["verb"], m["arg"]
        return PARAPHRASES[k % len(PARAPHRASES)].format(verb=verb, VERB=verb.upper(), arg=arg)

    if isinstance(ex.prompt, str):
        prompt: Any = reword(ex.prompt)
    else:
        msgs = [dict(m) for m in ex.prompt]
        last = max(i for i, m in enumerate(msgs) if m.get("role") == "user")
        msgs[last]["content"] = reword(msgs[last]["content"])
        prompt = msgs
    return Example(id=f"{ex.id}~p{k}", task=ex.task, prompt=prompt, answer=ex.answer, columns=ex.columns)


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def cache_key(cfg: TableConfig) -> str:
    """A digest of everything the table is a function of."""
    tasks = cfg.tasks or tuple(registry().names())
    files = [p for p in Path(cfg.base).iterdir() if p.is_file() and p.name != "metrics.json"]
    for t in tasks:
        spec = registry().get(t)
        files += [Path(spec.path), Path(spec.resolve(spec.data.heldout)), Path(spec.resolve(spec.data.train))]
    h = hashlib.sha256()
    parts = {**asdict(cfg), "tasks": tasks, "base": "", "data": ""}  # where they are is not what they are
    h.update(json.dumps({"format": TABLE_FORMAT, "cfg": parts}, sort_keys=True, default=str).encode())
    h.update(_file_digest(files).encode())
    return h.hexdigest()[:16]


def progress(msg: str) -> None:
    """One progress line on stderr (stdout ends with the benchmark's JSON line)."""
    print(f"[reward table] {msg}", file=sys.stderr, flush=True)


def reward_table(cfg: TableConfig, cache: Path) -> RewardTable:
    """The table for `cfg`: read from `cache/<key>` when there, else built (minutes) and written there."""
    folder = cache / cache_key(cfg)
    if (folder / "table.json").is_file():
        progress(f"cached: {folder}")
        table = RewardTable.load(folder)
        table.meta["cache"] = str(folder)  # where it is now (a cache may move)
        return table
    table = build(cfg, folder / "adapters")
    table.meta["cache"] = str(folder)
    table.save(folder)
    progress(f"written: {folder}")
    return table


def _tasks(cfg: TableConfig) -> list[str]:
    names = list(cfg.tasks) or registry().names()
    if len(names) < 2:
        raise ValueError(f"routing needs at least two registered tasks; got {names}")
    return names


def _train(cfg: TableConfig, tasks: list[str], adapters: Path) -> tuple[Any, dict[str, Any]]:
    """Train every policy (the task specialists and the decoys trained on another task) in one run; the
    trainer and the weights of every trained column (champions, older revisions, decoys)."""
    import torch

    from mint_core.lifecycle.prompts import load_prompts
    from mint_core.rl.builder import load_trainer, recipe_spec
    from mint_core.rl.constants import BUILTIN_PROMPTS_PER_STEP, BUILTIN_RECIPE
    from mint_core.rl.recipe import TrainingRun

    # a decoy named for task i, trained on task i+1: good at the wrong task, cold-started on the named one
    decoy = {f"{t}-expert": tasks[(i + 1) % len(tasks)] for i, t in enumerate(tasks[:1])}
    named = [(t, t) for t in tasks] + list(decoy.items())
    specs = [
        recipe_spec(name, task, cfg.rank, cfg.learning_rate).model_copy(update={"replay": 0.0})
        for name, task in named
    ]
    n = cfg.steps * BUILTIN_PROMPTS_PER_STEP
    prompts = {s.name: load_prompts(s.task, n, cfg.seed, cfg.data, f"route-{s.name}")[0] for s in specs}
    recipe = BUILTIN_RECIPE.model_copy(update={"learning_rate": cfg.learning_rate})
    trainer = load_trainer(cfg.base, specs, recipe, cfg.seed, dict.fromkeys(prompts), device=cfg.device)
    weights: dict[str, Any] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as ckpt:
        run = TrainingRun.start(
            trainer, prompts, cfg.steps, BUILTIN_PROMPTS_PER_STEP, Path(ckpt), 0, resume=False
        )
        for step in range(1, cfg.steps + 1):
            stats = run.step()
            if step == cfg.old_steps:
                weights |= {f"{t}@v1": trainer.weights(t) for t in tasks[: cfg.old_tasks]}
            if step % 10 == 0 or step == cfg.steps:
                mean = {k: round(v, 2) for k, v in stats.reward.items() if v is not None}
                progress(
                    f"training step {step}/{cfg.steps} ({time.perf_counter() - t0:.0f} s), rollout reward {mean}"
                )
    weights |= {s.name: trainer.weights(s.name) for s in specs}
    gen = torch.Generator().manual_seed(cfg.seed)
    for t in tasks[: cfg.old_tasks]:
        weights[f"{t}@regressed"] = _noised(weights[t], cfg.regress_scale, gen)
    weights[f"{tasks[-1]}-pro"] = _noised(_zeroed(weights[tasks[0]]), cfg.decoy_scale, gen)
    for name, w in weights.items():
        _export(trainer, w, adapters / name.replace("@", "_at_"))
    return trainer, {"weights": weights, "decoys": decoy}


def _zeroed(w: Any) -> Any:
    """A revision of `w`'s shapes with zero factors (what a random decoy perturbs)."""
    import torch

    from mint_core.lora.adapter import AdapterWeights

    t = {s: (torch.zeros_like(a), torch.zeros_like(b)) for s, (a, b) in w.tensors.items()}
    return AdapterWeights(w.rank, w.alpha, t, w.base_fingerprint, w.base_name, dtype=w.dtype)


def _noised(w: Any, scale: float, gen: Any) -> Any:
    """`w` with Gaussian noise of standard deviation `scale` added to its B factors (and unit-variance A factors
    where its A is all zero), seeded by `gen`."""
    import torch

    from mint_core.lora.adapter import AdapterWeights

    out = {}
    for s, (a, b) in sorted(w.tensors.items()):
        if not a.abs().sum():
            a = torch.randn(a.shape, generator=gen, dtype=a.dtype) / a.shape[-1] ** 0.5
        out[s] = (a.clone(), b + scale * torch.randn(b.shape, generator=gen, dtype=b.dtype))
    return AdapterWeights(w.rank, w.alpha, out, w.base_fingerprint, w.base_name, dtype=w.dtype)


def _export(trainer: Any, w: Any, path: Path) -> None:
    """Write a column's revision in PEFT format (for `--e2e` serving and inspection); kept when there."""
    from mint_core.lora.adapter import save_adapter

    if not path.exists():
        save_adapter(w, path, trainer.engine.sites)


def _rows(cfg: TableConfig, tasks: list[str]) -> tuple[list[Example], list[str], list[int]]:
    """Held-out examples of every task (the first `heldout`), then a paraphrase of each."""
    held = [ex for t in tasks for ex in registry().get(t).heldout_rows()[: cfg.heldout]]
    para = [paraphrase(ex, int(hashlib.sha256(ex.id.encode()).hexdigest(), 16)) for ex in held]
    return held + para, ["heldout"] * len(held) + ["paraphrase"] * len(para), list(range(len(held))) * 2


def complete(engine: Any, column: str | None, examples: list[Example], logprobs: bool = False) -> list[Any]:
    """Greedy completions of `examples` under `column` (None: the bare base), each task's max_new_tokens, in
    chunks of 512; with `logprobs`, each completion's tokens' logprobs too (the tokens are the same)."""
    from mint_core.engine.chat import prompt_ids
    from mint_core.engine.engine import Request
    from mint_core.engine.sampling import SamplingParams

    out = []
    chunk = 512
    for i in range(0, len(examples), chunk):
        reqs = [
            Request(
                prompt_ids(engine.tokenizer, ex.prompt),
                column,
                SamplingParams(
                    max_tokens=registry().get(ex.task).generation.max_new_tokens, logprobs=logprobs
                ),
            )
            for ex in examples[i : i + chunk]
        ]
        out += engine.generate(reqs)
    return out


def build(cfg: TableConfig, adapters: Path) -> RewardTable:
    """Train the arms, answer every row with every column, score with each task's rewards."""
    import torch

    from mint_core.data.rewards import Rewarder
    from mint_core.engine.base import load_base
    from mint_core.engine.engine import Engine, EngineConfig

    torch.manual_seed(cfg.seed)
    tasks = _tasks(cfg)
    t0 = time.perf_counter()
    progress(f"training {len(tasks)} policies and a decoy for {cfg.steps} steps (cache miss)")
    trainer, trained = _train(cfg, tasks, adapters)
    weights = trained["weights"]
    old = tasks[: cfg.old_tasks]
    served = {t: t for t in tasks} | {f"{t}-v1": f"{t}@v1" for t in old}
    served |= {name: name for name in trained["decoys"]} | {f"{tasks[-1]}-pro": f"{tasks[-1]}-pro"}
    columns = [BASE_ARM, *sorted(weights)]
    del trainer  # its engine wraps the base's linears: the table's engine loads the base afresh
    engine = Engine(
        load_base(cfg.base, device=cfg.device),
        EngineConfig(max_loras=len(weights), max_lora_rank=max(w.rank for w in weights.values())),
    )
    for name, w in weights.items():
        engine.add_adapter(name, w)
    examples, wording, source = _rows(cfg, tasks)
    rewards = np.zeros((len(examples), len(columns)), dtype=np.float32)
    with Rewarder() as rewarder:
        for j, col in enumerate(columns):
            texts = [c.text for c in complete(engine, None if col == BASE_ARM else col, examples)]
            rewards[:, j] = rewarder.score(examples, texts)
            progress(
                f"answered {len(examples)} prompts with {col} ({j + 1}/{len(columns)}), "
                f"mean reward {rewards[:, j].mean():.3f} ({time.perf_counter() - t0:.0f} s)"
            )
    # served arms read their column; the replay's extra revisions are columns too
    arms = [BASE_ARM, *sorted(served)]
    rewards_by_arm = np.stack([rewards[:, columns.index(served.get(a, a))] for a in arms], axis=1)
    extra = [c for c in columns if "@" in c]
    claims: dict[str, str | None] = {BASE_ARM: None}
    for a in arms[1:]:
        claims[a] = next(t for t in sorted(tasks, key=len, reverse=True) if a == t or a.startswith(f"{t}-"))
    revisions = {t: {"v1": f"{t}@v1", "regressed": f"{t}@regressed"} for t in old}
    return RewardTable(
        prompts=[prompt_text(ex.prompt) for ex in examples],
        tasks=[ex.task for ex in examples],
        wording=wording,
        source=source,
        columns=arms + extra,
        rewards=np.concatenate([rewards_by_arm, rewards[:, [columns.index(c) for c in extra]]], axis=1),
        arms=arms,
        claims=claims,
        revisions=revisions,
        meta={
            "config": {k: str(v) for k, v in asdict(cfg).items()},
            "build_s": round(time.perf_counter() - t0, 1),
            "served_as": served,
            "decoys": {**trained["decoys"], f"{tasks[-1]}-pro": "random LoRA"},
        },
    )
