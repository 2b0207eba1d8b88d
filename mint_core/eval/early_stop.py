"""Early stopping: stop training a policy whose greedy probe on a few held-out items does not rise.

Every few steps (`EarlyStop.every`) each policy still training is scored greedily on its probe items
(`take_probe`), and its rule (`Plateau`) decides whether it stops: no rise within `patience` probes, or a fall
below where it started beyond noise. A stopped policy leaves the run's next steps (`TrainingRun.freeze`), and one that gained
nothing is not exported, evaluated or gated. `EarlyStopping` holds one run's rules and its probe log, kept beside
the checkpoints so that a resumed run knows where each policy stands.

It sits in `eval`, not in `rl`: a fall is judged by the gate's paired test (exact McNemar, `gate.mcnemar_p`),
and the library's layers put `eval` above `rl` (a probe is an evaluation of the training, as the gate's is of
its result). The recipe in `rl` runs the steps; the flows and `mint train` put the two together.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from mint_core.data.generators import Example
from mint_core.engine.engine import Engine
from mint_core.eval.gate import discordant, mcnemar_p
from mint_core.rl.evaluate import heldout_correct


class EarlyStop(BaseModel):
    """Stop training a policy whose reward on held-out probe items does not rise, so no compute goes into steps
    (or an evaluation) the gate would reject. The probe is greedy exact match on a few items of the policy's task
    that no training, held-out or eval-suite prompt is (`mint_core.data.revision.probe_examples`): cheap, and
    not the gate's items. Defaults from benchmarks/learning_curves.py on the built-in base (docs/lifecycle.md, "Retraining")."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(10, ge=1)
    """Probe every this many steps (and before the first, and after the last). At the built-in recipe's ~0.2 s
    per policy and step on one core, a 128-item probe (~0.15 s) costs under a tenth of the 10 steps between."""
    probe_items: int = Field(128, ge=16, le=2000)
    """Probe items per policy. 128: one item is 0.008 of reward, and a probe costs about one step's rollout."""
    patience: int = Field(3, ge=1)
    """Probes in a row without a rise of `min_delta` over the best so far after which the policy stops."""
    min_delta: float = Field(0.025, ge=0.0, le=1.0)
    """The rise that counts (greedy exact match, 0..1): 0.025 is 3 of 128 items, about one standard deviation
    of the paired change between two probes of nearby adapters, so noise alone seldom makes a rise. A policy
    that stops without its best probe rising this much over its step-0 probe has gained nothing the gate could
    pass: it is not exported, evaluated or gated."""
    after_rejections: int = Field(2, ge=1)
    """A policy whose last this many candidates were rejected (`PolicyRun.rejected`) gets a patience of 1: unless
    its first probe after step 0 rises `min_delta`, it stops there and is skipped (not exported or gated)."""
    stop_after_gain: bool = False
    """Also stop a policy that has risen, once `patience` probes in a row bring no further rise (a plateau after
    a gain), and gate it as it stands. Off by default: the learning rate decays linearly over the run's steps,
    and the last steps consolidate the gain while the probe looks flat; stopped at such a plateau (step 40),
    `add` and `reverse` first revisions gained +0.062 (p 0.06) and +0.016 on their suites against +0.084 and
    +0.056 (both promoted) when trained to step 100."""

    fall_p: float = Field(0.05, gt=0.0, le=1.0)
    """A policy whose probe falls below its first (its champion's, for a continuation) beyond noise, the paired
    change on the same items negative at exact McNemar p below this, stops at once and is not exported, evaluated
    or gated, whatever it gained before."""
    room_fall_p: float = Field(0.005, gt=0.0, le=1.0)
    """`fall_p` for a continuation whose champion has headroom (`Continuation.has_room`): it trains at the full
    rate, and its probe dips while AdamW's moments start again before it rises (`examples/shout`'s fresh-clone
    champion: -0.078 at step 20, p 0.031, of 128 items), so only a fall well beyond that dip stops it."""

    def patience_for(self, rejected: int, room: bool = False) -> int:
        """Probes without a rise before a policy stops. For a continuation whose champion has headroom
        (`Continuation.has_room`, measured tonight), the whole run: only a fall stops it, since its probe first dips
        as AdamW starts again and rises after about 100 steps (docs/training.md), so a probe or three say nothing
        yet, whatever its earlier candidates did. Else 1 after `after_rejections` rejections, and `patience`."""
        if room:
            return 10**6
        return 1 if rejected >= self.after_rejections else self.patience


class ProbePoint(BaseModel):
    step: int
    score: float
    """Greedy exact match on the probe items after `step` steps."""


