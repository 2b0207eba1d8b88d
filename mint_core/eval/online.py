"""Online canary test: is a canary adapter revision better or worse than the champion on live traffic?

A watch flow polls the scores of served requests and must decide by itself, at any poll, whether to promote
the canary, roll it back or keep watching. Looking at a classical test after every poll and stopping at the
first "significant" result inflates its false-positive rate far above alpha. This module uses an
*always-valid* test instead: a confidence sequence, i.e. a sequence of intervals that contain the true
difference at every time at once with probability about 1 - alpha, so the flow may look after every request
and stop whenever it likes.

Setup. The router sends each request to the canary with a known probability p (`share`, 0 < p < 1) and to
the champion ("control") otherwise, deciding by a hash of the request key, so the assignment does not depend
on anything that happened before. Every served request gets a score Y in [0, 1]. The quantity tested is
mu1 - mu0, the canary's mean score minus the champion's.

Pseudo-outcomes (augmented inverse-propensity weighting, AIPW, with predictable plug-in means). For request i
let m1 and m0 be the running means of the canary's and the champion's scores over the requests *before* i
(0.5 while an arm has none). Then

    canary:   phi_i =  (Y_i - m1) / p       + (m1 - m0)
    control:  phi_i = -(Y_i - m0) / (1 - p) + (m1 - m0)

Because m1, m0 are fixed before request i is routed and the routing is an independent coin of known bias p,
E[phi_i | past] = p (mu1 - m1) / p - (1 - p) (mu0 - m0) / (1 - p) + (m1 - m0) = mu1 - mu0 exactly, however
poor the plug-ins. So the phi_i are unbiased for the difference one request at a time, and their running
mean diff_t = (phi_1 + ... + phi_t) / t estimates it using every request (not only the canary's small
share). As the plug-in means settle, the variance of phi approaches the efficient var1/p + var0/(1 - p).
Each phi is bounded (|phi| <= 1/min(p, 1 - p) + 1), which the central-limit argument below needs.

Confidence sequence. Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas, "Time-uniform central limit theory and
asymptotic confidence sequences" (Annals of Statistics, 2024; arXiv:2103.06476) show that a time-uniform
(strong-approximation) analogue of the CLT lets one plug the running sample variance s2_t of such
pseudo-outcomes into the boundaries of Gaussian sequential tests; they apply it to AIPW pseudo-outcomes of
sequential randomized experiments, as here. With Robbins' normal-mixture boundary the two-sided interval at
level alpha after t requests is diff_t +- w_t with

    w_t = sqrt( 2 (t s2 rho^2 + 1) / (t^2 rho^2) * log( sqrt(t s2 rho^2 + 1) / alpha ) ).

It covers mu1 - mu0 at all t simultaneously with probability tending to at least 1 - alpha (an *asymptotic*
confidence sequence: the guarantee is for large t, so the flow also waits for `min_per_arm` scores per arm
before it acts, and s2 is floored at 1e-4 so that a run of identical early scores cannot shrink the
interval to nothing). The mixture parameter rho only decides *where* the interval is tightest:
rho^2 = (-2 log alpha + log(-2 log alpha + 1)) / t_opt makes it tightest near t_opt requests (for phi of
unit variance; larger variance moves that point earlier in proportion). Any rho is valid; a misjudged t_opt
costs some width elsewhere, never validity.

Decision, at level alpha with a `margin` on the difference: until both arms have `min_per_arm` scores,
continue. Then promote when the interval lies wholly above the margin (lo > margin), roll back when it lies
wholly below (hi < margin), give up as inconclusive once `max_requests` requests were scored, and otherwise
continue. Since the interval is valid at every time, the chance that a canary no better than the margin is
ever promoted (or that one no worse is ever rolled back) stays at about alpha however often the flow polls.

Every update is O(1): running sums per arm and Welford's recurrence for the mean and variance of phi.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Decision = Literal["continue", "promote", "rollback", "inconclusive"]
"""What the watch flow should do now: keep watching, promote the canary, roll it back, or give up undecided."""

Arm = Literal["canary", "control"]
"""Which revision served a request: the canary, or the champion ("control")."""

_ARMS: tuple[str, ...] = ("canary", "control")
_S2_FLOOR = 1e-4  # floor on the variance of phi: identical early scores must not make the interval vanish
_PRIOR_MEAN = 0.5  # plug-in mean of an arm before it has any score


class OnlineTestConfig(BaseModel):
    """How the canary is routed and when the online test decides."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float = Field(gt=0.0, lt=1.0)
    """Probability that the router sends a request to the canary (known, fixed, independent of the past)."""
    alpha: float = Field(0.05, gt=0.0, lt=1.0)
    """Level: the always-valid interval has coverage 1 - alpha at all times at once, so a wrong promotion or
    rollback happens with probability about alpha however often the scores are polled."""
    margin: float = Field(0.0, ge=-1.0, le=1.0)
    """Difference (canary minus champion mean score) the decision is taken against: promote when the interval
    lies above it, roll back when below. Negative: non-inferiority (promote unless clearly worse by more)."""
    min_per_arm: int = Field(30, ge=1)
    """Fewest scores each arm needs before any decision other than "continue" (the interval is asymptotic)."""
    max_requests: int = Field(20000, ge=1)
    """Scored requests after which an undecided test ends "inconclusive"."""
    t_opt: int = Field(1000, ge=1)
    """Number of requests near which the interval is made tightest (tunes the mixture; validity does not
    depend on it)."""

    @property
    def rho2(self) -> float:
        """rho^2 of the normal-mixture boundary, chosen to make it tightest near `t_opt` requests."""
        la = -2.0 * math.log(self.alpha)
        return (la + math.log(la + 1.0)) / self.t_opt


