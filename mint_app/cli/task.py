"""`mint task`: the registered tasks, and a check of one task's files before anything trains on them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from mint_app.console import make_console
from mint_core.data.generators import Example
from mint_core.data.spec import (
    TASK_DIRS_ENV,
    SpecError,
    TaskRegistry,
    check_columns,
    load_spec,
    registry,
    task_dirs,
)
from mint_core.errors import MintError

if TYPE_CHECKING:
    from mint_core.data.rewards import Rewarder
    from mint_core.data.spec import TaskSpec

task_app = typer.Typer(help="List registered tasks and check a task's files.", no_args_is_help=True)

TasksOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--tasks",
        help="A task folder (its task.yaml) or a folder of them, registered beside the built-ins and "
        f"${TASK_DIRS_ENV}; repeatable.",
    ),
]


def add_task_dirs(dirs: list[Path] | None) -> None:
    """Register more task folders for this process and every server and worker it starts (`$MINT_TASK_DIRS`,
    made absolute so a process started elsewhere reads the same)."""
    if not dirs:
        return
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise typer.BadParameter(f"no such task folder: {', '.join(missing)}", param_hint="--tasks")
    have = [d for d in os.environ.get(TASK_DIRS_ENV, "").split(":") if d]
    os.environ[TASK_DIRS_ENV] = ":".join(dict.fromkeys([*have, *(str(d.resolve()) for d in dirs)]))


@task_app.command("list")
def list_cmd(tasks: TasksOption = None) -> None:
    """Every registered task: where its spec is, its rows, its rewards and the eval its gate reads."""
    add_task_dirs(tasks)
    try:
        reg = registry()
    except SpecError as e:
        raise typer.BadParameter(str(e)) from None
    table = Table(
        "task", "spec", "rewards", "eval (metric)", title=f"tasks in {', '.join(map(str, task_dirs()))}"
    )
    for name, spec in reg.specs.items():
        rewards = ", ".join(f"{r.label} x{r.weight:g}" for r in spec.rewards)
        table.add_row(name, str(spec.path), rewards, f"{spec.eval.task} ({spec.eval.metric})")
    make_console().print(table)


@task_app.command("check")
def check_cmd(
    task: Annotated[str, typer.Argument(help="A registered task's name, or a task folder / task.yaml.")],
    tasks: TasksOption = None,
    base: Annotated[
        Path | None,
        typer.Option(
            help="Also check this base: its tokenizer renders the task's prompts, and its own "
            "completions of a few prompts give the reward some signal (the dry run)."
        ),
    ] = None,
) -> None:
    """Check a task as training would before its first step: the spec, both data files (the task's Great
    Expectations suite: columns, no empty prompt, no held-out prompt in train, answers in format), the rewards
    (they import, take TRL's keywords, score the gold answers), the eval (lm-eval builds it from local data) and,
    with --base, the base. Changes nothing; exits 1 naming every problem."""
    add_task_dirs(tasks)
    from mint_core.data.checks import check_task
    from mint_core.data.rewards import GOLD_WARN_BELOW, Rewarder, check_rewards
    from mint_core.eval.suites import check_eval

    console = make_console()
    path = Path(task)
    try:
        if path.exists():
            spec = load_spec(path / "task.yaml" if path.is_dir() else path)
            reg = TaskRegistry({**registry().specs, spec.name: spec})
        else:
            reg = registry()
            spec = reg.get(task)
        check_columns(spec)  # before reading rows, which take a mapped column a file lacks as empty
        train, heldout = spec.train_rows(), spec.heldout_rows()
        console.print(
            f"[green]ok[/] {spec.name}: {len(train)} train rows, {len(heldout)} held-out rows ({spec.path})"
        )
        report = check_task(spec)
        console.print(f"[green]ok[/] data: {report.evaluated} expectations on {report.rows} rows")
        mean = check_rewards(spec)
        n_gold = min(32, len(heldout))
        if mean is None:
            console.print(
                "[green]ok[/] rewards: they import and take the data's keywords (no answers to score)"
            )
        elif mean < GOLD_WARN_BELOW:
            console.print(
                f"[yellow]warning[/] rewards: the gold answers of {n_gold} held-out rows score only {mean:.3f} "
                f"(below {GOLD_WARN_BELOW:g}): is the answer column ({spec.column('answer')!r}) what the reward "
                "compares with?"
            )
        else:
            console.print(
                f"[green]ok[/] rewards: the gold answers of {n_gold} held-out rows score {mean:.3f}"
            )
        with Rewarder(reg) as rewarder:
            n = check_eval(spec)
            console.print(
                f"[green]ok[/] eval: lm-eval builds {spec.eval.task} ({n} items, metric {spec.eval.metric}) and "
                "renders the held-out rows' prompts and answers"
            )
            if base is not None:
                _check_base(console, spec, base, train, rewarder)
    except MintError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None


def _check_base(
    console: Console, spec: TaskSpec, base: Path, train: list[Example], rewarder: Rewarder
) -> None:
    """The base renders the task's prompts and its own sampled completions give the reward some signal."""
    from mint_core.engine.base import load_base
    from mint_core.engine.chat import render_prompt
    from mint_core.engine.engine import Engine, EngineConfig
    from mint_core.engine.sampling import SamplingParams
    from mint_core.rl.builder import sample_signal
    from mint_core.serving.base_check import check_base

    check_base(base, [e.prompt for e in train[:8]])
    engine = Engine(load_base(base), EngineConfig(max_loras=1, max_lora_rank=8))
    # 8 prompts, 8 samples each; more rounds while they all score the same, as training's dry run does
    scores = sample_signal(
        engine,
        rewarder,
        spec,
        train,
        8,
        8,
        lambda i: SamplingParams(max_tokens=spec.generation.max_new_tokens, temperature=0.7, seed=i),
        lambda p: render_prompt(engine.tokenizer, p),
    )
    console.print(
        f"[green]ok[/] base {base}: renders the prompts; its completions score {sum(scores) / len(scores):.3f}"
    )