class Plateau:
    """The early-stop rule for one policy, fed one probe score at a time (the first at step 0). A score is a
    rise when it beats the best so far by at least `min_delta` (strictly, with `min_delta` 0); the policy has
    `gained` once its best beat its first that way. After `patience` probes in a row without a rise, a policy
    that has not gained stops ("no gain"), and with `stop_after_gain` one that has gained too ("plateau")."""

    def __init__(self, min_delta: float, patience: int, stop_after_gain: bool = False, fall_p: float = 0.05):
        if patience < 1 or min_delta < 0 or not 0 < fall_p <= 1:
            raise ValueError(
                f"patience {patience} must be >= 1, min_delta {min_delta} >= 0 and fall_p {fall_p} in (0, 1]"
            )
        self.min_delta = min_delta
        self.patience = patience
        self.stop_after_gain = stop_after_gain
        self.fall_p = fall_p
        self._first_correct: list[bool] | None = None
        self.fell: tuple[float, float] | None = None
        """(change, p) of the probe that fell below the first beyond noise and stopped the policy; None: none."""
        self.points: list[ProbePoint] = []
        self.best: ProbePoint | None = None
        self.waited = 0
        self.stopped_at: int | None = None

    @classmethod
    def of(cls, config: EarlyStop, rejected: int = 0, room: bool = False) -> Plateau:
        """The rule `config` sets for a policy whose last `rejected` candidates were rejected, and whose champion
        has headroom (`room`) or not."""
        fall_p = config.room_fall_p if room else config.fall_p
        return cls(config.min_delta, config.patience_for(rejected, room), config.stop_after_gain, fall_p)

    def add(self, step: int, score: float, correct: list[bool] | None = None) -> bool:
        """Record the probe after `step` steps; True when the policy stops here. `correct`: the probe item by
        item, the same items each time; with it, a probe that falls below the first beyond noise (`fall_p`)
        stops the policy at once."""
        if self.stopped_at is not None:
            raise ValueError(f"stopped at step {self.stopped_at}: no more probes")
        point = ProbePoint(step=step, score=score)
        self.points.append(point)
        if correct is not None:
            if self._first_correct is None:
                self._first_correct = list(correct)
            elif len(correct) == len(self._first_correct):
                change, p = probe_gain(self._first_correct, correct)
                if change < 0 and p < self.fall_p:
                    self.fell = (change, p)
                    self.stopped_at = step
                    return True
        if self.best is None or self._rises(score, self.best.score):
            self.best, self.waited = point, 0
        else:
            self.waited += 1
            if self.waited >= self.patience and (self.stop_after_gain or not self.gained):
                self.stopped_at = step
        return self.stopped_at is not None

    def _rises(self, score: float, over: float) -> bool:
        return score > over and score - over >= self.min_delta - 1e-9

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    @property
    def start(self) -> ProbePoint | None:
        return self.points[0] if self.points else None

    @property
    def exportable(self) -> bool:
        """Whether its adapter goes on to export and the gate: it trained to the end, or stopped after a gain
        without falling below its start."""
        return not self.stopped or (self.gained and self.fell is None)

    @property
    def gained(self) -> bool:
        """Whether the best probe rose `min_delta` over the first."""
        return (
            self.best is not None
            and self.start is not None
            and self._rises(self.best.score, self.start.score)
        )

    def reason(self, steps: int) -> str:
        """Why training of this policy ended, with the numbers; `steps`: the run's schedule."""
        if not self.points or self.best is None or self.start is None:
            return f"finished: all {steps} steps (not probed)"
        first, best, last = self.start, self.best, self.points[-1]
        curve = f"probe {first.score:.3f} at step {first.step}, best {best.score:.3f} at step {best.step}"
        if self.stopped_at is None:
            return f"finished: all {steps} steps ({curve}, {last.score:.3f} at the end)"
        if self.fell is not None:
            change, p = self.fell
            return (
                f"fell: probe {first.score:.3f} at step {first.step}, {last.score:.3f} at step {last.step} "
                f"({change:+.3f}, p {p:.2g} < {self.fall_p:g}): below where it started, not exported"
            )
        flat = f"no rise of {self.min_delta:g} in {self.patience} probe(s) to step {self.stopped_at}"
        if self.gained:
            return f"plateau: {curve}; {flat}"
        return f"no gain: {curve}; {flat}"


class Probe(BaseModel):
    """Greedy exact match of each probed policy on its probe items, after `step` steps."""

    step: int
    correct: dict[str, list[bool]]
    """Per policy, item by item (the same items in every probe, so two probes pair up)."""

    def score(self, policy: str) -> float:
        got = self.correct[policy]
        return sum(got) / len(got)


def take_probe(engine: Engine, items: dict[str, list[Example]], step: int) -> Probe:
    """Greedy exact match of each named policy on its probe items now, after `step` steps."""
    return Probe(step=step, correct={name: heldout_correct(engine, name, exs) for name, exs in items.items()})


