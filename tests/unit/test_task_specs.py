"""Task specs: a user's task folder is read like a built-in, its rewards run safely, bad input is named."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from mint_core.data.checks import check_task
from mint_core.data.rewards import MIN_CALLS_FOR_SHARE, NoRewardSignal, Rewarder, RewardFailures, check_signal
from mint_core.data.spec import BUILTIN_DIR, SpecError, TaskRegistry, load_spec, registry
from mint_core.errors import DataCheckError
from mint_core.eval.suites import SuiteError, spec_task_config

GSM8K = Path(__file__).resolve().parents[2] / "examples" / "gsm8k-format"

REWARD_PY = """
import math, time

def good(prompts, completions, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

def raises(prompts, completions, **kw):
    raise ZeroDivisionError("the user's bug")

def hangs(prompts, completions, **kw):
    time.sleep(60)

def nan(prompts, completions, **kw):
    return [math.nan for _ in completions]

def too_big(prompts, completions, **kw):
    return [2.0 for _ in completions]

def too_few(prompts, completions, **kw):
    return [1.0]

def skips(prompts, completions, **kw):
    return [None for _ in completions]

def constant(prompts, completions, **kw):
    return [0.5 for _ in completions]

def needs_label(prompts, completions, label):
    return [1.0 for _ in completions]

def positional(p, c, /):
    return [1.0]
"""


def eval_doc(task: str, text: str, target: str) -> dict[str, Any]:
    """A generation eval over the folder's data/heldout.jsonl, asking `text` and expecting `target` (its fields)."""
    return {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": "data/heldout.jsonl"}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": text,
        "doc_to_target": target,
        "generation_kwargs": {"until": ["<eos>"], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }


def make_task(root: Path, name: str = "mine", reward: str = "reward.py:good", **spec: Any) -> Path:
    """A task folder written only from files: data, a reward .py, an eval YAML."""
    d = root / name
    (d / "data").mkdir(parents=True, exist_ok=True)
    train = [{"id": f"t{i}", "prompt": f"say {i} =", "answer": str(i)} for i in range(30)]
    heldout = [{"id": f"h{i}", "prompt": f"say {100 + i} =", "answer": str(100 + i)} for i in range(10)]
    for split, rows in (("train", train), ("heldout", heldout)):
        (d / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "reward.py").write_text(REWARD_PY)
    (d / "eval.yaml").write_text(yaml.safe_dump(eval_doc(f"{name}_eval", "prompt", "answer")))
    doc = {
        "data": {"train": "data/train.jsonl", "heldout": "data/heldout.jsonl"},
        "rewards": [{"function": reward, "timeout_s": 3}],
        "eval": {"task": f"{name}_eval", "include": "eval.yaml"},
        **spec,
    }
    (d / "task.yaml").write_text(yaml.safe_dump(doc))
    return d


def test_builtins_and_a_users_folder_are_one_registry(tmp_path: Path) -> None:
    make_task(tmp_path, "mine")
    make_task(tmp_path, "other")
    reg = TaskRegistry.load([BUILTIN_DIR, tmp_path])
    assert reg.names() == ["add", "copy", "reverse", "sort", "upper", "mine", "other"]
    assert registry().names() == ["add", "copy", "reverse", "sort", "upper"]  # no folder added: built-ins
    spec = reg.get("mine")
    rows = spec.train_rows()
    assert (
        len(rows) == 30 and rows[3].prompt == "say 3 =" and rows[3].answer == "3" and rows[3].task == "mine"
    )
    # a single task folder is a folder of tasks too, and its name is the folder's
    assert TaskRegistry.load([tmp_path / "mine"]).names() == ["mine"]
    assert len(spec.digest()) == 64 and spec.reward_digest() != make_task_digest(tmp_path)
    with pytest.raises(SpecError, match="unknown task 'nope'; registered: add, copy"):
        reg.get("nope")


def make_task_digest(tmp_path: Path) -> str:
    d = make_task(tmp_path / "b", "mine")
    (d / "reward.py").write_text(REWARD_PY + "\n# changed\n")
    return load_spec(d / "task.yaml").reward_digest()


def test_chat_prompts_a_column_map_and_parquet(tmp_path: Path) -> None:
    d = make_task(
        tmp_path,
        "chat",
        data={
            "train": "data/train.parquet",
            "heldout": "data/heldout.jsonl",
            "columns": {"prompt": "messages", "answer": "gold"},
        },
    )
    msgs = [[{"role": "user", "content": f"what is {i}?"}] for i in range(5)]
    pq.write_table(
        pa.table({"messages": msgs, "gold": [str(i) for i in range(5)], "topic": ["n"] * 5}),
        d / "data" / "train.parquet",
    )
    (d / "data" / "heldout.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "what is 9?"}], "gold": "9", "topic": "n"})
        + "\n"
    )
    spec = load_spec(d / "task.yaml")
    rows = spec.train_rows()
    assert rows[2].prompt == msgs[2] and rows[2].answer == "2" and rows[2].columns == {"topic": "n"}
    assert spec.heldout_rows()[0].id == "chat-heldout-0"


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        (
            "no prompt column",
            lambda d: _rows(d, "train", lambda r: {"q": r["prompt"], "answer": r["answer"]}),
            r"data.train .*train.jsonl: row 1 has no prompt column 'prompt'",
        ),
        (
            "empty prompt",
            lambda d: _rows(d, "train", lambda r: {**r, "prompt": "  "}),
            r"data.train .*: row 1 has an empty prompt",
        ),
        (
            "prompt not text",
            lambda d: _rows(d, "train", lambda r: {**r, "prompt": 7}),
            "must be text or a list of {role, content} messages, got int",
        ),
        ("missing file", lambda d: (d / "data" / "heldout.jsonl").unlink(), r"data.heldout .*: no such file"),
        (
            "not YAML",
            lambda d: (d / "task.yaml").write_text("data: [1, 2\n"),
            r"task spec .*task.yaml: not YAML",
        ),
        ("unknown field", lambda d: _spec(d, lambda s: {**s, "reward": "x"}), r"reward: Extra inputs"),
        (
            "two reward kinds",
            lambda d: _spec(
                d, lambda s: {**s, "rewards": [{"builtin": "exact_match", "function": "a.py:f"}]}
            ),
            r"rewards.0: .*exactly one of `builtin` or `function`",
        ),
        (
            "regex without pattern",
            lambda d: _spec(d, lambda s: {**s, "rewards": [{"builtin": "regex_match"}]}),
            r"regex_match needs a `pattern`",
        ),
        (
            "bad weight",
            lambda d: _spec(d, lambda s: {**s, "rewards": [{"builtin": "exact_match", "weight": 0}]}),
            r"rewards.0.weight: .*greater than 0",
        ),
    ],
)
def test_bad_task_files_are_named(tmp_path: Path, case: str, change: Any, message: str) -> None:
    d = make_task(tmp_path)
    change(d)
    with pytest.raises(SpecError, match=message):
        spec = load_spec(d / "task.yaml")
        spec.train_rows()
        spec.heldout_rows()


