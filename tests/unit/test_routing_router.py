"""The router learns the best arm per kind of prompt, follows change (decay, set_revision), weighs costs, and its
stated probabilities are the ones it samples from (what off-policy evaluation relies on)."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from mint_core.routing import (
    Featurizer,
    Router,
    cold_claims,
    features,
    fit_router,
    prompt_text,
    warm_start_tasks,
)
from mint_core.routing.features import FEATURE_DIM, GRAM_WEIGHTS, NGRAMS
from mint_core.routing.router import _width, content_digest

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
    version bump. Case and spacing do not matter. The character 3-5 grams' digest is the default's until
    NGRAMS and GRAM_WEIGHTS changed: routers saved before then carry (3, 5) and no weights in their config and
    must score as they did."""
    old = Featurizer(dim=64, ngrams=(3, 5))
    assert FEAT.digest(old.transform("What is 3 plus 4?")) == "f6966865def9e225"
    assert FEAT.digest(old.transform("  what is 3   PLUS 4?")) == "f6966865def9e225"
    x = Featurizer(dim=64).transform("What is 3 plus 4?")
    assert FEAT.digest(x) == "672b27238c93eea7"
    assert FEAT.digest(Featurizer(dim=64).transform("  what is 3   PLUS 4?")) == "672b27238c93eea7"
    words = Featurizer(dim=64, kind="word")
    assert words.digest(words.transform("What is 3 plus 4?")) == "8a676d8f92556f48"


def test_default_features_are_the_weighted_signed_counts_of_character_1_to_5_grams() -> None:
    """A new featurizer hashes every character 1-5 gram of the padded, lower-cased prompt (CRC-32; the hash's
    top bit signs it), 1-grams counting 0.3 and 2-grams 0.6, and L2-normalizes: computed here by hand."""
    feat = Featurizer(dim=64)
    assert feat.ngrams == NGRAMS == (1, 5) and feat.gram_weights == GRAM_WEIGHTS == ((1, 0.3), (2, 0.6))
    data = b" ab: 1 "
    want = np.zeros(64)
    for n, weight in ((1, 0.3), (2, 0.6), (3, 1.0), (4, 1.0), (5, 1.0)):
        for i in range(len(data) - n + 1):
            h = zlib.crc32(data[i : i + n])
            want[h % 64] += weight if h >> 31 & 1 else -weight
    np.testing.assert_allclose(feat.transform("AB:   1"), want / np.linalg.norm(want), rtol=1e-6)
    assert not feat.transform("   ").any()  # nothing but spaces: no features, not the padding's 1-grams


def test_a_long_prompts_counted_short_grams_give_the_vector_hashed_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From COUNTED_CHARS on, 1- and 2-grams are counted in numpy: the vector is the one hashing each gives."""
    feat = Featurizer()
    long = "def f(x):\n    return [x * 2 for x in range(10)]  # Ünïcode too\n" * 12
    assert len(long) >= features.COUNTED_CHARS
    counted = feat.transform(long)
    monkeypatch.setattr(features, "COUNTED_CHARS", 10**9)
    np.testing.assert_allclose(feat.transform(long), counted, rtol=1e-6, atol=1e-7)


def test_short_grams_tell_kinds_of_text_apart_without_making_all_prompts_alike() -> None:
    """Single characters and pairs bring an unseen wording of a prompt closer to its task's prompts than 3-5
    grams do, and, weighed down, leave unrelated prompts about as far apart as 3-5 grams leave them."""
    new, old = Featurizer(), Featurizer(ngrams=(3, 5))
    seen = ["sort: 471724 =", "sort: 8380 =", "sort: 29845 =", "sort: 193571 ="]
    unseen = ["# sort: 5512 =", "sort :  90317 =", "to sort: 6628 ="]

    def closeness(f: Featurizer, texts: list[str]) -> float:
        return float(np.mean(f.transform_many(tuple(texts)) @ f.transform_many(tuple(seen)).T))

    assert closeness(new, unseen) > closeness(old, unseen) + 0.05
    unrelated = ["Write a haiku about rain.", "def f(x): return x+1", "What is the capital of France?"]
    x = new.transform_many((*unrelated, seen[0]))
    off = (x @ x.T)[~np.eye(len(x), dtype=bool)]
    assert np.abs(off).max() < 0.15, off
    flat = Featurizer(gram_weights=())  # 1-grams at full weight: any two prompts share letters and spaces
    y = flat.transform_many((*unrelated, seen[0]))
    assert float(np.mean((y @ y.T)[~np.eye(len(y), dtype=bool)])) > float(np.mean(off)) + 0.1


def test_gram_weights_outside_the_lengths_or_of_one_change_nothing_and_bad_ones_are_refused() -> None:
    old = Featurizer(dim=64, ngrams=(3, 5), gram_weights=())
    assert Featurizer(dim=64, ngrams=(3, 5)) == old  # the default weights are of lengths 1-2 only
    assert Featurizer(dim=64, ngrams=(3, 5), gram_weights=[(4, 1.0)]).config() == old.config()
    assert "gram_weights" not in old.config()
    assert (
        Featurizer(dim=64, kind="word").config() == Featurizer(dim=64, kind="word", gram_weights=()).config()
    )
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="gram weight"):
            Featurizer(gram_weights=[(1, bad)])
    with pytest.raises(ValueError, match="gram_weights"):
        Featurizer.from_config({**Featurizer().config(), "gram_weights": [1, 0.3]})


def test_a_saved_router_keeps_its_featurizer(tmp_path: Path) -> None:
    """A router saved with the earlier defaults ((3, 5), no weights) loads as that featurizer, not as the new
    default's, and one saved with the new defaults loads with its weights."""
    old = Featurizer(dim=64, ngrams=(3, 5))
    router = Router(old, seed=0)
    x = old.transform("sort: 321 =")
    router.update("a", x, 1.0)
    router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r")
    assert loaded.featurizer == old and loaded.featurizer.ngrams == (3, 5)
    assert loaded.featurizer != Featurizer(dim=64)
    np.testing.assert_array_equal(loaded.featurizer.transform("sort: 321 ="), x)
    assert loaded.predict(x, ["a"]) == pytest.approx(router.predict(x, ["a"]))
    new = Router(Featurizer(dim=64), seed=0)
    new.save(tmp_path / "new")
    assert Router.load(tmp_path / "new").featurizer == Featurizer(dim=64) != old


