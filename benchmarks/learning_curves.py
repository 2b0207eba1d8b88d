"""Learning curves of nightly retraining on the built-in base: does a retrain keep paying, and where does it stop?

`--waves` waves (default 4) of `add`, `sort` and `reverse` (or any registered tasks: `--tasks-dir DIR` registers a
user's task folder), each wave continuing from the champion the waves before it left (the first from a fresh
adapter, with the bare base as its champion; with `--first-steps`, that many steps and no early stop, as the main
job's first wave; or from `--from DIR/<task>`), as the `retrain`
deployment runs them, without the servers (the library directly, as benchmarks/grpo_learning.py does):
- the policies train at once over one base with the built-in recipe, `--steps` GRPO steps at most (retrain's
  `RETRAIN_STEPS`), each wave on fresh prompts drawn at its round's seed (`fresh_examples`: no held-out or
  eval-suite prompt, nor a probe item);
- a continuation trains with the continuation recipe (`Continuation`: warmed up over `--warmup` steps, at
  `--headroom-rate-scale` of the rate when its champion's pass@G exceeds its greedy answers by `--min-headroom`
  on the wave's own prompts, else `--rate-scale`), as every flow's continuation does; each row says what the
  champion measured and the share it trained at;
- early stopping as retrain's default (`EarlyStop`): a probe that falls below the wave's first beyond noise
  (paired McNemar p < `--fall-p`) stops the policy at once, not exported; a greedy probe on `--probe` items outside every split
  every `--every` steps, the rule of `Plateau` (no rise of `--min-delta` over step 0 in `--patience` probes:
  stop; `--stop-after-gain`: also at a plateau after a rise), one probe for a policy whose last candidates were
  rejected; a policy that stops without gain is skipped (no gate in the flow; here it is still scored, to check
  that the gate would have rejected it); `--no-early-stop` trains every step and says where the rule would
  have stopped;
- each policy trains with the built-in recipe's replay (`PolicySpec.replay`: a quarter of its prompts from the
  other tasks' train splits, `mint_core.lifecycle.prompts.with_replay`);
- the gate its task's spec declares (`GatePolicy(suite=task)`): greedy exact match on the first EVAL_LIMIT
  held-out items of every registered task (the items of their eval suites), candidate against champion, paired;
  promoted when the own gain is significant at alpha 0.05 and at least `min_effect` and no guarded task is
  worse beyond `task_guard_margin` (the pooled guard group, which reads log-likelihood items, is not run here);
  every other task's change is reported beside it (`not_guards`).

Every wave runs once per seed of `--seeds` (the round's seed: prompts, adapter initialisation, rollouts), the
seeds `--jobs` at a time, each in its own process on `--threads` threads. Prints one row per wave and task to
stderr as it goes, then a table per seed, a line that counts the continuations (waves from a champion, not the
base): those promoted, those promoted at p < 0.01, and the candidates significantly worse than their champion
(p < 0.05), then the JSON line: per seed and task the champion's score after each wave and the waves that
promoted, and every row (probe curve, steps spent, why it stopped, gain, p, decision).

    python benchmarks/learning_curves.py [--tasks add,sort,reverse] [--tasks-dir DIR] [--waves 4] [--steps 100]
        [--first-steps N] [--from DIR] [--min-headroom G] [--headroom-rate-scale S] [--seeds 0,1,2]
        [--jobs 2] [--every 10] [--patience 3] [--min-delta 0.025] [--probe 128] [--prompts-per-step 16]
        [--fall-p 0.05] [--rate-scale 0.25] [--warmup 10] [--stop-after-gain] [--no-early-stop]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
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

from flows.retrain import RETRAIN_STEPS
from mint_core.data.generators import Example
from mint_core.data.revision import evaluated_prompts, fresh_examples, probe_examples, train_prompts
from mint_core.data.spec import TASK_DIRS_ENV, prompt_text, registry
from mint_core.eval.early_stop import EarlyStop, Plateau, probe_gain
from mint_core.eval.gate import GatePolicy, SuiteScore, decide
from mint_core.eval.results import EVAL_LIMIT
from mint_core.eval.suites import SUITES_DIR
from mint_core.lifecycle.prompts import round_seed, with_replay
from mint_core.rl.builder import Continuation, load_trainer, recipe_spec
from mint_core.rl.constants import BUILTIN_PROMPTS_PER_STEP, BUILTIN_RECIPE
from mint_core.rl.evaluate import heldout_correct
from mint_core.rl.recipe import TrainingRun

DEFAULTS = EarlyStop()
CONTINUATION = Continuation()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("data/base"))
    ap.add_argument("--data", type=Path, default=Path("data/tasks"))
    ap.add_argument("--suites", type=Path, default=SUITES_DIR, help="eval suites (their data/ is left out)")
    ap.add_argument("--tasks", default="add,sort,reverse")
    ap.add_argument("--tasks-dir", type=Path, action="append", default=[], help="a task folder to register")
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--steps", type=int, default=RETRAIN_STEPS, help="most GRPO steps a wave (RETRAIN_STEPS)")
    ap.add_argument("--first-steps", type=int, help="most steps of a wave from the base (default: --steps)")
    ap.add_argument("--from", dest="start", type=Path, help="start every task from the champion START/<task>")
    ap.add_argument("--prompts-per-step", type=int, default=BUILTIN_PROMPTS_PER_STEP)
    ap.add_argument("--every", type=int, default=DEFAULTS.every)
    ap.add_argument("--patience", type=int, default=DEFAULTS.patience)
    ap.add_argument("--min-delta", type=float, default=DEFAULTS.min_delta)
    ap.add_argument("--probe", type=int, default=DEFAULTS.probe_items, help="probe items per task")
    ap.add_argument("--after-rejections", type=int, default=DEFAULTS.after_rejections)
    ap.add_argument(
        "--stop-after-gain", action="store_true", help="also stop a policy at a plateau after a gain"
    )
    ap.add_argument("--no-early-stop", action="store_true", help="train every step (probes still recorded)")
    ap.add_argument("--heldout", type=int, default=EVAL_LIMIT, help="gate items per task (EVAL_LIMIT)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fall-p", type=float, default=DEFAULTS.fall_p, help="stop a probe that falls at this p")
    ap.add_argument(
        "--rate-scale", type=float, default=CONTINUATION.rate_scale, help="a continuation's rate share"
    )
    ap.add_argument(
        "--warmup", type=int, default=CONTINUATION.warmup_steps, help="a continuation's warmup steps"
    )
    ap.add_argument(
        "--min-headroom",
        type=float,
        default=CONTINUATION.min_headroom,
        help="pass@G - greedy from which a champion has headroom (negative: never measured)",
    )
    ap.add_argument(
        "--headroom-rate-scale",
        type=float,
        default=CONTINUATION.headroom_rate_scale,
        help="the rate share of a continuation with headroom",
    )
    ap.add_argument(
        "--headroom-warmup",
        type=int,
        default=CONTINUATION.headroom_warmup_steps,
        help="the warmup steps of a continuation with headroom",
    )
    ap.add_argument("--prefix", default="curve", help="rounds are named <prefix>-0, <prefix>-1, ...")
    ap.add_argument("--seeds", default="0,1,2", help="a run of every wave per seed (Training.seed)")
    ap.add_argument("--jobs", type=int, default=2, help="seeds run at once, each in its own process")
    ap.add_argument("--keep", type=Path, help="copy every promoted adapter to KEEP/seed<n>/<task>-w<wave>")
    add_device(ap)
    args = ap.parse_args()
    checked_device(ap, args.device)
    have = [d for d in os.environ.get(TASK_DIRS_ENV, "").split(":") if d]
    os.environ[TASK_DIRS_ENV] = ":".join([*have, *(str(d.resolve()) for d in args.tasks_dir)])
    if not (args.base / "config.json").is_file():
        ap.error(f"no built-in base at {args.base}: run `.venv/bin/dvc repro` first")
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    t_start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(args.jobs, len(seeds))) as pool:
        results = pool.starmap(run_seed, [(args, seed) for seed in seeds])
    tasks = results[0]["tasks"]
    rows = [r for res in results for r in res["rows"]]
    out: dict[str, Any] = {
        "tasks": tasks,
        "seeds": seeds,
        "waves": args.waves,
        "steps_max": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "early_stop": results[0]["early_stop"],
        "continuation": results[0]["continuation"],
        "gate_items": args.heldout,
        "threads": args.threads,
        "total_s": round(time.perf_counter() - t_start, 1),
        "steps_spent": sum(r["steps"] for r in rows),
        "steps_budget": args.steps * args.waves * len(tasks) * len(seeds),
        "skips_the_gate_would_reject": sum(
            r["decision"] == "skipped" and r["gate"] == "reject" for r in rows
        ),
        "skips_the_gate_would_pass": sum(r["decision"] == "skipped" and r["gate"] == "pass" for r in rows),
        "rows": rows,
    }
    cont = [r for r in rows if r["from"] != "base"]
    candidates = [r for r in cont if r["decision"] != "skipped"]
    out["continuations"] = len(cont)
    out["continuation_candidates"] = len(candidates)
    out["continuations_promoted"] = sum(r["decision"] == "promoted" for r in cont)
    out["continuations_promoted_p01"] = sum(r["decision"] == "promoted" and r["p"] < 0.01 for r in cont)
    out["candidates_significantly_worse"] = sum(r["gain"] < 0 and r["p"] < 0.05 for r in candidates)
    out["skipped_significantly_worse"] = sum(
        r["gain"] < 0 and r["p"] < 0.05 for r in cont if r["decision"] == "skipped"
    )
    for res in results:
        seed = res["seed"]
        for t in tasks:
            out[f"seed{seed}_{t}_curve"] = res["curves"][t]
            out[f"seed{seed}_{t}_promoted_waves"] = res["promoted"][t]
    for res in results:
        print(f"\nseed {res['seed']}")
        _table(res["rows"], res["curves"], args.waves)
    print(
        f"continuations: {out['continuations']} ({out['continuation_candidates']} went to the gate); "
        f"promoted {out['continuations_promoted']}, of them at p < 0.01: {out['continuations_promoted_p01']}; "
        f"candidates significantly worse than their champion (p < 0.05): {out['candidates_significantly_worse']}"
        f" (stopped early and not exported: {out['skipped_significantly_worse']})"
    )
    report(out)


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Every wave of one seed: its rows, each task's champion curve and promoted waves."""
    torch.set_num_threads(args.threads)
    device = args.device
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    early = EarlyStop(
        every=args.every,
        probe_items=args.probe,
        patience=args.patience,
        min_delta=args.min_delta,
        after_rejections=args.after_rejections,
        stop_after_gain=args.stop_after_gain,
        fall_p=args.fall_p,
    )
    continuation = Continuation(
        rate_scale=args.rate_scale,
        warmup_steps=args.warmup,
        min_headroom=None if args.min_headroom < 0 else args.min_headroom,
        headroom_rate_scale=args.headroom_rate_scale,
        headroom_warmup_steps=args.headroom_warmup,
    )

    # the gate's items (every registered task's), the probe's, and everything fresh draws leave out (as
    # validate_data does)
    gate_items = {t: spec.heldout_rows()[: args.heldout] for t, spec in registry().specs.items()}
    evaluated = evaluated_prompts(args.data, args.suites / "data")
    probes = {t: probe_examples(t, early.probe_items, evaluated | train_prompts(args.data, t)) for t in tasks}

    champion_dir: dict[str, Path | None] = {t: args.start / t if args.start else None for t in tasks}
    champion_correct: dict[str, dict[str, list[bool]]] = {}
    champion_label = dict.fromkeys(tasks, str(args.start) if args.start else "base")
    rejected = dict.fromkeys(tasks, 0)
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[float]] = {t: [] for t in tasks}
    with tempfile.TemporaryDirectory() as tmp:
        for w in range(args.waves):
            name = f"{args.prefix}-{w}"
            wave_seed = round_seed(seed, name)
            specs = [recipe_spec(t, t) for t in tasks]
            steps_now = args.first_steps or args.steps if w == 0 and args.start is None else args.steps
            t0 = time.perf_counter()
            prompts = {
                s.task: with_replay(
                    s.task,
                    fresh_examples(
                        s.task,
                        args.prompts_per_step * steps_now,
                        wave_seed,
                        evaluated | {prompt_text(e.prompt) for e in probes[s.task]},
                    ),
                    s.replay,
                    wave_seed,
                    args.data,
                    name,
                )
                for s in specs
            }
            trainer = load_trainer(
                args.base,
                specs,
                BUILTIN_RECIPE,
                wave_seed,
                dict(champion_dir),
                device=device,
                continuation=continuation,
                headroom_items={t: [e for e in prompts[t] if e.task == t] for t in tasks},
            )
            engine = trainer.engine
            rooms = {t: room for t in tasks if (room := trainer.policies[t].headroom) is not None}
            if w == 0 and args.start is None:  # the base, on every task's items: own suite, guards, the rest
                on_base = {g: heldout_correct(engine, None, gate_items[g]) for g in gate_items}
                champion_correct = {t: dict(on_base) for t in tasks}
            elif w == 0:  # the champions it starts from, before they train
                champion_correct = {
                    t: {g: heldout_correct(engine, t, gate_items[g]) for g in gate_items} for t in tasks
                }
            plateaus = {
                t: Plateau.of(early, rejected[t], continuation.has_room(trainer.policies[t].headroom))
                for t in tasks
            }
            run = TrainingRun.start(trainer, prompts, steps_now, args.prompts_per_step, Path(tmp) / name, 0)
            # with --first-steps the first wave is the main job's: every step, no early stop
            stop_early = not args.no_early_stop and not (w == 0 and args.first_steps and args.start is None)
            seen, probe_s = _train(run, probes, plateaus, early.every, stop_early)
            train_s = time.perf_counter() - t0
            for t in tasks:
                p = plateaus[t]
                stop = p.reason(steps_now).split(":")[0]
                steps = run.trainer.steps
                if p.stopped_at is not None and not stop_early:
                    stop = f"finished (would stop: {stop} @{p.stopped_at})"
                elif p.stopped_at is not None:
                    steps = min(steps, p.stopped_at)
                skipped = stop_early and not p.exportable
                cand = {g: heldout_correct(engine, t, gate_items[g]) for g in gate_items}
                decision = decide(
                    GatePolicy(suite=t, guard_suites=[]),  # the pooled guard group is not run here
                    [SuiteScore(name=g, score=_mean(c), n=len(c), correct=c) for g, c in cand.items()],
                    [
                        SuiteScore(name=g, score=_mean(c), n=len(c), correct=c)
                        for g, c in champion_correct[t].items()
                    ],
                )
                guards = {
                    c.name.removeprefix("guard:"): round(c.stats.effect, 4)
                    for c in decision.checks
                    if c.name.startswith("guard:") and c.stats is not None
                }
                failed_guards = [c.name for c in decision.failed() if c.name.startswith("guard:")]
                not_guards = {
                    c.name.removeprefix("info:"): round(c.stats.effect, 4)
                    for c in decision.side_effects()
                    if c.stats is not None
                }
                trained = run.trainer.policies[t].spec
                gain_check = decision.check(f"gain:{t}")
                assert gain_check is not None and gain_check.stats is not None
                stats = gain_check.stats
                pg, pp = probe_gain(seen[t][0][1], seen[t][-1][1])
                promoted = decision.passed and not skipped
                row = {
                    "seed": seed,
                    "wave": w + 1,
                    "task": t,
                    "from": champion_label[t],
                    "rejected_before": rejected[t],
                    "steps": steps,
                    "stop": stop,
                    "stop_reason": p.reason(steps_now),
                    "probe": [[s, round(_mean(got), 4)] for s, got in seen[t]],
                    "probe_gain": round(pg, 4),
                    "probe_p": float(f"{pp:.4g}"),
                    "champion": round(stats.baseline, 4),
                    "candidate": round(stats.candidate, 4),
                    "gain": round(stats.effect, 4),
                    "p": float(f"{stats.p_value:.4g}"),
                    "gate": "pass" if decision.passed else "reject",
                    "guards": guards,
                    "failed_guards": failed_guards,
                    "not_guards": not_guards,
                    "rate_scale": trained.rate_scale,
                    "headroom": rooms[t].model_dump() if t in rooms else None,
                    "decision": "skipped" if skipped else ("promoted" if promoted else "rejected"),
                    "train_s": round(train_s, 1),
                    "probe_s": round(probe_s, 1),
                }
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
                if promoted:
                    saved = Path(tmp) / f"{t}-w{w + 1}"
                    trainer.export(t, saved)
                    if args.keep is not None:
                        shutil.copytree(saved, args.keep / f"seed{seed}" / saved.name, dirs_exist_ok=True)
                    champion_dir[t], champion_correct[t] = saved, cand
                    champion_label[t] = f"wave {w + 1}"
                    rejected[t] = 0
                elif not skipped:
                    rejected[t] += 1
                curves[t].append(round(_mean(champion_correct[t][t]), 4))

    return {
        "seed": seed,
        "tasks": tasks,
        "rows": rows,
        "curves": curves,
        "promoted": {
            t: [r["wave"] for r in rows if r["task"] == t and r["decision"] == "promoted"] for t in tasks
        },
        "early_stop": None if args.no_early_stop else early.model_dump(),
        "continuation": continuation.model_dump(),
    }