def _rows(d: Path, split: str, f: Any) -> None:
    p = d / "data" / f"{split}.jsonl"
    p.write_text("".join(json.dumps(f(json.loads(line))) + "\n" for line in p.read_text().splitlines()))


def _spec(d: Path, f: Any) -> None:
    p = d / "task.yaml"
    p.write_text(yaml.safe_dump(f(yaml.safe_load(p.read_text()))))


def test_the_task_suite_finds_a_held_out_row_in_train_and_a_malformed_answer(tmp_path: Path) -> None:
    d = make_task(tmp_path, answer_format=r"\d+")
    assert check_task(load_spec(d / "task.yaml")).success
    _rows(d, "heldout", lambda r: {**r, "prompt": "say 3 ="} if r["id"] == "h0" else r)
    with pytest.raises(DataCheckError, match=r"expect_column_values_to_be_unique\(column=prompt\)"):
        check_task(load_spec(d / "task.yaml"))
    d = make_task(tmp_path / "b", answer_format=r"\d+")
    _rows(d, "train", lambda r: {**r, "answer": "seven"} if r["id"] == "t7" else r)
    with pytest.raises(DataCheckError, match=r"(?s)task mine .* expect_column_values_to_match_regex.*seven"):
        check_task(load_spec(d / "task.yaml"))


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("nowhere.py:good", r"reward 'nowhere.py:good': no file"),
        ("reward.py:missing", r"reward.py has no function 'missing'"),
        ("no_such_module_xyz:f", r"reward 'no_such_module_xyz:f' does not import: ModuleNotFoundError"),
        ("reward.py:needs_label", r"needs \['label'\], which the data does not have"),
        ("reward.py:positional", r"takes positional-only"),
    ],
)
def test_a_reward_that_cannot_be_called_is_refused_before_training(
    tmp_path: Path, reward: str, message: str
) -> None:
    spec = load_spec(make_task(tmp_path, reward=reward) / "task.yaml")
    with Rewarder(TaskRegistry({spec.name: spec})) as r, pytest.raises(SpecError, match=message):
        r.check(spec, ["answer"])


