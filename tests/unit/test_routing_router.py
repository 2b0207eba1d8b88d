"""The router learns the best arm per kind of prompt, follows change (decay, set_revision), weighs costs, and its
stated probabilities are the ones it samples from (what off-policy evaluation relies on)."""

from __future__ import annotations

import numpy as np
import pytest

from mint_core.routing import Featurizer, Router, fit_router, prompt_text
from mint_core.routing.features import FEATURE_DIM
from mint_core.routing.router import content_digest

FEAT = Featurizer(dim=128)
ARMS = ["arith", "code", "base"]


def prompt(cluster: int, rng: np.random.Generator) -> str:
    """Two kinds of prompt, each in several wordings, with random numbers in them."""
    a, b = (int(v) for v in rng.integers(0, 1000, size=2))
    if cluster == 0:
        return [f"What is {a} plus {b}?", f"Compute {a} + {b}.", f"Add {a} and {b}; give the sum."][a % 3]
    return [f"Write a python function f{a} that returns {b}.", f"def f{a}(): return {b}  # finish this code"][
        a % 2
    ]


def reward_mean(arm: str, cluster: int) -> float:
    """arith is good on cluster 0, code on cluster 1, the base middling on both."""
    return {("arith", 0): 0.9, ("code", 1): 0.9, ("base", 0): 0.5, ("base", 1): 0.5}.get((arm, cluster), 0.1)


def run(
    router, steps: int, rng: np.random.Generator, means=reward_mean, cluster: int | None = None
) -> list[bool]:
    """Online replay: each step one prompt, one choice, one Bernoulli reward of the chosen arm only. Returns per
    step whether the arm chosen was the best for that prompt."""
    hits = []
    for i in range(steps):
        c = i % 2 if cluster is None else cluster
        x = FEAT.transform(prompt(c, rng))
        d = router.choose(x, ARMS, rng=rng)
        router.update(d.arm, x, float(rng.random() < means(d.arm, c)))
        hits.append(max(ARMS, key=lambda a: means(a, c)) == d.arm)
    return hits


def greedy(router: Router, x: np.ndarray, arms=ARMS) -> str:
    return arms[int(np.argmax(router.probs(x, arms)))]


def test_features_are_deterministic_normalized_and_separate_the_kinds_of_prompt() -> None:
    rng = np.random.default_rng(0)
    x = FEAT.transform("What is 3 plus 4?")
    assert x.shape == (128,) and x.dtype == np.float32
    assert np.linalg.norm(x) == pytest.approx(1.0, abs=1e-6)
    # fixed across processes and machines (CRC-32, not Python's salted hash()): pin one vector's digest
    assert FEAT.digest(x) == FEAT.digest(Featurizer(dim=128).transform("What is 3 plus 4?"))
    assert Featurizer().dim == FEATURE_DIM
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"}]
    assert prompt_text(chat) == "Be brief.\nWhat is 3 plus 4?"
    same = [float(FEAT.transform(prompt(0, rng)) @ FEAT.transform(prompt(0, rng))) for _ in range(100)]
    other = [float(FEAT.transform(prompt(0, rng)) @ FEAT.transform(prompt(1, rng))) for _ in range(100)]
    assert np.mean(same) > np.mean(other) + 0.08  # different wordings share some n-grams, other tasks few
    words = Featurizer(dim=64, kind="word")
    assert words.config() != FEAT.config() and np.linalg.norm(words.transform("a b c")) == pytest.approx(1.0)
    assert not FEAT.transform("").any()


def test_features_digest_is_pinned() -> None:
    """The same prompt maps to the same vector on any machine and in any process (a saved router would score
    differently otherwise): these digests were computed once and must never change without a featurizer
    version bump. Case and spacing do not matter."""
    x = Featurizer(dim=64).transform("What is 3 plus 4?")
    assert FEAT.digest(x) == "f6966865def9e225"
    assert FEAT.digest(Featurizer(dim=64).transform("  what is 3   PLUS 4?")) == "f6966865def9e225"
    words = Featurizer(dim=64, kind="word")
    assert words.digest(words.transform("What is 3 plus 4?")) == "8a676d8f92556f48"


