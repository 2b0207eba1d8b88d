"""A user's task is judged by its own spec: its `gate:` and `recipe:` sections are validated against the registry,
nothing of the built-in demo judges it, and the smoke check after a promotion asks its own held-out prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mint_core.data.spec import (
    BUILTIN_DIR,
    SpecError,
    TaskRegistry,
    demo_policies,
    load_spec,
    registry,
)
from mint_core.eval.gate import GatePolicy
from mint_core.lifecycle.smoke import SMOKE_FALLBACK, smoke_prompt

SHOUT = Path(__file__).resolve().parents[2] / "examples" / "shout"
BASE_SPEC: dict[str, Any] = {
    "data": {"train": "t.jsonl", "heldout": "h.jsonl"},
    "rewards": [{"builtin": "exact_match"}],
    "eval": {"task": "mine"},
}


def write_task(root: Path, name: str, **extra: Any) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "task.yaml").write_text(yaml.safe_dump({**BASE_SPEC, **extra}))
    return folder


@pytest.mark.parametrize(
    ("case", "extra", "message"),
    [
        (
            "a guard that is no task",
            {"gate": {"guards": ["nope"]}},
            "gate.guards names 'nope', not registered",
        ),
        ("itself as a guard", {"gate": {"guards": ["mine"]}}, "gate.guards names the task itself"),
        ("replay with nothing to replay", {"recipe": {"replay": 0.25}}, "recipe.replay draws from the tasks"),
        ("a margin out of range", {"gate": {"min_effect": 1.5}}, "gate.min_effect"),
        ("an unknown gate field", {"gate": {"guard": ["add"]}}, "gate.guard: Extra inputs are not permitted"),
        ("a rank out of range", {"recipe": {"rank": 0}}, "recipe.rank"),
    ],
)
def test_a_bad_gate_or_recipe_section_is_named(tmp_path: Path, case: str, extra: Any, message: str) -> None:
    folder = write_task(tmp_path, "mine", **extra)
    with pytest.raises(SpecError, match=message):
        TaskRegistry.load([BUILTIN_DIR, folder])


def test_a_task_without_gate_guards_nothing_and_reports_every_other_task(
    tmp_path: Path, register_tasks: Any
) -> None:
    register_tasks(SHOUT)
    spec = registry().get("shout")
    assert spec.gate.guards == [] and spec.recipe.replay == 0.0
    p = GatePolicy(suite="shout")
    assert p.guards() == [] and p.gated_suites() == ["shout"]
    assert p.info_suites == ["add", "copy", "reverse", "sort", "upper"]
    assert p.suites() == ["shout", "add", "copy", "reverse", "sort", "upper"]  # all scored, one gates
    assert "reported, not gating" in p.describe() and "non-inferior" not in p.describe()
    # a built-in's gate does not guard the user's task either: it is reported beside it
    add = GatePolicy(suite="add")
    assert add.guard_tasks == ["copy", "reverse", "sort", "upper"] and add.info_suites == ["shout"]


def test_a_declared_guard_gates_a_users_task(tmp_path: Path, register_tasks: Any) -> None:
    folder = write_task(
        tmp_path, "careful", gate={"guards": ["copy"], "min_effect": 0.1}, recipe={"replay": 0.2}
    )
    register_tasks(folder)
    p = GatePolicy(suite="careful")
    assert (p.guard_tasks, p.min_effect) == (["copy"], 0.1)
    assert p.info_suites == ["add", "reverse", "sort", "upper"]


def test_the_smoke_check_asks_the_revisions_own_task(register_tasks: Any) -> None:
    register_tasks(SHOUT)
    assert smoke_prompt("shout") == load_spec(SHOUT / "task.yaml").heldout_rows()[0].prompt
    assert str(smoke_prompt("shout")).startswith("shout: ")
    assert smoke_prompt(None) == SMOKE_FALLBACK and smoke_prompt("unregistered") == SMOKE_FALLBACK


def test_the_demo_is_named_in_the_builtin_folder_only() -> None:
    """The demo's default policies come from its own file; every built-in task is a spec with its hints."""
    assert demo_policies() == ["add", "sort"]
    builtins = TaskRegistry.load([BUILTIN_DIR]).specs
    for name, spec in builtins.items():
        assert sorted([*spec.gate.guards, name]) == sorted(builtins), name
        assert spec.gate.guard_suites == ["guard"] and spec.recipe.replay == 0.25
