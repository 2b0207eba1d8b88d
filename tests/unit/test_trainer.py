"""The multi-policy GRPO trainer: updates land in each policy's own slot, the base never moves, state resumes."""

from __future__ import annotations

import pytest
import torch

from mint_core.data.generators import split
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import MultiPolicyTrainer
from tests.conftest import DEVICES, FAMILIES

CFG = GRPOConfig(group_size=4, max_new_tokens=6, learning_rate=1e-2)


def make_trainer(make_engine, family="dense", device="cpu", **cfg):  # type: ignore[no-untyped-def]
    engine = make_engine(family, seed=0, device=device, max_loras=4, max_lora_rank=8)
    specs = [
        PolicySpec(name="adder", task="add", rank=4, alpha=8),
        PolicySpec(name="rev", task="reverse", rank=8, alpha=8, learning_rate=5e-3),
    ]
    return MultiPolicyTrainer(engine, CFG.model_copy(update=cfg), specs, seed=0)


def snapshot(trainer: MultiPolicyTrainer, name: str) -> dict[str, torch.Tensor]:
    return {
        f"{s}/{ab}": t.clone()
        for s, (A, B) in trainer.weights(name).tensors.items()
        for ab, t in (("A", A), ("B", B))
    }


def rows_for(trainer, policy: str, rewards: list[float], group: int, pad: int = 0) -> list[RolloutRow]:  # type: ignore[no-untyped-def]
    """Hand-made rollout rows: one prompt, G completions with the given rewards (`pad` more tokens each)."""
    ex = split(trainer.policies[policy].spec.task, 1, 1, 0)[0][0]
    prompt = trainer.engine._encode(ex.prompt)
    out = []
    for g, r in enumerate(rewards):
        comp = [ord(c) % 250 for c in f"{g}{r}x" + "yz" * pad]
        out.append(RolloutRow(policy, group, ex, prompt, comp, [0.0] * len(comp), "", r, "length"))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_step_changes_the_adapter_and_never_the_base(make_engine, device):
    trainer = make_trainer(make_engine, device=device)
    assert trainer.engine.base.device.type == device
    base_before = {
        k: v.clone() for k, v in trainer.engine.base.model.state_dict().items() if ".bank." not in k
    }
    before = snapshot(trainer, "adder")
    prompts = {"adder": split("add", 2, 1, 0)[0], "rev": split("reverse", 2, 1, 0)[0]}
    stats = trainer.step(prompts)
    # rewards of a random base are mostly zero, so plant variance by hand if a rollout had none
    if stats.kept_groups.get("adder", 0) == 0:
        trainer.update(rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], 0))
    after = snapshot(trainer, "adder")
    assert any(not torch.equal(before[k], after[k]) for k in before), "the adapter did not change"
    base_after = {k: v for k, v in trainer.engine.base.model.state_dict().items() if ".bank." not in k}
    for k, v in base_before.items():
        assert torch.equal(base_after[k], v), f"base weight {k} changed"


def moments(trainer: MultiPolicyTrainer, name: str) -> list[torch.Tensor]:
    return [t.clone() for s in trainer.policies[name].sites for t in trainer.adamw.moments(name, s)]


def test_updating_one_policy_in_a_mixed_batch_leaves_the_other_untouched(make_engine):
    """AdamW moves a policy's slot only when that policy had gradient: with weight decay and momentum on, a
    policy without a kept token keeps its weights, moments and step count bit for bit; the base never moves."""
    trainer = make_trainer(make_engine, weight_decay=0.5)
    base_before = {
        k: v.clone() for k, v in trainer.engine.base.model.state_dict().items() if ".bank." not in k
    }
    trainer.update(rows_for(trainer, "rev", [1.0, 0.0, 1.0, 0.0], 0))  # give rev some Adam state first
    rev_w, rev_m = snapshot(trainer, "rev"), moments(trainer, "rev")
    assert trainer.policies["rev"].optimizer_steps == 1 and any(m.any() for m in rev_m)
    adder_w = snapshot(trainer, "adder")
    # one mixed batch: adder's group has variance, rev's group does not (dropped: no gradient for rev)
    trainer.update(
        rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], 1) + rows_for(trainer, "rev", [0.5] * 4, 2)
    )
    assert any(not torch.equal(adder_w[k], v) for k, v in snapshot(trainer, "adder").items())
    assert all(torch.equal(rev_w[k], v) for k, v in snapshot(trainer, "rev").items())
    assert all(torch.equal(a, b) for a, b in zip(moments(trainer, "rev"), rev_m, strict=True))
    assert trainer.policies["rev"].optimizer_steps == 1 and trainer.policies["adder"].optimizer_steps == 1
    base_after = {k: v for k, v in trainer.engine.base.model.state_dict().items() if ".bank." not in k}
    assert all(torch.equal(base_after[k], v) for k, v in base_before.items())


