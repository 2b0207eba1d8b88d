"""Why a continuation from a champion loses (issue #33 item 1): the same figures, step by step, for a first wave
from the base and for the continuation from the champion it made.

One policy of a task, the built-in recipe (`recipe_spec`, `BUILTIN_RECIPE`, `BUILTIN_PROMPTS_PER_STEP`), no
servers. Wave 1 trains `--first-steps` steps from a fresh adapter, as the main job's first wave; its adapter is the
champion. Wave 2 continues `--steps` steps from it as `retrain` does today: the exported adapter alone (new AdamW
moments), the same learning rate and schedule, new prompts. Per step of each wave:

- `no_signal`: the share of the policy's GRPO groups whose rewards are all equal (zero advantage: no gradient);
- `update`: the norm of the step's change of the adapter's factors (A and B, all sites);
- `drift`: how far the adapter's weight delta (scale x B A, all sites) is from where the wave started (the champion,
  for wave 2), Frobenius norm;
- `kl_base`: the trainer's k3 estimate of the KL to the base on the sampled tokens;
- `grad_norm`: the gradient's norm before clipping;
- and every `--every` steps the probe: greedy exact match on the task's first `--probe` held-out rows (the gate's
  items), and `changed`: the share of them whose greedy answer differs from the wave's starting point (for wave 2,
  from the champion's: a behavioural distance to the champion).

Wave 2 runs twice from the same champion, on the same prompts and seed: as retrain did before issue #33 (rate share
1, no warmup), and with the continuation recipe (`mint_core.rl.builder.Continuation`). Prints a table per wave and a
JSON line with the waves' curves and their means (`cont_*`: the old way, `recipe_*`: the recipe).

    python benchmarks/continuation_diagnosis.py [--task add] [--tasks DIR] [--first-steps 300] [--steps 40]
        [--every 10] [--probe 320] [--seed 0] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see mint_app/cli/app.py train

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, report

from mint_core.data.spec import TASK_DIRS_ENV, registry
from mint_core.lifecycle.prompts import load_prompts, with_replay
from mint_core.lora.adapter import AdapterWeights, save_adapter
from mint_core.rl.builder import Continuation, load_trainer, recipe_spec
from mint_core.rl.constants import BUILTIN_PROMPTS_PER_STEP, BUILTIN_RECIPE
from mint_core.rl.evaluate import heldout_correct
from mint_core.rl.recipe import TrainingRun
from mint_core.rl.trainer import MultiPolicyTrainer

DATA = Path("data/tasks")


def factors(w: AdapterWeights) -> torch.Tensor:
    return torch.cat([t.float().flatten() for A, B in w.tensors.values() for t in (A, B)])


def delta(w: AdapterWeights) -> dict[str, torch.Tensor]:
    scale = w.alpha / w.rank
    return {s: scale * (B.float() @ A.float()) for s, (A, B) in w.tensors.items()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[s] - b[s]).pow(2).sum()) for s in a))


def greedy_answers(trainer: MultiPolicyTrainer, adapter: str | None, items: list[Any]) -> list[str]:
    from mint_core.engine.chat import prompt_ids
    from mint_core.engine.engine import Request
    from mint_core.engine.sampling import SamplingParams

    eng = trainer.engine
    params = SamplingParams(max_tokens=12)
    out = eng.generate([Request(prompt_ids(eng.tokenizer, e.prompt), adapter, params) for e in items])
    return [c.text.strip() for c in out]


def wave(
    trainer: MultiPolicyTrainer,
    name: str,
    prompts: list[Any],
    steps: int,
    every: int,
    probe: list[Any],
    ckpt: Path,
) -> dict[str, Any]:
    start_w = trainer.weights(name)
    start_delta = delta(start_w)
    start_answers = greedy_answers(trainer, name, probe)
    prev = factors(start_w)
    rows: list[dict[str, Any]] = []
    curve = [(0, sum(heldout_correct(trainer.engine, name, probe)) / len(probe), 0.0)]
    run = TrainingRun.start(trainer, {name: prompts}, steps, BUILTIN_PROMPTS_PER_STEP, ckpt, 0, resume=False)
    for _ in range(steps):
        st = run.step()
        w = trainer.weights(name)
        now = factors(w)
        extra = st.extra.get(name) or {}
        rows.append(
            {
                "step": st.step,
                "reward": st.reward.get(name),
                "no_signal": extra.get("no_signal"),
                "update": float((now - prev).norm()),
                "drift": distance(delta(w), start_delta),
                "kl_base": extra.get("kl"),
                "grad_norm": extra.get("grad_norm"),
            }
        )
        prev = now
        if st.step % every == 0 or st.step == steps:
            answers = greedy_answers(trainer, name, probe)
            right = sum(a == e.answer for a, e in zip(answers, probe, strict=True)) / len(probe)
            changed = sum(a != b for a, b in zip(answers, start_answers, strict=True)) / len(probe)
            curve.append((st.step, right, changed))
    return {"rows": rows, "probe": curve}


def mean(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.fmean(xs), 5) if xs else None


def show(label: str, w: dict[str, Any]) -> None:
    print(f"\n{label}")
    print(f"{'step':>5} {'reward':>7} {'no_signal':>9} {'update':>8} {'drift':>8} {'kl_base':>8} {'grad':>7}")
    for r in w["rows"]:
        if r["step"] % 10 == 0 or r["step"] <= 3:
            cells = [
                r[k] if r[k] is not None else float("nan") for k in ("reward", "no_signal", "update", "drift")
            ]
            kl = r["kl_base"] if r["kl_base"] is not None else float("nan")
            g = r["grad_norm"] if r["grad_norm"] is not None else float("nan")
            print(
                f"{r['step']:>5} {cells[0]:>7.3f} {cells[1]:>9.3f} {cells[2]:>8.4f} {cells[3]:>8.4f} {kl:>8.4f} {g:>7.3f}"
            )
    print(
        "probe (step, right, changed from the wave's start): "
        + ", ".join(f"{s}:{r:.3f}/{c:.3f}" for s, r, c in w["probe"])
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("data/base"))
    ap.add_argument("--tasks", type=Path, action="append", default=[], help="a task folder to register")
    ap.add_argument("--task", default="add")
    ap.add_argument("--first-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--probe", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    have = [d for d in os.environ.get(TASK_DIRS_ENV, "").split(":") if d]
    os.environ[TASK_DIRS_ENV] = ":".join([*have, *(str(d.resolve()) for d in args.tasks)])
    task = registry().get(args.task)
    probe = task.heldout_rows()[: args.probe]
    spec = recipe_spec(task.name, task.name)
    n1, n2 = args.first_steps * BUILTIN_PROMPTS_PER_STEP, args.steps * BUILTIN_PROMPTS_PER_STEP
    p1 = with_replay(
        task.name, load_prompts(task.name, n1, args.seed, DATA, "w1")[0], spec.replay, args.seed, DATA, "w1"
    )
    p2 = with_replay(
        task.name, load_prompts(task.name, n2, args.seed, DATA, "w2")[0], spec.replay, args.seed, DATA, "w2"
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainer = load_trainer(args.base, [spec], BUILTIN_RECIPE, args.seed, {task.name: None}, device=device)
        first = wave(trainer, task.name, p1, args.first_steps, args.every, probe, Path(tmp) / "w1")
        champion = Path(tmp) / "champion"
        save_adapter(trainer.weights(task.name), champion, trainer.engine.sites)
        del trainer
        conts = {}
        for label, recipe in (
            ("cont", Continuation(rate_scale=1.0, warmup_steps=0)),
            ("recipe", Continuation()),
        ):
            trainer = load_trainer(
                args.base,
                [spec],
                BUILTIN_RECIPE,
                args.seed + 1,
                {task.name: champion},
                device=device,
                continuation=recipe,
            )
            conts[label] = wave(trainer, task.name, p2, args.steps, args.every, probe, Path(tmp) / label)
            del trainer
    cont = conts["cont"]
    show(f"wave 1: {task.name} from the base, {args.first_steps} steps", first)
    show(
        f"wave 2: {task.name} from its champion, {args.steps} steps (fresh AdamW, the same rate and schedule)",
        cont,
    )
    recipe = Continuation()
    show(
        f"wave 2 with the continuation recipe: {recipe.rate_scale:g} of the rate, warmed up over "
        f"{recipe.warmup_steps} steps",
        conts["recipe"],
    )
    k = args.steps  # compare the continuation with the first wave's opening steps, the same count
    result: dict[str, Any] = {"benchmark": "continuation_diagnosis", "task": task.name, "n_probe": len(probe)}
    for label, w, rows in (
        ("first", first, first["rows"][:k]),
        ("first_all", first, first["rows"]),
        ("cont", cont, cont["rows"]),
        ("recipe", conts["recipe"], conts["recipe"]["rows"]),
    ):
        for key in ("no_signal", "update", "kl_base", "grad_norm", "reward"):
            result[f"{label}_{key}"] = mean(rows, key)
        result[f"{label}_drift_end"] = round(rows[-1]["drift"], 5)
        if label != "first_all":
            result[f"{label}_probe"] = [(s, round(r, 4), round(c, 4)) for s, r, c in w["probe"]]
    report(result)


if __name__ == "__main__":
    main()
