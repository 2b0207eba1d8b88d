"""Routing for `model: "auto"`: a learned choice of the served adapter (or the base) per prompt.

A pure library (numpy only; no MLflow, Prefect or serving imports): features.py maps a prompt to a vector,
router.py is the contextual bandit that chooses and learns, log.py the append-only decision and reward log,
ope.py off-policy estimates of a router from that log, fit.py fits a router from it, baselines.py the
context-free bandits the benchmark compares against. Serving, the registry and the lifecycle import it.
The defaults below are the one source of truth; docs read them from here.
"""

from mint_core.routing.features import FEATURE_DIM, NGRAMS, Featurizer, prompt_text
from mint_core.routing.router import (
    ALPHA,
    DECAY,
    EPSILON,
    REVISION_KEEP,
    RIDGE,
    TOP_K,
    WARM_WEIGHT,
    Decision,
    Router,
    RouterLoadError,
    decision_latency,
)

__all__ = [
    "ALPHA",
    "DECAY",
    "EPSILON",
    "FEATURE_DIM",
    "NGRAMS",
    "REVISION_KEEP",
    "RIDGE",
    "TOP_K",
    "WARM_WEIGHT",
    "Decision",
    "Featurizer",
    "Router",
    "RouterLoadError",
    "decision_latency",
    "prompt_text",
]
