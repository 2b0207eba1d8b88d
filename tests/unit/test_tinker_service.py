"""The Tinker API's service in process, over the tiny dense base: losses and gradients against a direct computation,
one batched step for many models, each model's calls in order, refusals that change nothing, and the protobuf
bodies against the SDK's own encoders and decoders."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from mint_core.engine.base import build_tiny_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.registry.store import AdapterStore
from mint_core.tinker import losses
from mint_core.tinker.mount import QuietPolls
from mint_core.tinker.optim import AdamStep
from mint_core.tinker.records import Futures, TinkerError, TrainModel, read_keys
from mint_core.tinker.service import TinkerService
from mint_core.tinker.wire import (
    Datum,
    Sampled,
    read_forward_backward,
    write_forward_backward_output,
    write_sample_response,
)
from mint_testkit.waiting import wait_until

VOCAB = 300
KEYS = {"tml-alice-key-0000": "alice", "tml-bob-key-00000": "bob"}


def make_service(root: Path, **kw: Any) -> TinkerService:
    base = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    engine = Engine(base, EngineConfig(max_loras=4, max_lora_rank=8))
    return TinkerService(
        engine, AdapterStore(root / "store"), "tiny-dense", root / "tinker", KEYS, window_ms=50, **kw
    )


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[TinkerService]:
    service = make_service(tmp_path)
    yield service
    service.close()


def new_model(svc: TinkerService, owner: str = "alice", rank: int = 4, seed: int = 0) -> TrainModel:
    sid = svc.create_session(owner)
    return svc.create_model(owner, sid, 0, "tiny-dense", rank, seed)


def datum(n: int, seed: int, loss_fn: str = "cross_entropy") -> Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, n)
    inputs: dict[str, np.ndarray] = {"target_tokens": rng.integers(0, 256, n)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = rng.uniform(0.0, 1.0, n).astype(np.float32)
    else:
        # sampler logprobs near the tiny base's (about log 1/300), so the ratios land on both sides of PPO's clip
        inputs["logprobs"] = (np.log(1 / VOCAB) + rng.uniform(-0.5, 0.5, n)).astype(np.float32)
        inputs["advantages"] = rng.normal(0.0, 1.0, n).astype(np.float32)
    return Datum(tokens, inputs)


def loss_of(result: Any) -> tuple[float, list[np.ndarray]]:
    out = deserialize_forward_backward_output(result.proto)
    return out.metrics["loss:sum"], [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def step(svc: TinkerService, m: TrainModel, lr: float = 0.05) -> None:
    svc.call(m, lambda: svc.optim_step(m, lr, 0.9, 0.95, 1e-8, 0.0, 0.0)).result(30)


def direct(
    svc: TinkerService, m: TrainModel, data: list[Datum], loss_fn: str
) -> tuple[float, list[np.ndarray], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The loss, target logprobs and slot gradients of `data` under `m`, written out by hand: one unpadded forward
    per datum, log_softmax + gather, the loss formula as the SDK documents it."""
    eng = svc.engine
    banks = eng.lora.banks
    for b in banks.values():
        b.A.grad = b.B.grad = None
        b.A.requires_grad_(True)
        b.B.requires_grad_(True)
    total = torch.zeros(())
    lps = []
    try:
        for d in data:
            eng.lora.ctx.set_rows([m.slot])
            logits = eng.base.model(input_ids=torch.from_numpy(d.tokens)[None]).logits[0]
            eng.lora.ctx.clear()
            tgt = torch.from_numpy(d.inputs["target_tokens"])
            lp = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(tgt)), tgt]
            lps.append(lp.detach().numpy())
            if loss_fn == "cross_entropy":
                w = d.inputs.get("weights")
                loss = -(lp * torch.from_numpy(w)).sum() if w is not None else -lp.sum()
            else:
                ratio = torch.exp(lp - torch.from_numpy(d.inputs["logprobs"]))
                adv = torch.from_numpy(d.inputs["advantages"])
                if loss_fn == "importance_sampling":
                    loss = -(ratio * adv).sum()
                else:
                    loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum()
            total = total + loss
        total.backward()
        grads = {s: (banks[s].A.grad[m.slot].clone(), banks[s].B.grad[m.slot].clone()) for s in m.sites}  # type: ignore[index]
    finally:
        for b in banks.values():
            b.A.grad = b.B.grad = None
            b.A.requires_grad_(False)
            b.B.requires_grad_(False)
    return float(total.detach()), lps, grads


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_losses_and_gradients_match_a_direct_computation_in_one_batched_step(
    svc: TinkerService, loss_fn: str
) -> None:
    a, b = new_model(svc, rank=4, seed=1), new_model(svc, rank=8, seed=2)
    for m in (a, b):  # one step first, so B is nonzero and A gets a gradient too
        svc.forward_backward(m, [datum(5, 99)], "cross_entropy", {}, False).result(30)
        step(svc, m)
    data_a = [datum(6, 1, loss_fn), datum(3, 2, loss_fn)]
    data_b = [datum(9, 3, loss_fn)]
    before = len(svc.batches)
    with svc._cv:  # the worker takes nothing until both calls are queued
        fa = svc.forward_backward(a, data_a, loss_fn, {}, False)
        fb = svc.forward_backward(b, data_b, loss_fn, {}, False)
    res_a, res_b = fa.result(30), fb.result(30)
    assert svc.batches[before:] == [2]  # both calls ran as one forward/backward
    banks = svc.engine.lora.banks
    got = {
        m.id: {s: (banks[s].A.grad[m.slot].clone(), banks[s].B.grad[m.slot].clone()) for s in m.sites}
        for m in (a, b)
    }  # type: ignore[index]
    for m, data, res in ((a, data_a, res_a), (b, data_b, res_b)):
        loss, lps = loss_of(res)
        want_loss, want_lps, want_grads = direct(svc, m, data, loss_fn)
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-5)
        for lp, want in zip(lps, want_lps, strict=True):
            np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
        for s, (gA, gB) in want_grads.items():
            assert gA.abs().sum() > 0 and gB.abs().sum() > 0
            torch.testing.assert_close(got[m.id][s][0], gA, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(got[m.id][s][1], gB, rtol=1e-4, atol=1e-6)


def test_each_models_calls_run_in_order_while_other_models_batch_with_them(svc: TinkerService) -> None:
    a, b = new_model(svc, seed=1), new_model(svc, seed=2)
    data = [datum(8, 5)]
    before = len(svc.batches)
    with svc._cv:  # the worker takes nothing until all four calls are queued
        first = svc.forward_backward(a, data, "cross_entropy", {}, False)
        other = svc.forward_backward(b, data, "cross_entropy", {}, False)
        opt = svc.call(a, lambda: svc.optim_step(a, 0.005, 0.9, 0.95, 1e-8, 0.0, 0.0))
        second = svc.forward_backward(a, data, "cross_entropy", {}, True)
    loss1, _ = loss_of(first.result(30))
    loss_other, _ = loss_of(other.result(30))
    opt.result(30)
    loss2, _ = loss_of(second.result(30))
    # round 1: a's first call batched with b's; round 2: a's optim_step alone; round 3: a's forward after it
    assert svc.batches[before:] == [2, 1]
    assert loss_other == pytest.approx(loss1, rel=0.02)  # two fresh models, same data: near-equal losses
    assert loss2 < loss1  # the step ran between a's two calls
    # and a forward now, with no step since, sees exactly the weights the second call saw
    again, _ = loss_of(svc.forward_backward(a, data, "cross_entropy", {}, True).result(30))
    assert again == pytest.approx(loss2, rel=1e-6)


def test_a_forward_backward_waits_the_window_only_while_another_model_is_training(svc: TinkerService) -> None:
    a, b = new_model(svc, seed=1), new_model(svc, seed=2)
    data = [datum(4, 5)]
    svc.forward_backward(a, data, "cross_entropy", {}, False).result(30)  # b never called: no wait
    svc.forward_backward(b, data, "cross_entropy", {}, False).result(30)  # a called just now: b waits for it
    before = len(svc.batches)
    fb = svc.forward_backward(b, data, "cross_entropy", {}, False)
    fa = svc.forward_backward(a, data, "cross_entropy", {}, False)  # within b's 50 ms window
    fb.result(30), fa.result(30)
    assert svc.batches[before:] == [2]


def test_a_forward_backward_waits_for_the_training_models_only_until_they_have_all_called(
    svc: TinkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = new_model(svc, seed=1), new_model(svc, seed=2)
    data = [datum(4, 5)]
    svc.forward_backward(a, data, "cross_entropy", {}, False).result(30)
    svc.forward_backward(b, data, "cross_entropy", {}, False).result(30)
    svc.window_s = 30.0  # a window no test waits out: the round must start as soon as both models have called
    before = len(svc.batches)
    # the worker's waits for a window: the event that shows it has seen b's call and chose to wait
    windows: list[float] = []
    wait = svc._cv.wait

    def recorded(timeout: float | None = None) -> bool:
        if timeout is not None:
            windows.append(timeout)
        return wait(timeout)

    monkeypatch.setattr(svc._cv, "wait", recorded)
    t0 = time.monotonic()
    fb = svc.forward_backward(b, data, "cross_entropy", {}, False)
    wait_until(lambda: windows, 10, "the worker waited out a window for b's call")
    assert not fb.done()  # a is training and has not called yet: b's call waits for it
    fa = svc.forward_backward(a, data, "cross_entropy", {}, False)
    fb.result(10), fa.result(10)
    assert time.monotonic() - t0 < 10
    assert svc.batches[before:] == [2]
    # calls other than forward/forward_backward never wait for the window
    t0 = time.monotonic()
    svc.optim(a, AdamStep(0.01)).result(10)
    svc.call(a, lambda: svc.save_weights(a, "w")).result(10)
    assert time.monotonic() - t0 < 10


def test_optim_steps_of_many_models_run_fused_in_one_round_and_each_models_calls_stay_in_order(
    svc: TinkerService,
) -> None:
    a, b = new_model(svc, seed=1), new_model(svc, seed=2)
    data = [datum(8, 5)]
    before, rounds = len(svc.batches), len(svc.optim_rounds)
    with svc._cv:  # the worker takes nothing until all five calls are queued
        fa = svc.forward_backward(a, data, "cross_entropy", {}, False)
        oa = svc.optim(a, AdamStep(0.005))
        again = svc.forward_backward(a, data, "cross_entropy", {}, True)
        fb = svc.forward_backward(b, data, "cross_entropy", {}, False)
        ob = svc.optim(b, AdamStep(0.005))
    loss1, _ = loss_of(fa.result(30))
    loss_b, _ = loss_of(fb.result(30))
    steps = [oa.result(30).json["metrics"]["step:max"], ob.result(30).json["metrics"]["step:max"]]
    loss2, _ = loss_of(again.result(30))
    # round 1: both forward_backward calls batched; round 2: both optim_steps fused; round 3: a's forward
    assert svc.batches[before:] == [2, 1]
    assert svc.optim_rounds[rounds:] == [2]
    assert steps == [1.0, 1.0]
    assert loss_b == pytest.approx(loss1, rel=0.02)
    assert loss2 < loss1  # a's forward ran after its step


def reference_adamw_step(svc: TinkerService, m: TrainModel, adam: AdamStep) -> float:
    """The step as one model's own `torch.optim.AdamW.step()`: its gradient copied out of the banks and clipped
    to its global norm, its hyper-parameters on its two param groups."""
    banks = svc.engine.lora.banks
    with torch.no_grad():
        grads = []
        for s, (A, B) in m.views.items():
            A.grad = banks[s].A.grad[m.slot].clone()  # type: ignore[index]
            B.grad = banks[s].B.grad[m.slot].clone()  # type: ignore[index]
            grads += [A.grad, B.grad]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
            for g in grads:
                g.mul_(adam.grad_clip_norm / (norm + 1e-6))
        for group in m.optimizer.param_groups:
            group["lr"] = adam.lr * group["lr_mult"]
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay / group["lr_mult"]
        m.optimizer.step()
        for s, (A, B) in m.views.items():
            A.grad = B.grad = None
            banks[s].A.grad[m.slot].zero_()  # type: ignore[index]
            banks[s].B.grad[m.slot].zero_()  # type: ignore[index]
        m.steps += 1
    return norm


def test_a_fused_optim_step_of_many_models_equals_each_models_own_adamw_step(tmp_path: Path) -> None:
    fused, alone = make_service(tmp_path / "fused"), make_service(tmp_path / "alone")
    # two models at rank 8 (the same alpha / r, so their B factors share fused calls where their
    # hyper-parameters agree) and one at rank 4; one clips, one decays
    adams = [
        AdamStep(0.02, 0.9, 0.95, 1e-8, weight_decay=0.1),
        AdamStep(0.01, 0.8, 0.99, 1e-6, grad_clip_norm=1e-3),
        AdamStep(0.01, 0.8, 0.99, 1e-6),
    ]
    ranks = [4, 8, 8]
    try:
        models = {
            id(svc): [new_model(svc, rank=r, seed=i) for i, r in enumerate(ranks)] for svc in (fused, alone)
        }
        for round_ in range(3):
            for svc in (fused, alone):
                ms = models[id(svc)]
                with svc._cv:  # one batched forward_backward, the same in both services
                    futs = [
                        svc.forward_backward(m, [datum(6, 10 * round_ + i)], "cross_entropy", {}, False)
                        for i, m in enumerate(ms)
                    ]
                for f in futs:
                    f.result(30)
            got = fused.optim_steps(list(zip(models[id(fused)], adams, strict=True)))
            with alone.engine.exclusive():
                want = [
                    reference_adamw_step(alone, m, adam)
                    for m, adam in zip(models[id(alone)], adams, strict=True)
                ]
            assert [g["metrics"]["grad_norm:mean"] for g in got] == want
            assert [g["metrics"]["step:max"] for g in got] == [float(round_ + 1)] * 3
            for mf, ma in zip(models[id(fused)], models[id(alone)], strict=True):
                for s in mf.sites:
                    bf, ba = fused.engine.lora.banks[s], alone.engine.lora.banks[s]
                    assert torch.equal(bf.A.data[mf.slot], ba.A.data[ma.slot]), s
                    assert torch.equal(bf.B.data[mf.slot], ba.B.data[ma.slot]), s
                    assert bf.A.grad is not None and not bf.A.grad[mf.slot].any()  # cleared
                    for vf, va in zip(mf.views[s], ma.views[s], strict=True):
                        sf, sa = mf.optimizer.state[vf], ma.optimizer.state[va]
                        assert set(sf) == set(sa) == {"step", "exp_avg", "exp_avg_sq"}
                        for k in sf:
                            assert torch.equal(sf[k], sa[k]), (s, k)
        assert models[id(fused)][1].steps == 3
    finally:
        fused.close()
        alone.close()


def test_a_call_whose_data_leave_out_an_optional_input_is_still_exact(svc: TinkerService) -> None:
    a = new_model(svc, seed=1)
    svc.forward_backward(a, [datum(5, 99)], "cross_entropy", {}, False).result(30)
    step(svc, a)
    bare = datum(4, 3)
    del bare.inputs["weights"]  # cross_entropy's weights are optional: each datum may leave them out
    data = [datum(6, 1), bare, datum(3, 2)]
    loss, lps = loss_of(svc.forward_backward(a, data, "cross_entropy", {}, True).result(30))
    want_loss, want_lps, _ = direct(svc, a, data, "cross_entropy")
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-5)
    for lp, want in zip(lps, want_lps, strict=True):
        np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)


