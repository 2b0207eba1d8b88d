"""The promotion gate: does a candidate revision's evaluation earn it the `champion` alias?

The gate compares the candidate with a baseline on the same items of the same suites: the policy's champion,
or, for a policy's first revision, the bare base (revision 0 of every policy). It runs a fixed list of checks
and passes only when all of them pass:

- `samples:<suite>` every suite it reads has at least `min_samples` samples, on both sides;
- `floor:<suite>`   the candidate scores at least the suite's absolute floor;
- `gain:<suite>`    on the policy's own suite the candidate's gain over the baseline is statistically
  significant (exact McNemar test, two-sided p < `alpha`) and at least `min_effect` (absolute);
- `guard:<suite>`   on every guard suite the candidate is non-inferior: the two-sided (1 - `alpha`) confidence
  interval of its difference from the baseline lies above `-guard_margin` (a one-sided score test of
  H0: difference <= -guard_margin at level alpha/2, the CONSORT convention).

What guards a policy is its task's to declare (the spec's `gate:` section, `mint_core.data.spec.GateSpec`): a
task that declares nothing is gated on its own suite alone, because its adapter answers only the requests that
name it. Every other registered task's suite is still scored and reported beside the decision (`info:<suite>`,
"sort -0.497 (not a guard)"), never rejecting: a reviewer sees what the adapter forgot before serving it for
anything else. The built-in tasks declare each other (`guard:add`, `guard:reverse`, ...) and the pooled guard
group, so the demo's gate is as it was:

The per-task guards (`guard_tasks`) reject a candidate when any single guarded task regresses beyond the per-task
margin (`task_guard_margin`, 0.10; why not 0.05: below). A pooled guard cannot see that: the guard group
(`guard:guard`) pools 64 generation and 64 log-likelihood items of every built-in task, the policy's own task
included, so the first `sort` revision that took `add` from 0.494 to 0.331 (-0.163 on the 320-item `add` suite)
passed it at -0.006 [-0.031, +0.018], its own task's items (+14 of 128) covering `add`'s (-9 of 128). The pooled
guard stays as one more guard because it is the only check that reads the log-likelihood items (does the
candidate still rank a right answer above a near miss) and the guard group's generation items, which no task
suite holds; and at 640 items it is the tightest guard against a loss spread thinly over every task (detectable
margin 0.035 at discordance 0.1).

Every comparison is paired: item i of a suite is the same prompt for both revisions, so what carries the
evidence is the discordant items, b (only the candidate right) and c (only the baseline right). The effect is
the difference in accuracy, (b - c) / n. Its confidence interval is Tango's score interval for a difference of
paired proportions (Tango 1998, Stat Med 17:891), which keeps close to nominal coverage down to a handful of
discordant items; the guards' p-value is the same score test, so a guard passes exactly when its interval
clears the margin.

Each compared check also reports the minimum detectable effect (MDE) of its suite: the smallest true gain
(own suite; Connor's formula, see `required_n`) or non-inferiority margin (guard; `detectable_margin`) that
its n items detect at `alpha` with `power` (0.8), at the discordance observed between the two revisions. The
decision warns when that is larger than `min_effect` (or the guard's margin).

How the eval sizes were chosen (alpha 0.05, power 0.8; planning discordance 0.2, i.e. the two revisions
disagree on one item in five, an assumption until real runs measure it: every check reports its own):

| what | needs n >= |
| --- | --- |
| own suite, true gain 0.10 | 155 (194 at discordance 0.25; at alpha 0.01, 319 at discordance 0.275): **320 items per task suite** (`results.EVAL_LIMIT`) |
| own suite, true gain 0.05 (= `min_effect`) | 626 |
| guard, margin 0.10 | 157 |
| guard, margin 0.05 (= `guard_margin`) | 628: **320 items per guard task, 640 in the guard group** (`results.GUARD_LIMIT`) |
| per-task guard, margin 0.05, discordance 0.1 | 314 |
| per-task guard, margin 0.10 (= `task_guard_margin`), discordance 0.3 | 236: **the task's suite, 320 items** (`results.EVAL_LIMIT`) |

So 320 items per task suite detect the +0.10 a training round is meant to bring, at p < 0.01 too. `min_effect` 0.05 is the
practical floor every promotion must clear besides significance, not the effect the suites are sized for: an
observed-gain threshold as large as the design effect would halve the power for it. Smaller suites still gate
correctly (a false promotion stays below alpha); they only reject more real gains, and the decision warns.

A per-task guard reads the other task's suite, n = 320 (the same items its own policy's gain is measured on),
and shows non-inferiority within (1.96 + 0.84) sqrt(d / 320) = 0.157 sqrt(d) at discordance d: 0.035 at d 0.05,
0.050 at d 0.10, 0.070 at d 0.20; a truly harmless revision passes such a guard with probability 0.98 at d 0.05,
0.8 at d 0.10. Measured on the first `add` and `sort` revisions of the built-in recipe (two rounds each, against
the base): on the letter tasks (`reverse`, `copy`, `upper`) they changed 3-11% of the items (detectable margin
0.027-0.052: 320 items hold the 0.05 margin there) and lost 0.00-0.03; on each other's digit task 21-32% (margin
0.072-0.088, and the gate warns), where they lost 0.15-0.18, three times the margin, which fails at any size.
The held-out split has no more items to give (450 per task: 320 for the task suite, 2 x 64 for the guard group).
So the per-task guards use `task_guard_margin` 0.10: with four of them a harmless revision at d 0.1 would pass
all four at 0.05 only about 0.8^4 = 0.4 of the time (the first runs failed letter-task guards at -0.016 to
-0.031), while the real costs measured, -0.14 to -0.18, fail 0.10 by far. The built-in recipe trains each policy
with a quarter of its prompts from the other tasks (`PolicySpec.replay`), which keeps those costs within it.

With no baseline scores at all (`champion=None`) or with `compare=False`, only the sample counts and floors
are checked and the reasons say so. A suite the gate needs but one side was not evaluated on (or not on the
same items) fails its check: the gate says no when it cannot tell.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from statistics import NormalDist
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator
from rich.table import Table

from mint_core.data.spec import registry_in
from mint_core.registry.tags import json_tag

GATE_TAG = "mint.gate"
"""Model-version tag holding the decision as compact JSON."""
_SLACK = 1e-9  # scores are ratios of counts: 0.7 must pass ">= 0.6 + 0.1" despite rounding
_NORMAL = NormalDist()

Baseline = Literal["champion", "base"]
"""What the candidate is compared with: the policy's champion, or the bare base (a first revision)."""