def _train(
    run: TrainingRun,
    probes: dict[str, list[Example]],
    plateaus: dict[str, Plateau],
    every: int,
    stop_early: bool,
) -> tuple[dict[str, list[tuple[int, list[bool]]]], float]:
    """Run a wave's steps with a probe of every policy still training before the first step, every `every`
    steps and after the last, as the flow does; returns each policy's probes and the seconds they took."""
    seen: dict[str, list[tuple[int, list[bool]]]] = {t: [] for t in run.prompts}
    spent = [0.0]

    def take_probe() -> None:
        t0 = time.perf_counter()
        stopping = []
        for t in list(run.prompts):
            got = heldout_correct(run.trainer.engine, t, probes[t])
            seen[t].append((run.trainer.steps, got))
            p = plateaus[t]
            if not p.stopped and p.add(run.trainer.steps, _mean(got), got):
                stopping.append(t)
        if stop_early:
            run.freeze(stopping)
        spent[0] += time.perf_counter() - t0

    def step() -> None:
        run.step()
        if run.trainer.steps % every == 0 or run.trainer.steps == run.steps:
            take_probe()

    take_probe()
    run.train(step, stop=lambda: not run.prompts)
    return seen, spent[0]


def _mean(xs: list[bool]) -> float:
    return sum(xs) / len(xs)


