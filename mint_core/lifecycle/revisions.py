"""The revisions a lifecycle looks up: a training run's identity (its idempotency key), the version a run with that
key already made, and a policy's champion."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from mint_core.registry.catalog import CHAMPION
from mint_core.registry.mlflow_registry import Registry, Revision, UnknownRevision
from mint_core.registry.runs import IDEMPOTENCY_TAG

if TYPE_CHECKING:  # annotations only: looking a revision up (a champion, a run by its key) loads no torch
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.policy import PolicySpec


def idempotency_key(
    spec: PolicySpec,
    data_rev: str,
    grpo: GRPOConfig,
    steps: int,
    prompts_per_step: int,
    seed: int,
    base: str,
    round: str,
) -> str:
    """What makes two training runs one run: the policy, the data, the config, the schedule, the base and the
    round (a name the caller gives each round of retraining). Not the parent: a rerun after the run's own
    promotion must still find the version it made. Rerunning finds that version instead of training again."""
    doc = {
        "spec": spec.model_dump(mode="json"),
        "round": round,
        "data_rev": data_rev,
        "grpo": grpo.model_dump(mode="json"),
        "steps": steps,
        "prompts_per_step": prompts_per_step,
        "seed": seed,
        "base": base,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def find_by_key(registry: Registry, policy: str, key: str) -> Revision | None:
    """The version of `policy` a run with this idempotency key already made, if any."""
    try:
        revs = registry.revisions(policy)
    except UnknownRevision:
        return None  # no such policy yet
    found = [r for r in revs if r.tags.get(IDEMPOTENCY_TAG) == key]
    return found[0] if found else None


def champion(registry: Registry, policy: str) -> Revision | None:
    """The policy's champion, or None (no policy yet, or no champion)."""
    version = registry.alias_version(policy, CHAMPION)
    return None if version is None else registry.revision(policy, version)
