"""Bounded growth of the Tinker API against a live `mint serve` with a real MLflow registry, driven by the official
`tinker` SDK: `get_training_run` and `delete_checkpoint` (the routes tinker-cookbook's rolling cleanup calls), the
`mint.kind=tinker` tag that keeps sampler saves apart in the MLflow UI, 50 cookbook-style save/delete cycles that
leave the registry and the store (after `mint catalog gc`) at the same size at cycle 10 and at cycle 50, and 50 RL
steps (an unnamed snapshot and a sample each) that leave the engine, the checkpoint index, the store's refs and the
server's sessions at the same size at step 10 and at step 50."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from mlflow import MlflowClient
from tinker import types

from mint_core.registry.store import AdapterStore
from mint_testkit.harness import mint_cli, start_server, stop_server
from tests.integration.test_tinker_api import ALICE, BOB, RANK, base_dir  # noqa: F401 (base_dir: a fixture)

pytestmark = pytest.mark.integration
os.environ["TINKER_TELEMETRY"] = "0"


def serve(base: Path, tmp: Path, mlflow_server: str) -> tuple[Any, str, Path]:
    store = tmp / "store"
    env = {
        "MINT_SERVE_TINKER_API_KEYS": f"{ALICE},{BOB}",
        "MINT_SERVE_TINKER_STATE_DIR": str(tmp / "tinker"),
        "MINT_SERVE_TINKER_REGISTRY_URI": mlflow_server,
        "MINT_SERVE_MAX_LORA_RANK": str(RANK),
    }
    proc, url = start_server(store, "--base", str(base), env=env)
    return proc, url, store


def train_step(tc: Any) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]}
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_get_training_run_and_delete_checkpoint_through_the_sdk(
    base_dir: Path,  # noqa: F811
    mlflow_server: str,
    tmp_path: Path,
) -> None:
    proc, url, _ = serve(base_dir, tmp_path, mlflow_server)
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=ALICE)
        rest = sc.create_rest_client()
        base = rest.get_server_capabilities().result().supported_models[0].model_name
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=0, user_metadata={"team": "a"})
        tc = tc.result()
        paths = []
        for name in ("first", "second"):
            train_step(tc)
            paths.append(tc.save_weights_for_sampler(name).result().path)
        state = tc.save_state("state").result().path

        run = rest.get_training_run(tc.model_id).result()
        assert run.training_run_id == tc.model_id and run.base_model == base and run.lora_rank == 4
        assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == paths[1]
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
        assert run.last_checkpoint.checkpoint_type == "training" and run.user_metadata == {"team": "a"}
        with (
            tinker.ServiceClient(base_url=url, api_key=BOB) as bob,
            pytest.raises(tinker.NotFoundError, match="no training run"),
        ):
            bob.create_rest_client().get_training_run(tc.model_id).result()

        client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
        policy = client.search_model_versions(f"tags.`tinker.path` = '{paths[0]}'")[0].name
        assert client.get_registered_model(policy).tags["mint.kind"] == "tinker"
        assert [
            m.name
            for m in client.search_registered_models(f"name = '{policy}' and tags.`mint.kind` = 'tinker'")
        ]

        rest.delete_checkpoint_from_tinker_path(paths[0]).result()  # the cookbook's rolling cleanup
        versions = client.search_model_versions(f"name = '{policy}'")
        assert [v.tags["tinker.path"] for v in versions] == [paths[1]]
        assert versions[0].tags["mint.parent"] == ""  # re-linked over the deleted version
        r = httpx.post(f"{url}/v1/completions", json={"model": paths[0], "prompt": "ab", "max_tokens": 1})
        assert r.status_code == 404, r.text  # no longer served
        r = httpx.post(f"{url}/v1/completions", json={"model": paths[1], "prompt": "ab", "max_tokens": 1})
        assert r.status_code == 200, r.text
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            rest.delete_checkpoint_from_tinker_path(paths[0]).result()
        rest.delete_checkpoint(tc.model_id, "weights/state").result()
        run = rest.get_training_run(tc.model_id).result()
        assert run.last_checkpoint is None and run.last_sampler_checkpoint is not None
        r = httpx.delete(
            f"{url}/api/v1/training_runs/{tc.model_id}/checkpoints/other/x", headers={"X-API-Key": ALICE}
        )
        assert r.status_code == 400 and "weights or sampler_weights" in r.json()["detail"]
        sc.close("success").result()
        # the record outlives the session: the run still answers, its checkpoints can still be deleted
        later = tinker.RestClient(base_url=url, api_key=ALICE)
        assert later.get_training_run(tc.model_id).result().last_sampler_checkpoint is not None
        later.delete_checkpoint_from_tinker_path(paths[1]).result()
        # the checkpoint is gone, but an alias (candidate) holds its version: that stays in the registry
        assert client.get_model_version_by_alias(policy, "candidate").tags["tinker.path"] == paths[1]
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            later.delete_checkpoint_from_tinker_path(paths[1]).result()
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_fifty_save_and_delete_cycles_keep_the_registry_and_the_store_at_a_constant_size(
    base_dir: Path,  # noqa: F811
    mlflow_server: str,
    tmp_path: Path,
) -> None:
    proc, url, store_dir = serve(base_dir, tmp_path, mlflow_server)
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=ALICE)
        rest = sc.create_rest_client()
        base = rest.get_server_capabilities().result().supported_models[0].model_name
        policy = f"tinker-growth-{uuid.uuid4().hex[:8]}"
        tc = sc.create_lora_training_client(
            base_model=base, rank=4, seed=0, user_metadata={"policy": policy}
        ).result()
        client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
        store = AdapterStore(store_dir)
        gc_args = (
            "--catalog",
            f"sqlite:///{tmp_path / 'tinker' / 'catalog.db'}",
            "--store",
            str(store_dir),
            "--tracking-uri",
            mlflow_server,
        )
        sizes: dict[int, tuple[int, int]] = {}
        previous: list[str] = []
        for cycle in range(1, 51):
            train_step(tc)
            saved = [
                tc.save_state(f"c{cycle}").result().path,
                tc.save_weights_for_sampler(f"c{cycle}").result().path,
            ]
            for path in previous:  # the older checkpoints go, as tinker-cookbook's rolling cleanup does
                rest.delete_checkpoint_from_tinker_path(path).result()
            previous = saved
            if cycle in (10, 50):
                gc = mint_cli("catalog", "gc", *gc_args)
                assert gc.returncode == 0, gc.stdout + gc.stderr
                sizes[cycle] = (len(client.search_model_versions(f"name = '{policy}'")), len(store.list()))
        print(f"(MLflow versions, store blobs) after gc: cycle 10 {sizes[10]}, cycle 50 {sizes[50]}")
        # constant: one version (the newest sampler save), and in the store exactly what the newest two saves
        # refer to (one blob: a save_state and a sampler save of the same step are the same bytes)
        assert sizes[10] == sizes[50] and sizes[50][0] == 1, sizes
        assert {str(d) for d in store.list()} == {str(d) for d in store.refs().values()}, store.refs()
        # what is left is the newest save, and it still works
        sampler = sc.create_sampling_client(model_path=previous[1]).result()
        out = sampler.sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result()
        assert len(out.sequences[0].tokens) == 2
        tc.load_state(previous[0]).result()
        sc.close("success").result()
    finally:
        stop_server(proc)


def gauges(url: str) -> dict[str, float]:
    """The server's unlabelled `mint_*` gauges and counters from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(mint_\w+) (\S+)$", text, re.MULTILINE)}


