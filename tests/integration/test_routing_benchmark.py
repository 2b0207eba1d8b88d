"""benchmarks/routing.py runs end to end and reports every figure issue 44 asks for.

The replay runs on a small table made here (three tasks, each with one arm clearly best on its prompts, a decoy,
an older and a regressed revision), so it is fast and its outcome is known: a router that reads the prompt must
beat the best single arm offline. The slow test builds a real table at a tiny size (trains the arms on the
built-in base for two steps) and checks the whole path: training, answers, rewards, cache, replay.
"""

from __future__ import annotations

import json
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mint_testkit.harness import save_tiny_base

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GOALS = {
    "offline % of oracle",
    "offline % of gap recovered",
    "online % of oracle, last quarter",
    "online regret / epsilon-greedy's",
    "requests until traffic follows",
    "decide p95 ms, table's arms",
    "decide p95 ms, catalog",
}


@pytest.fixture
def run_benchmark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[dict[str, Any], str]]:
    """run_benchmark(*args): the JSON object routing.py printed last, and everything it printed."""

    def run(*args: str) -> tuple[dict[str, Any], str]:
        monkeypatch.setattr(sys, "argv", ["routing.py", *args])
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
        runpy.run_path(str(ROOT / "benchmarks" / "routing.py"), run_name="__main__")
        out = capsys.readouterr().out
        return json.loads(out.strip().splitlines()[-1]), out

    return run


