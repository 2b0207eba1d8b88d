"""The built-in recipe's numbers, each with the measurements that chose it.

What `mint train`, the main job and the flows train with unless told otherwise: the GRPO settings, the schedule
of a first revision, and the continuation recipe's rate shares and warmups (`builder.Continuation`). The
experiments are in the closing notes of the issues cited and in docs/training.md.
"""

from __future__ import annotations

from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.recipe_defaults import RECIPE

BUILTIN_RECIPE = GRPOConfig(**RECIPE.grpo_fields())
"""The GRPO settings that measurably train the built-in base (`make run`, `mint train`, the flows' default), with
`BUILTIN_PROMPTS_PER_STEP` prompts per step and each task's recipe hints (`recipe_spec`). Chosen by greedy exact match on
200 held-out items against the bare base (paired McNemar), `add` and `sort` trained at once (the experiments are
in the closing notes of issue #16): at a constant 1e-3 the gain peaks near step 50 and then decays, the rollout
reward falling with it; at 2e-3 it collapses; a linear decay to 0 keeps the early gain. Sampling at 0.7 rather
than 1.0 wastes fewer samples (pass@1 0.50 against 0.42 on `add`, the same pass@8) and 16 prompts per step rather
than 8 halve each update's noise. GRPO sharpens what the base can already sample: on `add` and `sort` it samples a
right answer that it does not answer greedily on 25% and 17% of the items (pass@8 - greedy); on `reverse`, `copy`
and `upper` on 3-8%, and there it gains little. The learning rate is for rank `DEFAULT_RANK`."""

DEFAULT_RANK = RECIPE.rank
"""LoRA rank of a policy whose task's spec sets none (`recipe.rank`); alpha = 2 x rank."""


BUILTIN_PROMPTS_PER_STEP = RECIPE.prompts_per_step

BUILTIN_STEPS = RECIPE.steps
"""Steps of a policy's first revision with the built-in recipe (the main job's first wave, `mint train`). On the
AVX2-pinned built-in base (`mint_core.engine.cpu_pin`: `add` 0.495, `sort` 0.76), `add` and `sort` trained at
once, gains on 200 held-out items (`benchmarks/grpo_learning.py`), both at rank 8:
- 100 steps: `add` +0.08 and +0.10, `sort` +0.07 and +0.075;
- 200 steps: `add` +0.095 to +0.115, `sort` +0.095 to +0.11 (four rounds);
- 300 steps: `add` +0.095 and +0.115, `sort` +0.135 and +0.15 (p < 1e-6).
The linear decay spreads over more updates, so the late small steps keep the early gain and add to it; `sort`
keeps gaining, `add` does not (its spec's `recipe.rank` says why it trains at 32). About 0.5 s a step for the two policies on this 2-core
machine."""


CONTINUE_RATE_SCALE = 0.25
"""A continuation's share of its first revision's rate (`Continuation.rate_scale`)."""

CONTINUE_WARMUP = 10
"""A continuation's warmup, in steps (`Continuation.warmup_steps`)."""

HEADROOM_GAP = 0.10
"""The headroom (pass@G - greedy on the round's prompts) from which a continuation trains at
`HEADROOM_RATE_SCALE` instead of `CONTINUE_RATE_SCALE` (`Continuation.min_headroom`)."""

HEADROOM_RATE_SCALE = 1.0
"""A continuation's share of the rate when its champion has headroom (`Continuation.headroom_rate_scale`)."""

HEADROOM_WARMUP = 50
"""A continuation's warmup when its champion has headroom (`Continuation.headroom_warmup_steps`): at the full rate
a 10-step warmup dipped the fresh clone's `shout` champion (0.419) by 0.10-0.125 by step 20-50 in two seeds of
three; over 50 steps, one of three, and the others ended +0.031 and +0.047 (p 0.02) after 200 steps."""

HEADROOM_ITEMS = 128
"""Own-task prompts of a continuation's round on which its champion's headroom is measured (`Continuation`)."""
