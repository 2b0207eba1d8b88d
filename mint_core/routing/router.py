"""The router: a contextual bandit over served names, learned from the rewards mint already scores.

Model: disjoint LinUCB (Li et al., 2010) with an epsilon mix. Each arm (a served name: a policy or the base) has
its own ridge regression of reward on the prompt's features plus a bias term; the score of an arm is its mean
prediction plus `alpha` times the width of its confidence ellipsoid (`sqrt(x' A^-1 x)`), minus the request's cost
for that arm. With probability `1 - epsilon` the router serves the arm with the highest score (ties split
evenly); with probability `epsilon` a uniform draw among the considered arms.

Why LinUCB plus epsilon and not Thompson sampling: every decision's probability must be known exactly so that
off-policy evaluation (ope.py) can reweigh logged rewards, both for the router that logged them and for a
candidate router that did not. LinUCB's choice is a deterministic function of the state and the prompt, so the
epsilon mix gives a closed-form propensity (`(1 - eps) / |greedy| + eps / k`), positive for every considered arm.
Thompson sampling's propensity is an integral over the posterior with no closed form (only a Monte Carlo guess).
The UCB bonus still directs exploration to arms whose value is uncertain for this kind of prompt; epsilon keeps
every arm's probability off zero so the log supports evaluating other policies.

Change over time: a policy's champion moves, so old evidence must fade. Each arm's evidence (its Gram matrix and
reward vector) is multiplied by `decay` at each of its own updates, so the arm's estimate follows its last
~1/(1 - decay) rewards: a revision that regresses loses traffic once its recent rewards drop. A nightly fit
(fit.py) replays the whole log with a much slower decay, since it sees revision changes in the records. The prior (the
ridge) is never decayed, so an arm never becomes ill-conditioned. `set_revision` keeps only `revision_keep` of the
evidence and adds the arm's cold start again: a new revision has no traffic yet, so it starts as a new adapter
does (from its task's held-out prompts) and is relearned within a few dozen requests instead of fighting the
old revision's history.

The intercept (the constant feature) has its own ridge (`BIAS_RIDGE`), so the prior can weigh an arm's mean
reward apart from its prompt-dependent deviations (shrinkage toward the arm's mean rather than toward 0).

Cold start: `warm_start` adds the task's held-out prompts as pseudo-observations to the evidence (their total
weight capped at `warm_weight` observations, so real rewards soon outweigh them; they decay, and shrink on
`set_revision`, like real rewards, so a claim an arm does not live up to fades), and an arm with no state at all
uses the prior (mean 0, widest bonus): UCB tries it.

Scale: the first stage scores every candidate by its mean (one matrix-vector product over the arms that have
evidence; all others share the prior's score), the second computes the confidence width and the epsilon mix on the
`top_k` best only. Only arms with evidence hold matrices (three (d+1)^2 float64 arrays each and a float32 copy
of the inverse that decisions read, about 1.8 MB at the default dim), so a catalog of 10^5 names costs a name
table and one score vector. With ~11 arms and `top_k` 16 every arm is considered, which is exact LinUCB (the
width computed in float32: `_width`).

The inverse covariance is kept by forgetting-RLS updates (divide by `decay`, then a Sherman-Morrison rank-one
step; this decays the prior too, slightly) and recomputed exactly every `refresh` updates and on `set_revision`
and `warm_start`: an update costs O(d^2), and the O(d^3) inverse is paid once in `refresh` updates. (On a loaded
machine a multi-threaded BLAS makes that inverse much slower than one thread: run benchmarks with
OPENBLAS_NUM_THREADS=1.) An arm's model is never changed in place: learning computes a new one from the old
(`Step`) and swaps it in, so a server decides on the state before a change while the change is computed (a
refresh's inverse takes milliseconds on a loaded machine, a decision a tenth of one) and saves a `snapshot`
while it goes on learning.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mint_core.errors import MintError
from mint_core.routing.features import Featurizer

ALPHA = 0.5
"""Weight of the confidence width in the UCB score (rewards are in [0, 1])."""
DECAY = 0.98
"""Factor on an arm's evidence at each of its updates: it follows its last ~50 rewards. Short on purpose for
serving: a change nobody announces (a drift in what callers send, a revision swapped without `set_revision`) is
noticed only through decay. (0.995 lowered the benchmark's regret a little, within its seed noise, but a regressed
arm then kept its traffic for more than 200 unannounced bad answers.) A nightly fit replays with fit.FIT_DECAY."""
EPSILON = 0.05
"""Share of decisions drawn uniformly among the considered arms: keeps every propensity above zero for OPE."""
TOP_K = 16
"""Arms the second stage (confidence width, exploration) considers, the best by mean score of all candidates."""
RIDGE = 1.0
"""Prior precision of each arm's prompt-feature weights (ridge): mean 0, covariance I / RIDGE. (On the routing
benchmark's table 3 and 10 did no better: with every arm's reward of each prompt, the arms' differences are
fitted on the same rows whatever the ridge.)"""
BIAS_RIDGE = 1.0
"""Prior precision of each arm's intercept (its mean reward), apart from the features' so an intercept-heavy prior
(a weaker one here: the arm's mean learned first, per-prompt differences after) can be set; 0.01 measured no
better than 1.0 on the benchmark's table, so the default stays the plain ridge."""
REVISION_KEEP = 0.1
"""Share of an arm's evidence kept when its policy starts serving another revision."""
WARM_WEIGHT = 8.0
"""Total weight, in observations, of one warm_start call's pseudo-observations."""
REFRESH = 16
"""Exact recomputation of an arm's inverse covariance every this many updates (Sherman-Morrison between)."""
FORMAT = "mint-router"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = "state.npz"
_TIE = 1e-9


Claim = tuple[Sequence[np.ndarray] | np.ndarray, float]
"""Prompts' features claimed at a reward: one part of an arm's cold start (`warm_start`, `set_revision`)."""


class RouterLoadError(MintError):
    """A router revision that does not load: names the file and what is wrong with it."""

    def __init__(self, path: Path | str, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"router revision at {path} does not load: {problem}")


@dataclass(frozen=True)
class Decision:
    """One routing decision, with what off-policy evaluation needs."""

    arm: str
    """Served name chosen: a policy name, or the base's served name."""
    prob: float
    """Probability the router gave this arm (its propensity, > 0)."""
    explored: bool
    """True when the arm was not the greedy (highest score) choice."""
    decide_s: float
    """Seconds spent deciding (features excluded)."""


class _Arm:
    """One arm's linear model: prior precision A0 (ridge + warm start) and vector b0, decayed evidence G and g,
    the inverse P of A0 + G and the mean weights theta = P (b0 + g). `P32` is P in float32, what a decision reads
    for the confidence width (see `_width`); learning keeps P in float64.

    Never changed once made (copy on write): learning makes a new one (`Step`), so a reader holding one (a decision,
    a snapshot being saved) sees a whole state while the next is computed."""

    __slots__ = ("A0", "G", "P", "P32", "b0", "g", "since", "theta")

    def __init__(
        self, A0: np.ndarray, b0: np.ndarray, G: np.ndarray, g: np.ndarray, P: np.ndarray, since: int
    ) -> None:
        self.A0, self.b0, self.G, self.g, self.P, self.since = A0, b0, G, g, P, since
        self.theta = P @ (b0 + g)
        self.P32 = P.astype(np.float32)

    @classmethod
    def prior(cls, dim: int, ridge: float, bias_ridge: float) -> _Arm:
        prec = np.full(dim, ridge)
        prec[-1] = bias_ridge  # the intercept: the last (constant 1) feature
        return cls(np.diag(prec), np.zeros(dim), np.zeros((dim, dim)), np.zeros(dim), np.diag(1.0 / prec), 0)

    def exact(self, G: np.ndarray, g: np.ndarray) -> _Arm:
        """This arm with evidence (G, g) and its inverse recomputed exactly: O(d^3)."""
        inv = np.linalg.inv(self.A0 + G)
        P = (inv + inv.T) / 2  # symmetric exactly, so x' P x is not skewed by rounding
        return _Arm(self.A0, self.b0, G, g, P, 0)


@dataclass(frozen=True)
class Step:
    """A change to one arm, computed from the router's state and not yet applied (`Router.apply`): the arithmetic
    (O(d^2) per update, O(d^3) at a refresh) only reads the router, so a server computes it outside the lock its
    decisions take and applies it under that lock in microseconds. Applied in the order computed, one writer at a
    time (a step computed from an arm's state replaces that state whole)."""

    arm: str
    state: _Arm | None
    """The arm's new model (None: no change to it)."""
    revision: str | None = None
    """The revision the arm's policy now serves (`set_revision`; None: unchanged)."""


class Router:
    """Chooses a served name per prompt (`choose`), learns from rewards (`update`), saves as a revision.

    Not thread-safe: a caller that decides and learns from several threads holds one lock around both (the
    event loop of a server is one thread). `probs` and `predict` read the state without changing it, except
    that unknown candidate names are added as prior-only arms. Learning is split so that the lock need not cover
    its arithmetic: `update_step` (and `revision_step`, `warm_step`) only read the router and return a `Step`,
    `apply` makes it the state in O(d); `update` is both. One writer at a time: a step is applied before the
    next one is computed."""

    def __init__(
        self,
        featurizer: Featurizer | None = None,
        *,
        alpha: float = ALPHA,
        decay: float = DECAY,
        epsilon: float = EPSILON,
        top_k: int = TOP_K,
        ridge: float = RIDGE,
        bias_ridge: float = BIAS_RIDGE,
        revision_keep: float = REVISION_KEEP,
        warm_weight: float = WARM_WEIGHT,
        refresh: int = REFRESH,
        seed: int = 0,
    ) -> None:
        problems = _hyper_problems(alpha, decay, epsilon, top_k, ridge, revision_keep, warm_weight, refresh)
        if not bias_ridge > 0:
            problems.append(f"bias_ridge {bias_ridge} must be > 0")
        if problems:
            raise ValueError("router hyperparameters: " + "; ".join(problems))
        self.featurizer = featurizer or Featurizer()
        self.alpha, self.decay, self.epsilon = float(alpha), float(decay), float(epsilon)
        self.top_k, self.ridge, self.refresh = int(top_k), float(ridge), int(refresh)
        self.bias_ridge = float(bias_ridge)
        self.revision_keep, self.warm_weight = float(revision_keep), float(warm_weight)
        self.revision = ""
        self._rng = np.random.default_rng(seed)
        self._d = self.featurizer.dim + 1
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._revisions: dict[str, str] = {}
        self._state: dict[int, _Arm] = {}
        self._slot = np.full(0, -1, dtype=np.int64)  # arm index -> row of _theta (-1: prior only)
        self._theta = np.zeros((0, self._d), dtype=np.float32)
        self._slot_arm: list[int] = []
        self._cache: tuple[Sequence[str], tuple[str, ...], np.ndarray] | None = None

    # --- arms -------------------------------------------------------------------------------------------------
    def hyper(self) -> dict[str, Any]:
        """The hyperparameters, as saved in a revision's manifest."""
        return {
            "alpha": self.alpha, "decay": self.decay, "epsilon": self.epsilon, "top_k": self.top_k,
            "ridge": self.ridge, "bias_ridge": self.bias_ridge, "revision_keep": self.revision_keep, "warm_weight": self.warm_weight,
            "refresh": self.refresh,
        }  # fmt: skip

    def arms(self) -> list[str]:
        """Every served name the router knows, in the order it met them."""
        return list(self._names)

    def revisions(self) -> dict[str, str]:
        """The adapter revision each arm last served, as told by `set_revision`."""
        return dict(self._revisions)

    def add_arm(self, name: str) -> int:
        """Index of `name`, adding it (prior only) when new; idempotent."""
        i = self._index.get(name)
        if i is not None:
            return i
        _check_name(name)
        i = len(self._names)
        self._names.append(name)
        self._index[name] = i
        if i >= len(self._slot):
            grown = np.full(max(16, 2 * len(self._slot)), -1, dtype=np.int64)
            grown[: len(self._slot)] = self._slot
            self._slot = grown
        return i

    def _current(self, name: str) -> _Arm:
        """The arm's model, or the prior's for an arm with no evidence (not registered: `apply` does that)."""
        i = self._index.get(name)
        st = self._state.get(i) if i is not None else None
        return st if st is not None else _Arm.prior(self._d, self.ridge, self.bias_ridge)

    def _put(self, i: int, st: _Arm) -> None:
        """Make `st` arm i's model (given a row of the mean matrix on its first evidence)."""
        if i not in self._state:
            row = len(self._slot_arm)
            if row >= len(self._theta):
                grown = np.zeros((max(16, 2 * len(self._theta)), self._d), dtype=np.float32)
                grown[:row] = self._theta[:row]
                self._theta = grown
            self._slot[i] = row
            self._slot_arm.append(i)
        self._state[i] = st
        self._theta[self._slot[i]] = st.theta

    # --- deciding ---------------------------------------------------------------------------------------------
    def _augment(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.shape != (self.featurizer.dim,):
            raise ValueError(
                f"features have shape {x.shape}; this router's featurizer gives ({self.featurizer.dim},)"
            )
        xa = np.empty(self._d)
        xa[:-1] = x
        xa[-1] = 1.0
        if not np.isfinite(xa).all():
            raise ValueError("features hold NaN or infinity")
        return xa

    def _indices(self, candidates: Sequence[str]) -> np.ndarray:
        """Arm indices of the candidates (new names added), cached for a repeated large candidate list."""
        if len(candidates) == 0:
            raise ValueError("no candidates to route to")
        if len(candidates) <= 4 * self.top_k:
            return np.fromiter((self.add_arm(c) for c in candidates), dtype=np.int64, count=len(candidates))
        c = self._cache
        if c is not None and (
            c[0] is candidates or (len(c[1]) == len(candidates) and c[1] == tuple(candidates))
        ):
            return c[2]
        idx = np.fromiter((self.add_arm(n) for n in candidates), dtype=np.int64, count=len(candidates))
        self._cache = (candidates, tuple(candidates), idx)
        return idx

    def _policy(
        self, xa: np.ndarray, candidates: Sequence[str], costs: Mapping[str, float] | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions of the considered candidates, their probabilities, which of them are greedy)."""
        idx = self._indices(candidates)
        x32 = xa.astype(np.float32)  # what the means and the widths read
        mean = np.zeros(len(idx))
        if self._slot_arm:
            slots = self._slot[idx]
            has = slots >= 0
            if has.any():
                mean[has] = (self._theta[: len(self._slot_arm)] @ x32)[slots[has]]
        if costs:
            mean -= self._cost_vector(candidates, costs)
        k = min(self.top_k, len(idx))
        top = np.argpartition(-mean, k - 1)[:k] if len(idx) > k else np.arange(len(idx))
        prior_w = float(np.sqrt(xa[:-1] @ xa[:-1] / self.ridge + 1.0 / self.bias_ridge))
        width = np.full(len(top), prior_w)
        states = [self._state.get(int(idx[pos])) for pos in top]
        if any(st is not None for st in states):
            nz = np.flatnonzero(x32)
            rows = nz if 2 * len(nz) < len(x32) else None
            for j, st in enumerate(states):
                if st is not None:
                    width[j] = _width(st.P32, x32, rows)
        ucb = mean[top] + self.alpha * width
        greedy = ucb >= ucb.max() - _TIE
        probs = np.full(len(top), self.epsilon / len(top)) + (1 - self.epsilon) * greedy / greedy.sum()
        return top, probs, greedy

    def _cost_vector(self, candidates: Sequence[str], costs: Mapping[str, float]) -> np.ndarray:
        out = np.zeros(len(candidates))
        if len(costs) * 8 < len(candidates):
            where = {n: j for j, n in enumerate(candidates) if n in costs}
            for n, c in costs.items():
                if n in where:
                    out[where[n]] = float(c)
        else:
            for j, n in enumerate(candidates):
                out[j] = float(costs.get(n, 0.0))
        if not np.isfinite(out).all():
            raise ValueError("costs hold NaN or infinity")
        return out

    def choose(
        self,
        x: np.ndarray,
        candidates: Sequence[str],
        *,
        rng: np.random.Generator | None = None,
        costs: Mapping[str, float] | None = None,
    ) -> Decision:
        """The served name for a prompt with features `x` among `candidates` (non-empty; ValueError if empty).
        `costs`: per-candidate penalty in reward units (a cold load > 0, resident 0), subtracted before choosing."""
        t0 = time.perf_counter()
        rng = rng or self._rng
        xa = self._augment(x)
        top, probs, greedy = self._policy(xa, candidates, costs)
        if rng.random() < self.epsilon:
            j = int(rng.integers(len(top)))
        else:
            g = np.flatnonzero(greedy)
            j = int(g[rng.integers(len(g))]) if len(g) > 1 else int(g[0])
        arm = candidates[int(top[j])]
        return Decision(
            arm=arm, prob=float(probs[j]), explored=not bool(greedy[j]), decide_s=time.perf_counter() - t0
        )

    def probs(
        self, x: np.ndarray, candidates: Sequence[str], *, costs: Mapping[str, float] | None = None
    ) -> np.ndarray:
        """The probability `choose` gives each candidate (aligned with `candidates`; zero outside the top-k);
        sums to 1. Off-policy evaluation reads a target router's policy through this."""
        xa = self._augment(x)
        top, probs, _ = self._policy(xa, candidates, costs)
        out = np.zeros(len(candidates))
        out[top] = probs
        return out

    def predict(self, x: np.ndarray, arms: Sequence[str]) -> np.ndarray:
        """Each arm's mean predicted reward for these features (the prior's 0 for an arm with no evidence)."""
        xa = self._augment(x)
        out = np.zeros(len(arms))
        for j, a in enumerate(arms):
            i = self._index.get(a)
            st = self._state.get(i) if i is not None else None
            if st is not None:
                out[j] = float(st.theta @ xa)
        return out

    # --- learning ---------------------------------------------------------------------------------------------
    def update(self, arm: str, x: np.ndarray, reward: float) -> None:
        """Learn from one reward in [0, 1] for `arm` on features `x`: old evidence decays, this one is added."""
        self.apply(self.update_step(arm, x, reward))

    def update_step(self, arm: str, x: np.ndarray, reward: float) -> Step:
        """`update`'s change, computed and not applied: the router is only read."""
        reward = float(reward)
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"reward {reward} for {arm!r} is outside [0, 1]")
        xa = self._augment(x)
        _check_name(arm)
        st = self._current(arm)
        G = st.G * self.decay
        g = st.g * self.decay
        G += np.outer(xa, xa)
        g += reward * xa
        since = st.since + 1
        if since >= self.refresh:
            return Step(arm, st.exact(G, g))
        # (A0 + decay G + x x')^-1 ~ (decay (A0 + G) + x x')^-1: forgetting RLS, exact again at refresh
        P = st.P / self.decay
        px = P @ xa
        P -= np.outer(px, px) / (1.0 + xa @ px)
        return Step(arm, _Arm(st.A0, st.b0, G, g, P, since))

    def set_revision(self, arm: str, revision: str, claims: Sequence[Claim] = ()) -> None:
        """The policy behind `arm` now serves `revision`: keep the arm's prior, keep only `revision_keep` of its
        evidence, and add `claims` (the arm's cold start, `warm_start`'s (prompts' features, reward) pairs) afresh,
        so the new revision is relearned quickly from where a new adapter would start. Idempotent: the same
        revision again changes nothing; the first revision an arm is told of changes nothing either (its evidence
        is that revision's)."""
        self.apply(self.revision_step(arm, revision, claims))

    def revision_step(self, arm: str, revision: str, claims: Sequence[Claim] = ()) -> Step:
        """`set_revision`'s change, computed and not applied."""
        _check_name(arm)
        i = self._index.get(arm)
        old = self._revisions.get(arm)
        st = self._state.get(i) if i is not None else None
        if old is None or old == revision or (st is None and not claims):
            return Step(arm, None, revision)
        st = st if st is not None else _Arm.prior(self._d, self.ridge, self.bias_ridge)
        G, g = st.G * self.revision_keep, st.g * self.revision_keep
        for xs, reward in claims:
            dG, dg = self._claim(arm, xs, reward)
            G, g = G + dG, g + dg
        return Step(arm, st.exact(G, g), revision)

    def warm_start(self, arm: str, xs: Sequence[np.ndarray] | np.ndarray, reward: float = 1.0) -> None:
        """Cold start: add prompts' features as pseudo-observations of `reward` (a task's held-out prompts with
        1.0; other tasks' prompts with 0.0), `warm_weight` observations in all. They are evidence, not prior: they
        decay with the arm's real rewards and `set_revision` shrinks them, so a claim an arm does not live up to
        (a decoy named for a task, a revision that regressed) fades instead of anchoring the arm for good."""
        self.apply(self.warm_step(arm, xs, reward))

    def warm_step(self, arm: str, xs: Sequence[np.ndarray] | np.ndarray, reward: float = 1.0) -> Step:
        """`warm_start`'s change, computed and not applied."""
        _check_name(arm)
        dG, dg = self._claim(arm, xs, reward)
        if not dG.any() and not dg.any():
            return Step(arm, None)
        st = self._current(arm)
        return Step(arm, st.exact(st.G + dG, st.g + dg))

    def _claim(
        self, arm: str, xs: Sequence[np.ndarray] | np.ndarray, reward: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """The evidence (Gram matrix, reward vector) of prompts' features claimed at `reward`, `warm_weight`
        observations in all (zeros for no prompts)."""
        reward = float(reward)
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"warm-start reward {reward} for {arm!r} is outside [0, 1]")
        if len(xs) == 0:
            return np.zeros((self._d, self._d)), np.zeros(self._d)
        X = np.stack([self._augment(x) for x in xs])
        w = min(1.0, self.warm_weight / len(X))
        return w * (X.T @ X), w * reward * X.sum(axis=0)

    def apply(self, step: Step) -> None:
        """Make a computed change (`update_step`, `revision_step`, `warm_step`) the router's state: O(d) (the
        arm's row of the mean matrix), under the lock a server's decisions take."""
        if step.state is None and step.revision is None:
            return
        i = self.add_arm(step.arm)
        if step.revision is not None:
            self._revisions[step.arm] = step.revision
        if step.state is not None:
            self._put(i, step.state)

    def snapshot(self) -> Router:
        """A router with this one's state as it is now that this one's later changes do not reach (the arms'
        models are shared: never changed in place): what a server saves while it goes on deciding and learning.
        O(arms), no matrix copied."""
        snap = copy.copy(self)
        snap._names, snap._index = list(self._names), dict(self._index)
        snap._revisions, snap._state = dict(self._revisions), dict(self._state)
        snap._slot, snap._theta = self._slot.copy(), self._theta[: len(self._slot_arm)].copy()
        snap._slot_arm, snap._cache = list(self._slot_arm), None
        snap._rng = np.random.default_rng()  # draws of its own: the snapshot's choices do not move this one's
        return snap

    # --- revisions on disk ------------------------------------------------------------------------------------
    def _arrays(self) -> dict[str, np.ndarray]:
        order = list(self._slot_arm)
        d = self._d

        def stack(attr: str, shape: tuple[int, ...]) -> np.ndarray:
            if not order:
                return np.zeros((0, *shape))
            return np.stack([getattr(self._state[i], attr) for i in order])

        return {
            "A0": stack("A0", (d, d)), "b0": stack("b0", (d,)), "G": stack("G", (d, d)), "g": stack("g", (d,)),
            "P": stack("P", (d, d)), "since": np.array([self._state[i].since for i in order], dtype=np.int64),
        }  # fmt: skip

    def _manifest(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "featurizer": self.featurizer.config(),
            "hyper": self.hyper(),
            "arms": list(self._names),
            "revisions": dict(self._revisions),
            "evidence_arms": [self._names[i] for i in self._slot_arm],
        }

    def save(self, path: Path) -> str:
        """Write the router to directory `path` (manifest.json + state.npz), atomically: a reader sees the old
        directory or the new one, never half of one. Returns and sets `revision`, the sha256 of the contents."""
        path = Path(path)
        manifest, arrays = self._manifest(), self._arrays()
        revision = content_digest(manifest, arrays)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            np.savez(tmp / ARRAYS, **arrays)  # type: ignore[arg-type]
            (tmp / MANIFEST).write_text(
                json.dumps({**manifest, "revision": revision}, indent=1, sort_keys=True)
            )
            for f in (ARRAYS, MANIFEST):
                with open(tmp / f, "rb") as fh:
                    os.fsync(fh.fileno())
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.revision = revision
        return revision

    @classmethod
    def load(cls, path: Path, *, featurizer: Featurizer | None = None) -> Router:
        """The router saved in directory `path`. RouterLoadError naming the file and the problem on anything
        wrong: missing files, another format or version, a featurizer other than `featurizer` (when given),
        arrays of the wrong shape or with NaN/inf, contents that do not match the recorded revision."""
        path = Path(path)
        manifest = _read_manifest(path)
        try:
            feat = Featurizer.from_config(manifest["featurizer"])
        except (ValueError, TypeError, KeyError) as e:
            raise RouterLoadError(path / MANIFEST, f"featurizer config is not usable: {e}") from e
        if featurizer is not None and feat != featurizer:
            raise RouterLoadError(
                path / MANIFEST, f"featurizer mismatch: saved {feat.config()}, expected {featurizer.config()}"
            )
        try:
            router = cls(feat, **manifest["hyper"])
        except (ValueError, TypeError) as e:
            raise RouterLoadError(path / MANIFEST, f"hyperparameters: {e}") from e
        arrays = _read_arrays(path, manifest, feat.dim + 1)
        if content_digest(manifest, arrays) != manifest["revision"]:
            raise RouterLoadError(
                path, f"contents do not match revision {manifest['revision']} (edited or corrupt)"
            )
        router._restore(manifest, arrays)
        router.revision = manifest["revision"]
        return router

    def _restore(self, manifest: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Fill a fresh router with checked saved state (store.read_router checked shapes and values)."""
        for name in manifest["arms"]:
            self.add_arm(name)
        self._revisions = dict(manifest["revisions"])
        for k, name in enumerate(manifest["evidence_arms"]):
            st = _Arm(
                arrays["A0"][k].copy(), arrays["b0"][k].copy(), arrays["G"][k].copy(), arrays["g"][k].copy(),
                arrays["P"][k].copy(), int(arrays["since"][k]),
            )  # fmt: skip
            self._put(self._index[name], st)


def _width(P32: np.ndarray, x32: np.ndarray, rows: np.ndarray | None) -> float:
    """The confidence width sqrt(x' P x), read from P in float32 and, for a sparse x (hashed n-grams: a short
    prompt fills a fraction of the dimensions), from the rows of its nonzero features only (x is zero elsewhere).
    A decision reads every considered arm's P, (d+1)^2 values each: 0.5 MB in float64 at the default dim, which a
    server's generation has pushed out of the cache by the next request, so the read, not the arithmetic, is what a
    decision costs (benchmarks/routing.py's cold decision, 11 arms: 0.62 ms p50 with float64 widths over every
    row, 0.30 ms read this way; 0.11 ms warm). float32 changes the width by about 1e-7 of itself, far below what
    the epsilon mix and the rewards' noise decide on."""
    w2 = float(x32 @ P32 @ x32) if rows is None else float(x32[rows] @ (P32[rows] @ x32))
    return float(np.sqrt(max(w2, 0.0)))


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"an arm is a non-empty served name, got {name!r}")


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, with its keys and their types checked."""
    file = path / MANIFEST
    if not path.is_dir():
        raise RouterLoadError(path, "no such directory")
    if not file.is_file():
        raise RouterLoadError(file, "missing")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RouterLoadError(file, f"not readable JSON: {e}") from e
    if not isinstance(manifest, dict):
        raise RouterLoadError(file, "not a JSON object")
    if manifest.get("format") != FORMAT:
        raise RouterLoadError(file, f"format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise RouterLoadError(
            file, f"format version {manifest.get('format_version')!r} (this mint reads {FORMAT_VERSION})"
        )
    kinds = {
        "featurizer": dict,
        "hyper": dict,
        "arms": list,
        "revisions": dict,
        "evidence_arms": list,
        "revision": str,
    }
    for key, kind in kinds.items():
        if not isinstance(manifest.get(key), kind):
            raise RouterLoadError(file, f"{key!r} is missing or not a {kind.__name__}")
    names = manifest["arms"]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise RouterLoadError(file, "arms are not distinct non-empty names")
    unknown = sorted(set(manifest["evidence_arms"]) - set(names))
    if unknown or len(set(manifest["evidence_arms"])) != len(manifest["evidence_arms"]):
        raise RouterLoadError(file, f"evidence arms are not distinct known arms (unknown: {unknown})")
    return manifest


def _read_arrays(path: Path, manifest: Mapping[str, Any], d: int) -> dict[str, np.ndarray]:
    """The state arrays, each present, of the shape the manifest implies, finite."""
    file = path / ARRAYS
    if not file.is_file():
        raise RouterLoadError(file, "missing")
    n = len(manifest["evidence_arms"])
    shapes = {"A0": (n, d, d), "b0": (n, d), "G": (n, d, d), "g": (n, d), "P": (n, d, d), "since": (n,)}
    try:
        with np.load(file, allow_pickle=False) as z:
            arrays = {k: z[k] for k in shapes if k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise RouterLoadError(file, f"not a readable .npz: {e}") from e
    for k, shape in shapes.items():
        if k not in arrays:
            raise RouterLoadError(file, f"array {k!r} is missing")
        if arrays[k].shape != shape:
            raise RouterLoadError(file, f"array {k!r} has shape {arrays[k].shape}, expected {shape}")
        if not np.isfinite(arrays[k]).all():
            raise RouterLoadError(file, f"array {k!r} holds NaN or infinity")
    return arrays


def content_digest(manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the manifest (canonical JSON, without its revision) and every array's dtype, shape and bytes:
    the same state gives the same revision on any machine."""
    h = hashlib.sha256()
    body = {k: v for k, v in manifest.items() if k != "revision"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\n{name}:{a.dtype.str}:{a.shape}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _hyper_problems(
    alpha: float,
    decay: float,
    epsilon: float,
    top_k: int,
    ridge: float,
    keep: float,
    warm: float,
    refresh: int,
) -> list[str]:
    checks = [
        (alpha >= 0, f"alpha {alpha} must be >= 0"),
        (0 < decay <= 1, f"decay {decay} must be in (0, 1]"),
        (0 < epsilon < 1, f"epsilon {epsilon} must be in (0, 1): every arm needs a positive probability"),
        (top_k >= 1, f"top_k {top_k} must be >= 1"),
        (ridge > 0, f"ridge {ridge} must be > 0"),
        (0 <= keep <= 1, f"revision_keep {keep} must be in [0, 1]"),
        (warm >= 0, f"warm_weight {warm} must be >= 0"),
        (refresh >= 1, f"refresh {refresh} must be >= 1"),
    ]
    return [msg for ok, msg in checks if not ok]


def decision_latency(
    router: Any,
    xs: Sequence[np.ndarray],
    candidates: Sequence[str],
    *,
    costs: Mapping[str, float] | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, float]:
    """p50 and p95 of `choose`'s own decide time (ms) over the prompts `xs`: the benchmark's decision overhead
    (any object with `choose` returning a Decision)."""
    rng = rng or np.random.default_rng(0)
    ms = np.array([router.choose(x, candidates, rng=rng, costs=costs).decide_s * 1e3 for x in xs])
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "n": float(len(ms)),
    }
