"""How far GRPO can take the built-in base on a task, and how far the base could go at all (issue #33 items 4, 5).

GRPO raises the probability of answers the policy already samples: the update of a group moves only where some of
its samples are right and some wrong. So on the gate's held-out items (the first `--items` of a task's held-out
rows, greedy exact match as the gate scores):

- `greedy`: the bare base's (or `--adapter`'s) greedy exact match, the score the gate compares;
- `pass@k`: the chance that at least one of k samples at `--temperature` is right (the unbiased estimate from
  `--samples` samples per item): the best-of-k ceiling, what sharpening could at most make greedy;
- `sample_beats_greedy`: the share of items the greedy answer gets wrong and some sample gets right (the items a
  GRPO group can teach the greedy answer);
- with `--sft-steps`: a fresh LoRA of `--rank` trained by PEFT with supervised cross-entropy on the task's train
  answers (no RL), then served by mint's engine from the saved PEFT files: its greedy exact match is what an adapter
  of that rank on this base can reach when it is shown the answers, a ceiling GRPO's samples do not give it.

    python benchmarks/headroom.py [--tasks reverse,add,sort] [--items 320] [--samples 32] [--temperature 0.7]
        [--sft-steps 600] [--rank 8] [--adapter DIR]
"""

from __future__ import annotations

import argparse
import math
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

from mint_core.data.generators import Example, read_jsonl
from mint_core.data.rewards import builtin_scores
from mint_core.engine.base import load_base
from mint_core.engine.chat import prompt_ids
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.rl.constants import BUILTIN_RECIPE
from mint_core.rl.evaluate import heldout_correct
from mint_core.rl.policy import PolicySpec

KS = (1, 4, 8, 16, 32)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are right (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def sampled_right(
    engine: Engine, adapter: str | None, items: list[Example], n: int, temp: float
) -> list[int]:
    """How many of `n` samples at `temp` answer each item right."""
    reqs = [
        Request(
            prompt_ids(engine.tokenizer, e.prompt),
            adapter,
            SamplingParams(max_tokens=BUILTIN_RECIPE.max_new_tokens, temperature=temp, seed=7919 * i + j),
        )
        for i, e in enumerate(items)
        for j in range(n)
    ]
    scores = builtin_scores(
        "exact_match", [e for e in items for _ in range(n)], [c.text for c in engine.generate(reqs)]
    )
    return [sum(s >= 1.0 for s in scores[i * n : (i + 1) * n]) for i in range(len(items))]


def supervised(base_dir: Path, train: list[Example], steps: int, rank: int, out: Path, seed: int) -> float:
    """A fresh rank-`rank` LoRA on every site of the built-in recipe, trained by PEFT with cross-entropy on the
    answers (and EOS) of `train`, 32 examples a step, AdamW at 1e-3 decaying linearly; saved to `out` in PEFT's
    format. Returns the final loss (mean over the last 20 steps)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    targets = PolicySpec(name="x", task="x").targets
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    rows = []
    for e in train:
        p = prompt_ids(tok, e.prompt)
        a = tok(str(e.answer), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p, a))
    g = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        idx = torch.randint(len(rows), (32,), generator=g).tolist()
        seqs = [rows[i][0] + rows[i][1] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id or 0)
        labels = torch.full((len(seqs), width), -100)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p, a = rows[i]
            ids[r, : len(p) + len(a)] = torch.tensor(p + a)
            labels[r, len(p) : len(p) + len(a)] = torch.tensor(a)
            attn[r, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
        if (step + 1) % 100 == 0:
            print(f"  sft step {step + 1}: loss {sum(losses[-100:]) / 100:.4f}", file=sys.stderr, flush=True)
    model.save_pretrained(out)
    return sum(losses[-20:]) / len(losses[-20:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("data/base"))
    ap.add_argument("--data", type=Path, default=Path("data/tasks"))
    ap.add_argument("--tasks", default="reverse,add,sort")
    ap.add_argument("--items", type=int, default=320, help="the gate's held-out items per task")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=BUILTIN_RECIPE.temperature)
    ap.add_argument("--adapter", type=Path, help="a PEFT adapter to measure instead of the bare base")
    ap.add_argument("--sft-steps", type=int, default=600, help="0: no supervised ceiling")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    torch.set_num_threads(args.threads)
    if not (args.base / "config.json").is_file():
        ap.error(f"no built-in base at {args.base}: run `.venv/bin/dvc repro` first")
    t0 = time.perf_counter()
    base = load_base(args.base, device=device)
    engine = Engine(base, EngineConfig(max_loras=2, max_lora_rank=max(args.rank, 64)))
    who = None
    if args.adapter is not None:
        engine.add_adapter("measured", engine.read_adapter("measured", args.adapter))
        who = "measured"
    out: dict[str, Any] = {
        "benchmark": "headroom",
        "of": str(args.adapter or "base"),
        "items": args.items,
        "samples": args.samples,
        "temperature": args.temperature,
    }
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
            items = read_jsonl(args.data / "heldout" / f"{task}.jsonl")[: args.items]
            greedy = heldout_correct(engine, who, items)
            right = sampled_right(engine, who, items, args.samples, args.temperature)
            g = sum(greedy) / len(items)
            passes = {
                k: sum(pass_at_k(args.samples, c, k) for c in right) / len(items)
                for k in KS
                if k <= args.samples
            }
            beats = sum(c > 0 and not gr for c, gr in zip(right, greedy, strict=True)) / len(items)
            row: dict[str, Any] = {
                "greedy": round(g, 4),
                **{f"pass@{k}": round(v, 4) for k, v in passes.items()},
                "sample_beats_greedy": round(beats, 4),
            }
            if args.sft_steps:
                train = read_jsonl(args.data / "train" / f"{task}.jsonl")
                saved = Path(tmp) / f"sft-{task}"
                row["sft_loss"] = round(
                    supervised(args.base, train, args.sft_steps, args.rank, saved, args.seed), 4
                )
                name = f"sft-{task}"
                engine.add_adapter(name, engine.read_adapter(name, saved), replace=True)
                row["sft_greedy"] = round(sum(heldout_correct(engine, name, items)) / len(items), 4)
                engine.unload_adapter(name)
            out[task] = row
            cells = "  ".join(f"{k} {v}" for k, v in row.items())
            lines.append(f"{task:8s} {cells}")
            print(lines[-1], flush=True)
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print()
    print("\n".join(lines))
    report(out)


if __name__ == "__main__":
    main()
