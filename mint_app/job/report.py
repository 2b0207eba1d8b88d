"""What the main job shows: each step's time, the waves' outcomes and the gate's reasons, the final table, the
summary file, the canaries, and in a few lines what happened."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flows.canary import CanaryOutcome
from flows.forms import PolicyOutcome, WaveReport
from mint_app.console import rule
from mint_app.job.config import MainJobConfig
from mint_core import access
from mint_core.lifecycle.workspace import Workspace
from tasks.registry import EXPERIMENT


class Timer:
    """The job's steps and their seconds, printed as each ends and as a table at the end."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rows: list[tuple[str, float, str]] = []
        self.t0 = time.perf_counter()

    @contextmanager
    def step(self, name: str) -> Iterator[list[str]]:
        """Time a step; the yielded list collects a short note for the table."""
        rule(self.console, f"[bold]{name}")
        note: list[str] = []
        t0 = time.perf_counter()
        try:
            yield note
        except BaseException:
            self.console.print(f"[red]✗[/] {name} [dim]({time.perf_counter() - t0:.1f} s)[/]")
            raise
        s = time.perf_counter() - t0
        self.rows.append((name, s, "; ".join(note)))
        self.console.print(f"[green]✓[/] {name} [dim]({s:.1f} s)[/]")

    def table(self) -> Table:
        table = Table("step", "seconds", "what", title="main job: time per step")
        for name, s, note in self.rows:
            table.add_row(name, f"{s:.1f}", note)
        table.add_row("[bold]total[/]", f"[bold]{time.perf_counter() - self.t0:.1f}[/]", "")
        return table


def _score(o: PolicyOutcome, side: str, suite: str) -> str:
    got = o.scores.get(side, {}).get(suite)
    return "-" if got is None else f"{got.score:.3f}"


def _p(o: PolicyOutcome, suite: str) -> str:
    """The paired test's p-value on the own suite (gain check), '-' when nothing was compared."""
    check = o.decision.check(f"gain:{suite}") if o.decision else None
    return "-" if check is None or check.stats is None else f"{check.stats.p_value:.2g}"


def print_outcomes(report: WaveReport, title: str, console: Console) -> None:
    """Each policy's outcome with the scores the gate compared (base -> champion -> candidate on its own
    suite), the paired test's p-value, the change on every other suite (its guards, and those that do not gate
    it), then the gate's reasons verbatim (`Text`: no markup, no emoji codes such as `:guard:`)."""
    table = Table(
        "policy",
        "candidate",
        "vs",
        "own suite: base / champion / candidate",
        "p",
        "other suites: change (guard / not a guard)",
        "gate",
        "champion",
        title=title,
        caption_justify="left",
    )
    style = {"promoted": "green", "rejected": "yellow", "failed": "red", "unchanged": "dim"}
    for o in report.outcomes:
        task = o.policy  # the main job names each policy after its task
        versus = o.decision.baseline if o.decision and o.decision.baseline else "-"
        moved = o.champion_before or "-"
        if o.champion_after != o.champion_before:
            moved += f" -> {o.champion_after}"
        table.add_row(
            o.policy,
            o.candidate or "",
            versus,
            f"{_score(o, 'base', task)} / {_score(o, 'champion', task)} / {_score(o, 'candidate', task)}",
            _p(o, task),
            _others(o),
            Text(o.status, style=style.get(o.status, "")),
            moved,
        )
    table.caption = (
        "scores: lm-eval through the server, greedy, exact match; p: exact McNemar on the same items, "
        "candidate vs what it was compared with (vs)"
    )
    console.print(table)
    for o in report.outcomes:
        # soft_wrap: one line in a kept log, however long the reasons
        console.print(Text(f"  gate {o.candidate}: " + "; ".join(o.reasons)), soft_wrap=True)


def _others(o: PolicyOutcome) -> Text:
    """The candidate's change on every suite but its own: a guard's in the verdict's colour, one that does not gate
    it dim and marked, so what an adapter forgot shows whether or not it rejects it."""
    out = Text()
    for c in o.decision.checks if o.decision else []:
        if c.stats is None or c.name.startswith("gain:"):
            continue
        kind, suite = c.name.split(":", 1)
        if out:
            out.append(", ")
        if kind == "info":
            out.append(f"{suite} {c.stats.effect:+.3f} (not a guard)", style="dim")
        else:
            out.append(f"{suite} {c.stats.effect:+.3f}", style="" if c.passed else "red")
    return out or Text("-")