def test_the_access_log_leaves_out_answered_retrieve_future_polls() -> None:
    def record(path: str, status: int) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "POST", path, "1.1", status)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    quiet = QuietPolls()
    assert not quiet.filter(record("/api/v1/retrieve_future", 200))
    assert quiet.filter(record("/api/v1/retrieve_future", 404))
    assert quiet.filter(record("/api/v1/forward_backward", 200))


def test_a_model_trains_only_its_own_slot(svc: TinkerService) -> None:
    a, b = new_model(svc, seed=1), new_model(svc, seed=2)
    banks = svc.engine.lora.banks
    before_b = {s: banks[s].B.data[b.slot].clone() for s in b.sites}
    base = {n: p.detach().clone() for n, p in svc.engine.base.model.named_parameters() if "bank" not in n}
    svc.forward_backward(a, [datum(6, 1)], "cross_entropy", {}, False).result(30)
    step(svc, a)
    assert any(banks[s].B.data[a.slot].abs().sum() > 0 for s in a.sites)
    for s in b.sites:
        assert torch.equal(banks[s].B.data[b.slot], before_b[s])
    for n, p in svc.engine.base.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n


def test_save_weights_for_sampler_serves_the_trained_revision_by_its_path(svc: TinkerService) -> None:
    a = new_model(svc, seed=1)
    svc.forward_backward(a, [datum(6, 1)], "cross_entropy", {}, False).result(30)
    step(svc, a)
    out = svc.call(a, lambda: svc.save_for_sampler(a, "v1")).result(30)
    path = out["path"]
    assert path == f"tinker://{a.id}/sampler_weights/v1"
    digest = svc.engine.working_set.get(path)
    assert digest is not None and svc.store.exists(digest)
    ids = torch.tensor([[5, 6, 7, 8]])
    served = svc.engine.logits(ids, [path])
    with svc.engine.exclusive():
        svc.engine.lora.ctx.set_rows([a.slot])
        trained = svc.engine.base.model(input_ids=ids).logits.detach()
        svc.engine.lora.ctx.clear()
    torch.testing.assert_close(served, trained, rtol=1e-5, atol=1e-5)
    # another key cannot sample it
    with pytest.raises(TinkerError, match="no checkpoint"):
        svc.create_sampler("bob", svc.create_session("bob"), path, None)


