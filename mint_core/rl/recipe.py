"""The one GRPO training recipe: what `mint train` runs, and what the lifecycle flows run one task per step.

A run trains several policies at once over one base, each from its parent revision or a fresh adapter, on a
list of prompts per policy taken `prompts_per_step` at a time. A step is one batched rollout of every policy's
prompts (`MultiPolicyTrainer.rollout`, seeded by the step count) and one batched GRPO update; each step adds a
row per policy to the run's curve.

The recipe is one class in torchtune's shape, configured by `RecipeConfig`: `setup` loads the trainer
(`_setup_model`), takes the prompts (`_setup_data`), starts each policy's AdamW afresh or from the newest
checkpoint (`_setup_optimizer`); `train` runs the steps; `save_checkpoint` writes one. What it trains is built
by `builder`, with the built-in recipe's numbers from `constants`.

Checkpoints go to one directory: every `checkpoint_every` steps, at the end, and when a stop is asked for after
a step, kept two deep. Each holds the trainer's state and run.json: the run's identity (what a checkpoint must
have been made with to be continued: policies, GRPO config, seed, schedule, base, the adapters it started
from), its curve so far, and its held-out scores before training. Resuming continues the same run (another
run's checkpoint is refused, naming what differs) and ends byte for byte where an uninterrupted run does.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mint_core.data.generators import Example
from mint_core.errors import MintError
from mint_core.lora.adapter import adapter_bytes, digest_files
from mint_core.rl.builder import Continuation, dry_run_rewards, load_trainer
from mint_core.rl.checkpoints import (
    is_lead_process,
    latest_checkpoint,
    pull_checkpoint,
    push_checkpoint,
    write_checkpoint,
)
from mint_core.rl.constants import BUILTIN_PROMPTS_PER_STEP, BUILTIN_RECIPE
from mint_core.rl.evaluate import heldout_scores
from mint_core.rl.grpo import GRPOConfig, lr_factor
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe_defaults import RECIPE
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import MultiPolicyTrainer, StepStats

logger = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
"""A run resumes from its newest checkpoint; the one before it is kept in case the newest is damaged."""

STEP_METRICS = ("reward_std", "no_signal", "pg_objective", "kl", "entropy", "clip_frac", "grad_norm")
"""What a step adds to the curve per policy beside its reward and loss (None where it took no update):
the spread of its rollout rewards, the share of its groups with no signal (all rewards equal), the clipped
surrogate objective, the k3 KL to the base, the mean -logprob of its sampled tokens (its entropy, estimated),
the share of clipped tokens and its gradient's norm before clipping (mint_core.rl.grpo, .trainer)."""


class RecipeConfig(BaseModel):
    """A run of the recipe: its schedule and checkpoints, and what `_setup_model` loads when `setup` is given no
    trainer (the base, the policies, the GRPO settings, the parents they continue from)."""

    model_config = ConfigDict(extra="forbid")

    steps: int
    """GRPO steps of the run (a resumed run may have more than its checkpoint was made with)."""
    prompts_per_step: int = BUILTIN_PROMPTS_PER_STEP
    checkpoint_dir: Path
    checkpoint_every: int = 10
    """Steps between checkpoints (0: only at the end and when a stop is asked for)."""
    resume: bool = True
    """Continue from the newest checkpoint in `checkpoint_dir` (it must be of this run, `ResumeError`
    otherwise); False: start afresh, removing the checkpoints there."""
    mirror: str | None = None
    """A directory or fsspec URL every host reaches where each checkpoint is also copied (None: none); a newer
    checkpoint there (an attempt on another host got further) is pulled into `checkpoint_dir` first."""
    dry_run: int = 0
    """Before a first step, the reward's dry run on this many prompts per policy (`dry_run_rewards`; 0: none)."""
    base: Path | None = None
    """The base model's directory (None: `setup` is given the trainer)."""
    policies: list[PolicySpec] = Field(default_factory=list)
    grpo: GRPOConfig = BUILTIN_RECIPE
    seed: int = 0
    parents: dict[str, Path | None] = Field(default_factory=dict)
    """Each policy's parent revision (a directory; None or absent: a fresh adapter)."""
    device: str = "cpu"
    deepspeed: Path | None = None
    """A DeepSpeed config: the run trains under DeepSpeed (`load_trainer`)."""
    continuation: Continuation | None = None
    """How a policy with a parent continues from it (None: `Continuation()`)."""
    compile_decode: bool = RECIPE.compile_decode
    """Roll out through the engine's compiled decode step (`EngineConfig.compile_decode`)."""


class ResumeError(MintError):
    """A checkpoint this run cannot continue from; names the checkpoint and what differs."""


