"""Off-policy estimates recover a known policy's value from another policy's logs, within their intervals, and
rank a good router above a bad one; fit_router learns from the log."""

from __future__ import annotations

import numpy as np
import pytest

from mint_core.routing import (
    ContextFreeThompson,
    EpsilonGreedy,
    Featurizer,
    Router,
    RouteRecord,
    dr,
    fit_router,
    ips,
    snips,
    sparse_features,
)

FEAT = Featurizer(dim=32)
ARMS = ["arith", "code", "base"]
MEANS = {0: {"arith": 0.9, "code": 0.1, "base": 0.5}, 1: {"arith": 0.1, "code": 0.8, "base": 0.5}}


def prompt(c: int, rng: np.random.Generator) -> str:
    a, b = (int(v) for v in rng.integers(0, 1000, size=2))
    return f"What is {a} plus {b}?" if c == 0 else f"Write a python function f{a} that returns {b}."


def trained(flip: bool, seed: int) -> Router:
    """A router that learned the best arm per cluster (or, with flip, the worst), from full-information rewards."""
    rng = np.random.default_rng(seed)
    router = Router(FEAT, seed=seed)
    for i in range(300):
        c = i % 2
        x = FEAT.transform(prompt(c, rng))
        for arm in ARMS:
            m = 1 - MEANS[c][arm] if flip else MEANS[c][arm]
            router.update(arm, x, float(rng.random() < m))
    return router


def logs(logger: Router, n: int, seed: int) -> list[RouteRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c = int(rng.integers(2))
        x = FEAT.transform(prompt(c, rng))
        d = logger.choose(x, ARMS, rng=rng)
        out.append(
            RouteRecord(
                rid=f"r{i}",
                t=float(i),
                router_revision="log",
                features_digest=FEAT.digest(x),
                features=sparse_features(x),
                candidates=ARMS,
                choice=d.arm,
                prob=d.prob,
                explored=d.explored,
                reward=float(rng.random() < MEANS[c][d.arm]),
                reward_source="task",
            )
        )
    return out


def true_value(target: Router, seed: int) -> float:
    """The target's expected reward per request, from its exact probabilities on fresh prompts."""
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(1000):
        c = int(rng.integers(2))
        pi = target.probs(FEAT.transform(prompt(c, rng)), ARMS)
        vals.append(sum(p * MEANS[c][a] for p, a in zip(pi, ARMS, strict=True)))
    return float(np.mean(vals))


@pytest.fixture(scope="module")
def setting() -> tuple[list[RouteRecord], Router, Router]:
    logger = Router(FEAT, epsilon=0.5, seed=5)  # a half-random logging router with uneven propensities
    rng = np.random.default_rng(5)
    for _ in range(20):
        x = FEAT.transform(prompt(0, rng))
        logger.update("base", x, 1.0)
    return logs(logger, 2000, seed=6), trained(False, 7), trained(True, 8)


@pytest.mark.parametrize("estimator", [ips, snips, dr])
def test_estimates_recover_a_known_policys_value_within_their_interval(setting, estimator) -> None:
    records, good, bad = setting
    for target in (good, bad):
        v = true_value(target, seed=11)
        est = estimator(records, target)
        assert est.n == 2000 and est.method == estimator.__name__
        # the truth lies within the interval stretched from 95% to 99% (z 2.576): six 95% checks would miss one
        # in four runs by chance alone, and a biased estimator misses by far more
        half = (est.hi - est.lo) / 2 * 2.576 / 1.96
        assert abs(est.value - v) <= half, (est, v)
        assert est.hi - est.lo < 0.2
    assert estimator(records, bad).hi < estimator(records, good).lo


def test_doubly_robust_is_tighter_than_ips(setting) -> None:
    records, good, _ = setting
    a, b = ips(records, good), dr(records, good)
    assert b.hi - b.lo < a.hi - a.lo


def test_no_rewarded_record_gives_nan_with_n_zero(setting) -> None:
    records, good, _ = setting
    unrewarded = [r.model_copy(update={"reward": None}) for r in records[:10]]
    for est in (ips(unrewarded, good), snips(unrewarded, good), dr(unrewarded, good)):
        assert est.n == 0 and np.isnan(est.value)


def test_fit_router_learns_from_the_log_and_keeps_its_base(setting) -> None:
    records, _, _ = setting
    fitted = fit_router(records, featurizer=FEAT)
    assert dr(records, fitted).value > 0.75
    base = trained(False, 9)
    before = base.probs(FEAT.transform("What is 1 plus 2?"), ARMS)
    on_base = fit_router(records[:100], base=base)
    assert np.array_equal(base.probs(FEAT.transform("What is 1 plus 2?"), ARMS), before)  # base untouched
    assert on_base.revision == "" and on_base.arms() == base.arms()
    with pytest.raises(ValueError, match="come from the base"):
        fit_router(records, base=base, alpha=1.0)
    with pytest.raises(ValueError, match="dim 32, router takes 64"):
        fit_router(records, featurizer=Featurizer(dim=64))


@pytest.mark.parametrize("baseline", [EpsilonGreedy, ContextFreeThompson])
def test_context_free_baselines_find_the_best_arm_on_average(baseline) -> None:
    rng = np.random.default_rng(12)
    bandit = baseline(seed=12)
    means = {"arith": 0.3, "code": 0.7, "base": 0.5}
    x = FEAT.transform("ignored")
    picks = []
    for _ in range(600):
        d = bandit.choose(x, ARMS, rng=rng)
        assert 0 < d.prob <= 1
        bandit.update(d.arm, x, float(rng.random() < means[d.arm]))
        picks.append(d.arm)
    assert picks[-200:].count("code") / 200 > 0.7
    assert bandit.choose(x, ARMS, rng=rng, costs={"code": 1.0}).arm != "code"
