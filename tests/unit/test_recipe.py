"""The one training recipe: a run stopped and resumed ends byte for byte where an uninterrupted run does, with
the whole curve; another run's checkpoint is refused, naming what differs, before anything changes."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from mint_core.data.generators import split
from mint_core.data.rewards import NoRewardSignal
from mint_core.engine.base import build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.rl.builder import (
    DRY_RUN_ROUNDS,
    Continuation,
    continue_spec,
    dry_run_rewards,
    load_trainer,
    spec_changes,
)
from mint_core.rl.checkpoints import checkpoints
from mint_core.rl.evaluate import Headroom, headroom
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.recipe import ResumeError, TrainingRun

GRPO = GRPOConfig(
    group_size=2, max_new_tokens=4, learning_rate=1e-2, weight_decay=0.5, drop_zero_variance=False
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = {"add": split("add", 8, 0, 0)[0], "sort": split("sort", 8, 0, 0)[0]}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("base")
    tiny = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    tiny.model.save_pretrained(where)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(where)
    return where


def start(base_dir: Path, ckpt: Path, steps: int = 4, rank: int = 4, **kw) -> TrainingRun:  # type: ignore[no-untyped-def]
    specs = [PolicySpec(name=t, task=t, rank=rank, alpha=8) for t in PROMPTS]
    trainer = load_trainer(base_dir, specs, GRPO, seed=3)
    return TrainingRun.start(trainer, PROMPTS, steps, 2, ckpt, checkpoint_every=1, **kw)


def revisions(run: TrainingRun, where: Path) -> dict[str, bytes]:
    out = {}
    for name in run.trainer.policies:
        run.trainer.export(name, where / name)
        out[name] = (where / name / "adapter_model.safetensors").read_bytes()
    return out


def test_stopped_and_resumed_ends_where_an_uninterrupted_run_does(base_dir: Path, tmp_path: Path) -> None:
    straight = start(base_dir, tmp_path / "straight")
    assert straight.train() and straight.trainer.steps == 4

    stopped = start(base_dir, tmp_path / "stopped")
    assert not stopped.train(stop=lambda: stopped.trainer.steps == 2)  # stop asked during step 2
    assert [p.name for p in checkpoints(tmp_path / "stopped")] == ["step-00001", "step-00002"]  # two deep

    # the flows' way: the same step as separate rollout and update calls
    resumed = start(base_dir, tmp_path / "stopped")
    assert (resumed.resumed_step, resumed.resumed_checkpoint) == (2, tmp_path / "stopped" / "step-00002")

    def rollout_then_update() -> None:
        resumed.update(resumed.rollout())

    assert resumed.train(rollout_then_update)
    assert revisions(resumed, tmp_path / "a") == revisions(straight, tmp_path / "b")
    assert [(h["step"], h["policy"]) for h in resumed.history] == [
        (s, t) for s in range(1, 5) for t in PROMPTS
    ]
    record = json.loads((tmp_path / "stopped" / "step-00004" / "run.json").read_text())
    assert record["history"] == resumed.history and record["args"]["policies"] == ["add", "sort"]


@pytest.mark.slow
def test_a_run_with_compiled_decode_trains_the_same_adapters(base_dir: Path, tmp_path: Path) -> None:
    """Two policies in one rollout (mixed adapter rows), three steps: the compiled decode step samples the tokens
    the eager forward samples, so the update, which is the same either way, exports the same bytes."""
    specs = [PolicySpec(name=t, task=t, rank=4, alpha=8) for t in PROMPTS]
    runs = []
    for compiled in (False, True):
        trainer = load_trainer(base_dir, specs, GRPO, seed=3, compile_decode=compiled)
        assert (trainer.engine.compiled_decode is not None) is compiled
        run = TrainingRun.start(trainer, PROMPTS, 3, 2, tmp_path / f"compiled-{compiled}", checkpoint_every=0)
        assert run.train()
        runs.append(revisions(run, tmp_path / f"out-{compiled}"))
    compiled_decode = trainer.engine.compiled_decode
    assert compiled_decode is not None and compiled_decode.compiles == 1
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("case", "change", "expected"),
    [
        (
            "another rank",
            {"rank": 2},
            r"add rank 4 then, 2 now.*add starts from sha256:\w+ then, sha256:\w+ now",
        ),
        ("fewer steps than done", {"steps": 1}, "at step 2 already, beyond this run's 1 steps"),
    ],
)
def test_another_runs_checkpoint_is_refused_naming_what_differs(
    base_dir: Path, tmp_path: Path, case: str, change: dict[str, int], expected: str
) -> None:
    first = start(base_dir, tmp_path)
    first.train(stop=lambda: first.trainer.steps == 2)
    with pytest.raises(ResumeError, match=expected):
        start(base_dir, tmp_path, **change)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00001", "step-00002"], case


def test_a_fresh_start_replaces_old_checkpoints_and_scores_heldout(base_dir: Path, tmp_path: Path) -> None:
    first = start(base_dir, tmp_path)
    first.train(stop=lambda: True)
    heldout = {t: split(t, 0, 3, 0)[1] for t in PROMPTS}
    fresh = start(base_dir, tmp_path, resume=False, heldout=heldout)
    assert fresh.resumed_step == 0 and not checkpoints(tmp_path)
    assert set(fresh.heldout_before) == set(PROMPTS)
    assert all(0.0 <= v <= 1.0 for v in fresh.heldout_before.values())


def test_too_few_prompts_are_named(base_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs 10 prompts .* too few for \{'add': 8, 'sort': 8\}"):
        start(base_dir, tmp_path, steps=5)


def test_a_policy_continues_from_its_parent_at_the_parents_rank_alpha_and_targets(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The champion fixes what a policy continues with, whatever the form says: `make run` leaves `add` at rank
    32, and the dashboard's form asks for rank 8. Before issue 27 the engine was sized from the form (max rank
    8) and the rank-32 champion was refused; a parent whose rank the spec did not match was dropped for a fresh
    adapter."""
    base = load_base(base_dir)
    champion = random_adapter(
        base.sites, ["q_proj", "v_proj"], 32, alpha=64, seed=5, std=0.05, base_fingerprint=base.fingerprint
    )
    parent = tmp_path / "add-v1"
    save_adapter(champion, parent, base.sites)
    form = [
        PolicySpec(name="add", task="add", rank=8, alpha=16),
        PolicySpec(name="sort", task="sort", rank=4, alpha=8),
    ]
    with caplog.at_level(logging.WARNING, logger="mint_core.rl.recipe"):
        trainer = load_trainer(base_dir, form, GRPO, seed=3, parents={"add": parent, "sort": None})

    assert trainer.engine.config.max_lora_rank == 32  # sized for the parent, not the form
    add = trainer.policies["add"].spec
    assert (add.rank, add.alpha, add.targets) == (32, 64.0, ["q_proj", "v_proj"])
    # the run's rate is for the form's rank 8: at rank 32 half of it, as recipe_spec gives rank 32
    assert add.learning_rate == pytest.approx(GRPO.learning_rate * math.sqrt(8 / 32))
    assert trainer.policies["sort"].spec == form[1]  # no parent: the form as given
    start = trainer.weights("add").tensors  # the champion's weights (B read back through the scale)
    assert set(start) == set(champion.tensors)
    for s, (A, B) in champion.tensors.items():
        torch.testing.assert_close(start[s][0], A.to(start[s][0].dtype))
        torch.testing.assert_close(start[s][1], B.to(start[s][1].dtype))
    assert "add continues from its parent" in caplog.text and "rank: 8 -> 32" in caplog.text

    trainer.step({t: PROMPTS[t][:2] for t in PROMPTS})
    stepped = trainer.weights("add")
    assert stepped.rank == 32 and set(stepped.tensors) == set(champion.tensors)
    assert any(not torch.equal(stepped.tensors[s][1], start[s][1]) for s in start)  # it trained on from there


