"""Evaluating one adapter revision on all its lm-eval suites, served vs in process, and what training buys.

Setup: the built-in base (`--base`, default data/base; without it a random tiny base, which answers nothing, is
used and the output says so), one policy per built-in task trained together with GRPO for `--steps` steps
(mint_core.rl.trainer), each exported as a revision into an adapter store, and a `mint serve` subprocess over
that store. Then:
  served_s / in_process_s   wall time to score one revision (the `add` policy) on every suite: lm-eval's
                            local-completions against the server (the revision loaded under `candidate` first) /
                            lm-eval's hf model in this process with the adapter applied by PEFT (model loading
                            included); the median of `--rounds` interleaved runs after one warm-up each
  tasks.<t>                 the bare base's and the trained policy's score on the task's own suite (exact match)
                            and on the guard suite (all tasks, generation and log-likelihood items pooled),
                            served
  agree                     every policy's scores and per-sample answers on [its suite, guard] are the same by
                            both paths (and the timed revision's on all suites)

`--device` (cpu by default) puts the training, the server's base and the in-process evaluation's model there.

    python benchmarks/eval_revision.py [--base data/base] [--steps 30] [--limit N] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, report, stop_servers_on_kill

ROOT = Path(__file__).resolve().parent.parent


def train_policies(
    base_dir: Path, store: Path, tasks: list[str], args: argparse.Namespace
) -> dict[str, float]:
    """One policy per task, trained together; revisions written to store/<task>. Returns timings."""
    from mint_core.data.generators import split
    from mint_core.engine.base import load_base
    from mint_core.engine.engine import Engine, EngineConfig
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.policy import PolicySpec
    from mint_core.rl.trainer import MultiPolicyTrainer

    engine = Engine(
        load_base(base_dir, device=args.device),
        EngineConfig(max_loras=len(tasks), max_lora_rank=args.rank, max_model_len=128),
    )
    specs = [PolicySpec(name=t, task=t, rank=args.rank, alpha=2 * args.rank) for t in tasks]
    cfg = GRPOConfig(group_size=args.group, learning_rate=args.lr, max_new_tokens=12)
    trainer = MultiPolicyTrainer(engine, cfg, specs, seed=0)
    # training prompts come from the train split; the suites hold held-out items only
    data = {t: split(t, args.prompts * args.steps, 1, 0)[0] for t in tasks}
    t0 = time.perf_counter()
    for s in range(args.steps):
        stats = trainer.step({t: data[t][s * args.prompts : (s + 1) * args.prompts] for t in tasks})
        if s == 0 or (s + 1) % 10 == 0:
            print(f"  step {s + 1}: reward {stats.reward}", file=sys.stderr)
    train_s = time.perf_counter() - t0
    for t in tasks:
        trainer.export(t, store / t)
    return {"train_s": train_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", default=str(ROOT / "data" / "base"), help="base dir (default: the built-in base)"
    )
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per policy per step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="items per lm-eval task (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per path")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, here and in the server")
    add_device(ap)
    args = ap.parse_args()
    stop_servers_on_kill()
    checked_device(ap, args.device)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("lm_eval", "lm-eval", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    import torch
    from pydantic import SecretStr

    from mint_core.data.generators import GENERATORS
    from mint_core.engine.base import build_tiny_base
    from mint_core.engine.tokenizer import byte_tokenizer
    from mint_core.eval.in_process import evaluate_in_process
    from mint_core.eval.lm_eval_runner import evaluate_served
    from mint_core.eval.results import EvalConfig, EvalResult, LocalModel, ServedModel, differences
    from mint_core.eval.suites import SUITES_DIR, standalone_suites
    from mint_testkit.harness import start_server, stop_server

    torch.set_num_threads(args.threads)
    tasks = list(GENERATORS)
    work = Path(tempfile.mkdtemp(prefix="mint-eval-bench-"))
    notes = []
    base_dir = Path(args.base)
    if (base_dir / "config.json").is_file():
        base_label = str(base_dir)
    else:
        notes.append(
            f"{base_dir} not found (build it with `dvc repro builtin_base`); used a random tiny base"
        )
        print(f"note: {notes[-1]}", file=sys.stderr)
        base_dir = work / "tiny-dense"
        tiny = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
        tiny.model.save_pretrained(base_dir)
        assert tiny.tokenizer is not None
        tiny.tokenizer.save_pretrained(base_dir)
        base_label = "tiny-dense (random)"
    if (SUITES_DIR / "data" / "manifest.json").is_file():
        suites_dir = SUITES_DIR
    else:
        notes.append("eval_suites/data not built; built the suite data from the task generators")
        suites_dir = standalone_suites(work)
    store = work / "store"
    store.mkdir()
    proc = None
    try:
        print(
            f"training {len(tasks)} policies for {args.steps} GRPO steps on {base_label} ...", file=sys.stderr
        )
        timing = train_policies(base_dir, store, tasks, args)
        proc, url = start_server(
            store,
            "--base",
            str(base_dir),
            "--max-loras",
            str(len(tasks) + 1),
            "--device",
            args.device,
            env={"MINT_SERVE_TORCH_THREADS": str(args.threads), "MINT_SERVE_LOG_LEVEL": "warning"},
        )

        def cfg(suites: list[str] | None) -> EvalConfig:
            return EvalConfig(
                suites=suites, limit=args.limit, batch_size=args.batch_size, suites_dir=suites_dir
            )

        def served(adapter: str | None, suites: list[str] | None, name: str = "candidate") -> EvalResult:
            target = ServedModel(
                url=url, tokenizer=base_dir, adapter=adapter, name=name, admin_token=SecretStr("admin-secret")
            )
            return evaluate_served(target, cfg(suites))

        def local(adapter: str | None, suites: list[str] | None) -> EvalResult:
            return evaluate_in_process(
                LocalModel(base=base_dir, adapter=store / adapter if adapter else None, device=args.device),
                cfg(suites),
            )

        # timing: one revision on every suite by each path (one warm-up each, then interleaved rounds)
        timed = tasks[0]
        runs: dict[str, list[EvalResult]] = {"served": [], "in_process": []}
        for r in range(args.rounds + 1):
            for path, fn in (("served", served), ("in_process", local)):
                res = fn(timed, None)
                if r:
                    runs[path].append(res)
        disagreements = differences(runs["served"][-1], runs["in_process"][-1])
        n_items = sum(s.n for s in runs["served"][-1].suites.values())

        base_scores = served(None, None).suites
        per_task = {}
        for t in tasks:
            pol = served(t, [t, "guard"])
            disagreements += differences(pol, local(t, [t, "guard"]))
            per_task[t] = {
                "base": {"suite": base_scores[t].score, "guard": base_scores["guard"].score},
                "policy": {"suite": pol.suites[t].score, "guard": pol.suites["guard"].score},
            }
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(work, ignore_errors=True)

    served_s = statistics.median(r.wall_s for r in runs["served"])
    in_process_s = statistics.median(r.wall_s for r in runs["in_process"])
    print(f"base {base_label}; suites {suites_dir}; {n_items} items per full evaluation; revision '{timed}'")
    print(f"  served      {served_s:6.2f} s   {[round(r.wall_s, 2) for r in runs['served']]}")
    print(f"  in process  {in_process_s:6.2f} s   {[round(r.wall_s, 2) for r in runs['in_process']]}")
    print(f"  {'task':8s} {'base suite':>10s} {'policy':>7s} {'base guard':>10s} {'policy':>7s}")
    for t, v in per_task.items():
        b, p = v["base"], v["policy"]
        print(f"  {t:8s} {b['suite']:10.3f} {p['suite']:7.3f} {b['guard']:10.3f} {p['guard']:7.3f}")
    for d in disagreements[:20]:
        print(f"  disagreement: {d}")
    report(
        {
            "served_s": round(served_s, 3),
            "in_process_s": round(in_process_s, 3),
            "agree": not disagreements,
            "disagreements": len(disagreements),
            "items_per_evaluation": n_items,
            "timed_revision": timed,
            "base": base_label,
            "steps": args.steps,
            "train_s": round(timing["train_s"], 1),
            "limit": args.limit,
            "threads": args.threads,
            "device": args.device,
            "tasks": {
                t: {k: {m: round(x, 4) for m, x in v[k].items()} for k in ("base", "policy")}
                for t, v in per_task.items()
            },
            "notes": notes,
        }
    )


if __name__ == "__main__":
    main()