def test_learns_the_best_arm_per_kind_of_prompt() -> None:
    rng = np.random.default_rng(1)
    router = Router(FEAT, seed=1)
    hits = run(router, 600, rng)
    assert np.mean(hits[-200:]) >= 0.85, np.mean(hits[-200:])
    for c, best in ((0, "arith"), (1, "code")):
        assert all(greedy(router, FEAT.transform(prompt(c, rng))) == best for _ in range(20))


def regressed(arm: str, c: int) -> float:
    """arith's revision now answers arithmetic badly; the base (0.5) is the best there."""
    return 0.1 if (arm, c) == ("arith", 0) else reward_mean(arm, c)


def test_a_regressed_arm_loses_its_traffic_by_decay() -> None:
    """Nobody tells the router: its own rewards drop, old evidence decays, the base takes arithmetic over."""
    rng = np.random.default_rng(2)
    router = Router(FEAT, seed=2)
    run(router, 600, rng)
    hits = run(router, 200, rng, means=regressed, cluster=0)
    assert np.mean(hits[:50]) < 0.5  # it did serve arith at first
    assert np.mean(hits[-50:]) >= 0.75, [np.mean(hits[i : i + 50]) for i in range(0, 200, 50)]


def test_set_revision_makes_a_regressed_revision_lose_traffic_sooner() -> None:
    """A worse revision is promoted: told of it, the router keeps only a tenth of the old evidence, so the base
    takes arithmetic over after far fewer bad answers than when decay alone has to undo the old revision."""
    served = {}
    for told in (True, False):
        rng = np.random.default_rng(3)
        router = Router(FEAT, seed=3)
        router.set_revision("arith", "rev-1")
        run(router, 600, rng)
        if told:
            router.set_revision("arith", "rev-2")
        served[told] = 200 - sum(run(router, 200, rng, means=regressed, cluster=0))
    assert served[True] < 0.7 * served[False], served


def test_set_revision_relearns_a_better_revision() -> None:
    """arith regressed and lost arithmetic to the base; a good revision is promoted and, told, the router gives
    it its prompts back within 200 of them."""
    rng = np.random.default_rng(4)
    router = Router(FEAT, seed=4)
    router.set_revision("arith", "rev-1")
    run(router, 600, rng)
    run(router, 300, rng, means=regressed, cluster=0)
    x = FEAT.transform(prompt(0, rng))
    assert greedy(router, x) == "base"
    router.set_revision("arith", "rev-2")
    hits = run(router, 200, rng, cluster=0)
    assert np.mean(hits[-100:]) >= 0.8, [np.mean(hits[i : i + 50]) for i in range(0, 200, 50)]


def test_set_revision_is_idempotent() -> None:
    rng = np.random.default_rng(4)
    router = Router(FEAT)
    router.set_revision("arith", "rev-1")
    run(router, 100, rng)
    x = FEAT.transform(prompt(0, rng))
    before = router.probs(x, ARMS)
    router.set_revision("arith", "rev-1")
    assert np.array_equal(router.probs(x, ARMS), before)
    assert router.revisions() == {"arith": "rev-1"}


def test_costs_shift_the_choice() -> None:
    rng = np.random.default_rng(5)
    router = Router(FEAT, alpha=0.1)
    means = {"arith": 0.8, "code": 0.7, "base": 0.2}
    for _ in range(300):
        x = FEAT.transform(prompt(0, rng))
        for arm, m in means.items():
            router.update(arm, x, float(rng.random() < m))
    x = FEAT.transform(prompt(0, rng))
    assert greedy(router, x) == "arith"
    probs = router.probs(x, ARMS, costs={"arith": 0.3, "code": 0.0})
    assert ARMS[int(np.argmax(probs))] == "code"


