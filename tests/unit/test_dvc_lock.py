"""dvc.lock records the bytes of every source file a stage depends on, as committed: a stage's code edited without
`dvc commit` would make a fresh clone's `make run` rerun the stage and leave dvc.lock modified (the checkout
dirty), which is what a newcomer saw after `mint_core/eval/suites.py` changed in 0f30576."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _file_deps() -> list[tuple[str, str, str, int]]:
    """(stage, path, md5, size) of every dependency in dvc.lock that is one file of the repository (folders,
    such as data/tasks, are outputs of other stages and are not in git)."""
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    return [
        (stage, dep["path"], dep["md5"], dep["size"])
        for stage, body in lock["stages"].items()
        for dep in body.get("deps", [])
        if "nfiles" not in dep
    ]


def test_dvc_lock_names_source_files() -> None:
    deps = _file_deps()
    assert deps, "dvc.lock lists no file dependency"
    missing = sorted({path for _, path, _, _ in deps if not (ROOT / path).is_file()})
    assert not missing, f"dvc.lock depends on files the repository lacks: {missing}"


@pytest.mark.parametrize(("stage", "path", "md5", "size"), _file_deps(), ids=lambda v: str(v)[:40])
def test_each_stage_dependency_is_recorded_as_committed(stage: str, path: str, md5: str, size: int) -> None:
    data = (ROOT / path).read_bytes()
    assert (hashlib.md5(data).hexdigest(), len(data)) == (md5, size), (
        f"{path} changed since dvc.lock recorded it for stage {stage!r}: if the stage's outputs are the same, "
        f"`dvc commit -f {stage.split('@')[0]}` records it; otherwise rebuild it (docs/builtin-base.md)"
    )
