"""Evaluation step: score a revision through the serving API (lm-eval local-completions), the revision loaded
under its own name beside what is served, then check the results before the gate reads them."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Literal

from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import SecretStr

from mint_core.data.checks import CheckParams, EvalBounds, check, eval_frame
from mint_core.eval.gate import SuiteScore
from mint_core.eval.lm_eval_runner import evaluate_served
from mint_core.eval.records import log_to_mlflow
from mint_core.eval.results import EvalConfig, ServedModel
from mint_core.lifecycle.faults import fault
from mint_core.lifecycle.workspace import Workspace
from mint_core.types import Digest
from tasks.common import RETRY_DELAYS, RevisionRef, Timed, artifact_key, transient

Role = Literal["candidate", "champion"]


class Scores(Timed):
    """One revision's evaluation: a gate score per suite."""

    digest: Digest
    scores: dict[str, SuiteScore]
    eval_s: float
    """lm-eval's own wall time (loading the revision on the server included)."""


def _eval_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """A revision's scores depend only on its bytes, the base, the suites (and their data) and the limit."""
    ws: Workspace = parameters["ws"]
    config: EvalConfig = parameters["config"]
    rev: RevisionRef = parameters["revision"]
    manifest = Path(config.suites_dir) / "data" / "manifest.json"
    data = manifest.read_bytes() if manifest.is_file() else b""
    doc = f"{config.model_dump_json()}|{ws.base.resolve()}|{ws.serving_url}".encode() + data
    return f"eval-{rev.digest[:32]}-{hashlib.sha256(doc).hexdigest()[:16]}"


class BaseScores(Timed):
    """The bare base's evaluation: revision 0 of every policy, what a first revision is gated against."""

    scores: dict[str, SuiteScore]
    eval_s: float


def _base_identity(base: Path) -> bytes:
    """The base directory's config and the size and time of each weights file: what its scores depend on,
    without reading gigabytes of weights."""
    parts = [str(base.resolve()).encode()]
    config = base / "config.json"
    if config.is_file():
        parts.append(config.read_bytes())
    for f in sorted(base.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return b"|".join(parts)


def _base_eval_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    ws: Workspace = parameters["ws"]
    config: EvalConfig = parameters["config"]
    manifest = Path(config.suites_dir) / "data" / "manifest.json"
    data = manifest.read_bytes() if manifest.is_file() else b""
    doc = f"{config.model_dump_json()}|{ws.serving_url}".encode() + _base_identity(ws.base) + data
    return f"eval-base-{hashlib.sha256(doc).hexdigest()[:32]}"


@task(
    cache_key_fn=_base_eval_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=transient,
)
def evaluate_base(ws: Workspace, config: EvalConfig, bounds: EvalBounds) -> BaseScores:
    """Score the bare base (no adapter) on the served API, as revision 0 of every policy, then check the
    scores. Cached per base and suites: every first revision of a wave, and of later waves, reads the same."""
    t0 = time.perf_counter()
    fault("evaluate")
    ws.await_serving()  # a server still starting (the main job starts vLLM beside the first wave's training)
    token = ws.admin_token()  # the base is called with mint's own credential (serving keys need one)
    target = ServedModel(
        url=ws.serving_url, tokenizer=ws.base, admin_token=SecretStr(token) if token else None
    )
    result = evaluate_served(target, config)
    check(eval_frame(result.suites), "eval", CheckParams(eval=bounds), source=f"the base {ws.base}")
    scores = result.gate_scores()
    rows = "\n".join(f"| {s.name} | {s.score:.3f} | {s.n} |" for s in scores.values())
    create_markdown_artifact(
        f"### the base (revision 0)\n\n| suite | score | n |\n| --- | --- | --- |\n{rows}\n",
        key="eval-base",
        description=f"evaluation of the bare base {ws.base.name}: what first revisions are gated against",
    )
    return BaseScores(scores=scores, eval_s=result.wall_s, work_s=time.perf_counter() - t0)


@task(
    cache_key_fn=_eval_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=transient,
)
def evaluate(
    ws: Workspace, revision: RevisionRef, role: Role, config: EvalConfig, bounds: EvalBounds
) -> Scores:
    """Score a revision on the served API under `<policy>-<role>`, then check the scores (Great Expectations)."""
    t0 = time.perf_counter()
    fault("evaluate")
    ws.await_serving()
    token = ws.admin_token()
    target = ServedModel(
        url=ws.serving_url,
        tokenizer=ws.base,
        adapter=ws.lora_path(revision.digest),
        name=f"{revision.policy}-{role}",
        admin_token=SecretStr(token) if token else None,
        unload_after=True,
    )
    result = evaluate_served(target, config)
    if result.revision not in (None, revision.digest.prefixed):
        raise RuntimeError(f"the server scored {result.revision}, not {revision.address}")
    check(eval_frame(result.suites), "eval", CheckParams(eval=bounds), source=f"{revision.address} ({role})")
    if role == "candidate" and revision.run_id:
        log_to_mlflow(result, ws.tracking_uri, revision.run_id)
    scores = result.gate_scores()
    rows = "\n".join(f"| {s.name} | {s.score:.3f} | {s.n} |" for s in scores.values())
    create_markdown_artifact(
        f"### {revision.address} ({role})\n\n| suite | score | n |\n| --- | --- | --- |\n{rows}\n",
        key=artifact_key("eval", revision.policy, role),
        description=f"evaluation of {revision.address} as {role}",
    )
    return Scores(
        digest=revision.digest,
        scores=scores,
        eval_s=result.wall_s,
        work_s=time.perf_counter() - t0,
    )
