"""A lifecycle's parameters, which the dashboard shows as its form (`PolicyRun`, `Training`), and what a wave
reports (`PolicyOutcome`, `WaveReport`); flows/lifecycle.py runs them."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from flows.canary import CanaryOutcome
from mint_core.data.spec import registry_in
from mint_core.eval.early_stop import EarlyStop, ProbePoint
from mint_core.eval.gate import GateDecision, GatePolicy, SuiteScore
from mint_core.registry.address import NAME_RE
from mint_core.rl.builder import Continuation
from mint_core.rl.constants import BUILTIN_RECIPE
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe_defaults import RECIPE
from tasks.canary import CanaryConfig

# ---- parameters (the dashboard's form) ---------------------------------------------------------------------


class PolicyRun(BaseModel):
    """One policy of a run: what it trains on, how it is gated, the name it is served under."""

    model_config = ConfigDict(extra="forbid")

    spec: PolicySpec
    """Name (the MLflow registered model), task, reward, rank, alpha, learning rate, targets."""
    gate: GatePolicy | None = None
    """When its candidate may replace its champion; default: what its task's spec declares (its `gate:`
    section: the guards, the margins), else a significant gain of at least `min_effect` on its own task's suite
    (exact McNemar). Fields a form leaves unset take the spec's. Every other registered task's suite is scored
    too and shown beside the decision, not gating (`GatePolicy.info_suites`)."""
    served_name: str | None = Field(None, pattern=f"^{NAME_RE.pattern}$")
    """Adapter name the champion is served under (default: the policy's name)."""
    canary: CanaryConfig | None = None
    """Promote through a canary: once the gate passes the candidate, it answers `canary.share` of the policy's
    users beside the champion, and the online test on their answers' scores promotes it or rolls it back
    (flows/canary.py). None: the gate's pass promotes at once."""
    rejected: int = Field(0, ge=0)
    """Candidates of this policy the gate rejected in a row since its champion (`retrain` reads it from the
    registry). With `training.early_stop`, from `early_stop.after_rejections` on, the policy gets one probe to
    show a gain, else it is skipped."""

    @model_validator(mode="after")
    def _known_task(self, info: ValidationInfo) -> PolicyRun:
        # checked when the run's parameters are, before anything trains: a typo fails the run at once
        reg = registry_in(info.context)
        known = reg.names()
        if self.spec.task not in known:
            raise ValueError(
                f"spec.task: unknown task {self.spec.task!r}; registered: {', '.join(known)} (a task is a spec "
                f"file in a task folder: {', '.join(str(d) for d in reg.dirs)})"
            )
        return self

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def served(self) -> str:
        return self.served_name or self.spec.name

    def gate_policy(self) -> GatePolicy:
        return self.gate or GatePolicy(suite=self.spec.task)


def _one_run_each(runs: list[PolicyRun]) -> list[PolicyRun]:
    # one slot and one served name per policy: a repeat fails the run before anything trains
    for what, names in (("spec.name", [r.name for r in runs]), ("served_name", [r.served for r in runs])):
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"{what} {', '.join(map(repr, repeated))} given more than once")
    return runs


Policies = Annotated[list[PolicyRun], Field(min_length=1), AfterValidator(_one_run_each)]
"""A wave's policies: at least one, each named (and served) once."""