def probe_gain(first: list[bool], last: list[bool]) -> tuple[float, float]:
    """The probe's paired change from `first` to `last` (the same items): effect and exact McNemar p."""
    gained, lost = discordant(last, first)
    return (gained - lost) / len(first), mcnemar_p(gained, lost)


class ProbeLog(BaseModel):
    """The probes of a run so far, kept beside its checkpoints so that a resumed run knows where each policy
    stands (a probe is re-taken when the checkpoint is older than it)."""

    items: str
    """Digest of the probe items, so a log of other items is not read back."""
    probes: list[Probe] = Field(default_factory=list)

    @staticmethod
    def digest(items: dict[str, list[Example]]) -> str:
        doc = {name: [e.prompt for e in examples] for name, examples in sorted(items.items())}
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]

    @classmethod
    def read(cls, path: Path, items: dict[str, list[Example]], upto: int) -> ProbeLog:
        """The log at `path` for these items, without probes after step `upto` (the run's resumed step)."""
        log = cls(items=cls.digest(items))
        if path.is_file():
            saved = cls.model_validate_json(path.read_text())
            if saved.items == log.items:
                log.probes = [p for p in saved.probes if p.step <= upto]
        return log

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json())
        tmp.replace(path)


class Trained(BaseModel):
    """How one policy's training in a run went."""

    steps: int
    """GRPO steps it trained (the run's, or fewer where early stopping stopped it)."""
    reason: str
    """Why its training ended (`Plateau.reason`, or "finished: all N steps")."""
    exported: bool
    """False: stopped without a gain on the probe, so nothing was exported."""
    probe: list[ProbePoint] = Field(default_factory=list)
    probe_gain: float | None = None
    """The probe's paired change from its first probe to its last (None: not probed)."""
    probe_p: float | None = None

    @classmethod
    def finished(cls, steps: int, schedule: int) -> Trained:
        """A policy that trained without early stopping: `steps` of the run's `schedule`."""
        return cls(steps=steps, reason=f"finished: all {schedule} steps", exported=True)


class EarlyStopping:
    """One run's early stopping: a `Plateau` per policy, fed the probes of the policies still training, and the
    probes so far in a log at `log_file` (read back up to step `upto`, the step the run resumed at)."""

    def __init__(
        self,
        config: EarlyStop,
        items: dict[str, list[Example]],
        log_file: Path,
        upto: int,
        rejected: dict[str, int] | None = None,
        room: dict[str, bool] | None = None,
    ):
        """`items`: each policy's probe items; `rejected`: how many of its last candidates were rejected;
        `room`: whether its champion has headroom (`Plateau.of`)."""
        self.config = config
        self.items = items
        self.rejected = rejected or {}
        self.plateaus = {
            n: Plateau.of(config, self.rejected.get(n, 0), (room or {}).get(n, False)) for n in items
        }
        self.log_file = log_file
        self.log = ProbeLog.read(log_file, items, upto)
        self.first: dict[str, list[bool]] = {}
        self.last: dict[str, list[bool]] = {}

    def replay(self) -> list[str]:
        """Feed the rules the probes read back (a resumed run: where each policy stood at its checkpoint);
        returns the policies they stopped."""
        return [name for result in self.log.probes for name in self._feed(result)]

    def due(self, step: int, steps: int) -> bool:
        """Whether a probe is taken after `step` of a run's `steps`: every `every` steps and after the last."""
        return step % self.config.every == 0 or step == steps

    def record(self, result: Probe) -> list[str]:
        """Log a new probe and feed it to the rules; returns the policies it stops."""
        self.log.probes.append(result)
        self.log.write(self.log_file)
        return self._feed(result)

    def _feed(self, result: Probe) -> list[str]:
        stopping = []
        for name, got in result.correct.items():
            self.first.setdefault(name, got)
            self.last[name] = got
            if self.plateaus[name].add(result.step, result.score(name), got):
                stopping.append(name)
        return stopping

    def trained(self, name: str, steps: int, schedule: int) -> Trained:
        """How the policy's training went, the run having taken `steps` of its `schedule`."""
        plateau = self.plateaus[name]
        done = steps if plateau.stopped_at is None else min(steps, plateau.stopped_at)
        reason = plateau.reason(schedule)
        rejected = self.rejected.get(name, 0)
        if plateau.stopped and rejected >= self.config.after_rejections:
            reason = f"its last {rejected} candidates were rejected, so one probe to show a gain: {reason}"
        gain, p_value = probe_gain(self.first[name], self.last[name]) if name in self.first else (None, None)
        return Trained(
            steps=done,
            reason=reason,
            exported=plateau.exportable,
            probe=plateau.points,
            probe_gain=gain,
            probe_p=p_value,
        )
