"""What a training step reports and draws: per-step learning metrics, the greedy completion in each group, and
each round's own prompts and seed (issue #16's "learning you can see" and "every round is new training")."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest

from mint_core.data.generators import Example, split, write_jsonl
from mint_core.engine.engine import Request
from mint_core.engine.sampling import SamplingParams
from mint_core.lifecycle.prompts import load_prompts, round_seed
from mint_core.rl.grpo import GRPOConfig, lr_factor
from mint_core.rl.optim import warmup_factor
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe import STEP_METRICS, TrainingRun
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import MultiPolicyTrainer

CFG = GRPOConfig(group_size=4, max_new_tokens=6, learning_rate=1e-2)


def _trainer(make_engine, **cfg) -> MultiPolicyTrainer:  # type: ignore[no-untyped-def]
    engine = make_engine("dense", seed=0, max_loras=2, max_lora_rank=4)
    specs = [PolicySpec(name="adder", task="add", rank=4, alpha=8)]
    return MultiPolicyTrainer(engine, CFG.model_copy(update=cfg), specs, seed=0)


def _rows(trainer: MultiPolicyTrainer, groups: list[list[float]]) -> list[RolloutRow]:
    """Hand-made rows: one prompt per group, completions of distinct tokens with the given rewards."""
    examples = split("add", len(groups), 1, 0)[0]
    out = []
    for g, (ex, rewards) in enumerate(zip(examples, groups, strict=True)):
        prompt = trainer.engine._encode(ex.prompt)
        for i, r in enumerate(rewards):
            comp = [ord(c) % 250 for c in f"{i}{g}ab"]
            out.append(RolloutRow("adder", g, ex, prompt, comp, [0.0] * len(comp), "", r, "length"))
    return out


def test_a_step_reports_spread_signal_kl_entropy_and_grad_norm(make_engine) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(make_engine)
    # two groups with signal, one without: a third of the groups teach nothing
    stats = trainer.update(_rows(trainer, [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    st = stats.extra["adder"]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    mean = sum(rewards) / len(rewards)
    assert st["reward_std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)))
    assert st["no_signal"] == pytest.approx(1 / 3)
    assert st["grad_norm"] > 0 and st["entropy"] > 0
    # the first update starts from B = 0: the policy is the base, so the KL to it is zero
    assert st["kl"] == pytest.approx(0.0, abs=1e-6)
    again = trainer.update(_rows(trainer, [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]))
    assert again.extra["adder"]["kl"] > 0, "after a step the policy differs from the base"


def test_the_kl_metric_reads_one_row_per_group_with_signal(make_engine) -> None:  # type: ignore[no-untyped-def]
    """With kl_coef 0 the KL is a metric: the base's logprobs of the first row of each group with signal only,
    and the metric is the mean k3 over that row's completion tokens; with kl_coef > 0 every row counts."""
    import torch

    from mint_core.rl.grpo import k3_kl

    trainer = _trainer(make_engine)
    trainer.update(_rows(trainer, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]))  # the policy leaves the base
    rows = _rows(trainer, [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    batch = trainer._batch(rows)
    with torch.no_grad():
        lp = trainer._logprobs(batch, batch.slots)
        ref = trainer._logprobs(batch, [-1] * len(rows))
    kl = k3_kl(lp, ref)
    mask = batch.comp.bool()

    def mean_over(idx: list[int]) -> float:
        return float(torch.cat([kl[i][mask[i]] for i in idx]).mean())

    assert trainer._reference(batch)[1] == [0, 8]  # group 1 has no signal
    got = trainer.update(rows).extra["adder"]["kl"]
    assert got == pytest.approx(mean_over([0, 8]), rel=1e-4) and got > 0
    assert got != pytest.approx(mean_over([0, 1, 2, 3, 8, 9, 10, 11]), rel=1e-3)

    penalised = _trainer(make_engine, kl_coef=0.1)
    penalised.update(_rows(penalised, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]))
    rows = _rows(penalised, [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    batch = penalised._batch(rows)
    ref_all, which = penalised._reference(batch)
    assert which is None and ref_all is not None and ref_all.shape[0] == len(rows)


def test_kl_is_measured_only_when_asked(make_engine) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(make_engine, track_kl=False)
    trainer.update(_rows(trainer, [[1.0, 0.0, 0.0, 1.0]]))
    stats = trainer.update(_rows(trainer, [[1.0, 0.0, 0.0, 1.0]]))
    assert stats.extra["adder"]["kl"] == 0.0


def test_the_curve_carries_every_step_metric(make_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(make_engine)
    prompts = {"adder": split("add", 4, 1, 0)[0]}
    run = TrainingRun.start(trainer, prompts, 2, 2, tmp_path / "ckpt", checkpoint_every=0)
    run.train()
    assert [row["step"] for row in run.history] == [1, 2]
    for row in run.history:
        assert set(STEP_METRICS) <= set(row) and row["time"] > 0
        assert row["reward_std"] is not None and row["no_signal"] is not None


def test_greedy_in_group_puts_the_greedy_answer_first(make_engine) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(make_engine, greedy_in_group=True, temperature=1.0)
    examples = split("add", 3, 1, 0)[0]
    rows = trainer.rollout({"adder": examples})
    greedy = trainer.engine.generate(
        [Request(ex.prompt, "adder", SamplingParams(max_tokens=CFG.max_new_tokens)) for ex in examples]
    )
    firsts = [rows[g * CFG.group_size] for g in range(len(examples))]
    assert [r.text for r in firsts] == [c.text for c in greedy]
    # the others are sampled: over three groups of a random base, some differ from the greedy answer
    assert any(r.text != firsts[r.group].text for r in rows if r not in firsts)


def test_each_round_draws_its_own_prompts_and_seed(tmp_path: Path) -> None:
    rows = [Example(id=f"add-{i}", task="add", prompt=f"add: {i}+1 =", answer=str(i + 1)) for i in range(50)]
    write_jsonl(tmp_path / "train" / "add.jsonl", rows)
    first, _ = load_prompts("add", 10, 0, tmp_path)
    assert first == rows[:10]  # no round: the first n, as before
    r1, src = load_prompts("add", 10, 0, tmp_path, "r1")
    assert load_prompts("add", 10, 0, tmp_path, "r1")[0] == r1, "the same round draws the same prompts"
    r2, _ = load_prompts("add", 10, 0, tmp_path, "r2")
    assert r1 != r2 and len({e.id for e in r1}) == 10 and "round=r1" in src
    assert round_seed(0, "r1") == round_seed(0, "r1") != round_seed(0, "r2") != round_seed(1, "r2")
    assert round_seed(7, None) == 7
    with pytest.raises(Exception, match="needs 60"):
        load_prompts("add", 60, 0, tmp_path, "r1")


def test_lr_factor_schedules() -> None:
    assert [lr_factor("none", s, 4) for s in range(4)] == [1.0] * 4
    assert [lr_factor("linear", s, 4) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    cos = [lr_factor("cosine", s, 4) for s in range(4)]
    assert (
        cos[0] == 1.0 and cos[2] == pytest.approx(0.5) and all(a > b > 0 for a, b in itertools.pairwise(cos))
    )
    with pytest.raises(ValueError, match="outside a run of 4 steps"):
        lr_factor("linear", 4, 4)


def test_a_decaying_run_steps_at_the_scheduled_rate(make_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(make_engine, lr_decay="linear")
    seen: list[float] = []
    step = trainer.adamw.step

    def recording(policies, lr_scale=1.0):  # type: ignore[no-untyped-def]
        seen.append(lr_scale)
        return step(policies, lr_scale)

    trainer.adamw.step = recording  # type: ignore[method-assign]
    run = TrainingRun.start(
        trainer, {"adder": split("add", 8, 1, 0)[0]}, 4, 2, tmp_path / "c", checkpoint_every=0
    )
    for _ in range(4):
        run.update(_rows(trainer, [[1.0, 0.0, 0.0, 1.0]]))
    assert seen == [1.0, 0.75, 0.5, 0.25]
    groups = trainer.adamw.optimizer.param_groups
    assert [g["lr"] for g in groups] == pytest.approx([lr * 0.25 for lr in trainer.adamw.base_lrs])


def test_a_continuation_warms_up_at_its_share_of_the_rate(make_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`rate_scale` and `warmup_steps` set each policy's own rate, step by step of its own AdamW steps, on top
    of the run's schedule; a policy without them keeps the run's rate."""
    engine = make_engine("dense", seed=0, max_loras=2, max_lora_rank=4)
    specs = [
        PolicySpec(name="adder", task="add", rank=4, alpha=8, rate_scale=0.25, warmup_steps=3),
        PolicySpec(name="plain", task="add", rank=4, alpha=8),
    ]
    trainer = MultiPolicyTrainer(engine, CFG, specs, seed=0)
    assert [warmup_factor(3, k) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    lr = CFG.learning_rate
    adder_A, plain_A = (trainer.adamw.base_lrs[i] for i in (0, 2))
    assert (adder_A, plain_A) == pytest.approx((0.25 * lr, lr))
    seen = []
    for _ in range(4):
        rows = _rows(trainer, [[1.0, 0.0, 0.0, 1.0]])
        rows += [dataclasses.replace(r, policy="plain", group=1) for r in rows]
        trainer.update(rows, lr_scale=0.5)
        seen += [g["lr"] for g in trainer.adamw.optimizer.param_groups[::2]]
    want = [[0.5 * adder_A * f, 0.5 * plain_A] for f in (0.25, 0.5, 0.75, 1.0)]
    assert seen == pytest.approx([x for pair in want for x in pair])


def test_each_policy_samples_its_own_group_size(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A policy's `group_size` overrides the run's for its prompts alone, in the same batched rollout, and the
    rollout check takes a batch whose groups have the run's sizes."""
    from mint_core.data.checks import CheckParams, RolloutBounds, check, rollout_frame

    engine = make_engine("dense", seed=0, max_loras=2, max_lora_rank=4)
    specs = [
        PolicySpec(name="wide", task="add", rank=4, alpha=8, group_size=6),
        PolicySpec(name="plain", task="add", rank=4, alpha=8),
    ]
    trainer = MultiPolicyTrainer(engine, CFG.model_copy(update={"group_size": 2}), specs, seed=0)
    examples = split("add", 3, 1, 0)[0]
    rows = trainer.rollout({"wide": examples, "plain": examples})
    sizes: dict[tuple[str, int], int] = {}
    for r in rows:
        sizes[(r.policy, r.group)] = sizes.get((r.policy, r.group), 0) + 1
    assert sorted(n for (p, _), n in sizes.items() if p == "wide") == [6, 6, 6]
    assert sorted(n for (p, _), n in sizes.items() if p == "plain") == [2, 2, 2]
    assert trainer.group_sizes() == [2, 6]
    bounds = RolloutBounds(group_size=trainer.group_sizes(), max_completion_len=CFG.max_new_tokens + 1)
    report = check(rollout_frame(rows), "rollouts", CheckParams(rollouts=bounds), source="test", quick=True)
    assert report.success, report
    one = RolloutBounds(group_size=2, max_completion_len=CFG.max_new_tokens + 1)  # the run's size alone
    failed = check(
        rollout_frame(rows),
        "rollouts",
        CheckParams(rollouts=one),
        source="t",
        quick=True,
        raise_on_failure=False,
    )
    assert not failed.success
    trainer.update(rows)  # groups of both sizes in one update


def test_mint_train_refuses_an_unknown_task_before_any_work(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mint_app.cli.app import app

    out = CliRunner().invoke(app, ["train", "--policies", "add,nope", "--out", str(tmp_path / "run")])
    assert out.exit_code == 2, out.output
    assert "unknown task 'nope'" in out.output and not (tmp_path / "run").exists()


@pytest.mark.parametrize("lr", ["-1", "0", "nan"])
def test_mint_train_refuses_a_learning_rate_at_or_below_zero(tmp_path: Path, lr: str) -> None:
    from typer.testing import CliRunner

    from mint_app.cli.app import app

    out = CliRunner().invoke(app, ["train", "--lr", lr, "--out", str(tmp_path / "run")])
    assert out.exit_code == 2, out.output
    assert "--lr" in out.output and "above 0" in out.output and not (tmp_path / "run").exists()
