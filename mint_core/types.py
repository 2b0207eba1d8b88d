"""The shared types at the bottom of the library: every package may import them, they import nothing of mint.

Kept free of torch and transformers, so a command that only reads the registry stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

# Parameters of fused MoE expert modules (transformers 5 stores all experts of a layer as one 3D tensor,
# [experts, out, in], applied with F.linear(x, W[e])).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Site:
    """One place a LoRA can attach: a linear layer, or one 3D expert parameter (`experts` > 0)."""

    name: str  # module path for a linear ("model.layers.0.self_attn.q_proj"), module path + "." + param for experts
    in_features: int
    out_features: int
    experts: int = 0  # 0 for a plain linear

    @property
    def module_path(self) -> str:
        return self.name.rpartition(".")[0] if self.experts else self.name

    @property
    def short(self) -> str:
        """The name PEFT matches in `target_modules` (linear) or `target_parameters` suffix (experts)."""
        return self.name.rpartition(".")[2]
