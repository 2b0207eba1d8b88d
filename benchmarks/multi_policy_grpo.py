"""Many policies in one GRPO step vs the same policies one after another, on one resident base.

8 policies (tasks round-robin over the built-in tasks, rank 8) x (4 prompts x group 8) per step:
  concurrent  one trainer step: one batched rollout and one batched forward/backward over all 8 policies' rows
  sequential  the same trainer, each policy stepped on its own (8 rollouts, 8 forward/backwards)
Each mode runs in its own subprocess (so its peak RSS is its own) for `--steps` steps after one warm-up step.
Keys: `speedup` = sequential / concurrent wall time per step (per step of all 8 policies),
`peak_rss_ratio` = concurrent / sequential peak RSS.

    python benchmarks/multi_policy_grpo.py [--base data/base] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peak_rss_bytes, report

ROOT = Path(__file__).resolve().parent.parent


def run_mode(
    mode: str, base: str, steps: int, policies: int, prompts: int, group: int, new_tokens: int
) -> dict:
    import torch

    from mint_core.data.tasks import TASKS, split
    from mint_core.engine.base import build_tiny_base, load_base
    from mint_core.engine.engine import Engine, EngineConfig
    from mint_core.engine.tokenizer import byte_tokenizer
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.trainer import MultiPolicyTrainer, PolicySpec

    torch.set_num_threads(2)
    b = (
        load_base(base)
        if Path(base).is_dir()
        else build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    )
    engine = Engine(b, EngineConfig(max_loras=policies, max_lora_rank=8, max_model_len=128))
    tasks = list(TASKS)
    specs = [PolicySpec(name=f"p{i}", task=tasks[i % len(tasks)], rank=8, alpha=16) for i in range(policies)]
    cfg = GRPOConfig(group_size=group, max_new_tokens=new_tokens, learning_rate=1e-4)
    trainer = MultiPolicyTrainer(engine, cfg, specs, seed=0)
    pools = {s.name: split(s.task, prompts * (steps + 1), 1, 7)[0] for s in specs}

    def batch(step: int) -> dict:
        return {n: pool[step * prompts : (step + 1) * prompts] for n, pool in pools.items()}

    def one(step: int) -> None:
        if mode == "concurrent":
            trainer.step(batch(step))
        else:
            for name, exs in batch(step).items():
                trainer.step({name: exs})

    one(0)  # warm-up
    times = []
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        one(s)
        times.append(time.perf_counter() - t0)
    return {
        "mode": mode,
        "step_s": sorted(times)[len(times) // 2],
        "times": times,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", default=str(ROOT / "data" / "base"), help="base dir (default: the built-in base)"
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--policies", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--mode", choices=["concurrent", "sequential"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:  # child process
        print(
            json.dumps(
                run_mode(
                    args.mode, args.base, args.steps, args.policies, args.prompts, args.group, args.new_tokens
                )
            )
        )
        return
    if not Path(args.base).is_dir():
        print(f"note: {args.base} not found (run `dvc repro`); using a random tiny base", file=sys.stderr)
    results = {}
    for mode in ("sequential", "concurrent"):
        out = subprocess.run(
            [sys.executable, __file__, "--mode", mode, *sys.argv[1:]],
            capture_output=True,
            text=True,
            check=True,
        )
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    seq, con = results["sequential"], results["concurrent"]
    print(
        f"{args.policies} policies x ({args.prompts} prompts x group {args.group}), {args.new_tokens} new tokens, base {args.base}"
    )
    for r in (seq, con):
        print(
            f"  {r['mode']:10s} {r['step_s']:7.2f} s/step   peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB   {r['times']}"
        )
    report(
        {
            "speedup": round(seq["step_s"] / con["step_s"], 3),
            "peak_rss_ratio": round(con["peak_rss_bytes"] / seq["peak_rss_bytes"], 3),
            "concurrent_step_s": round(con["step_s"], 3),
            "sequential_step_s": round(seq["step_s"], 3),
            "concurrent_peak_rss_bytes": con["peak_rss_bytes"],
            "sequential_peak_rss_bytes": seq["peak_rss_bytes"],
            "base": args.base,
        }
    )


if __name__ == "__main__":
    main()
