"""The online canary test (`mint_core.eval.online`): its false-decision rate under continuous monitoring, its
power and time to decide at +/-0.15, the inconclusive end, bad input, and the numbers behind one estimate.

The type-I check needs 400 streams of 5,000 requests looked at after every request; the class does that at
about 10 us a request, so the streams are replayed by an independent numpy version of the same computation
(`_replay`), and the class is checked against it, request by request, on the first 40 of them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from mint_core.eval.online import Estimate, OnlineTestConfig, SequentialTest

ALPHA = 0.05


def _stream(
    rng: np.random.Generator, n: int, share: float, mu1: float, mu0: float
) -> tuple[np.ndarray, np.ndarray]:
    """n requests: True where routed to the canary (probability share), and Bernoulli scores per arm."""
    canary = rng.random(n) < share
    scores = (rng.random(n) < np.where(canary, mu1, mu0)).astype(float)
    return canary, scores


def _replay(
    canary: np.ndarray, scores: np.ndarray, cfg: OnlineTestConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The test's state after every request of many streams at once (rows: streams), from the formulas in the
    module docstring: (canary counts, control counts, diff, lo, hi), each of shape (streams, requests)."""
    p, t = cfg.share, np.arange(1, scores.shape[1] + 1)
    n1, n0 = np.cumsum(canary, 1), np.cumsum(~canary, 1)
    s1, s0 = np.cumsum(np.where(canary, scores, 0.0), 1), np.cumsum(np.where(canary, 0.0, scores), 1)

    def before(a: np.ndarray) -> np.ndarray:  # the value before each request
        return np.hstack([np.zeros((a.shape[0], 1)), a[:, :-1]])

    m1 = np.where(before(n1) > 0, before(s1) / np.maximum(before(n1), 1), 0.5)
    m0 = np.where(before(n0) > 0, before(s0) / np.maximum(before(n0), 1), 0.5)
    phi = np.where(canary, (scores - m1) / p, -(scores - m0) / (1 - p)) + (m1 - m0)
    diff = np.cumsum(phi, 1) / t
    s2 = np.where(t > 1, (np.cumsum(phi**2, 1) - t * diff**2) / np.maximum(t - 1, 1), 0.0)
    la = -2 * math.log(cfg.alpha)
    rho2 = (la + math.log(la + 1)) / cfg.t_opt
    v = t * np.maximum(s2, 1e-4) * rho2 + 1
    w = np.sqrt(2 * v / (t**2 * rho2) * np.log(np.sqrt(v) / cfg.alpha))
    return n1, n0, diff, diff - w, diff + w


def test_null_false_decisions_stay_below_alpha_under_continuous_monitoring() -> None:
    """Equal arms (0.6 both, share 0.2), looked at after every one of 5,000 requests: the share of 400 streams
    that ever promote or roll back is at most alpha plus 3 binomial standard errors of a 400-stream estimate
    of alpha (0.05 + 3 * 0.0109 = 0.083): a valid test exceeds that bound with probability about 0.2%. An
    invalid one is nowhere near it: a fixed-n z-test (1.96) looked at this often errs in about 43% of the streams."""
    cfg = OnlineTestConfig(share=0.2, alpha=ALPHA, max_requests=10**9)
    streams, n = 400, 5000
    rng = np.random.default_rng(20240611)
    canary, scores = _stream(rng, streams * n, cfg.share, 0.6, 0.6)
    canary, scores = canary.reshape(streams, n), scores.reshape(streams, n)
    n1, n0, diff, lo, hi = _replay(canary, scores, cfg)
    ready = (n1 >= cfg.min_per_arm) & (n0 >= cfg.min_per_arm)
    decided = ready & ((lo > cfg.margin) | (hi < cfg.margin))

    # the real class, after every request of the first 40 streams, agrees with the replay
    checked = 40
    got = np.full((checked, n, 3), np.nan)
    decisions = np.empty((checked, n), dtype=object)
    for s in range(checked):
        test = SequentialTest(cfg)
        for i in range(n):
            test.update("canary" if canary[s, i] else "control", float(scores[s, i]))
            est = test.estimate()
            decisions[s, i] = est.decision
            if est.diff is not None:
                got[s, i] = est.diff, est.lo, est.hi
    both = (n1[:checked] > 0) & (n0[:checked] > 0)
    assert np.array_equal(~np.isnan(got[..., 0]), both)
    want = np.stack([diff[:checked], lo[:checked], hi[:checked]], axis=-1)
    np.testing.assert_allclose(got[both], want[both], rtol=0, atol=1e-9)
    expected = np.where(
        decided[:checked], np.where(lo[:checked] > cfg.margin, "promote", "rollback"), "continue"
    ).astype(object)
    assert np.array_equal(decisions, expected)
    assert (decisions != "continue").any()  # the check saw some (false) decisions, not only "continue"

    rate = decided.any(axis=1).mean()
    bound = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / streams)
    print(
        f"\ntype-I rate under continuous monitoring: {rate:.4f} ({streams} streams x {n} requests), bound {bound:.4f}"
    )
    assert rate <= bound


