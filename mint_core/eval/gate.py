"""The promotion gate: does a candidate revision's evaluation earn it the `champion` alias?

The gate reads one score per evaluation suite for the candidate and (when there is one) the current champion,
runs a fixed list of checks and passes only when all of them pass:

- `samples:<suite>`   every suite it reads has at least `min_samples` samples, on both sides;
- `floor:<suite>`     the candidate scores at least the suite's absolute floor;
- `margin:<suite>`    on the policy's own suite, candidate >= champion + `margin`;
- `guard:<suite>`     on every guard suite, candidate >= champion - `guard_tolerance`;
- `significance:<suite>` (optional) a one-sided test that the candidate beats the champion on its own suite
  has p < `alpha`.

With no champion yet (a policy's first revision) only the sample counts and floors are checked, and the
decision's reasons say so. A suite the gate needs but one side was not evaluated on fails its check: the gate
says no when it cannot tell.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.table import Table

GATE_TAG = "mint.gate"
"""Model-version tag holding the decision as compact JSON."""
_TAG_MAX_CHARS = 5000  # the smallest tag-value limit among MLflow backends
_SLACK = 1e-9  # scores are ratios of counts: 0.7 must pass ">= 0.6 + 0.1" despite rounding

Significance = Literal["none", "auto", "paired", "two_proportion"]


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
    candidate's and a champion's lists pair up); None when only the aggregate is known."""

    @model_validator(mode="after")
    def _correct_has_n_entries(self) -> SuiteScore:
        if self.correct is not None and len(self.correct) != self.n:
            raise ValueError(f"suite {self.name!r}: {len(self.correct)} per-sample results but n={self.n}")
        return self

    @property
    def successes(self) -> int:
        """Samples counted as correct: from `correct` when given, else score x n rounded."""
        return sum(self.correct) if self.correct is not None else round(self.score * self.n)


class GatePolicy(BaseModel):
    """When a candidate revision may replace the champion of its policy."""

    model_config = ConfigDict(extra="forbid")

    suite: str = Field(min_length=1)
    """The policy's own suite: the one its training is meant to improve."""
    margin: float = Field(0.0, ge=0.0, le=1.0)
    """The candidate's own-suite score must be at least the champion's plus this."""
    guard_suites: list[str] = Field(default_factory=list)
    """Other suites (other tasks, general ability) on which the candidate must not regress."""
    guard_tolerance: float = Field(0.02, ge=0.0, le=1.0)
    """A guard suite fails when the candidate scores below the champion's score minus this."""
    floors: dict[str, float] = Field(default_factory=dict)
    """Absolute minimum score per suite; checked whether or not there is a champion."""
    min_samples: int = Field(1, ge=1)
    """Fewest samples each suite the gate reads may have, on the candidate's and the champion's side alike;
    below it a score is noise and the check fails."""
    min_samples_by_suite: dict[str, int] = Field(default_factory=dict)
    """Per-suite overrides of `min_samples` (suite name -> fewest samples)."""
    significance: Significance = "none"
    """One-sided test that the candidate beats the champion on its own suite (H0: it does not). "paired": an
    exact sign test (McNemar) on the samples where the two disagree, from per-sample correctness;
    "two_proportion": a pooled two-proportion z-test from counts; "auto": paired when both sides carry
    per-sample correctness of the same length, else two-proportion; "none": no test."""
    alpha: float = Field(0.05, gt=0.0, lt=1.0)
    """Significance level: the test passes when its p-value is below alpha."""

    @model_validator(mode="after")
    def _consistent(self) -> GatePolicy:
        if self.suite in self.guard_suites:
            raise ValueError(f"suite {self.suite!r} is the policy's own suite and cannot also be a guard")
        bad = {k: v for k, v in self.floors.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"floors must lie in [0, 1]: {bad}")
        small = {k: v for k, v in self.min_samples_by_suite.items() if v < 1}
        if small:
            raise ValueError(f"min_samples_by_suite values must be >= 1: {small}")
        return self

    def suites(self) -> list[str]:
        """Every suite the gate reads, own suite first, each once."""
        return list(dict.fromkeys([self.suite, *self.guard_suites, *self.floors]))

    def min_samples_for(self, suite: str) -> int:
        return self.min_samples_by_suite.get(suite, self.min_samples)