def test_save_and_load_weights_restore_weights_and_optimizer(svc: TinkerService) -> None:
    a = new_model(svc, seed=1)
    data = [datum(6, 1)]
    svc.forward_backward(a, data, "cross_entropy", {}, False).result(30)
    step(svc, a)
    path = svc.call(a, lambda: svc.save_weights(a, "ck")).result(30)["path"]
    saved, _ = loss_of(svc.forward_backward(a, data, "cross_entropy", {}, True).result(30))
    svc.forward_backward(a, data, "cross_entropy", {}, False).result(30)
    step(svc, a)
    moved, _ = loss_of(svc.forward_backward(a, data, "cross_entropy", {}, True).result(30))
    assert moved != pytest.approx(saved)
    svc.call(a, lambda: svc.load_weights(a, path, True)).result(30)
    back, _ = loss_of(svc.forward_backward(a, data, "cross_entropy", {}, True).result(30))
    assert back == pytest.approx(saved, rel=1e-6)
    assert a.steps == 1


CASES = [
    (
        "unknown model id",
        lambda s, a: s.model("alice", "nope:train:0"),
        404,
        "unknown model_id 'nope:train:0'",
    ),
    ("another key's model", lambda s, a: s.model("bob", a.id), 404, "unknown model_id"),
    (
        "loss not supported",
        lambda s, a: s.forward_backward(a, [datum(3, 1)], "dro", {}, False),
        400,
        "loss_fn 'dro' is not supported by this server; supported: cross_entropy, importance_sampling, ppo",
    ),
    (
        "input token outside the vocabulary",
        lambda s, a: s.forward_backward(
            a, [Datum(np.array([1, 300]), {"target_tokens": np.array([1, 2])})], "cross_entropy", {}, False
        ),
        400,
        "datum 0: model_input token ids must be in [0, 300)",
    ),
    (
        "target outside the vocabulary",
        lambda s, a: s.forward_backward(
            a, [Datum(np.array([1, 2]), {"target_tokens": np.array([1, -3])})], "cross_entropy", {}, False
        ),
        400,
        "datum 0: target_tokens must be token ids in [0, 300)",
    ),
    (
        "mismatched shapes",
        lambda s, a: s.forward_backward(
            a,
            [
                Datum(
                    np.array([1, 2, 3]),
                    {"target_tokens": np.array([1, 2, 3]), "weights": np.ones(2, dtype=np.float32)},
                )
            ],
            "cross_entropy",
            {},
            False,
        ),
        400,
        "datum 0: loss_fn_inputs['weights'] has shape [2]; the model input has 3 tokens, so it must be [3]",
    ),
    (
        "missing input",
        lambda s, a: s.forward_backward(
            a,
            [
                Datum(
                    np.array([1, 2]),
                    {"target_tokens": np.array([1, 2]), "logprobs": np.zeros(2, dtype=np.float32)},
                )
            ],
            "importance_sampling",
            {},
            False,
        ),
        400,
        "datum 0: loss_fn_inputs has no 'advantages', which importance_sampling needs",
    ),
    (
        "unknown config key",
        lambda s, a: s.forward_backward(a, [datum(3, 1, "ppo")], "ppo", {"clip": 0.1}, False),
        400,
        "loss_fn_config key 'clip' is not a parameter of ppo",
    ),
    (
        "rank above the engine's maximum",
        lambda s, a: s.create_model("alice", a.session_id, 7, "tiny-dense", 64, 0),
        400,
        "LoRA rank 64 is outside [1, 8] (the engine's maximum rank is 8)",
    ),
    (
        "another base",
        lambda s, a: s.create_model("alice", a.session_id, 7, "Qwen/Qwen3-8B", 4, 0),
        400,
        "base_model 'Qwen/Qwen3-8B' is not served here; this server's base is 'tiny-dense'",
    ),
    (
        "another key's session",
        lambda s, a: s.create_model("bob", a.session_id, 7, "tiny-dense", 4, 0),
        404,
        "no session",
    ),
    (
        "unknown checkpoint",
        lambda s, a: s.checkpoint("alice", "tinker://x/weights/y"),
        404,
        "no checkpoint at 'tinker://x/weights/y'",
    ),
]


