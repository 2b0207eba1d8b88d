"""What a person reads from the main job: one progress bar per training phase instead of a line per GRPO step (a
few lines in a kept log), no progress bars of libraries, tables at their natural width in a file or a pipe, and a
last screen that says what happened."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from flows.canary import CanaryOutcome
from flows.forms import PolicyOutcome, WaveReport
from flows.lifecycle import STEP_RECORD
from mint_app.job.progress import step_bar
from mint_app.job.report import what_happened

STEPS = 300


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """A root log handler writing to a buffer, as the CLI's handler writes to stderr."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield buf
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _train(log: logging.Logger) -> None:
    """What the wave flow logs while it trains: a record per GRPO step (with its numbers), and other lines."""
    log.info("probe before training")
    for step in range(1, STEPS + 1):
        reward = {"add": 0.4 + step / 1000, "sort": 0.6}
        extra = {STEP_RECORD: {"step": step, "steps": STEPS, "reward": reward}}
        log.info("step %d/%d: reward %s", step, STEPS, reward, extra=extra)
        if step == STEPS // 2:
            log.info("probe after step %d", step)
    log.info("exported add")


def test_kept_log_has_a_few_lines_per_phase_and_no_step_lines(log_lines: io.StringIO) -> None:
    out = io.StringIO()
    console = Console(file=out, width=400)  # a file: not a terminal
    with step_bar(console, "GRPO add, sort"):
        _train(logging.getLogger("flow"))
    logging.getLogger("flow").info("after the phase")
    shown = out.getvalue().splitlines()
    assert [re.search(r"step (\d+)/300", line).group(1) for line in shown] == ["75", "150", "225", "300"]  # type: ignore[union-attr]
    assert "mean reward add 0.700, sort 0.600" in shown[-1] and re.search(r"\d+\.\d\d s/step", shown[-1])
    logged = log_lines.getvalue().splitlines()
    assert logged == ["probe before training", "probe after step 150", "exported add", "after the phase"]


def test_terminal_draws_one_bar_and_prints_other_lines_above_it(log_lines: io.StringIO) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with step_bar(console, "GRPO add, sort"):
        _train(logging.getLogger("flow"))
    text = out.getvalue()
    assert "300/300" in text and "GRPO add, sort" in text
    assert "probe after step 150" in text  # logged while the bar is drawn: printed above it, not into it
    assert "step 150/300: reward" not in text + log_lines.getvalue()
    # the lines before the first step and after the last went out as usual, the one during the bar through the console
    assert log_lines.getvalue().splitlines() == ["probe before training", "exported add"]


def _outcome(
    policy: str, status: str, candidate: str, after: str, canary: CanaryOutcome | None = None
) -> PolicyOutcome:
    return PolicyOutcome.model_validate(
        {
            "policy": policy,
            "status": status,
            "candidate": candidate,
            "champion_before": None,
            "champion_after": after,
            "canary": canary,
        }
    )


def test_last_screen_says_what_happened() -> None:
    canary = CanaryOutcome(
        policy="add", version=1, champion_before=None, decision="promoted", reason="", requests=2048,
        scored=2000, diff=0.1, lo=0.01, hi=0.2, seconds=60.0,
    )  # fmt: skip
    step0 = canary.model_copy(update={"version": 3, "decision": "rolled back", "requests": 1500})
    first = WaveReport(
        outcomes=[
            _outcome("add", "promoted", "add/v1", "add/v1", canary),
            _outcome("sort", "promoted", "sort/v1", "sort/v1"),
        ],
        curve=[],
        timings=[],
    )
    main = WaveReport(
        outcomes=[
            _outcome("add", "rejected", "add/v2", "add/v1"),
            _outcome("sort", "promoted", "sort/v2", "sort/v2"),
        ],
        curve=[],
        timings=[],
    )
    lines = what_happened(
        [("first", first), ("main", main)], [("step-0", step0)], "sort back from v2 to v1", 409.0
    )
    assert lines == [
        "add: first revision promoted (add/v1), by its canary after 2,048 requests; this round's candidate rejected "
        "(add/v2); serves add/v1",
        "sort: first revision promoted (sort/v1); this round's candidate promoted (sort/v2); serves sort/v2",
        "rollback: sort back from v2 to v1",
        "canary add/v3 (step-0): rolled back after 1,500 requests",
        "in 6 min 49 s",
    ]


WIDE_TABLE = textwrap.dedent(
    """
    from rich.console import Console
    from rich.table import Table
    from mint_app.console import make_console

    console = make_console() if "kept" in __import__("sys").argv else Console()
    table = Table(*[f"column {i} candidate champion" for i in range(6)])
    table.add_row(*[f"value {i} with its reasons spelled out" for i in range(6)])
    console.print(table)
    """
)