class Check(BaseModel):
    """One named test of the gate and its outcome."""

    name: str
    """`<kind>:<suite>`, kind one of samples, floor, margin, guard, significance."""
    passed: bool
    """Whether this check passed."""
    detail: str
    """The numbers compared, readable on their own."""


class GateDecision(BaseModel):
    """The gate's verdict: every check, and the reasons a person reads."""

    passed: bool
    """True when every check passed."""
    reasons: list[str]
    """Why: the detail of every failed check (or a one-line summary when all passed), plus a note when there
    was no champion to compare with."""
    checks: list[Check]
    """Every check run, in order."""
    first_revision: bool = False
    """True when there was no champion, so only sample counts and floors were checked."""

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def table(self, title: str | None = None) -> Table:
        """The checks as a rich table (for the CLI and logs)."""
        verdict = "[green]passed[/]" if self.passed else "[red]failed[/]"
        table = Table("check", "result", "detail", title=title or f"gate {verdict}")
        for c in self.checks:
            table.add_row(c.name, "[green]pass[/]" if c.passed else "[red]FAIL[/]", c.detail)
        return table

    def markdown(self) -> str:
        """The decision as markdown (a Prefect artifact): verdict, reasons, then a table of checks."""
        lines = [f"**Gate: {'passed' if self.passed else 'failed'}**", ""]
        lines += [f"- {_md(r)}" for r in self.reasons]
        lines += ["", "| check | result | detail |", "| --- | --- | --- |"]
        lines += [
            f"| {_md(c.name)} | {'pass' if c.passed else 'FAIL'} | {_md(c.detail)} |" for c in self.checks
        ]
        return "\n".join(lines) + "\n"

    def tag_value(self) -> str:
        """Compact JSON for the `mint.gate` model-version tag: the verdict, the reasons and the failed checks;
        trailing reasons (then failed names) are dropped, with `"truncated": true`, to fit an MLflow tag."""
        reasons, failed = list(self.reasons), [c.name for c in self.failed()]

        def dump(truncated: bool) -> str:
            doc: dict[str, object] = {
                "passed": self.passed,
                "first_revision": self.first_revision,
                "reasons": reasons,
                "failed": failed,
            }
            if truncated:
                doc["truncated"] = True
            return json.dumps(doc, separators=(",", ":"))

        text = dump(False)
        while len(text) > _TAG_MAX_CHARS and (reasons or failed):
            (reasons or failed).pop()
            text = dump(True)
        return text


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _by_name(scores: Iterable[SuiteScore], side: str) -> dict[str, SuiteScore]:
    out: dict[str, SuiteScore] = {}
    for s in scores:
        if s.name in out:
            raise ValueError(f"{side} scores name suite {s.name!r} twice")
        out[s.name] = s
    return out


def paired_p_value(candidate: list[bool], champion: list[bool]) -> float:
    """One-sided exact sign test (McNemar) that the candidate is right more often than the champion on the
    same samples: P(X >= b) for X ~ Binomial(b + c, 1/2), where b counts samples only the candidate gets right
    and c those only the champion gets right. 1.0 when the two never disagree."""
    if len(candidate) != len(champion):
        raise ValueError(f"paired test needs equal lengths, got {len(candidate)} and {len(champion)}")
    b = sum(x and not y for x, y in zip(candidate, champion, strict=True))
    c = sum(y and not x for x, y in zip(candidate, champion, strict=True))
    n = b + c
    if n == 0:
        return 1.0
    # in log space: comb(n, k) / 2**n overflows floats for a few thousand disagreements
    log_half_n = n * math.log(0.5)
    terms = (
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + log_half_n for k in range(b, n + 1)
    )
    return min(1.0, math.fsum(math.exp(t) for t in terms))


