"""Fit a router from the route log (and cold-start prompts): what the nightly `route` flow gates and registers.

A fit replays the logged rewards in time order through `Router.update` with the slow `FIT_DECAY` (not the
online `DECAY`), and calls `set_revision` where a record says its arm answered with another adapter revision than
the arm's last. Why: online, decay is how the router notices change it is not told about, and ~50 rewards an arm
is the price; a nightly fit has the whole log and is told of every revision change by the records themselves, so
forgetting within a revision would only throw away evidence (with reward gaps of a few hundredths between arms
and a 0/1-ish score, 50 rewards cannot tell them apart; the benchmark's batch fit, with no forgetting, is what the
router reaches given enough evidence). The fitted router then serves with the online decay
(its hyperparameters keep it). The serving router's exploration history does not matter: disjoint per-arm regressions are unbiased under the logging policy's
choice of arm (it only changes which prompts each arm saw). Starting from `base` (the serving router) keeps its
priors and evidence and adds the new records; starting fresh makes the fit reproducible from the log alone.

Cold start: for each arm, its task's prompts are positive pseudo-observations (reward 1) and the other arms'
prompts negative ones (reward 0), except prompts the arm shares (two revisions of one task share their prompts):
a new adapter is routed its task's prompts before any traffic reaches it. A record that shows an arm's new revision
adds that cold start again after shrinking the old revision's evidence (`Router.set_revision`), as serving does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mint_core.routing.features import Featurizer, prompt_text
from mint_core.routing.log import RouteRecord
from mint_core.routing.router import Claim, Router

FIT_DECAY = 0.999
"""Decay while a fit replays the log: ~1,000 rewards an arm instead of the online ~50 (revision changes are
replayed by `set_revision`); not 1.0, so a drift no record announces still fades over a long log."""

Prompt = str | list[dict[str, str]]


def fit_router(
    records: Sequence[RouteRecord],
    cold_start: Mapping[str, Sequence[Prompt]] | None = None,
    base: Router | None = None,
    fit_decay: float = FIT_DECAY,
    **hyper: Any,
) -> Router:
    """A router fitted on the rewarded `records` (time order), after warm-starting the arms of `cold_start`
    ({served name: its task's prompts}). `base`: start from a copy of this router (it is not changed); else a
    new Router(**hyper) (`featurizer=` among them). ValueError for hyperparameters given with a base, or records
    whose features do not fit the featurizer. The replay forgets at `fit_decay` (FIT_DECAY); the router returned
    keeps its own decay for serving."""
    if base is not None and hyper:
        raise ValueError(f"hyperparameters {sorted(hyper)} come from the base router; give one or the other")
    router = copy.deepcopy(base) if base is not None else Router(**hyper)
    if not 0 < fit_decay <= 1:
        raise ValueError(f"fit_decay {fit_decay} must be in (0, 1]")
    router.revision = ""
    claims = warm_start_tasks(router, cold_start) if cold_start else {}
    dim = router.featurizer.dim
    serving_decay, router.decay = router.decay, fit_decay
    try:
        for rec in sorted(records, key=lambda r: r.t):
            for name in rec.candidates:
                router.add_arm(name)
            if rec.reward is not None:
                if rec.revision:
                    router.set_revision(rec.choice, rec.revision, claims.get(rec.choice, ()))
                router.update(rec.choice, rec.vector(dim), rec.reward)
    finally:
        router.decay = serving_decay
    return router


def warm_start_tasks(router: Router, prompts: Mapping[str, Sequence[Prompt]]) -> dict[str, list[Claim]]:
    """Warm-start each arm from its task's prompts (reward 1) and the other arms' prompts it does not share
    (reward 0). The serving side calls this for a cold router too, so both start alike. Returns each arm's
    claims (`cold_claims`), which `set_revision` adds again when the arm's policy serves a new revision."""
    claims = cold_claims(router.featurizer, prompts)
    for arm, parts in claims.items():
        for xs, reward in parts:
            router.warm_start(arm, xs, reward)
    return claims


def cold_claims(feat: Featurizer, prompts: Mapping[str, Sequence[Prompt]]) -> dict[str, list[Claim]]:
    """{arm: [(its task's prompts' features, 1.0), (the other arms' prompts it does not share, 0.0)]}: an arm's
    cold start, given {arm: its task's prompts}."""
    texts = {arm: [prompt_text(p) for p in ps] for arm, ps in prompts.items()}
    xs = {arm: feat.transform_many(list(ps)) for arm, ps in prompts.items()}
    out: dict[str, list[Claim]] = {}
    for arm in prompts:
        own = set(texts[arm])
        negatives = [
            x
            for other in prompts
            if other != arm
            for x, t in zip(xs[other], texts[other], strict=True)
            if t not in own
        ]
        out[arm] = [(xs[arm], 1.0)] + ([(np.stack(negatives), 0.0)] if negatives else [])
    return out