def test_slot_adamw_is_torch_adamw_per_policy(make_engine):
    """One update's AdamW on a slot equals torch's AdamW over that policy's PEFT-shaped factors (B's learning rate
    scaled by alpha/r, gradient clipped to the policy's own norm)."""
    trainer = make_trainer(make_engine, weight_decay=0.1, max_grad_norm=1e-3)  # a norm low enough to clip
    p = trainer.policies["adder"]
    banks = trainer.engine.lora.banks
    before = {s: (banks[s].A[p.slot].clone(), banks[s].B[p.slot].clone()) for s in p.sites}
    rows = rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], 0)
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    original = trainer.adamw.step

    def keep_grads(policies, lr_scale=1.0):  # type: ignore[no-untyped-def]
        for s in p.sites:
            grads[s] = (banks[s].A.grad[p.slot].clone(), banks[s].B.grad[p.slot].clone())
        return original(policies, lr_scale)

    trainer.adamw.step = keep_grads  # type: ignore[method-assign]
    trainer.update(rows)
    params = [t.clone() for s in p.sites for t in before[s]]
    for t, g in zip(params, [g for s in p.sites for g in grads[s]], strict=True):
        t.grad = g
    torch.nn.utils.clip_grad_norm_(params, 1e-3)
    lr = CFG.learning_rate
    ref = torch.optim.AdamW(
        [{"params": params[0::2], "lr": lr}, {"params": params[1::2], "lr": lr * p.scale}], weight_decay=0.1
    )
    ref.step()
    for i, s in enumerate(p.sites):
        assert torch.allclose(banks[s].A[p.slot], params[2 * i], atol=1e-7), s
        assert torch.allclose(banks[s].B[p.slot], params[2 * i + 1], atol=1e-7), s


def test_padded_rank_columns_stay_zero(make_engine):
    trainer = make_trainer(make_engine)
    for g in range(3):
        trainer.update(rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], g))
    p = trainer.policies["adder"]  # rank 4 in rank-8 slots
    for s in p.sites:
        bank = trainer.engine.lora.banks[s]
        assert not bank.A[p.slot][..., 4:, :].any() and not bank.B[p.slot][4:, :].any()


def test_state_resumes_where_it_stopped(make_engine, tmp_path):
    prompts = {"adder": split("add", 2, 1, 0)[0], "rev": split("reverse", 2, 1, 0)[0]}
    a = make_trainer(make_engine)
    a.update(rows_for(a, "adder", [1.0, 0.0, 0.0, 1.0], 0))
    a.save_state(tmp_path / "ckpt")
    a.update(rows_for(a, "adder", [0.0, 1.0, 1.0, 0.0], 1))
    a.step(prompts)
    b = make_trainer(make_engine)
    b.load_state(tmp_path / "ckpt")
    b.update(rows_for(b, "adder", [0.0, 1.0, 1.0, 0.0], 1))
    b.step(prompts)
    for name in ("adder", "rev"):
        wa, wb = snapshot(a, name), snapshot(b, name)
        assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa), name
    assert a.policies["adder"].optimizer_steps == b.policies["adder"].optimizer_steps == 2
    assert all(torch.equal(x, y) for x, y in zip(moments(a, "adder"), moments(b, "adder"), strict=True))


def test_a_state_of_other_policies_is_refused_before_anything_changes(make_engine, tmp_path):
    a = make_trainer(make_engine)
    a.update(rows_for(a, "adder", [1.0, 0.0, 0.0, 1.0], 0))
    a.save_state(tmp_path / "ckpt")
    engine = make_engine("dense", seed=0, max_loras=4, max_lora_rank=8)
    specs = [
        PolicySpec(name="adder", task="add", rank=8, alpha=8),  # rank 4 and alpha 8 when saved
        PolicySpec(name="rev", task="reverse", rank=8, alpha=8, targets=["q_proj"]),
    ]
    b = MultiPolicyTrainer(engine, CFG, specs, seed=0)
    before = {name: snapshot(b, name) for name in ("adder", "rev")}
    with pytest.raises(
        ValueError, match=r"adder: rank 4 saved, 8 now.*rev: targets .* saved, \['q_proj'\] now"
    ):
        b.load_state(tmp_path / "ckpt")
    for name, was in before.items():
        assert all(torch.equal(was[k], v) for k, v in snapshot(b, name).items()), name
    assert b.steps == 0
    c = MultiPolicyTrainer(make_engine("dense", seed=0, max_loras=4, max_lora_rank=8), CFG, specs[:1], seed=0)
    with pytest.raises(ValueError, match=r"policies \['adder', 'rev'\], this trainer \['adder'\]"):
        c.load_state(tmp_path / "ckpt")


