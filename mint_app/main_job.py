"""The main job (`mint run`, `make run`): the whole lifecycle on the embedded default, every step timed.

1. build what is missing with DVC: the task data, the built-in base, the eval suites' data, the data checks;
2. start MLflow, Prefect and `mint serve` on the built-in base (reusing those already running); a Prefect worker
   with every deployment of infra/prefect.yaml registered starts beside step 3, and the job waits for it in 6;
3. the `wave` flow: every policy without a champion gets its first revision (the gate has nothing to compare
   with), then a second wave trains every policy from its champion and gates the candidate against it;
4. a served completion from each policy's champion through the HTTP server, naming the revision that answered;
5. the `rollback` flow on a policy the second wave promoted, and a completion from the revision it restored;
6. the worker up; where to look: the Prefect flow runs, the MLflow models, the server; the servers are left
   running.

Everything it writes lives under one state directory (`.mint` by default, the same places `mint up` and the
flows' default `Workspace` use), so `mint up/down/status`, `mint registry` and `mint catalog` see the same state.
This module is command-line code: it reports on a rich console.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import redis
import torch
import transformers
from prefect.settings import PREFECT_API_URL, temporary_settings
from pydantic import Field
from pydantic_settings import SettingsConfigDict
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flows.canary import CanaryOutcome, canary_flow
from flows.lifecycle import PolicyOutcome, PolicyRun, Training, WaveFailed, WaveReport, wave
from flows.promotion import rollback_flow
from flows.reconcile import reconcile
from mint_app.console import quiet_libraries, rule
from mint_app.progress import step_bar
from mint_app.services import Service, ServiceError, ServiceName, ServicesConfig, services_for, start
from mint_core.data.spec import SpecError, prompt_text
from mint_core.data.spec import registry as task_registry
from mint_core.data.tasks import Prompt
from mint_core.engine.base import load_base
from mint_core.engine.device import check_device
from mint_core.errors import BaseError, MintError
from mint_core.eval.lm_eval_runner import EvalConfig
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.lifecycle import Workspace
from mint_core.lora.adapter import initial_adapter, save_adapter
from mint_core.rl.recipe import BUILTIN_PROMPTS_PER_STEP, BUILTIN_RECIPE, BUILTIN_STEPS, builtin_spec
from mint_core.serving.base_check import check_base
from mint_core.serving.traffic import Traffic
from mint_core.settings import Settings
from mint_core.types import Device
from tasks.canary import CanaryConfig
from tasks.registry import EXPERIMENT

STAGES = ("task_data", "builtin_base", "validate_data", "eval_sets")
"""The DVC stages the job needs, in pipeline order (the tiny random bases are for tests and are not built)."""


ENV_PREFIX = "MINT_RUN_"
"""`mint run` reads MainJobConfig fields from MINT_RUN_<FIELD> environment variables (after its --config file)."""


class MainJobError(MintError):
    """The main job could not go on; says which step and what to do."""


class MainJobConfig(Settings):
    """What `mint run` does and where.

    `MainJobConfig.load(file, **flags)` reads the file, then MINT_RUN_<FIELD> environment variables, then flags."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    policies: list[str] = Field(default_factory=lambda: ["add", "sort"], min_length=1)
    """Registered tasks (`mint task list`; a user's with `--tasks DIR`), one policy per task, named after it.
    Default: the built-in tasks GRPO
    measurably improves on the built-in base (see `mint_core.rl.recipe.BUILTIN_RECIPE` for why not the others)."""
    steps: int = Field(40, ge=1)
    """GRPO steps of the wave that trains every policy from its champion."""
    first_steps: int = Field(BUILTIN_STEPS, ge=1)
    """GRPO steps of the first wave, for the policies that have no champion yet (trained from the base)."""
    prompts_per_step: int = Field(BUILTIN_PROMPTS_PER_STEP, ge=1)
    """Prompts per policy per step, each sampled `group_size` times."""
    group_size: int = Field(BUILTIN_RECIPE.group_size, ge=2)
    """GRPO group size G."""
    learning_rate: float = Field(BUILTIN_RECIPE.learning_rate, gt=0)
    """AdamW learning rate of every policy's adapter."""
    temperature: float = Field(BUILTIN_RECIPE.temperature, gt=0)
    """Sampling temperature of the rollouts."""
    rank: int | None = Field(None, ge=1)
    """LoRA rank of every policy (alpha = 2 x rank). Default: each task's built-in rank (`rl.recipe.builtin_spec`:
    `add` 32, the others 8), with the learning rate scaled to it. The server the job starts accepts up to 32
    unless its serving config says otherwise (`ServicesConfig.serve_max_lora_rank`)."""
    eval_limit: int = Field(EVAL_LIMIT, ge=20)
    """Items per lm-eval task in the evaluation the gate reads (the suites hold 320, params.yaml
    eval_suites.limit; checks.eval wants >= 20). Why 320: mint_core.eval.results.EVAL_LIMIT."""
    guard_limit: int = Field(GUARD_LIMIT, ge=20)
    """Items per task of the guard group (generation, choice) in the gate's evaluation; the suites hold 320
    (params.yaml eval_suites.guard_limit). Why 320: mint_core.eval.results.GUARD_LIMIT."""
    seed: int = 0
    """Seeds the adapters' initialisation and the rollouts."""
    canary: list[str] = Field(default_factory=lambda: ["add"])
    """Policies whose first revision, once the gate passes it, is promoted through a canary (the online test on
    live traffic decides) instead of at once. Names not in `policies` are ignored."""
    canary_share: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of a policy's users (request keys) a canary answers, in the job's canaries."""
    canary_demo: bool = True
    """End with a canary of a deliberately worse candidate (the first policy's step-0 checkpoint: an adapter
    as PEFT initialises it, which answers as the base), which the online test rolls back."""
    traffic_concurrency: int = Field(8, ge=1)
    """Requests the built-in traffic generator keeps in flight to policies under a canary."""
    round: str | None = None
    """Names this run's training rounds (idempotency keys); default: a UTC timestamp, so every run trains."""
    state_dir: Path = Path(".mint")
    """Everything the job writes: run/ (services: pids, logs, databases, admin token), store/ (adapter store),
    catalog.db, lifecycle/ (checkpoints, cached task results)."""
    base: Path = Path("data/base")
    """The base the waves train and mint serve (or vLLM) serves: any Hugging Face causal-LM directory with its
    tokenizer (chat prompts use its chat template). Default: the built-in base (the DVC builtin_base stage's
    output)."""
    data_dir: Path = Path("data/tasks")
    """The task data (the DVC task_data stage's output)."""
    build: bool = True
    """Run the DVC step (off: use data/ as it is)."""
    host: str = "127.0.0.1"
    """Address the services bind to and are reached at."""
    mlflow_port: int = Field(5000, ge=1, le=65535)
    """MLflow tracking server, registry and UI."""
    prefect_port: int = Field(4200, ge=1, le=65535)
    """Prefect API and dashboard."""
    serve_port: int = Field(8000, ge=1, le=65535)
    """`mint serve` (the OpenAI/vLLM-compatible API)."""
    serving: Literal["mint", "vllm"] = "mint"
    """Who serves the policies (evaluation, promotion, completions): `mint`, the embedded engine in `mint serve`;
    `vllm`, a vLLM server from .venv-vllm (`make vllm-venv`) with `mint serve` as its front
    (`ServicesConfig.serving`). Training runs in this process either way."""
    worker_port: int = Field(4201, ge=1, le=65535)
    """Healthcheck of the Prefect worker that runs the deployments (dashboard runs, nightly retraining)."""
    torch_threads: int | None = Field(1, ge=1)
    """CPU threads of torch in this process (the trainer) and in a `mint serve` started here; None: torch's
    choice. 1 because on a 2-core machine shared with other busy processes OpenMP's spinning threads stall each
    other: a wave's GRPO step measured 1.2-2.2 s with 1 thread and 8-14 s with 2."""
    device: Device = "cpu"
    """Where the base, the adapters and the GRPO updates of the waves run, and what `mint serve` serves on: cpu,
    cuda or cuda:N; a CUDA device that is not visible stops the job before it starts anything."""


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