def test_a_users_reward_scores_by_keywords_in_a_pool(tmp_path: Path) -> None:
    spec = load_spec(make_task(tmp_path) / "task.yaml")
    rows = spec.train_rows()[:4]
    with Rewarder(TaskRegistry({spec.name: spec})) as r:
        assert r.score(rows, [" 0", "1", "no", "3 "]) == [1.0, 1.0, 0.0, 1.0]
        assert r.stats["mine"].calls == 1 and r.stats["mine"].failures == 0


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        ("raises", "ZeroDivisionError: the user's bug"),
        ("hangs", "timed out after 3 s"),
        ("nan", "returned nan, outside"),
        ("too_big", "returned 2.0, outside"),
        ("too_few", "returned 1 scores for 4 completions"),
    ],
)
def test_a_failing_reward_scores_zero_is_counted_logged_once_and_stops_past_its_share(
    tmp_path: Path, fn: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = load_spec(make_task(tmp_path, reward=f"reward.py:{fn}") / "task.yaml")
    rows = spec.train_rows()[:4]
    with (
        Rewarder(TaskRegistry({spec.name: spec}), max_failure_share=0.5) as r,
        caplog.at_level(logging.WARNING),
    ):
        assert r.score(rows, ["0", "1", "2", "3"]) == [0.0] * 4
        assert r.stats["mine"].failures == 1 and why in r.stats["mine"].first_error[f"reward.py:{fn}"]
        if fn == "hangs":
            return  # one timeout is enough: each costs its whole limit
        for _ in range(MIN_CALLS_FOR_SHARE - 2):
            r.score(rows, ["0", "1", "2", "3"])
        with pytest.raises(RewardFailures, match=r"task 'mine': its rewards failed on 20 of 20 calls"):
            r.score(rows, ["0", "1", "2", "3"])
    assert sum(why in m for m in caplog.messages) == 1, "the first traceback is logged, once"


def test_weights_and_none(tmp_path: Path) -> None:
    spec = load_spec(
        make_task(
            tmp_path,
            rewards=[
                {"function": "reward.py:skips", "weight": 1},
                {"builtin": "exact_match", "weight": 3},
                {"builtin": "regex_match", "pattern": r"^\d+$", "column": None, "weight": 1},
            ],
        )
        / "task.yaml"
    )
    with Rewarder(TaskRegistry({spec.name: spec})) as r:
        assert r.score(spec.train_rows()[:3], ["0", "9", "x"]) == [0.8, 0.2, 0.0]


def test_the_dry_run_refuses_a_reward_with_no_signal(tmp_path: Path) -> None:
    spec = load_spec(make_task(tmp_path, reward="reward.py:constant") / "task.yaml")
    rows = spec.train_rows()[:4]
    with (
        Rewarder(TaskRegistry({spec.name: spec})) as r,
        pytest.raises(NoRewardSignal, match="task 'mine': its reward gave all 4 of the base's completions"),
    ):
        check_signal(spec, r.score_task(spec, rows, ["a", "b", "c", "d"]), ["a", "b", "c", "d"])
    spec = load_spec(make_task(tmp_path / "b") / "task.yaml")
    with Rewarder(TaskRegistry({spec.name: spec})) as r:
        scores = r.score_task(spec, rows, ["0", "x", "2", "y"])
        assert scores == [1.0, 0.0, 1.0, 0.0]
        check_signal(spec, scores, ["0", "x", "2", "y"])


def test_a_tasks_eval_yaml_is_its_suite_and_a_broken_one_is_named(tmp_path: Path) -> None:
    spec = load_spec(make_task(tmp_path) / "task.yaml")
    cfg = spec_task_config(spec)
    assert cfg["task"] == "mine_eval"
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "mine" / "data" / "heldout.jsonl")
    _spec(tmp_path / "mine", lambda s: {**s, "eval": {"task": "other", "include": "eval.yaml"}})
    with pytest.raises(SuiteError, match=r"eval.task 'other' is not defined in .*eval.yaml"):
        spec_task_config(load_spec(tmp_path / "mine" / "task.yaml"))
    (tmp_path / "mine" / "data" / "heldout.jsonl").unlink()
    _spec(tmp_path / "mine", lambda s: {**s, "eval": {"task": "mine_eval", "include": "eval.yaml"}})
    with pytest.raises(SuiteError, match=r"data file data/heldout\.jsonl not found"):
        spec_task_config(load_spec(tmp_path / "mine" / "task.yaml"))


def test_the_gsm8k_format_example_scores_with_math_verify() -> None:
    reg = TaskRegistry.load([GSM8K])
    spec = reg.get("gsm8k-format")
    rows = spec.train_rows()
    assert isinstance(rows[0].prompt, list) and rows[0].columns["question"].startswith("Tom has 3 apples")
    assert check_task(spec).success
    with Rewarder(reg) as r:
        got = r.score(rows[:3], ["3 + 4 = 7\n#### 7", "so it is 30.0", "#### 12"])
    assert got == [1.0, 0.8, 0.2]


