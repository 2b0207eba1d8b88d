"""The one GRPO training recipe: what `mint train` runs, and what the lifecycle flows run one task per step.

A run trains several policies at once over one base, each from its parent revision or a fresh adapter, on a
list of prompts per policy taken `prompts_per_step` at a time. A step is one batched rollout of every policy's
prompts (`MultiPolicyTrainer.rollout`, seeded by the step count) and one batched GRPO update; each step adds a
row per policy to the run's curve.

Checkpoints go to one directory: every `checkpoint_every` steps, at the end, and when a stop is asked for after
a step, kept two deep. Each holds the trainer's state and run.json: the run's identity (what a checkpoint must
have been made with to be continued: policies, GRPO config, seed, schedule, base, the adapters it started
from), its curve so far, and its held-out scores before training. Resuming continues the same run (another
run's checkpoint is refused, naming what differs) and ends byte for byte where an uninterrupted run does.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mint_core.data.generators import Example
from mint_core.data.rewards import dry_run, override_spec
from mint_core.data.spec import registry as task_registry
from mint_core.engine.base import load_base
from mint_core.engine.chat import prompt_ids
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.errors import MintError
from mint_core.lora.adapter import CONFIG_FILE, AdapterWeights, adapter_bytes, digest_files
from mint_core.lora.validate import read_adapter
from mint_core.rl.checkpoints import (
    is_lead_process,
    latest_checkpoint,
    pull_checkpoint,
    push_checkpoint,
    write_checkpoint,
)
from mint_core.rl.evaluate import Headroom, headroom, heldout_scores
from mint_core.rl.grpo import GRPOConfig, lr_factor
from mint_core.rl.policy import PolicySpec
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import MultiPolicyTrainer, StepStats
from mint_core.types import Site

logger = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
"""A run resumes from its newest checkpoint; the one before it is kept in case the newest is damaged."""


BUILTIN_RECIPE = GRPOConfig(group_size=8, learning_rate=1e-3, lr_decay="linear", temperature=0.7)
"""The GRPO settings that measurably train the built-in base (`make run`, `mint train`, the flows' default), with
`BUILTIN_PROMPTS_PER_STEP` prompts per step and each task's recipe hints (`recipe_spec`). Chosen by greedy exact match on
200 held-out items against the bare base (paired McNemar), `add` and `sort` trained at once (the experiments are
in the closing notes of issue #16): at a constant 1e-3 the gain peaks near step 50 and then decays, the rollout
reward falling with it; at 2e-3 it collapses; a linear decay to 0 keeps the early gain. Sampling at 0.7 rather
than 1.0 wastes fewer samples (pass@1 0.50 against 0.42 on `add`, the same pass@8) and 16 prompts per step rather
than 8 halve each update's noise. GRPO sharpens what the base can already sample: on `add` and `sort` it samples a
right answer that it does not answer greedily on 25% and 17% of the items (pass@8 - greedy); on `reverse`, `copy`
and `upper` on 3-8%, and there it gains little. The learning rate is for rank `DEFAULT_RANK`."""

DEFAULT_RANK = 8
"""LoRA rank of a policy whose task's spec sets none (`recipe.rank`); alpha = 2 x rank."""


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


BUILTIN_PROMPTS_PER_STEP = 16

BUILTIN_STEPS = 300
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


STEP_METRICS = ("reward_std", "no_signal", "pg_objective", "kl", "entropy", "clip_frac", "grad_norm")
"""What a step adds to the curve per policy beside its reward and loss (None where it took no update):
the spread of its rollout rewards, the share of its groups with no signal (all rewards equal), the clipped
surrogate objective, the k3 KL to the base, the mean -logprob of its sampled tokens (its entropy, estimated),
the share of clipped tokens and its gradient's norm before clipping (mint_core.rl.grpo, .trainer)."""


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


class ResumeError(MintError):
    """A checkpoint this run cannot continue from; names the checkpoint and what differs."""


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
) -> MultiPolicyTrainer:
    """Load the base once, onto `device` (cpu, cuda, cuda:N), and a trainer of `specs` over it. A policy with a
    parent revision (a directory) continues from it with the parent's rank, alpha and targets, whatever its spec
    says, at the `continuation` recipe's rate share and warmup (`continue_spec`; a warning names what the parent
    and the recipe overrode), the share set by its champion's headroom on the first `HEADROOM_ITEMS` of its
    `headroom_items` (the round's own prompts; none given: not measured); the engine's slots are sized for the
    largest rank of the parents and the fresh policies' specs. With a DeepSpeed config the process joins
    DeepSpeed's group, loads the base where its rank trains (its own GPU; `device` is not used), and the trainer
    is a `DeepSpeedTrainer`."""
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
    engine = Engine(base, EngineConfig(max_loras=len(specs), max_lora_rank=max(ranks)))
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


class TrainingRun:
    """A trainer, the prompts it trains on, its schedule, its curve and its checkpoints (see the module doc).

    A plain class, not a dataclass: the flows pass it to Prefect tasks, which would walk a dataclass's fields.
    """

    def __init__(
        self,
        trainer: MultiPolicyTrainer,
        prompts: dict[str, list[Example]],
        steps: int,
        prompts_per_step: int,
        checkpoint_dir: Path,
        checkpoint_every: int,
        heldout: dict[str, list[Example]] | None,
        mirror: str | None = None,
    ):
        self.trainer = trainer
        self.mirror = mirror
        """A directory or fsspec URL every host reaches where each checkpoint is also copied (None: none)."""
        self.prompts = prompts
        self.steps = steps
        self.prompts_per_step = prompts_per_step
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.heldout = heldout
        self.identity = self._identity()
        self.history: list[dict[str, Any]] = []
        """One row per step and policy: step, policy, reward, loss (None: no update), kept_groups, seconds,
        time (when the step ended, epoch seconds) and the `STEP_METRICS`."""
        self.heldout_before: dict[str, float] = {}
        """Each policy's held-out exact match before its first step (with `heldout`)."""
        self.resumed_step = 0
        """Steps restored from a checkpoint (0: a fresh run)."""
        self.resumed_checkpoint: Path | None = None
        self._rollout_t0: float | None = None

    @classmethod
    def start(
        cls,
        trainer: MultiPolicyTrainer,
        prompts: dict[str, list[Example]],
        steps: int,
        prompts_per_step: int,
        checkpoint_dir: Path,
        checkpoint_every: int = 10,
        resume: bool = True,
        heldout: dict[str, list[Example]] | None = None,
        mirror: str | None = None,
    ) -> TrainingRun:
        """A run of `steps` steps. `resume`: continue from the newest checkpoint in `checkpoint_dir` when there is
        one (it must be of this run, `ResumeError` otherwise); False: start afresh, removing the checkpoints
        there. `heldout`: examples per policy scored greedily before training (and by `heldout_scores`).
        `mirror`: where every checkpoint is also copied for other hosts; a newer checkpoint there (an attempt on
        another host got further) is pulled into `checkpoint_dir` first."""
        if steps < 1 or prompts_per_step < 1 or checkpoint_every < 0:
            raise ValueError(
                f"steps {steps} and prompts_per_step {prompts_per_step} must be >= 1, "
                f"checkpoint_every {checkpoint_every} >= 0"
            )
        short = {p: len(v) for p, v in prompts.items() if len(v) < steps * prompts_per_step}
        if set(prompts) != set(trainer.policies) or short:
            raise ValueError(
                f"a run of {steps} steps x {prompts_per_step} prompts needs {steps * prompts_per_step} prompts "
                f"for each of {sorted(trainer.policies)}; got {sorted(prompts)}, too few for {short}"
            )
        run = cls(
            trainer, prompts, steps, prompts_per_step, checkpoint_dir, checkpoint_every, heldout, mirror
        )
        if resume and mirror is not None and is_lead_process():
            pulled = pull_checkpoint(mirror, checkpoint_dir)
            if pulled is not None:
                logger.info("pulled %s from the mirror %s", pulled.name, mirror)
        ckpt = latest_checkpoint(checkpoint_dir)
        if resume and ckpt is not None:
            run._resume(ckpt)
            return run
        if ckpt is not None and is_lead_process():
            logger.info("starting afresh: removing the checkpoints in %s", checkpoint_dir)
            shutil.rmtree(checkpoint_dir)
        if heldout is not None:
            run.heldout_before = run.heldout_scores()
        return run

    # ---- one step ------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.trainer.steps >= self.steps

    def batch(self) -> dict[str, list[Example]]:
        """The prompts of the next step: the next `prompts_per_step` of each policy's."""
        s, k = self.trainer.steps, self.prompts_per_step
        return {name: examples[s * k : (s + 1) * k] for name, examples in self.prompts.items()}

    def rollout(self) -> list[RolloutRow]:
        """The next step's batched rollout of every policy."""
        self._rollout_t0 = time.perf_counter()
        return self.trainer.rollout(self.batch())

    def update(self, rows: list[RolloutRow]) -> StepStats:
        """The next step's batched GRPO update from its rollout; adds the step to the curve."""
        done = self.trainer.steps
        stats = self.trainer.update(
            rows, lr_factor(self.trainer.config.lr_decay, done, max(self.steps, done + 1))
        )
        if self._rollout_t0 is not None:
            stats.seconds = time.perf_counter() - self._rollout_t0
            self._rollout_t0 = None
        now = time.time()
        for name in self.trainer.policies:
            extra = stats.extra.get(name, {})
            self.history.append(
                {
                    "step": stats.step,
                    "policy": name,
                    "reward": stats.reward.get(name),
                    "loss": stats.loss.get(name),
                    "kept_groups": stats.kept_groups.get(name, 0),
                    "seconds": round(stats.seconds, 4),
                    "time": round(now, 3),
                    **{k: round(extra[k], 6) if k in extra else None for k in STEP_METRICS},
                }
            )
        return stats

    def step(self) -> StepStats:
        """Rollout, then update."""
        return self.update(self.rollout())

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self, step: Callable[[], object] | None = None, stop: Callable[[], bool] = lambda: False) -> bool:
        """Step until `steps` are done, checkpointing every `checkpoint_every` steps and at the end. `step` runs
        one step (default `self.step`; the flows run it as tasks). When `stop()` is true after a step, the run
        is checkpointed there and this returns False (True: finished). Every rank calls it under DeepSpeed."""
        one = step or self.step
        first = self.trainer.steps
        while not self.done:
            one()
            if stop():
                self.checkpoint()
                return False
            every = self.checkpoint_every
            if every and self.trainer.steps % every == 0 and not self.done:
                self.checkpoint()
        if self.trainer.steps > first:
            self.checkpoint()
        return True

    def checkpoint(self) -> Path:
        """The run as its newest checkpoint, written whole or not at all; the older ones beyond
        `KEEP_CHECKPOINTS` are removed."""
        record = {"args": self.identity, "before": self.heldout_before, "history": self.history}
        path = write_checkpoint(self.trainer, self.checkpoint_dir, record, keep=KEEP_CHECKPOINTS)
        if self.mirror is not None and is_lead_process():
            push_checkpoint(path, self.mirror, keep=KEEP_CHECKPOINTS)
        return path

    def heldout_scores(self) -> dict[str, float]:
        """Each policy's greedy exact match on its held-out examples now."""
        assert self.heldout is not None, "a run started without held-out examples"
        return {name: heldout_scores(self.trainer.engine, name, self.heldout[name]) for name in self.prompts}

    # ---- resume ----------------------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must have been made with for this run to continue it (`steps` may grow), flat so a
        refusal can name each difference. The adapters a policy starts from are named by their digest: the
        parent revision, or the fresh adapter the trainer's seed drew."""
        t = self.trainer
        doc: dict[str, Any] = {
            "policies": list(t.policies),
            "prompts": self.prompts_per_step,
            "seed": t.seed,
            "base": t.engine.base.fingerprint,
            "trainer": type(t).__name__,
        }
        for name, p in t.policies.items():
            for key, value in p.spec.model_dump(mode="json", exclude={"name"}).items():
                doc[f"{name} {key}"] = value
            start = digest_files(*adapter_bytes(t.weights(name), t.engine.sites))
            doc[f"{name} starts from"] = start.prefixed
        for key, value in t.config.model_dump(mode="json").items():
            doc[f"grpo {key}"] = value
        return dict(json.loads(json.dumps(doc)))  # as run.json reads back (tuples as lists)

    def _resume(self, ckpt: Path) -> None:
        """Continue from `ckpt`, refusing, before anything changes, a checkpoint of another run."""
        record_file = ckpt / "run.json"
        if not record_file.is_file():
            raise ResumeError(f"{ckpt} has no run.json: not a checkpoint of a training run")
        record = json.loads(record_file.read_text())
        then = record.get("args", {})
        changed = [f"{k} {then.get(k)} then, {v} now" for k, v in self.identity.items() if then.get(k) != v]
        if changed:
            raise ResumeError(f"{ckpt} is of another run: " + "; ".join(changed))
        done = int(json.loads((ckpt / "state.json").read_text())["steps"])
        if done > self.steps:
            raise ResumeError(f"{ckpt} is at step {done} already, beyond this run's {self.steps} steps")
        try:
            self.trainer.load_state(ckpt)
        except ValueError as e:
            raise ResumeError(f"{ckpt}: {e}") from None
        self.history = record["history"]
        self.heldout_before = record["before"]
        self.resumed_step = self.trainer.steps
        self.resumed_checkpoint = ckpt
        logger.info("resumed from %s (step %d of %d)", ckpt, self.trainer.steps, self.steps)


