"""The promotion gate: one table of (case, policy change, candidate, champion, expected outcome), the tests
behind its significance numbers, its renderings, and the `mint.gate` tag on a real MLflow registry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rich.console import Console

from mint_core.eval.gate import (
    GATE_TAG,
    GatePolicy,
    SuiteScore,
    decide,
    paired_p_value,
    two_proportion_p_value,
)

BASE = GatePolicy(
    suite="add",
    margin=0.02,
    guard_suites=["copy"],
    guard_tolerance=0.02,
    floors={"add": 0.5},
    min_samples=100,
)


def scores(add: float = 0.70, copy: float = 0.90, n: int = 200, **extra: float) -> list[SuiteScore]:
    out = [SuiteScore(name="add", score=add, n=n), SuiteScore(name="copy", score=copy, n=n)]
    return out + [SuiteScore(name=k, score=v, n=n) for k, v in extra.items()]


def correct(n_right: int, n: int, first: bool = True) -> list[bool]:
    """n booleans with n_right True, at the front (first) or the back."""
    right = [True] * n_right + [False] * (n - n_right)
    return right if first else right[::-1]


def flipped(base: list[bool], gained: int, lost: int) -> list[bool]:
    """`base` with its first `lost` right answers made wrong and its first `gained` wrong answers made right."""
    out, right = list(base), [i for i, x in enumerate(base) if x]
    wrong = [i for i, x in enumerate(base) if not x]
    for i in right[:lost]:
        out[i] = False
    for i in wrong[:gained]:
        out[i] = True
    return out


CHAMPION = scores(add=0.60, copy=0.90)

CASES: list[tuple[str, dict[str, Any], list[SuiteScore], list[SuiteScore] | None, bool, set[str]]] = [
    # (case, policy change, candidate, champion, passes, failed checks)
    ("better on own suite, guards hold", {}, scores(add=0.70), CHAMPION, True, set()),
    ("exactly champion + margin", {}, scores(add=0.62), CHAMPION, True, set()),
    ("below champion + margin", {}, scores(add=0.61), CHAMPION, False, {"margin:add"}),
    ("guard regression", {}, scores(add=0.70, copy=0.85), CHAMPION, False, {"guard:copy"}),
    ("guard dip within tolerance", {}, scores(add=0.70, copy=0.885), CHAMPION, True, set()),
    ("under the floor", {"floors": {"add": 0.75}}, scores(add=0.70), CHAMPION, False, {"floor:add"}),
    (
        "floor on a suite the champion lacks",
        {"floors": {"add": 0.5, "upper": 0.4}},
        scores(add=0.70, upper=0.3),
        CHAMPION,
        False,
        {"floor:upper"},
    ),
    (
        "too few samples",
        {},
        scores(add=0.70, n=50),
        scores(add=0.6, n=50),
        False,
        {"samples:add", "samples:copy"},
    ),
    (
        "too few samples on one suite",
        {"min_samples_by_suite": {"copy": 300}},
        scores(add=0.70),
        CHAMPION,
        False,
        {"samples:copy"},
    ),
    ("candidate not evaluated on a guard", {}, scores(add=0.70)[:1], CHAMPION, False, {"samples:copy"}),
    (
        "significant (two-proportion from counts)",
        {"significance": "auto"},
        scores(add=0.75),
        CHAMPION,
        True,
        set(),
    ),
    (
        "not significant (two-proportion from counts)",
        {"significance": "auto"},
        scores(add=0.65),
        CHAMPION,
        False,
        {"significance:add"},
    ),
    (
        "not significant (paired: 7 gained, 2 lost)",
        {"significance": "paired", "margin": 0.0},
        [SuiteScore(name="add", score=0.625, n=200, correct=flipped(correct(120, 200), 7, 2)), *scores()[1:]],
        [SuiteScore(name="add", score=0.6, n=200, correct=correct(120, 200)), *CHAMPION[1:]],
        False,
        {"significance:add"},
    ),
    (
        "significant (paired: 20 more right, none lost)",
        {"significance": "paired"},
        [SuiteScore(name="add", score=0.7, n=200, correct=correct(140, 200)), *scores()[1:]],
        [SuiteScore(name="add", score=0.6, n=200, correct=correct(120, 200)), *CHAMPION[1:]],
        True,
        set(),
    ),
    (
        "paired test without per-sample results",
        {"significance": "paired"},
        scores(add=0.9),
        CHAMPION,
        False,
        {"significance:add"},
    ),
    ("first revision above the floors", {}, scores(add=0.55, copy=0.1), None, True, set()),
    ("first revision under a floor", {}, scores(add=0.45), None, False, {"floor:add"}),
    (
        "first revision with too few samples",
        {},
        scores(add=0.9, n=10),
        None,
        False,
        {"samples:add", "samples:copy"},
    ),
]


@pytest.mark.parametrize(
    ("case", "change", "candidate", "champion", "passes", "failed"), CASES, ids=[c[0] for c in CASES]
)
def test_gate_table(
    case: str,
    change: dict[str, Any],
    candidate: list[SuiteScore],
    champion: list[SuiteScore] | None,
    passes: bool,
    failed: set[str],
) -> None:
    policy = BASE.model_copy(update=change)
    d = decide(GatePolicy.model_validate(policy.model_dump()), candidate, champion)
    assert d.passed is passes, d.reasons
    assert {c.name for c in d.failed()} == failed, d.reasons
    # every failed check is a reason, named
    for name in failed:
        assert any(r.startswith(f"{name}: ") for r in d.reasons), d.reasons
    assert d.first_revision is (champion is None)
    if champion is None:
        assert "first revision" in d.reasons[0] and "floors only" in d.reasons[0]
        assert not any(c.name.startswith(("margin", "guard", "significance")) for c in d.checks)
    if passes:
        assert d.reasons[-1].startswith("all ")


def test_gate_checks_every_suite_it_names() -> None:
    d = decide(BASE.model_copy(update={"significance": "auto"}), scores(add=0.8), CHAMPION)
    assert [c.name for c in d.checks] == [
        "samples:add",
        "samples:copy",
        "floor:add",
        "margin:add",
        "guard:copy",
        "significance:add",
    ]


def test_p_values_against_known_numbers() -> None:
    # sign test: 9 of 10 disagreements favour the candidate -> P(X >= 9 | Bin(10, .5)) = 11 / 1024
    cand = [True] * 9 + [False] + [True] * 5
    champ = [False] * 9 + [True] + [True] * 5
    assert paired_p_value(cand, champ) == pytest.approx(11 / 1024)
    assert paired_p_value([True, False], [True, False]) == 1.0
    # thousands of disagreements stay finite
    assert 0.0 <= paired_p_value([True] * 3000 + [False] * 2000, [False] * 3000 + [True] * 2000) < 1e-6
    # z = (0.75 - 0.6) / sqrt(.675 * .325 * 2 / 200) = 3.2026 -> one-sided p = 0.000681
    assert two_proportion_p_value(150, 200, 120, 200) == pytest.approx(6.81e-4, rel=1e-3)
    assert two_proportion_p_value(200, 200, 200, 200) == 1.0
    assert two_proportion_p_value(120, 200, 150, 200) > 0.99


@pytest.mark.parametrize(
    ("case", "kwargs", "message"),
    [
        ("own suite as guard", {"suite": "add", "guard_suites": ["add"]}, "cannot also be a guard"),
        ("floor above 1", {"suite": "add", "floors": {"add": 1.5}}, "floors must lie in [0, 1]"),
        ("unknown field", {"suite": "add", "margn": 0.1}, "margn"),
        ("negative margin", {"suite": "add", "margin": -0.1}, "margin"),
    ],
)
def test_policy_rejects(case: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[")):
        GatePolicy(**kwargs)


def test_suite_score_rejects_mismatched_samples() -> None:
    with pytest.raises(ValidationError, match="3 per-sample results but n=4"):
        SuiteScore(name="add", score=0.5, n=4, correct=[True, False, True])
    with pytest.raises(ValueError, match="twice"):
        decide(BASE, [*scores(), SuiteScore(name="add", score=0.1, n=200)], CHAMPION)


def test_renderings() -> None:
    d = decide(BASE, scores(add=0.61, copy=0.5), CHAMPION)
    md = d.markdown()
    assert md.startswith("**Gate: failed**")
    assert "| margin:add | FAIL | candidate 0.61 < champion 0.6 + margin 0.02 |" in md
    assert "| guard:copy | FAIL |" in md
    console = Console(record=True, width=160)
    console.print(d.table())
    text = console.export_text()
    assert "margin:add" in text and "FAIL" in text
    tag = json.loads(d.tag_value())
    assert tag["passed"] is False and set(tag["failed"]) == {"margin:add", "guard:copy"}
    assert tag["reasons"] == d.reasons
    assert ": " not in d.tag_value().split('"reasons"')[0]  # compact separators


@pytest.mark.parametrize("n_suites", [150, 400])
def test_tag_value_fits_an_mlflow_tag(n_suites: int) -> None:
    policy = GatePolicy(suite="s0", floors={f"s{i}": 0.9 for i in range(n_suites)})
    d = decide(policy, [SuiteScore(name=f"s{i}", score=0.1, n=5) for i in range(n_suites)])
    tag = d.tag_value()
    assert len(tag) <= 5000 < len(json.dumps(d.reasons))
    doc = json.loads(tag)
    assert doc["truncated"] is True and doc["passed"] is False
    assert doc["reasons"] == d.reasons[: len(doc["reasons"])]  # trailing reasons go first, then failed names
    if n_suites == 150:
        assert doc["reasons"] and len(doc["failed"]) == n_suites
    else:
        assert not doc["reasons"] and doc["failed"] == [c.name for c in d.failed()][: len(doc["failed"])]


def test_record_gate_on_a_real_registry(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from mint_core.registry.runs import tag_version

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("add-policy")
    mv = client.create_model_version("add-policy", source=str(tmp_path / "rev"))
    d = decide(BASE, scores(add=0.70), CHAMPION)
    tag_version(client, "add-policy", int(mv.version), GATE_TAG, d.tag_value())
    tag = client.get_model_version("add-policy", mv.version).tags[GATE_TAG]
    assert json.loads(tag) == {"passed": True, "first_revision": False, "reasons": d.reasons, "failed": []}
