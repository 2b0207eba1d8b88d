"""The multi-policy trainer under DeepSpeed on the CPU: DeepSpeed's CPU accelerator, gloo, a world of one.

The configs are the ones in infra/deepspeed/ (ZeRO-2, and ZeRO-3 sharding the frozen base); precision follows
the float32 tiny base. The plain trainer on an identical engine is the reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import deepspeed
import pytest
import torch
import torch.distributed as dist

from mint_core.data.generators import split
from mint_core.rl.distributed import DeepSpeedTrainer, PolicyAdamW, init_distributed, load_config
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import MultiPolicyTrainer

CONFIGS = Path(__file__).resolve().parents[2] / "infra" / "deepspeed"
CFG = GRPOConfig(group_size=4, max_new_tokens=6, learning_rate=1e-2, kl_coef=0.05)


@pytest.fixture(scope="module", autouse=True)
def _world() -> Iterator[None]:
    """One process group for the module (a process can form only one); the environment is restored after."""
    saved = dict(os.environ)
    os.environ["DS_ACCELERATOR"] = "cpu"
    if not dist.is_initialized():
        init_distributed("gloo")
    yield
    os.environ.clear()
    os.environ.update(saved)


def specs() -> list[PolicySpec]:
    return [
        PolicySpec(name="adder", task="add", rank=4, alpha=8),
        PolicySpec(name="rev", task="reverse", rank=8, alpha=8, learning_rate=5e-3),
    ]


def pair(make_engine, stage: str) -> tuple[MultiPolicyTrainer, DeepSpeedTrainer]:  # type: ignore[no-untyped-def]
    """The plain trainer and the DeepSpeed one, each on its own copy of the same engine and adapters."""
    plain = MultiPolicyTrainer(
        make_engine("dense", seed=0, max_loras=4, max_lora_rank=8), CFG, specs(), seed=0
    )
    config = json.loads((CONFIGS / f"{stage}.json").read_text())
    if stage == "zero3":  # the tiny base's weights are all below the persistence threshold: shard them anyway
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds = DeepSpeedTrainer(make_engine("dense", seed=0, max_loras=4, max_lora_rank=8), CFG, specs(), config)
    return plain, ds


def rows_of(trainer: MultiPolicyTrainer, policy: str, rewards: list[float], group: int) -> list[RolloutRow]:
    """One prompt, G hand-made completions of different lengths (so the token-mean loss is not zero)."""
    ex = split(trainer.policies[policy].spec.task, 1, 1, 0)[0][0]
    prompt = trainer.engine._encode(ex.prompt)
    out = []
    for g, r in enumerate(rewards):
        comp = [ord(c) % 250 for c in f"{g}{r}" + "xy" * g]
        out.append(RolloutRow(policy, group, ex, prompt, comp, [0.0] * len(comp), "", r, "length"))
    return out


def snapshot(trainer: MultiPolicyTrainer, name: str) -> dict[str, torch.Tensor]:
    return {
        f"{s}/{ab}": t.clone()
        for s, (A, B) in trainer.weights(name).tensors.items()
        for ab, t in (("A", A), ("B", B))
    }


def base_weights(trainer: MultiPolicyTrainer) -> dict[str, torch.Tensor]:
    """The base's own weights, gathered whole where ZeRO-3 has partitioned them."""
    model = trainer.engine.base.model
    named = [(k, p) for k, p in model.named_parameters() if ".bank." not in k]
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {k: p.detach().clone() for k, p in named}


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_update_matches_the_plain_trainer_and_moves_only_adapters(make_engine, stage):
    plain, ds = pair(make_engine, stage)
    base_before = base_weights(plain)
    base_params = list(ds.engine.base.model.parameters())
    if stage == "zero3":  # the frozen base is partitioned: outside a forward no rank holds a whole weight
        assert all(p.numel() == 0 and p.ds_numel > 0 for p in base_params)
    before = {n: snapshot(ds, n) for n in ("adder", "rev")}
    for i, (ra, rr) in enumerate(
        [([1.0, 0.0, 0.5, 1.0], [1.0, 0.0, 1.0, 0.5]), ([0.0, 1.0, 1.0, 0.0], [0.0, 0.5, 1.0, 1.0])]
    ):
        rows = rows_of(plain, "adder", ra, 2 * i) + rows_of(plain, "rev", rr, 2 * i + 1)
        shapes: list[tuple[int, ...]] = []
        hook = ds.engine.base.model.register_forward_hook(
            lambda _m, _a, out, seen=shapes: seen.append(out.logits.shape)
        )
        want, got = plain.update(rows), ds.update(rows)
        hook.remove()
        # logits only where a completion token is predicted: [K, V], K the completion tokens of the rows
        assert shapes[-1] == (
            sum(len(r.completion_ids) for r in rows),
            ds.engine.base.model.config.vocab_size,
        )
        assert want.loss.keys() == got.loss.keys() == {"adder", "rev"}
        for name in want.loss:  # the second update's loss depends on the first update's weights
            assert got.loss[name] == pytest.approx(want.loss[name], abs=1e-6), (i, name)
    for name in ("adder", "rev"):
        after = snapshot(ds, name)
        assert any(not torch.equal(before[name][k], after[k]) for k in after), f"{name} did not change"
    # the engine's slots (what rollouts read) hold the new weights, and serve like the plain trainer's
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    for name in ("adder", "rev"):
        assert torch.allclose(
            ds.engine.logits(ids, [name] * 2), plain.engine.logits(ids, [name] * 2), atol=1e-4
        )
    if stage == "zero3":  # gathered layer by layer in each forward, released after
        assert all(p.numel() == 0 for p in base_params)
    for k, v in base_weights(ds).items():
        assert torch.equal(v, base_before[k]), f"base weight {k} changed"
    stats = ds.step({"adder": split("add", 2, 1, 0)[0], "rev": split("reverse", 2, 1, 0)[0]})
    assert stats.step == 3


