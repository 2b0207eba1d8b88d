"""Step 1 of the main job: build what is missing with DVC (the task data, the built-in base, the data checks, the
eval suites' data), from the local remote's cache where it holds the outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from mint_app.job.config import MainJobError

STAGES = ("task_data", "builtin_base", "validate_data", "eval_sets")
"""The DVC stages the job needs, in pipeline order (the tiny random bases are for tests and are not built)."""


def _tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise MainJobError(f"{name} is not installed (make run installs it into .venv)")
    return found


def _dvc_env() -> dict[str, str]:
    """The stages' commands (`mint ...`) must find this environment's `mint` first. OpenMP threads that wait
    passively: on two cores shared with other busy processes, spinning ones stall each other, and the builtin_base
    stage's 2-thread pretraining ran 5x slower (40 steps: 78-94 s against 17 s passive; the same threads, so
    the same numbers)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _dvc_status(stages: list[str]) -> dict[str, list[Any]]:
    out = subprocess.run(
        [_tool("dvc"), "status", "--json", *stages],
        capture_output=True,
        text=True,
        env=_dvc_env(),
    )
    if out.returncode != 0:
        raise MainJobError(f"dvc status failed:\n{out.stderr.strip() or out.stdout.strip()}")
    doc = json.loads(out.stdout or "{}")
    return {k: v for k, v in doc.items() if k in stages}


def _built_not_cached(entries: list[Any]) -> bool:
    """Outputs on disk that DVC's cache does not hold, deps and params unchanged: built here before but never
    cached (DVC reports 'not in cache' for a missing output too, hence the look at the disk); no rebuild."""
    changes = [e for e in entries if isinstance(e, dict)]
    return bool(changes) and all(
        set(e) == {"changed outs"}
        and set(e["changed outs"].values()) == {"not in cache"}
        and all(Path(out).exists() for out in e["changed outs"])
        for e in changes
    )


def _missing_outs(entries: list[Any]) -> bool:
    return any(
        not Path(out).exists() for e in entries if isinstance(e, dict) for out in e.get("changed outs") or {}
    )


def _local_remotes() -> list[tuple[str, Path]]:
    """The DVC remotes that are local folders holding something, the default first: the one a `dvc push` filled
    (`.mint/dvc-remote`), then `published`, the repository's own copy of the built-in base (`infra/dvc-published`).

    Why a published base: pretraining amplifies the last bit of every sum, and a base built on a CPU whose kernels
    escape the pin (mint_core/engine/cpu_pin.py; an Intel Xeon with AVX-512 and AMX rebuilt a different base, final
    loss 0.195 against 0.305) is not the base that dvc.lock records. A fresh clone therefore takes the published
    bytes, which DVC checks against dvc.lock's md5, and rebuilds only when the base's inputs changed."""
    listed = subprocess.run([_tool("dvc"), "remote", "list"], capture_output=True, text=True, env=_dvc_env())
    default = subprocess.run(
        [_tool("dvc"), "remote", "default"], capture_output=True, text=True, env=_dvc_env()
    ).stdout.strip()
    found: list[tuple[str, Path]] = []
    for line in listed.stdout.splitlines():
        parts = line.split()
        if len(parts) < 2 or "://" in parts[1]:
            continue
        path = Path(parts[1])
        path = path if path.is_absolute() else (Path(".dvc") / path).resolve()
        if path.is_dir() and any(path.iterdir()):
            found.append((parts[0], path))
    return sorted(found, key=lambda r: r[0] != default)


def _pull(stage: str, remotes: list[tuple[str, Path]], console: Console) -> bool:
    """Fetch a stage's missing outputs from the first local remote that holds them all; whether one did."""
    for name, path in remotes:
        t0 = time.perf_counter()
        subprocess.run(
            [_tool("dvc"), "pull", "-r", name, "--allow-missing", "-q", stage], env=_dvc_env(), check=False
        )
        if not _dvc_status([stage]).get(stage):
            console.print(f"  {stage}: pulled from {path} ({time.perf_counter() - t0:.1f} s)")
            return True
    return False


def build(console: Console) -> list[str]:
    """Bring the job's DVC stages up to date, pulling from a local remote before building; what was done."""
    if not Path("dvc.yaml").is_file():
        raise MainJobError("no dvc.yaml here: run the main job from the repository root")
    done: list[str] = []
    remotes = _local_remotes()
    status = _dvc_status(list(STAGES))
    for stage in STAGES:
        entries = status.get(stage) or []
        if not entries:
            console.print(f"  {stage}: up to date")
            continue
        if _built_not_cached(entries):
            console.print(f"  {stage}: built, matches dvc.lock's inputs, not in DVC's cache (kept as is)")
            continue
        if remotes and _missing_outs(entries) and _pull(stage, remotes, console):
            done.append(f"{stage} pulled")
            continue
        why = "; ".join(
            f"{kind} {', '.join(f'{k} {v}' for k, v in what.items())}"
            for e in entries
            if isinstance(e, dict)
            for kind, what in e.items()
            if isinstance(what, dict)
        )
        console.print(f"  {stage}: building ({why or 'changed'}): dvc repro -s {stage}")
        t0 = time.perf_counter()
        run = subprocess.run([_tool("dvc"), "repro", "-s", stage], env=_dvc_env())
        if run.returncode != 0:
            raise MainJobError(f"dvc repro -s {stage} failed (exit {run.returncode}); see its output above")
        s = time.perf_counter() - t0
        console.print(f"  {stage}: built in {s:.1f} s")
        done.append(f"{stage} built {s:.0f} s")
        later = list(STAGES[STAGES.index(stage) + 1 :])
        if later:  # an upstream rebuild can change what the later stages depend on
            status = _dvc_status(later)
    return done
