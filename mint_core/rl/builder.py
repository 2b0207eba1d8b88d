"""What a run of the recipe trains, built before its first step: each policy's spec (`recipe_spec`, and
`continue_spec` for one that continues from its champion, by the `Continuation` recipe), the trainer over one
loaded base (`load_trainer`), and the reward's dry run on the bare base (`dry_run_rewards`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mint_core.data.generators import Example
from mint_core.data.rewards import Rewarder, check_signal, override_spec
from mint_core.data.spec import TaskSpec
from mint_core.data.spec import registry as task_registry
from mint_core.engine.base import load_base
from mint_core.engine.chat import prompt_ids
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.lora.adapter import CONFIG_FILE, AdapterWeights
from mint_core.lora.validate import read_adapter
from mint_core.rl.constants import (
    BUILTIN_RECIPE,
    CONTINUE_RATE_SCALE,
    CONTINUE_WARMUP,
    DEFAULT_RANK,
    HEADROOM_GAP,
    HEADROOM_ITEMS,
    HEADROOM_RATE_SCALE,
    HEADROOM_WARMUP,
)
from mint_core.rl.evaluate import Headroom, headroom
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe_defaults import RECIPE
from mint_core.rl.trainer import MultiPolicyTrainer
from mint_core.types import Site

logger = logging.getLogger(__name__)


def recipe_spec(
    name: str, task: str, rank: int | None = None, learning_rate: float = BUILTIN_RECIPE.learning_rate
) -> PolicySpec:
    """A policy of the recipe for a registered task: the rank, group size and replay its spec's `recipe:`
    section asks for (`mint_core.data.spec.RecipeSpec`; a rank given here wins), alpha = 2 x rank, and
    `learning_rate` (the rate for rank `DEFAULT_RANK`) scaled by sqrt(DEFAULT_RANK / rank). AdamW moves each of
    the rank's directions by about the rate, so the product B A moves about sqrt(rank) times as far per step; the
    scaling keeps that per-step change about the same (rank 16 at 1e-3 gained less than rank 8; rank 32 at 5e-4
    more). At `DEFAULT_RANK` the policy has no rate of its own and trains at the run's."""
    hints = task_registry().get(task).recipe
    r = rank if rank is not None else hints.rank or DEFAULT_RANK
    lr = None if r == DEFAULT_RANK else learning_rate * math.sqrt(DEFAULT_RANK / r)
    return PolicySpec(
        name=name,
        task=task,
        rank=r,
        alpha=2.0 * r,
        learning_rate=lr,
        replay=hints.replay,
        group_size=hints.group_size,
    )


class Continuation(BaseModel):
    """How a policy trains when it continues from its champion rather than from a fresh adapter (issue #33).

    A continuation starts from the exported adapter alone: a PEFT revision carries no optimizer state, so AdamW's
    moments start again, and its first steps move every weight by about the full rate whatever the gradient
    (`benchmarks/continuation_diagnosis.py`: at the first revision's rate, the first continuation updates were
    larger than the first wave's, a quarter to a third of the champion's greedy answers changed within 10 steps,
    and the probe fell 0.628 -> 0.566). So a continuation trains at `rate_scale` of the rate, warmed up over its
    first `warmup_steps` steps, and decays linearly as a first revision does. Recorded on the MLflow run (the
    `policy` parameter's `rate_scale` and `warmup_steps`, and `continuation`)."""

    model_config = ConfigDict(extra="forbid")

    rate_scale: float = Field(CONTINUE_RATE_SCALE, gt=0.0, le=1.0)
    """Share of the policy's rate a continuation trains at (`PolicySpec.rate_scale`), when its champion has no
    headroom (below `min_headroom`) or none was measured."""
    warmup_steps: int = Field(CONTINUE_WARMUP, ge=0)
    """Steps over which a continuation's rate ramps up from 1/(w+1) of it (`PolicySpec.warmup_steps`)."""
    min_headroom: float | None = Field(HEADROOM_GAP, ge=0.0, le=1.0)
    """A champion whose pass@G exceeds its greedy exact match by at least this much on the round's own prompts
    (`mint_core.rl.evaluate.headroom`, G the group size) has room to grow, and continues at
    `headroom_rate_scale`; below it, it is saturated and continues at `rate_scale`. None: never measured."""
    headroom_rate_scale: float = Field(HEADROOM_RATE_SCALE, gt=0.0, le=1.0)
    """Share of the rate a continuation of a champion with headroom trains at."""
    headroom_warmup_steps: int = Field(HEADROOM_WARMUP, ge=0)
    """Its warmup, in steps: longer than `warmup_steps`, since it ramps up to the full rate."""

    def has_room(self, room: Headroom | None) -> bool:
        """Whether a champion that measured `room` has room to grow (None: not measured, so no)."""
        return room is not None and self.min_headroom is not None and room.gap >= self.min_headroom - 1e-9

    def rate_for(self, room: Headroom | None) -> float:
        """The rate share of a continuation whose champion measured `room` (None: not measured)."""
        return self.headroom_rate_scale if self.has_room(room) else self.rate_scale


