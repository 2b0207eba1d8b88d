"""Off-policy evaluation: what reward would a router have earned on the requests another router served?

Each logged decision carries the probability the serving (logging) router gave its choice. For a target router
with probability pi(a | x) of that choice, the importance weight w = pi / prob reweighs the logged reward:

- `ips`: mean of w * r. Unbiased when the logging policy gave every arm the target picks a positive probability
  (the router's epsilon mix does this for every arm it considers), high variance when weights are large.
- `snips`: sum(w r) / sum(w), self-normalized: slightly biased, much lower variance with few records.
- `dr` (doubly robust): a reward model q(x, a) predicts every arm's reward; the estimate is
  sum_a pi(a|x) q(x, a) + w (r - q(x, choice)): unbiased if either the propensities or the model are right, and
  of low variance when the model is good. The default model is per-arm ridge regression on the logged rewards,
  cross-fitted over two folds (each record's prediction comes from a model fitted on the other half), so the
  model does not fit the very noise it corrects.

Confidence intervals: 95%, normal approximation over the per-record terms (mean +- 1.96 standard errors; for
SNIPS the delta method's linearized terms). Records are treated as independent, which the decisions of a learning
router are not quite; with hundreds of records the interval is what the gate needs, not an exact bound.

The target is evaluated as a frozen policy (its `probs` at its current state); records without a reward are left
out. With no rewarded record every estimate is NaN with n = 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mint_core.routing.log import RouteRecord
from mint_core.routing.router import Router

Z95 = 1.959963984540054
"""Two-sided 95% normal quantile."""
MODEL_RIDGE = 1.0
"""Ridge of the default DR reward model."""

RewardModel = Callable[[np.ndarray, Sequence[str]], np.ndarray]
"""(features, arms) -> predicted reward of each arm."""


@dataclass(frozen=True)
class Estimate:
    """An off-policy estimate of a router's mean reward per request, with its 95% confidence interval."""

    value: float
    lo: float
    hi: float
    n: int
    method: str


def _interval(terms: np.ndarray, method: str, value: float | None = None) -> Estimate:
    n = len(terms)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, method)
    v = float(terms.mean()) if value is None else value
    se = float(terms.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")
    return Estimate(v, v - Z95 * se, v + Z95 * se, n, method)


def _logged(
    records: Sequence[RouteRecord], target: Router
) -> list[tuple[RouteRecord, np.ndarray, np.ndarray]]:
    """The rewarded records, each with its features and the target's probabilities over its candidates."""
    dim = target.featurizer.dim
    out = []
    for rec in records:
        if rec.reward is None:
            continue
        x = rec.vector(dim)
        out.append((rec, x, target.probs(x, rec.candidates)))
    return out


def _weights(logged: list[tuple[RouteRecord, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    w = np.array([pi[rec.candidates.index(rec.choice)] / rec.prob for rec, _, pi in logged])
    r = np.array([rec.reward for rec, _, _ in logged], dtype=float)
    return w, r


def ips(records: Sequence[RouteRecord], target: Router) -> Estimate:
    """Inverse propensity scoring: mean of (target prob / logged prob) * reward."""
    w, r = _weights(_logged(records, target))
    return _interval(w * r, "ips")


def snips(records: Sequence[RouteRecord], target: Router) -> Estimate:
    """Self-normalized IPS: sum(w r) / sum(w), interval by the delta method."""
    w, r = _weights(_logged(records, target))
    if len(w) == 0 or w.sum() <= 0:
        return _interval(np.zeros(0) if len(w) == 0 else np.zeros_like(w), "snips")
    v = float((w * r).sum() / w.sum())
    return _interval(w * (r - v) / w.mean() + v, "snips", value=v)


def dr(records: Sequence[RouteRecord], target: Router, model: RewardModel | None = None) -> Estimate:
    """Doubly robust: the model's prediction under the target policy, corrected by the weighted residual of the
    logged choice. `model(x, arms)` predicts rewards; default: cross-fitted per-arm ridge on these records."""
    logged = _logged(records, target)
    w, r = _weights(logged)
    if not logged:
        return _interval(np.zeros(0), "dr")
    if model is None:
        q = _crossfit(logged, target.featurizer.dim)
    else:
        q = [model(x, rec.candidates) for rec, x, _ in logged]
    terms = np.array(
        [
            float(pi @ qi) + wi * (ri - float(qi[rec.candidates.index(rec.choice)]))
            for (rec, _, pi), qi, wi, ri in zip(logged, q, w, r, strict=True)
        ]
    )
    return _interval(terms, "dr")


class RidgeRewards:
    """Per-arm ridge regression of reward on features (plus a bias); an arm with no data predicts the mean."""

    def __init__(self, dim: int, ridge: float = MODEL_RIDGE) -> None:
        self.dim, self.ridge = dim, ridge
        self.theta: dict[str, np.ndarray] = {}
        self.mean = 0.0

    def fit(self, xs: np.ndarray, arms: Sequence[str], rewards: np.ndarray) -> RidgeRewards:
        X = np.hstack([xs, np.ones((len(xs), 1))])
        self.mean = float(rewards.mean()) if len(rewards) else 0.0
        for arm in sorted(set(arms)):
            m = np.array([a == arm for a in arms])
            Xa = X[m]
            A = Xa.T @ Xa + self.ridge * np.eye(X.shape[1])
            self.theta[arm] = np.linalg.solve(A, Xa.T @ (rewards[m] - self.mean))
        return self

    def __call__(self, x: np.ndarray, arms: Sequence[str]) -> np.ndarray:
        xa = np.append(np.asarray(x, dtype=float), 1.0)
        return np.clip(
            [self.mean + float(self.theta[a] @ xa) if a in self.theta else self.mean for a in arms], 0, 1
        )


def _crossfit(logged: list[tuple[RouteRecord, np.ndarray, np.ndarray]], dim: int) -> list[np.ndarray]:
    """Each record's predicted rewards over its candidates, from a model fitted on the other fold."""
    xs = np.stack([x for _, x, _ in logged]).astype(float)
    arms = [rec.choice for rec, _, _ in logged]
    r = np.array([rec.reward for rec, _, _ in logged], dtype=float)
    fold = np.arange(len(logged)) % 2
    if len(logged) < 4:
        fold[:] = 0
        models = [RidgeRewards(dim).fit(xs, arms, r)] * 2
    else:
        models = [
            RidgeRewards(dim).fit(
                xs[fold != k], [a for a, f in zip(arms, fold, strict=True) if f != k], r[fold != k]
            )
            for k in (0, 1)
        ]
    return [models[f](x, rec.candidates) for (rec, x, _), f in zip(logged, fold, strict=True)]