def test_a_task_folder_that_holds_no_spec_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"holds no task\.yaml"):
        TaskRegistry.load([tmp_path])
    make_task(tmp_path / "a", "same")
    make_task(tmp_path / "b", "same")
    with pytest.raises(SpecError, match="task 'same' is defined twice"):
        TaskRegistry.load([tmp_path / "a", tmp_path / "b"])
    shutil.rmtree(tmp_path / "b")


def test_a_server_scores_answers_to_a_users_task_with_its_reward(tmp_path: Path) -> None:
    from mint_core.serving.canary import task_score

    spec = load_spec(make_task(tmp_path) / "task.yaml")
    reg = TaskRegistry.load([BUILTIN_DIR, tmp_path])
    with Rewarder(reg) as r:
        assert task_score(r, "say 104 =", ["104"]) == 1.0  # a held-out row
        assert task_score(r, "say 3 =", ["3", "4"]) == 0.5  # a train row, two choices
        assert task_score(r, "say 999 =", ["999"]) is None  # not a row of any task: feedback scores it
        assert task_score(r, "add: 1+2 =", ["3"]) == pytest.approx(1.0)  # a built-in's, by its own spec
    assert spec.name in reg


def test_retraining_draws_epochs_over_the_train_file_and_never_a_held_out_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mint_core.data.revision import fresh_examples, probe_examples
    from mint_core.data.spec import TASK_DIRS_ENV, prompt_text, reload_registry

    make_task(tmp_path)
    monkeypatch.setenv(TASK_DIRS_ENV, str(tmp_path))
    reload_registry()
    heldout = {prompt_text(e.prompt) for e in registry().get("mine").heldout_rows()}
    probe = probe_examples("mine", 5, heldout)
    assert [e.id for e in probe] == [f"t{i}" for i in range(25, 30)]  # the last train rows, set aside
    exclude = heldout | {prompt_text(e.prompt) for e in probe}
    night1 = fresh_examples("mine", 50, seed=1, exclude=exclude)
    night2 = fresh_examples("mine", 50, seed=2, exclude=exclude)
    ids1 = [e.id for e in night1]
    assert len(set(ids1[:25])) == 25, "a whole pass over the 25 train rows before any row again"
    assert not {prompt_text(e.prompt) for e in night1 + night2} & exclude
    assert ids1 != [e.id for e in night2] and fresh_examples("mine", 50, seed=1, exclude=exclude) == night1


def test_an_eval_yaml_lm_eval_rejects_is_named_before_training(tmp_path: Path) -> None:
    from mint_core.eval.suites import check_eval

    d = make_task(tmp_path)
    assert check_eval(load_spec(d / "task.yaml")) == 10
    doc = yaml.safe_load((d / "eval.yaml").read_text())
    (d / "eval.yaml").write_text(yaml.safe_dump({**doc, "output_type": "generate_everything"}))
    with pytest.raises(SuiteError, match=r"task 'mine' .*lm-eval rejects eval 'mine_eval' from eval.yaml"):
        check_eval(load_spec(d / "task.yaml"))
    (d / "eval.yaml").write_text(yaml.safe_dump(doc))
    _spec(d, lambda s: {**s, "eval": {**s["eval"], "metric": "f1"}})
    with pytest.raises(
        SuiteError, match=r"eval.metric 'f1' is not one of the eval's metric_list \(exact_match\)"
    ):
        check_eval(load_spec(d / "task.yaml"))


def test_a_reward_that_fails_on_the_gold_answers_is_refused(tmp_path: Path) -> None:
    from mint_core.data.rewards import check_rewards

    assert check_rewards(load_spec(make_task(tmp_path) / "task.yaml")) == 1.0
    spec = load_spec(make_task(tmp_path / "b", reward="reward.py:too_few") / "task.yaml")
    with pytest.raises(
        SpecError, match=r"task 'mine' .*its reward fails on the gold answers: returned 1 scores"
    ):
        check_rewards(spec)


def test_building_suite_data_for_a_users_task_says_its_eval_is_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mint_core.data.spec import TASK_DIRS_ENV, reload_registry
    from mint_core.eval.suites import build_suite_data

    make_task(tmp_path / "tasks")
    monkeypatch.setenv(TASK_DIRS_ENV, str(tmp_path / "tasks"))
    reload_registry()
    try:
        with pytest.raises(
            SuiteError, match=r"task 'mine' is a registered task .*'mine_eval' from eval.yaml"
        ):
            build_suite_data(tmp_path / "out", tasks=["mine"])
        with pytest.raises(
            SuiteError, match=r"unknown tasks \['mul'\]; built-in: add, .*; registered: .*mine"
        ):
            build_suite_data(tmp_path / "out", tasks=["mul"])
        assert not (tmp_path / "out").exists(), "nothing written before the names are checked"
    finally:
        monkeypatch.delenv(TASK_DIRS_ENV)
        reload_registry()
