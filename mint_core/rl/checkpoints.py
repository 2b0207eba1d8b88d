"""Training checkpoints: a trainer's state written whole or not at all, the newest one found, old ones pruned.

A checkpoint is a directory `step-NNNNN` (the trainer's step count) holding `MultiPolicyTrainer.save_state`'s
files and, optionally, `run.json`: whatever the caller needs to pick the run up again (its arguments, the curve so
far). It is written under a `.tmp` name and renamed into place, so a kill mid-write leaves no checkpoint that looks
whole. Under DeepSpeed every rank writes its share and rank 0 renames, between barriers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mint_core.rl.trainer import MultiPolicyTrainer


def is_lead_process() -> bool:
    """Whether this process writes and prints for the run: rank 0 under DeepSpeed, the only one otherwise."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def checkpoints(directory: Path) -> list[Path]:
    """The whole checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))


def latest_checkpoint(directory: Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def write_checkpoint(
    trainer: MultiPolicyTrainer, directory: Path, run: dict[str, Any] | None = None, keep: int | None = None
) -> Path:
    """Write `trainer`'s state (and `run` as run.json) to directory/step-NNNNN; keep only the newest `keep`
    checkpoints (None: all). Every rank calls it under DeepSpeed."""
    path = directory / f"step-{trainer.steps:05d}"
    tmp = path.with_name(path.name + ".tmp")
    if is_lead_process():
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed write left
    _barrier()
    trainer.save_state(tmp)
    _barrier()
    if is_lead_process():
        if run is not None:
            (tmp / "run.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
        if path.exists():  # this step written before (a final checkpoint right after a periodic one)
            shutil.rmtree(path)
        tmp.rename(path)
        if keep is not None:
            for old in checkpoints(directory)[:-keep]:
                shutil.rmtree(old)
    _barrier()
    return path
