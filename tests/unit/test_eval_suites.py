"""The lm-eval suites in eval_suites/: lm-eval finds and loads them, their data is right and in sync with the
task generators, and each suite scores what its task asks for.

eval_suites/data is an output of the DVC pipeline (`eval_sets` stage), so these tests build the same data into a
copy of the suites (`standalone_suites`) rather than depend on it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from lm_eval.tasks import TaskManager
from typer.testing import CliRunner

from mint_core.data.generators import GENERATORS, Example
from mint_core.eval.suites import (
    SUITES_DIR,
    SuiteError,
    available_suites,
    build_suite_data,
    near_miss,
    standalone_suites,
    suite_tasks,
)

ROOT = Path(__file__).resolve().parents[2]
GENERATE = [*GENERATORS, "guard_generate"]


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mint's suite YAMLs with data built by the default command, in <tmp>/eval_suites."""
    return standalone_suites(tmp_path_factory.mktemp("suites"), limit=100)


def oracle(task: str, inp: str) -> str:
    """The right answer, computed from the prompt's input (independently of mint_core.data.generators)."""
    return {
        "add": lambda: str(sum(int(x) for x in inp.split("+"))),
        "reverse": lambda: inp[::-1],
        "copy": lambda: inp,
        "upper": lambda: inp.upper(),
        "sort": lambda: "".join(sorted(inp)),
    }[task]()


def rows(suites: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (suites / "data" / f"{name}.jsonl").read_text().splitlines()]


def input_of(row: dict[str, Any]) -> str:
    prefix = f"{row['task']}: "
    assert row["prompt"].startswith(prefix) and row["prompt"].endswith(" =")
    return str(row["prompt"][len(prefix) : -2])


def test_every_builtin_task_has_a_suite_and_there_is_a_guard() -> None:
    assert SUITES_DIR == ROOT / "eval_suites"
    assert set(available_suites()) == {*GENERATORS, "guard"}