@pytest.mark.parametrize(
    ("case", "spec", "expected"),
    [
        ("same rank, own rate", {"rank": 32, "alpha": 64, "learning_rate": 3e-4}, {}),
        (
            "form rank 8, run's rate",
            {"rank": 8, "alpha": 16},
            {"rank": 32, "alpha": 64.0, "learning_rate": 5e-3},
        ),
        (
            "form rank 128, own rate",
            {"rank": 128, "alpha": 256, "learning_rate": 1e-3},
            {"rank": 32, "alpha": 64.0, "learning_rate": 2e-3},
        ),
        ("other alpha only", {"rank": 32, "alpha": 32}, {"alpha": 64.0}),
    ],
)
def test_continue_spec_takes_the_parents_rank_and_scales_the_rate(
    base_dir: Path, case: str, spec: dict[str, float], expected: dict[str, float]
) -> None:
    base = load_base(base_dir)
    parent = random_adapter(base.sites, TARGETS, 32, alpha=64, seed=0, base_fingerprint=base.fingerprint)
    asked = PolicySpec(name="add", task="add", **spec)  # type: ignore[arg-type]
    got = continue_spec(asked, parent, base.sites, learning_rate=1e-2)
    recipe = Continuation()
    want = asked.model_copy(
        update=expected | {"rate_scale": recipe.rate_scale, "warmup_steps": recipe.warmup_steps}
    )
    assert got.learning_rate == pytest.approx(want.learning_rate), case
    assert got.model_dump(exclude={"learning_rate"}) == want.model_dump(exclude={"learning_rate"}), case
    assert spec_changes(asked, got) == [f"{k}: {getattr(asked, k)} -> {getattr(got, k)}" for k in expected]


