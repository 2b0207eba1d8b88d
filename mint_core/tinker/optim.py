"""The optimizer of Tinker's training models: one optim_step's AdamW hyper-parameters, and the fused AdamW step
that updates many models' LoRA factors in a few kernel calls (bit for bit the same as each model's own step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw


@dataclass(frozen=True)
class AdamStep:
    """One optim_step's AdamW hyper-parameters (the SDK's `AdamParams`)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


def fused_adamw_step(optimizers: list[torch.optim.AdamW]) -> None:
    """`opt.step()` of each of `optimizers` (fused AdamW, no amsgrad, no maximize), in one fused AdamW call per
    distinct set of hyper-parameters across all their param groups rather than one per group: the kernel updates
    each tensor on its own, so the result is the same, bit for bit. Parameters without a `.grad` are skipped, and a
    parameter's state is created on its first step as `torch.optim.AdamW` creates it."""
    calls: dict[tuple[float, float, float, float, float], tuple[list[torch.Tensor], ...]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            if not group["fused"] or group["amsgrad"] or group["maximize"]:
                raise ValueError("fused_adamw_step takes fused AdamW without amsgrad or maximize")
            beta1, beta2 = group["betas"]
            key = (
                float(group["lr"]),
                float(beta1),
                float(beta2),
                float(group["weight_decay"]),
                float(group["eps"]),
            )
            lists = calls.setdefault(key, ([], [], [], [], []))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = opt.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                for lst, t in zip(
                    lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]), strict=True
                ):
                    lst.append(t)
    for (lr, beta1, beta2, weight_decay, eps), (params, grads, exp_avgs, exp_avg_sqs, steps) in calls.items():
        if params:
            adamw(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=weight_decay,
                eps=eps,
                maximize=False,
            )