class Estimate(BaseModel):
    """The online test's state after the requests scored so far, and what to do about it."""

    model_config = ConfigDict(frozen=True)

    n: int
    """Scored requests, both arms."""
    n_canary: int
    """Scored requests served by the canary."""
    n_control: int
    """Scored requests served by the champion."""
    mean_canary: float | None
    """Plain mean score of the canary; None before it has one."""
    mean_control: float | None
    """Plain mean score of the champion; None before it has one."""
    diff: float | None
    """Estimated difference, canary minus champion (mean of the AIPW pseudo-outcomes); None until both arms
    have a score."""
    lo: float | None
    """Lower end of the always-valid (1 - alpha) interval of the difference; None until both arms have a
    score."""
    hi: float | None
    """Upper end of that interval; None until both arms have a score."""
    decision: Decision
    """What to do now."""
    reason: str
    """The decision in one sentence, with the evidence behind it."""

    def row(self) -> dict[str, float | int | str | None]:
        """A flat dict of every field (MLflow metrics, a Prefect table artifact)."""
        return {
            "n": self.n,
            "n_canary": self.n_canary,
            "n_control": self.n_control,
            "mean_canary": self.mean_canary,
            "mean_control": self.mean_control,
            "diff": self.diff,
            "lo": self.lo,
            "hi": self.hi,
            "decision": self.decision,
            "reason": self.reason,
        }


def half_width(t: int, s2: float, alpha: float, rho2: float) -> float:
    """Half-width of the two-sided asymptotic confidence sequence (Robbins' normal mixture) after t
    observations of running variance s2 (floored at 1e-4)."""
    v = t * max(s2, _S2_FLOOR) * rho2 + 1.0
    return math.sqrt(2.0 * v / (t * t * rho2) * math.log(math.sqrt(v) / alpha))


