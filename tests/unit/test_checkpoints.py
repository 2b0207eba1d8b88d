"""Training checkpoints: whole or absent, the newest found, old ones pruned."""

from __future__ import annotations

import json

from mint_core.rl.checkpoints import checkpoints, latest_checkpoint, write_checkpoint
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.trainer import MultiPolicyTrainer


def test_checkpoints_are_whole_newest_first_and_pruned(make_engine, tmp_path):
    engine = make_engine("dense", seed=0, max_loras=1, max_lora_rank=4)
    trainer = MultiPolicyTrainer(engine, GRPOConfig(), [PolicySpec(name="p", task="add", rank=4)], seed=0)
    where = tmp_path / "ckpt"
    assert latest_checkpoint(where) is None
    # a write killed half-way left a .tmp: never taken for a checkpoint, cleared by the next write of its step
    (where / "step-00003.tmp").mkdir(parents=True)
    (where / "step-00003.tmp" / "state.json").write_text("{")
    assert latest_checkpoint(where) is None
    for step in (1, 2, 3):
        trainer.steps = step
        path = write_checkpoint(trainer, where, {"at": step}, keep=2)
        assert path == where / f"step-{step:05d}" and (path / "state.safetensors").is_file()
        assert json.loads((path / "run.json").read_text()) == {"at": step}
    assert [p.name for p in checkpoints(where)] == ["step-00002", "step-00003"]
    assert sorted(p.name for p in where.iterdir()) == ["step-00002", "step-00003"]
    assert latest_checkpoint(where) == where / "step-00003"
    # the same step again (a final save right after a periodic one) replaces it
    write_checkpoint(trainer, where, {"at": "again"}, keep=2)
    assert json.loads((where / "step-00003" / "run.json").read_text()) == {"at": "again"}
    assert [p.name for p in checkpoints(where)] == ["step-00002", "step-00003"]
