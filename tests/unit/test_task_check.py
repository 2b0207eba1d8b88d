"""`mint task check` on the bad input a user's own task folders brought: each is an error (or a warning) that names
what is wrong, and a good folder passes without one. Each case is one change to a good folder."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from mint_app.cli.app import app
from mint_testkit.harness import save_tiny_base
from tests.unit.test_task_specs import eval_doc

REWARD_PY = """
def graded(prompts, completions, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

def lenient(prompts, completions, answer, **kw):
    return [0.25 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def against_word(prompts, completions, word, **kw):  # compares with the lowercase word: no gold answer is right
    return [float(c.strip() == w) for c, w in zip(completions, word)]

def helper(c):
    return 1 / 0 if c else 0.0

def buggy(prompts, completions, **kw):
    return [helper(c) for c in completions]

def graded_chat(prompts, completions, answer, **kw):
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]
"""


def good_task(root: Path) -> Path:
    """A folder as a team writes one: its own column names (mapped), parquet train, JSONL held out, its reward."""
    d = root / "loud"
    (d / "data").mkdir(parents=True)
    words = [f"w{'abcdefgh'[i % 8]}{'ijklmnop'[i // 8 % 8]}x{i}" for i in range(60)]
    rows = [{"question": f"loud: {w} =", "shouted": w.upper(), "word": w} for w in words]
    pq.write_table(pa.Table.from_pylist(rows[20:]), d / "data" / "train.parquet")
    (d / "data" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    (d / "reward.py").write_text(REWARD_PY)
    (d / "eval.yaml").write_text(yaml.safe_dump(eval_doc("loud", "question", "shouted")))
    spec = {
        "data": {
            "train": "data/train.parquet",
            "heldout": "data/heldout.jsonl",
            "columns": {"prompt": "question", "answer": "shouted"},
        },
        "rewards": [{"function": "reward.py:graded"}],
        "eval": {"task": "loud", "include": "eval.yaml"},
    }
    (d / "task.yaml").write_text(yaml.safe_dump(spec))
    return d


def edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def id_in_train_only(d: Path) -> None:
    """Map `id` to a column only the train file has."""
    table = pq.read_table(d / "data" / "train.parquet")
    pq.write_table(
        table.append_column("qid", pa.array([f"q{i}" for i in range(table.num_rows)])),
        d / "data" / "train.parquet",
    )
    edit(d / "task.yaml", lambda s: s["data"]["columns"].update(id="qid"))


def as_chat(d: Path) -> None:
    """The folder with chat prompts (a system turn, then the question as the user's) and the question's text
    kept in a `text` column, which the eval asks."""

    def chat(row: dict[str, Any]) -> dict[str, Any]:
        turns = [{"role": "system", "content": "Shout."}, {"role": "user", "content": row["question"]}]
        return {**row, "question": turns, "text": row["question"]}

    train = [chat(r) for r in pq.read_table(d / "data" / "train.parquet").to_pylist()]
    pq.write_table(pa.Table.from_pylist(train), d / "data" / "train.parquet")
    held = d / "data" / "heldout.jsonl"
    held.write_text("".join(json.dumps(chat(json.loads(x))) + "\n" for x in held.read_text().splitlines()))
    edit(d / "task.yaml", lambda s: s["rewards"][0].update(function="reward.py:graded_chat"))
    edit(d / "eval.yaml", lambda e: e.update(doc_to_text="text"))


def chat_eval(d: Path, **fields: str) -> None:
    """The folder as chat, with these fields of its eval YAML changed."""
    as_chat(d)
    edit(d / "eval.yaml", lambda e: e.update(fields))


def run_check(folder: Path) -> tuple[int, str]:
    out = CliRunner().invoke(app, ["task", "check", str(folder)], env={"COLUMNS": "400"})
    return out.exit_code, re.sub(r"\s+", " ", out.output)


@pytest.mark.parametrize("chat", [False, True], ids=["text prompts", "chat prompts"])
def test_a_good_folder_passes_without_a_warning(tmp_path: Path, chat: bool) -> None:
    folder = good_task(tmp_path)
    if chat:
        as_chat(folder)
    code, text = run_check(folder)
    assert code == 0, text
    assert "warning" not in text and "score 1.000" in text
    assert "renders the held-out rows' prompts and answers" in text


CASES: list[tuple[str, Callable[[Path], None], int, str]] = [
    (
        "a column map naming a column the file lacks",
        lambda d: edit(d / "task.yaml", lambda s: s["data"]["columns"].update(answer="solution")),
        1,
        r"data.columns maps 'answer' to column 'solution', which data.train .*train.parquet does not have "
        r"\(its columns: question, shouted, word\)",
    ),
    (
        "a prompt column map naming a column the file lacks, named before any row is read",
        lambda d: edit(d / "task.yaml", lambda s: s["data"]["columns"].update(prompt="query")),
        1,
        r"^task 'loud' .*data.columns maps 'prompt' to column 'query', which data.train .*train.parquet does "
        r"not have \(its columns: question, shouted, word\)",
    ),
    (
        "an id column map naming a column the held-out file lacks",
        id_in_train_only,
        1,
        r"data.columns maps 'id' to column 'qid', which data.heldout .*heldout.jsonl does not have "
        r"\(its columns: question, shouted, word\)",
    ),
    (
        "gold answers that all score 0 (the reward reads another column)",
        lambda d: edit(d / "task.yaml", lambda s: s["rewards"][0].update(function="reward.py:against_word")),
        1,
        r"every gold answer of 20 held-out rows scores 0 with its rewards \(reward.py:against_word\): either the "
        r"answer column \('shouted'\) or the reward is wrong; the first row: prompt 'loud: wai",
    ),
    (
        "gold answers that score low",
        lambda d: edit(d / "task.yaml", lambda s: s["rewards"][0].update(function="reward.py:lenient")),
        0,
        r"warning rewards: the gold answers of 20 held-out rows score only 0.250 \(below 0.5\)",
    ),
    (
        "an eval asking a field the rows lack",
        lambda d: edit(d / "eval.yaml", lambda e: e.update(doc_to_text="questoin")),
        1,
        r"asks every item the same text, 'questoin', where the spec's first held-out row asks 'loud: wai.* =': "
        r"its doc_to_text names no field of the rows",
    ),
    (
        "an eval scoring against another column",
        lambda d: edit(d / "eval.yaml", lambda e: e.update(doc_to_target="word")),
        1,
        r"expects 'wai.*' for 'loud: wai.* =', where the spec's held-out row answers 'WAI.*': the eval's "
        r"doc_to_target is not the task's answer column",
    ),
    (
        "an eval over other data",
        lambda d: edit(d / "eval.yaml", lambda e: e.update(doc_to_text="{{word}} please")),
        1,
        r"renders the prompt 'wai.* please', which is no held-out prompt of the spec \(its first: 'loud: wai",
    ),
    (
        "a chat task's eval asking a field the rows lack (compared with the last user turn)",
        lambda d: chat_eval(d, doc_to_text="txet"),
        1,
        r"asks every item the same text, 'txet', where the spec's first held-out row asks 'loud: wai.* =': ",
    ),
    (
        "a chat task's eval scoring against another column",
        lambda d: chat_eval(d, doc_to_target="word"),
        1,
        r"expects 'wai.*' for 'loud: wai.* =', where the spec's held-out row answers 'WAI.*'",
    ),
]


@pytest.mark.parametrize(("case", "change", "exit_code", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(
    tmp_path: Path, case: str, change: Callable[[Path], None], exit_code: int, message: str
) -> None:
    folder = good_task(tmp_path)
    change(folder)
    code, text = run_check(folder)
    assert code == exit_code, text
    assert re.search(message, text), text


def test_a_failing_reward_shows_its_own_frames_once(tmp_path: Path) -> None:
    folder = good_task(tmp_path)
    edit(folder / "task.yaml", lambda s: s["rewards"][0].update(function="reward.py:buggy"))
    out = CliRunner().invoke(app, ["task", "check", str(folder)], env={"COLUMNS": "400"})
    assert out.exit_code == 1, out.output
    text = out.output
    assert text.count("ZeroDivisionError: division by zero") == 1, text
    assert text.count("Traceback") == 1
    assert 'reward.py", line 12, in helper' in text and 'reward.py", line 15, in buggy' in text
    assert "multiprocessing" not in text and "mint_core" not in text, text
    assert len(text.strip().splitlines()) < 16, text


def test_with_a_base_the_dry_run_tries_four_rounds_before_it_refuses(tmp_path: Path) -> None:
    """`--base`: the base's own completions of 8 prompts, then 8 more while they all score the same, up to 4 rounds
    (as training's dry run): a tiny random base never writes a shouted word, so all 4 x 64 score 0 and the check
    fails naming the task and the count."""
    base = save_tiny_base(tmp_path / "base")
    folder = good_task(tmp_path)
    out = CliRunner().invoke(app, ["task", "check", str(folder), "--base", str(base)], env={"COLUMNS": "400"})
    text = re.sub(r"\s+", " ", out.output)
    assert out.exit_code == 1, text
    assert "task 'loud': its reward gave all 256 of the base's completions the same score 0" in text, text