# ---- 1. DVC ------------------------------------------------------------------------------------------------


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


def _local_remote() -> Path | None:
    """The default DVC remote when it is a local folder that exists (a `dvc push` filled it)."""
    out = subprocess.run([_tool("dvc"), "remote", "list"], capture_output=True, text=True, env=_dvc_env())
    default = subprocess.run(
        [_tool("dvc"), "remote", "default"], capture_output=True, text=True, env=_dvc_env()
    ).stdout.strip()
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == default and "://" not in parts[1]:
            path = Path(parts[1])
            path = path if path.is_absolute() else (Path(".dvc") / path).resolve()
            return path if path.is_dir() and any(path.iterdir()) else None
    return None


def build(console: Console) -> list[str]:
    """Bring the job's DVC stages up to date, pulling from a local remote before building; what was done."""
    if not Path("dvc.yaml").is_file():
        raise MainJobError("no dvc.yaml here: run the main job from the repository root")
    done: list[str] = []
    remote = _local_remote()
    status = _dvc_status(list(STAGES))
    for stage in STAGES:
        entries = status.get(stage) or []
        if not entries:
            console.print(f"  {stage}: up to date")
            continue
        if _built_not_cached(entries):
            console.print(f"  {stage}: built, matches dvc.lock's inputs, not in DVC's cache (kept as is)")
            continue
        if remote is not None and _missing_outs(entries):
            t0 = time.perf_counter()
            subprocess.run(
                [_tool("dvc"), "pull", "--allow-missing", "-q", stage], env=_dvc_env(), check=False
            )
            if not _dvc_status([stage]).get(stage):
                console.print(f"  {stage}: pulled from {remote} ({time.perf_counter() - t0:.1f} s)")
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