@pytest.mark.parametrize(
    ("share", "mu_canary", "expected"),
    [(0.25, 0.75, "promote"), (0.25, 0.45, "rollback"), (0.1, 0.75, "promote"), (0.1, 0.45, "rollback")],
)
def test_a_difference_of_015_is_decided_in_time(share: float, mu_canary: float, expected: str) -> None:
    """Canary 0.15 better (or worse) than a 0.6 champion: at least 45 of 50 streams decide the right way within
    6,000 requests, and none the wrong way."""
    cfg = OnlineTestConfig(share=share, alpha=ALPHA, max_requests=6000)
    rng = np.random.default_rng(7)
    outcomes: list[tuple[str, int]] = []
    for _ in range(50):
        canary, scores = _stream(rng, cfg.max_requests, share, mu_canary, 0.6)
        test = SequentialTest(cfg)
        for arm, y in zip(canary.tolist(), scores.tolist(), strict=True):
            test.update("canary" if arm else "control", y)
            est = test.estimate()
            if est.decision != "continue":
                break
        outcomes.append((est.decision, est.n))
    right = [n for decision, n in outcomes if decision == expected]
    wrong = [decision for decision, _ in outcomes if decision in {"promote", "rollback"} - {expected}]
    print(
        f"\nshare {share}, canary {mu_canary} vs 0.6: {len(right)}/50 {expected}, median requests to decision "
        f"{np.median(right):.0f} (quartiles {np.percentile(right, 25):.0f}..{np.percentile(right, 75):.0f})"
    )
    assert len(right) >= 45
    assert not wrong


def test_equal_arms_end_inconclusive_at_max_requests() -> None:
    cfg = OnlineTestConfig(share=0.3, max_requests=3000)
    canary, scores = _stream(np.random.default_rng(3), cfg.max_requests, cfg.share, 0.6, 0.6)
    test = SequentialTest(cfg)
    for arm, y in zip(canary.tolist(), scores.tolist(), strict=True):
        assert test.estimate().decision == "continue"
        test.update("canary" if arm else "control", y)
    est = test.estimate()
    assert (est.n, est.decision) == (3000, "inconclusive")
    assert est.lo is not None and est.hi is not None and est.lo <= 0.0 <= est.hi
    assert "limit of 3,000 requests" in est.reason


@pytest.mark.parametrize(
    ("arm", "score", "named"),
    [("canary", 1.5, "1.5"), ("control", -0.1, "-0.1"), ("canary", math.nan, "nan"), ("nope", 0.5, "'nope'")],
)
def test_bad_input_is_refused_naming_it(arm: str, score: float, named: str) -> None:
    test = SequentialTest(OnlineTestConfig(share=0.5))
    test.update("canary", 1.0)
    with pytest.raises(ValueError, match=named):
        test.update(arm, score)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=named):
        test.extend([("control", 0.0), (arm, score), ("control", 1.0)])
    est = test.estimate()
    assert (est.n, est.n_canary, est.n_control) == (
        2,
        1,
        1,
    )  # the good event before the bad one, nothing after


@pytest.mark.parametrize(
    "fields",
    [{"share": 0.0}, {"share": 1.0}, {"share": 0.5, "alpha": 0.0}, {"share": 0.5, "min_per_arm": 0}, {}],
    ids=["share-0", "share-1", "alpha-0", "min_per_arm-0", "no-share"],
)
def test_bad_config_is_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        OnlineTestConfig(**fields)  # type: ignore[arg-type]