_RENAMED = {
    "margin": "`margin` (a raw own-suite margin) is gone: use `min_effect` (the gain must also be significant)",
    "guard_tolerance": "`guard_tolerance` is gone: guards are non-inferiority tests, use `guard_margin`",
    "significance": "`significance` is gone: the paired test always runs (`compare=False` turns comparing off)",
}


class SuiteScore(BaseModel):
    """One evaluation suite's result for one revision."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    """Suite name (an lm-eval task name); the key the gate policy refers to."""
    score: float = Field(ge=0.0, le=1.0)
    """Mean score over the suite's samples, in [0, 1] (accuracy, exact match, ...)."""
    n: int = Field(ge=0)
    """Number of samples scored."""
    correct: list[bool] | None = None
    """Per-sample correctness in the suite's fixed sample order (the same order for every revision, so a
    candidate's and a champion's lists pair up); None when only the aggregate is known, which the gate's paired
    checks cannot use."""

    @model_validator(mode="after")
    def _correct_has_n_entries(self) -> SuiteScore:
        if self.correct is not None and len(self.correct) != self.n:
            raise ValueError(f"suite {self.name!r}: {len(self.correct)} per-sample results but n={self.n}")
        return self


class GatePolicy(BaseModel):
    """When a candidate revision may replace the champion of its policy (or, first, the bare base)."""

    model_config = ConfigDict(extra="forbid")

    suite: str = Field(min_length=1)
    """The policy's own suite: the one its training is meant to improve."""
    guard_suites: list[str] | None = None
    """Other suites (general ability, a group such as the built-ins' `guard`) on which the candidate must be
    non-inferior, each as one pool of its items. None: what the task's spec declares (`gate.guard_suites`;
    none for a suite that is no registered task). [] turns them off. Resolved when the policy is made."""
    guard_tasks: list[str] | None = None
    """Registered tasks (`mint_core.data.spec.registry`: the built-ins and the workspace's task folders) each
    guarded on its own suite, `guard:<task>`, within `task_guard_margin`, so that one task's regression cannot
    hide among the other tasks' items in a pooled guard. None: what the task's spec declares (`gate.guards`;
    none for a task that declares none). [] turns them off. Resolved when the policy is made."""
    info_suites: list[str] | None = None
    """Suites scored and reported beside the decision (`info:<suite>`: the candidate's change, "not a guard"),
    never rejecting: what the adapter does to tasks its callers do not ask it. None: every registered task's
    suite the gate does not otherwise read. [] reports none (and evaluates less)."""
    alpha: float = Field(0.05, gt=0.0, lt=1.0)
    """Significance level: the own-suite gain needs an exact two-sided McNemar p below it, and every
    confidence interval reported (and a guard's) has coverage 1 - alpha."""
    min_effect: float = Field(0.05, ge=0.0, lt=1.0)
    """Smallest own-suite gain (absolute accuracy, candidate minus baseline) worth a promotion: the observed
    gain must reach it besides being significant."""
    guard_margin: float = Field(0.05, gt=0.0, lt=1.0)
    """Non-inferiority margin of the guards: a guard passes when the confidence interval of the candidate's
    difference from the baseline lies above -guard_margin. Positive: with 0 a guard would have to improve."""
    task_guard_margin: float = Field(0.10, gt=0.0, lt=1.0)
    """Non-inferiority margin of the per-task guards (`guard_tasks`). Wider than `guard_margin` because a task
    suite holds 320 items, not the guard group's 640: at the discordance of a task a revision touches (0.2-0.3)
    320 items show non-inferiority within 0.07-0.09 at power 0.8, so a 0.05 margin would reject a harmless
    revision about as often as a harmful one; 0.10 holds at n >= 157 (the size table above) and still rejects
    the -0.14 to -0.18 a single-task recipe cost the other digit task."""
    power: float = Field(0.8, gt=0.0, lt=1.0)
    """Power at which the minimum detectable effect is reported (and suites are sized)."""
    floors: dict[str, float] = Field(default_factory=dict)
    """Absolute minimum score per suite; checked whether or not there is a baseline."""
    min_samples: int = Field(1, ge=1)
    """Fewest samples each suite the gate reads may have, on the candidate's and the baseline's side alike;
    below it a score is noise and the check fails."""
    min_samples_by_suite: dict[str, int] = Field(default_factory=dict)
    """Per-suite overrides of `min_samples` (suite name -> fewest samples)."""
    compare: bool = True
    """False: check only sample counts and floors, as for a revision with no baseline (plumbing tests, a
    manual promotion). The default compares every revision with its baseline."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [_RENAMED[k] for k in data if k in _RENAMED]
            if old:
                raise ValueError("; ".join(old))
        return data

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> GatePolicy:
        # what the form leaves unset, the task's spec declares (GateSpec); what the spec leaves unset, the defaults
        reg = registry_in(info.context)
        declared = reg.get(self.suite).gate if self.suite in reg else None
        if declared is not None:
            for name in ("min_effect", "alpha", "guard_margin", "task_guard_margin"):
                value = getattr(declared, name)
                if value is not None and name not in self.model_fields_set:
                    setattr(self, name, value)
        if self.guard_suites is None:
            self.guard_suites = list(declared.guard_suites) if declared is not None else []
        if self.suite in self.guard_suites:
            raise ValueError(f"suite {self.suite!r} is the policy's own suite and cannot also be a guard")
        if self.guard_tasks is None:
            self.guard_tasks = [t for t in declared.guards if t not in self.guard_suites] if declared else []
        known = reg.names()
        unknown = [t for t in self.guard_tasks if t not in known]
        if unknown:
            raise ValueError(
                f"guard_tasks {unknown} are not registered tasks ({', '.join(known)}); guard other suites with "
                "guard_suites"
            )
        if self.suite in self.guard_tasks:
            raise ValueError(f"task {self.suite!r} is the policy's own suite and cannot also be a guard")
        if self.info_suites is None:
            read = {self.suite, *self.guard_tasks, *self.guard_suites}
            self.info_suites = [t for t in known if t not in read]
        else:
            both = [x for x in self.info_suites if x == self.suite or x in self.guards()]
            if both:
                raise ValueError(f"info_suites {both} are read by the gate already (own suite or guards)")
        bad = {k: v for k, v in self.floors.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"floors must lie in [0, 1]: {bad}")
        small = {k: v for k, v in self.min_samples_by_suite.items() if v < 1}
        if small:
            raise ValueError(f"min_samples_by_suite values must be >= 1: {small}")
        if self.power <= self.alpha:
            raise ValueError(f"power {self.power:g} must exceed alpha {self.alpha:g}")
        return self

    def guards(self) -> list[str]:
        """Every guarded suite, each once: the per-task guards (`guard_tasks`), then the `guard_suites`."""
        return list(dict.fromkeys([*(self.guard_tasks or []), *(self.guard_suites or [])]))

    def suites(self) -> list[str]:
        """Every suite the lifecycle evaluates for the gate, own suite first, each once: what it reads (own,
        guards, floors), then what it only reports (`info_suites`)."""
        return list(dict.fromkeys([*self.gated_suites(), *(self.info_suites or [])]))

    def gated_suites(self) -> list[str]:
        """The suites whose checks can reject a candidate: its own, the guards, the floors."""
        return list(dict.fromkeys([self.suite, *self.guards(), *self.floors]))

    def describe(self) -> str:
        """The gate in a line, from its own fields: what must rise, what must hold, what is only reported."""
        parts = [f"a significant gain >= {self.min_effect:g} on {self.suite} (alpha {self.alpha:g})"]
        if self.guard_tasks:
            parts.append(f"{', '.join(self.guard_tasks)} non-inferior within {self.task_guard_margin:g}")
        if self.guard_suites:
            parts.append(f"{', '.join(self.guard_suites)} non-inferior within {self.guard_margin:g}")
        if self.info_suites:
            parts.append(f"{', '.join(self.info_suites)} reported, not gating")
        return "; ".join(parts)

    def min_samples_for(self, suite: str) -> int:
        return self.min_samples_by_suite.get(suite, self.min_samples)


class PairedStats(BaseModel):
    """The numbers behind one paired comparison of a candidate with its baseline on one suite."""

    model_config = ConfigDict(frozen=True)

    n: int
    """Items compared (the same items on both sides)."""
    b: int
    """Items only the candidate got right."""
    c: int
    """Items only the baseline got right."""
    candidate: float
    """The candidate's score on the suite."""
    baseline: float
    """The baseline's score on the suite."""
    effect: float
    """Candidate minus baseline accuracy, (b - c) / n."""
    ci: tuple[float, float]
    """Two-sided (1 - alpha) score confidence interval of the effect (Tango)."""
    p_value: float
    """Own suite: exact two-sided McNemar. Guard: one-sided score test of H0 effect <= -margin."""
    mde: float | None
    """Smallest true effect (own suite) or margin (guard) this many items detect at the policy's alpha and
    power, at the observed discordance; None when no effect that discordance allows is detectable."""

    @property
    def discordance(self) -> float:
        """Share of items on which the two revisions disagree, (b + c) / n."""
        return (self.b + self.c) / self.n if self.n else 0.0

    def summary(self, confidence: float) -> str:
        ci = f"{confidence:.0%} CI [{self.ci[0]:+.3f}, {self.ci[1]:+.3f}]"
        return f"{self.effect:+.3f} ({self.baseline:.3f} -> {self.candidate:.3f}), {ci}, p={self.p_value:.3g}, n={self.n}"