# ---- 2. services -------------------------------------------------------------------------------------------


def services_config(cfg: MainJobConfig) -> ServicesConfig:
    return ServicesConfig.load(
        None,
        state_dir=cfg.state_dir / "run",
        host=cfg.host,
        mlflow_port=cfg.mlflow_port,
        prefect_port=cfg.prefect_port,
        serve_port=cfg.serve_port,
        serving=cfg.serving,
        worker_port=cfg.worker_port,
        serve_base=str(cfg.base.resolve()),
        serve_adapter_root=cfg.state_dir / "store",
        serve_device=cfg.device,
    )


def workspace(cfg: MainJobConfig, services: Mapping[ServiceName, Service]) -> Workspace:
    """The flows' workspace, agreeing with the services: the store `mint serve` reads, its admin token."""
    state = cfg.state_dir.resolve()
    return Workspace(
        tracking_uri=services["mlflow"].api_url,
        store=str(state / "store"),
        catalog_url=f"sqlite:///{state / 'catalog.db'}",
        base=cfg.base.resolve(),
        serving_url=services["serve"].api_url,
        admin_token_file=state / "run" / "serve.token",
        work_dir=state / "lifecycle",
        device=cfg.device,
    )


def redis_up(host: str = "127.0.0.1", port: int = 6379) -> bool:
    """Whether a Redis answers PING there (within a second). The job itself needs no Redis: promotions lock
    through leases, the catalog's by default (tasks.common.LeaseLocks)."""
    client = redis.Redis(host=host, port=port, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):  # refused, timed out, not Redis, or a Redis that wants a password
        return False
    finally:
        client.close()


# ---- 3. waves ----------------------------------------------------------------------------------------------


def canary_config(cfg: MainJobConfig) -> CanaryConfig:
    """The job's canaries: the share asked for, scores read every second, at most 5 minutes each."""
    return CanaryConfig(share=cfg.canary_share, poll_s=1.0, max_minutes=5.0)


def run_wave(
    cfg: MainJobConfig,
    ws: Workspace,
    names: list[str],
    steps: int,
    round_name: str,
    canary: list[str] | None = None,
) -> tuple[WaveReport, str]:
    """The wave flow over `names` (those in `canary` promoted through a canary); its report and flow run id."""
    runs = [
        PolicyRun(
            spec=builtin_spec(t, t, cfg.rank, cfg.learning_rate),
            canary=canary_config(cfg) if t in (canary or []) else None,
        )
        for t in names
    ]
    training = Training(
        steps=steps,
        prompts_per_step=cfg.prompts_per_step,
        grpo=BUILTIN_RECIPE.model_copy(
            update={
                "group_size": cfg.group_size,
                "learning_rate": cfg.learning_rate,
                "temperature": cfg.temperature,
            }
        ),
        seed=cfg.seed,
        data_dir=cfg.data_dir.resolve(),
        round=round_name,
    )
    state = wave(
        policies=runs,
        training=training,
        evaluation=EvalConfig(limit=cfg.eval_limit, guard_limit=cfg.guard_limit),
        workspace=ws,
        return_state=True,
    )
    flow_run_id = str(state.state_details.flow_run_id)
    try:
        report = state.result()
    except WaveFailed as e:
        raise MainJobError(f"the wave failed: {e}") from None
    assert report is not None
    return report, flow_run_id


def _score(o: PolicyOutcome, side: str, suite: str) -> str:
    got = o.scores.get(side, {}).get(suite)
    return "-" if got is None else f"{got.score:.3f}"


def _p(o: PolicyOutcome, suite: str) -> str:
    """The paired test's p-value on the own suite (gain check), '-' when nothing was compared."""
    check = o.decision.check(f"gain:{suite}") if o.decision else None
    return "-" if check is None or check.stats is None else f"{check.stats.p_value:.2g}"