def test_learns_the_best_arm_per_kind_of_prompt() -> None:
    rng = np.random.default_rng(1)
    router = Router(FEAT, seed=1)
    hits = run(router, 600, rng)
    assert np.mean(hits[-200:]) >= 0.85, np.mean(hits[-200:])
    for c, best in ((0, "arith"), (1, "code")):  # fresh prompts: a rare one (<1%, either featurizer) may miss
        right = [greedy(router, FEAT.transform(prompt(c, rng))) == best for _ in range(40)]
        assert np.mean(right) >= 0.95, (c, np.mean(right))


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
    takes arithmetic over after far fewer bad answers than when decay alone has to undo the old revision. Summed
    over three seeds: one stream's draws can make decay alone about as quick."""
    served = {True: 0, False: 0}
    for told in (True, False):
        for seed in (3, 5, 7):
            rng = np.random.default_rng(seed)
            router = Router(FEAT, seed=seed)
            router.set_revision("arith", "rev-1")
            run(router, 600, rng)
            if told:
                router.set_revision("arith", "rev-2")
            served[told] += 200 - sum(run(router, 200, rng, means=regressed, cluster=0))
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


def test_a_new_revision_starts_from_the_arm_s_cold_start() -> None:
    """arith regressed and lost arithmetic to the base. A new revision told with the arm's cold start (its claims)
    takes (nearly all) arithmetic back before any reward of it, as a new adapter would; told without, the arm only
    forgets and the base keeps it. The first revision an arm is told of changes nothing, claims or not."""
    rng = np.random.default_rng(6)
    cold = {c: [prompt(k, rng) for _ in range(20)] for k, c in enumerate(("arith", "code"))}
    claims = cold_claims(FEAT, cold)
    assert [r for _, r in claims["arith"]] == [1.0, 0.0] and claims["arith"][0][0].shape == (20, FEAT.dim)
    routers = {}
    for told in ("claims", "none"):
        router = routers[told] = Router(FEAT, seed=6)
        warm_start_tasks(router, cold)
        x = FEAT.transform(prompt(0, rng))
        before = router.probs(x, ARMS)
        router.set_revision("arith", "rev-1", claims["arith"])
        assert np.array_equal(router.probs(x, ARMS), before)
        run(router, 400, np.random.default_rng(6))
        run(router, 300, np.random.default_rng(7), means=regressed, cluster=0)
        assert greedy(router, x) == "base"
        router.set_revision("arith", "rev-2", claims["arith"] if told == "claims" else ())
    xs = [FEAT.transform(prompt(0, rng)) for _ in range(20)]
    took = {told: sum(greedy(r, x) == "arith" for x in xs) for told, r in routers.items()}
    assert took["claims"] >= 16 and took["none"] <= 4, took


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


def test_the_routing_doc_quotes_the_featurizers_defaults() -> None:
    """docs/routing.md states the featurizer's defaults for new routers: they are the code's."""
    doc = re.sub(r"\s+", " ", (Path(__file__).resolve().parents[2] / "docs" / "routing.md").read_text())
    assert f"`NGRAMS` = {NGRAMS}" in doc and f"`GRAM_WEIGHTS` = {GRAM_WEIGHTS}" in doc


def test_the_width_a_decision_reads_is_the_exact_quadratic_form() -> None:
    """A decision reads each arm's inverse covariance in float32, from the rows of the prompt's nonzero features
    when they are few: the greedy choice is still exact LinUCB's (float64, every row), for short prompts (sparse
    features) and long ones (dense)."""
    rng = np.random.default_rng(11)
    router = Router(FEAT, epsilon=0.01, alpha=2.0)
    run(router, 300, rng)
    texts = [f"add {i}" for i in range(20)] + [f"def f{i}()" for i in range(20)]
    texts += [" ".join(prompt(i % 2, rng) for _ in range(30)) for i in range(40)]
    branches = set()
    for text in texts:
        x = FEAT.transform(text)
        xa = np.append(x.astype(np.float64), 1.0)
        sparse = 2 * np.count_nonzero(xa) < len(xa)
        branches.add(sparse)
        ucb = []
        for arm in ARMS:
            st = router._state[router.arms().index(arm)]
            ucb.append(st.theta @ xa + router.alpha * np.sqrt(xa @ st.P @ xa))
        assert greedy(router, x) == ARMS[int(np.argmax(ucb))]
        st = router._state[0]
        rows = np.flatnonzero(xa) if sparse else None
        exact = float(np.sqrt(xa @ st.P @ xa))
        assert _width(st.P32, xa.astype(np.float32), rows) == pytest.approx(exact, rel=1e-5)
    assert branches == {True, False}