def dry_run_rewards(
    trainer: MultiPolicyTrainer, prompts: dict[str, list[Example]], k: int
) -> dict[str, float]:
    """Before the first step: the bare base's own completions of each policy's first `k` prompts of its own task
    (`group_size` samples each, as the rollouts sample), scored by the policy's reward; `NoRewardSignal` names the
    task whose reward gives them all one score (GRPO would learn nothing). Returns each policy's mean reward."""
    cfg = trainer.config
    out = {}
    for name, examples in prompts.items():
        own = trainer.policies[
            name
        ].spec.task  # not the replayed rows of other tasks: they have their own rewards
        exs = [e for e in [x for x in examples if x.task == own][:k] for _ in range(trainer.group_size(name))]
        params = [
            SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=1_000_003 + i)
            for i in range(len(exs))
        ]
        eng = trainer.engine
        done = eng.generate(
            [Request(prompt_ids(eng.tokenizer, e.prompt), None, p) for e, p in zip(exs, params, strict=True)]
        )
        texts = [c.text for c in done]
        spec = trainer.policies[name].spec
        task = trainer.rewarder.tasks.get(spec.task)
        if spec.reward is not None:
            task = override_spec(task, spec.reward)
        scores = dry_run(trainer.rewarder, task, exs, texts)
        out[name] = sum(scores) / len(scores)
        logger.info(
            "dry run of %s (task %s): mean reward %.3f on %d base completions",
            name,
            task.name,
            out[name],
            len(scores),
        )
    return out
