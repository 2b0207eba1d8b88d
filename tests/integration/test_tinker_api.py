"""The official `tinker` SDK, unchanged, against a live `mint serve` (the Tinker API on the same engine as the
OpenAI routes): a supervised loop whose cross-entropy falls, an RL loop (sample, reward, importance_sampling,
optim_step) whose mean reward on a built-in task rises, losses and gradients through the API against a direct
computation, refusals the SDK raises with a clear message, and saved revisions served by name and registered in
MLflow with their lineage.

The base is the built-in one (data/base) when `dvc repro` has built it. Otherwise a tiny dense base (seed 0, the
byte tokenizer) whose output head is initialised wide (std 0.3): at Hugging Face's default (0.02) a random head
cannot make any token likely, and LoRA adapts the decoder layers, not the head, so no reward could rise on it;
the RL loop then uses a task's format reward, which such a base can learn. MINT_TEST_TINKER_TINY_BASE=1 picks the
tiny base even when data/base is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from mint_core.data.generators import examples, take
from mint_core.data.rewards import reward
from mint_core.engine.base import build_tiny_base, load_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import AdapterWeights
from mint_core.lora.validate import BaseSpec, read_adapter
from mint_core.registry.store import AdapterStore
from mint_testkit.harness import start_server, stop_server

pytestmark = pytest.mark.integration
os.environ["TINKER_TELEMETRY"] = "0"

ROOT = Path(__file__).resolve().parents[2]
ALICE, BOB = "tml-alice-key-0000000", "tml-bob-key-000000000"
RANK = 8


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    builtin = ROOT / "data" / "base"
    if (builtin / "config.json").is_file() and not os.environ.get("MINT_TEST_TINKER_TINY_BASE"):
        return builtin
    out = tmp_path_factory.mktemp("tinker-base") / "tiny-wide"
    tiny = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer(), initializer_range=0.3)
    tiny.model.save_pretrained(out)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    store = tmp_path_factory.mktemp("tinker-store")
    keys = tmp_path_factory.mktemp("tinker-keys") / "keys"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    env = {
        "MINT_SERVE_TINKER_API_KEYS_FILE": str(keys),
        "MINT_SERVE_TINKER_STATE_DIR": str(tmp_path_factory.mktemp("tinker-state")),
        "MINT_SERVE_MAX_LORA_RANK": str(RANK),
    }
    proc, url = start_server(store, "--base", str(base_dir), env=env)
    try:
        yield url, store
    finally:
        stop_server(proc)


OPENED: list[Any] = []
"""The SDK clients this module's tests made: each runs a heartbeat thread until it is closed."""


def service_client(url: str, key: str) -> Any:
    OPENED.append(tinker.ServiceClient(base_url=url, api_key=key))
    return OPENED[-1]


@pytest.fixture(autouse=True)
def closed_clients() -> Iterator[None]:
    """Every SDK client a test left open is closed at its end (a second close does nothing), so no session
    heartbeat outlives its test or the server."""
    yield
    while OPENED:
        OPENED.pop().close("success").result(timeout=30)


def training_client(url: str, key: str = ALICE, rank: int = RANK, seed: int = 0) -> tuple[Any, Any]:
    sc = service_client(url, key)
    base = sc._rest_client().get_server_capabilities().result().supported_models[0].model_name
    return sc, sc.create_lora_training_client(base_model=base, rank=rank, seed=seed).result()


def test_supervised_loop_cross_entropy_falls(server: tuple[str, Path], base_dir: Path) -> None:
    url, _ = server
    sc, tc = training_client(url)
    info = tc.get_info()
    assert info.model_data.model_name == base_dir.name and info.lora_rank == RANK
    tok = tc.get_tokenizer()  # loaded by the SDK from the tokenizer_id the server gave
    data = []
    for ex in take(examples("reverse", 0), 6):
        prompt, answer = tok.encode(ex.prompt), tok.encode(" " + ex.answer)
        ids = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
            )
        )
    losses = []
    for _ in range(12):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    assert losses[-1] < 0.6 * losses[0], losses
    sc.close("success").result()


