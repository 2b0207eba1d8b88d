"""Routing for `model: "auto"`: a learned choice of the served adapter (or the base) per prompt.

A pure library (numpy only; no MLflow, Prefect or serving imports): features.py maps a prompt to a vector,
router.py is the contextual bandit that chooses and learns, log.py the append-only decision and reward log,
ope.py off-policy estimates of a router from that log, fit.py fits a router from it, baselines.py the
context-free bandits the benchmark compares against. Serving, the registry and the lifecycle import it.
The defaults (FEATURE_DIM, ALPHA, DECAY, FIT_DECAY, EPSILON, TOP_K, ...) are the one source of truth; docs read them here.
"""

from mint_core.routing.baselines import ContextFreeThompson, EpsilonGreedy
from mint_core.routing.features import FEATURE_DIM, GRAM_WEIGHTS, NGRAMS, Featurizer, prompt_text
from mint_core.routing.fit import FIT_DECAY, cold_claims, fit_router, warm_start_tasks
from mint_core.routing.log import LOG_NAME, RouteLog, RouteRecord, sparse_features
from mint_core.routing.ope import Estimate, dr, ips, snips
from mint_core.routing.router import (
    ALPHA,
    BIAS_RIDGE,
    DECAY,
    EPSILON,
    REVISION_KEEP,
    RIDGE,
    TOP_K,
    WARM_WEIGHT,
    Claim,
    Decision,
    Router,
    RouterLoadError,
    decision_latency,
)

__all__ = [
    "ALPHA",
    "BIAS_RIDGE",
    "DECAY",
    "EPSILON",
    "FEATURE_DIM",
    "FIT_DECAY",
    "GRAM_WEIGHTS",
    "LOG_NAME",
    "NGRAMS",
    "REVISION_KEEP",
    "RIDGE",
    "TOP_K",
    "WARM_WEIGHT",
    "Claim",
    "ContextFreeThompson",
    "Decision",
    "EpsilonGreedy",
    "Estimate",
    "Featurizer",
    "RouteLog",
    "RouteRecord",
    "Router",
    "RouterLoadError",
    "cold_claims",
    "decision_latency",
    "dr",
    "fit_router",
    "ips",
    "prompt_text",
    "snips",
    "sparse_features",
    "warm_start_tasks",
]
