"""What the registry records beside revisions: MLflow runs (training curves, evaluation results) and the
gate's decision on a model version.

The rest of the library hands plain values here (metrics, params, JSON documents) and never talks to MLflow
itself: evaluation returns results, the lifecycle returns curves, and this module records them.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow.artifacts
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from mint_core.errors import MintError
from mint_core.registry.tags import fit_tag

IDEMPOTENCY_TAG = "mint.idempotency_key"
"""Tag on a training run (and its model version) naming the work that produced it, so a retry finds it."""
_BATCH = 900  # MLflow's log_batch takes at most 1000 metrics per call


class RunRecordError(MintError):
    """A run's record could not be written to, or read back from, MLflow."""


def log_training_run(
    client: MlflowClient,
    experiment: str,
    policy: str,
    key: str,
    params: Mapping[str, Any],
    curve: list[dict[str, float]],
    figure: Any | None = None,
    times: list[float] | None = None,
    started: float | None = None,
) -> str:
    """The MLflow run of one policy's training: params, the curve as `train/<name>` metrics by step, and a plot.
    `times` (epoch seconds, one per point: when its step ended) stamp the metrics, and with `started` the run
    spans the training it records (start to the last step) rather than the moment it was logged. A rerun with
    the same idempotency key finds the run it made before instead of making another."""
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    found = client.search_runs([exp_id], filter_string=f"tags.`{IDEMPOTENCY_TAG}` = '{key}'", max_results=1)
    if found:
        return str(found[0].info.run_id)
    if times is not None and len(times) != len(curve):
        raise ValueError(f"{len(times)} times for {len(curve)} curve points")
    now = time.time()
    stamps = [int(t * 1000) for t in times] if times else [int(now * 1000)] * len(curve)
    begin = int((started if started is not None else now) * 1000)
    run = client.create_run(
        exp_id,
        start_time=begin,
        run_name=f"{policy}-{key[:8]}",
        tags={IDEMPOTENCY_TAG: key, "mint.policy": policy},
    )
    run_id = str(run.info.run_id)
    metrics = [
        Metric(f"train/{name}", float(value), stamps[i], i)
        for i, point in enumerate(curve)
        for name, value in point.items()
        if math.isfinite(value)
    ]
    flat = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for start in range(0, max(len(metrics), 1), _BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + _BATCH], params=flat if start == 0 else [])
    if figure is not None:
        client.log_figure(run_id, figure, "reward_curve.png")
    client.set_terminated(run_id, end_time=max(stamps) if stamps and times else None)
    return run_id


def log_run_record(
    tracking_uri: str,
    run_id: str,
    metrics: Mapping[str, float],
    tags: Mapping[str, str],
    documents: Mapping[str, Any],
) -> None:
    """Log metrics (non-finite values skipped), tags and JSON documents (artifact path -> document) to a run."""
    now = int(time.time() * 1000)
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items() if math.isfinite(v)],
            tags=[RunTag(k, fit_tag(v)) for k, v in tags.items()],
        )
        for path, doc in documents.items():
            client.log_dict(run_id, doc, path)
    except MlflowException as e:
        raise RunRecordError(f"logging to MLflow run {run_id} at {tracking_uri} failed: {e}") from e


def read_run_documents(tracking_uri: str, run_id: str, paths: list[str]) -> dict[str, Any]:
    """The JSON documents `log_run_record` wrote to a run, by artifact path."""
    docs = {}
    with tempfile.TemporaryDirectory(prefix="mint-run-") as tmp:
        for path in paths:
            try:
                local = mlflow.artifacts.download_artifacts(
                    run_id=run_id, artifact_path=path, dst_path=tmp, tracking_uri=tracking_uri
                )
            except MlflowException as e:
                raise RunRecordError(f"no {path} in MLflow run {run_id} at {tracking_uri}: {e}") from e
            docs[path] = json.loads(Path(local).read_text())
    return docs


def tag_version(client: MlflowClient, policy: str, version: str | int, key: str, value: str) -> None:
    """Set one tag on a policy's model version (the gate's decision, `mint.gate`)."""
    client.set_model_version_tag(policy, str(version), key, value)


CANARY_EXPERIMENT = "mint-canary"
"""Experiment of the canary watch runs: one run per canary, its online estimate over time."""


def start_canary_run(client: MlflowClient, policy: str, key: str, params: Mapping[str, Any]) -> str:
    """The MLflow run of one canary watch (found again by `key` on a retry of the same flow run)."""
    exp = client.get_experiment_by_name(CANARY_EXPERIMENT)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(CANARY_EXPERIMENT)
    found = client.search_runs([exp_id], filter_string=f"tags.`{IDEMPOTENCY_TAG}` = '{key}'", max_results=1)
    if found:
        return str(found[0].info.run_id)
    run = client.create_run(
        exp_id, run_name=f"canary-{policy}-{key[:8]}", tags={IDEMPOTENCY_TAG: key, "mint.policy": policy}
    )
    run_id = str(run.info.run_id)
    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    return run_id


def log_metrics(client: MlflowClient, run_id: str, metrics: Mapping[str, float | None], step: int) -> None:
    """Metrics at one step (non-finite and None values skipped), stamped now."""
    now = int(time.time() * 1000)
    rows = [
        Metric(k, float(v), now, step)
        for k, v in metrics.items()
        if v is not None and math.isfinite(float(v))
    ]
    try:
        client.log_batch(run_id, metrics=rows)
    except MlflowException as e:
        raise RunRecordError(f"logging to MLflow run {run_id} failed: {e}") from e


def end_run(client: MlflowClient, run_id: str, tags: Mapping[str, str], failed: bool = False) -> None:
    client.log_batch(run_id, tags=[RunTag(k, fit_tag(v)) for k, v in tags.items()])
    client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")
