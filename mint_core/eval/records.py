"""An evaluation's record in an MLflow run, written and read back through the registry (`registry.runs`):
metrics `<prefix>/<suite>/<metric>`, tags naming the path and revision, and the typed result plus lm-eval's raw
results as JSON artifacts."""

from __future__ import annotations

from mint_core.eval.results import RAW_ARTIFACT, RESULT_ARTIFACT, EvalError, EvalResult
from mint_core.registry.runs import RunRecordError, log_run_record, read_run_documents


def log_to_mlflow(result: EvalResult, tracking_uri: str, run_id: str, prefix: str = "eval") -> None:
    """Record `result` in a run through the registry: metrics `<prefix>/<suite>/<metric>` (plus `score` and `n`
    per suite and `<prefix>/wall_s`), tags naming the path and revision, and artifacts `<prefix>/result.json`
    (typed result with per-sample answers) and `<prefix>/lm_eval_results.json` (lm-eval's raw results)."""
    metrics = {f"{prefix}/wall_s": result.wall_s}
    for name, s in result.suites.items():
        values = {**s.metrics, "score": s.score, "n": float(s.n)}
        metrics |= {f"{prefix}/{name}/{m}": v for m, v in values.items()}
    tags = {
        f"mint.{prefix}.path": result.path,
        f"mint.{prefix}.revision": result.revision or "base",
        f"mint.{prefix}.suites": ",".join(result.suites),
    }
    documents = {
        f"{prefix}/{RESULT_ARTIFACT}": result.model_dump(mode="json", exclude={"raw"}),
        f"{prefix}/{RAW_ARTIFACT}": result.raw,
    }
    try:
        log_run_record(tracking_uri, run_id, metrics, tags, documents)
    except RunRecordError as e:
        raise EvalError(f"logging the evaluation: {e}") from e


def load_from_mlflow(tracking_uri: str, run_id: str, prefix: str = "eval") -> EvalResult:
    """The EvalResult `log_to_mlflow` recorded in a run."""
    paths = [f"{prefix}/{RESULT_ARTIFACT}", f"{prefix}/{RAW_ARTIFACT}"]
    try:
        doc, raw = read_run_documents(tracking_uri, run_id, paths).values()
    except RunRecordError as e:
        raise EvalError(f"no evaluation under {prefix}/: {e}") from e
    return EvalResult.model_validate({**doc, "raw": raw})
