"""The built-in training recipe's default values, in one place: what `mint train`, `mint run` (the main job), the
flows' forms and `mint_core.rl.recipe` all start from.

Free of torch (pydantic only), so the command line can render its defaults and help from it without loading the
trainer. Why each value is what it is (the measurements behind them) is written beside the constants read from them,
`mint_core.rl.constants` (`BUILTIN_RECIPE`, `BUILTIN_STEPS`, `DEFAULT_RANK`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class RecipeDefaults(BaseModel):
    """The built-in recipe: the GRPO settings that measurably train the built-in base, and the run's size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(300, ge=1)
    """GRPO steps of a policy's first revision (`mint train`, the main job's first wave)."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per policy per step, each sampled `group_size` times."""
    group_size: int = Field(8, ge=2)
    """GRPO group size G: samples per prompt."""
    learning_rate: float = Field(1e-3, gt=0)
    """AdamW learning rate at rank `rank` (scaled by sqrt(rank / r) at another rank r)."""
    lr_decay: Literal["none", "linear", "cosine"] = "linear"
    """The learning rate over the run: from `learning_rate` at the first step towards 0 after the last."""
    temperature: float = Field(0.7, gt=0)
    """Sampling temperature of the rollouts."""
    rank: int = Field(8, ge=1)
    """LoRA rank of a policy whose task's spec sets none (`recipe.rank`); alpha = 2 x rank."""
    heldout: int = Field(200, ge=20)
    """Held-out prompts per policy that `mint train` scores before and after training (paired test)."""
    seed: int = 0
    """Seeds the draw of the prompts, the adapters' initialisation and the rollouts."""
    compile_decode: bool = False
    """Roll out through the engine's compiled decode step: off, because its compile (about 27 s on a 2-core CPU
    with a cold cache) costs more than it saves in the built-in run's 300 short steps."""

    def grpo_fields(self) -> dict[str, Any]:
        """The fields of `mint_core.rl.grpo.GRPOConfig` this recipe sets (the rest keep GRPOConfig's defaults)."""
        return {
            "group_size": self.group_size,
            "learning_rate": self.learning_rate,
            "lr_decay": self.lr_decay,
            "temperature": self.temperature,
        }


RECIPE = RecipeDefaults()
"""The built-in recipe's defaults."""