def test_exported_revision_serves_like_the_slot(make_engine, tmp_path):
    trainer = make_trainer(make_engine)
    trainer.update(rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], 0))
    trainer.update(rows_for(trainer, "adder", [1.0, 0.0, 1.0, 0.0], 1))
    trainer.export("adder", tmp_path / "adder-v1")
    serving = make_engine("dense", seed=0)
    serving.load_adapter("adder", tmp_path / "adder-v1")  # handoff by adapter files only
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(serving.logits(ids, ["adder"]), trainer.engine.logits(ids, ["adder"]), atol=1e-5)
    # and in process: tensors straight into the serving engine's slots
    serving.add_adapter("adder-mem", trainer.weights("adder"))
    assert torch.allclose(
        serving.logits(ids, ["adder-mem"]), trainer.engine.logits(ids, ["adder"]), atol=1e-5
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prompt_logprobs_and_gradients_match_full_rows(make_engine, family):
    """The packed update (each group's prompt once, its rows' completions behind a block mask) gives the
    logprobs and gradients of a plain forward over the full rows."""
    trainer = make_trainer(make_engine, family)
    with (
        torch.no_grad()
    ):  # nonzero B so the adapters matter, within each policy's rank (beyond it stays zero)
        for bank in trainer.engine.lora.banks.values():
            for p in trainer.policies.values():
                rank = bank._rank[p.slot]
                if rank:
                    bank.B[p.slot, ..., :rank, :].normal_(0, 0.05)
    # rev's completions are much longer than adder's, so the two packed sequences run as two buckets
    rows = rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], 0) + rows_for(
        trainer, "rev", [1.0, 0.0, 1.0, 0.5], 1, pad=4
    )
    batch = trainer._batch(rows)
    forwards: list[int] = []
    hook = trainer.engine.base.model.register_forward_pre_hook(
        lambda _m, _args, kwargs: forwards.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    out_rows: list[int] = []  # positions the model's output covers, per forward
    head = trainer.engine.base.model.register_forward_hook(
        lambda _m, _args, out: out_rows.append(out.logits.shape[:-1].numel())
    )
    weight = torch.randn(batch.comp.shape, generator=torch.Generator().manual_seed(0)) * batch.comp
    banks = list(trainer.engine.lora.banks.values())
    got = {}
    for path in ("full", "shared"):
        for b in banks:
            b.A.requires_grad_(True)
            b.B.requires_grad_(True)
            b.A.grad = b.B.grad = None
        with torch.enable_grad():
            if path == "full":
                trainer.engine.lora.ctx.set_rows(batch.slots)
                logits = trainer.engine.base.model(input_ids=batch.ids, attention_mask=batch.attn).logits
                trainer.engine.lora.ctx.clear()
                # the plain formulation, as the oracle for the packed path and its selective log-softmax
                lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.ids[:, 1:, None]).squeeze(-1)
            else:
                lp = trainer._logprobs(batch, batch.slots)  # 2 distinct prompts for 8 rows: the shared path
            (lp * weight).sum().backward()
        grads = torch.cat([g.flatten() for b in banks for g in (b.A.grad, b.B.grad) if g is not None])
        got[path] = ((lp * batch.comp).detach(), grads)
    hook.remove()
    head.remove()
    assert forwards == [8, 1, 1]  # the full rows, then one packed sequence per bucket
    # the shared path's output covers only the positions that predict a completion token: each group's last
    # prompt position once, then every completion input (not the rest of the prompt, nor padding)
    lens = [len(r.completion_ids) for r in rows]
    assert out_rows[0] == batch.ids.numel()
    assert sum(out_rows[1:]) == 2 + sum(m - 1 for m in lens) < batch.ids.numel()
    assert torch.allclose(got["full"][0], got["shared"][0], atol=1e-5)
    assert torch.allclose(got["full"][1], got["shared"][1], atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_way_out_of_the_model_gives_the_same_logprobs_and_gradients(make_engine, family, monkeypatch):
    """The update's logprobs come out of the model one of three ways (`_output_mode`): the output projection
    fused with the log-softmax ("hidden", what the test families get), logits at the predicted positions only
    ("logits"), or every position's logits ("full", for a model whose forward has no logits_to_keep). All three
    give the same logprobs and gradients; a model that ignores a boolean logits_to_keep is noticed and moved to
    "full"."""
    got = {}
    for mode in ("hidden", "logits", "full", "ignored"):
        trainer = make_trainer(make_engine, family)
        trainer.fused_head_min_bytes = 0  # fuse even these small logits
        assert trainer._output_mode() == "hidden"
        with torch.no_grad():
            for bank in trainer.engine.lora.banks.values():
                bank.B[trainer.policies["adder"].slot].normal_(
                    0, 0.05, generator=torch.Generator().manual_seed(1)
                )
        rows = rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], 0)
        batch = trainer._batch(rows)
        model = trainer.engine.base.model
        if mode == "ignored":
            forward = model.forward

            def ignores_logits_to_keep(*a, logits_to_keep=0, _forward=forward, **k):  # type: ignore[no-untyped-def]
                return _forward(*a, **k)

            monkeypatch.setattr(model, "forward", ignores_logits_to_keep)
            trainer._output = "logits"
        elif mode != "hidden":
            trainer._output = mode  # type: ignore[assignment]
        banks = list(trainer.engine.lora.banks.values())
        for b in banks:
            b.A.requires_grad_(True)
            b.B.requires_grad_(True)
        head_calls: list[int] = []
        hook = model.get_output_embeddings().register_forward_hook(
            lambda *_, calls=head_calls: calls.append(1)
        )
        with torch.enable_grad():
            lp = trainer._logprobs(batch, batch.slots)
            (lp * batch.comp).sum().backward()
        hook.remove()
        assert (len(head_calls) == 0) == (mode == "hidden"), mode  # fused: the head module itself never runs
        grads = torch.cat([g.flatten() for b in banks for g in (b.A.grad, b.B.grad) if g is not None])
        got[mode] = ((lp * batch.comp).detach(), grads)
        if mode == "ignored":
            assert trainer._output == "full"
            monkeypatch.setattr(model, "forward", forward)
    for mode in ("logits", "full", "ignored"):
        assert torch.allclose(got[mode][0], got["hidden"][0], atol=1e-5), mode
        assert torch.allclose(got[mode][1], got["hidden"][1], atol=1e-5), mode
    assert got["hidden"][1].abs().sum() > 0