def test_a_continuation_sets_its_recipe_without_compounding(base_dir: Path) -> None:
    """The continuation recipe's rate share and warmup are set on the spec, not multiplied: a champion that
    was itself a continuation (its recorded spec already has them) continues at the same share."""
    base = load_base(base_dir)
    parent = random_adapter(base.sites, TARGETS, 8, alpha=16, seed=0, base_fingerprint=base.fingerprint)
    first = PolicySpec(name="add", task="add", rank=8, alpha=16)
    recipe = Continuation(rate_scale=0.5, warmup_steps=4)
    once = continue_spec(first, parent, base.sites, 1e-3, recipe)
    twice = continue_spec(once, parent, base.sites, 1e-3, recipe)
    assert (once.rate_scale, once.warmup_steps) == (0.5, 4) and twice == once
    assert once.learning_rate is None  # the rank is the parent's: no rate of its own
    assert spec_changes(first, once) == []  # the recipe is recorded on its own, not as the parent's override


def test_a_champion_with_headroom_continues_at_the_headroom_rate(base_dir: Path) -> None:
    """The continuation's rate share follows its champion's headroom (pass@G - greedy on the round's prompts):
    a saturated champion at `rate_scale`, one with room at `headroom_rate_scale`; not measured, or measuring
    turned off, the saturated share."""
    base = load_base(base_dir)
    parent = random_adapter(base.sites, TARGETS, 8, alpha=16, seed=0, base_fingerprint=base.fingerprint)
    spec = PolicySpec(name="add", task="add", rank=8, alpha=16)
    recipe = Continuation(rate_scale=0.25, min_headroom=0.15, headroom_rate_scale=1.0)
    saturated = Headroom(items=64, greedy=0.70, pass_k=0.80, k=8)
    room = Headroom(items=64, greedy=0.40, pass_k=0.60, k=8)
    edge = Headroom(items=64, greedy=0.50, pass_k=0.65, k=8)
    for measured, share in ((None, 0.25), (saturated, 0.25), (room, 1.0), (edge, 1.0)):
        got = continue_spec(spec, parent, base.sites, 1e-3, recipe, measured)
        assert got.rate_scale == share, measured
        warmup = recipe.headroom_warmup_steps if share == 1.0 else recipe.warmup_steps
        assert got.warmup_steps == warmup and recipe.headroom_warmup_steps > recipe.warmup_steps
        assert recipe.rate_for(measured) == share
    off = recipe.model_copy(update={"min_headroom": None})
    assert continue_spec(spec, parent, base.sites, 1e-3, off, room).rate_scale == 0.25