def test_rl_loop_mean_reward_rises(server: tuple[str, Path], base_dir: Path) -> None:
    """Sample with the SDK, score with a built-in task's reward, importance_sampling, optim_step, on the same 8
    prompts each step. On the built-in base: exact answers to `add` (about a quarter right at temperature 1 at
    first, about 0.7 after 12 steps); on the tiny fallback, which knows no task: the `add` task's format reward."""
    url, _ = server
    builtin = base_dir == ROOT / "data" / "base"
    task, score_name, max_tokens, lr, steps, gain = (
        ("add", "exact_match", 4, 1e-3, 12, 0.15) if builtin else ("add", "well_formed", 2, 0.02, 10, 0.5)
    )
    sc, tc = training_client(url, seed=1)
    tok = tc.get_tokenizer()
    score = reward(score_name)
    prompts = take(examples(task, 0), 8)
    means = []
    for it in range(steps):
        sampler = tc.save_weights_and_get_sampling_client().result()
        futures = []
        for j, ex in enumerate(prompts):
            ids = tok.encode(ex.prompt)
            params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=it * 100 + j)
            futures.append((ex, ids, sampler.sample(types.ModelInput.from_ints(ids), 16, params)))
        data, rewards = [], []
        for ex, ids, fut in futures:
            seqs = fut.result().sequences
            r = np.array([score(ex, tok.decode(s.tokens, skip_special_tokens=True)) for s in seqs])
            rewards += r.tolist()
            for s, adv in zip(seqs, r - r.mean(), strict=True):
                if adv == 0 or not s.tokens:
                    continue
                assert s.logprobs is not None and len(s.logprobs) == len(s.tokens)
                toks = ids + s.tokens
                pad = [0.0] * (len(ids) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={
                            "target_tokens": toks[1:],
                            "logprobs": pad + list(s.logprobs),
                            "advantages": pad + [float(adv)] * len(s.tokens),
                        },
                    )
                )
        if data:
            tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        means.append(float(np.mean(rewards)))
    assert np.mean(means[-3:]) > np.mean(means[:2]) + gain, means
    sc.close("success").result()


def test_losses_and_gradients_through_the_api_match_a_direct_computation(
    server: tuple[str, Path], base_dir: Path
) -> None:
    """Loss values from `forward`; the gradient from the weights after one Adam step (from zero moments and B = 0
    it moves B by -lr * sign(grad) and leaves A, whose gradient is zero, as it was), read back from the store."""
    url, store = server
    sc, tc = training_client(url, seed=3)
    rng = np.random.default_rng(0)
    ce, isd = [], []
    for n in (7, 4):
        ids = rng.integers(0, 200, n + 1).tolist()
        ce.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": rng.uniform(0, 1, n).tolist()},
            )
        )
        isd.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": ids[1:],
                    "logprobs": (-5.0 + rng.uniform(-1, 1, n)).tolist(),
                    "advantages": rng.normal(0, 1, n).tolist(),
                },
            )
        )
    ce_loss = tc.forward(ce, "cross_entropy").result().metrics["loss:sum"]
    is_out = tc.forward_backward(isd, "importance_sampling").result()
    lr = 1e-3
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    path = tc.save_weights_for_sampler("after-one-step").result().path

    # the saved revision: the store (same machine) holds it under the digest the engine serves it as
    base = load_base(base_dir)
    spec = BaseSpec(base.fingerprint, base.sites, 1024)
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    saved = read_adapter(AdapterStore(store).local_dir(listed[path]["revision"]), spec)
    engine = Engine(base, EngineConfig(max_loras=2, max_lora_rank=RANK))
    fresh = {s: (A, torch.zeros_like(B)) for s, (A, B) in saved.tensors.items()}
    engine.add_adapter("before-step", AdapterWeights(saved.rank, saved.alpha, fresh, base.fingerprint))
    slot = engine.working_set.acquire("before-step")
    banks = engine.lora.banks
    for b in banks.values():
        b.A.requires_grad_(True)
        b.B.requires_grad_(True)
    loss_is, loss_ce = torch.zeros(()), torch.zeros(())
    for d_ce, d_is in zip(ce, isd, strict=True):
        ids = torch.tensor([d_ce.model_input.to_ints()])
        engine.lora.ctx.set_rows([slot])
        logits = engine.base.model(input_ids=ids).logits[0]
        engine.lora.ctx.clear()
        lp = torch.log_softmax(logits.float(), dim=-1)[
            torch.arange(ids.shape[1]), d_ce.loss_fn_inputs["target_tokens"].to_torch()
        ]
        loss_ce = loss_ce - (lp * d_ce.loss_fn_inputs["weights"].to_torch()).sum().detach()
        ratio = torch.exp(lp - d_is.loss_fn_inputs["logprobs"].to_torch())
        loss_is = loss_is - (ratio * d_is.loss_fn_inputs["advantages"].to_torch()).sum()
    loss_is.backward()
    assert ce_loss == pytest.approx(float(loss_ce), rel=1e-4)
    assert is_out.metrics["loss:sum"] == pytest.approx(float(loss_is.detach()), rel=1e-4)
    checked = 0
    for s, (A, B) in saved.tensors.items():
        torch.testing.assert_close(A, fresh[s][0])  # no gradient reached A (B was 0)
        grad = banks[s].B.grad[slot][: saved.rank].T  # type: ignore[index]
        big = grad.abs() > 1e-6
        torch.testing.assert_close(B[big], -lr * torch.sign(grad[big]), rtol=1e-3, atol=1e-6)
        checked += int(big.sum())
    assert checked > 100
    sc.close("success").result()


