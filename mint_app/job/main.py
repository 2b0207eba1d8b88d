"""The main job (`mint run`, `make run`): the whole lifecycle on the embedded default, every step timed.

1. build what is missing with DVC: the task data, the built-in base, the eval suites' data, the data checks;
2. start MLflow and Prefect (reusing those already running); the serving backend (`mint serve` on the built-in
   base, or vLLM behind it) starts beside step 3's training, which needs no server (its evaluations wait for
   it), then a Prefect worker with every deployment of infra/prefect.yaml registered; the job waits for it in 6;
3. the `wave` flow: every policy without a champion gets its first revision (the gate has nothing to compare
   with), then a second wave trains every policy from its champion and gates the candidate against it;
4. a served completion from each policy's champion through the HTTP server, naming the revision that answered;
5. the `rollback` flow on a policy the second wave promoted, and a completion from the revision it restored;
6. the worker up; where to look: the Prefect flow runs, the MLflow models, the server; the servers are left
   running.

Everything it writes lives under one state directory (`.mint` by default, the same places `mint up` and the
flows' default `Workspace` use), so `mint up/down/status`, `mint registry` and `mint catalog` see the same state.
This module is command-line code: it reports on a rich console. The settings are in `job_config.py`, step 1
(DVC) in `job_build.py`, the tables and summaries it prints in `job_report.py`; this module runs the steps.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch
import transformers
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flows.canary import CanaryOutcome, canary_flow
from flows.forms import PolicyRun, Training, WaveFailed, WaveReport
from flows.lifecycle import wave
from flows.promotion import rollback_flow
from flows.reconcile import reconcile
from mint_app.console import quiet_libraries, rule
from mint_app.job.build import build
from mint_app.job.config import MainJobConfig, MainJobError
from mint_app.job.progress import step_bar
from mint_app.job.report import (
    Timer,
    canaries_table,
    count_outcomes,
    credentials_line,
    final_table,
    print_outcomes,
    rewards_line,
    timings_table,
    training_runs_url,
    what_happened,
    write_summary,
)
from mint_app.services.commands import serve_token
from mint_app.services.config import (
    VLLM_SIDE,
    Service,
    ServiceError,
    ServiceName,
    ServicesConfig,
    services_for,
)
from mint_app.services.control import check_serving, start, startup_timeout
from mint_app.services.mlflow_auth import as_service
from mint_app.services.prefect_auth import client_auth, prefect_api
from mint_core.data.generators import Prompt
from mint_core.data.spec import SpecError, prompt_text
from mint_core.data.spec import registry as task_registry
from mint_core.engine.base import load_base
from mint_core.engine.device import check_device
from mint_core.errors import BaseError
from mint_core.eval.gate import GatePolicy
from mint_core.eval.lm_eval_runner import EvalConfig
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import initial_adapter, save_adapter
from mint_core.rl.builder import recipe_spec
from mint_core.rl.constants import BUILTIN_RECIPE
from mint_core.serving.base_check import check_base
from mint_core.serving.traffic import Traffic
from tasks.canary import CanaryConfig
from tasks.registry import EXPERIMENT

# ---- 2. services -------------------------------------------------------------------------------------------

SERVING_SIDE: frozenset[ServiceName] = frozenset({*VLLM_SIDE, "serve"})
"""What the job starts beside its first wave's training instead of before it: the serving backend."""


def services_config(cfg: MainJobConfig) -> ServicesConfig:
    return ServicesConfig.load(
        None,
        state_dir=cfg.state_dir / "run",
        host=cfg.host,
        mlflow_port=cfg.mlflow_port,
        prefect_port=cfg.prefect_port,
        serve_port=cfg.serve_port,
        serving=cfg.serving,
        replicas=cfg.replicas,
        worker_port=cfg.worker_port,
        serve_base=str(cfg.base.resolve()),
        serve_adapter_root=cfg.state_dir / "store",
        serve_device=cfg.device,
    )