def optimizer_state(ds: DeepSpeedTrainer, name: str) -> list[torch.Tensor]:
    """The policy's Adam moments on this rank (under ZeRO-2: its group's flat partition)."""
    group = next(g for g in ds.optimizer.param_groups if g["policy"] == name)
    return [ds.optimizer.state[p][k].clone() for p in group["params"] for k in ("exp_avg", "exp_avg_sq")]


def test_a_policy_without_rows_is_left_alone(make_engine):
    _, ds = pair(make_engine, "zero2")
    ds.update(rows_of(ds, "adder", [1.0, 0.0, 0.5, 1.0], 0) + rows_of(ds, "rev", [1.0, 0.0, 1.0, 0.5], 1))
    rev_w, adder_w = snapshot(ds, "rev"), snapshot(ds, "adder")
    rev_state = optimizer_state(ds, "rev")
    assert rev_state and ds.policies["rev"].optimizer_steps == 1
    # rev's group has no variance: no kept token, so no loss, no gradient and no optimizer step for rev
    stats = ds.update(rows_of(ds, "adder", [0.0, 1.0, 1.0, 0.0], 2) + rows_of(ds, "rev", [0.5] * 4, 3))
    assert set(stats.loss) == {"adder"}
    assert any(not torch.equal(adder_w[k], v) for k, v in snapshot(ds, "adder").items())
    assert all(torch.equal(rev_w[k], v) for k, v in snapshot(ds, "rev").items())
    # and an update with no rev rows at all
    ds.update(rows_of(ds, "adder", [1.0, 0.0, 0.0, 1.0], 4))
    assert all(torch.equal(rev_w[k], v) for k, v in snapshot(ds, "rev").items())
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(ds, "rev"), rev_state, strict=True))
    assert ds.policies["rev"].optimizer_steps == 1 and ds.policies["adder"].optimizer_steps == 3


def test_state_resumes_where_it_stopped(make_engine, tmp_path):
    _, a = pair(make_engine, "zero2")
    first = rows_of(a, "adder", [1.0, 0.0, 0.5, 1.0], 0) + rows_of(a, "rev", [1.0, 0.0, 1.0, 0.5], 1)
    second = rows_of(a, "adder", [0.0, 1.0, 1.0, 0.0], 2) + rows_of(a, "rev", [0.0, 0.5, 1.0, 1.0], 3)
    a.update(first)
    a.save_state(tmp_path / "ckpt")
    a.update(second)
    _, b = pair(make_engine, "zero2")
    b.load_state(tmp_path / "ckpt")
    assert b.steps == 1 and b.policies["adder"].optimizer_steps == 1
    b.update(second)
    for name in ("adder", "rev"):
        wa, wb = snapshot(a, name), snapshot(b, name)
        assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa), name


@pytest.mark.parametrize(
    ("case", "change", "expected"),
    [
        ("own optimizer", {"optimizer": {"type": "AdamW"}}, "'optimizer' section"),
        ("global clipping", {"gradient_clipping": 1.0}, "per-policy clipping is GRPOConfig.max_grad_norm"),
        ("accumulation", {"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
        ("fp16", {"fp16": {"enabled": True}}, "fp16"),
        ("bf16 on a float32 base", {"bf16": {"enabled": True}}, "precision follows the base"),
    ],
)
def test_configs_that_would_couple_policies_are_refused(case, change, expected):
    with pytest.raises(ValueError, match=expected):
        load_config({"zero_optimization": {"stage": 2}, **change}, torch.float32)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_shipped_configs_load(stage):
    cfg = load_config(CONFIGS / f"{stage}.json", torch.bfloat16)
    assert cfg["zero_optimization"]["stage"] == int(stage[-1])
    assert cfg["bf16"] == {"enabled": True}


def test_each_policy_is_clipped_to_its_own_norm_and_steps_alone():
    """PolicyAdamW against torch AdamW fed by hand-clipped gradients: one policy's large gradient neither
    shrinks the other's step nor moves it when it is not active."""

    def run(grads_p: list[float], active: list[set[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
        opt = PolicyAdamW(
            [{"params": [p], "lr": 0.1, "policy": "p"}, {"params": [q], "lr": 0.2, "policy": "q"}],
            lr=0.1,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            max_grad_norm=1.0,
        )
        for scale, names in zip(grads_p, active, strict=True):
            p.grad = torch.full((4,), scale)
            q.grad = torch.tensor([0.3, -0.1, 0.2])
            opt.active = names
            opt.step()
        return p.detach(), q.detach()

    def reference(grads: list[torch.Tensor], lr: float) -> torch.Tensor:
        w = torch.nn.Parameter(torch.ones(grads[0].numel()))
        opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        for g in grads:
            w.grad = g * min(1.0, 1.0 / (float(g.norm()) + 1e-6))
            opt.step()
        return w.detach()

    both = [{"p", "q"}] * 2
    p, q = run([5.0, 0.1], both)  # p's first gradient has norm 10: clipped; its second (0.2) is not
    assert torch.allclose(p, reference([torch.full((4,), 5.0), torch.full((4,), 0.1)], 0.1), atol=1e-7)
    assert torch.allclose(q, reference([torch.tensor([0.3, -0.1, 0.2])] * 2, 0.2), atol=1e-7)
    assert torch.equal(run([500.0, 0.1], both)[1], q)  # q's steps do not depend on p's gradient
    p_alone, q_idle = run([5.0, 0.1], [{"p"}, {"p"}])
    assert torch.equal(p_alone, p) and torch.equal(q_idle, torch.ones(3))
