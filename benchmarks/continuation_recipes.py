"""Continuation recipes from one champion, side by side (issue #33): does any of them gain past it?

Each variant continues the champion adapter `--champion` (a PEFT directory, e.g. one `learning_curves.py --keep`
saved) for `--steps` GRPO steps with the built-in recipe and the variant's changes, on fresh prompts of the task
(none of the gate's, eval suites' or probes'), with the built-in replay. Then greedy exact match on the gate's first
320 held-out items against the champion's, paired: the gain, how many items were fixed and broken, exact McNemar p.
A variant is a JSON object of `GRPOConfig` fields, plus `rate_scale` and `warmup` (the continuation recipe) and
`pps` (prompts per step); `--from-base` trains a first revision instead (no champion).

    python benchmarks/continuation_recipes.py --task add --champion DIR [--steps 100] [--jobs 2]
        [--variant '{"rate_scale": 0.25}' ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see mint_app/cli/app.py train

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import add_device, checked_device, report

from mint_core.data.generators import read_jsonl
from mint_core.data.revision import evaluated_prompts, fresh_examples
from mint_core.eval.gate import discordant, mcnemar_p
from mint_core.eval.results import EVAL_LIMIT
from mint_core.eval.suites import SUITES_DIR
from mint_core.lifecycle.prompts import round_seed, with_replay
from mint_core.rl.builder import Continuation, load_trainer, recipe_spec
from mint_core.rl.constants import BUILTIN_RECIPE
from mint_core.rl.evaluate import heldout_correct
from mint_core.rl.recipe import TrainingRun

DEFAULT_VARIANTS = [
    {"rate_scale": 0.25},
    {"rate_scale": 0.5},
    {"rate_scale": 1.0},
    {"rate_scale": 0.5, "temperature": 1.0},
    {"rate_scale": 0.5, "greedy_in_group": True},
    {"rate_scale": 0.5, "pps": 64, "steps": 50},
]


def run_variant(args: argparse.Namespace, variant: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    kw = dict(variant)
    steps = int(kw.pop("steps", args.steps))
    pps = int(kw.pop("pps", 16))
    cont = Continuation(rate_scale=kw.pop("rate_scale", 0.25), warmup_steps=kw.pop("warmup", 10))
    grpo = BUILTIN_RECIPE.model_copy(update=kw)
    gate = read_jsonl(args.data / "heldout" / f"{args.task}.jsonl")[:EVAL_LIMIT]
    spec = recipe_spec(args.task, args.task)
    seed = round_seed(args.seed, "continuation-recipes")
    parent = None if args.from_base else args.champion
    trainer = load_trainer(
        args.base, [spec], grpo, seed, {args.task: parent}, device=args.device, continuation=cont
    )
    before = heldout_correct(trainer.engine, args.task if parent else None, gate)
    evaluated = evaluated_prompts(args.data, SUITES_DIR / "data")
    examples = fresh_examples(args.task, pps * steps, seed, evaluated)
    prompts = {
        args.task: with_replay(args.task, examples, spec.replay, seed, args.data, "continuation-recipes")
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run = TrainingRun.start(trainer, prompts, steps, pps, Path(tmp), 0)
        run.train()
    after = heldout_correct(trainer.engine, args.task, gate)
    fixed, broken = discordant(after, before)
    return {
        "variant": variant,
        "before": round(sum(before) / len(gate), 4),
        "after": round(sum(after) / len(gate), 4),
        "gain": round((fixed - broken) / len(gate), 4),
        "fixed": fixed,
        "broken": broken,
        "p": float(f"{mcnemar_p(fixed, broken):.4g}"),
        "train_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("data/base"))
    ap.add_argument("--data", type=Path, default=Path("data/tasks"))
    ap.add_argument("--task", default="add")
    ap.add_argument("--champion", type=Path)
    ap.add_argument("--from-base", action="store_true", help="a first revision: no champion")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--variant", action="append", type=json.loads, help="a JSON object (default: six recipes)"
    )
    add_device(ap)
    args = ap.parse_args()
    checked_device(ap, args.device)
    if not args.from_base and (args.champion is None or not args.champion.is_dir()):
        ap.error("--champion DIR (a PEFT adapter directory) or --from-base")
    variants = args.variant or DEFAULT_VARIANTS
    with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(variants))) as pool:
        rows = pool.starmap(run_variant, [(args, v) for v in variants])
    print(f"{'variant':60s} {'before':>7} {'after':>7} {'gain':>7} {'fixed':>5} {'broken':>6} {'p':>8}")
    for r in rows:
        print(
            f"{json.dumps(r['variant']):60s} {r['before']:7.3f} {r['after']:7.3f} {r['gain']:+7.3f} "
            f"{r['fixed']:5d} {r['broken']:6d} {r['p']:8.3g}"
        )
    report({"benchmark": "continuation_recipes", "task": args.task, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