@pytest.mark.parametrize("micro_batch_rows", [1, 3, 5])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_update_like_one_batch(make_engine, micro_batch_rows, loss_agg):
    # adam_eps large enough that float-order noise in near-zero gradients is not amplified into the weights
    one = make_trainer(make_engine, loss_agg=loss_agg, adam_eps=1e-5, kl_coef=0.1)
    many = make_trainer(make_engine, loss_agg=loss_agg, adam_eps=1e-5, kl_coef=0.1)
    many.micro_batch_rows = micro_batch_rows
    for g in range(2):
        rows = [
            *rows_for(one, "adder", [1.0, 0.0, 0.0, 1.0], 2 * g),
            *rows_for(one, "rev", [0.0, 1.0, 0.5, 1.0], 2 * g + 1),
        ]
        a, b = one.update(rows), many.update(rows)
        assert a.loss.keys() == b.loss.keys() == {"adder", "rev"}
        for name in a.loss:
            assert b.loss[name] == pytest.approx(a.loss[name], abs=1e-6)
            assert b.extra[name] == pytest.approx(a.extra[name], rel=1e-5, abs=1e-6)
    for name in ("adder", "rev"):
        wa, wb = snapshot(one, name), snapshot(many, name)
        assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa), name


def test_an_empty_completion_in_a_group_is_no_target_and_no_error(make_engine):
    """A sample that generated nothing (e.g. aborted) contributes no token to the loss; its group still trains."""
    trainer = make_trainer(make_engine)
    rows = rows_for(trainer, "adder", [1.0, 0.0, 0.0, 1.0], 0)
    rows[2].completion_ids, rows[2].sampling_logprobs = [], []
    batch = trainer._batch(rows)
    assert batch.comp[2].sum() == 0 and batch.comp[0].sum() > 0
    lp = trainer._logprobs(batch, batch.slots)
    assert torch.isfinite(lp).all()
    before = snapshot(trainer, "adder")
    stats = trainer.update(rows)
    assert stats.kept_groups["adder"] == 1
    assert any(not torch.equal(before[k], v) for k, v in snapshot(trainer, "adder").items())


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"micro_batch_rows": 0}, "micro_batch_rows must be >= 1 or None, got 0"),
        ({"fused_head_min_bytes": -1}, "fused_head_min_bytes must be >= 0, got -1"),
    ],
)
def test_bad_trainer_arguments_are_named(make_engine, change, expected):
    engine = make_engine("dense", seed=0, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match=expected):
        MultiPolicyTrainer(engine, CFG, [PolicySpec(name="p", task="add")], **change)
