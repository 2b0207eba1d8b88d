"""Which data a training run or a revision was built from: the `mint.data_rev` it records.

`data_rev(repo_root)` is a short hash of the outputs that `dvc.lock` pins: for every stage, each output's path
and content hash (md5 of a file, or of a directory listing). So it names the data itself, not how it was made:
a lock whose outputs are byte-for-byte the same gives the same revision even if a command or a code dependency
changed around them, and any rebuilt output that came out different gives a new one. It reads the lock as it is
on disk (committed or not); `dvc status` says whether the working tree still matches it, and
`git log -- dvc.lock` finds the commit that introduced a revision.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

DATA_REV_TAG = "mint.data_rev"
"""Tag (MLflow run and model version) holding the data revision."""
DATA_REV_CHARS = 12


def lock_outputs(repo_root: str | Path = ".") -> dict[str, dict[str, str]]:
    """Every stage's outputs in dvc.lock: stage -> output path -> content hash."""
    lock = Path(repo_root) / "dvc.lock"
    if not lock.is_file():
        raise FileNotFoundError(f"no dvc.lock in {Path(repo_root).resolve()}: run `dvc repro` first")
    doc = yaml.safe_load(lock.read_text()) or {}
    stages: dict[str, Any] = doc.get("stages") or {}
    return {
        name: {out["path"]: _content_hash(out) for out in (stage or {}).get("outs", [])}
        for name, stage in sorted(stages.items())
    }


def data_rev(repo_root: str | Path = ".") -> str:
    """A short hash (12 hex digits) of dvc.lock's stage outputs and their content hashes."""
    canonical = json.dumps(lock_outputs(repo_root), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:DATA_REV_CHARS]


def _content_hash(out: dict[str, Any]) -> str:
    kind = out.get("hash", "md5")  # DVC 3 names the algorithm, then stores the value under that key
    for key in (kind, "md5", "etag", "checksum"):
        if out.get(key):
            return f"{key}:{out[key]}"
    # no content hash (an output never built): its whole entry, so that building it changes the revision
    return json.dumps(out, sort_keys=True, default=str)