def workspace(
    cfg: MainJobConfig,
    services: Mapping[ServiceName, Service],
    serving_url: str,
    serving_start_s: float = 0.0,
) -> Workspace:
    """The flows' workspace, agreeing with the services: the store `mint serve` reads, its admin token; its
    evaluations wait up to `serving_start_s` for a server still starting (`Workspace.serving_start_s`)."""
    state = cfg.state_dir.resolve()
    return Workspace(
        tracking_uri=services["mlflow"].api_url,
        store=str(state / "store"),
        catalog_url=f"sqlite:///{state / 'catalog.db'}",
        base=cfg.base.resolve(),
        serving_url=serving_url,
        serving_start_s=serving_start_s,
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
            spec=recipe_spec(t, t, cfg.rank, cfg.learning_rate),
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
ASKING = 8
"""Requests in flight while the served-completions table is built: the server batches them (one at a time,
the 160 greedy answers of two policies took 24 s through vLLM)."""


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
    champions = {task: reg.alias_version(task, "champion") for task in cfg.policies}
    with ThreadPoolExecutor(ASKING, thread_name_prefix="mint-ask") as pool:
        asked = {
            task: [
                (
                    prompt,
                    expected,
                    pool.submit(served_answer, ws, base_name, prompt),
                    pool.submit(served_answer, ws, task, prompt),
                )
                for prompt, expected in (heldout_prompt(cfg, task, i) for i in range(SEARCHED_PROMPTS))
            ]
            for task, version in champions.items()
            if version is not None
        }
        for task, version in champions.items():
            if version is None:
                table.add_row(task, "", "", "", "[yellow]no champion[/]", "")
                continue
            rev = reg.revision(task, version)
            shown = differ = 0
            for prompt, expected, base_asked, asked_policy in asked[task]:
                base_text, _ = base_asked.result()
                text, fp = asked_policy.result()
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
    spec = recipe_spec(policy, policy, cfg.rank, cfg.learning_rate)
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
    # MLflow sets its logger's level when it is imported (mint_core.lifecycle.workspace above imports
    # mint_core.registry, which imports it), so a level set here holds
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
def _prefect_api(url: str, config: ServicesConfig) -> Iterator[None]:
    """Flow runs of this process go to the Prefect server the job started (its dashboard shows them), with its
    auth string."""
    with prefect_api(url, client_auth(config)):
        yield


def run_main_job(cfg: MainJobConfig, console: Console) -> None:
    """The whole lifecycle: build, serve, train+evaluate+gate+promote, serve completions, roll back."""
    with _job_console():
        _run(cfg, console)


@dataclass
class _Job:
    """What the main job's steps share: its config and console, the step timer, the round's name, and what the
    steps produced (the servers, the workspace, the runs, waves and canaries the report names)."""

    cfg: MainJobConfig
    console: Console
    timer: Timer
    round_name: str
    started: dict[ServiceName, Service] = field(default_factory=dict)
    runs: list[tuple[str, str]] = field(default_factory=list)
    waves: list[tuple[str, WaveReport]] = field(default_factory=list)
    canaries: list[tuple[str, CanaryOutcome]] = field(default_factory=list)
    summary_file: Path | None = None


def _run(cfg: MainJobConfig, console: Console) -> None:
    check_device(cfg.device, "device")  # before anything is built or started
    job = _Job(
        cfg, console, Timer(console), cfg.round or dt.datetime.now(dt.UTC).strftime("run-%Y%m%dT%H%M%SZ")
    )
    _build_step(job)
    serving, worker, ws = _start_step(job)
    # live traffic for the canaries: users asking task prompts of every policy while it has a canary split
    traffic = Traffic(
        ws.serving_url,
        api_key=os.environ.get("MINT_SERVE_API_KEY") or ws.admin_token(),  # mint's own traffic: every policy
        concurrency=cfg.traffic_concurrency,
    )
    services = services_config(cfg)
    # this process logs in to MLflow as mint's service account (the stack's access file) and its flows to the
    # Prefect server with its auth string
    with as_service(services):
        with _prefect_api(job.started["prefect"].api_url, services), traffic:
            _waves_and_serving(job, ws, traffic, serving)
        with job.timer.step("7. the Prefect worker (started beside the waves)") as note:
            job.started["worker"] = worker.result()[0]
            _say_started(job.started["worker"], console)
            note.append(job.started["worker"].detail or "running")
        _report(job, ws)


def _waves_and_serving(job: _Job, ws: Workspace, traffic: Traffic, serving: BackgroundStart) -> None:
    """Steps 3 to 6: the waves, served completions, a rollback and a canary, with live traffic running. The
    serving backend may still be starting when the first wave begins: its training needs no server, and its
    evaluations wait for it (`Workspace.serving_start_s`); a serving backend that did not start ends the job
    with its own error once that wave is over, whatever became of the wave."""
    cfg, console = job.cfg, job.console
    fresh = [t for t in cfg.policies if ws.registry().alias_version(t, "champion") is None]
    main: WaveReport | None = None
    try:
        if fresh:
            _first_wave_step(job, ws, fresh)
        else:
            main = _main_wave_step(job, ws)
    except BaseException:
        serving.raise_failure()  # the cause, when the wave failed because serving never came up
        raise
    job.started.update({s.name: s for s in serving.result()})
    if main is None:
        main = _main_wave_step(job, ws)
    _completions_step(job, ws)
    _rollback_step(job, ws, main)
    if cfg.canary_demo:
        _canary_step(job, ws)
    sent = traffic.stats
    console.print(
        f"  traffic: {sent.answered:,} requests answered, {sent.failed:,} failed"
        + (f" ({sent.errors})" if sent.errors else "")
    )


def _build_step(job: _Job) -> None:
    """Build what is missing (DVC), then check, before anything starts or trains, the policies' tasks, the
    base's tokenizer and its template on their prompts, and what the serving backend runs."""
    cfg = job.cfg
    with job.timer.step("1. build what is missing (DVC)") as note:
        if cfg.build:
            built = build(job.console)
            note.append(", ".join(built) if built else "all up to date")
        else:
            note.append("skipped (--no-build)")
        for need in (cfg.base / "config.json", cfg.data_dir / "train"):
            if not need.exists():
                raise MainJobError(f"{need} is missing: run `dvc repro` (or drop --no-build)")
        try:
            tasks = [task_registry().get(p) for p in cfg.policies]
            samples = [t.train_rows()[0].prompt for t in tasks]
            check_base(cfg.base, sample_messages=samples, serving=cfg.serving, device=cfg.device)
        except (BaseError, SpecError) as e:
            raise MainJobError(str(e)) from None


def _start_step(job: _Job) -> tuple[BackgroundStart, BackgroundStart, Workspace]:
    """Start (or reuse) MLflow, Prefect and the webhook receiver, and wait for them; the serving backend (vLLM
    and mint serve in front of it, or mint serve) starts beside the first wave's training, which needs no
    server (a vLLM takes a minute or more to come up on a small CPU), then the worker registers the deployments
    and starts (the job's own flows run in this process). The job waits for serving after the first wave and
    for the worker at the end."""
    cfg, console = job.cfg, job.console
    serving = "vLLM behind mint serve" if cfg.serving == "vllm" else "mint serve"
    with job.timer.step(f"2. start the servers (MLflow, Prefect, {serving})") as note:
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
            os.environ.setdefault("MINT_SERVE_TORCH_THREADS", str(cfg.torch_threads))
        svc_cfg = services_config(cfg)
        names = [n for n in services_for(svc_cfg) if n != "worker"]
        later: list[ServiceName] = [n for n in names if n in SERVING_SIDE]
        try:
            check_serving(
                svc_cfg, later
            )  # what cannot start is refused now, not after the first wave trained
            started = start(
                svc_cfg, [n for n in names if n not in later], progress=lambda m: console.print(f"  {m}")
            )
        except ServiceError as e:
            raise MainJobError(f"a service did not start:\n{e}") from None
        job.started.update({s.name: s for s in started})
        for s in started:
            _say_started(s, console)
        # serve's admin token, made now as serve would make it: the job's traffic reads it from the start
        if "serve" in later:
            serve_token(svc_cfg)
        serving_start = BackgroundStart(svc_cfg, later, console=console)
        worker = BackgroundStart(svc_cfg, ["worker"], after=serving_start)
        console.print(
            f"  {' and '.join(later)}: starting beside the first wave's training (its evaluations wait for "
            "them); then the worker: registering the deployments and starting"
        )
        reused = [s.name for s in started if s.reused]
        note.append(f"reused {', '.join(reused)}" if reused else "all started")
        wait_s = sum(startup_timeout(svc_cfg, n) for n in later)
        ws = workspace(cfg, job.started, svc_cfg.url("serve"), serving_start_s=wait_s)
        return serving_start, worker, ws


def _wave_lines(job: _Job, report: WaveReport) -> None:
    job.console.print(f"  mean rollout reward, first -> last step: {rewards_line(report)}")
    job.console.print(timings_table(report, "inside the wave"))


def _first_wave_step(job: _Job, ws: Workspace, fresh: list[str]) -> None:
    """Policies without a champion: their first revisions, trained from the base and gated against it (and,
    for the canaried ones, decided on live traffic)."""
    cfg, console = job.cfg, job.console
    with job.timer.step(f"3a. wave: first revisions of {', '.join(fresh)}") as note:
        console.print(
            f"  no champion yet for {', '.join(fresh)}: {cfg.first_steps} GRPO steps from the base, "
            "evaluate the candidate and the bare base (revision 0) on the same suites, gate (paired "
            "test against the base), promote, serve"
        )
        by_canary = [t for t in fresh if t in cfg.canaried()]
        if by_canary:
            console.print(
                f"  {', '.join(by_canary)}: once the gate passes it, the candidate answers "
                f"{cfg.canary_share:.0%} of the users (live traffic: simulated users asking its task's held-out "
                "prompts) and the online test (always-valid, on the task's reward of each answer) promotes or "
                "rolls it back"
            )
        with step_bar(console, f"GRPO {', '.join(fresh)}"):
            first, run_id = run_wave(
                cfg, ws, fresh, cfg.first_steps, job.round_name + "-first", canary=by_canary
            )
        job.waves.append(("first", first))
        for o in first.outcomes:
            if o.canary is not None:
                job.canaries.append(("first revision", o.canary))
                note.append(f"{o.policy} canary {o.canary.decision} after {o.canary.requests:,} requests")
        job.runs.append(("wave (first revisions)", run_id))
        print_outcomes(first, "first revisions (gated against the base)", console)
        _wave_lines(job, first)
        note.append(count_outcomes(first))


def _main_wave_step(job: _Job, ws: Workspace) -> WaveReport:
    """Every policy trained from its champion in one batched wave, each gated against its champion."""
    cfg, console = job.cfg, job.console
    with job.timer.step(f"3b. wave: {', '.join(cfg.policies)} trained from their champions") as note:
        console.print(
            f"  {cfg.steps} GRPO steps x {cfg.prompts_per_step} prompts x G={cfg.group_size} per policy, "
            "all policies in one batched rollout and update per step; then per policy: evaluate the "
            "candidate and the champion (lm-eval through the server), gate (paired tests), promote + refresh "
            "serving + smoke check in one transaction"
        )
        for t in cfg.policies:
            console.print(f"  gate of {t}: {GatePolicy(suite=t).describe()}", soft_wrap=True)
        with step_bar(console, f"GRPO {', '.join(cfg.policies)}"):
            main, run_id = run_wave(cfg, ws, list(cfg.policies), cfg.steps, job.round_name)
        job.waves.append(("main", main))
        job.summary_file = write_summary(cfg, job.round_name, job.waves)
        console.print(f"  summary: {job.summary_file}")
        job.runs.append(("wave", run_id))
        print_outcomes(main, "the wave", console)
        _wave_lines(job, main)
        note.append(count_outcomes(main))
    return main


def _completions_step(job: _Job, ws: Workspace) -> None:
    with job.timer.step("4. a served completion from each policy's champion") as note:
        # a champion the wave did not replace may not be loaded yet (a server restarted since the last run):
        # serving follows the registry first, as the reconcile deployment keeps it doing
        reconciled = reconcile(policies=list(job.cfg.policies), workspace=ws)
        reloaded = [r for r in reconciled if r.reloaded]
        if reloaded:
            job.console.print(f"  reconcile loaded {len(reloaded)} champion(s) the server did not hold yet")
        table, n = completions_table(job.cfg, ws)
        job.console.print(table)
        note.append(f"{n} policies answered through {ws.serving_url}/v1/completions")


def _rollback_step(job: _Job, ws: Workspace, main: WaveReport) -> None:
    with job.timer.step("5. rollback") as note:
        policy = pick_rollback(main)
        if policy is None:
            job.console.print(
                "[yellow]the wave promoted no policy over an earlier champion, so there is nothing to "
                "roll back to this time (the gate kept every champion)[/]"
            )
            note.append("nothing to roll back")
        else:
            summary, run_id = show_rollback(job.cfg, ws, policy, job.console)
            job.runs.append(("rollback", run_id))
            note.append(summary)


def _canary_step(job: _Job, ws: Workspace) -> None:
    """A deliberately worse candidate (a champion's step-0 checkpoint) on a canary split, decided online."""
    cfg, console = job.cfg, job.console
    reg = ws.registry()
    champions = [t for t in cfg.policies if reg.alias_version(t, "champion") is not None]
    if not champions:
        with job.timer.step("6. canary: a deliberately worse candidate") as note:
            console.print("[yellow]no policy has a champion to compare a candidate with: no canary[/]")
            note.append("no champion")
        return
    policy = champions[0]
    with job.timer.step(f"6. canary: a deliberately worse candidate of {policy}") as note:
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
        job.canaries.append(("step-0", out))
        job.runs.append(("canary", str(state.state_details.flow_run_id)))
        console.print(Text(f"  {policy}/v{version} {out.decision}: {out.reason}"))
        note.append(f"{policy}/v{version} {out.decision} after {out.requests:,} requests")


def _report(job: _Job, ws: Workspace) -> None:
    """The job's closing report: the waves, the canaries, the step times, what happened, and where to look."""
    console = job.console
    console.print(final_table(job.waves))
    if job.canaries:
        console.print(canaries_table(job.canaries))
    console.print(f"  (every number, with n and each check's effect, CI and p-value: {job.summary_file})")
    console.print(job.timer.table())
    rule(console, "[bold]what happened")
    rolled_back = next((note for name, _, note in job.timer.rows if name.startswith("5.")), "-")
    for line in what_happened(job.waves, job.canaries, rolled_back, time.perf_counter() - job.timer.t0):
        console.print(Text(line), soft_wrap=True)
    where(
        job.cfg,
        job.started,
        job.started["prefect"].url,
        job.runs,
        console,
        training_runs_url(ws, job.started["mlflow"].url),
    )


def _say_started(s: Service, console: Console) -> None:
    how = "already running" if s.reused else f"started in {s.startup_s:.1f} s"
    console.print(f"  {s.name}: {how} at {s.api_url} (pid {s.pid}, log {s.log})")


class BackgroundStart:
    """`start(config, names)` in a thread of its own, after `after` has ended (the worker's registration of the
    deployments, two Prefect CLI runs, waits for the serving backend, so the two do not take turns at the cores
    with the first wave's training at once); with `console`, each service's start is said there as it answers.
    `result()` waits for it and raises what it raised as a MainJobError."""

    def __init__(
        self,
        config: ServicesConfig,
        names: list[ServiceName],
        after: BackgroundStart | None = None,
        console: Console | None = None,
    ) -> None:
        self.names = names
        self._out: list[Service] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(config, after, console), name=f"mint-start-{'-'.join(names)}", daemon=True
        )
        self._thread.start()

    def _run(self, config: ServicesConfig, after: BackgroundStart | None, console: Console | None) -> None:
        if after is not None:
            after._thread.join()
        try:
            self._out = start(config, self.names) if self.names else []
        except BaseException as e:  # handed to the job's thread by result()
            self._error = e
            if console is not None:
                console.print(
                    f"  {', '.join(self.names)}: did not start (the job ends with this after its wave)"
                )
            return
        if console is not None:
            for s in self._out:
                _say_started(s, console)

    def raise_failure(self) -> None:
        """Raise what `result()` would, if the start has ended and failed; else return."""
        if not self._thread.is_alive() and self._error is not None:
            self.result()

    def result(self) -> list[Service]:
        self._thread.join()
        if isinstance(self._error, ServiceError):
            raise MainJobError(f"a service did not start:\n{self._error}") from None
        if self._error is not None:
            raise self._error
        return self._out


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
    say(f"credentials         {credentials_line(run_dir)}")
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
