"""`mint eval ...`: build the evaluation suites' data, evaluate a revision served or in process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from pydantic import SecretStr
from rich.table import Table

from mint_app.console import make_console
from mint_core.errors import MintError
from mint_core.eval.results import EvalConfig, EvalResult, LocalModel, ServedModel
from mint_core.eval.suites import build_suite_data

eval_app = typer.Typer(help="Evaluate adapter revisions on the lm-eval suites.", no_args_is_help=True)
console = make_console()  # a kept log's tables keep their width


@eval_app.command("build-suites")
def build_suites(
    out: Annotated[Path, typer.Option(help="Directory for the suites' JSONL data.")] = Path(
        "eval_suites/data"
    ),
    tasks_dir: Annotated[
        Path | None,
        typer.Option(help="Task data from `mint data build` (held-out items); default: generate them."),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Items per task suite.")] = 100,
    guard_limit: Annotated[
        int | None,
        typer.Option(min=1, help="Items per guard task (generation, choice); default: as many as --limit."),
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Seed of the generated held-out items (without --tasks-dir).")
    ] = 0,
) -> None:
    """Write each suite's JSONL and a manifest, deterministically (the same inputs give the same bytes)."""
    try:
        data = build_suite_data(out, tasks_dir=tasks_dir, limit=limit, guard_limit=guard_limit, seed=seed)
    except MintError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    counts = ", ".join(f"{k} {v}" for k, v in data.counts.items())
    console.print(f"wrote suite data to {out}: {counts}")


def _suites(suites: str | None) -> list[str] | None:
    return [s.strip() for s in suites.split(",") if s.strip()] if suites else None


def _report(result: EvalResult, result_json: Path | None, mlflow_uri: str | None, run_id: str | None) -> None:
    table = Table("suite", "metrics", "score", "n")
    for name, s in result.suites.items():
        metrics = ", ".join(f"{m} {v:.3f}" for m, v in s.metrics.items())
        table.add_row(name, metrics, f"{s.score:.3f}", str(s.n))
    console.print(table)
    console.print(f"{result.path}: revision {result.revision or 'base'} in {result.wall_s:.1f} s")
    if result_json is not None:
        result_json.parent.mkdir(parents=True, exist_ok=True)
        result_json.write_text(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    if mlflow_uri and run_id:
        from mint_core.eval.records import log_to_mlflow  # mlflow: deferred for `mint --help`

        log_to_mlflow(result, mlflow_uri, run_id)
        console.print(f"logged to MLflow run {run_id} at {mlflow_uri}")


SuitesOpt = Annotated[str | None, typer.Option(help="Comma-separated suites (default: all).")]
LimitOpt = Annotated[int | None, typer.Option(min=1, help="At most this many items per lm-eval task.")]
BatchOpt = Annotated[int, typer.Option(min=1)]
SuitesDirOpt = Annotated[
    Path | None, typer.Option(help="Suite YAML directory (default: mint's eval_suites).")
]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Also write the result as JSON here.")]
UriOpt = Annotated[str | None, typer.Option(help="MLflow tracking URI to log the result to.")]
RunOpt = Annotated[str | None, typer.Option(help="MLflow run id to log the result to.")]


def _config(
    suites: str | None,
    limit: int | None,
    batch_size: int,
    suites_dir: Path | None,
    mlflow: tuple[str | None, ...],
) -> EvalConfig:
    if len({bool(x) for x in mlflow}) > 1:
        raise typer.BadParameter("--mlflow-uri and --run-id go together")
    cfg = EvalConfig(suites=_suites(suites), limit=limit, batch_size=batch_size)
    return cfg.model_copy(update={"suites_dir": suites_dir}) if suites_dir else cfg


def _run(fn: Callable[[], EvalResult]) -> EvalResult:
    try:
        return fn()
    except MintError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None


@eval_app.command("served")
def served(
    url: Annotated[str, typer.Option(help="Server root, e.g. http://127.0.0.1:8000.")],
    tokenizer: Annotated[Path, typer.Option(help="Local tokenizer directory of the served base.")],
    adapter: Annotated[
        str | None, typer.Option(help="lora_path of the revision as the server sees it; none: the bare base.")
    ] = None,
    name: Annotated[str, typer.Option(help="Name to load the revision under.")] = "candidate",
    admin_token: Annotated[str | None, typer.Option(envvar="MINT_SERVE_ADMIN_TOKEN")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="MINT_SERVE_API_KEY")] = None,
    suites: SuitesOpt = None,
    limit: LimitOpt = None,
    batch_size: BatchOpt = 32,
    suites_dir: SuitesDirOpt = None,
    out: OutOpt = None,
    mlflow_uri: UriOpt = None,
    run_id: RunOpt = None,
) -> None:
    """Load a revision on a server under a name and score what it serves (lm-eval local-completions)."""
    from mint_core.eval.lm_eval_runner import evaluate_served  # lm-eval: deferred to keep `mint --help` fast

    target = ServedModel(
        url=url,
        tokenizer=tokenizer,
        adapter=adapter,
        name=name,
        admin_token=SecretStr(admin_token) if admin_token else None,
        api_key=SecretStr(api_key) if api_key else None,
    )
    cfg = _config(suites, limit, batch_size, suites_dir, (mlflow_uri, run_id))
    _report(_run(lambda: evaluate_served(target, cfg)), out, mlflow_uri, run_id)


@eval_app.command("local")
def local(
    base: Annotated[Path, typer.Option(help="Base model directory.")],
    adapter: Annotated[
        Path | None, typer.Option(help="Adapter directory (PEFT format); none: the bare base.")
    ] = None,
    suites: SuitesOpt = None,
    limit: LimitOpt = None,
    batch_size: BatchOpt = 32,
    suites_dir: SuitesDirOpt = None,
    out: OutOpt = None,
    mlflow_uri: UriOpt = None,
    run_id: RunOpt = None,
) -> None:
    """Score a revision in this process: the base with transformers, the adapter through PEFT (lm-eval hf)."""
    from mint_core.eval.in_process import evaluate_in_process  # torch, PEFT: deferred for `mint --help`

    cfg = _config(suites, limit, batch_size, suites_dir, (mlflow_uri, run_id))
    target = LocalModel(base=base, adapter=adapter)
    _report(_run(lambda: evaluate_in_process(target, cfg)), out, mlflow_uri, run_id)