def print_outcomes(report: WaveReport, title: str, console: Console) -> None:
    """Each policy's outcome with the scores the gate compared (base -> champion -> candidate on its own
    suite, the guard suite beside), the paired test's p-value, then the gate's reasons verbatim (`Text`: no
    markup, no emoji codes such as `:guard:`)."""
    table = Table(
        "policy",
        "candidate",
        "vs",
        "own suite: base / champion / candidate",
        "p",
        "guard: baseline -> candidate",
        "gate",
        "champion",
        title=title,
        caption_justify="left",
    )
    style = {"promoted": "green", "rejected": "yellow", "failed": "red", "unchanged": "dim"}
    for o in report.outcomes:
        task = o.policy  # the main job names each policy after its task
        versus = o.decision.baseline if o.decision and o.decision.baseline else "-"
        side = "champion" if "champion" in o.scores else "base"
        moved = o.champion_before or "-"
        if o.champion_after != o.champion_before:
            moved += f" -> {o.champion_after}"
        table.add_row(
            o.policy,
            o.candidate or "",
            versus,
            f"{_score(o, 'base', task)} / {_score(o, 'champion', task)} / {_score(o, 'candidate', task)}",
            _p(o, task),
            f"{_score(o, side, 'guard')} -> {_score(o, 'candidate', 'guard')}",
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


# ---- 4./5. served completions and a rollback ------------------------------------------------------------


def heldout_prompt(cfg: MainJobConfig, task: str, index: int = 0) -> tuple[Prompt, str]:
    """A held-out prompt of a task (never trained on; its spec's held-out rows) and its expected answer."""
    rows = task_registry().get(task).heldout_rows()
    ex = rows[index % len(rows)]
    return ex.prompt, ex.answer


def served_answer(ws: Workspace, model: str, prompt: Prompt) -> tuple[str, str | None]:
    """Greedy completion from the server under `model` (a chat prompt through the chat route): its text and the
    revision that answered."""
    max_tokens = 16
    with ws.client(timeout=60) as client:
        return client.ask(model, prompt, max_tokens=max_tokens, temperature=0.0)


def base_model_name(ws: Workspace) -> str:
    with ws.client() as client:
        models = client.models()
    bare = [m["id"] for m in models if not m.get("parent")]
    return str(bare[0]) if bare else Path(ws.base).name


SHOWN_PROMPTS = 3
"""Held-out prompts per policy in the served-completions table: one answer says little about a policy that is
right on three items in four."""
SEARCHED_PROMPTS = 40
"""Held-out prompts searched for ones where the champion and the base answer differently."""


def completions_table(cfg: MainJobConfig, ws: Workspace) -> tuple[Table, int]:
    """Per policy, `SHOWN_PROMPTS` held-out prompts (never trained on) where its champion (served under the
    policy's name) answers differently from the base: what the adapter changed, not what the base already knew.
    The caption says how many of the prompts searched differ at all."""
    reg = ws.registry()
    base_name = base_model_name(ws)
    table = Table(
        "policy", "prompt", "expected", "base says", "policy says", "answered by", title="served completions"
    )
    n = 0
    found: list[str] = []
    for task in cfg.policies:
        version = reg.alias_version(task, "champion")
        if version is None:
            table.add_row(task, "", "", "", "[yellow]no champion[/]", "")
            continue
        rev = reg.revision(task, version)
        shown = differ = 0
        for i in range(SEARCHED_PROMPTS):
            prompt, expected = heldout_prompt(cfg, task, i)
            base_text, _ = served_answer(ws, base_name, prompt)
            text, fp = served_answer(ws, task, prompt)
            if text.strip() == base_text.strip():
                continue
            differ += 1
            if shown == SHOWN_PROMPTS:
                continue
            shown += 1
            ok = "[green]✓[/]" if text.strip() == expected.strip() else "[red]✗[/]"
            base_ok = "✓ " if base_text.strip() == expected.strip() else "✗ "
            table.add_row(
                task,
                Text(prompt_text(prompt)),
                Text(expected.strip()),
                Text(base_ok + base_text.strip()),
                Text.from_markup(ok) + Text(f" {text.strip()}"),
                _who(fp, rev.digest, f"{task}/v{version}"),
            )
        found.append(f"{task} {differ} of {SEARCHED_PROMPTS}")
        n += 1
    table.caption = (
        "held-out prompts where the champion and the base answer differently (greedy); they differ on "
        + ", ".join(found)
    )
    return table, n


def _who(fingerprint: str | None, digest: str, address: str) -> str:
    """The revision that answered (the response's system_fingerprint), checked against the champion's digest."""
    got = (fingerprint or "").removeprefix("sha256:")
    if got == digest:
        return f"{address} {digest[:8]}"
    return f"[red]{got[:8]}, not {address}[/]"


def pick_rollback(report: WaveReport) -> str | None:
    """A policy the wave promoted over an earlier champion (so there is one to go back to)."""
    for o in report.outcomes:
        if o.status == "promoted" and o.champion_before:
            return o.policy
    return None


def show_rollback(cfg: MainJobConfig, ws: Workspace, policy: str, console: Console) -> tuple[str, str]:
    """The rollback flow on `policy`, with a completion before and after it; (summary, flow run id)."""
    reg = ws.registry()
    prompt, expected = heldout_prompt(cfg, policy)  # the main job names each policy after its task
    before = reg.alias_version(policy, "champion")
    assert before is not None
    text, fp = served_answer(ws, policy, prompt)
    who = _who(fp, reg.revision(policy, before).digest, f"{policy}/v{before}")
    console.print(
        Text(f"before: {policy} answers {prompt!r} with {text.strip()!r}, answered by ")
        + Text.from_markup(who)
    )
    state = rollback_flow(
        policy=policy, reason="the main job shows a rollback", workspace=ws, return_state=True
    )
    out = state.result()
    assert out is not None
    moved = out.alias
    console.print(
        f"rolled back {policy}@champion: v{moved.from_version} -> v{moved.to_version} "
        f"(alias moved, served in place, smoke-checked; {out.seconds:.2f} s inside the lock)"
    )
    text, fp = served_answer(ws, policy, prompt)
    who = _who(fp, moved.to_digest, f"{policy}/v{moved.to_version}")
    console.print(
        Text(f"after:  {policy} answers {prompt!r} with {text.strip()!r} (expected {expected.strip()!r}), ")
        + Text("answered by ")
        + Text.from_markup(who)
    )
    summary = f"{policy}: v{moved.from_version} -> v{moved.to_version}"
    return summary, str(state.state_details.flow_run_id)


# ---- 6. a canary rolled back -----------------------------------------------------------------------------


def step0_checkpoint(cfg: MainJobConfig, ws: Workspace, policy: str) -> int:
    """Register `policy`'s step-0 checkpoint as a new version: the adapter its training starts from (PEFT's
    init, B = 0), which answers as the base. The same bytes every run, so a rerun finds the same version."""
    reg = ws.registry()
    spec = builtin_spec(policy, policy, cfg.rank, cfg.learning_rate)
    transformers.utils.logging.disable_progress_bar()  # a tiny base: no bar in the job's output
    base = load_base(cfg.base)
    weights = initial_adapter(
        base.sites,
        spec.targets,
        spec.rank,
        spec.alpha,
        torch.Generator().manual_seed(cfg.seed),
        base.fingerprint,
    )
    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(weights, Path(tmp) / "step-0", base.sites)
        digest = reg.store.put_dir(Path(tmp) / "step-0")
    rev = reg.create_revision(
        policy,
        digest,
        base=base.fingerprint,
        rank=spec.rank,
        alias=None,
        reason="step-0 checkpoint (canary demo)",
    )
    return rev.version


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


# ---- the job --------------------------------------------------------------------------------------------


class _ConsoleLines(logging.Formatter):
    """Log lines during the job: seconds since it started, then the message (level and logger when not INFO)."""

    def __init__(self, t0: float) -> None:
        super().__init__()
        self.t0 = t0

    def format(self, record: logging.LogRecord) -> str:
        where = "" if record.levelno == logging.INFO else f"{record.levelname} {record.name}: "
        return f"  [{record.created - self.t0:6.1f} s] {where}{record.getMessage()}"


def _no_task_run_chatter(record: logging.LogRecord) -> bool:
    """Every task run logs 'Finished in state Completed()': the dashboard keeps those, the console need not."""
    return not (record.name.startswith("prefect.task_runs") and record.levelno < logging.WARNING)


@contextmanager
def _job_console() -> Iterator[None]:
    """The console the job's reader sees: flow logs (steps, rewards, gate decisions) stamped with the seconds
    since the job started; no progress bars of libraries (training's own bar is `step_bar`), no task-run chatter, no MLflow run links (printed once at the end),
    no lm-eval batch-size warning."""
    quiet_libraries()
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    root = logging.getLogger()
    handlers = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    if not handlers:  # called outside the CLI, which configures logging
        handlers = [logging.StreamHandler()]
        root.addHandler(handlers[0])
    saved = [(h, h.formatter) for h in handlers]
    # MLflow sets its logger's level when it is imported (mint_core.lifecycle above imports mint_core.registry,
    # which imports it), so a level set here holds
    names = ("mlflow", "mlflow.store.model_registry.abstract_store", "lm_eval", "httpx")
    quiet = {name: logging.getLogger(name) for name in names}
    levels = {name: lg.level for name, lg in quiet.items()}
    fmt = _ConsoleLines(time.time())
    for h in handlers:
        h.setFormatter(fmt)
        h.addFilter(_no_task_run_chatter)
    quiet["mlflow"].setLevel(logging.WARNING)
    quiet["mlflow.store.model_registry.abstract_store"].setLevel(logging.WARNING)
    quiet["lm_eval"].setLevel(logging.ERROR)
    quiet["httpx"].setLevel(logging.WARNING)
    try:
        yield
    finally:
        for h, f in saved:
            h.setFormatter(f)
            h.removeFilter(_no_task_run_chatter)
        for name, lg in quiet.items():
            lg.setLevel(levels[name])


@contextmanager
def _prefect_api(url: str) -> Iterator[None]:
    """Flow runs of this process go to the Prefect server the job started (its dashboard shows them)."""
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield


def run_main_job(cfg: MainJobConfig, console: Console) -> None:
    """The whole lifecycle: build, serve, train+evaluate+gate+promote, serve completions, roll back."""
    with _job_console():
        _run(cfg, console)


def _run(cfg: MainJobConfig, console: Console) -> None:
    check_device(cfg.device, "device")  # before anything is built or started
    timer = Timer(console)
    round_name = cfg.round or dt.datetime.now(dt.UTC).strftime("run-%Y%m%dT%H%M%SZ")

    with timer.step("1. build what is missing (DVC)") as note:
        if cfg.build:
            built = build(console)
            note.append(", ".join(built) if built else "all up to date")
        else:
            note.append("skipped (--no-build)")
        for need in (cfg.base / "config.json", cfg.data_dir / "train"):
            if not need.exists():
                raise MainJobError(f"{need} is missing: run `dvc repro` (or drop --no-build)")
        try:  # before anything starts or trains: the policies' tasks, the base's tokenizer and its template on
            # their prompts, and what the serving backend runs
            tasks = [task_registry().get(p) for p in cfg.policies]
            samples = [t.train_rows()[0].prompt for t in tasks]
            check_base(cfg.base, sample_messages=samples, serving=cfg.serving, device=cfg.device)
        except (BaseError, SpecError) as e:
            raise MainJobError(str(e)) from None

    serving = "vLLM behind mint serve" if cfg.serving == "vllm" else "mint serve"
    with timer.step(f"2. start the servers (MLflow, Prefect, {serving})") as note:
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
            os.environ.setdefault("MINT_SERVE_TORCH_THREADS", str(cfg.torch_threads))
        svc_cfg = services_config(cfg)
        try:
            names: list[ServiceName] = [n for n in services_for(svc_cfg) if n != "worker"]
            started = {s.name: s for s in start(svc_cfg, names, progress=lambda m: console.print(f"  {m}"))}
        except ServiceError as e:
            raise MainJobError(f"a service did not start:\n{e}") from None
        for s in started.values():
            _say_started(s, console)
        # the job's own flows run in this process: the worker (dashboard runs, nightly retraining) registers
        # the deployments and starts while the first wave trains, and the job waits for it at the end
        worker = WorkerStart(svc_cfg)
        console.print("  worker: registering the deployments and starting, beside the waves")
        reused = [n for n, s in started.items() if s.reused]
        note.append(f"reused {', '.join(reused)}" if reused else "all started")
        ws = workspace(cfg, started)

    prefect_url = started["prefect"].url
    runs: list[tuple[str, str]] = []
    waves: list[tuple[str, WaveReport]] = []
    canaries: list[tuple[str, CanaryOutcome]] = []
    # live traffic for the canaries: users asking task prompts of every policy while it has a canary split
    traffic = Traffic(
        ws.serving_url, api_key=os.environ.get("MINT_SERVE_API_KEY"), concurrency=cfg.traffic_concurrency
    )
    with _prefect_api(started["prefect"].api_url), traffic:
        reg = ws.registry()
        fresh = [t for t in cfg.policies if reg.alias_version(t, "champion") is None]
        if fresh:
            with timer.step(f"3a. wave: first revisions of {', '.join(fresh)}") as note:
                console.print(
                    f"  no champion yet for {', '.join(fresh)}: {cfg.first_steps} GRPO steps from the base, "
                    "evaluate the candidate and the bare base (revision 0) on the same suites, gate (paired "
                    "test against the base), promote, serve"
                )
                by_canary = [t for t in fresh if t in cfg.canary]
                if by_canary:
                    console.print(
                        f"  {', '.join(by_canary)}: once the gate passes it, the candidate answers "
                        f"{cfg.canary_share:.0%} of the users (live traffic from the built-in generator) and the "
                        "online test (always-valid, on the task's reward of each answer) promotes or rolls it back"
                    )
                with step_bar(console, f"GRPO {', '.join(fresh)}"):
                    first, run_id = run_wave(
                        cfg, ws, fresh, cfg.first_steps, round_name + "-first", canary=by_canary
                    )
                waves.append(("first", first))
                for o in first.outcomes:
                    if o.canary is not None:
                        canaries.append(("first revision", o.canary))
                        note.append(
                            f"{o.policy} canary {o.canary.decision} after {o.canary.requests:,} requests"
                        )
                runs.append(("wave (first revisions)", run_id))
                print_outcomes(first, "first revisions (gated against the base)", console)
                console.print(f"  mean rollout reward, first -> last step: {rewards_line(first)}")
                console.print(timings_table(first, "inside the wave"))
                note.append(_count(first))

        with timer.step(f"3b. wave: {', '.join(cfg.policies)} trained from their champions") as note:
            console.print(
                f"  {cfg.steps} GRPO steps x {cfg.prompts_per_step} prompts x G={cfg.group_size} per policy, "
                "all policies in one batched rollout and update per step; then per policy: evaluate the "
                "candidate and the champion (lm-eval through the server), gate (paired test: a significant "
                "own-suite gain >= 0.05, each other task non-inferior within 0.10, the pooled guard within 0.05), "
                "promote + refresh serving + smoke check in one transaction"
            )
            with step_bar(console, f"GRPO {', '.join(cfg.policies)}"):
                main, run_id = run_wave(cfg, ws, list(cfg.policies), cfg.steps, round_name)
            waves.append(("main", main))
            summary_file = write_summary(cfg, round_name, waves)
            console.print(f"  summary: {summary_file}")
            runs.append(("wave", run_id))
            print_outcomes(main, "the wave", console)
            console.print(f"  mean rollout reward, first -> last step: {rewards_line(main)}")
            console.print(timings_table(main, "inside the wave"))
            note.append(_count(main))

        with timer.step("4. a served completion from each policy's champion") as note:
            # a champion the wave did not replace may not be loaded yet (a server restarted since the last run):
            # serving follows the registry first, as the reconcile deployment keeps it doing
            reconciled = reconcile(policies=list(cfg.policies), workspace=ws)
            reloaded = [r for r in reconciled if r.reloaded]
            if reloaded:
                console.print(f"  reconcile loaded {len(reloaded)} champion(s) the server did not hold yet")
            table, n = completions_table(cfg, ws)
            console.print(table)
            note.append(f"{n} policies answered through {ws.serving_url}/v1/completions")

        with timer.step("5. rollback") as note:
            policy = pick_rollback(main)
            if policy is None:
                console.print(
                    "[yellow]the wave promoted no policy over an earlier champion, so there is nothing to "
                    "roll back to this time (the gate kept every champion)[/]"
                )
                note.append("nothing to roll back")
            else:
                summary, run_id = show_rollback(cfg, ws, policy, console)
                runs.append(("rollback", run_id))
                note.append(summary)

        reg = ws.registry()
        champions = [t for t in cfg.policies if reg.alias_version(t, "champion") is not None]
        if cfg.canary_demo and not champions:
            with timer.step("6. canary: a deliberately worse candidate") as note:
                console.print("[yellow]no policy has a champion to compare a candidate with: no canary[/]")
                note.append("no champion")
        elif cfg.canary_demo:
            policy = champions[0]
            with timer.step(f"6. canary: a deliberately worse candidate of {policy}") as note:
                version = step0_checkpoint(cfg, ws, policy)
                console.print(
                    f"  {policy}/v{version} is {policy}'s step-0 checkpoint (PEFT's init: it answers as the base); "
                    f"it answers {cfg.canary_share:.0%} of {policy}'s users beside the champion until the online "
                    "test decides"
                )
                state = canary_flow(
                    policy=policy, version=version, canary=canary_config(cfg), workspace=ws, return_state=True
                )
                out = state.result()
                assert out is not None
                canaries.append(("step-0", out))
                runs.append(("canary", str(state.state_details.flow_run_id)))
                console.print(Text(f"  {policy}/v{version} {out.decision}: {out.reason}"))
                note.append(f"{policy}/v{version} {out.decision} after {out.requests:,} requests")
        sent = traffic.stats
        console.print(
            f"  traffic: {sent.answered:,} requests answered, {sent.failed:,} failed"
            + (f" ({sent.errors})" if sent.errors else "")
        )

    with timer.step("7. the Prefect worker (started beside the waves)") as note:
        started["worker"] = worker.result()
        _say_started(started["worker"], console)
        note.append(started["worker"].detail or "running")

    console.print(final_table(waves))
    if canaries:
        console.print(canaries_table(canaries))
    console.print(f"  (every number, with n and each check's effect, CI and p-value: {summary_file})")
    console.print(timer.table())
    rule(console, "[bold]what happened")
    rolled_back = next((note for name, _, note in timer.rows if name.startswith("5.")), "-")
    for line in what_happened(waves, canaries, rolled_back, time.perf_counter() - timer.t0):
        console.print(Text(line), soft_wrap=True)
    where(cfg, started, prefect_url, runs, console, training_runs_url(ws, started["mlflow"].url))


def _say_started(s: Service, console: Console) -> None:
    how = "already running" if s.reused else f"started in {s.startup_s:.1f} s"
    console.print(f"  {s.name}: {how} at {s.api_url} (pid {s.pid}, log {s.log})")


class WorkerStart:
    """`start(config, ["worker"])` in a thread of its own (the deployments' registration is two Prefect CLI
    runs, ~20 s of a fresh clone's job); `result()` waits for it and raises what it raised as a MainJobError."""

    def __init__(self, config: ServicesConfig) -> None:
        self._out: list[Service] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(config,), name="mint-worker-start", daemon=True
        )
        self._thread.start()

    def _run(self, config: ServicesConfig) -> None:
        try:
            self._out = start(config, ["worker"])
        except BaseException as e:  # handed to the job's thread by result()
            self._error = e

    def result(self) -> Service:
        self._thread.join()
        if isinstance(self._error, ServiceError):
            raise MainJobError(f"a service did not start:\n{self._error}") from None
        if self._error is not None:
            raise self._error
        return self._out[0]