def test_load_trainer_measures_each_continuing_champion_on_its_prompts(
    base_dir: Path, tmp_path: Path
) -> None:
    """The trainer measures a continuing policy's champion on its own prompts of the round (greedy and
    pass@G), and sets its rate from that; a fresh policy is not measured."""
    base = load_base(base_dir)
    parent = random_adapter(base.sites, TARGETS, 4, alpha=8, seed=0, base_fingerprint=base.fingerprint)
    save_adapter(parent, tmp_path / "add", base.sites)
    specs = [PolicySpec(name=t, task=t, rank=4, alpha=8) for t in PROMPTS]
    parents: dict[str, Path | None] = {"add": tmp_path / "add", "sort": None}
    # a random champion answers nothing right: no headroom, the saturated share
    trainer = load_trainer(base_dir, specs, GRPO, 3, parents, headroom_items=PROMPTS)
    assert trainer.policies["add"].spec.rate_scale == Continuation().rate_scale
    assert trainer.policies["sort"].spec.rate_scale == 1.0  # a first revision
    # the champion's own greedy answers as the gold answers, a threshold of 0 gap: measured, and it has room
    engine = trainer.engine
    from mint_core.engine.chat import prompt_ids
    from mint_core.engine.engine import Request
    from mint_core.engine.sampling import SamplingParams

    greedy = engine.generate(
        [
            Request(prompt_ids(engine.tokenizer, e.prompt), "add", SamplingParams(max_tokens=4))
            for e in PROMPTS["add"]
        ]
    )
    mine = [replace(e, answer=c.text.strip()) for e, c in zip(PROMPTS["add"], greedy, strict=True)]
    sampled = headroom(engine, "add", mine, 2, 0.7, 4)  # a random base's samples miss its own greedy answers
    assert sampled.greedy == 1.0 and sampled.items == 8 and sampled.gap == sampled.pass_k - 1.0
    cold = GRPO.model_copy(update={"temperature": 0.01})  # samples as greedy as greedy: pass@G = greedy
    assert headroom(engine, "add", mine, 2, 0.01, 4).gap == 0.0
    eager = Continuation(min_headroom=0.0, headroom_rate_scale=0.9)
    trainer = load_trainer(
        base_dir, specs, cold, 3, parents, continuation=eager, headroom_items={"add": mine}
    )
    assert trainer.policies["add"].spec.rate_scale == 0.9


def test_a_tasks_recipe_section_sets_its_policies_hints(tmp_path: Path, register_tasks: Any) -> None:
    from mint_core.rl.builder import recipe_spec
    from mint_core.rl.constants import DEFAULT_RANK

    task = tmp_path / "hinted"
    task.mkdir()
    (task / "task.yaml").write_text(
        "data: {train: t.jsonl, heldout: h.jsonl}\nrewards: [{builtin: exact_match}]\neval: {task: hinted}\n"
        "gate: {guards: [copy]}\nrecipe: {rank: 32, group_size: 12, replay: 0.5}\n"
    )
    register_tasks(tmp_path)
    got = recipe_spec("mine", "hinted")
    assert (got.rank, got.alpha, got.group_size, got.replay) == (32, 64.0, 12, 0.5)
    assert got.learning_rate == pytest.approx(1e-3 * math.sqrt(DEFAULT_RANK / 32))
    assert recipe_spec("mine", "hinted", rank=8).rank == 8  # a form's rank wins
    plain = recipe_spec("s", "sort")  # a built-in's own hints, from its spec
    assert (plain.rank, plain.group_size, plain.replay) == (8, None, 0.25)
    assert recipe_spec("r", "reverse").group_size == 16 and recipe_spec("a", "add").rank == 32


def test_the_dry_run_tries_more_prompts_before_it_refuses_a_reward(base_dir: Path) -> None:
    """The tiny random base answers no `add` prompt right nor in its shape: every completion scores 0. The dry run
    samples DRY_RUN_ROUNDS rounds of `k` prompts (a hard task's first prompts may all be missed) before it refuses,
    naming how many completions it scored."""
    trainer = load_trainer(base_dir, [PolicySpec(name="add", task="add", rank=4, alpha=8)], GRPO, seed=3)
    prompts = {"add": split("add", 40, 0, 0)[0]}
    group = trainer.group_size("add")
    with pytest.raises(NoRewardSignal, match=f"all {DRY_RUN_ROUNDS * 3 * group} of the base's completions"):
        dry_run_rewards(trainer, prompts, 3)
    with pytest.raises(NoRewardSignal, match=f"all {2 * group} of"):  # fewer prompts than the rounds ask for
        dry_run_rewards(trainer, {"add": prompts["add"][:2]}, 3)
