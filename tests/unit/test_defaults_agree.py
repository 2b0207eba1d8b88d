"""A default that a doc, params.yaml or `--help` states is the default the code has.

The code holds each default once (the built-in recipe in `mint_core.rl.recipe_defaults`, the main job's in
`MainJobConfig`, the servers' in `ServingConfig` / `ServicesConfig`, the data pipeline's in `DataParams`); these
tests read what the docs, params.yaml and the command line's help say and compare it with that one source."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic import BaseModel

from flows.route import RouteConfig
from mint_app.cli.app import app
from mint_app.cli.help import default_of, shown
from mint_app.cli.registry import DEFAULT_TRACKING
from mint_app.job.config import MainJobConfig
from mint_app.services.config import ServicesConfig
from mint_core.data.build import DataParams
from mint_core.engine.pretrain import PretrainParams
from mint_core.eval.results import EVAL_LIMIT, GUARD_LIMIT
from mint_core.rl.recipe_defaults import RECIPE
from mint_core.serving.config import ServingConfig

ROOT = Path(__file__).resolve().parents[2]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def _doc(name: str) -> str:
    """A doc's text with its line breaks as spaces: a quote may wrap."""
    return re.sub(r"\s+", " ", (ROOT / name).read_text())


def _same(stated: str, value: Any) -> bool:
    """Whether a stated default is `value`: as numbers when both are numbers, else as written."""
    try:
        return float(stated.replace(",", "")) == float(value)
    except (TypeError, ValueError):
        return stated == shown(value)


# ---- params.yaml ------------------------------------------------------------------------------------------------


def test_params_yaml_runs_the_code_s_defaults() -> None:
    # what the pipeline builds is what a caller with no params.yaml gets (`mint data build`, the generated suites)
    assert PARAMS["data"] == DataParams().model_dump()
    assert PARAMS["eval_suites"] == {"limit": EVAL_LIMIT, "guard_limit": GUARD_LIMIT}
    assert PARAMS["base"]["eval_per_task"] == PretrainParams().eval_per_task


# ---- docs -------------------------------------------------------------------------------------------------------

WORKER_NAME = default_of(ServicesConfig, "worker_name").replace(socket.gethostname(), "<hostname>")

QUOTES: list[tuple[str, str, Callable[[], tuple[Any, ...]]]] = [
    # (doc, a pattern whose groups are defaults, the code's values for them)
    (
        "docs/training.md",
        r"(\d+) steps of (\d+) prompts x G (\d+), lr (\S+) decaying (\w+) to 0, rollouts at temperature (\S+), "
        r"rank (\d+) but rank 32 for `add`, alpha 2 x rank, the rate scaled by sqrt\((\d+) / rank\)",
        lambda: (
            RECIPE.steps,
            RECIPE.prompts_per_step,
            RECIPE.group_size,
            RECIPE.learning_rate,
            {"linear": "linearly"}.get(RECIPE.lr_decay),
            RECIPE.temperature,
            RECIPE.rank,
            RECIPE.rank,
        ),
    ),
    (
        "docs/training.md",
        r"every `--checkpoint-every` steps \((\d+)\)",
        lambda: (_option("train", "checkpoint_every").default,),
    ),
    (
        "docs/your-own-task.md",
        r"The first revision, (\d+) steps of the default recipe",
        lambda: (RECIPE.steps,),
    ),
    (
        "docs/builtin-base.md",
        r"`task_data` \(params `data:`\): ([\d,]+) train and ([\d,]+) held-out examples per task",
        lambda: (DataParams().n_train, DataParams().n_heldout),
    ),
    (
        "docs/builtin-base.md",
        r"Held-out accuracy \(greedy, `max_tokens` \d+, (\d+) prompts per task",
        lambda: (PretrainParams().eval_per_task,),
    ),
    (
        "docs/lifecycle.md",
        r"\(`(\w+)` and `(\w+)` by default\) through the `wave` flow",
        lambda: tuple(default_of(MainJobConfig, "policies")),
    ),
    (
        "docs/lifecycle.md",
        r"first get one: (\d+) GRPO steps from the base, .{0,200}?every built-in task's suite, (\d+) items each",
        lambda: (default_of(MainJobConfig, "first_steps"), default_of(MainJobConfig, "eval_limit")),
    ),
    (
        "docs/lifecycle.md",
        r"state directory \(`--state-dir`, default `([^`]+)`\)",
        lambda: (default_of(MainJobConfig, "state_dir"),),
    ),
    (
        "docs/lifecycle.md",
        r"its task's first held-out prompts \(config.cold_start_prompts, (\d+)\)",
        lambda: (RouteConfig().cold_start_prompts,),
    ),
    (
        "docs/lifecycle.md",
        r"rewarded decisions \((\d+) by default, `ROUTE_MIN_RECORDS`\)",
        lambda: (RouteConfig().min_records,),
    ),
    (
        "docs/engine.md",
        r"`MINT_RUN_DEVICE`\) and every benchmark's `--device` take `(\w+)` \(default\)",
        lambda: (default_of(MainJobConfig, "device"),),
    ),
    (
        "docs/multi-host.md",
        r"One name per worker \(`--name`, default `([^`]+)`\)",
        lambda: (WORKER_NAME,),
    ),
    (
        "docs/training-api.md",
        r"`tinker_keep_snapshots` unnamed snapshots \([^()]*default (\d+),",
        lambda: (default_of(ServingConfig, "tinker_keep_snapshots"),),
    ),
]