def test_no_decision_before_min_per_arm_and_no_difference_before_both_arms() -> None:
    test = SequentialTest(OnlineTestConfig(share=0.5, min_per_arm=30))
    est = test.estimate()
    assert (est.n, est.diff, est.lo, est.hi, est.mean_canary, est.decision) == (
        0,
        None,
        None,
        None,
        None,
        "continue",
    )
    test.extend([("canary", 1.0)] * 5)
    est = test.estimate()
    assert (est.n_canary, est.n_control, est.mean_canary, est.mean_control) == (5, 0, 1.0, None)
    assert (est.diff, est.lo, est.hi, est.decision) == (None, None, None, "continue")
    # a canary always right and a champion always wrong: the interval clears 0 long before 30 per arm
    test.extend([("control", 0.0)] * 29 + [("canary", 1.0)] * 24)
    est = test.estimate()
    assert (est.n_canary, est.n_control) == (29, 29)
    assert est.lo is not None and est.lo > 0.0
    assert est.decision == "continue"
    assert "at least 30 scores per arm" in est.reason
    test.update("control", 0.0)
    test.update("canary", 1.0)
    assert test.estimate().decision == "promote"


def test_one_estimate_by_hand() -> None:
    """Two requests at share 0.25: canary 1.0 then control 0.0. phi1 = (1 - 0.5)/0.25 + (0.5 - 0.5) = 2;
    then m1 = 1, m0 = 0.5 and phi2 = -(0 - 0.5)/0.75 + (1 - 0.5) = 7/6. diff = 19/12, s2 = (2 - 7/6)^2 / 2."""
    cfg = OnlineTestConfig(share=0.25, min_per_arm=1, t_opt=100)
    test = SequentialTest(cfg)
    test.extend([("canary", 1.0), ("control", 0.0)])
    est = test.estimate()
    la = -2 * math.log(0.05)
    rho2 = (la + math.log(la + 1)) / 100
    v = 2 * ((2 - 7 / 6) ** 2 / 2) * rho2 + 1
    w = math.sqrt(2 * v / (4 * rho2) * math.log(math.sqrt(v) / 0.05))
    assert est.diff == pytest.approx(19 / 12)
    assert (est.lo, est.hi) == (pytest.approx(19 / 12 - w), pytest.approx(19 / 12 + w))
    assert (est.mean_canary, est.mean_control) == (1.0, 0.0)


def test_reason_and_row() -> None:
    test = SequentialTest(OnlineTestConfig(share=0.5, min_per_arm=30))
    test.extend([("canary", 1.0), ("control", 0.0)] * 617)
    est = test.estimate()
    assert est.decision == "promote"
    assert est.reason.startswith("canary better: difference +1.000 (95% always-valid interval +0.")
    assert est.reason.endswith("after 1,234 scored requests (617 canary, 617 champion)")
    row = est.row()
    assert list(row) == list(Estimate.model_fields)
    assert row["n"] == 1234 and row["decision"] == "promote" and row["lo"] == est.lo
    margin = SequentialTest(OnlineTestConfig(share=0.5, margin=-0.1))
    margin.extend([("canary", 0.0), ("control", 1.0)] * 100)
    est = margin.estimate()
    assert est.decision == "rollback"
    assert est.reason.startswith("canary worse (margin -0.100): difference -1.00")


def test_the_canary_flows_burn_in_holds_alpha_where_scores_are_skewed() -> None:
    """At share 0.1 with both arms right 95% of the time (a good policy's task reward), 30 scores per arm let the
    asymptotic interval err well above alpha; the canary flow's default of 100 (`CanaryConfig.min_per_arm`) keeps
    the false decisions of 600 equal-quality streams, monitored after every request, within alpha plus 3
    standard errors."""
    from tasks.canary import CanaryConfig

    streams, n = 600, 3000
    bound = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / streams)
    rates = {}
    for per_arm in (30, CanaryConfig().min_per_arm):
        cfg = OnlineTestConfig(share=0.1, alpha=ALPHA, max_requests=10**9, min_per_arm=per_arm)
        rng = np.random.default_rng(11)
        canary, scores = _stream(rng, streams * n, cfg.share, 0.95, 0.95)
        canary, scores = canary.reshape(streams, n), scores.reshape(streams, n)
        n1, n0, _, lo, hi = _replay(canary, scores, cfg)
        ready = (n1 >= cfg.min_per_arm) & (n0 >= cfg.min_per_arm)
        rates[per_arm] = float((ready & ((lo > cfg.margin) | (hi < cfg.margin))).any(axis=1).mean())
    print(f"\nfalse decisions at share 0.1, 0.95 both: {rates} (bound {bound:.4f})")
    assert rates[30] > ALPHA and rates[CanaryConfig().min_per_arm] <= bound