def _worst(row: dict[str, Any]) -> str:
    """The other task that lost most, and whether its guard failed."""
    if not row["guards"]:
        return "-"
    task, effect = min(row["guards"].items(), key=lambda kv: kv[1])
    return f"{task} {effect:+.3f}" + (" FAIL" if f"guard:{task}" in row["failed_guards"] else "")


def _table(rows: list[dict[str, Any]], curves: dict[str, list[float]], waves: int) -> None:
    head = [
        "wave",
        "task",
        "steps",
        "stop",
        "probe 0 -> best",
        "champion",
        "candidate",
        "gain",
        "p",
        "worst guard",
        "decision",
    ]
    lines = [head]
    for r in rows:
        probe = r["probe"]
        best = max(probe, key=lambda q: q[1]) if probe else None
        lines.append(
            [
                str(r["wave"]),
                r["task"],
                str(r["steps"]),
                r["stop"],
                f"{probe[0][1]:.3f} -> {best[1]:.3f} @{best[0]}" if best else "-",
                f"{r['champion']:.3f}",
                f"{r['candidate']:.3f}",
                f"{r['gain']:+.3f}",
                f"{r['p']:.3g}",
                _worst(r),
                r["decision"] + ("" if r["decision"] != "skipped" else f" (gate: {r['gate']})"),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    print()
    print("champion's held-out reward after each wave:")
    for t, curve in curves.items():
        print(f"  {t:8s} " + "  ".join(f"w{i + 1} {v:.3f}" for i, v in enumerate(curve[:waves])))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