def parent_rank(parent: Path) -> int | None:
    """The rank a parent revision's adapter_config.json (PEFT's `r`) names, read before any engine is sized for
    it; None when it names none (`read_adapter` then says what is wrong with the revision)."""
    try:
        rank = json.loads((parent / CONFIG_FILE).read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1 else None


def continue_spec(
    spec: PolicySpec,
    parent: AdapterWeights,
    sites: dict[str, Site],
    learning_rate: float,
    continuation: Continuation | None = None,
    room: Headroom | None = None,
) -> PolicySpec:
    """The spec a policy trains with when it continues from its parent revision: the parent's rank, alpha and
    targets (its tensors fix them), whatever `spec` asks for, and the continuation recipe's rate share and
    warmup (`Continuation`; set, not compounded, so a spec read back from a continued champion gets the same).
    Where the rank changes, the policy's rate (its own, else the run's `learning_rate`) is scaled by
    sqrt(spec.rank / parent.rank), as `recipe_spec` scales the rate for a rank: a form at rank 8 and the run's
    rate continues a rank-32 champion at half that rate, the rate `recipe_spec` gives rank 32."""
    targets = list(dict.fromkeys(sites[n].short for n in sites if n in parent.tensors))
    cont = continuation or Continuation()
    update: dict[str, Any] = {}
    rate_scale = cont.rate_for(room)
    warmup = cont.headroom_warmup_steps if cont.has_room(room) else cont.warmup_steps
    if spec.rate_scale != rate_scale:
        update["rate_scale"] = rate_scale
    if spec.warmup_steps != warmup:
        update["warmup_steps"] = warmup
    if set(targets) != set(spec.targets):
        update["targets"] = targets
    if parent.alpha != spec.alpha:
        update["alpha"] = parent.alpha
    if parent.rank != spec.rank:
        rate = spec.learning_rate if spec.learning_rate is not None else learning_rate
        update["rank"] = parent.rank
        update["learning_rate"] = rate * math.sqrt(spec.rank / parent.rank)
    return spec.model_copy(update=update)


CONTINUATION_FIELDS = ("rate_scale", "warmup_steps")
"""The spec fields a continuation sets from its recipe (`Continuation`), whatever a form asked."""


def spec_changes(asked: PolicySpec, trained: PolicySpec) -> list[str]:
    """What its parent made a policy train with that its spec did not ask for, one "field: asked -> trained"
    each; not the continuation recipe's fields (`CONTINUATION_FIELDS`), which every continuation sets."""
    a, t = asked.model_dump(), trained.model_dump()
    return [f"{k}: {a[k]} -> {t[k]}" for k in a if a[k] != t[k] and k not in CONTINUATION_FIELDS]


def load_trainer(
    base_dir: Path,
    specs: list[PolicySpec],
    grpo: GRPOConfig,
    seed: int = 0,
    parents: dict[str, Path | None] | None = None,
    deepspeed: Path | None = None,
    device: str = "cpu",
    continuation: Continuation | None = None,
    headroom_items: dict[str, list[Example]] | None = None,
    compile_decode: bool = RECIPE.compile_decode,
) -> MultiPolicyTrainer:
    """Load the base once, onto `device` (cpu, cuda, cuda:N), and a trainer of `specs` over it. A policy with a
    parent revision (a directory) continues from it with the parent's rank, alpha and targets, whatever its spec
    says, at the `continuation` recipe's rate share and warmup (`continue_spec`; a warning names what the parent
    and the recipe overrode), the share set by its champion's headroom on the first `HEADROOM_ITEMS` of its
    `headroom_items` (the round's own prompts; none given: not measured); the engine's slots are sized for the
    largest rank of the parents and the fresh policies' specs. With a DeepSpeed config the process joins
    DeepSpeed's group, loads the base where its rank trains (its own GPU; `device` is not used), and the trainer
    is a `DeepSpeedTrainer`. `compile_decode`: the engine's rollouts run its compiled decode step
    (`EngineConfig.compile_decode`)."""
    found = {name: path for name, path in (parents or {}).items() if path is not None}
    ranks = [parent_rank(found[s.name]) or s.rank if s.name in found else s.rank for s in specs]
    if deepspeed is None:
        base = load_base(base_dir, device=device)
    else:
        # only a DeepSpeed run imports deepspeed: seconds to import, and it picks an accelerator when it does
        from mint_core.rl import distributed

        distributed.init_distributed()
        base = load_base(base_dir, *distributed.rank_placement())
    # prompts up to the base's own positions (the engine's default, clamped by the base)
    engine = Engine(
        base, EngineConfig(max_loras=len(specs), max_lora_rank=max(ranks), compile_decode=compile_decode)
    )
    trained = []
    rooms: dict[str, Headroom | None] = {}
    for spec in specs:
        parent = found.get(spec.name)
        if parent is None:
            trained.append(spec)
            continue
        weights = read_adapter(parent, engine.spec, name=spec.name)
        engine.add_adapter(spec.name, weights)
        room = None
        items = [e for e in (headroom_items or {}).get(spec.name, []) if e.answer][:HEADROOM_ITEMS]
        if items and (continuation or Continuation()).min_headroom is not None:
            room = _champion_headroom(engine, spec, items, grpo, seed)
        cont = continue_spec(spec, weights, engine.sites, grpo.learning_rate, continuation, room)
        changed = spec_changes(spec, cont)
        if changed:
            logger.warning("%s continues from its parent at %s: %s", spec.name, parent, "; ".join(changed))
        trained.append(cont)
        rooms[spec.name] = room
    if deepspeed is None:
        trainer: MultiPolicyTrainer = MultiPolicyTrainer(engine, grpo, trained, seed=seed)
    else:
        trainer = distributed.DeepSpeedTrainer(engine, grpo, trained, deepspeed, seed=seed)
    for name, room in rooms.items():
        trainer.policies[name].headroom = room
    return trainer


def _champion_headroom(
    engine: Engine, spec: PolicySpec, items: list[Example], grpo: GRPOConfig, seed: int
) -> Headroom:
    """What the champion in the policy's slot measures on `items` (`evaluate.headroom`), logged."""
    group = spec.group_size or grpo.group_size
    room = headroom(engine, spec.name, items, group, grpo.temperature, grpo.max_new_tokens, seed)
    logger.info(
        "%s's champion on %d of its round's prompts: greedy %.3f, pass@%d %.3f (headroom %+.3f)",
        spec.name,
        room.items,
        room.greedy,
        group,
        room.pass_k,
        room.gap,
    )
    return room


DRY_RUN_ROUNDS = 4
"""Rounds of `k` more prompts the reward's dry run samples while every completion so far scored the same, before it
refuses the reward: a hard task's base may miss every answer of its first few prompts (seen: the built-in `reverse`,
all 64 of its first 8 prompts' completions well formed and wrong on one CPU), where a broken reward or answer column
gives one score however many prompts are tried."""


def sample_signal(
    engine: Engine,
    rewarder: Rewarder,
    task: TaskSpec,
    examples: list[Example],
    k: int,
    group: int,
    sampling: Callable[[int], SamplingParams],
    render: Callable[[Any], str | list[int]],
) -> list[float]:
    """The reward's dry run: the bare base's completions of the first `k` of `examples`, `group` samples each (the
    i-th completion sampled with `sampling(i)`, its prompt rendered by `render`), scored by `task`'s reward; while
    every score is the same, `k` more examples, up to DRY_RUN_ROUNDS rounds. Returns the scores; `NoRewardSignal`
    (naming the task and how many completions it scored) when they are still all one."""
    texts: list[str] = []
    scores: list[float] = []
    for r in range(DRY_RUN_ROUNDS):
        more = [e for e in examples[r * k : (r + 1) * k] for _ in range(group)]
        if not more:
            break
        reqs = [Request(render(e.prompt), None, sampling(len(texts) + j)) for j, e in enumerate(more)]
        new = [c.text for c in engine.generate(reqs)]
        texts += new
        scores += rewarder.score_task(task, more, new)
        if len(set(scores)) > 1:
            break
    check_signal(task, scores, texts)
    return scores


def dry_run_rewards(
    trainer: MultiPolicyTrainer, prompts: dict[str, list[Example]], k: int
) -> dict[str, float]:
    """Before the first step: the bare base's own completions of each policy's first `k` prompts of its own task
    (`group_size` samples each, as the rollouts sample), scored by the policy's reward; while they all score the
    same, `k` more prompts, up to DRY_RUN_ROUNDS rounds (`sample_signal`); `NoRewardSignal` names the task whose
    reward still gives them all one score (GRPO would learn nothing). Returns each policy's mean reward."""
    cfg = trainer.config
    eng = trainer.engine
    out = {}
    for name, examples in prompts.items():
        spec = trainer.policies[name].spec
        own = [x for x in examples if x.task == spec.task]  # not the replayed rows of other tasks
        task = trainer.rewarder.tasks.get(spec.task)
        if spec.reward is not None:
            task = override_spec(task, spec.reward)
        scores = sample_signal(
            eng,
            trainer.rewarder,
            task,
            own,
            k,
            trainer.group_size(name),
            lambda i: SamplingParams(
                max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=1_000_003 + i
            ),
            lambda p: prompt_ids(eng.tokenizer, p),
        )
        out[name] = sum(scores) / len(scores)
        logger.info(
            "dry run of %s (task %s): mean reward %.3f on %d base completions",
            name,
            task.name,
            out[name],
            len(scores),
        )
    return out