def _count(report: WaveReport) -> str:
    by: dict[str, int] = {}
    for o in report.outcomes:
        by[o.status] = by.get(o.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in by.items())


def training_runs_url(ws: Workspace, mlflow: str) -> str:
    """The runs view of the lifecycle's experiment (a table of the training runs). The experiment's own page,
    `#/experiments/<id>`, opens on MLflow 3's GenAI overview ("Traces 0") instead."""
    exp = ws.registry().client.get_experiment_by_name(EXPERIMENT)
    return (
        f"{mlflow}/#/experiments/{exp.experiment_id}/runs" if exp is not None else f"{mlflow}/#/experiments"
    )


def where(
    cfg: MainJobConfig,
    services: Mapping[ServiceName, Service],
    prefect_url: str,
    runs: list[tuple[str, str]],
    console: Console,
    runs_url: str | None = None,
) -> None:
    """Where to look, and how to stop."""
    mlflow = services["mlflow"].url
    serve = services["serve"].url
    rule(console, "[bold]where to look")
    say = functools.partial(console.print, soft_wrap=True)
    say(f"Prefect dashboard   {prefect_url}")
    for what, run_id in runs:
        say(f"  {what:<24} {prefect_url}/runs/flow-run/{run_id}")
    say(f"MLflow UI           {mlflow}/#/models  (one registered model per policy)")
    for p in cfg.policies:
        say(f"  {p:<24} {mlflow}/#/models/{p}")
    say(f"  training runs            {runs_url or mlflow + '/#/experiments'} (experiment {EXPERIMENT})")
    say(f"mint serve          {serve}/v1/models  (metrics: {serve}/metrics)")
    p0 = cfg.policies[0]
    prompt, _ = heldout_prompt(cfg, p0)
    field, route = ("prompt", "completions") if isinstance(prompt, str) else ("messages", "chat/completions")
    body = json.dumps({"model": p0, field: prompt, "max_tokens": 8, "temperature": 0})
    say(f"  curl -s {serve}/v1/{route} -H 'Content-Type: application/json' -d '{body}'")
    run_dir = cfg.state_dir / "run"
    flag = "" if run_dir == Path(".mint/run") else f" --state-dir {run_dir}"
    say(f"from the shell      mint status{flag}")
    if cfg.state_dir != Path(".mint") or mlflow != "http://127.0.0.1:5000":
        catalog = f"sqlite:///{(cfg.state_dir / 'catalog.db').resolve()}"
        say(f"                    export MLFLOW_TRACKING_URI={mlflow} MINT_CATALOG_URL={catalog}")
    say(f"                    mint registry ls {p0}   (its revisions, aliases and gate decisions)")
    say(f"                    mint registry history {p0}   (every champion move: who, when, why)")
    say("                    mint catalog ls")
    say(
        f"\n[bold]The servers are still running[/] (logs in {run_dir}/); stop them with "
        f"[bold]make down[/] (or `mint down{flag}`)."
    )
