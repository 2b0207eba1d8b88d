"""Memory of one GRPO update at a real vocabulary size: mint's selective log-softmax vs full-vocabulary logprobs.

Setup: the benchmarks' 6-layer, 256-wide Llama (float32, sdpa, on `--device`: cpu by default) with Qwen2's 151,936-token vocabulary, one
policy (rank 8 on q,k,v,o), one update over 4 prompts x group 8 with 64-token completions (random tokens: the
update's cost does not depend on what the tokens say), the trainer's packed path (each prompt once per group).

Variants, each in a fresh process (peak RSS is a per-process high-water mark):
  mint    the trainer as it is: the model runs only up to the output projection's input at the positions that
          predict a completion token, and the projection runs fused with the log-softmax a chunk of rows at a
          time (`head_logprobs`), in forward and again in backward: no [positions, vocab] tensor at all
  logits  the trainer's path for a model whose head it does not know: logits at those positions only (a boolean
          `logits_to_keep`), `selected_logprobs` keeping the logits and one float per row for backward
  plain   the usual formulation: logits at every position of the packed sequences, the predicted rows gathered
          from them, then log_softmax in float32 and a gather of the targets (what mint did before, and what
          most GRPO code does)
All compute the same logprobs and gradients (checked: the updated adapters agree to 1e-6 relative).

Figures: `peak_ratio` = plain / mint peak RSS above the setup RSS (model, engine, libraries: the same in all),
`logits_peak_ratio` the same for logits, `*_update_peak_bytes` those increments, `*_update_s` median wall time of
an update, `speedup` = plain / mint update time, `logits_bytes_plain` the size of one float32 [positions, vocab]
tensor, for scale, `mint_output` the way mint's update went ("hidden": fused; below the trainer's
`fused_head_min_bytes` (512 MiB) of logits it makes them once, "logits", which is faster).

On `--device cuda` the peaks are the GPU's allocated bytes (`torch.cuda.max_memory_allocated`) above what the
setup allocated, instead of the process's RSS (`memory` says which).

    python benchmarks/update_memory.py [--vocab 151936] [--new-tokens 64] [--steps 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, peak_rss_bytes, report, synchronize

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
VARIANTS = ("mint", "logits", "plain")


def child(args: argparse.Namespace) -> None:
    import torch
    from mixed_adapter_decode import build_model

    import mint_core.rl.trainer as trainer_mod
    from mint_core.data.generators import split
    from mint_core.engine.base import from_model
    from mint_core.engine.engine import Engine, EngineConfig
    from mint_core.engine.tokenizer import byte_tokenizer
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.policy import PolicySpec
    from mint_core.rl.rollout import RolloutRow
    from mint_core.rl.trainer import MultiPolicyTrainer

    torch.set_num_threads(args.threads)
    tok = byte_tokenizer()
    model = build_model(0, args.vocab, "sdpa", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.to(args.device)
    engine = Engine(
        from_model(model, tok, "bench-llama-big-vocab"),
        EngineConfig(max_loras=1, max_lora_rank=8, target_modules=TARGETS, max_model_len=256),
    )
    cfg = GRPOConfig(group_size=args.group, max_new_tokens=args.new_tokens, drop_zero_variance=False)
    spec = PolicySpec(name="policy", task="add", rank=8, alpha=16, targets=TARGETS)
    trainer = MultiPolicyTrainer(engine, cfg, [spec], seed=0)
    if args.fused_head_min_bytes is not None:
        trainer.fused_head_min_bytes = args.fused_head_min_bytes
    if args.child == "logits":
        trainer._output = "logits"
    elif args.child == "plain":

        def log_softmax_gather(
            logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
        ) -> torch.Tensor:
            return torch.log_softmax(logits[rows].float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)

        trainer._output = "full"
        trainer_mod.selected_logprobs = log_softmax_gather  # type: ignore[assignment]

    g = torch.Generator().manual_seed(0)
    examples = split("add", args.prompts * (args.steps + 1), 1, 11)[0]

    def rows(step: int) -> list[RolloutRow]:
        out = []
        for p, ex in enumerate(examples[step * args.prompts : (step + 1) * args.prompts]):
            prompt = engine._encode(ex.prompt)
            for _ in range(args.group):
                comp = torch.randint(3, 256, (args.new_tokens,), generator=g).tolist()
                out.append(
                    RolloutRow(
                        "policy",
                        step * args.prompts + p,
                        ex,
                        prompt,
                        comp,
                        [0.0] * len(comp),
                        "",
                        float(torch.rand(1, generator=g)),
                        "length",
                    )
                )
        return out

    # on a GPU the figure is the device's allocated memory (its high-water mark from here), else the process's RSS
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize(args.device)
        torch.cuda.reset_peak_memory_stats(args.device)
    setup = torch.cuda.memory_allocated(args.device) if cuda else peak_rss_bytes()
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        trainer.update(rows(step))
        synchronize(args.device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(args.device) if cuda else peak_rss_bytes()
    A, B = trainer.weights("policy").tensors["model.layers.0.self_attn.q_proj"]
    print(
        json.dumps(
            {
                "setup": setup,
                "peak": peak,
                "update_s": statistics.median(times[1:]),
                "output": trainer.last_output,
                "check": [float(A.double().sum()), float(B.double().sum())],
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--fused-head-min-bytes",
        type=int,
        default=None,
        help="mint fuses the head from this many bytes of logits (default: the trainer's, 512 MiB)",
    )
    add_device(ap)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    checked_device(ap, args.device)
    if args.child:
        child(args)
        return
    out: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            v,
            *(
                f"--{k}={getattr(args, k.replace('-', '_'))}"
                for k in ("vocab", "prompts", "group", "new-tokens", "steps", "threads", "device")
            ),
            *(
                []
                if args.fused_head_min_bytes is None
                else [f"--fused-head-min-bytes={args.fused_head_min_bytes}"]
            ),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{v} failed:\n{done.stderr[-4000:]}")
        out[v] = json.loads(done.stdout.strip().splitlines()[-1])
    for v in VARIANTS[1:]:
        pairs = zip(out["mint"]["check"], out[v]["check"], strict=True)
        if not all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for x, y in pairs):
            sys.exit(f"mint and {v} trained different adapters: {out['mint']['check']} vs {out[v]['check']}")
    grow = {v: out[v]["peak"] - out[v]["setup"] for v in VARIANTS}
    positions = args.prompts * args.group * args.new_tokens  # about what the plain path projects
    print(
        f"vocab {args.vocab}, {args.prompts} prompts x group {args.group}, {args.new_tokens}-token completions, "
        f"{args.threads} thread(s); peak RSS above setup, median of {args.steps} updates"
    )
    for v in VARIANTS:
        print(f"  {v:6s} {grow[v] / 2**20:8.0f} MiB   {out[v]['update_s']:.2f} s/update")
    report(
        {
            "peak_ratio": round(grow["plain"] / max(grow["mint"], 1), 2),
            "logits_peak_ratio": round(grow["plain"] / max(grow["logits"], 1), 2),
            "logits_update_peak_bytes": grow["logits"],
            "logits_update_s": round(out["logits"]["update_s"], 3),
            "mint_update_peak_bytes": grow["mint"],
            "plain_update_peak_bytes": grow["plain"],
            "mint_update_s": round(out["mint"]["update_s"], 3),
            "plain_update_s": round(out["plain"]["update_s"], 3),
            "speedup": round(out["plain"]["update_s"] / out["mint"]["update_s"], 3),
            "logits_bytes_plain": positions * args.vocab * 4,
            "vocab": args.vocab,
            "mint_output": out["mint"]["output"],
            "device": args.device,
            "memory": "cuda_allocated" if args.device.startswith("cuda") else "rss",
        }
    )


if __name__ == "__main__":
    main()