@pytest.mark.parametrize(("case", "call", "status", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_clear_error_and_changes_nothing(
    svc: TinkerService, case: str, call: Any, status: int, message: str
) -> None:
    a = new_model(svc, seed=1)
    banks = svc.engine.lora.banks
    slots_before = svc.engine.working_set.slot_table()
    weights_before = {s: banks[s].B.data.clone() for s in a.sites}
    batches_before = list(svc.batches)
    with pytest.raises(TinkerError) as e:
        call(svc, a)
    assert e.value.status == status
    assert message in e.value.message
    assert list(svc.models) == [a.id]
    assert not a.queue and svc.batches == batches_before
    assert svc.engine.working_set.slot_table() == slots_before
    assert all(banks[s].A.grad is None for s in a.sites)
    for s in a.sites:
        assert torch.equal(banks[s].B.data, weights_before[s])


def test_api_keys_from_a_list_and_a_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# keys\ntml-file-key-123456 carol\n\n")
    assert read_keys("tml-listed-key-1234", f) == {
        "tml-listed-key-1234": read_keys("tml-listed-key-1234", None)["tml-listed-key-1234"],
        "tml-file-key-123456": "carol",
    }
    with pytest.raises(ValueError, match="must start with 'tml-'"):
        read_keys("secret-123456789", None)


def test_the_wire_format_round_trips_with_the_sdks_own_encoders_and_decoders() -> None:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints([3, 4, 5]),
                    loss_fn_inputs={
                        "target_tokens": [4, 5, 6],
                        "advantages": [0.5, -1.0, 2.0],
                        "logprobs": [-1.0, -2.0, -3.0],
                    },
                )
            ],
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": 0.9},
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    fb = read_forward_backward(msg.SerializeToString())
    assert (fb.model_id, fb.seq_id, fb.loss_fn, fb.forward_only) == ("s:train:0", 3, "ppo", True)
    assert fb.config == {"clip_low_threshold": 0.9}
    assert fb.data[0].tokens.tolist() == [3, 4, 5]
    assert fb.data[0].inputs["target_tokens"].tolist() == [4, 5, 6]
    np.testing.assert_allclose(fb.data[0].inputs["advantages"], [0.5, -1.0, 2.0])
    losses.check(fb.loss_fn, fb.config, [fb.data[0].tokens], [fb.data[0].inputs], VOCAB)

    out = deserialize_forward_backward_output(
        write_forward_backward_output(
            [{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-3.0])}], {"loss:sum": 6.0}
        )
    )
    assert out.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]

    sample = deserialize_sample_response(
        write_sample_response(
            [Sampled([7, 8], [-0.5, -0.25], True), Sampled([9], [-1.0], False)], [None, -2.0]
        )
    )
    assert [s.tokens for s in sample.sequences] == [[7, 8], [9]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[0].logprobs == [-0.5, -0.25]
    assert sample.prompt_logprobs is not None and sample.prompt_logprobs[1] == -2.0


def test_round_size_history_stays_bounded() -> None:
    """A long-running server keeps only the newest round sizes, never an ever-growing list."""
    from mint_core.tinker.records import HISTORY, record

    history: list[int] = []
    for i in range(HISTORY + 1):
        record(history, i)
    assert len(history) == HISTORY // 2 + 1 and history[-1] == HISTORY and history[0] == HISTORY // 2


def test_a_session_closed_while_its_call_runs_fails_its_other_calls_cleanly_and_the_worker_goes_on(
    svc: TinkerService,
) -> None:
    """The call running when its session closes ends as it would have (its future is settled once, no
    InvalidStateError); the calls queued behind it fail with 410; a new call on the model is refused with a clear
    error; another session's model keeps training on the same worker."""
    a = new_model(svc, seed=1)
    b = new_model(svc, seed=2)
    running, release = threading.Event(), threading.Event()

    def slow() -> str:
        running.set()
        assert release.wait(30)
        return "done"

    first = svc.call(a, slow)
    queued = svc.forward_backward(a, [datum(5, 1)], "cross_entropy", {}, False)
    assert running.wait(30)
    svc.finish_session("alice", a.session_id)
    with pytest.raises(TinkerError, match="closed with its session"):
        queued.result(30)
    release.set()
    assert first.result(30) == "done"
    with pytest.raises(TinkerError, match=f"model {a.id} was closed with its session") as e:
        svc.model("alice", a.id)
    assert e.value.status == 410
    with pytest.raises(TinkerError, match="closed with its session"):
        svc.call(a, lambda: None)
    loss, _ = loss_of(svc.forward_backward(b, [datum(5, 2)], "cross_entropy", {}, False).result(30))
    assert loss > 0 and svc._thread is not None and svc._thread.is_alive()


def test_delete_and_retention_free_a_runs_old_checkpoints_for_gc(tmp_path: Path) -> None:
    """A run keeps its newest `keep_sampler_saves` named sampler saves; an older one, and any checkpoint its client
    deletes, leaves the engine, the store's refs, the run's record and the checkpoint index, so the store's gc
    frees its bytes while it keeps every live checkpoint's. The run's record answers get_training_run."""
    service = make_service(tmp_path)
    service.keep_sampler_saves = 2
    try:
        a = new_model(service, seed=1)
        paths = []
        for i in range(4):
            service.forward_backward(a, [datum(6, i)], "cross_entropy", {}, False).result(30)
            step(service, a)
            paths.append(service.call(a, lambda i=i: service.save_for_sampler(a, f"s{i}")).result(30)["path"])
        state = service.call(a, lambda: service.save_weights(a, "state")).result(30)["path"]
        for old in paths[:2]:
            with pytest.raises(TinkerError, match="no checkpoint"):
                service.checkpoint("alice", old)
            assert service.engine.working_set.get(old) is None
        live = {p: service.checkpoint("alice", p).digest for p in [*paths[2:], state]}
        assert set(service.store.refs()) == set(live)
        run = service.training_run("alice", a.id)
        assert run["last_sampler_checkpoint"]["tinker_path"] == paths[3]
        assert run["last_checkpoint"]["checkpoint_id"] == "weights/state"
        assert run["lora_rank"] == 4 and run["model_owner"] == "alice"
        types.TrainingRun.model_validate(run)  # the SDK's own shape
        with pytest.raises(TinkerError, match="no training run"):
            service.training_run("bob", a.id)

        service.delete_checkpoint("alice", paths[2])
        with pytest.raises(TinkerError, match="no checkpoint"):
            service.delete_checkpoint("alice", paths[2])  # gone: a second delete is a 404
        with pytest.raises(TinkerError, match="no checkpoint"):
            service.delete_checkpoint("bob", paths[3])  # another key's: refused, and kept
        service.store.gc(set())
        assert set(service.store.list()) == {live[paths[3]], live[state]}
        service.call(a, lambda: service.load_weights(a, state, True)).result(30)  # still loads after gc
        assert service.training_run("alice", a.id)["last_sampler_checkpoint"]["tinker_path"] == paths[3]
    finally:
        service.close()


def snapshot(svc: TinkerService, m: TrainModel, seed: int) -> tuple[str, str]:
    """One RL step's save: train a little, then an unnamed snapshot; its sampling session id and path."""
    svc.forward_backward(m, [datum(6, seed)], "cross_entropy", {}, False).result(30)
    step(svc, m)
    sid = svc.call(m, lambda: svc.save_for_sampler(m, None)).result(30)["sampling_session_id"]
    path = svc.sampler(m.owner, sid).model_path
    assert path is not None
    return sid, path


def metadata_files(svc: TinkerService) -> int:
    return len(list((svc.state_dir / "checkpoints").glob("*.json")))


def test_a_run_keeps_its_newest_unnamed_snapshots_and_releases_older_ones_completely(tmp_path: Path) -> None:
    """Snapshot by snapshot: each run keeps its newest `keep_snapshots`; an older one leaves the engine, the
    checkpoint index and the store's refs (gc then frees its bytes), and its sampling session answers 410 naming
    it. Another run's snapshots are its own business."""
    svc = make_service(tmp_path, keep_snapshots=2)
    try:
        a, b = new_model(svc, seed=1), new_model(svc, seed=2)
        _, b_path = snapshot(svc, b, 0)
        taken: list[tuple[str, str]] = []
        for i in range(4):
            taken.append(snapshot(svc, a, i))
            live = [p for _, p in taken[-2:]]
            ws = svc.engine.working_set
            assert [p for _, p in taken if ws.get(p) is not None] == live, i
            assert set(svc.store.refs()) == {*live, b_path}, i
            assert metadata_files(svc) == len(live) + 1, i
            assert list(a.live_snapshots) == live and list(b.live_snapshots) == [b_path]
            assert svc.counts()["snapshots"] == len(live) + 1
        for sid, path in taken[:2]:
            with pytest.raises(TinkerError, match=f"{sid} sampled {path}, which was released") as e:
                svc.sampler("alice", sid)
            assert e.value.status == 410 and "tinker_keep_snapshots" in e.value.message
            with pytest.raises(TinkerError, match="no checkpoint"):
                svc.checkpoint("alice", path)
        with pytest.raises(TinkerError, match="no sampling session"):
            svc.sampler("bob", taken[0][0])  # another key's: not even its fate is told
        for sid, path in taken[2:]:
            assert svc.sampler("alice", sid).adapter == path
        assert len(svc.samplers) == 3
        live_digests = {svc.checkpoint("alice", p).digest for p in [taken[2][1], taken[3][1], b_path]}
        svc.store.gc(set())
        assert set(svc.store.list()) == live_digests
        svc.engine.logits(torch.tensor([[5, 6, 7]]), [taken[3][1]])  # the newest still serves after gc
    finally:
        svc.close()


def test_a_closed_session_releases_its_snapshots_now_and_is_forgotten_after_the_ttl(tmp_path: Path) -> None:
    """Finishing a session releases its models' snapshots at once (their samplers answer 410 saying why); the
    session itself answers 410 until `result_ttl_s` after it ended, then it and its sampling sessions are gone
    (404). An expired session (no heartbeat for `session_ttl_s`) goes the same way."""
    svc = make_service(tmp_path, result_ttl_s=60)
    try:
        a = new_model(svc, seed=1)
        sid, path = snapshot(svc, a, 0)
        base_sampler = svc.create_sampler("alice", a.session_id, None, "tiny-dense")
        svc.finish_session("alice", a.session_id)
        assert svc.engine.working_set.get(path) is None and metadata_files(svc) == 0 and not svc.store.refs()
        with pytest.raises(TinkerError, match=f"sampled {path}, which was released when its training model"):
            svc.sampler("alice", sid)
        assert svc.sampler("alice", base_sampler).adapter is None
        with pytest.raises(TinkerError, match="has finished"):
            svc.session("alice", a.session_id)
        svc.sweep(time.monotonic() + 61)
        with pytest.raises(TinkerError, match="no session") as e:
            svc.session("alice", a.session_id)
        assert e.value.status == 404
        with pytest.raises(TinkerError, match="no sampling session"):
            svc.sampler("alice", base_sampler)
        b = new_model(svc, seed=2)
        _, b_path = snapshot(svc, b, 1)
        svc.sweep(
            time.monotonic() + svc.session_ttl_s + 1
        )  # no heartbeat since: expired, its snapshot released
        assert svc.engine.working_set.get(b_path) is None and metadata_files(svc) == 0
        svc.sweep(time.monotonic() + svc.session_ttl_s + 62)
        assert svc.counts() == {
            "sessions": 0,
            "training_models": 0,
            "sampling_sessions": 0,
            "snapshots": 0,
            "futures": 0,
        }
        assert list(svc.engine.working_set.names()) == []
    finally:
        svc.close()


def test_a_result_stays_retrievable_for_the_ttl_after_it_finished_retrieved_or_not() -> None:
    from concurrent.futures import Future

    futures = Futures(keep_s=10)
    done: Future[Any] = Future()
    done.set_result(1)
    pending: Future[Any] = Future()
    retrieved: Future[Any] = Future()
    retrieved.set_result(2)
    ids = [futures.track("alice", f) for f in (done, pending, retrieved)]
    t0 = time.monotonic()
    assert futures.get("alice", ids[2]).result() == 2
    futures.sweep(t0)
    futures.sweep(t0 + 9)
    assert len(futures) == 3
    futures.sweep(t0 + 11)
    assert len(futures) == 1  # only the call still running
    with pytest.raises(TinkerError, match="finished more than 10 s ago"):
        futures.get("alice", ids[0])
    pending.set_result(3)
    futures.sweep(t0 + 100)
    assert futures.get("alice", ids[1]).result() == 3
    futures.sweep(t0 + 111)
    assert len(futures) == 0


def test_a_deleted_checkpoints_sampling_sessions_answer_410(svc: TinkerService) -> None:
    a = new_model(svc, seed=1)
    path = svc.call(a, lambda: svc.save_for_sampler(a, "v1")).result(30)["path"]
    sid = svc.create_sampler("alice", a.session_id, path, None)
    svc.delete_checkpoint("alice", path)
    with pytest.raises(TinkerError, match=f"sampled {path}, which was deleted") as e:
        svc.sampler("alice", sid)
    assert e.value.status == 410 and not svc.samplers


def test_a_restart_releases_the_unnamed_snapshots_a_previous_process_left(tmp_path: Path) -> None:
    """Their models and sampling sessions died with the process: a new one frees their index entries and refs at
    start, written before snapshots were marked too (told by name and by being in no run's record); named saves,
    even one called snapshot-N, stay."""
    import json

    svc = make_service(tmp_path)
    try:
        a = new_model(svc, seed=1)
        _, old = snapshot(svc, a, 0)
        _, legacy = snapshot(svc, a, 1)
        named = svc.call(a, lambda: svc.save_for_sampler(a, "snapshot-9")).result(30)["path"]
    finally:
        svc.close()
    meta = svc._meta_file(legacy)
    record = json.loads(meta.read_text())
    del record["ephemeral"]
    meta.write_text(json.dumps(record))
    assert metadata_files(svc) == 3
    again = make_service(tmp_path)
    try:
        assert metadata_files(again) == 1 and set(again.store.refs()) == {named}
        with pytest.raises(TinkerError, match="no checkpoint"):
            again.checkpoint("alice", old)
        assert again.checkpoint("alice", named).kind == "sampler_weights"
    finally:
        again.close()
