"""The one training recipe: a run stopped and resumed ends byte for byte where an uninterrupted run does, with
the whole curve; another run's checkpoint is refused, naming what differs, before anything changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mint_core.data.tasks import split
from mint_core.engine.base import build_tiny_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.rl.checkpoints import checkpoints
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.recipe import ResumeError, TrainingRun, load_trainer
from mint_core.rl.trainer import PolicySpec

GRPO = GRPOConfig(
    group_size=2, max_new_tokens=4, learning_rate=1e-2, weight_decay=0.5, drop_zero_variance=False
)
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
    assert straight.run() and straight.trainer.steps == 4

    stopped = start(base_dir, tmp_path / "stopped")
    assert not stopped.run(stop=lambda: stopped.trainer.steps == 2)  # stop asked during step 2
    assert [p.name for p in checkpoints(tmp_path / "stopped")] == ["step-00001", "step-00002"]  # two deep

    # the flows' way: the same step as separate rollout and update calls
    resumed = start(base_dir, tmp_path / "stopped")
    assert (resumed.resumed_step, resumed.resumed_checkpoint) == (2, tmp_path / "stopped" / "step-00002")

    def rollout_then_update() -> None:
        resumed.update(resumed.rollout())

    assert resumed.run(rollout_then_update)
    assert revisions(resumed, tmp_path / "a") == revisions(straight, tmp_path / "b")
    assert [(h["step"], h["policy"]) for h in resumed.history] == [
        (s, t) for s in range(1, 5) for t in PROMPTS
    ]
    record = json.loads((tmp_path / "stopped" / "step-00004" / "run.json").read_text())
    assert record["history"] == resumed.history and record["args"]["policies"] == ["add", "sort"]


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
    first.run(stop=lambda: first.trainer.steps == 2)
    with pytest.raises(ResumeError, match=expected):
        start(base_dir, tmp_path, **change)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00001", "step-00002"], case


def test_a_fresh_start_replaces_old_checkpoints_and_scores_heldout(base_dir: Path, tmp_path: Path) -> None:
    first = start(base_dir, tmp_path)
    first.run(stop=lambda: True)
    heldout = {t: split(t, 0, 3, 0)[1] for t in PROMPTS}
    fresh = start(base_dir, tmp_path, resume=False, heldout=heldout)
    assert fresh.resumed_step == 0 and not checkpoints(tmp_path)
    assert set(fresh.heldout_before) == set(PROMPTS)
    assert all(0.0 <= v <= 1.0 for v in fresh.heldout_before.values())


def test_too_few_prompts_are_named(base_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs 10 prompts .* too few for \{'add': 8, 'sort': 8\}"):
        start(base_dir, tmp_path, steps=5)
