"""A dashboard form that cannot work is refused before anything runs, with a message naming the field (issue 27):
Prefect validates a flow run's parameters against the flow's pydantic models before the flow starts. Every
deployment's defaults in infra/prefect.yaml pass the same check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.exceptions import ParameterTypeError
from pydantic import ValidationError

from flows.forms import PolicyRun
from flows.lifecycle import lifecycle, wave

PREFECT_FILE = Path(__file__).resolve().parents[2] / "infra" / "prefect.yaml"
ADD = {"spec": {"name": "add", "task": "add"}}


def with_spec(**change: Any) -> dict[str, Any]:
    return {"policies": [{"spec": {"name": "add", "task": "add", **change}}]}


@pytest.mark.parametrize(
    ("case", "form", "expected"),
    [
        ("rank 0", with_spec(rank=0), r"policies\.0\.spec\.rank: Input should be greater than or equal to 1"),
        (
            "rank above the limit",
            with_spec(rank=4096),
            r"policies\.0\.spec\.rank: .*less than or equal to 512",
        ),
        (
            "unknown task",
            with_spec(task="addd"),
            r"policies\.0: .*spec\.task: unknown task 'addd'; registered: add, copy",
        ),
        ("unknown reward", with_spec(reward="nope"), r"policies\.0\.spec\.reward: .*unknown reward 'nope'"),
        (
            "policy name",
            with_spec(name="my policy/1"),
            r"policies\.0\.spec\.name: String should match pattern",
        ),
        (
            "no targets",
            with_spec(targets=[]),
            r"policies\.0\.spec\.targets: List should have at least 1 item",
        ),
        ("alpha 0", with_spec(alpha=0), r"policies\.0\.spec\.alpha: Input should be greater than 0"),
        (
            "steps 0",
            {"policies": [ADD], "training": {"steps": 0}},
            r"training\.steps: .*greater than or equal to 1",
        ),
        (
            "prompts per step 0",
            {"policies": [ADD], "training": {"prompts_per_step": 0}},
            r"training\.prompts_per_step: .*greater than or equal to 1",
        ),
        ("no policies", {"policies": []}, r"policies: List should have at least 1 item"),
        ("a policy twice", {"policies": [ADD, ADD]}, r"policies: .*spec\.name 'add' given more than once"),
        (
            "a served name twice",
            {
                "policies": [
                    {**ADD, "served_name": "x"},
                    {"spec": {"name": "s", "task": "sort"}, "served_name": "x"},
                ]
            },
            r"policies: .*served_name 'x' given more than once",
        ),
        (
            "served name",
            {"policies": [{**ADD, "served_name": "a b"}]},
            r"policies\.0\.served_name: String should",
        ),
        ("unknown field", with_spec(rnak=16), r"policies\.0\.spec\.rnak: Extra inputs are not permitted"),
    ],
)
def test_a_form_that_cannot_work_is_refused_naming_the_field(
    case: str, form: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ParameterTypeError, match=expected):
        wave.validate_parameters(form)


def test_lifecycle_refuses_the_same_spec() -> None:
    with pytest.raises(ParameterTypeError, match=r"policy\.spec\.rank: .*greater than or equal to 1"):
        lifecycle.validate_parameters({"policy": {"spec": {"name": "add", "task": "add", "rank": 0}}})


def test_a_policy_run_checks_its_task_in_the_registry_it_is_given(tmp_path: Path) -> None:
    """The task registry passed in the validation context decides which tasks a form may name."""
    from mint_core.data.spec import BUILTIN_DIR, TASKS_CONTEXT, TaskRegistry

    task = tmp_path / "mine"
    task.mkdir()
    (task / "task.yaml").write_text(
        "data: {train: t.jsonl, heldout: h.jsonl}\nrewards: [{builtin: exact_match}]\neval: {task: mine}\n"
    )
    doc = {"spec": {"name": "mine", "task": "mine"}}
    with pytest.raises(ValidationError, match=r"unknown task 'mine'; registered: add, copy"):
        PolicyRun.model_validate(doc)
    given = TaskRegistry.load([BUILTIN_DIR, tmp_path])
    run = PolicyRun.model_validate(doc, context={TASKS_CONTEXT: given})
    assert run.spec.task == "mine" and run.gate_policy().suite == "mine"
    with pytest.raises(ValidationError, match=rf"unknown task 'addd'; .*task folder: .*{tmp_path}"):
        PolicyRun.model_validate({"spec": {"name": "a", "task": "addd"}}, context={TASKS_CONTEXT: given})


def test_every_training_deployments_defaults_pass() -> None:
    deployments = {d["name"]: d for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"]}
    for name, flow in (("wave", wave), ("lifecycle", lifecycle)):
        flow.validate_parameters(deployments[name]["parameters"])