@pytest.mark.parametrize("console", ["kept", "rich's default"])
def test_tables_keep_their_width_in_a_pipe(console: str) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    out = subprocess.run(
        [sys.executable, "-c", WIDE_TABLE, console], capture_output=True, text=True, check=True, env=env
    ).stdout
    cut = "…" in out or "column 5 candidate champion" not in out.replace("\n", " ")
    assert cut == (console != "kept"), out  # rich's default cuts at 80 columns: the test can tell


QUIET = textwrap.dedent(
    """
    import json, sys
    data = sys.argv[1]
    if sys.argv[2] == "quiet":
        from mint_app.console import quiet_libraries
        quiet_libraries()
    import datasets
    datasets.load_dataset("json", data_files=data, split="train", cache_dir=sys.argv[3])
    """
)


@pytest.mark.parametrize("mode", ["quiet", "as is"])
def test_no_library_progress_bars(mode: str, tmp_path: Path) -> None:
    data = tmp_path / "suite.jsonl"
    data.write_text("".join(f'{{"prompt": "add: {i}+1 =", "answer": "{i + 1}"}}\n' for i in range(50)))
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if not k.endswith("PROGRESS_BARS") and k != "TQDM_DISABLE"
    }
    got = subprocess.run(
        [sys.executable, "-c", QUIET, str(data), mode, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    noisy = "Generating train split" in got.stderr + got.stdout
    assert noisy == (mode != "quiet"), got.stderr[-2000:]


BAR = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "mint":
        import mint_app  # what every `mint` command imports first
    from tqdm import tqdm
    for _ in tqdm(range(3), desc="a library's bar"):  # as lm-eval's per-task and "Requesting API" bars: no disable=
        pass
    """
)


@pytest.mark.parametrize("process", ["mint", "plain"])
def test_library_tqdm_bars_are_off_in_mint(process: str) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "TQDM_DISABLE"}
    got = subprocess.run(
        [sys.executable, "-c", BAR, process], capture_output=True, text=True, check=True, env=env
    )
    assert ("a library's bar" in got.stderr) == (process == "plain"), got.stderr


def test_the_wave_table_shows_what_an_adapter_forgot_beside_its_guards() -> None:
    """The job's per-policy table: a user's policy (no guards) shows each built-in task's change marked "not a
    guard"; a built-in policy shows its guards' changes; the gate's reasons say the same in words."""
    from mint_app.job.report import print_outcomes
    from mint_core.eval.gate import GatePolicy, SuiteScore, decide

    def paired(name: str, n: int, both: int, b: int, c: int) -> tuple[SuiteScore, SuiteScore]:
        rest = n - both - b - c
        cand = [True] * both + [True] * b + [False] * c + [False] * rest
        base = [True] * both + [False] * b + [True] * c + [False] * rest
        return (
            SuiteScore(name=name, score=sum(cand) / n, n=n, correct=cand),
            SuiteScore(name=name, score=sum(base) / n, n=n, correct=base),
        )

    shapes = {"shout": (320, 0, 120, 0), "sort": (320, 80, 2, 161), "add": (320, 50, 10, 12)}
    pairs = {k: paired(k, *v) for k, v in shapes.items()}
    cand = [c for c, _ in pairs.values()]
    base = [b for _, b in pairs.values()]
    mine = decide(GatePolicy(suite="shout", info_suites=["sort", "add"]), cand, base, baseline="base")
    theirs = decide(
        GatePolicy(suite="add", guard_tasks=["sort"], guard_suites=[], info_suites=[]),
        [pairs["add"][0], pairs["sort"][0]],
        [pairs["add"][1], pairs["sort"][1]],
        baseline="base",
    )
    report = WaveReport(
        outcomes=[
            PolicyOutcome(
                policy=name,
                status="promoted" if d.passed else "rejected",
                candidate=f"{name}/v1",
                champion_before=None,
                champion_after=f"{name}/v1" if d.passed else None,
                reasons=d.reasons,
                decision=d,
                scores={"candidate": {}, "base": {}},
            )
            for name, d in (("shout", mine), ("add", theirs))
        ],
        curve=[],
        timings=[],
    )
    console = Console(record=True, width=400)
    print_outcomes(report, "first revisions", console)
    text = console.export_text()
    assert "sort -0.497 (not a guard), add -0.006 (not a guard)" in text
    assert "sort -0.497" in text.split("add/v1")[1]  # add's guard, a failing one, without the mark
    assert "changes on suites that do not gate it: sort -0.497 (not a guard)" in text
