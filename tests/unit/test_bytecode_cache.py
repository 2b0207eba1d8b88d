"""Bytecode in mint's environments: scripts/warm_bytecode.py compiles what it imports (and nothing else), and the
services mint launches cache the bytecode of what they import even where PYTHONDONTWRITEBYTECODE is set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mint_app.services.control import launch_env

ROOT = Path(__file__).resolve().parents[2]


def _package(tmp_path: Path) -> Path:
    pkg = tmp_path / "warmpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from warmpkg import used\n")
    (pkg / "used.py").write_text("X = 1\n")
    (pkg / "unused.py").write_text("Y = 2\n")
    return pkg


def _cached(pkg: Path) -> set[str]:
    return (
        {p.name.split(".")[0] for p in (pkg / "__pycache__").glob("*.pyc")}
        if (pkg / "__pycache__").is_dir()
        else set()
    )


def test_warm_bytecode_compiles_what_is_imported_only(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "warm_bytecode.py"), "warmpkg"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "modules compiled" in done.stderr and "did not import" not in done.stderr
    assert _cached(pkg) == {"__init__", "used"}


def test_warm_bytecode_refuses_to_run_with_writes_off(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "warm_bytecode.py"), "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "PYTHONDONTWRITEBYTECODE" in done.stderr


@pytest.mark.parametrize("name", ["mlflow", "prefect", "vllm", "serve", "hooks", "worker"])
def test_services_cache_bytecode_where_the_environment_turns_it_off(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = launch_env(name, {})  # type: ignore[arg-type]
    assert "PYTHONDONTWRITEBYTECODE" not in env
    pkg = _package(tmp_path)
    env["PYTHONPATH"] = str(
        tmp_path
    )  # (vLLM's own environment drops mint's PYTHONPATH; this child needs one)
    subprocess.run([sys.executable, "-c", "import warmpkg"], env=env, check=True, timeout=60)
    assert _cached(pkg) == {"__init__", "used"}


def test_vllm_side_and_prefect_keep_their_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("VIRTUAL_ENV", "/a/venv")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    vllm = launch_env("vllm-1", {"X": "1"})
    assert "PYTHONPATH" not in vllm and "VIRTUAL_ENV" not in vllm and vllm["X"] == "1"
    assert "PREFECT_API_URL" not in launch_env("prefect", {})
    assert launch_env("serve", {})["PYTHONPATH"] == "/somewhere"
