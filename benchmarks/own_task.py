"""A registered task's first revision on the built-in base: its held-out gain over the bare base, without servers.

For any task a spec defines (`--tasks DIR` registers a user's folder), the main job's first wave without the
servers: a policy of the built-in recipe (`recipe_spec`: its spec's rank and replay of the tasks it guards, the
learning rate) trained `--steps` steps from a fresh adapter on the prompts a round draws from the task's train file,
scored by the task's own rewards (a user's reward in its process pool). Then greedy exact match against the `answer`
column on every held-out row (the gate's items), with the adapter and without it (the baseline, measured in the same
run), paired: exact two-sided McNemar. Then the gate's own decision (`mint_core.eval.gate.decide`, the lifecycle's
default policy: a significant gain on the task, and the guards its spec declares non-inferior, on the first
`--guard-items` held-out rows of each other registered task, whose changes are reported either way) on those
paired answers. The lifecycle reads the same test from lm-eval on the same
rows (the main job prints it).

    python benchmarks/own_task.py --tasks examples/sums-over-100 --task sums-over-100 [--steps 300] [--seed 0]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see mint_app/cli/app.py train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, report

from mint_core.data.spec import TASK_DIRS_ENV, registry
from mint_core.eval.gate import GatePolicy, SuiteScore, decide, discordant, mcnemar_p
from mint_core.lifecycle.prompts import load_prompts, with_replay
from mint_core.rl.builder import load_trainer, recipe_spec
from mint_core.rl.constants import BUILTIN_PROMPTS_PER_STEP, BUILTIN_RECIPE, BUILTIN_STEPS
from mint_core.rl.evaluate import heldout_correct
from mint_core.rl.recipe import TrainingRun


def _mean(xs: list[bool]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("data/base"))
    ap.add_argument("--tasks", type=Path, action="append", default=[], help="a task folder to register")
    ap.add_argument("--task", help="the registered task's name (required)")
    ap.add_argument("--steps", type=int, default=BUILTIN_STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument(
        "--guard-items", type=int, default=320, help="held-out rows of each other task (the gate's)"
    )
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    if not args.task:
        ap.error("--task is required: the name of a registered task (mint task list)")
    have = [d for d in os.environ.get(TASK_DIRS_ENV, "").split(":") if d]
    os.environ[TASK_DIRS_ENV] = ":".join([*have, *(str(d.resolve()) for d in args.tasks)])
    task = registry().get(args.task)
    spec = recipe_spec(task.name, task.name, rank=args.rank)
    trainer = load_trainer(args.base, [spec], BUILTIN_RECIPE, args.seed, {task.name: None}, device=device)
    n = args.steps * BUILTIN_PROMPTS_PER_STEP
    data = Path("data/tasks")
    prompts, source = load_prompts(task.name, n, args.seed, data, "r1")
    prompts = with_replay(task.name, prompts, spec.replay, args.seed, data, "r1")
    heldout = task.heldout_rows()
    before = heldout_correct(trainer.engine, None, heldout)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as ckpt:
        run = TrainingRun.start(
            trainer, {task.name: prompts}, args.steps, BUILTIN_PROMPTS_PER_STEP, Path(ckpt), 0, resume=False
        )
        run.train()
    seconds = time.perf_counter() - t0
    after = heldout_correct(trainer.engine, task.name, heldout)
    b, c = discordant(after, before)
    others = [t for t in registry().names() if t != task.name]
    cand, base = (
        [SuiteScore(name=task.name, score=_mean(after), n=len(after), correct=after)],
        [SuiteScore(name=task.name, score=_mean(before), n=len(before), correct=before)],
    )
    for other in others:
        items = registry().get(other).heldout_rows()[: args.guard_items]
        for side, adapter in ((cand, task.name), (base, None)):
            got = heldout_correct(trainer.engine, adapter, items)
            side.append(SuiteScore(name=other, score=_mean(got), n=len(got), correct=got))
    decision = decide(GatePolicy(suite=task.name), cand, base, baseline="base")
    guards = {
        ch.name: round(ch.stats.effect, 4)
        for ch in decision.checks
        if ch.name.startswith("guard:") and ch.stats
    }
    not_guards = {ch.name: round(ch.stats.effect, 4) for ch in decision.side_effects() if ch.stats}
    report(
        {
            "benchmark": "own_task",
            "task": task.name,
            "spec": str(task.path),
            "prompts": source,
            "rank": spec.rank,
            "steps": args.steps,
            "seed": args.seed,
            "n": len(heldout),
            "base": round(sum(before) / len(heldout), 4),
            "revision": round(sum(after) / len(heldout), 4),
            "gain": round((sum(after) - sum(before)) / len(heldout), 4),
            "p_value": float(f"{mcnemar_p(b, c):.3g}"),
            "fixed": b,
            "broken": c,
            "train_s": round(seconds, 1),
            "gate": "pass" if decision.passed else "fail",
            "gate_failed": [ch.name for ch in decision.failed()],
            "guards": guards,
            "not_guards": not_guards,
        }
    )


if __name__ == "__main__":
    main()
