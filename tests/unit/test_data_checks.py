"""Great Expectations suites: planted bad prompt datasets, rollout batches and eval results are stopped with
the failing expectation named (column and observed value); the real task datasets and well-formed batches pass.

GX is slow to import and set up, so one process-wide ephemeral context serves every test here."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from mint_core.data.build import write_task_data
from mint_core.data.checks import (
    PROMPT_COLUMNS,
    ROLLOUT_COLUMNS,
    CheckParams,
    EvalBounds,
    RolloutBounds,
    check,
    check_path,
    eval_frame,
    read_prompts,
    rollout_frame,
)
from mint_core.data.generators import Example, split
from mint_core.errors import DataCheckError
from mint_core.eval.gate import SuiteScore
from mint_core.rl.rollout import RolloutRow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    """A small clean prompt dataset: train and held-out examples of every task."""
    out: list[dict[str, Any]] = []
    for name in ("add", "reverse", "copy", "upper", "sort"):
        train, heldout = split(name, 20, 5, seed=0)
        out += [json.loads(e.to_json()) for e in train + heldout]
    return out


def _write(path: Path, rows: list[dict[str, Any]] | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows))
    return path


def _set(i: int, **change: Any) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    def edit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = [dict(r) for r in rows]
        rows[i].update(change)
        return rows

    return edit


def _rename(old: str, new: str) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    return lambda rows: [{(new if k == old else k): v for k, v in r.items()} for r in rows]


PROMPT_CASES: list[tuple[str, Callable[[list[dict[str, Any]]], list[dict[str, Any]] | str], list[str]]] = [
    ("null answer", _set(3, answer=None), ["expect_column_values_to_not_be_null(column=answer)", "nan"]),
    ("null id", _set(0, id=None), ["expect_column_values_to_not_be_null(column=id)"]),
    (
        "answer too long",
        _set(30, answer="abcdefghijklmnopqrstuvwxyz"),
        ["expect_column_value_lengths_to_be_between(column=answer", "'abcdefghijklmnopqrstuvwxyz'"],
    ),
    (
        "prompt too long",
        _set(2, prompt="add: " + "1" * 40 + " ="),
        ["expect_column_value_lengths_to_be_between(column=prompt", "1 of 125 rows"],
    ),
    ("empty file", lambda rows: "", ["expect_table_row_count_to_be_between(min_value=1): observed 0"]),
    (
        "wrong schema",
        _rename("prompt", "question"),
        [
            "expect_table_columns_to_match_set(column_set=['id', 'task', 'prompt', 'answer'])",
            "observed ['answer', 'id', 'question', 'task']",
            'The column "prompt" in BatchData does not exist',
        ],
    ),
    (
        "duplicate ids",
        lambda rows: [*rows, {**rows[0], "prompt": "add: 1+1 =", "answer": "2"}],
        ["expect_column_values_to_be_unique(column=id)", "'add-0-0'"],
    ),
    (
        "held-out prompt leaked into train",
        lambda rows: [*rows, {**rows[0], "id": "add-0-999"}],
        ["expect_column_values_to_be_unique(column=prompt)"],
    ),
    (
        "answer in the wrong format for its task",
        _set(0, answer="twelve"),
        ["expect_column_values_to_match_regex(column=answer", "where task == 'add'", "'twelve'"],
    ),
    (
        "prompt not in the task's format",
        _set(25, prompt="reverse abc"),
        ["expect_column_values_to_match_regex(column=prompt", "where task == 'reverse'"],
    ),
    ("unknown task", _set(0, task="divide"), ["expect_column_values_to_be_in_set(column=task", "'divide'"]),
    ("answer not a string", _set(0, answer=12), ["expect_column_values_to_be_of_type(column=answer", "12"]),
    ("a line that is not JSON", lambda rows: '{"id": "a"\n', ["not JSON"]),
]


@pytest.mark.parametrize(("case", "change", "expected"), PROMPT_CASES, ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompt_dataset_is_stopped(
    tmp_path: Path,
    rows: list[dict[str, Any]],
    case: str,
    change: Callable[[list[dict[str, Any]]], list[dict[str, Any]] | str],
    expected: list[str],
) -> None:
    path = _write(tmp_path / "train" / "add.jsonl", change(rows))
    with pytest.raises(DataCheckError) as info:
        check_path(tmp_path, "prompts")
    msg = str(info.value)
    assert msg.startswith(f"data check 'prompts' on {tmp_path}"), msg
    for part in expected:
        assert part in msg, msg
    if "not JSON" not in expected:
        doc = info.value.result_json
        assert doc["success"] is False and doc["results"], doc
        json.dumps(doc)  # storable as is
    assert path.is_file()


def test_every_failing_expectation_is_listed(tmp_path: Path, rows: list[dict[str, Any]]) -> None:
    bad = _set(0, answer=None)(rows)
    bad = _set(1, id=bad[2]["id"])(bad)
    with pytest.raises(DataCheckError) as info:
        check(pd.DataFrame(bad), "prompts", source="planted")
    names = "\n".join(info.value.failures)
    assert "not_be_null(column=answer)" in names
    assert "to_be_unique(column=id)" in names
    assert len(info.value.failures) == sum(not r["success"] for r in info.value.result_json["results"])


def test_clean_prompt_rows_pass(rows: list[dict[str, Any]]) -> None:
    report = check(pd.DataFrame(rows), "prompts")
    assert report.success and report.rows == len(rows) and not report.failed
    assert report.summary()["expectations"] == report.evaluated > 20


def test_the_real_task_datasets_pass(tmp_path: Path) -> None:
    """The task_data stage's generator with params.yaml's tasks and seed (fewer examples, for speed), and
    data/tasks itself when `dvc repro` has built it."""
    data = yaml.safe_load((REPO / "params.yaml").read_text())["data"]
    write_task_data(tmp_path / "tasks", data["tasks"], n_train=300, n_heldout=30, seed=data["seed"])
    checks = CheckParams(**yaml.safe_load((REPO / "params.yaml").read_text()).get("checks", {}))
    assert check_path(tmp_path / "tasks", "prompts", checks).success
    built = REPO / "data" / "tasks"
    if (built / "manifest.json").is_file():
        report = check_path(built, "prompts", checks)
        manifest = json.loads((built / "manifest.json").read_text())
        assert report.rows == len(manifest["tasks"]) * (manifest["n_train"] + manifest["n_heldout"])


def test_read_prompts_reads_a_directory_of_splits(tmp_path: Path, rows: list[dict[str, Any]]) -> None:
    _write(tmp_path / "train" / "a.jsonl", rows[:10])
    _write(tmp_path / "heldout" / "a.jsonl", rows[10:12])
    df = read_prompts(tmp_path)
    assert list(df.columns) == PROMPT_COLUMNS and len(df) == 12
    with pytest.raises(DataCheckError, match="no such file or directory"):
        read_prompts(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataCheckError, match=r"no \*\.jsonl files"):
        read_prompts(tmp_path / "empty")


# ---- rollouts ------------------------------------------------------------------------------------------------

EX = Example("add-0-0", "add", "add: 1+2 =", "3")


def _row(group: int, **change: Any) -> RolloutRow:
    fields: dict[str, Any] = dict(
        policy="add",
        group=group,
        example=EX,
        prompt_ids=list(range(10)),
        completion_ids=[51, 2],
        sampling_logprobs=[-0.3],
        text="3",
        reward=1.0,
        finish_reason="stop",
    )
    return RolloutRow(**(fields | change))


def _batch(*last: RolloutRow) -> list[RolloutRow]:
    """Three groups of four, the last rows replaced by `last` (same group)."""
    rows = [_row(g, reward=float(i % 2)) for g in range(3) for i in range(4)]
    return rows[: len(rows) - len(last)] + list(last)


ROLLOUT_CASES: list[tuple[str, list[RolloutRow], list[str]]] = [
    ("NaN reward", _batch(_row(2, reward=math.nan)), ["expect_column_values_to_not_be_null(column=reward)"]),
    ("infinite reward", _batch(_row(2, reward=math.inf)), ["to_be_between(column=reward", "inf"]),
    ("reward out of range", _batch(_row(2, reward=3.0)), ["to_be_between(column=reward", "3.0"]),
    (
        "unequal groups",
        _batch()[:-1],
        ["expect_column_values_to_be_in_set(column=group_size, value_set=[4])"],
    ),
    (
        "completion too long",
        _batch(_row(2, completion_ids=list(range(30)))),
        ["to_be_between(column=completion_len", "e.g. 30"],
    ),
    (
        "NaN logprob",
        _batch(_row(2, sampling_logprobs=[-0.1, math.nan])),
        ["to_be_between(column=nonfinite_logprobs, min_value=0.0, max_value=0.0): 1 of 12 rows"],
    ),
    (
        "-inf logprob",
        _batch(_row(2, sampling_logprobs=[-math.inf])),
        ["to_be_between(column=nonfinite_logprobs"],
    ),
    (
        "positive logprob",
        _batch(_row(2, sampling_logprobs=[0.7])),
        ["to_be_between(column=logprob_max", "0.7"],
    ),
    (
        "more logprobs than tokens",
        _batch(_row(2, sampling_logprobs=[-0.1] * 5)),
        ["expect_column_pair_values_a_to_be_greater_than_b(column_A=completion_len, column_B=n_logprobs)"],
    ),
    ("aborted request", _batch(_row(2, finish_reason="abort")), ["column=finish_reason", "'abort'"]),
    ("empty batch", [], ["expect_table_row_count_to_be_between(min_value=1): observed 0"]),
]


@pytest.mark.parametrize("quick", [False, True], ids=["summary", "quick"])
@pytest.mark.parametrize(("case", "batch", "expected"), ROLLOUT_CASES, ids=[c[0] for c in ROLLOUT_CASES])
def test_bad_rollout_batch_is_stopped(
    case: str, batch: list[RolloutRow], expected: list[str], quick: bool
) -> None:
    """The quick check (before every GRPO update) stops the same batches, naming the same values."""
    with pytest.raises(DataCheckError) as info:
        check(
            rollout_frame(batch), "rollouts", CheckParams(rollouts=RolloutBounds(group_size=4)), quick=quick
        )
    for part in expected:
        assert part in str(info.value), str(info.value)


def test_rollout_frame_and_a_good_batch() -> None:
    batch = _batch(_row(2, sampling_logprobs=[], completion_ids=[2]))  # stopped at once: EOS, no logprob
    df = rollout_frame(batch)
    assert list(df.columns) == ROLLOUT_COLUMNS and len(df) == 12
    assert set(df["group_size"]) == {4} and df["logprob_max"].isna().sum() == 1
    assert check(df, "rollouts", CheckParams(rollouts=RolloutBounds(group_size=4))).success
    quick = check(df, "rollouts", CheckParams(rollouts=RolloutBounds(group_size=4)), quick=True)
    full = check(df, "rollouts", CheckParams(rollouts=RolloutBounds(group_size=4)))
    assert quick.success and quick.evaluated == full.evaluated and not quick.failed
    # without a known G, equal sizes are still required
    with pytest.raises(DataCheckError, match=r"unique_value_count.*group_size.*observed 2"):
        check(rollout_frame(_batch()[:-1]), "rollouts")


def test_rollout_schema(tmp_path: Path) -> None:
    df = rollout_frame(_batch()).drop(columns=["reward"])
    with pytest.raises(DataCheckError, match=r"columns_to_match_set.*observed"):
        check(df, "rollouts")


# ---- eval results --------------------------------------------------------------------------------------------

EVAL_CASES: list[tuple[str, Any, list[str]]] = [
    ("score above 1", {"add": {"score": 1.5, "n": 50}}, ["to_be_between(column=score", "1.5"]),
    ("negative score", [{"suite": "add", "score": -0.1, "n": 50}], ["to_be_between(column=score", "-0.1"]),
    (
        "too few samples",
        [SuiteScore(name="add", score=0.5, n=3)],
        ["to_be_between(column=n, min_value=10.0)", "3"],
    ),
    ("null score", {"add": {"score": None, "n": 50}}, ["not_be_null(column=score)"]),
    ("suite twice", [{"name": "add", "score": 0.5, "n": 50}] * 2, ["to_be_unique(column=suite)"]),
    ("no results", [], ["row_count_to_be_between(min_value=1): observed 0"]),
    ("wrong schema", [{"suite": "add", "acc": 0.5, "n": 50}], ["columns_to_match_set", "'acc'"]),
]


@pytest.mark.parametrize(("case", "results", "expected"), EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_bad_eval_results_are_stopped(case: str, results: Any, expected: list[str]) -> None:
    with pytest.raises(DataCheckError) as info:
        check(eval_frame(results), "eval", CheckParams(eval=EvalBounds(min_samples=10)))
    for part in expected:
        assert part in str(info.value), str(info.value)


def test_good_eval_results_pass(tmp_path: Path) -> None:
    scores = [
        SuiteScore(name="add", score=0.5, n=20, correct=[True, False] * 10),
        SuiteScore(name="copy", score=1, n=20),
    ]
    assert check(eval_frame(scores), "eval", CheckParams(eval=EvalBounds(min_samples=10))).success
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"add": {"score": 0.5, "n": 20}}))
    assert check_path(path, "eval").rows == 1
    # a runner's result: objects named by `suite`, or a run's JSON with per-sample detail under "suites"
    runner = [SimpleNamespace(suite="add", score=0.4, n=30, metrics={"exact_match": 0.4}, samples=[])]
    assert eval_frame(runner).to_dict("records") == [{"suite": "add", "score": 0.4, "n": 30}]
    run = {
        "model": "m",
        "suites": {"add": {"suite": "add", "metrics": {}, "score": 0.4, "n": 30, "samples": []}},
    }
    path.write_text(json.dumps(run))
    assert check_path(path, "eval").rows == 1


# ---- the CLI -------------------------------------------------------------------------------------------------


def test_cli_checks_a_directory_and_writes_its_report(tmp_path: Path, rows: list[dict[str, Any]]) -> None:
    from mint_app.cli.app import app

    _write(tmp_path / "tasks" / "train" / "add.jsonl", rows)
    params = _write(tmp_path / "params.yaml", yaml.safe_dump({"checks": {"prompts": {"min_rows": 10}}}))
    report, result = tmp_path / "out" / "report.json", tmp_path / "out" / "result.json"
    args = ["data", "check", str(tmp_path / "tasks"), "--params", str(params), "--report", str(report)]
    ok = CliRunner().invoke(app, [*args, "--result", str(result)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(report.read_text()) == {
        "kind": "prompts",
        "source": str(tmp_path / "tasks"),
        "rows": len(rows),
        "success": True,
        "expectations": json.loads(report.read_text())["expectations"],
        "failed": [],
    }
    assert json.loads(result.read_text())["success"] is True

    _write(tmp_path / "tasks" / "heldout" / "add.jsonl", [{**rows[0], "answer": None}])
    bad = CliRunner().invoke(app, args)
    assert bad.exit_code == 1
    assert "expect_column_values_to_be_unique(column=id)" in bad.output
    assert "expect_column_values_to_not_be_null(column=answer)" in bad.output
    assert json.loads(report.read_text())["success"] is False

    wrong = CliRunner().invoke(app, ["data", "check", str(tmp_path), "--kind", "tables"])
    assert wrong.exit_code != 0 and "kind must be one of" in wrong.output