class Training(BaseModel):
    """The GRPO run of a lifecycle."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(8, ge=1)
    """GRPO steps (k): rollout -> check -> update, for every policy at once (mint_core.rl.recipe)."""
    prompts_per_step: int = Field(RECIPE.prompts_per_step, ge=1)
    """Prompts per policy per step (each sampled `grpo.group_size` times)."""
    grpo: GRPOConfig = BUILTIN_RECIPE
    """Sampling, loss and optimiser settings (default: what trains the built-in base, `rl.constants.BUILTIN_RECIPE`)."""
    seed: int = RECIPE.seed
    """With the round, seeds the draw of the prompts, the adapters' initialisation and the rollouts
    (`mint_core.lifecycle.prompts.round_seed`): each round trains on new prompts and samples."""
    data_dir: Path | None = Path("data/tasks")
    """The DVC `task_data` output (train/<task>.jsonl, heldout/<task>.jsonl); None generates the prompts from
    `seed` (only with `draw="train"` and no `early_stop`: leaving the held-out prompts out needs them)."""
    draw: Literal["train", "fresh"] = "train"
    """Where a round's prompts come from. "train": drawn by the round from `data_dir`/train (the examples the
    built-in base was pretrained on, one fixed pool of 5000 a task). "fresh": new ones from the task generators
    at the round's seed (`mint_core.lifecycle.prompts.round_seed`, recorded as the run's `fresh_seed`), leaving out
    every held-out and eval-suite prompt and the early-stop probe's, so evaluation stays honest."""
    early_stop: EarlyStop | None = None
    """Probe each policy's held-out reward every few steps and stop it when that does not rise (`EarlyStop`); a
    policy stopped without gain is not exported or gated. None: every policy trains every step."""
    round: str | None = None
    """Names this training round: runs with the same parameters and round are one run, so a rerun makes no
    second version. Default: today's UTC date, so a daily schedule trains once a day."""
    checkpoint_every: int = Field(1, ge=0)
    """Checkpoint the run every this many steps and at its end (a killed run resumes from the newest); 0: only
    at the end."""
    continuation: Continuation = Continuation()
    """How a policy that continues from its champion trains: its share of the rate and its warmup (the
    default keeps a continuation's first steps from undoing the champion: `rl.builder.Continuation`)."""
    compile_decode: bool = RECIPE.compile_decode
    """Roll out through a compiled decode step (Llama, Mistral and Qwen2 bases; `mint_core.engine.compiled_decode`):
    the same tokens, each step's decode faster, after a compile of tens of seconds on a small CPU (seconds once
    its cache is warm) at the run's first step. Worth it for runs of hundreds of steps and more; a base it does
    not cover fails the run's setup with the reason."""
    dry_run: int = Field(8, ge=0)
    """Before the first step, score the bare base's own completions of this many prompts per policy
    (`grpo.group_size` samples each) and refuse to train, naming the task, when its reward gives them all one
    score: GRPO would have no signal. 0 skips it (a plumbing test on a random base)."""

    def round_name(self) -> str:
        return self.round or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")

    def key_round(self) -> str:
        """The round as the run's idempotency key names it: its name, and the draw and early stop where they are
        not the defaults (they change what trains, so a run with others is another run)."""
        extra = [] if self.draw == "train" else [f"draw={self.draw}"]
        if self.early_stop is not None:
            extra.append(f"early_stop={self.early_stop.model_dump_json()}")
        if self.continuation != Continuation():
            extra.append(f"continuation={self.continuation.model_dump_json()}")
        return "|".join([self.round_name(), *extra])


class StepTiming(BaseModel):
    step: str
    wall_s: float
    """Around the task call, in the flow."""
    work_s: float | None
    """The mint_core work inside the task; wall - work is Prefect's overhead."""


Status = Literal["promoted", "rejected", "unchanged", "failed", "stopped"]
""""stopped": early stopping ended its training without a gain on the probe; nothing was exported or gated."""


class PolicyOutcome(BaseModel):
    policy: str
    status: Status
    candidate: str | None
    champion_before: str | None
    champion_after: str | None
    reused: bool = False
    """The candidate came from an earlier run with the same idempotency key (nothing was trained)."""
    reasons: list[str] = Field(default_factory=list)
    decision: GateDecision | None = None
    """The gate's decision, every check with its effect, CI, p-value and n (None: the gate did not run)."""
    scores: dict[str, dict[str, SuiteScore]] = Field(default_factory=dict)
    """Suite scores by side: "candidate", and "champion" or "base" (what it was compared with)."""
    gain: float | None = None
    """The candidate's paired effect on its own suite over its baseline (the gate's `gain:<suite>`); for a
    "stopped" policy, its probe's change from step 0 to the stop. None: not measured."""
    p_value: float | None = None
    """Exact two-sided McNemar p of `gain`."""
    gain_on: str | None = None
    """Where `gain` was measured: `suite:<name>` (the gate's items) or `probe` (the early-stop probe's)."""
    steps: int | None = None
    """GRPO steps this policy trained in this run (None: its candidate was reused, nothing trained)."""
    stop_reason: str | None = None
    """Why its training ended: "finished" (all steps), "plateau" (rose, then flat) or "no gain", with the
    probe's numbers; or that the candidate was reused."""
    probe: list[ProbePoint] = Field(default_factory=list)
    """The early-stop probe's score per probed step (empty: no early stop)."""
    canary: CanaryOutcome | None = None
    """The canary's decision and evidence, for a policy promoted through one (`PolicyRun.canary`)."""

    def summary(self) -> dict[str, Any]:
        """The row of the per-policy tables: status, gain, p, steps, why training stopped."""
        return {
            "policy": self.policy,
            "status": self.status,
            "gain": None if self.gain is None else round(self.gain, 4),
            "p_value": None if self.p_value is None else float(f"{self.p_value:.4g}"),
            "gain_on": self.gain_on,
            "steps": self.steps,
            "stop_reason": self.stop_reason,
            "candidate": self.candidate,
            "champion_after": self.champion_after,
        }


class WaveReport(BaseModel):
    outcomes: list[PolicyOutcome]
    curve: list[dict[str, Any]]
    """Per step and policy: mean reward, loss, groups kept."""
    timings: list[StepTiming]
    resumed_from: int = 0
    """Steps restored from a checkpoint of an earlier attempt."""


class WaveFailed(RuntimeError):
    """Some policies of a wave failed; the others finished."""