def _outcome_doc(o: PolicyOutcome) -> dict[str, Any]:
    checks = []
    for c in o.decision.checks if o.decision else []:
        row: dict[str, Any] = {"check": c.name, "passed": c.passed}
        if c.stats is not None:
            st = c.stats
            row |= {
                "effect": st.effect,
                "ci": list(st.ci),
                "p_value": st.p_value,
                "n": st.n,
                "candidate_only": st.b,
                "baseline_only": st.c,
                "mde": st.mde,
            }
        checks.append(row)
    return {
        "candidate": o.candidate,
        "status": o.status,
        "compared_with": o.decision.baseline if o.decision else None,
        "gate_passed": o.decision.passed if o.decision else None,
        "champion_before": o.champion_before,
        "champion_after": o.champion_after,
        "reused": o.reused,
        "scores": {
            side: {suite: {"score": sc.score, "n": sc.n} for suite, sc in by_suite.items()}
            for side, by_suite in o.scores.items()
        },
        "checks": checks,
        "reasons": o.reasons,
    }


def write_summary(cfg: MainJobConfig, round_name: str, waves: list[tuple[str, WaveReport]]) -> Path:
    """`<state dir>/runs/<round>/summary.json`: per policy, the base's scores and each wave's candidate with
    its scores, n, the gate's checks (effect, CI, p-value, n) and verdict; for scripts and dashboards."""
    policies: dict[str, dict[str, Any]] = {}
    for wave_name, report in waves:
        for o in report.outcomes:
            entry = policies.setdefault(o.policy, {"base": None, "waves": {}})
            base = o.scores.get("base")
            if base and entry["base"] is None:
                entry["base"] = {suite: {"score": sc.score, "n": sc.n} for suite, sc in base.items()}
            entry["waves"][wave_name] = _outcome_doc(o)
    doc = {
        "round": round_name,
        "written": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "policies": policies,
    }
    path = cfg.state_dir / "runs" / round_name / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def final_table(waves: list[tuple[str, WaveReport]]) -> Table:
    """Per policy: the base, the first revision (with its p-value against the base), the champion the main
    wave started from, its candidate (with its p-value against that champion) and the verdicts."""
    by: dict[str, dict[str, PolicyOutcome]] = {}
    for wave_name, report in waves:
        for o in report.outcomes:
            by.setdefault(o.policy, {})[wave_name] = o
    table = Table(
        "policy",
        "base",
        "first revision (p vs base)",
        "champion",
        "candidate (p vs champion)",
        "verdict",
        "serves",
        title="base -> champion -> candidate (own suite, exact match)",
    )
    for policy, got in by.items():
        first, main = got.get("first"), got.get("main")
        any_o = main or first
        assert any_o is not None
        first_cell = "-"
        if first is not None:
            first_cell = f"{_score(first, 'candidate', policy)} (p={_p(first, policy)}, {first.status})"
        champ_cell = "-"
        if main is not None and main.champion_before:
            champ_cell = f"{_score(main, 'champion', policy)} ({main.champion_before})"
        cand_cell = f"{_score(main, 'candidate', policy)} (p={_p(main, policy)})" if main is not None else "-"
        table.add_row(
            policy,
            _score(any_o, "base", policy),
            first_cell,
            champ_cell,
            cand_cell,
            main.status if main is not None else "-",
            any_o.champion_after or "-",
        )
    return table


