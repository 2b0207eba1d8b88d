"""Context-free bandits the benchmark compares the router against (they never look at the prompt).

Both answer `choose(x, candidates, rng=, costs=)` with a Decision and learn by `update(arm, x, reward)`, like
Router, so one replay loop drives all three. They show what the prompt is worth: a context-free bandit can only
find the single best arm on average, the router's target is the best arm per prompt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from mint_core.routing.router import DECAY, EPSILON, Decision

PROB_DRAWS = 256
"""Monte Carlo draws estimating a Thompson choice's probability (it has no closed form)."""


def _costed(candidates: Sequence[str], costs: Mapping[str, float] | None) -> np.ndarray:
    if not candidates:
        raise ValueError("no candidates to route to")
    return np.array([float((costs or {}).get(c, 0.0)) for c in candidates])


class EpsilonGreedy:
    """Epsilon-greedy on each arm's (decayed) mean reward; an arm never tried counts as 1.0, so each is tried."""

    def __init__(self, epsilon: float = EPSILON, decay: float = DECAY, seed: int = 0) -> None:
        self.epsilon, self.decay = epsilon, decay
        self._sum: dict[str, float] = {}
        self._n: dict[str, float] = {}
        self._rng = np.random.default_rng(seed)

    def means(self, candidates: Sequence[str]) -> np.ndarray:
        return np.array([self._sum[c] / self._n[c] if self._n.get(c) else 1.0 for c in candidates])

    def choose(
        self,
        x: np.ndarray,
        candidates: Sequence[str],
        *,
        rng: np.random.Generator | None = None,
        costs: Mapping[str, float] | None = None,
    ) -> Decision:
        t0 = time.perf_counter()
        rng = rng or self._rng
        score = self.means(candidates) - _costed(candidates, costs)
        greedy = score >= score.max() - 1e-12
        probs = self.epsilon / len(score) + (1 - self.epsilon) * greedy / greedy.sum()
        if rng.random() < self.epsilon:
            j = int(rng.integers(len(score)))
        else:
            g = np.flatnonzero(greedy)
            j = int(g[rng.integers(len(g))])
        return Decision(candidates[j], float(probs[j]), not bool(greedy[j]), time.perf_counter() - t0)

    def update(self, arm: str, x: np.ndarray, reward: float) -> None:
        self._sum[arm] = self.decay * self._sum.get(arm, 0.0) + float(reward)
        self._n[arm] = self.decay * self._n.get(arm, 0.0) + 1.0


class ContextFreeThompson:
    """Beta-Bernoulli Thompson sampling per arm (rewards in [0, 1] count as fractional successes), with each arm's
    counts decayed at its updates, so it follows change like the router does."""

    def __init__(self, decay: float = DECAY, seed: int = 0) -> None:
        self.decay = decay
        self._s: dict[str, float] = {}
        self._f: dict[str, float] = {}
        self._rng = np.random.default_rng(seed)

    def _params(self, candidates: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        a = np.array([1.0 + self._s.get(c, 0.0) for c in candidates])
        b = np.array([1.0 + self._f.get(c, 0.0) for c in candidates])
        return a, b

    def choose(
        self,
        x: np.ndarray,
        candidates: Sequence[str],
        *,
        rng: np.random.Generator | None = None,
        costs: Mapping[str, float] | None = None,
    ) -> Decision:
        t0 = time.perf_counter()
        rng = rng or self._rng
        a, b = self._params(candidates)
        cost = _costed(candidates, costs)
        j = int(np.argmax(rng.beta(a, b) - cost))
        draws = rng.beta(a[:, None], b[:, None], size=(len(a), PROB_DRAWS)) - cost[:, None]
        share = float((draws.argmax(axis=0) == j).mean())
        prob = max(share, 1.0 / (PROB_DRAWS + 1))
        greedy = int(np.argmax(a / (a + b) - cost))
        return Decision(candidates[j], prob, j != greedy, time.perf_counter() - t0)

    def update(self, arm: str, x: np.ndarray, reward: float) -> None:
        r = float(reward)
        self._s[arm] = self.decay * self._s.get(arm, 0.0) + r
        self._f[arm] = self.decay * self._f.get(arm, 0.0) + (1.0 - r)
