"""Many policies in one GRPO step vs the same policies one after another, on one resident base.

8 policies (tasks round-robin over the built-in tasks, rank 8 on every linear) x (4 prompts x group 8) per step,
up to 12 new tokens:
  sequential     each policy stepped on its own: 8 rollouts of 32 rows, 8 forward/backwards of 32 rows
  concurrent     one trainer step for all 8 (the trainer's defaults): one rollout of 256 rows, one
                 forward/backward over all 256 rows, one AdamW step per policy
  micro_batched  as concurrent, with the update in micro-batches of `--micro-batch-rows` rows (default 32,
                 one policy's rows: the forward/backward size of a sequential step), gradients accumulated
All modes do the same work per step of all 8 policies: the same prompts, 256 sampled completions, a forward and
backward over every row once (each distinct prompt once per policy, see MultiPolicyTrainer._logprobs), and 8
AdamW steps.

Each mode lives in its own child process, so its peak RSS (ru_maxrss, a per-process high-water mark) is its
own, and the parent drives them in lock-step: each round runs one step of every mode (order rotated each
round), so drift in machine speed (other jobs on shared cores) hits all modes alike. One warm-up round is
skipped; times are medians over `--steps` rounds. Threads: `--threads` (default 1) in every child. Each step is
timed in wall clock and in the child's CPU time, which on a shared machine leaves out time spent waiting for a
core (with one thread it is the step's compute).

Keys: `speedup` = sequential / concurrent wall time per step of all policies, `cpu_speedup` the same in CPU
time, `peak_rss_ratio` = concurrent / sequential peak RSS (targets: speedup >= 2.5, peak_rss_ratio <= 1.1);
`micro_batched_*` the same for micro_batched; `*_setup_rss_bytes`: RSS before the first step (base, engine,
libraries), the same in every mode.

On `--device cuda` each child holds its base on the GPU (the RSS figures stay the processes' host memory).

    python benchmarks/multi_policy_grpo.py [--base data/base] [--steps 8] [--threads 1] [--modes ...] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, peak_rss_bytes, report, stop_servers_on_kill, synchronize

ROOT = Path(__file__).resolve().parent.parent
MODES = ("sequential", "concurrent", "micro_batched")


def child(args: argparse.Namespace) -> None:
    """One mode: build everything, print "ready", then run one step per "step" line on stdin."""
    import torch

    from mint_core.data.generators import GENERATORS, split
    from mint_core.engine.base import build_tiny_base, load_base
    from mint_core.engine.engine import Engine, EngineConfig
    from mint_core.engine.tokenizer import byte_tokenizer
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.policy import PolicySpec
    from mint_core.rl.trainer import MultiPolicyTrainer

    torch.set_num_threads(args.threads)
    b = (
        load_base(args.base, device=args.device)
        if Path(args.base).is_dir()
        else build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer(), device=args.device)
    )
    n = args.policies
    engine = Engine(b, EngineConfig(max_loras=n, max_lora_rank=8, max_model_len=128))
    tasks = list(GENERATORS)
    specs = [PolicySpec(name=f"p{i}", task=tasks[i % len(tasks)], rank=8, alpha=16) for i in range(n)]
    cfg = GRPOConfig(group_size=args.group, max_new_tokens=args.new_tokens, learning_rate=1e-4)
    extra: dict[str, Any] = {}
    if args.child == "micro_batched":
        extra["micro_batch_rows"] = args.micro_batch_rows
    trainer = MultiPolicyTrainer(engine, cfg, specs, seed=0, **extra)
    rounds = args.steps + 1
    pools = {s.name: split(s.task, args.prompts * rounds, 1, 7)[0] for s in specs}
    setup_rss = peak_rss_bytes()

    def batch(step: int) -> dict:
        return {name: pool[step * args.prompts : (step + 1) * args.prompts] for name, pool in pools.items()}

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "step":
            step = int(cmd[1])
            t0, c0 = time.perf_counter(), time.process_time()
            if args.child == "sequential":
                for name, exs in batch(step).items():
                    trainer.step({name: exs})
            else:
                trainer.step(batch(step))
            synchronize(args.device)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(json.dumps({"seconds": seconds, "cpu_seconds": cpu}), flush=True)
        else:
            print(json.dumps({"peak_rss_bytes": peak_rss_bytes(), "setup_rss_bytes": setup_rss}), flush=True)
            return


def _ask(proc: subprocess.Popen, line: str) -> dict:
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    if line:
        stdin.write(line + "\n")
        stdin.flush()
    out = stdout.readline()
    if not out:
        raise RuntimeError(f"child exited with {proc.wait()}")
    return dict(json.loads(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", default=str(ROOT / "data" / "base"), help="base dir (default: the built-in base)"
    )
    ap.add_argument("--steps", type=int, default=8, help="timed rounds after one warm-up round")
    ap.add_argument("--policies", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    ap.add_argument(
        "--micro-batch-rows",
        type=int,
        default=None,
        help="micro_batched mode's rows (default: prompts x group)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    add_device(ap)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    stop_servers_on_kill()
    checked_device(ap, args.device)
    if args.micro_batch_rows is None:
        args.micro_batch_rows = args.prompts * args.group
    if args.child:
        child(args)
        return
    modes = [m for m in args.modes.split(",") if m]
    if "sequential" not in modes or not set(modes) <= set(MODES):
        ap.error(f"--modes must include sequential and name only {MODES}")
    if not Path(args.base).is_dir():
        print(f"note: {args.base} not found (run `dvc repro`); using a random tiny base", file=sys.stderr)
    forwarded = (
        "base",
        "steps",
        "policies",
        "prompts",
        "group",
        "new_tokens",
        "threads",
        "micro_batch_rows",
        "device",
    )
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in forwarded]
    procs: dict[str, subprocess.Popen] = {}
    with contextlib.ExitStack() as stack:
        logs = {m: stack.enter_context(tempfile.TemporaryFile("w+")) for m in modes}
        try:
            for m in modes:
                procs[m] = subprocess.Popen(
                    [sys.executable, __file__, "--child", m, *common],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=logs[m],
                    text=True,
                )
            for m in modes:
                _ask(procs[m], "")  # ready
            times: dict[str, list[float]] = {m: [] for m in modes}
            cpu_times: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.steps + 1):
                for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    took = _ask(procs[m], f"step {r}")
                    if r:  # round 0 warms up
                        times[m].append(took["seconds"])
                        cpu_times[m].append(took["cpu_seconds"])
            mem = {m: _ask(procs[m], "done") for m in modes}
        except Exception:
            for m, log in logs.items():
                log.seek(0)
                print(f"--- {m} stderr ---\n{log.read()[-4000:]}", file=sys.stderr)
            raise
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    step_s = {m: statistics.median(t) for m, t in times.items()}
    cpu_s = {m: statistics.median(t) for m, t in cpu_times.items()}
    print(
        f"{args.policies} policies x ({args.prompts} prompts x group {args.group}), {args.new_tokens} new tokens, "
        f"micro-batch {args.micro_batch_rows} rows, {args.threads} thread(s), base {args.base}"
    )
    for m in modes:
        print(
            f"  {m:13s} {step_s[m]:7.2f} s/step ({cpu_s[m]:5.2f} CPU s)   peak RSS {mem[m]['peak_rss_bytes'] / 2**20:6.0f} MiB "
            f"(setup {mem[m]['setup_rss_bytes'] / 2**20:4.0f})   {[round(t, 2) for t in times[m]]}"
        )
    seq = "sequential"
    result: dict[str, Any] = {
        "sequential_step_s": round(step_s[seq], 3),
        "sequential_step_cpu_s": round(cpu_s[seq], 3),
        "sequential_peak_rss_bytes": mem[seq]["peak_rss_bytes"],
        "sequential_setup_rss_bytes": mem[seq]["setup_rss_bytes"],
        "micro_batch_rows": args.micro_batch_rows,
        "threads": args.threads,
        "base": args.base,
        "device": args.device,
    }
    for m, prefix in (("concurrent", ""), ("micro_batched", "micro_batched_")):
        if m in modes:
            result[f"{prefix}speedup"] = round(step_s[seq] / step_s[m], 3)
            result[f"{prefix}cpu_speedup"] = round(cpu_s[seq] / cpu_s[m], 3)
            result[f"{prefix}peak_rss_ratio"] = round(
                mem[m]["peak_rss_bytes"] / mem[seq]["peak_rss_bytes"], 3
            )
            result[f"{m}_step_s"] = round(step_s[m], 3)
            result[f"{m}_step_cpu_s"] = round(cpu_s[m], 3)
            result[f"{m}_peak_rss_bytes"] = mem[m]["peak_rss_bytes"]
            result[f"{m}_setup_rss_bytes"] = mem[m]["setup_rss_bytes"]
    report(result)


if __name__ == "__main__":
    main()