@pytest.mark.parametrize(("doc", "pattern", "values"), QUOTES, ids=[f"{d}:{p[:30]}" for d, p, _ in QUOTES])
def test_docs_quote_the_defaults_the_code_has(
    doc: str, pattern: str, values: Callable[[], tuple[Any, ...]]
) -> None:
    m = re.search(pattern, _doc(doc))
    assert m is not None, f"{doc} no longer says this; quote it anew here: {pattern}"
    wrong = [(s, v) for s, v in zip(m.groups(), values(), strict=True) if not _same(s, v)]
    assert wrong == [], f"{doc} states (stated, code) {wrong}"


SETTINGS: tuple[type[BaseModel], ...] = (ServingConfig, ServicesConfig, MainJobConfig, DataParams)
FIELD_QUOTE = re.compile(r"`(\w+)`[^`()]{0,40}\(default ([\w.]+)( [KM]iB)?")
"""A settings field quoted with its default: "`tinker_window_ms` (default 10 ms)", "(default 4 MiB, ...)"."""
UNITS = {"": 1, " KiB": 2**10, " MiB": 2**20}


def _field_quotes() -> Iterator[tuple[str, str, str]]:
    for page in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        for field, stated, unit in FIELD_QUOTE.findall(_doc(str(page.relative_to(ROOT)))):
            if any(field in m.model_fields for m in SETTINGS):
                yield page.name, field, stated if not unit else str(float(stated) * UNITS[unit])


def test_docs_quote_the_settings_defaults_the_code_has() -> None:
    quotes = list(_field_quotes())
    assert (
        len(quotes) >= 4
    )  # the Tinker API's window, saves kept and result lifetime, the body limit at least
    wrong = []
    for page, field, stated in quotes:
        values = [default_of(m, field) for m in SETTINGS if field in m.model_fields]
        if not any(_same(stated, v) for v in values):
            wrong.append(f"{page}: `{field}` (default {stated}), the code's: {values}")
    assert wrong == []


# ---- the command line's help ------------------------------------------------------------------------------------

STATED = re.compile(r"\\?\[default: ([^\]]+)\]|\(default:? ([^)]+)\)|; default: ([^.]+)\.")
"""A default written into an option's help (typer prints the others itself, from the parameter)."""

OWNERS: dict[tuple[str, ...], tuple[type[BaseModel], dict[str, str]]] = {
    # the settings a command's flags override, and their field where the flag's name is not the field's
    ("run",): (MainJobConfig, {}),
    ("serve",): (ServingConfig, {}),
    ("up",): (ServicesConfig, {}),
    ("down",): (ServicesConfig, {}),
    ("status",): (ServicesConfig, {}),
    ("logs",): (ServicesConfig, {}),
    ("worker",): (ServicesConfig, {"name": "worker_name", "port": "worker_port", "limit": "worker_limit"}),
}


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield path, cmd


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _option(command: str, name: str) -> Any:
    return next(p for p in COMMANDS[(command,)].params if p.name == name)


RULE = "a rule"


def _expected(path: tuple[str, ...], param: Any) -> str | None:
    """What a flag's help must state as its default: RULE where the settings' default is None (the help words the
    rule), None where no settings model holds the flag."""
    if param.name == "tracking_uri":  # the workspace's server, else this one
        return f"the one `mint up` runs for this workspace, else {DEFAULT_TRACKING}"
    if path == ("canary",) and param.name == "max_minutes":
        from tasks.canary import CanaryConfig  # loads Prefect: only for this test

        return shown(default_of(CanaryConfig, "max_minutes"))
    if path in OWNERS:
        model, renamed = OWNERS[path]
        field = renamed.get(param.name, param.name)
        if field in model.model_fields:
            value = default_of(model, field)
            # None: the field's default is a rule the help words ("SQLite in the state dir"), not a value
            return RULE if value is None else WORKER_NAME if field == "worker_name" else shown(value)
    return None


def test_help_states_the_defaults_the_code_has() -> None:
    wrong, checked = [], 0
    for path, cmd in COMMANDS.items():
        for param in cmd.params:
            for m in STATED.finditer(getattr(param, "help", None) or ""):
                stated = next(g for g in m.groups() if g)
                expected = _expected(path, param)
                where = f"mint {' '.join(path)} --{param.name}"
                if expected == RULE:
                    continue
                if expected is not None:
                    checked += 1
                    if not _same(stated, expected):
                        wrong.append(f"{where}: help says {stated!r}, the default is {expected!r}")
                elif re.search(r"\d", stated):  # a number no settings model holds: a copy nothing checks
                    wrong.append(f"{where}: help says {stated!r}; read it from the model that holds it")
    assert checked >= 20  # mint run's, mint up's and the registry's at least
    assert wrong == []