class TrainingRun:
    """The recipe: a trainer, the prompts it trains on, its schedule, its curve and its checkpoints (see the
    module doc).

    A plain class, not a dataclass: the flows pass it to Prefect tasks, which would walk a dataclass's fields.
    """

    def __init__(self, config: RecipeConfig):
        self.config = config
        self.steps = config.steps
        self.prompts_per_step = config.prompts_per_step
        self.checkpoint_dir = config.checkpoint_dir
        self.checkpoint_every = config.checkpoint_every
        self.mirror = config.mirror
        self.trainer: MultiPolicyTrainer
        self.prompts: dict[str, list[Example]] = {}
        """Each policy's prompts, the next step's taken from them by `batch` (a frozen policy has none)."""
        self.heldout: dict[str, list[Example]] | None = None
        self.identity: dict[str, Any] = {}
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
        """A run of `steps` steps of a trainer already loaded, set up (see `RecipeConfig` for the rest)."""
        config = RecipeConfig(
            steps=steps,
            prompts_per_step=prompts_per_step,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            resume=resume,
            mirror=mirror,
        )
        run = cls(config)
        run.setup(prompts, heldout, trainer)
        return run

    # ---- setup ---------------------------------------------------------------------------------------

    def setup(
        self,
        prompts: dict[str, list[Example]],
        heldout: dict[str, list[Example]] | None = None,
        trainer: MultiPolicyTrainer | None = None,
    ) -> None:
        """Everything before the first step: the trainer (`trainer`, else `_setup_model`), the prompts, each
        policy's adapter and AdamW afresh or from the newest checkpoint, then for a fresh run the held-out
        scores before training (`heldout`: examples per policy, scored greedily) and the reward's dry run."""
        c = self.config
        if c.steps < 1 or c.prompts_per_step < 1 or c.checkpoint_every < 0:
            raise ValueError(
                f"steps {c.steps} and prompts_per_step {c.prompts_per_step} must be >= 1, "
                f"checkpoint_every {c.checkpoint_every} >= 0"
            )
        self.trainer = trainer if trainer is not None else self._setup_model(prompts)
        self._setup_data(prompts, heldout)
        self.identity = self._identity()
        if self._setup_optimizer():
            return
        if heldout is not None:
            self.heldout_before = self.heldout_scores()
        if c.dry_run and self.trainer.steps == 0:
            dry_run_rewards(self.trainer, prompts, c.dry_run)

    def _setup_model(self, prompts: dict[str, list[Example]]) -> MultiPolicyTrainer:
        """The base and a trainer of the config's policies over it (`load_trainer`), a continuing champion's
        headroom measured on its own task's prompts (not the replayed rows of other tasks)."""
        c = self.config
        if c.base is None:
            raise ValueError("a recipe with no base to load needs a trainer")
        own = {s.name: [e for e in prompts[s.name] if e.task == s.task] for s in c.policies}
        return load_trainer(
            c.base,
            c.policies,
            c.grpo,
            c.seed,
            c.parents,
            deepspeed=c.deepspeed,
            device=c.device,
            continuation=c.continuation,
            headroom_items=own,
            compile_decode=c.compile_decode,
        )

    def _setup_data(
        self, prompts: dict[str, list[Example]], heldout: dict[str, list[Example]] | None
    ) -> None:
        """Take each policy's prompts, enough of them for every step."""
        steps, k = self.steps, self.prompts_per_step
        short = {p: len(v) for p, v in prompts.items() if len(v) < steps * k}
        if set(prompts) != set(self.trainer.policies) or short:
            raise ValueError(
                f"a run of {steps} steps x {k} prompts needs {steps * k} prompts "
                f"for each of {sorted(self.trainer.policies)}; got {sorted(prompts)}, too few for {short}"
            )
        self.prompts = prompts
        self.heldout = heldout

    def _setup_optimizer(self) -> bool:
        """Each policy's adapter and AdamW moments from the newest checkpoint (`resume`; pulled from the mirror
        first when the mirror has a newer one), or afresh, removing the checkpoints there; True: resumed."""
        c = self.config
        if c.resume and c.mirror is not None and is_lead_process():
            pulled = pull_checkpoint(c.mirror, c.checkpoint_dir)
            if pulled is not None:
                logger.info("pulled %s from the mirror %s", pulled.name, c.mirror)
        ckpt = latest_checkpoint(c.checkpoint_dir)
        if c.resume and ckpt is not None:
            self._resume(ckpt)
            return True
        if ckpt is not None and is_lead_process():
            logger.info("starting afresh: removing the checkpoints in %s", c.checkpoint_dir)
            shutil.rmtree(c.checkpoint_dir)
        return False

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

    def train(
        self, step: Callable[[], object] | None = None, stop: Callable[[], bool] = lambda: False
    ) -> bool:
        """Step until `steps` are done, checkpointing every `checkpoint_every` steps and at the end. `step` runs
        one step (default `self.step`; the flows run it as tasks). When `stop()` is true after a step, the run
        is checkpointed there and this returns False (True: finished). Every rank calls it under DeepSpeed."""
        one = step or self.step
        first = self.trainer.steps
        while not self.done:
            one()
            if stop():
                self.save_checkpoint()
                return False
            every = self.checkpoint_every
            if every and self.trainer.steps % every == 0 and not self.done:
                self.save_checkpoint()
        if self.trainer.steps > first:
            self.save_checkpoint()
        return True

    def save_checkpoint(self) -> Path:
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

    def freeze(self, names: list[str]) -> None:
        """Leave policies out of the next rollouts, and so out of the updates: their adapters stay as they are
        (`batch` takes the prompts of the policies in `prompts`)."""
        for name in names:
            self.prompts.pop(name, None)

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
