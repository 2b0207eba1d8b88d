"""The DVC pipeline: its stages and their order, params.yaml sections that the commands accept, that a change to
one parameter reruns exactly the stages that depend on it (the cheap stages; slow: with the built-in base), and
the data revision (`mint.data_rev`) read from dvc.lock."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mint_core.data.build import DataParams
from mint_core.data.checks import CheckParams
from mint_core.data.revision import data_rev
from mint_core.engine.pretrain import PretrainParams
from mint_testkit.harness import cli_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STAGES = {
    "tiny_base@dense",
    "tiny_base@moe",
    "tiny_base@mla",
    "task_data",
    "builtin_base",
    "validate_data",
    "eval_sets",
}
CHEAP = ["validate_data", "eval_sets"]  # repro targets that need only task_data upstream (no pretraining)


def _dvc_proc(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run dvc (the venv's, with the venv's `mint` on PATH)."""
    return subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dvc(*args: str, cwd: Path, timeout: float = 300) -> str:
    """Run dvc; its output, or a failure showing it."""
    proc = _dvc_proc(*args, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, (
        f"dvc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout + proc.stderr


def test_stages_and_order() -> None:
    listed = dvc("stage", "list", "--name-only", cwd=REPO).split()
    assert set(listed) >= STAGES, listed
    dot = dvc("dag", "--dot", cwd=REPO)
    edges = set(re.findall(r'"?([\w@]+)"?\s*->\s*"?([\w@]+)"?', dot))
    assert {
        ("task_data", "builtin_base"),
        ("task_data", "validate_data"),
        ("task_data", "eval_sets"),
    } <= edges, dot
    assert not any("tiny_base" in a or "tiny_base" in b for a, b in edges), "tiny bases stand alone"


def test_params_file_fits_the_commands() -> None:
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    DataParams(**doc["data"])
    base = PretrainParams(**doc["base"])
    assert base.max_position_embeddings >= base.seq_len
    CheckParams(**doc["checks"])
    suites = doc["eval_suites"]
    assert int(suites["limit"]) >= 1
    # the held-out split holds a task suite and its share of both guard members (mint_core/eval/suites.py)
    per_guard = -(-int(suites["guard_limit"]) // len(doc["data"]["tasks"]))
    assert int(doc["data"]["n_heldout"]) >= int(suites["limit"]) + 2 * per_guard


def _changed_stages(out: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w@]+)'", out))


def _scratch_repo(tmp_path: Path, params: dict) -> Path:
    """A git+DVC repo in tmp_path with the real dvc.yaml, its source deps, and the given params.yaml."""
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(REPO / "dvc.yaml", work / "dvc.yaml")
    pipeline = yaml.safe_load((REPO / "dvc.yaml").read_text())
    for stage in pipeline["stages"].values():
        for dep in stage.get("do", stage).get("deps", []):
            if dep.endswith(".py"):  # source deps: copy them so the scratch repo can hash them
                (work / dep).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / dep, work / dep)
    _write_params(work, params)
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    dvc("init", "-q", cwd=work)
    return work


def _write_params(work: Path, params: dict) -> None:
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _small_params() -> dict:
    """params.yaml shrunk: few examples of every task (the eval suites cover them all), small eval suites."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"].update(n_train=40, n_heldout=10)
    params["eval_suites"].update(
        limit=4, guard_limit=5
    )  # needs 4 + 2 x 1 guard items = 6 held-out items per task
    return params


@pytest.mark.slow  # reruns the pipeline's stages (26 s)
def test_a_param_reruns_exactly_its_stages(tmp_path: Path) -> None:
    """The cheap stages in a scratch repo: a check bound reruns only validate_data, a suite size only
    eval_sets, a data size task_data and both below it; the data revision follows the data, not the bounds."""
    params = _small_params()
    work = _scratch_repo(tmp_path, params)
    out = dvc("repro", *CHEAP, cwd=work, timeout=600)
    assert _changed_stages(out) == {"task_data", "validate_data", "eval_sets"}, out
    report = json.loads((work / "data" / "metrics" / "validate_data.json").read_text())
    assert report["success"] is True and report["rows"] == len(params["data"]["tasks"]) * (40 + 10)
    assert (work / "eval_suites" / "data" / "manifest.json").is_file()
    assert _changed_stages(dvc("repro", "--dry", *CHEAP, cwd=work)) == set()
    rev = data_rev(work)

    params["checks"]["prompts"]["answer_chars"] = [1, 12]
    _write_params(work, params)
    assert _changed_stages(dvc("repro", "--dry", *CHEAP, cwd=work)) == {"validate_data"}
    assert _changed_stages(dvc("repro", *CHEAP, cwd=work)) == {"validate_data"}
    assert data_rev(work) == rev  # the same report: the data did not change

    params["eval_suites"]["limit"] = 3
    _write_params(work, params)
    assert _changed_stages(dvc("repro", *CHEAP, cwd=work)) == {"eval_sets"}
    rev_suites = data_rev(work)
    assert rev_suites != rev

    params["data"]["n_train"] = 30
    _write_params(work, params)
    assert _changed_stages(dvc("repro", "--dry", *CHEAP, cwd=work)) == {"task_data"}
    out = dvc("repro", *CHEAP, cwd=work, timeout=600)
    assert _changed_stages(out) == {"task_data", "validate_data", "eval_sets"}, out
    assert "up to date" in dvc("status", *CHEAP, cwd=work)
    assert data_rev(work) not in {rev, rev_suites}

    params["checks"]["prompts"]["answer_chars"] = [1, 2]  # a bound the words break: the pipeline stops
    _write_params(work, params)
    failed = _dvc_proc("repro", "validate_data", cwd=work)
    assert failed.returncode != 0
    assert "expect_column_value_lengths_to_be_between(column=answer" in failed.stdout + failed.stderr


def test_wall_times_stay_out_of_git_and_of_what_dvc_hashes() -> None:
    """The builtin_base stage writes its wall times to a file git ignores and the stage does not declare, so a
    rebuild (`make run` on a fresh clone) leaves `git status` clean."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["builtin_base"]
    timings = "data/metrics/builtin_base.timings.json"
    assert f"--timings {timings}" in stage["cmd"]
    declared = [next(iter(o)) if isinstance(o, dict) else o for o in stage["outs"] + stage["metrics"]]
    assert timings not in declared
    ignored = subprocess.run(["git", "check-ignore", "-q", timings], cwd=REPO)
    assert ignored.returncode == 0, f"{timings} is not git-ignored"
    metrics = json.loads((REPO / "data" / "metrics" / "builtin_base.json").read_text())
    assert not {"train_seconds", "eval_seconds"} & set(metrics)


def test_data_rev_follows_the_locked_outputs(tmp_path: Path) -> None:
    shutil.copy(REPO / "dvc.lock", tmp_path / "dvc.lock")
    rev = data_rev(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{12}", rev)
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())

    # the same lock written differently (key order, layout) is the same revision
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=True, indent=4))
    assert data_rev(tmp_path) == rev
    # a dependency's hash alone does not name different data...
    lock["stages"]["task_data"]["deps"][0]["md5"] = "0" * 32
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert data_rev(tmp_path) == rev
    # ...an output's hash does
    lock["stages"]["task_data"]["outs"][0]["md5"] = "f" * 32 + ".dir"
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert data_rev(tmp_path) != rev
    with pytest.raises(FileNotFoundError, match=r"no dvc\.lock"):
        data_rev(tmp_path / "elsewhere")


