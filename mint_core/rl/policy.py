"""A policy of a training run: what it is (`PolicySpec`, the form a flow, `mint train` or the dashboard gives) and
what the trainer keeps of it (`PolicyState`: its slot, sites and AdamW step count)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mint_core.data.rewards import OVERRIDES
from mint_core.registry.address import NAME_RE
from mint_core.rl.evaluate import Headroom

MAX_RANK = 512
"""Largest LoRA rank a policy may have: the largest that either serving backend holds (vLLM's largest
`--max-lora-rank`; mint's engine goes to 1024), so a form asking for more is refused before anything trains."""


class PolicySpec(BaseModel):
    """One policy of a multi-policy run."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=f"^{NAME_RE.pattern}$")
    """Adapter name (also its MLflow registered model and catalog policy later, so spelled as a policy of an
    address: 1-128 of [A-Za-z0-9._-], starting with a letter or digit)."""
    task: str
    """Task whose prompts it trains on: the name of a registered task spec (`mint_core.data.spec`), whose rewards
    score its rollouts."""
    reward: str | None = None
    """None: the task's own rewards (its spec). Or a built-in reward over the task's `answer` column that replaces
    them for this policy: exact_match, char_overlap, well_formed, match_and_format (`mint_core.data.rewards`)."""
    rank: int = Field(8, ge=1, le=MAX_RANK)
    """LoRA rank (at most `MAX_RANK`). A policy that continues from its champion takes the champion's rank
    (`mint_core.rl.builder.continue_spec`)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha (scale = alpha / rank)."""
    learning_rate: float | None = Field(None, gt=0)
    """This policy's learning rate (default: the GRPO config's)."""
    targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """Short names of the sites it adapts."""
    replay: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of its training prompts drawn from the train splits of the tasks its task's gate guards (the spec's
    `gate.guards`; each scored with its own task's reward), so the adapter keeps answering them as the base did:
    what those guards check. 0: its own task only; a task that guards none has nothing to replay."""
    group_size: int | None = Field(None, ge=2, le=64)
    """Completions sampled per prompt of this policy (its GRPO group); None: the run's `GRPOConfig.group_size`. A
    task whose base rarely samples a right answer learns from more samples a prompt: the built-in recipe gives
    `reverse` 16 (its spec's `recipe.group_size`)."""
    rate_scale: float = Field(1.0, gt=0.0, le=1.0)
    """Multiplier on its learning rate (its own, else the run's). 1 for a first revision; a continuation from a
    champion trains at the continuation recipe's share of the rate (`mint_core.rl.builder.Continuation`)."""
    warmup_steps: int = Field(0, ge=0)
    """Its learning rate ramps up linearly over its first this many AdamW steps of the run, (k + 1) / (w + 1) at
    step k, while its moments are new: AdamW's first steps move every weight by about the full rate whatever the
    gradient's size. 0 for a first revision from a zero B; a continuation warms up (`Continuation`)."""

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, v: str | None) -> str | None:
        if v is not None and v not in OVERRIDES:
            raise ValueError(f"unknown reward {v!r}; choose from {', '.join(OVERRIDES)}, or leave it unset")
        return v


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of the rollout that precedes update `step` + 1 of a run seeded `seed`: a function of
    the step count alone, so a run resumed from a checkpoint draws what an uninterrupted run would."""
    return seed * 1_000_003 + step


@dataclass
class PolicyState:
    spec: PolicySpec
    slot: int
    sites: list[str]
    optimizer_steps: int = 0
    """AdamW steps this policy has taken (none in an update where it had no kept token)."""
    headroom: Headroom | None = None
    """What its champion measured on the round's own prompts before a continuation (`builder.load_trainer`): what
    set its rate share, and how long early stopping waits for it. None: a first revision, or not measured."""

    @property
    def scale(self) -> float:
        return self.spec.alpha / self.spec.rank