def what_happened(
    waves: list[tuple[str, WaveReport]],
    canaries: list[tuple[str, CanaryOutcome]],
    rollback: str,
    seconds: float,
) -> list[str]:
    """The job in a few lines: per policy what each wave's candidate became and what serves now; the rollback;
    each canary's decision; the time."""
    by: dict[str, dict[str, PolicyOutcome]] = {}
    for wave_name, report in waves:
        for o in report.outcomes:
            by.setdefault(o.policy, {})[wave_name] = o
    lines = []
    for policy, got in by.items():
        said = []
        for wave_name, what in (("first", "first revision"), ("main", "this round's candidate")):
            one = got.get(wave_name)
            if one is None:
                continue
            how = f" ({one.candidate})" if one.candidate else ""
            if one.canary is not None:
                how += f", by its canary after {one.canary.requests:,} requests"
            said.append(f"{what} {one.status}{how}")
        last = got.get("main") or got.get("first")
        serves = last.champion_after if last is not None and last.champion_after else "the base (no champion)"
        lines.append(f"{policy}: {'; '.join(said)}; serves {serves}")
    lines.append(f"rollback: {rollback}")
    for what, c in canaries:
        lines.append(f"canary {c.policy}/v{c.version} ({what}): {c.decision} after {c.requests:,} requests")
    lines.append(f"in {int(seconds // 60)} min {seconds % 60:.0f} s")
    return lines


def rewards_line(report: WaveReport) -> str:
    """First and last step's mean rollout reward per policy."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for c in report.curve:
        first.setdefault(c["policy"], c["reward"])
        last[c["policy"]] = c["reward"]
    return ", ".join(f"{p} {first[p]:.2f} -> {last[p]:.2f}" for p in first)


def timings_table(report: WaveReport, title: str) -> Table:
    """The flow's task calls grouped by task: calls, seconds in the flow, mint_core work inside."""
    rows: dict[str, list[float]] = {}
    for t in report.timings:
        r = rows.setdefault(t.step, [0, 0.0, 0.0])
        r[0] += 1
        r[1] += t.wall_s
        r[2] += t.work_s or 0.0
    table = Table("task", "calls", "seconds", "work inside", title=title)
    for step, (n, wall, work) in rows.items():
        table.add_row(step, str(int(n)), f"{wall:.1f}", f"{work:.1f}" if work else "")
    return table


def canaries_table(canaries: list[tuple[str, CanaryOutcome]]) -> Table:
    """Each canary of the job: what it compared, what the online test decided, on how many requests."""
    table = Table(
        "candidate",
        "vs",
        "decision",
        "requests",
        "canary - champion [95% always-valid]",
        "s",
        title="canaries: the online test on live traffic",
        caption="requests: scored answers the test read (each the task's reward of one served answer)",
    )
    style = {"promoted": "green", "rolled back": "red"}
    for what, o in canaries:
        diff = "-" if o.diff is None else f"{o.diff:+.3f} [{o.lo:+.3f}, {o.hi:+.3f}]"
        table.add_row(
            f"{o.policy}/v{o.version} ({what})",
            f"v{o.champion_before}" if o.champion_before else "base",
            Text(o.decision, style=style.get(o.decision, "yellow")),
            f"{o.scored:,}",
            diff,
            f"{o.seconds:.0f}",
        )
    return table


def count_outcomes(report: WaveReport) -> str:
    by: dict[str, int] = {}
    for o in report.outcomes:
        by[o.status] = by.get(o.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in by.items())


def credentials_line(run_dir: Path) -> str:
    """Where the stack's credentials are (its access file: the admin's MLflow login, the default serving key,
    the Prefect auth string), never a secret: for the job's "where to look"."""
    path = access.access_path(run_dir)
    try:
        found = access.load(path)
    except access.AccessError as e:
        return f"no credentials: {e}"
    admins = ", ".join(n for n, u in sorted(found.users.items()) if u.role == "admin") or "none"
    keys = ", ".join(sorted(found.keys)) or "none"
    return (
        f"{path} (admin: {admins}; serving keys: {keys}; the Prefect auth string): "
        f"mint access show --secrets{'' if run_dir == Path('.mint/run') else f' --state-dir {run_dir}'}"
    )


def training_runs_url(ws: Workspace, mlflow: str) -> str:
    """The runs view of the lifecycle's experiment (a table of the training runs). The experiment's own page,
    `#/experiments/<id>`, opens on MLflow 3's GenAI overview ("Traces 0") instead."""
    exp = ws.registry().client.get_experiment_by_name(EXPERIMENT)
    return (
        f"{mlflow}/#/experiments/{exp.experiment_id}/runs" if exp is not None else f"{mlflow}/#/experiments"
    )