class SequentialTest:
    """An always-valid test of a canary against the champion, fed one scored request at a time."""

    def __init__(self, config: OnlineTestConfig) -> None:
        self.config = config
        self._rho2 = config.rho2
        self._count = {"canary": 0, "control": 0}
        self._sum = {"canary": 0.0, "control": 0.0}
        self._t = 0
        self._phi_mean = 0.0
        self._phi_m2 = 0.0  # Welford: sum of squared deviations of phi from its running mean

    def update(self, arm: Arm, score: float) -> None:
        """Add one scored request. Raises ValueError for an arm other than "canary"/"control" or a score that
        is not a number in [0, 1] (nan included); the state is unchanged then."""
        self._add(arm, score)

    def extend(self, events: Iterable[tuple[str, float]]) -> None:
        """Add scored requests in order, each an (arm, score) pair; stops at the first bad one (raising, with
        the ones before it added)."""
        for arm, score in events:
            self._add(arm, score)

    def _add(self, arm: str, score: float) -> None:
        if arm not in _ARMS:
            raise ValueError(f"unknown arm {arm!r}: expected 'canary' or 'control'")
        try:
            y = float(score)
        except (TypeError, ValueError):
            raise ValueError(f"score {score!r} is not a number in [0, 1]") from None
        if not 0.0 <= y <= 1.0:  # nan fails both comparisons
            raise ValueError(f"score {score!r} is outside [0, 1]")
        p = self.config.share
        m1 = self._mean("canary", _PRIOR_MEAN)
        m0 = self._mean("control", _PRIOR_MEAN)
        phi = (y - m1) / p + (m1 - m0) if arm == "canary" else -(y - m0) / (1.0 - p) + (m1 - m0)
        self._t += 1
        delta = phi - self._phi_mean
        self._phi_mean += delta / self._t
        self._phi_m2 += delta * (phi - self._phi_mean)
        self._count[arm] += 1
        self._sum[arm] += y

    def _mean(self, arm: str, empty: float) -> float:
        n = self._count[arm]
        return self._sum[arm] / n if n else empty

    def estimate(self) -> Estimate:
        """The estimate, its always-valid interval and the decision after every request added so far."""
        cfg = self.config
        t, n1, n0 = self._t, self._count["canary"], self._count["control"]
        mean1 = self._sum["canary"] / n1 if n1 else None
        mean0 = self._sum["control"] / n0 if n0 else None
        counts = f"{t:,} scored requests ({n1:,} canary, {n0:,} champion)"
        if not (n1 and n0):
            return Estimate(
                n=t,
                n_canary=n1,
                n_control=n0,
                mean_canary=mean1,
                mean_control=mean0,
                diff=None,
                lo=None,
                hi=None,
                decision="continue",
                reason=f"waiting for scores on both arms (at least {cfg.min_per_arm:,} each): {counts}",
            )
        s2 = self._phi_m2 / (t - 1) if t > 1 else 0.0
        w = half_width(t, s2, cfg.alpha, self._rho2)
        diff = self._phi_mean
        lo, hi = diff - w, diff + w
        level = f"{100.0 * (1.0 - cfg.alpha):g}%"
        evidence = (
            f"difference {diff:+.3f} ({level} always-valid interval {lo:+.3f}..{hi:+.3f}) after {counts}"
        )
        against = "" if cfg.margin == 0.0 else f" (margin {cfg.margin:+.3f})"
        decision: Decision
        if min(n1, n0) < cfg.min_per_arm:
            decision = "continue"
            reason = f"waiting for at least {cfg.min_per_arm:,} scores per arm: {evidence}"
        elif lo > cfg.margin:
            decision = "promote"
            reason = f"canary better{against}: {evidence}"
        elif hi < cfg.margin:
            decision = "rollback"
            reason = f"canary worse{against}: {evidence}"
        elif t >= cfg.max_requests:
            decision = "inconclusive"
            reason = (
                f"no decision within the limit of {cfg.max_requests:,} requests: the interval still "
                f"contains the margin {cfg.margin:+.3f}; {evidence}"
            )
        else:
            decision = "continue"
            reason = f"keep watching, the interval contains the margin {cfg.margin:+.3f}: {evidence}"
        return Estimate(
            n=t,
            n_canary=n1,
            n_control=n0,
            mean_canary=mean1,
            mean_control=mean0,
            diff=diff,
            lo=lo,
            hi=hi,
            decision=decision,
            reason=reason,
        )