@pytest.mark.slow
def test_a_data_param_reruns_exactly_the_stages_below_it(tmp_path: Path) -> None:
    """In a scratch git+DVC repo with the real dvc.yaml and a shrunken params.yaml: after a full repro nothing is
    left to run; after changing data.seed, task_data and everything below it reruns and the tiny bases do not."""
    params = _small_params()
    params["base"].update(
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        intermediate_size=32,
        steps=3,
        batch_size=4,
        eval_per_task=2,
    )
    work = _scratch_repo(tmp_path, params)

    dvc("repro", cwd=work, timeout=600)
    assert (work / "dvc.lock").is_file()
    assert (work / "data" / "base" / "config.json").is_file()
    assert (work / "data" / "metrics" / "builtin_base.json").is_file()
    assert _changed_stages(dvc("repro", "--dry", cwd=work)) == set()

    # a rebuild of the base gives the same weights and metrics: the lock is not rewritten (the wall times go
    # only to the timings file, which is no output of the stage)
    lock, metrics = (
        (work / "dvc.lock").read_bytes(),
        (work / "data" / "metrics" / "builtin_base.json").read_bytes(),
    )
    assert _changed_stages(dvc("repro", "-f", "-s", "builtin_base", cwd=work, timeout=600)) == {
        "builtin_base"
    }
    assert (work / "dvc.lock").read_bytes() == lock
    assert (work / "data" / "metrics" / "builtin_base.json").read_bytes() == metrics
    timings = json.loads((work / "data" / "metrics" / "builtin_base.timings.json").read_text())
    assert set(timings) == {"train_seconds", "eval_seconds"}

    params["data"]["seed"] += 1
    _write_params(work, params)
    # A dry run sees only the stage whose own params changed (downstream deps change only once it has run)...
    assert _changed_stages(dvc("repro", "--dry", cwd=work)) == {"task_data"}
    # ...the real run reruns it, the base trained on its output and the example task's data (it leaves out the
    # built-in add rows), and leaves the tiny bases alone.
    out = dvc("repro", cwd=work, timeout=600)
    below = {"task_data", "builtin_base", "validate_data", "eval_sets", "sums_over_100_data"}
    assert _changed_stages(out) == below, out
    assert "Stage 'tiny_base@dense' didn't change" in out
    assert "up to date" in dvc("status", cwd=work)