@pytest.mark.slow  # fifty RL steps through the SDK (10 s)
def test_fifty_rl_steps_with_unnamed_snapshots_leave_the_server_at_a_constant_size(
    base_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An RL loop's step: forward_backward, optim_step, `save_weights_and_get_sampling_client`, one sample. With
    `tinker_keep_snapshots` 4, the server holds the same at step 10 as at step 50: the engine's adapters (the
    training model and 4 snapshots), 4 checkpoint index files, 4 store refs and (after gc) 4 blobs, one session, 4
    sampling sessions.
    The first step's sampling client, released long ago, fails with a 410 that names its snapshot."""
    keep = 4
    env = {
        "MINT_SERVE_TINKER_API_KEYS": ALICE,
        "MINT_SERVE_TINKER_STATE_DIR": str(tmp_path / "tinker"),
        "MINT_SERVE_MAX_LORA_RANK": str(RANK),
        "MINT_SERVE_TINKER_KEEP_SNAPSHOTS": str(keep),
    }
    store_dir = tmp_path / "store"
    proc, url = start_server(store_dir, "--base", str(base_dir), env=env)
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=ALICE)
        base = sc.create_rest_client().get_server_capabilities().result().supported_models[0].model_name
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=0).result()
        store = AdapterStore(store_dir)
        sizes: dict[int, dict[str, float]] = {}
        first: Any = None
        for step in range(1, 51):
            train_step(tc)
            sampler = tc.save_weights_and_get_sampling_client().result()
            first = first or sampler
            out = sampler.sample(
                types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2, seed=step)
            ).result()
            assert len(out.sequences[0].tokens) == 2
            if step in (10, 50):
                store.gc(set())  # as `mint catalog gc` (no catalog here): keeps what a store ref names
                g = gauges(url)
                sizes[step] = {
                    "engine adapters": g["mint_lora_adapters_loaded"],
                    "metadata files": len(list((tmp_path / "tinker" / "checkpoints").glob("*.json"))),
                    "store refs": len(store.refs()),
                    "store blobs after gc": len(store.list()),
                    "sessions": g["mint_tinker_sessions"],
                    "training models": g["mint_tinker_training_models"],
                    "sampling sessions": g["mint_tinker_sampling_sessions"],
                    "snapshots": g["mint_tinker_snapshots"],
                }
        print(f"step 10: {sizes[10]}\nstep 50: {sizes[50]}")
        assert (
            sizes[10]
            == sizes[50]
            == {
                "engine adapters": 1 + keep,
                "metadata files": keep,
                "store refs": keep,
                "store blobs after gc": keep,
                "sessions": 1,
                "training models": 1,
                "sampling sessions": keep,
                "snapshots": keep,
            }
        )
        with pytest.raises(tinker.APIStatusError, match=r"snapshot-1, which was released") as e:
            first.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
        assert e.value.status_code == 410
        sc.close("success").result()
        g = gauges(url)
        assert g["mint_tinker_snapshots"] == g["mint_tinker_training_models"] == 0
        assert g["mint_lora_adapters_loaded"] == 0 and not store.refs()
    finally:
        stop_server(proc)