class Check(BaseModel):
    """One named test of the gate and its outcome."""

    name: str
    """`<kind>:<suite>`, kind one of samples, floor, gain, guard, info."""
    passed: bool
    """Whether this check passed."""
    detail: str
    """The numbers compared and, when it failed, what fell short and by how much; readable on its own."""
    stats: PairedStats | None = None
    """For gain, guard and info checks: effect, confidence interval, p-value, n and MDE."""
    gating: bool = True
    """False for an `info:<suite>` check: reported, never rejecting (it always passes)."""


class GateDecision(BaseModel):
    """The gate's verdict: every check, and the reasons a person reads."""

    passed: bool
    """True when every check passed."""
    reasons: list[str]
    """Why: what the candidate was compared with, the detail of every failed check (or a summary when all
    passed), then warnings (`warning: ...`, e.g. a suite too small for `min_effect`)."""
    checks: list[Check]
    """Every check run, in order."""
    first_revision: bool = False
    """True when there was no champion (the candidate was compared with the base, or with nothing)."""
    baseline: Baseline | None = "champion"
    """What the paired checks compared with; None when nothing was compared (floors and samples only)."""
    warnings: list[str] = Field(default_factory=list)
    """Suites too small for the effect (or margin) they are meant to detect; also at the end of `reasons`."""
    alpha: float = 0.05
    """The policy's alpha: the confidence intervals are 1 - alpha."""

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def side_effects(self) -> list[Check]:
        """The `info:<suite>` checks: the candidate's change on suites that do not gate it."""
        return [c for c in self.checks if not c.gating]

    def check(self, name: str) -> Check | None:
        """The check called `name` (e.g. `gain:add`), if it ran."""
        return next((c for c in self.checks if c.name == name), None)

    def _columns(self, c: Check) -> list[str]:
        s = c.stats
        if s is None:
            return ["", "", "", "", ""]
        mde = "-" if s.mde is None else f"{s.mde:.3f}"
        return [f"{s.effect:+.3f}", f"[{s.ci[0]:+.3f}, {s.ci[1]:+.3f}]", f"{s.p_value:.3g}", str(s.n), mde]

    def _header(self) -> list[str]:
        return ["check", "result", "effect", f"{1 - self.alpha:.0%} CI", "p", "n", "MDE", "detail"]

    def table(self, title: str | None = None) -> Table:
        """The checks as a rich table (for the CLI and logs)."""
        verdict = "[green]passed[/]" if self.passed else "[red]failed[/]"
        table = Table(*self._header(), title=title or f"gate {verdict}")
        for c in self.checks:
            table.add_row(c.name, _result(c, "[green]pass[/]", "[red]FAIL[/]"), *self._columns(c), c.detail)
        return table

    def markdown(self) -> str:
        """The decision as markdown (a Prefect artifact): verdict, reasons, then a table of checks."""
        head = self._header()
        lines = [f"**Gate: {'passed' if self.passed else 'failed'}**", ""]
        lines += [f"- {_md(r)}" for r in self.reasons]
        lines += ["", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for c in self.checks:
            row = [c.name, _result(c, "pass", "FAIL"), *self._columns(c), c.detail]
            lines.append("| " + " | ".join(_md(x) for x in row) + " |")
        return "\n".join(lines) + "\n"

    def tag_value(self) -> str:
        """Compact JSON for the `mint.gate` model-version tag: the verdict, the baseline, the reasons, the failed
        checks and every paired check's numbers (`stats`: effect, CI, p, n, MDE; a gain and each guard, one per
        guarded task). To fit an MLflow tag, trailing reasons (warnings first: the prose of what `stats` and
        `failed` already hold), then trailing stats, then failed names are dropped, with `"truncated": true`
        (`registry.tags.json_tag`)."""
        doc = {
            "passed": self.passed,
            "first_revision": self.first_revision,
            "baseline": self.baseline,
            "reasons": list(self.reasons),
            "failed": [c.name for c in self.failed()],
            "stats": {c.name: _compact(c.stats) for c in self.checks if c.stats is not None},
        }
        return json_tag(doc, shrink=("reasons", "stats", "failed"))


def _result(c: Check, passed: str, failed: str) -> str:
    return "info" if not c.gating else passed if c.passed else failed


def _compact(s: PairedStats) -> dict[str, object]:
    return {
        "effect": round(s.effect, 4),
        "ci": [round(s.ci[0], 4), round(s.ci[1], 4)],
        "p": float(f"{s.p_value:.4g}"),
        "n": s.n,
        "mde": None if s.mde is None else round(s.mde, 4),
    }


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _by_name(scores: Iterable[SuiteScore], side: str) -> dict[str, SuiteScore]:
    out: dict[str, SuiteScore] = {}
    for s in scores:
        if s.name in out:
            raise ValueError(f"{side} scores name suite {s.name!r} twice")
        out[s.name] = s
    return out


# ---- paired statistics --------------------------------------------------------------------------------------


def discordant(candidate: list[bool], baseline: list[bool]) -> tuple[int, int]:
    """(b, c): items only the candidate gets right, items only the baseline gets right."""
    if len(candidate) != len(baseline):
        raise ValueError(f"paired results need equal lengths, got {len(candidate)} and {len(baseline)}")
    b = sum(x and not y for x, y in zip(candidate, baseline, strict=True))
    c = sum(y and not x for x, y in zip(candidate, baseline, strict=True))
    return b, c


def mcnemar_p(b: int, c: int, alternative: Literal["two-sided", "greater"] = "two-sided") -> float:
    """Exact McNemar test on b and c discordant items: under H0 (equal accuracy) b ~ Binomial(b + c, 1/2).
    "two-sided": 2 P(X <= min(b, c)), capped at 1 (as statsmodels' `mcnemar(exact=True)`); "greater" (the
    candidate is better): P(X >= b). Exact integer arithmetic, so thousands of disagreements stay accurate.
    1.0 when the two never disagree."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    m = b + c
    if m == 0:
        return 1.0
    if alternative == "greater":
        tail = sum(math.comb(m, k) for k in range(b, m + 1))
        return min(1.0, tail / 2**m)
    tail = sum(math.comb(m, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**m)


def score_z(b: int, c: int, n: int, delta0: float) -> float:
    """Tango's score statistic for H0: effect = delta0 on n paired items, (b - c - n delta0) / sqrt(n (2 q +
    delta0 (1 - delta0))), q the maximum-likelihood P(only the baseline right) under H0. Decreasing in delta0."""
    num = b - c - n * delta0
    if n == 0:
        return 0.0
    a2, b2 = 2.0 * n, -(b + c) + delta0 * (2 * n - b + c)
    c2 = -c * delta0 * (1.0 - delta0)
    q = (-b2 + math.sqrt(max(b2 * b2 - 4.0 * a2 * c2, 0.0))) / (2.0 * a2)
    var = n * (2.0 * q + delta0 * (1.0 - delta0))
    if var <= 1e-12:
        return 0.0 if abs(num) < 1e-12 else math.copysign(math.inf, num)
    return num / math.sqrt(var)


def paired_ci(b: int, c: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Tango's score confidence interval for the effect (b - c) / n: every delta0 whose two-sided score test
    does not reject at 1 - confidence. Solved by bisection (80 halvings: far below any printed digit)."""
    if n == 0:
        return (-1.0, 1.0)
    z = _NORMAL.inv_cdf(0.5 + confidence / 2.0)
    est = (b - c) / n

    def solve(lo: float, hi: float, target: float) -> float:
        # score_z(lo) > target >= score_z(hi)
        for _ in range(80):
            mid = (lo + hi) / 2.0
            if score_z(b, c, n, mid) > target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2.0

    low = -1.0 if score_z(b, c, n, -1.0) <= z else solve(-1.0, est, z)
    high = 1.0 if score_z(b, c, n, 1.0) >= -z else solve(est, 1.0, -z)
    return (low, high)