def _table(folder: Path) -> None:
    """A table whose best arm is the task's own: `t<k>` earns 1.0 on task k's prompts and 0.2 elsewhere; `t0-v1`
    and `t0@v1` 0.6 on task 0; the decoy `t1-pro` and every `@regressed` 0.0; the base 0.4."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _reward_table import RewardTable, paraphrase
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from mint_core.data.generators import Example

    tasks = ["t0", "t1", "t2"]
    held = [
        Example(id=f"{t}-{i}", task=t, prompt=f"{verb}: {i * 7919 % 1000:03d} =", answer="x", columns={})
        for t, verb in zip(tasks, ["add", "reverse", "upper"], strict=True)
        for i in range(40)
    ]
    rows = held + [paraphrase(e, i) for i, e in enumerate(held)]
    arms = ["base", "t0", "t0-v1", "t1", "t1-pro", "t2"]
    extra = ["t0@regressed", "t0@v1", "t1@regressed", "t1@v1"]
    cols = arms + extra
    R = np.zeros((len(rows), len(cols)), dtype=np.float32)
    for i, e in enumerate(rows):
        k = tasks.index(e.task)
        R[i, 0] = 0.4
        for j, t in enumerate(tasks):
            R[i, arms.index(t)] = 1.0 if j == k else 0.2
        R[i, cols.index("t0-v1")] = R[i, cols.index("t0@v1")] = 0.6 if k == 0 else 0.2
        R[i, cols.index("t1@v1")] = 0.6 if k == 1 else 0.2
    RewardTable(
        prompts=[str(e.prompt) for e in rows],
        tasks=[e.task for e in rows],
        wording=["heldout"] * len(held) + ["paraphrase"] * len(held),
        source=list(range(len(held))) * 2,
        columns=cols,
        rewards=R,
        arms=arms,
        claims={"base": None, "t0": "t0", "t0-v1": "t0", "t1": "t1", "t1-pro": "t1", "t2": "t2"},
        revisions={t: {"v1": f"{t}@v1", "regressed": f"{t}@regressed"} for t in ("t0", "t1")},
    ).save(folder)


def _check(result: dict[str, Any], out: str, seeds: int) -> None:
    assert {g["goal"] for g in result["goals"]} == GOALS
    assert len(result["offline"]) == len(result["online"]) == seeds
    for name in (
        "router:char",
        "router:word",
        "router:char+anchors",
        "router:base-hidden",
        "best single",
        "task known",
        "random",
        "oracle",
        "task oracle",
    ):
        assert name in result["offline"][0] and name in result["online"][0], name
        assert result["offline"][0][name]["pct_task_oracle"] >= 0, name
    for name in ("router:char", "epsilon-greedy", "Thompson (context-free)", "best single", "oracle"):
        row = result["online"][0][name]
        assert 0 <= row["pct_oracle_last"] <= 100 and row["regret"] >= 0, name
    assert result["online"][0]["oracle"]["regret"] == 0
    for key in ("arms_ms", "catalog_ms", "arms_cpu_ms", "catalog_cpu_ms"):
        assert result["overhead"][key]["p95_ms"] > 0, key
    # the cold decision, and its float64 baseline of the same run
    for key in ("float32_rows", "float64_full"):
        assert result["overhead"]["arms_cold_ms"][key]["p95_ms"] > 0, key
    # hindsight over finer groups is never worse: per task, then per task and length, then per row
    for seed in result["offline"]:
        task, length = seed["task oracle"]["reward"], seed["task+length oracle"]["reward"]
        assert task <= length + 1e-6 and length <= seed["oracle"]["reward"] + 1e-6
    assert result["hidden_features_ms"]["p95_ms"] > 0
    assert ("PASS" in out or "FAIL" in out) and "end-to-end p95" in out


def test_the_replay_reports_every_figure_and_the_router_reads_the_prompt(
    tmp_path: Path, run_benchmark: Callable[..., tuple[dict[str, Any], str]]
) -> None:
    _table(tmp_path / "table")
    base = save_tiny_base(
        tmp_path / "base"
    )  # the base-hidden features' base: CI's clean clone builds no data/
    result, out = run_benchmark(
        *("--table", str(tmp_path / "table"), "--base", str(base), "--seeds", "0,1", "--requests", "240"),
        *("--catalog", "1000"),
    )
    _check(result, out, 2)
    for seed in result["offline"]:
        assert seed["router:char"]["pct_oracle"] > seed["best single"]["pct_oracle"] + 10
        assert seed["router:base-hidden"]["pct_oracle"] > seed["best single"]["pct_oracle"] + 10
        assert seed["router:char+anchors"]["pct_oracle"] > seed["best single"]["pct_oracle"] + 10
        assert seed["oracle"]["pct_oracle"] == 100
        # each task's own arm is its best on every row: told the task, the reference serves it, as the task oracle
        assert seed["task known"]["pct_task_oracle"] == pytest.approx(100)
        assert seed["task known"]["pct_oracle"] == pytest.approx(100)
        assert seed["router:char"]["pct_task_oracle"] == pytest.approx(seed["router:char"]["pct_oracle"])
    assert "% task oracle" in out
    assert result["events"]["better"] == "t0" and result["events"]["worse"] == "t1"


@pytest.mark.slow  # trains six policies for two steps on the built-in base, then answers 14 x 100 prompts
def test_the_reward_table_is_built_from_trained_arms_and_cached(
    tmp_path: Path, run_benchmark: Callable[..., tuple[dict[str, Any], str]]
) -> None:
    args = ("--steps", "2", "--old-steps", "1", "--heldout", "10", "--cache", str(tmp_path))
    result, out = run_benchmark(*args, "--seeds", "0", "--requests", "80", "--catalog", "1000")
    _check(result, out, 1)
    arms = set(result["arms"])
    assert {"base", "add", "add-v1", "add-expert", "upper-pro"} <= arms and len(arms) == 11
    arrow = result["offline"][0]["arrow (from weights)"]  # scored from the adapters the table wrote
    assert 0 < arrow["pct_oracle"] <= 100, arrow
    # every arm answered every row again, from the same adapters, to the same rewards; a model of the answers picks
    assert result["answers"]["reproduced"] >= 0.995, result["answers"]
    answers = result["offline"][0]["answers (every arm answers)"]
    assert 0 < answers["pct_oracle"] <= 100, answers
    assert result["rows"] == 2 * 10 * 5  # held-out and paraphrased, every task
    cached = Path(result["table"]["cache"])
    assert (cached / "rewards.npy").is_file() and (
        cached / "adapters" / "add" / "adapter_config.json"
    ).is_file()
    again, _ = run_benchmark(*args, "--seeds", "0", "--requests", "80", "--catalog", "1000")
    assert again["table"]["cache"] == str(cached) and again["offline"] == result["offline"]
    # the answers are read back from beside the table, not computed again
    assert (cached / "answers.npz").is_file() and again["answers"] == result["answers"]


def test_the_answers_reference_learns_which_answers_to_trust() -> None:
    """Three arms: on every row two agree and one is alone; the rewards make the lone arm right on the train rows
    only when it is surer of its tokens than the pair. The fit must pick the pair, or the sure lone arm, per row."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _arm_answers import ArmAnswers, answer_choices
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rng = np.random.default_rng(0)
    n = 400
    lone = rng.integers(3, size=n)
    sure = rng.random(n) < 0.3
    texts = np.full((n, 3), "pair", dtype=object)
    texts[np.arange(n), lone] = "alone"
    mean_lp = np.full((n, 3), -0.5)
    mean_lp[np.arange(n), lone] = np.where(sure, -0.05, -2.0)
    rewards = np.zeros((n, 3), dtype=np.float32)
    for i in range(n):
        rewards[i] = [1.0 if (j == lone[i]) == sure[i] else 0.0 for j in range(3)]
    ans = ArmAnswers(texts.astype(str), mean_lp, mean_lp.copy(), reproduced=1.0, generate_s=0.0)
    rows = np.arange(n)
    picked = answer_choices(ans, rewards, rows[:200], rows[200:])
    assert picked is not None
    assert rewards[rows[200:], picked].mean() == 1.0
    stale = ArmAnswers(ans.texts, mean_lp, mean_lp, reproduced=0.9, generate_s=0.0)
    # answers that do not score to the table's rewards are not used
    assert answer_choices(stale, rewards, rows[:200], rows[200:]) is None