def test_probs_sum_to_one_and_match_the_choices() -> None:
    rng = np.random.default_rng(6)
    router = Router(FEAT, epsilon=0.3)
    run(router, 200, rng)
    x = FEAT.transform(prompt(0, rng))
    probs = router.probs(x, ARMS)
    assert probs.sum() == pytest.approx(1.0) and (probs > 0).all()
    draws = [router.choose(x, ARMS, rng=rng) for _ in range(4000)]
    freq = np.array([sum(d.arm == a for d in draws) for a in ARMS]) / len(draws)
    assert np.abs(freq - probs).max() < 0.03, (freq, probs)
    best = ARMS[int(np.argmax(probs))]
    for d in draws[:50]:
        assert d.prob == pytest.approx(probs[ARMS.index(d.arm)])
        assert d.explored == (d.arm != best)
        assert d.decide_s >= 0


def test_a_large_catalog_considers_the_top_k_and_keeps_the_best() -> None:
    rng = np.random.default_rng(7)
    router = Router(FEAT, top_k=8)
    catalog = [f"policy-{i}" for i in range(3000)] + ARMS
    run(router, 300, rng)
    x = FEAT.transform(prompt(0, rng))
    probs = router.probs(x, catalog)
    assert probs.sum() == pytest.approx(1.0)
    assert (probs > 0).sum() == 8
    assert catalog[int(np.argmax(probs))] == "arith"
    assert router.choose(x, catalog, rng=rng).arm in {catalog[i] for i in np.flatnonzero(probs)}
    assert len(router.arms()) == len(catalog)


def test_cold_start_routes_a_new_adapter_its_tasks_prompts() -> None:
    rng = np.random.default_rng(8)
    router = fit_router(
        [], cold_start={"arith": [prompt(0, rng) for _ in range(30)], "code": [prompt(1, rng) for _ in range(30)]},
        featurizer=FEAT,
    )  # fmt: skip
    for c, best in ((0, "arith"), (1, "code")):
        assert all(
            greedy(router, FEAT.transform(prompt(c, rng)), ["arith", "code"]) == best for _ in range(20)
        )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: r.choose(FEAT.transform("x"), []), "no candidates"),
        (lambda r: r.choose(np.zeros(8), ARMS), "shape"),
        (lambda r: r.update("arith", FEAT.transform("x"), 1.5), r"outside \[0, 1\]"),
        (lambda r: r.update("arith", np.full(128, np.nan), 1.0), "NaN"),
        (lambda r: r.choose(FEAT.transform("x"), ARMS, costs={"arith": float("inf")}), "costs"),
        (lambda r: Router(FEAT, epsilon=0.0), "epsilon"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(Router(FEAT))


def _digest(router: Router) -> str:
    return content_digest(router._manifest(), router._arrays())


def test_a_step_reads_the_router_only_and_applied_is_the_update() -> None:
    """What a server computes outside its decisions' lock (`update_step`) changes nothing until `apply`, and then
    exactly what `update` does, in the Sherman-Morrison steps and at the refreshes (refresh 3)."""
    rng = np.random.default_rng(6)
    stepped, updated = Router(FEAT, refresh=3), Router(FEAT, refresh=3)
    for i in range(8):
        x = FEAT.transform(prompt(i % 2, rng))
        arm, reward = ARMS[i % 3], float(rng.random())
        before = _digest(stepped)
        step = stepped.update_step(arm, x, reward)
        assert _digest(stepped) == before, i
        stepped.apply(step)
        updated.update(arm, x, reward)
        assert _digest(stepped) == _digest(updated), i
    step = stepped.revision_step("arith", "rev-1")
    stepped.apply(step)
    updated.set_revision("arith", "rev-1")
    assert _digest(stepped) == _digest(updated) and stepped.revisions() == {"arith": "rev-1"}


def test_a_snapshot_keeps_the_state_it_was_taken_at() -> None:
    rng = np.random.default_rng(7)
    router = Router(FEAT, refresh=2)
    run(router, 20, rng)
    taken, snap = _digest(router), router.snapshot()
    run(router, 20, rng)
    router.add_arm("new")
    assert _digest(snap) == taken != _digest(router)
    assert "new" not in snap.arms()
