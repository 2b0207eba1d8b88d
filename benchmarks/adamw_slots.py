"""The trainer's AdamW on its slot banks: torch.optim.AdamW (fused) over slot views, against the hand-written
`torch._foreach_*` AdamW the trainer used before (kept here, verbatim in its arithmetic, as the baseline).

Layout: the trainer's own banks (`_SlotBank`, A [slots, r, in], B [slots, r, out]) for the LoRA sites of a
Qwen2-0.5B-shaped base (24 layers x q/k/v/o/gate/up/down, hidden 896, intermediate 4864, 2 KV heads of 64) or
of the built-in base, `--policies` policies at rank `--rank` in `--rank`-wide slots, on `--device` (cpu by
default; on CUDA each timing waits for the device). Each timed
step is one AdamW step of every policy from gradients already in the banks (per-policy clipping on, as in
the trainer's default GRPOConfig), with both implementations run round-robin (`interleaved`) so drift in
machine speed hits both alike.

Keys: `torch_adamw_ms` (`SlotAdamW`, what the trainer runs), `foreach_ms` (the old private one), `ratio` =
torch_adamw_ms / foreach_ms (below 1: torch's is faster), `max_abs_diff` between the two after the same three
steps from the same start (they compute the same update up to float rounding).

    python benchmarks/adamw_slots.py [--layout qwen2-0.5b|builtin] [--policies 4] [--rank 8] [--rounds 15]
                                     [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, interleaved, report, synced

from mint_core.engine.base import build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.layers import _SlotBank
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.optim import SlotAdamW
from mint_core.rl.policy import PolicySpec, PolicyState
from mint_core.types import Site

ROOT = Path(__file__).resolve().parent.parent


def qwen2_05b_sites() -> list[Site]:
    hidden, inter, kv, layers = 896, 4864, 128, 24
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    return [Site(f"model.layers.{i}.{n}", a, b) for i in range(layers) for n, (a, b) in shapes.items()]


def builtin_sites() -> list[Site]:
    path = ROOT / "data" / "base"
    base = (
        load_base(path)
        if (path / "config.json").is_file()
        else build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    )
    return list(base.sites.values())


class ForeachAdamW:
    """The trainer's AdamW before this benchmark: one set of `torch._foreach_*` kernels over every policy's
    slot views, with per-policy global-norm clipping, bias correction and decoupled weight decay."""

    def __init__(self, banks: dict[str, _SlotBank], policies: list[PolicyState], config: GRPOConfig):
        self.banks, self.policies, self.config = banks, policies, config
        self.m = {(p.spec.name, s): [torch.zeros_like(banks[s].A[0]), torch.zeros_like(banks[s].B[0])]
                  for p in policies for s in p.sites}  # fmt: skip
        self.v = {k: [torch.zeros_like(t) for t in m] for k, m in self.m.items()}
        self.steps = dict.fromkeys((p.spec.name for p in policies), 0)

    @torch.no_grad()
    def step(self) -> None:
        cfg = self.config
        b1, b2 = cfg.adam_betas
        params, grads, ms, vs, lrs, owner = [], [], [], [], [], []
        for i, p in enumerate(self.policies):
            lr = p.spec.learning_rate or cfg.learning_rate
            for s in p.sites:
                bank = self.banks[s]
                for j, param in enumerate((bank.A, bank.B)):
                    assert param.grad is not None
                    params.append(param.data[p.slot])
                    grads.append(param.grad[p.slot])
                    ms.append(self.m[p.spec.name, s][j])
                    vs.append(self.v[p.spec.name, s][j])
                    lrs.append(lr * (p.scale if j == 1 else 1.0))
                    owner.append(i)
        if cfg.max_grad_norm is not None:
            sq = torch.zeros(len(self.policies), dtype=torch.float64)
            sq.index_add_(0, torch.tensor(owner), torch.stack(torch._foreach_norm(grads)).double().cpu() ** 2)
            clips = [min(1.0, cfg.max_grad_norm / (math.sqrt(q) + 1e-6)) for q in sq.tolist()]
            if any(c < 1.0 for c in clips):
                grads = list(torch._foreach_mul(grads, [clips[o] for o in owner]))
        for p in self.policies:
            self.steps[p.spec.name] += 1
        t = [self.steps[self.policies[o].spec.name] for o in owner]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, grads, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
        if cfg.weight_decay:
            torch._foreach_mul_(params, [1 - lr * cfg.weight_decay for lr in lrs])
        denom = torch._foreach_div(vs, [1 - b2**ti for ti in t])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, cfg.adam_eps)
        m_hat = torch._foreach_div(ms, [1 - b1**ti for ti in t])
        torch._foreach_addcdiv_(params, m_hat, denom, [-lr for lr in lrs])


def setup(
    sites: list[Site], n: int, rank: int, device: str = "cpu"
) -> tuple[dict[str, _SlotBank], list[PolicyState], GRPOConfig]:
    """Banks on `device` with random A/B in every policy's slot and a fixed random gradient in the banks (drawn
    on the CPU: the same numbers on every device)."""
    g = torch.Generator().manual_seed(0)
    banks = {s.name: _SlotBank(s, n, rank, torch.float32, torch.device(device)) for s in sites}
    for bank in banks.values():
        with torch.no_grad():
            bank.A.copy_(torch.empty(bank.A.shape).normal_(0, 0.02, generator=g))
            bank.B.copy_(torch.empty(bank.B.shape).normal_(0, 0.02, generator=g))
        bank.A.grad = (torch.randn(bank.A.shape, generator=g) * 1e-3).to(device)
        bank.B.grad = (torch.randn(bank.B.shape, generator=g) * 1e-3).to(device)
    policies = [
        PolicyState(PolicySpec(name=f"p{i}", task="add", rank=rank, alpha=2 * rank), i, list(banks))
        for i in range(n)
    ]
    return banks, policies, GRPOConfig(learning_rate=1e-3, weight_decay=0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=("qwen2-0.5b", "builtin"), default="qwen2-0.5b")
    ap.add_argument("--policies", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    torch.set_num_threads(args.threads)
    sites = qwen2_05b_sites() if args.layout == "qwen2-0.5b" else builtin_sites()

    # the same update: three steps of each from the same start end at the same weights, up to rounding
    banks_t, pols_t, cfg = setup(sites, args.policies, args.rank, device)
    banks_f, pols_f, _ = setup(sites, args.policies, args.rank, device)
    torch_adamw, foreach = SlotAdamW(banks_t, pols_t, cfg), ForeachAdamW(banks_f, pols_f, cfg)
    for _ in range(3):
        torch_adamw.step(pols_t)
        foreach.step()
    diff = max(
        float((banks_t[s].A - banks_f[s].A).abs().max().max((banks_t[s].B - banks_f[s].B).abs().max()))
        for s in banks_t
    )
    times = interleaved(
        {
            "torch_adamw": synced(lambda: torch_adamw.step(pols_t), device),
            "foreach": synced(foreach.step, device),
        },
        rounds=args.rounds,
    )
    floats = sum(b.A[0].numel() + b.B[0].numel() for b in banks_t.values()) * args.policies
    report(
        {
            "benchmark": "adamw_slots",
            "layout": args.layout,
            "sites": len(sites),
            "policies": args.policies,
            "rank": args.rank,
            "threads": args.threads,
            "device": device,
            "trainable_params": floats,
            "torch_adamw_ms": round(1000 * times["torch_adamw"], 2),
            "foreach_ms": round(1000 * times["foreach"], 2),
            "ratio": round(times["torch_adamw"] / times["foreach"], 3),
            "max_abs_diff": diff,
        }
    )


if __name__ == "__main__":
    main()