def noninferiority_p(b: int, c: int, n: int, margin: float) -> float:
    """One-sided score test p-value of H0: effect <= -margin (the candidate worse by the margin or more)."""
    return 0.5 * math.erfc(score_z(b, c, n, -margin) / math.sqrt(2.0))


def _z_pair(alpha: float, power: float) -> tuple[float, float]:
    return _NORMAL.inv_cdf(1.0 - alpha / 2.0), _NORMAL.inv_cdf(power)


def required_n(effect: float, discordance: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Items a two-sided paired test at alpha needs to detect a true `effect` with `power`, when a share
    `discordance` of items is discordant (Connor 1987, Biometrics 43:207):
    n = (z_{1-alpha/2} sqrt(d) + z_{power} sqrt(d - effect^2))^2 / effect^2.
    An effect can be no larger than the discordance (|b - c| <= b + c)."""
    if not 0.0 < effect <= discordance <= 1.0:
        raise ValueError(
            f"need 0 < effect <= discordance <= 1, got effect={effect}, discordance={discordance}"
        )
    za, zb = _z_pair(alpha, power)
    root = za * math.sqrt(discordance) + zb * math.sqrt(discordance - effect * effect)
    return math.ceil((root / effect) ** 2 - 1e-9)


def mde(n: int, discordance: float, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The smallest true effect n items detect with `power` (the inverse of `required_n`); None when even an
    effect as large as the discordance is not detectable."""
    if n < 1 or not 0.0 < discordance <= 1.0:
        return None
    za, zb = _z_pair(alpha, power)

    def need(effect: float) -> float:  # decreasing in effect
        return (
            (za * math.sqrt(discordance) + zb * math.sqrt(max(discordance - effect * effect, 0.0))) / effect
        ) ** 2

    if need(discordance) > n:
        return None
    lo, hi = 0.0, discordance
    for _ in range(80):
        mid = (lo + hi) / 2.0
        if need(mid) > n:
            lo = mid
        else:
            hi = mid
    return hi


def detectable_margin(n: int, discordance: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest non-inferiority margin n items can show with `power` when the true effect is 0:
    (z_{1-alpha/2} + z_{power}) sqrt(d / n), the variance of (b - c) / n being about d / n (Nam 1997,
    Biometrics 53:1422, to first order); a guard needs n >= (z_{1-alpha/2} + z_{power})^2 d / margin^2."""
    za, zb = _z_pair(alpha, power)
    return (za + zb) * math.sqrt(discordance / n) if n >= 1 else math.inf


def paired_stats(
    candidate: list[bool], baseline: list[bool], policy: GatePolicy, guard: bool = False
) -> PairedStats:
    """The paired statistics of one suite: own-suite superiority (exact McNemar) or, with `guard`,
    non-inferiority within `policy.guard_margin` (score test)."""
    b, c = discordant(candidate, baseline)
    n = len(candidate)
    d = (b + c) / n if n else 0.0
    if guard:
        p = noninferiority_p(b, c, n, policy.guard_margin)
        power_of: float | None = detectable_margin(n, d, policy.alpha, policy.power)
    else:
        p = mcnemar_p(b, c)
        power_of = mde(n, d, policy.alpha, policy.power) if d > 0 else None
    return PairedStats(
        n=n,
        b=b,
        c=c,
        candidate=sum(candidate) / n if n else 0.0,
        baseline=sum(baseline) / n if n else 0.0,
        effect=(b - c) / n if n else 0.0,
        ci=paired_ci(b, c, n, 1.0 - policy.alpha),
        p_value=p,
        mde=power_of,
    )


# ---- the decision -------------------------------------------------------------------------------------------


def _paired_check(
    policy: GatePolicy, suite: str, cand: SuiteScore, base: SuiteScore, baseline: Baseline, guard: bool
) -> tuple[Check, str | None]:
    """One gain or guard check, and a warning when the suite is too small for what it must detect."""
    name = f"{'guard' if guard else 'gain'}:{suite}"
    if cand.correct is None or base.correct is None or len(cand.correct) != len(base.correct):
        sides = (
            f"candidate {'n=' + str(cand.n) if cand.correct is not None else 'without per-sample results'}"
        )
        sides += (
            f", {baseline} {'n=' + str(base.n) if base.correct is not None else 'without per-sample results'}"
        )
        detail = f"the paired test needs per-sample results on the same items from both sides ({sides})"
        return Check(name=name, passed=False, detail=detail), None
    if guard and suite in (policy.guard_tasks or []):
        policy = policy.model_copy(update={"guard_margin": policy.task_guard_margin})
    s = paired_stats(cand.correct, base.correct, policy, guard=guard)
    conf = 1.0 - policy.alpha
    head = f"{s.summary(conf)} vs {baseline}"
    shortfalls: list[str] = []
    if guard:
        floor = -policy.guard_margin
        ok = s.ci[0] > floor + _SLACK
        if not ok:
            shortfalls.append(
                f"CI lower bound {s.ci[0]:+.3f} is {floor - s.ci[0]:.3f} below -margin {floor:+.3f} "
                f"(p >= alpha/2 = {policy.alpha / 2:g}): cannot rule out a regression beyond the margin"
            )
        verdict = f"non-inferior: CI above -margin {floor:+.3f}"
        too_small = s.mde is not None and s.mde > policy.guard_margin + _SLACK  # observed CI too wide
        warning = (
            f"warning: guard {suite} with n={s.n} shows non-inferiority only within a margin of {s.mde:.3f} "
            f"(power {policy.power:g}, discordance {s.discordance:.2f}), wider than guard_margin "
            f"{policy.guard_margin:g}: about {_guard_n(policy, s.discordance)} items needed"
            if too_small and s.mde is not None
            else None
        )
    else:
        significant = s.p_value < policy.alpha and s.effect > 0
        big_enough = s.effect >= policy.min_effect - _SLACK
        if not significant:
            shortfalls.append(
                f"not significant (exact McNemar p={s.p_value:.3g} >= alpha {policy.alpha:g}, "
                f"items gained {s.b}, lost {s.c})"
                if s.p_value >= policy.alpha
                else f"significantly worse (items gained {s.b}, lost {s.c})"
            )
        if not big_enough:
            shortfalls.append(f"{policy.min_effect - s.effect:.3f} short of min_effect {policy.min_effect:g}")
        ok = significant and big_enough
        verdict = f"significant at {policy.alpha:g} and >= min_effect {policy.min_effect:g}"
        # with fewer discordant items than min_effect the effect itself falls short: more items would not help
        too_small = 0.0 < policy.min_effect <= s.discordance and (
            s.mde is None or s.mde > policy.min_effect + _SLACK
        )
        warning = None
        if too_small:
            detects = "no gain" if s.mde is None else f"gains >= {s.mde:.3f}"
            need = f"about {required_n(policy.min_effect, s.discordance, policy.alpha, policy.power)} items needed"
            warning = (
                f"warning: suite {suite} with n={s.n} detects {detects} (power {policy.power:g}, alpha "
                f"{policy.alpha:g}, discordance {s.discordance:.2f}): too small for min_effect "
                f"{policy.min_effect:g}, {need}"
            )
    mde_text = "none" if s.mde is None else f"{s.mde:.3f}"
    detail = f"{head}, MDE {mde_text}: " + ("; ".join(shortfalls) if shortfalls else verdict)
    return Check(name=name, passed=ok, detail=detail, stats=s), warning


def _side_effects(
    policy: GatePolicy, cand: dict[str, SuiteScore], base: dict[str, SuiteScore], baseline: Baseline
) -> list[Check]:
    """One `info:<suite>` check per `info_suites` suite both sides were scored on item by item: the paired
    change, as a guard would measure it, marked "not a guard"; it always passes."""
    out = []
    for suite in policy.info_suites or []:
        c, b = cand.get(suite), base.get(suite)
        if (
            c is None
            or b is None
            or c.correct is None
            or b.correct is None
            or len(c.correct) != len(b.correct)
        ):
            continue
        s = paired_stats(c.correct, b.correct, policy)
        detail = f"{suite} {s.summary(1.0 - policy.alpha)} vs {baseline} (not a guard)"
        out.append(Check(name=f"info:{suite}", passed=True, detail=detail, stats=s, gating=False))
    return out


def _guard_n(policy: GatePolicy, discordance: float) -> int:
    za, zb = _z_pair(policy.alpha, policy.power)
    return math.ceil((za + zb) ** 2 * discordance / policy.guard_margin**2)


def decide(
    policy: GatePolicy,
    candidate: Iterable[SuiteScore],
    champion: Iterable[SuiteScore] | None = None,
    *,
    baseline: Baseline = "champion",
) -> GateDecision:
    """Run the gate on a candidate's suite scores against its baseline's, on the same items: the champion's,
    or with `baseline="base"` the bare base's (a first revision). `champion=None`: nothing to compare with,
    so only the sample counts and floors are checked."""
    cand = _by_name(candidate, "candidate")
    base = _by_name(champion, baseline) if champion is not None and policy.compare else None
    side: Baseline | None = baseline if base is not None else None
    checks: list[Check] = []
    warnings: list[str] = []

    compared = {policy.suite, *policy.guards()}  # the suites read on the baseline's side too
    readable: set[str] = set()  # suites every side the gate compares on has, with enough samples
    for suite in policy.gated_suites():
        need = policy.min_samples_for(suite)
        sides = [("candidate", cand)]
        if base is not None and suite in compared:
            sides.append((baseline, base))
        problems: list[str] = []
        counts: list[str] = []
        for who, scores in sides:
            s = scores.get(suite)
            if s is None:
                problems.append(f"{who} was not evaluated on it")
            else:
                counts.append(f"{who} n={s.n}")
                if s.n < need:
                    problems.append(f"{who} has {s.n} < {need} samples")
        ok = not problems
        detail = (", ".join(counts) + f" (need >= {need})") if ok else "; ".join(problems)
        checks.append(Check(name=f"samples:{suite}", passed=ok, detail=detail))
        if ok:
            readable.add(suite)

    for suite, floor in policy.floors.items():
        if suite in readable:
            score = cand[suite].score
            ok = score >= floor - _SLACK
            detail = f"candidate {score:.4g} {'>=' if ok else '<'} floor {floor:.4g}"
            if not ok:
                detail += f" (short by {floor - score:.3f})"
            checks.append(Check(name=f"floor:{suite}", passed=ok, detail=detail))

    if base is not None:
        for suite, guard in [(policy.suite, False), *((g, True) for g in policy.guards())]:
            if suite in readable:
                check, warning = _paired_check(policy, suite, cand[suite], base[suite], baseline, guard)
                checks.append(check)
                if warning:
                    warnings.append(warning)
        checks += _side_effects(policy, cand, base, baseline)

    failed = [c for c in checks if not c.passed]
    reasons: list[str] = []
    if side == "base":
        reasons.append("first revision: compared with the bare base (revision 0) on the same items")
    elif side is None:
        why = (
            "comparing is off (compare=False)"
            if not policy.compare
            else f"no {baseline} scores to compare with"
        )
        reasons.append(f"{why}: checked sample counts and floors only")
    reasons += [f"{c.name}: {c.detail}" for c in failed]
    if not failed:
        gain = next((c for c in checks if c.name == f"gain:{policy.suite}"), None)
        gating = [c for c in checks if c.gating]
        reasons.append(f"all {len(gating)} checks passed" + (f"; {gain.name}: {gain.detail}" if gain else ""))
    effects = [c for c in checks if not c.gating and c.stats is not None]
    if effects:
        reasons.append(
            "changes on suites that do not gate it: "
            + ", ".join(
                f"{c.name.removeprefix('info:')} {c.stats.effect:+.3f} (not a guard)"
                for c in effects
                if c.stats
            )
        )
    reasons += warnings
    return GateDecision(
        passed=not failed,
        reasons=reasons,
        checks=checks,
        first_revision=baseline != "champion" or champion is None,
        baseline=side,
        warnings=warnings,
        alpha=policy.alpha,
    )
