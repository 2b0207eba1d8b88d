"""The repository's published base (`infra/dvc-published`, the DVC remote `published`) holds exactly the
`data/base` that dvc.lock records, so a fresh clone's main job pulls the recorded bytes on any CPU instead of
rebuilding a base its kernels would round differently (docs/builtin-base.md)."""

from __future__ import annotations

import configparser
import hashlib
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _remote_dir(name: str) -> Path:
    config = configparser.ConfigParser()
    config.read(ROOT / ".dvc" / "config")
    url = config[f"'remote \"{name}\"'"]["url"]  # DVC writes the section as ['remote "<name>"']
    return (ROOT / ".dvc" / url).resolve()


def _object(remote: Path, md5: str) -> Path:
    """Where DVC 3 keeps an object in a remote: files/md5/<first two hex digits>/<the rest>."""
    return remote / "files" / "md5" / md5[:2] / md5[2:]


def _recorded_base() -> dict[str, object]:
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    (out,) = [o for o in lock["stages"]["builtin_base"]["outs"] if o["path"] == "data/base"]
    return out


def test_the_published_remote_is_a_folder_in_the_repository() -> None:
    remote = _remote_dir("published")
    assert remote.is_relative_to(ROOT) and remote.is_dir(), remote


def test_the_published_base_is_the_base_dvc_lock_records() -> None:
    out = _recorded_base()
    remote = _remote_dir("published")
    manifest = _object(remote, str(out["md5"]))
    assert manifest.is_file(), f"{manifest} missing: `dvc push -r published builtin_base` after a rebuild"
    entries = json.loads(manifest.read_text())
    assert len(entries) == out["nfiles"]
    size = 0
    for entry in entries:
        blob = _object(remote, entry["md5"])
        assert blob.is_file(), f"{entry['relpath']}: {blob} missing from the published base"
        data = blob.read_bytes()
        assert hashlib.md5(data).hexdigest() == entry["md5"], f"{entry['relpath']} is not the recorded bytes"
        size += len(data)
    assert size == out["size"]
