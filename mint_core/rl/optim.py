"""Each policy's own AdamW over its slot of the multi-LoRA banks (`SlotAdamW`), and its warmup."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from mint_core.lora.layers import _SlotBank
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicyState


def warmup_factor(warmup_steps: int, step: int) -> float:
    """The learning rate's multiplier at a policy's AdamW step `step` (0-based) of a warmup over `warmup_steps`:
    (step + 1) / (warmup_steps + 1) while step < warmup_steps, then 1."""
    return 1.0 if step >= warmup_steps else (step + 1) / (warmup_steps + 1)


class SlotAdamW:
    """AdamW on each policy's own slot of the multi-LoRA banks: `torch.optim.AdamW` (fused) whose parameters
    are views of the slots, so a step writes the banks in place.

    Each policy has two param groups: A at its learning rate, and B at that rate times alpha/r, since the banks
    hold B with the scale folded in (this matches PEFT's parameterisation). A step gives gradients only to the
    views of the policies that step, and AdamW skips a parameter without one: the others' weights, moments and
    step counts stay as they were (a zero gradient would still move them, by momentum and weight decay). Each
    stepping policy's gradient is first clipped to its own global norm. benchmarks/adamw_slots.py measured it
    against the hand-written `foreach` AdamW it replaced.
    """

    def __init__(self, banks: Mapping[str, _SlotBank], policies: Sequence[PolicyState], config: GRPOConfig):
        self.banks = banks
        self.max_grad_norm = config.max_grad_norm
        # policy -> site -> (A view, B view) of its slot
        self.views: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        groups: list[dict[str, object]] = []
        self.warmups: list[PolicyState] = []
        """The policy of each param group, in order (two groups each), for its warmup."""
        for p in policies:
            lr = (p.spec.learning_rate or config.learning_rate) * p.spec.rate_scale
            views = {s: (banks[s].A.data[p.slot], banks[s].B.data[p.slot]) for s in p.sites}
            self.views[p.spec.name] = views
            groups.append({"params": [A for A, _ in views.values()], "lr": lr})
            groups.append({"params": [B for _, B in views.values()], "lr": lr * p.scale})
            self.warmups += [p, p]
        self.base_lrs = [float(g["lr"]) for g in groups]  # type: ignore[arg-type]
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=config.learning_rate,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            fused=True,
        )

    @torch.no_grad()
    def step(self, policies: Sequence[PolicyState], lr_scale: float = 1.0) -> dict[str, float]:
        """One AdamW step of each of `policies` whose sites all have a gradient in the banks, at `lr_scale` times
        each one's learning rate; the global norm of each stepping policy's gradient, before clipping."""
        stepping = [p for p in policies if all(self._has_grad(s) for s in p.sites)]
        norms: dict[str, float] = {}
        for group, lr, p in zip(self.optimizer.param_groups, self.base_lrs, self.warmups, strict=True):
            group["lr"] = lr * lr_scale * warmup_factor(p.spec.warmup_steps, p.optimizer_steps)
        try:
            for p in stepping:
                params = []
                for s, (A, B) in self.views[p.spec.name].items():
                    bank_A, bank_B = self.banks[s].A, self.banks[s].B
                    assert bank_A.grad is not None and bank_B.grad is not None
                    A.grad, B.grad = bank_A.grad[p.slot], bank_B.grad[p.slot]
                    params += [A, B]
                limit = self.max_grad_norm if self.max_grad_norm is not None else math.inf
                norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
                norms[p.spec.name] = float(norm)
                p.optimizer_steps += 1
            if stepping:
                self.optimizer.step()
        finally:
            for p in stepping:
                for A, B in self.views[p.spec.name].values():
                    A.grad = B.grad = None
        return norms

    def _has_grad(self, site: str) -> bool:
        bank = self.banks[site]
        return bank.A.grad is not None and bank.B.grad is not None

    def moments(self, name: str, site: str) -> list[torch.Tensor]:
        """The policy's AdamW moments at one site: [m_A, v_A, m_B, v_B] (zeros before its first step)."""
        out = []
        for view in self.views[name][site]:
            state = self.optimizer.state.get(view)
            out += (
                [state["exp_avg"], state["exp_avg_sq"]] if state else [torch.zeros_like(view) for _ in "mv"]
            )
        return out

    def set_moments(self, name: str, site: str, moments: list[torch.Tensor], steps: int) -> None:
        """Restore what `moments` returned, and the policy's step count (0: no state, as before a first step)."""
        for view, m, v in zip(self.views[name][site], moments[0::2], moments[1::2], strict=True):
            if steps == 0:
                self.optimizer.state.pop(view, None)
                continue
            self.optimizer.state[view] = {
                # where and how fused AdamW keeps it: a float32 scalar on the parameter's device
                "step": torch.tensor(float(steps), dtype=torch.float32, device=view.device),
                "exp_avg": m.to(view).clone(),
                "exp_avg_sq": v.to(view).clone(),
            }