def two_proportion_p_value(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided pooled two-proportion z-test that x1/n1 > x2/n2. 1.0 when a side has no samples or the pooled
    proportion is 0 or 1 (no variance, so no evidence of a difference)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2))
    if se == 0.0:
        return 1.0
    z = (x1 / n1 - x2 / n2) / se
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _significance(policy: GatePolicy, cand: SuiteScore, champ: SuiteScore) -> Check:
    name = f"significance:{policy.suite}"
    pairable = (
        cand.correct is not None and champ.correct is not None and len(cand.correct) == len(champ.correct)
    )
    mode = policy.significance
    if mode == "auto":
        mode = "paired" if pairable else "two_proportion"
    if mode == "paired":
        if not pairable:
            return Check(
                name=name,
                passed=False,
                detail="paired test needs per-sample correctness of equal length from both revisions",
            )
        assert cand.correct is not None and champ.correct is not None
        p = paired_p_value(cand.correct, champ.correct)
        test = "paired sign test"
    else:
        p = two_proportion_p_value(cand.successes, cand.n, champ.successes, champ.n)
        test = "two-proportion z-test"
    ok = p < policy.alpha
    return Check(
        name=name, passed=ok, detail=f"{test}: p={p:.4g} {'<' if ok else '>='} alpha={policy.alpha:g}"
    )


def decide(
    policy: GatePolicy, candidate: Iterable[SuiteScore], champion: Iterable[SuiteScore] | None = None
) -> GateDecision:
    """Run the gate on a candidate's suite scores against the champion's (None: there is no champion yet)."""
    cand = _by_name(candidate, "candidate")
    champ = _by_name(champion, "champion") if champion is not None else None
    checks: list[Check] = []

    compared = {policy.suite, *policy.guard_suites}  # the suites read on the champion's side too
    readable: set[str] = set()  # suites every side the gate compares on has, with enough samples
    for suite in policy.suites():
        need = policy.min_samples_for(suite)
        sides = [("candidate", cand)]
        if champ is not None and suite in compared:
            sides.append(("champion", champ))
        problems: list[str] = []
        counts: list[str] = []
        for side, scores in sides:
            s = scores.get(suite)
            if s is None:
                problems.append(f"{side} was not evaluated on it")
            else:
                counts.append(f"{side} n={s.n}")
                if s.n < need:
                    problems.append(f"{side} has {s.n} < {need} samples")
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
            checks.append(Check(name=f"floor:{suite}", passed=ok, detail=detail))

    if champ is not None:
        if policy.suite in readable:
            c, h = cand[policy.suite].score, champ[policy.suite].score
            ok = c >= h + policy.margin - _SLACK
            detail = f"candidate {c:.4g} {'>=' if ok else '<'} champion {h:.4g} + margin {policy.margin:.4g}"
            checks.append(Check(name=f"margin:{policy.suite}", passed=ok, detail=detail))
        for suite in policy.guard_suites:
            if suite in readable:
                c, h = cand[suite].score, champ[suite].score
                ok = c >= h - policy.guard_tolerance - _SLACK
                detail = (
                    f"candidate {c:.4g} {'>=' if ok else '<'} champion {h:.4g} "
                    f"- tolerance {policy.guard_tolerance:.4g}"
                )
                checks.append(Check(name=f"guard:{suite}", passed=ok, detail=detail))
        if policy.significance != "none" and policy.suite in readable:
            checks.append(_significance(policy, cand[policy.suite], champ[policy.suite]))

    failed = [c for c in checks if not c.passed]
    reasons: list[str] = []
    if champ is None:
        reasons.append("no champion yet (first revision): compared to floors only")
    reasons += [f"{c.name}: {c.detail}" for c in failed]
    if not failed:
        reasons.append(f"all {len(checks)} checks passed")
    return GateDecision(passed=not failed, reasons=reasons, checks=checks, first_revision=champ is None)