def test_task_manager_finds_and_loads_every_suite_by_name(
    suites: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # data paths in the YAMLs are relative to the directory holding eval_suites/ (the repository root), as for
    # `lm_eval --include_path eval_suites --tasks mint_guard` run there
    monkeypatch.chdir(suites.parent)
    tm = TaskManager(include_path=str(suites), include_defaults=False)
    assert set(tm.all_subtasks) == {f"mint_{t}" for t in GENERATE} | {"mint_guard_choice"}
    assert tm.all_groups == ["mint_guard"]
    loaded = tm.load([f"mint_{s}" for s in available_suites(suites)])
    assert loaded["group_map"] == {"mint_guard": ["mint_guard_generate", "mint_guard_choice"]}
    assert set(loaded["tasks"]) == set(tm.all_subtasks)

    for name in GENERATE:
        task = loaded["tasks"][f"mint_{name}"]
        cfg = task.config
        assert cfg.output_type == "generate_until"
        assert cfg.num_fewshot == 0
        assert [m["metric"] for m in cfg.metric_list] == ["exact_match"]
        assert cfg.generation_kwargs["until"] == ["<eos>"]  # the tasks' answers end at EOS
        assert cfg.generation_kwargs["do_sample"] is False and cfg.generation_kwargs["temperature"] == 0.0
        assert [f["name"] for f in cfg.filter_list] == ["strip"]
        assert [f["function"] for f in cfg.filter_list[0]["filter"]] == ["remove_whitespace", "take_first"]
        docs = list(task.test_docs())
        assert len(docs) == 100
        longest = max(len(d["answer"]) for d in docs)
        assert cfg.generation_kwargs["max_gen_toks"] >= longest + 2  # leading space and EOS (byte tokens)
        d = docs[0]
        assert task.doc_to_text(d) == d["prompt"] and task.doc_to_target(d) == d["answer"]
        # exact match on the filtered answer
        assert task.process_results(d, [d["answer"]]) == {"exact_match": 1.0}
        assert task.process_results(d, [d["answer"] + "x"]) == {"exact_match": 0.0}

    choice = loaded["tasks"]["mint_guard_choice"]
    assert choice.config.output_type == "multiple_choice"
    assert [m["metric"] for m in choice.config.metric_list] == ["acc"]
    docs = list(choice.test_docs())
    assert len(docs) == 100
    d = docs[0]
    assert choice.doc_to_text(d) == d["prompt"]
    assert choice.doc_to_choice(d) == d["choices"] and choice.doc_to_target(d) == d["gold"]
    lls = [(-1.0, False), (-1.0, False)]
    lls[d["gold"]] = (-0.5, True)
    assert choice.process_results(d, lls)["acc"] == 1.0
    lls.reverse()
    assert choice.process_results(d, lls)["acc"] == 0.0


def test_suite_tasks_resolve_data_paths_from_anywhere(
    suites: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    specs = suite_tasks(["add", "guard"], suites)
    assert [c["task"] for c in specs["add"]] == ["mint_add"]
    assert [c["task"] for c in specs["guard"]] == ["mint_guard_generate", "mint_guard_choice"]
    for cfgs in specs.values():
        for cfg in cfgs:
            path = Path(cfg["dataset_kwargs"]["data_files"]["test"])
            assert path.is_absolute() and path.is_file() and suites in path.parents
    tm = TaskManager(include_path=str(suites), include_defaults=False)
    loaded = tm.load([c for cfgs in specs.values() for c in cfgs])
    assert len(loaded["tasks"]["mint_guard_choice"].test_docs()) == 100


def test_data_is_right_and_every_suite_is_its_task(suites: Path) -> None:
    manifest = json.loads((suites / "data" / "manifest.json").read_text())
    assert manifest["counts"] == {name: 100 for name in [*GENERATE, "guard_choice"]}
    for t in GENERATORS:
        items = rows(suites, t)
        assert {r["task"] for r in items} == {t}
        assert all(r["answer"] == oracle(t, input_of(r)) for r in items)
    for r in rows(suites, "guard_generate"):
        assert r["answer"] == oracle(r["task"], input_of(r))
    for r in rows(suites, "guard_choice"):
        right = oracle(r["task"], input_of(r))
        a, b = r["choices"]
        assert r["choices"][r["gold"]] == right and a != b and len(a) == len(b)
    # the guard and the task suites share no item, and every window of the guard's first items covers all tasks
    task_ids = {r["id"] for t in GENERATORS for r in rows(suites, t)}
    for name in ("guard_generate", "guard_choice"):
        items = rows(suites, name)
        assert not task_ids & {r["id"] for r in items}
        assert [r["task"] for r in items[: len(GENERATORS)]] == list(GENERATORS)
    assert not {r["id"] for r in rows(suites, "guard_generate")} & {
        r["id"] for r in rows(suites, "guard_choice")
    }


def test_built_data_is_the_same_from_task_data_or_the_generators(suites: Path, tmp_path: Path) -> None:
    """`mint eval build-suites --tasks-dir data/tasks` (the DVC stage) and the generators with the same seed give
    the same items, byte for byte; so does eval_suites/data where it has been built."""
    from mint_core.data.build import write_task_data

    write_task_data(
        tmp_path / "tasks", list(GENERATORS), 200, 200, seed=0
    )  # a small train split: same held-out
    build_suite_data(tmp_path / "small", tasks_dir=tmp_path / "tasks", limit=10)
    build_suite_data(tmp_path / "generated", limit=10, n_train=200, n_heldout=200)
    for name in [*GENERATE, "guard_choice"]:
        f = f"{name}.jsonl"
        assert (tmp_path / "small" / f).read_bytes() == (tmp_path / "generated" / f).read_bytes(), f
    repo_data = SUITES_DIR / "data"
    if (repo_data / "manifest.json").is_file():
        # the DVC stage's suites (params.yaml eval_suites), against the generators at the same sizes
        manifest = json.loads((repo_data / "manifest.json").read_text())
        data = yaml.safe_load((SUITES_DIR.parent / "params.yaml").read_text())["data"]
        build_suite_data(
            tmp_path / "repo-like",
            limit=manifest["limit"],
            guard_limit=manifest.get("guard_limit"),
            n_train=data["n_train"],
            n_heldout=data["n_heldout"],
        )
        for name in [*GENERATE, "guard_choice"]:
            f = f"{name}.jsonl"
            assert (repo_data / f).read_bytes() == (tmp_path / "repo-like" / f).read_bytes(), f


def test_task_data_with_fewer_tasks_gives_suites_for_those(tmp_path: Path) -> None:
    from mint_core.data.build import write_task_data

    out = tmp_path / "data"
    build_suite_data(out, limit=5)
    write_task_data(tmp_path / "tasks", ["add", "sort"], 50, 20, seed=0)
    data = build_suite_data(out, tasks_dir=tmp_path / "tasks", limit=5)
    assert data.manifest["tasks"] == ["add", "sort"]
    assert sorted(p.stem for p in out.glob("*.jsonl")) == ["add", "guard_choice", "guard_generate", "sort"]
    guard = [json.loads(line)["task"] for line in (out / "guard_generate.jsonl").read_text().splitlines()]
    assert guard == ["add", "sort", "add", "sort"]  # limit // 2 tasks = 2 per task, interleaved


def test_the_guard_can_hold_more_items_than_a_task_suite(tmp_path: Path) -> None:
    """guard_limit sizes each guard task apart from the task suites: the same number from every task (rounded up
    so that each holds at least guard_limit), still interleaved, past the task suites' items."""
    data = build_suite_data(tmp_path, limit=10, guard_limit=12)
    assert data.counts["add"] == 10
    assert data.counts["guard_generate"] == data.counts["guard_choice"] == 15  # 3 per task, 5 tasks
    assert data.manifest["guard_limit"] == 12 and data.manifest["guard_per_task"] == 3
    guard = [
        json.loads(line)["task"] for line in (tmp_path / "guard_generate.jsonl").read_text().splitlines()
    ]
    assert guard == list(GENERATORS) * 3
    with pytest.raises(
        SuiteError, match=r"limit 100 with guard limit 255 needs 202 held-out items .*--guard-limit"
    ):
        build_suite_data(tmp_path, limit=100, guard_limit=255, n_heldout=200)
    with pytest.raises(SuiteError, match="guard_limit must be at least 1, got 0"):
        build_suite_data(tmp_path, limit=10, guard_limit=0)


def test_build_suites_command(suites: Path, tmp_path: Path) -> None:
    from mint_app.cli.app import app

    out = tmp_path / "suites"
    result = CliRunner().invoke(app, ["eval", "build-suites", "--out", str(out), "--limit", "10"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == {"add": 10, "reverse": 10, "copy": 10, "upper": 10, "sort": 10} | {
        "guard_generate": 10,
        "guard_choice": 10,
    }
    # a suite of limit 10 is the first 10 items of the full one: the same items whatever the limit
    full = (suites / "data" / "add.jsonl").read_text().splitlines()
    assert (out / "add.jsonl").read_text().splitlines() == full[:10]
    again = CliRunner().invoke(app, ["eval", "build-suites", "--out", str(out), "--limit", "10"])
    assert again.exit_code == 0
    bad = CliRunner().invoke(app, ["eval", "build-suites", "--out", str(out), "--tasks-dir", str(tmp_path)])
    assert bad.exit_code == 1 and "is not task data" in " ".join(bad.output.split())


@pytest.mark.parametrize(
    ("task", "inp", "answer"),
    [("add", "4+5", "9"), ("add", "50+49", "99"), ("reverse", "abba", "abba"), ("sort", "555", "555")],
)
def test_near_miss_has_the_answers_shape_and_is_wrong(task: str, inp: str, answer: str) -> None:
    wrong = near_miss(Example("x", task, f"{task}: {inp} =", answer))
    assert wrong != answer and len(wrong) == len(answer)


def _without_data(tmp_path: Path) -> Path:
    d = tmp_path / "eval_suites"
    shutil.copytree(SUITES_DIR, d, ignore=shutil.ignore_patterns("data"))
    return d


ERRORS: list[tuple[str, Callable[[Path], object], str]] = [
    (
        "unknown suite",
        lambda tmp: suite_tasks(["add", "nope"]),
        r"unknown suites \['nope'\]; known in .*: add",
    ),
    ("no suites", lambda tmp: suite_tasks([]), "unknown suites"),
    (
        "data not built",
        lambda tmp: suite_tasks(["add"], _without_data(tmp)),
        "data file eval_suites/data/add.jsonl not found .*`mint eval build-suites",
    ),
    ("no such suites dir", lambda tmp: suite_tasks(["add"], tmp / "nowhere"), "does not exist"),
    ("unknown task", lambda tmp: build_suite_data(tmp, tasks=["mul"]), r"unknown tasks \['mul'\]"),
    (
        "limit above the held-out set",
        lambda tmp: build_suite_data(tmp, limit=150, n_heldout=200),
        "needs 210 held-out items",
    ),
    ("tasks dir is not task data", lambda tmp: build_suite_data(tmp, tasks_dir=tmp), "is not task data"),
]


@pytest.mark.parametrize(("case", "change", "expected"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_what_was_wrong(
    tmp_path: Path, case: str, change: Callable[[Path], object], expected: str
) -> None:
    with pytest.raises(SuiteError, match=expected):
        change(tmp_path)
