"""fit_router's replay (slow decay, revision changes from the records) and warm-start claims that fade."""

from __future__ import annotations

import numpy as np

from mint_core.routing import DECAY, Featurizer, Router, RouteRecord, fit_router, sparse_features

FEAT = Featurizer()


def arith(k: int) -> str:
    return f"What is {k} plus {3 * k + 1}?"


def record(k: int, t: float, arm: str, reward: float, revision: str = "") -> RouteRecord:
    x = FEAT.transform(arith(k))
    return RouteRecord(
        rid=f"r{t}", t=t, router_revision="", features_digest=FEAT.digest(x), features=sparse_features(x),
        candidates=["a", "b"], choice=arm, prob=0.5, explored=False, revision=revision, reward=reward,
    )  # fmt: skip


def test_fit_replays_revision_changes_and_keeps_the_online_decay() -> None:
    """`a` answered well under revision r1 for long, then badly under r2; `b` is middling throughout. The log's
    revision field tells the fit of the change: it keeps a tenth of r1's evidence, so r2's 60 bad answers hand
    arithmetic to `b` (without the change, 400 good answers under a slow decay would keep `a` ahead)."""
    rng = np.random.default_rng(0)
    recs = [record(k, k, "a", float(rng.random() < 0.9), "r1") for k in range(400)]
    recs += [record(k, 400 + k, "a", float(rng.random() < 0.1), "r2") for k in range(60)]
    recs += [record(k, k + 0.5, "b", 0.5) for k in range(460)]
    router = fit_router(recs)
    assert router.decay == DECAY  # the replay's decay is not the one it serves with
    assert router.revisions()["a"] == "r2"
    xs = [FEAT.transform(arith(k)) for k in range(500, 520)]
    preds = np.array([router.predict(x, ["a", "b"]) for x in xs])
    assert (preds[:, 1] > preds[:, 0]).all(), preds.mean(axis=0)


def test_a_warm_start_claim_fades_once_real_rewards_contradict_it() -> None:
    """A decoy warm-started as good at arithmetic that answers it with 0: its pseudo-observations decay with its
    real rewards, so after a few hundred answers nothing of the claim is left (as prior they would stay for good,
    about 8 of the ~50 observations the decay keeps)."""
    router = Router(FEAT)
    router.warm_start("decoy", [FEAT.transform(arith(k)) for k in range(50)], 1.0)
    x = FEAT.transform(arith(1000))
    assert router.predict(x, ["decoy"])[0] > 0.5
    for k in range(300):
        router.update("decoy", FEAT.transform(arith(k)), 0.0)
    assert router.predict(x, ["decoy"])[0] < 0.02


def test_a_revision_change_in_the_log_starts_the_arm_from_its_cold_start() -> None:
    """`a` answered arithmetic badly under r1; its first record under r2 (a middling answer) tells the fit of a new
    revision, which starts from `a`'s cold start (its task's prompts) again, on top of a tenth of r1's evidence. A
    fit given no cold start only forgets r1."""
    rng = np.random.default_rng(1)
    recs = [record(k, k, "a", float(rng.random() < 0.1), "r1") for k in range(300)]
    recs += [record(k, k + 0.5, "b", 0.5) for k in range(300)]
    recs.append(record(300, 300, "a", 0.5, "r2"))
    cold = {
        "a": [arith(k) for k in range(1000, 1040)],
        "b": [f"Write a poem about the number {k}." for k in range(40)],
    }
    xs = [FEAT.transform(arith(k)) for k in range(500, 520)]
    mean = {}
    for given in (True, False):
        router = fit_router(recs, cold_start=cold if given else None)
        mean[given] = float(np.mean([router.predict(x, ["a"])[0] for x in xs]))
    assert mean[True] > mean[False] + 0.05, mean
