"""Training checkpoints: a trainer's state written whole or not at all, the newest one found, old ones pruned.

A checkpoint is a directory `step-NNNNN` (the trainer's step count) holding `MultiPolicyTrainer.save_state`'s
files and, optionally, `run.json`: whatever the caller needs to pick the run up again (its arguments, the curve so
far). It is written under a `.tmp` name and renamed into place, so a kill mid-write leaves no checkpoint that looks
whole. Under DeepSpeed every rank writes its share and rank 0 renames, between barriers.

A run whose next attempt may start on another host also keeps its checkpoints in a *mirror*, a directory or
fsspec URL every host reaches (`push_checkpoint`): each checkpoint copied there file by file with a `COMPLETE`
marker written last (object stores have no atomic rename), so a half-copied one is never taken; an attempt on
another host first pulls the newest mirrored checkpoint into its own directory (`pull_checkpoint`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import fsspec.core
import torch
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

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


MIRRORED = "COMPLETE"
"""Written last into a mirrored checkpoint: one without it is a copy that a kill interrupted."""


def _mirror_fs(url: str) -> tuple[AbstractFileSystem, str]:
    if "://" not in url:
        return LocalFileSystem(), str(Path(url).expanduser().absolute())
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _mirrored(fs: AbstractFileSystem, root: str) -> list[str]:
    """The whole mirrored checkpoints under `root`, oldest first."""
    try:
        names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    steps = sorted(n for n in names if n.startswith("step-") and not n.endswith(".tmp"))
    return [f"{root}/{n}" for n in steps if fs.exists(f"{root}/{n}/{MIRRORED}")]


def push_checkpoint(ckpt: Path, url: str, keep: int | None = None) -> str:
    """Copy the checkpoint directory `ckpt` to `url`/<its name>, its `COMPLETE` marker last; keep only the newest
    `keep` mirrored checkpoints there (None: all). Returns where it went."""
    fs, root = _mirror_fs(url)
    dest = f"{root}/{ckpt.name}"
    if fs.exists(dest):  # this step mirrored before, or a copy a kill interrupted
        fs.rm(dest, recursive=True)
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        target = f"{dest}/{f.relative_to(ckpt).as_posix()}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(f), target)
    fs.pipe_file(f"{dest}/{MIRRORED}", b"")
    if keep is not None:
        for old in _mirrored(fs, root)[:-keep]:
            fs.rm(old, recursive=True)
    return dest


def pull_checkpoint(url: str, directory: Path) -> Path | None:
    """The newest checkpoint mirrored at `url`, copied into `directory` when it is newer than the newest there
    (an earlier attempt on another host got further); returns its local path, or None when nothing was copied."""
    fs, root = _mirror_fs(url)
    found = _mirrored(fs, root)
    if not found:
        return None
    newest = found[-1]
    name = newest.rsplit("/", 1)[-1]
    local = latest_checkpoint(directory)
    if local is not None and local.name >= name:
        return None
    tmp = directory / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for remote in fs.find(newest):
        rel = str(remote)[len(newest) + 1 :]
        if rel == MIRRORED:
            continue
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(tmp / rel))
    path = directory / name
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def drop_mirror(url: str) -> None:
    """Remove a run's mirrored checkpoints (its revision is exported: they have done their job)."""
    fs, root = _mirror_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)
