"""GRPO learning on the built-in base: the first revision's held-out gain over the bare base, over several rounds.

The main job's first wave, without the servers: for each round (a seed), every policy trains from a fresh adapter
with the built-in recipe (`BUILTIN_RECIPE`, `BUILTIN_PROMPTS_PER_STEP` prompts per step, `--steps`), all policies
at once on one base, on the prompts that round draws from data/tasks/train (`load_prompts` with the round's name,
as the flows draw them). Then greedy exact match on the first `--heldout` items of data/tasks/heldout (the items
of the eval suites), with the adapter and without it (the baseline, measured in the same run), paired.

Figures, per policy (`<task>_...`): the base's score, the median and the smallest gain over the rounds, the largest
p-value (exact two-sided McNemar), and how many rounds met `--target` with p < 0.01; per round in `rounds`. With
`--guard K`, each round also holds `<task>_guard`: the adapter's effect on the next K held-out items of every task
(greedy exact match against the base's, per task and over all of them with its p-value), what the guard suite's
generation half sees.

    python benchmarks/grpo_learning.py [--tasks add,sort] [--rounds 3] [--steps 200] [--heldout 320]
        [--prompts-per-step 16] [--guard 64] [--set learning_rate=5e-4 --set rank=16 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see mint_app/cli/app.py train

import torch
import yaml
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, report

from mint_core.data.generators import read_jsonl
from mint_core.engine.base import load_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.eval.gate import discordant, mcnemar_p
from mint_core.eval.results import EVAL_LIMIT
from mint_core.lifecycle.prompts import load_prompts, round_seed
from mint_core.rl.builder import recipe_spec
from mint_core.rl.constants import BUILTIN_PROMPTS_PER_STEP, BUILTIN_RECIPE, BUILTIN_STEPS
from mint_core.rl.evaluate import heldout_correct
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe import TrainingRun
from mint_core.rl.trainer import MultiPolicyTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("data/base"))
    ap.add_argument("--data", type=Path, default=Path("data/tasks"))
    ap.add_argument("--tasks", default="add,sort")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--steps", type=int, default=BUILTIN_STEPS, help="GRPO steps (the first wave: BUILTIN_STEPS)"
    )
    ap.add_argument(
        "--heldout",
        type=int,
        default=EVAL_LIMIT,
        help="held-out items per task (the eval suites': EVAL_LIMIT)",
    )
    ap.add_argument(
        "--guard",
        type=int,
        default=0,
        help="also score each adapter on the next GUARD held-out items of every task in data/tasks (the items "
        "past the suites', as the guard suite's generation half takes them) against the base, paired per task",
    )
    ap.add_argument("--target", type=float, default=0.10, help="gain a round must reach (issue #16: +0.10)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a BUILTIN_RECIPE field (GRPOConfig, e.g. learning_rate=5e-4) or a PolicySpec field "
        "(rank, default each task's recipe_spec rank; alpha, default 2 x rank; reward); repeatable",
    )
    ap.add_argument("--prefix", default="bench", help="rounds are named <prefix>-0, <prefix>-1, ...")
    ap.add_argument("--prompts-per-step", type=int, default=BUILTIN_PROMPTS_PER_STEP)
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    torch.set_num_threads(args.threads)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    heldout = {t: read_jsonl(args.data / "heldout" / f"{t}.jsonl")[: args.heldout] for t in tasks}
    few = {t: len(items) for t, items in heldout.items() if len(items) < args.heldout}
    if few:
        ap.error(f"--heldout {args.heldout}: data/tasks/heldout has fewer items for {few}")
    if args.guard < 0:
        ap.error(f"--guard {args.guard}: must be 0 (off) or more")
    guard_items = _guard_items(args.data, args.heldout, args.guard)
    short = {g: len(items) for g, items in guard_items.items() if len(items) < args.guard}
    if short:
        ap.error(
            f"--guard {args.guard} past --heldout {args.heldout}: too few held-out items for {short} "
            f"(lower either, or build more held-out items: params.yaml data.n_heldout)"
        )
    k = args.prompts_per_step
    grpo, spec_fields = _overrides(ap, args.set)
    engine = Engine(
        load_base(args.base, device=device),
        # each round's policies get slots of their own (named <task>-<round>), so every round starts fresh
        EngineConfig(
            max_loras=len(tasks) * args.rounds,
            max_lora_rank=max(s.rank for s in _specs(tasks, "x", grpo, spec_fields)),
            max_model_len=128,
        ),
    )
    base = {t: heldout_correct(engine, None, heldout[t]) for t in tasks}
    guard_base = {g: heldout_correct(engine, None, items) for g, items in guard_items.items()}
    rounds = []
    for r in range(args.rounds):
        name = f"{args.prefix}-{r}"
        prompts = {f"{t}-{r}": load_prompts(t, k * args.steps, 0, args.data, name)[0] for t in tasks}
        specs = _specs(tasks, str(r), grpo, spec_fields)
        trainer = MultiPolicyTrainer(engine, grpo, specs, seed=round_seed(0, name))
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            TrainingRun.start(trainer, prompts, args.steps, k, Path(tmp), checkpoint_every=0).train()
        row: dict[str, object] = {"round": name, "train_s": round(time.perf_counter() - t0, 1)}
        for t in tasks:
            now = heldout_correct(engine, f"{t}-{r}", heldout[t])
            gained, lost = discordant(now, base[t])
            row[t] = {
                "gain": (gained - lost) / len(now),
                "p": mcnemar_p(gained, lost),
                "gained": gained,
                "lost": lost,
            }
            if guard_items:
                row[f"{t}_guard"] = _guard_row(engine, f"{t}-{r}", guard_items, guard_base)
        print(row, flush=True)
        rounds.append(row)
    out: dict[str, object] = {
        "rounds": rounds,
        "steps": args.steps,
        "heldout": args.heldout,
        "overrides": args.set,
    }
    for t in tasks:
        gains = [r[t]["gain"] for r in rounds]  # type: ignore[index]
        ps = [r[t]["p"] for r in rounds]  # type: ignore[index]
        out[f"{t}_base"] = sum(base[t]) / len(base[t])
        out[f"{t}_gain_median"] = statistics.median(gains)
        out[f"{t}_gain_min"] = min(gains)
        out[f"{t}_p_max"] = max(ps)
        out[f"{t}_rounds_meeting_target"] = sum(
            g >= args.target and p < 0.01 for g, p in zip(gains, ps, strict=True)
        )
    report(out)


def _guard_items(data: Path, start: int, n: int) -> dict[str, list[Any]]:
    """Held-out items [start, start + n) of every task that has held-out data (empty when n is 0)."""
    if n <= 0:
        return {}
    files = sorted((data / "heldout").glob("*.jsonl"))
    return {f.stem: read_jsonl(f)[start : start + n] for f in files}


def _guard_row(
    engine: Engine, adapter: str, items: dict[str, list[Any]], base: dict[str, list[bool]]
) -> dict[str, object]:
    """The adapter's greedy exact match on every task's guard items against the base's: per task the effect
    (adapter - base), and over all of them the effect and the paired p-value."""
    row: dict[str, object] = {}
    gained_all = lost_all = n_all = 0
    for g, got in items.items():
        now = heldout_correct(engine, adapter, got)
        gained, lost = discordant(now, base[g])
        row[g] = round((gained - lost) / len(now), 4)
        gained_all, lost_all, n_all = gained_all + gained, lost_all + lost, n_all + len(now)
    row["all"] = round((gained_all - lost_all) / n_all, 4)
    row["all_p"] = mcnemar_p(gained_all, lost_all)
    return row


def _specs(tasks: list[str], suffix: str, grpo: GRPOConfig, fields: dict[str, Any]) -> list[PolicySpec]:
    """The round's policies `<task>-<suffix>` as the main job makes them (`recipe_spec`: each task's rank, alpha
    2 x rank, the rate scaled to it), then the `--set` PolicySpec fields."""
    out = []
    for t in tasks:
        spec = recipe_spec(f"{t}-{suffix}", t, fields.get("rank"), grpo.learning_rate)  # alpha 2 x rank
        out.append(PolicySpec.model_validate({**spec.model_dump(), **fields}))
    return out


def _overrides(ap: argparse.ArgumentParser, pairs: list[str]) -> tuple[GRPOConfig, dict[str, Any]]:
    """`--set KEY=VALUE` pairs split into the recipe (GRPOConfig fields, validated) and PolicySpec fields."""
    recipe: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            ap.error(f"--set {pair!r}: expected KEY=VALUE")
        value = yaml.safe_load(raw)
        if key in GRPOConfig.model_fields:
            recipe[key] = value
        elif key in PolicySpec.model_fields and key not in ("name", "task"):
            spec[key] = value
        else:
            ap.error(f"--set {key}: not a GRPOConfig or PolicySpec field")
    try:
        grpo = GRPOConfig.model_validate({**BUILTIN_RECIPE.model_dump(), **recipe})
        PolicySpec(name="x", task="add", **spec)
    except ValidationError as e:
        ap.error(f"--set: {e}")
    return grpo, spec


if __name__ == "__main__":
    main()