def test_refusals_are_raised_by_the_sdk_with_a_clear_message(
    server: tuple[str, Path], base_dir: Path
) -> None:
    url, _ = server
    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        service_client(url, "tml-not-a-key-00000").create_lora_training_client(
            base_model="x", rank=4
        ).result()
    sc, tc = training_client(url, rank=4)
    with pytest.raises(tinker.BadRequestError, match=r"LoRA rank 64 is outside \[1, 8\]"):
        sc.create_lora_training_client(base_model=tc.get_info().model_data.model_name, rank=64).result()
    good = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]}
        )
    ]
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'dro' is not supported by this server"):
        tc.forward_backward(good, "dro").result()
    sc, tc = training_client(url, rank=4)  # a failed call leaves the SDK's client unusable: a fresh one
    vocab = json.loads((base_dir / "config.json").read_text())["vocab_size"]
    outside = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, vocab + 5]), loss_fn_inputs={"target_tokens": [2, 3]}
        )
    ]
    with pytest.raises(tinker.BadRequestError, match=rf"model_input token ids must be in \[0, {vocab}\)"):
        tc.forward_backward(outside, "cross_entropy").result()
    sc, tc = training_client(url, rank=4)
    mismatched = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]},
        )
    ]
    with pytest.raises(
        tinker.BadRequestError, match=r"'weights'\] has shape \[2\]; the model input has 3 tokens"
    ):
        tc.forward_backward(mismatched, "cross_entropy").result()
    # another key cannot touch the model, and is not told it exists
    r = httpx.post(
        f"{url}/api/v1/get_info", json={"model_id": tc.model_id}, headers={"X-API-Key": BOB}, timeout=10
    )
    assert r.status_code == 404 and "unknown model_id" in r.json()["detail"]
    # the model still trains for its own key
    assert tc.forward_backward(good, "cross_entropy").result().metrics["loss:sum"] > 0
    r = httpx.get(f"{url}/api/v1/training_runs", headers={"X-API-Key": ALICE}, timeout=10)
    assert r.status_code == 404 and "not supported by this server" in r.json()["detail"]
    assert httpx.get(f"{url}/api/v1/healthz", timeout=10).status_code == 401


def test_a_saved_sampler_revision_is_served_by_name_at_once(server: tuple[str, Path]) -> None:
    url, _ = server
    sc, tc = training_client(url, seed=5)
    tok = tc.get_tokenizer()
    ids = tok.encode("copy: abc = abc")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("served").result().path
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": path, "prompt": "copy: abc =", "max_tokens": 3, "temperature": 0},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    # the same revision through the SDK's sampler, greedy: the same tokens
    sampler = sc.create_sampling_client(model_path=path).result()
    out = sampler.sample(
        types.ModelInput.from_ints(tok.encode("copy: abc =")),
        1,
        types.SamplingParams(max_tokens=3, temperature=0.0),
    ).result()
    assert out.sequences[0].tokens == r.json()["choices"][0].get("token_ids", out.sequences[0].tokens)
    assert tok.decode(out.sequences[0].tokens) == r.json()["choices"][0]["text"]
    sc.close("success").result()


def test_saved_revisions_become_mlflow_versions_with_lineage(
    base_dir: Path, mlflow_server: str, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    store = tmp_path / "store"
    env = {
        "MINT_SERVE_TINKER_API_KEYS": ALICE,
        "MINT_SERVE_TINKER_STATE_DIR": str(tmp_path / "tinker"),
        "MINT_SERVE_TINKER_REGISTRY_URI": mlflow_server,
        "MINT_SERVE_MAX_LORA_RANK": str(RANK),
    }
    proc, url = start_server(store, "--base", str(base_dir), env=env)
    try:
        sc = service_client(url, ALICE)
        base = sc._rest_client().get_server_capabilities().result().supported_models[0].model_name
        policy = f"tinker-test-{os.getpid()}"
        tc = sc.create_lora_training_client(
            base_model=base, rank=4, seed=0, user_metadata={"policy": policy}
        ).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]}
        )
        paths = []
        for name in ("first", "second"):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            paths.append(tc.save_weights_for_sampler(name).result().path)
        client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
        versions = sorted(client.search_model_versions(f"name='{policy}'"), key=lambda v: int(v.version))
        assert [v.tags["tinker.path"] for v in versions] == paths
        assert versions[0].tags["mint.parent"] == ""
        assert versions[1].tags["mint.parent"] == f"{policy}/v1"
        assert {v.tags["tinker.session"] for v in versions} == {tc.model_id.split(":")[0]}
        assert client.get_model_version_by_alias(policy, "candidate").version == versions[1].version
        # served at once, by its Tinker path and by its address
        for model in (paths[1], f"{policy}/v2"):
            r = httpx.post(
                f"{url}/v1/completions", json={"model": model, "prompt": "ab", "max_tokens": 2}, timeout=30
            )
            assert r.status_code == 200, r.text
        sc.close("success").result()
    finally:
        stop_server(proc)
