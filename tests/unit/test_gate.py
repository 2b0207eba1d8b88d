"""The promotion gate: one table of (case, policy change, candidate, baseline, expected outcome), the statistics
behind it checked against hand-computed numbers (exact McNemar, the score interval's coverage, sample sizes),
its renderings, and the `mint.gate` tag on a real MLflow registry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rich.console import Console

from mint_core.eval.gate import (
    GATE_TAG,
    Baseline,
    GatePolicy,
    SuiteScore,
    decide,
    detectable_margin,
    discordant,
    mcnemar_p,
    mde,
    noninferiority_p,
    paired_ci,
    required_n,
    score_z,
)
from mint_core.eval.results import EVAL_LIMIT

POLICY = GatePolicy(
    suite="add", guard_suites=["copy"], guard_tasks=[], info_suites=[], floors={"add": 0.3}, min_samples=20
)
Z95 = 1.959963984540054


def paired(name: str, n: int, both: int, b: int, c: int) -> tuple[SuiteScore, SuiteScore]:
    """(candidate, baseline) on the same n items: `both` right on both sides, then b only the candidate gets
    right, then c only the baseline gets right; the rest wrong on both."""
    rest = n - both - b - c
    assert rest >= 0
    cand = [True] * both + [True] * b + [False] * c + [False] * rest
    base = [True] * both + [False] * b + [True] * c + [False] * rest
    return (
        SuiteScore(name=name, score=sum(cand) / n, n=n, correct=cand),
        SuiteScore(name=name, score=sum(base) / n, n=n, correct=base),
    )


def sides(
    add: tuple[int, int, int, int] = (200, 120, 30, 2), copy: tuple[int, int, int, int] = (200, 170, 3, 3)
) -> tuple[list[SuiteScore], list[SuiteScore]]:
    """Candidate and baseline scores on `add` and `copy`, each given as (n, both right, b, c)."""
    a, c = paired("add", *add), paired("copy", *copy)
    return [a[0], c[0]], [a[1], c[1]]


GOOD = sides()
PLUS_ONE = sides(
    add=(100, 38, 1, 0)
)  # 0.38 -> 0.39 on 100 items: the old gate (margin 0, no test) promoted it


def aggregate(scores: list[SuiteScore]) -> list[SuiteScore]:
    return [SuiteScore(name=s.name, score=s.score, n=s.n) for s in scores]


CASES: list[
    tuple[str, dict[str, Any], tuple[list[SuiteScore], list[SuiteScore] | None], Baseline, bool, set[str]]
]
CASES = [
    # (case, policy change, (candidate, baseline), baseline kind, passes, failed checks)
    ("significant gain, guard holds", {}, GOOD, "champion", True, set()),
    ("+1 item: 0.38 -> 0.39 on 100", {}, PLUS_ONE, "champion", False, {"gain:add"}),
    ("+1 item net, 5 gained 4 lost", {}, sides(add=(100, 34, 5, 4)), "champion", False, {"gain:add"}),
    (
        "significant but below min_effect",
        {},
        sides(add=(2000, 800, 130, 60)),
        "champion",
        False,
        {"gain:add"},
    ),
    (
        "large but not significant",
        {"min_samples": 1},
        sides(add=(20, 5, 3, 0)),
        "champion",
        False,
        {"gain:add"},
    ),
    ("significantly worse", {}, sides(add=(200, 100, 0, 20)), "champion", False, {"gain:add"}),
    ("guard regression beyond margin", {}, sides(copy=(200, 150, 2, 30)), "champion", False, {"guard:copy"}),
    ("guard dip shown within margin", {}, sides(copy=(400, 300, 5, 7)), "champion", True, set()),
    (
        "guard too small to show non-inferiority",
        {},
        sides(copy=(40, 30, 2, 2)),
        "champion",
        False,
        {"guard:copy"},
    ),
    ("under the floor", {"floors": {"add": 0.9}}, GOOD, "champion", False, {"floor:add"}),
    ("too few samples", {"min_samples": 300}, GOOD, "champion", False, {"samples:add", "samples:copy"}),
    ("candidate not evaluated on a guard", {}, (GOOD[0][:1], GOOD[1]), "champion", False, {"samples:copy"}),
    (
        "aggregates only: no paired test",
        {},
        (aggregate(GOOD[0]), GOOD[1]),
        "champion",
        False,
        {"gain:add", "guard:copy"},
    ),
    (
        "different items on the two sides",
        {},
        (GOOD[0], [paired("add", 199, 120, 0, 0)[1], GOOD[1][1]]),
        "champion",
        False,
        {"gain:add"},
    ),
    ("first revision beats the base", {}, GOOD, "base", True, set()),
    ("first revision no better than the base", {}, PLUS_ONE, "base", False, {"gain:add"}),
    ("no baseline scores: floors only", {}, (GOOD[0], None), "champion", True, set()),
    (
        "no baseline scores, under a floor",
        {"floors": {"add": 0.9}},
        (GOOD[0], None),
        "base",
        False,
        {"floor:add"},
    ),
    ("compare=False: floors only", {"compare": False}, PLUS_ONE, "champion", True, set()),
]


@pytest.mark.parametrize(
    ("case", "change", "scores", "baseline", "passes", "failed"), CASES, ids=[c[0] for c in CASES]
)
def test_gate_table(
    case: str,
    change: dict[str, Any],
    scores: tuple[list[SuiteScore], list[SuiteScore] | None],
    baseline: Baseline,
    passes: bool,
    failed: set[str],
) -> None:
    policy = GatePolicy.model_validate({**POLICY.model_dump(), **change})
    candidate, base = scores
    d = decide(policy, candidate, base, baseline=baseline)
    assert d.passed is passes, d.reasons
    assert {c.name for c in d.failed()} == failed, d.reasons
    for name in failed:  # every failed check is a reason, named, with its numbers
        assert any(r.startswith(f"{name}: ") for r in d.reasons), d.reasons
    compared = base is not None and policy.compare
    assert d.baseline == (baseline if compared else None)
    assert d.first_revision is (baseline == "base" or base is None)
    if baseline == "base" and compared:
        assert d.reasons[0].startswith("first revision: compared with the bare base (revision 0)")
    if not compared:
        assert "sample counts and floors only" in d.reasons[0]
        assert not any(c.name.startswith(("gain", "guard")) for c in d.checks)
    else:  # every paired check reports effect, CI, p and n
        for c in d.checks:
            if c.name.startswith(("gain", "guard")) and c.stats is not None:
                s = c.stats
                assert s.ci[0] <= s.effect <= s.ci[1] and 0.0 <= s.p_value <= 1.0 and s.n > 0
                assert "CI [" in c.detail and "p=" in c.detail and f"n={s.n}" in c.detail
    if passes:
        assert any(r.startswith("all ") for r in d.reasons)


def test_plus_one_item_is_not_a_promotion() -> None:
    """The issue's case: `reverse` 0.38 -> 0.39 over 100 items. The old gate compared raw scores with margin 0
    (0.39 >= 0.38 + 0) and promoted; the new one sees 1 discordant item: p = 1, and 0.04 short of min_effect."""
    cand, base = PLUS_ONE
    assert cand[0].score >= base[0].score + 0.0  # what the old gate checked
    d = decide(POLICY, cand, base)
    gain = d.check("gain:add")
    assert gain is not None and gain.stats is not None and not d.passed
    assert (gain.stats.b, gain.stats.c, gain.stats.n) == (1, 0, 100)
    assert gain.stats.effect == pytest.approx(0.01) and gain.stats.p_value == 1.0
    assert gain.stats.ci[0] < 0 < gain.stats.ci[1]
    assert "not significant (exact McNemar p=1 >= alpha 0.05, items gained 1, lost 0)" in gain.detail
    assert "0.040 short of min_effect 0.05" in gain.detail


def test_gate_checks_every_suite_it_names() -> None:
    d = decide(POLICY, *GOOD)
    assert [c.name for c in d.checks] == [
        "samples:add",
        "samples:copy",
        "floor:add",
        "gain:add",
        "guard:copy",
    ]


# ---- per-task guards ------------------------------------------------------------------------------------------

OTHERS = ["add", "copy", "reverse", "upper"]  # registered tasks, in the order of their spec files


def first_sort_revision(
    add: tuple[int, int, int, int] = (320, 100, 6, 58),
) -> tuple[list[SuiteScore], list[SuiteScore]]:
    """A `sort` revision against the base as measured on the built-in base: +0.156 on its own suite, `add` at
    -0.163 (6 gained, 58 lost of 320 by default), the other tasks barely touched, and the pooled guard group at
    -0.006 (its own task's items make up for `add`'s)."""
    shapes = {
        "sort": (320, 240, 55, 5),
        "add": add,
        "reverse": (320, 30, 1, 3),
        "copy": (320, 210, 2, 3),
        "upper": (320, 200, 2, 3),
        "guard": (640, 440, 25, 29),
    }
    pairs = [paired(name, *shape) for name, shape in shapes.items()]
    return [c for c, _ in pairs], [b for _, b in pairs]


def test_a_builtin_task_declares_its_guards_and_a_form_overrides_them() -> None:
    p = GatePolicy(suite="sort")  # what sort's spec declares: each other built-in task, and the pooled group
    assert p.guard_tasks == OTHERS and p.guard_suites == ["guard"]
    assert p.guards() == [*OTHERS, "guard"]
    assert p.suites() == ["sort", *OTHERS, "guard"]  # what the lifecycle evaluates, the base included
    assert p.info_suites == []  # every other registered task is a guard already
    assert GatePolicy(suite="sort", guard_suites=["guard"]) == p  # today's form gives the same gate
    # a task already a guard suite is guarded once; explicit tasks, or none
    assert GatePolicy(suite="sort", guard_suites=["guard", "add"]).guards() == [*OTHERS[1:], "guard", "add"]
    assert GatePolicy(suite="add", guard_suites=["guard"], guard_tasks=["sort"]).guards() == ["sort", "guard"]
    assert GatePolicy(suite="add", guard_suites=["guard"], guard_tasks=[]).guards() == ["guard"]
    # what a form turns off is off, and what it no longer guards is still reported
    off = GatePolicy(suite="add", guard_suites=[], guard_tasks=[])
    assert off.guards() == [] and off.info_suites == ["copy", "reverse", "sort", "upper"]
    assert POLICY.guards() == ["copy"]
    # a suite that is no registered task declares nothing: its own suite alone, every registered task reported
    mine = GatePolicy(suite="mine")
    assert mine.guards() == [] and mine.info_suites == [*OTHERS[:3], "sort", "upper"]
    # resolved once: the policy round-trips through its JSON (the flows' parameters) unchanged
    assert GatePolicy.model_validate_json(p.model_dump_json()) == p


def test_a_task_without_gate_is_gated_on_its_own_suite_and_shows_what_it_forgot() -> None:
    """The issue's case: a user's adapter that learned its own task (+0.175, 0.000 -> 0.175) and forgot the
    demo's (`sort` -0.497, `add` -0.338): rejected by the built-in guards, passed by its own gate, which shows
    every other suite's change beside the decision."""
    shapes = {
        "mine": (320, 0, 56, 0),
        "sort": (320, 80, 2, 161),
        "add": (320, 50, 3, 111),
        "copy": (320, 250, 3, 4),
        "reverse": (320, 30, 2, 2),
        "upper": (320, 200, 1, 3),
    }
    pairs = [paired(name, *shape) for name, shape in shapes.items()]
    cand, base = [c for c, _ in pairs], [b for _, b in pairs]
    old = decide(
        GatePolicy(suite="mine", guard_tasks=[*OTHERS[:3], "sort", "upper"]), cand, base, baseline="base"
    )
    assert not old.passed and {c.name for c in old.failed()} == {"guard:add", "guard:sort"}
    d = decide(GatePolicy(suite="mine"), cand, base, baseline="base")
    assert d.passed, d.reasons
    assert [c.name for c in d.checks if c.gating] == ["samples:mine", "gain:mine"]
    info = {c.name: c for c in d.side_effects()}
    assert list(info) == [f"info:{t}" for t in ["add", "copy", "reverse", "sort", "upper"]]
    assert all(c.passed and c.stats is not None for c in info.values())
    assert info["info:sort"].stats is not None and info["info:sort"].stats.effect == pytest.approx(-159 / 320)
    assert info["info:sort"].detail.startswith("sort -0.497 (") and info["info:sort"].detail.endswith(
        "(not a guard)"
    )
    assert any("sort -0.497 (not a guard)" in r and "add -0.338 (not a guard)" in r for r in d.reasons)
    assert "| info:sort | info | -0.497 |" in d.markdown()
    tag = json.loads(d.tag_value())
    assert tag["passed"] and tag["stats"]["info:sort"]["effect"] == round(-159 / 320, 4)
    # a suite it reports but that was not evaluated is left out, and rejects nothing
    partial = decide(GatePolicy(suite="mine"), cand[:2], base[:2], baseline="base")
    assert partial.passed and [c.name for c in partial.side_effects()] == ["info:sort"]


def test_the_demos_gate_gives_the_same_verdicts_from_its_specs() -> None:
    """The built-in specs declare what the lifecycle's gate used to compute: the same checks, the same verdicts."""
    for add in ((320, 100, 6, 58), (320, 100, 4, 6)):
        cand, base = first_sort_revision(add=add)
        declared = decide(GatePolicy(suite="sort"), cand, base, baseline="base")
        explicit = decide(
            GatePolicy(suite="sort", guard_suites=["guard"], guard_tasks=OTHERS, info_suites=[]),
            cand,
            base,
            baseline="base",
        )
        assert declared == explicit and not declared.side_effects()


def test_a_tasks_gate_section_sets_margins_a_form_still_wins(tmp_path: Path, register_tasks: Any) -> None:
    task = tmp_path / "strict"
    task.mkdir()
    (task / "task.yaml").write_text(
        "data: {train: t.jsonl, heldout: h.jsonl}\nrewards: [{builtin: exact_match}]\n"
        "eval: {task: strict}\ngate: {guards: [copy], min_effect: 0.2, task_guard_margin: 0.02}\n"
    )
    register_tasks(tmp_path)
    p = GatePolicy(suite="strict")
    assert (p.guard_tasks, p.guard_suites, p.min_effect, p.task_guard_margin) == (["copy"], [], 0.2, 0.02)
    assert p.guard_margin == GatePolicy.model_fields["guard_margin"].default  # unset: the gate's default
    assert "strict" in GatePolicy(suite="add").info_suites  # type: ignore[operator]
    form = GatePolicy(suite="strict", min_effect=0.05, guard_tasks=[])
    assert (form.min_effect, form.guards(), form.task_guard_margin) == (0.05, [], 0.02)


def test_a_gate_reads_the_task_registry_its_validation_is_given(tmp_path: Path) -> None:
    """A registry passed in the validation context is the one the gate's defaults and guards come from, not the
    process's: `strict` is registered in no folder of this process."""
    from mint_core.data.spec import BUILTIN_DIR, TASKS_CONTEXT, TaskRegistry, registry

    task = tmp_path / "strict"
    task.mkdir()
    (task / "task.yaml").write_text(
        "data: {train: t.jsonl, heldout: h.jsonl}\nrewards: [{builtin: exact_match}]\n"
        "eval: {task: strict}\ngate: {guards: [copy], min_effect: 0.2}\n"
    )
    given = {TASKS_CONTEXT: TaskRegistry.load([BUILTIN_DIR, tmp_path])}
    assert "strict" not in registry()
    p = GatePolicy.model_validate({"suite": "strict"}, context=given)
    assert (p.guard_tasks, p.min_effect) == (["copy"], 0.2)
    assert GatePolicy(suite="strict").min_effect != 0.2  # the process's registry: no such spec, the defaults
    with pytest.raises(ValidationError, match=r"guard_tasks \['strict'\] are not registered tasks"):
        GatePolicy(suite="add", guard_tasks=["strict"])
    assert GatePolicy.model_validate({"suite": "add", "guard_tasks": ["strict"]}, context=given).guards()


def test_one_task_regression_fails_its_own_guard_though_the_pool_passes() -> None:
    """The issue's case: a `sort` revision that costs `add` 0.163 passed the pooled guard, and now fails
    `guard:add` alone, with every other guard shown passing beside it."""
    cand, base = first_sort_revision()
    pooled_only = decide(
        GatePolicy(suite="sort", guard_suites=["guard"], guard_tasks=[]), cand, base, baseline="base"
    )
    assert pooled_only.passed, pooled_only.reasons
    d = decide(GatePolicy(suite="sort", guard_suites=["guard"]), cand, base, baseline="base")
    assert not d.passed and [c.name for c in d.failed()] == ["guard:add"]
    assert [c.name for c in d.checks if c.name.startswith(("gain", "guard"))] == [
        "gain:sort",
        *(f"guard:{t}" for t in OTHERS),
        "guard:guard",
    ]
    add = d.check("guard:add")
    assert add is not None and add.stats is not None
    assert (add.stats.n, add.stats.b, add.stats.c) == (320, 6, 58)
    assert (
        add.stats.effect == pytest.approx(-52 / 320) and add.stats.ci[1] < -0.05
    )  # all of it beyond the margin
    assert add.detail.startswith("-0.163 (0.494 -> 0.331), 95% CI [")
    assert "below -margin -0.100 (p >= alpha/2 = 0.025): cannot rule out a regression" in add.detail
    assert any(r.startswith("guard:add: -0.163 (0.494 -> 0.331)") for r in d.reasons)
    for t in OTHERS[1:]:  # the tasks it left alone: a handful of items changed, CI well within the margin
        g = d.check(f"guard:{t}")
        assert g is not None and g.passed and g.stats is not None and g.stats.n == 320
        assert g.stats.ci[0] > -0.05 and g.stats.p_value < 0.025
    # within the margin on add too: promoted
    ok = decide(GatePolicy(suite="sort", guard_suites=["guard"]), *first_sort_revision(add=(320, 100, 4, 6)))
    assert ok.passed, ok.reasons


def test_every_per_task_guard_is_in_the_table_the_artifact_and_the_tag() -> None:
    cand, base = first_sort_revision()
    d = decide(GatePolicy(suite="sort", guard_suites=["guard"]), cand, base, baseline="base")
    guards = [f"guard:{t}" for t in [*OTHERS, "guard"]]
    md = d.markdown()
    console = Console(record=True, width=250)
    console.print(d.table())
    text = console.export_text()
    tag = json.loads(d.tag_value())
    assert len(d.tag_value()) <= 5000 and "truncated" not in tag
    for name in guards:
        check = d.check(name)
        assert check is not None and check.stats is not None
        s = check.stats
        ci = f"[{s.ci[0]:+.3f}, {s.ci[1]:+.3f}]"
        row = f"| {name} | {'pass' if check.passed else 'FAIL'} | {s.effect:+.3f} | {ci} | {s.p_value:.3g} | {s.n} |"
        assert row in md, md
        assert name in text and ci in text
        assert tag["stats"][name]["n"] == s.n and tag["stats"][name]["effect"] == round(s.effect, 4)
        assert tag["stats"][name]["ci"] == [round(s.ci[0], 4), round(s.ci[1], 4)]
        assert tag["stats"][name]["p"] == float(f"{s.p_value:.4g}")
    assert tag["failed"] == ["guard:add"]


# ---- the statistics against hand-computed numbers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("b", "c", "alternative", "p"),
    [
        (8, 1, "two-sided", 20 / 512),  # 2 (C(9,0) + C(9,1)) / 2^9 = 0.039
        (1, 8, "two-sided", 20 / 512),
        (8, 1, "greater", 10 / 512),  # (C(9,8) + C(9,9)) / 2^9
        (9, 1, "greater", 11 / 1024),
        (6, 0, "two-sided", 2 / 64),  # the fewest discordant items that can be significant at 0.05
        (5, 0, "two-sided", 2 / 32),
        (5, 5, "two-sided", 1.0),  # capped
        (1, 0, "two-sided", 1.0),
        (0, 0, "two-sided", 1.0),
        (10, 2, "two-sided", 2 * (1 + 12 + 66) / 4096),  # 0.0386
    ],
)
def test_exact_mcnemar(b: int, c: int, alternative: Any, p: float) -> None:
    assert mcnemar_p(b, c, alternative) == pytest.approx(p, rel=1e-12)


def test_exact_mcnemar_agrees_with_scipy_and_scales() -> None:
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(8, 1), (30, 12), (17, 17), (3, 40)]:
        assert mcnemar_p(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)
    assert 0.0 <= mcnemar_p(3000, 2000) < 1e-6  # thousands of disagreements stay finite
    with pytest.raises(ValueError, match="equal lengths"):
        discordant([True], [True, False])


def test_score_interval_against_closed_forms() -> None:
    # no discordant items: the interval is +-z^2 / (n + z^2) (a Wilson-like bound), 0.037 for n = 100
    lo, hi = paired_ci(0, 0, 100)
    assert hi == pytest.approx(Z95**2 / (100 + Z95**2), rel=1e-6) and lo == pytest.approx(-hi, rel=1e-6)
    # at delta0 = 0 the score statistic is McNemar's (b - c) / sqrt(b + c)
    assert score_z(8, 1, 50, 0.0) == pytest.approx(7 / 3)
    # the interval's ends are where the score test is exactly at its critical value
    lo, hi = paired_ci(8, 1, 50)
    assert score_z(8, 1, 50, lo) == pytest.approx(Z95, abs=1e-6)
    assert score_z(8, 1, 50, hi) == pytest.approx(-Z95, abs=1e-6)
    assert 0 < lo < 7 / 50 < hi  # b=8, c=1: significant, and so the 95% interval excludes 0
    # every item discordant for the candidate: Z = sqrt(n (1 - d) / (1 + d)), so the lower end is
    # (n - z^2) / (n + z^2) = 0.445 for n = 10, and the upper end is 1
    assert paired_ci(10, 0, 10) == (pytest.approx((10 - Z95**2) / (10 + Z95**2), rel=1e-6), 1.0)


@pytest.mark.parametrize(("n", "p10", "p01"), [(50, 0.15, 0.05), (100, 0.10, 0.10), (100, 0.20, 0.05)])
def test_score_interval_coverage(n: int, p10: float, p01: float) -> None:
    """Exact coverage of the 95% interval: the probability, summed over every (b, c) the multinomial can give,
    that the interval holds the true effect p10 - p01. Tango's interval keeps within a point of nominal."""
    delta, rest = p10 - p01, 1.0 - p10 - p01
    covered = 0.0
    for b in range(n + 1):
        for c in range(n - b + 1):
            log_p = math.lgamma(n + 1) - math.lgamma(b + 1) - math.lgamma(c + 1) - math.lgamma(n - b - c + 1)
            log_p += b * math.log(p10) + c * math.log(p01) + (n - b - c) * math.log(rest)
            if log_p < -30:
                continue
            lo, hi = paired_ci(b, c, n)
            covered += math.exp(log_p) * (lo <= delta <= hi)
    assert 0.94 <= covered <= 0.96


def test_noninferiority_p_matches_the_interval() -> None:
    """A guard passes exactly when its interval clears -margin, i.e. when the one-sided p < alpha / 2."""
    for b, c, n in [(5, 7, 400), (2, 30, 200), (2, 2, 40), (10, 25, 200), (0, 0, 60), (12, 3, 100)]:
        for margin in (0.02, 0.05, 0.10):
            assert (paired_ci(b, c, n)[0] > -margin) is (noninferiority_p(b, c, n, margin) < 0.025), (b, c, n)
    # hand check: b = c = 5 of 200, margin 0.05 -> q = 0.0125 + ..., z = 10 / sqrt(200 (2 q - 0.0525))
    assert noninferiority_p(5, 5, 200, 0.05) == pytest.approx(0.00548, rel=1e-2)


def test_sample_sizes_and_mde() -> None:
    # n = (1.96 sqrt(0.2) + 0.8416 sqrt(0.2 - 0.01))^2 / 0.01 = (0.8765 + 0.3668)^2 / 0.01 = 154.6
    assert required_n(0.10, 0.20) == 155
    assert required_n(0.10, 0.25) == 194  # 200 items per suite hold up to a discordance of 0.25
    # the bar, p < 0.01: EVAL_LIMIT's 320 items hold up to a discordance of 0.275
    assert required_n(0.10, 0.275, alpha=0.01) == 319 <= EVAL_LIMIT
    assert required_n(0.05, 0.20) == 626
    for n, d in [(100, 0.2), (200, 0.2), (500, 0.3)]:
        effect = mde(n, d)
        assert effect is not None and required_n(effect, d) == pytest.approx(n, abs=1)
    assert mde(200, 0.2) == pytest.approx(0.0881, abs=1e-4)
    assert mde(100, 0.01) is None  # two revisions that barely differ cannot show any gain on 100 items
    # guard: (1.96 + 0.8416) sqrt(0.2 / 200) = 0.0886; a 0.05 margin needs 7.85 x 0.2 / 0.0025 = 628
    assert detectable_margin(200, 0.2) == pytest.approx(0.0886, abs=1e-4)
    with pytest.raises(ValueError, match="effect <= discordance"):
        required_n(0.3, 0.2)


def test_warns_when_a_suite_is_too_small() -> None:
    # add: 32 of 200 items discordant (0.16): the MDE is 0.079 > min_effect 0.05, which needs
    # (1.96 sqrt(.16) + 0.8416 sqrt(.16 - .0025))^2 / .0025 = 500 items; copy disagrees on 3%: CI narrow enough
    d = decide(POLICY, *GOOD)
    assert d.passed and len(d.warnings) == 1 and d.reasons[-1:] == d.warnings
    assert d.warnings[0] == (
        "warning: suite add with n=200 detects gains >= 0.079 (power 0.8, alpha 0.05, discordance 0.16): "
        "too small for min_effect 0.05, about 500 items needed"
    )
    # a guard of 40 items disagreeing on 4 shows non-inferiority only within (1.96 + 0.84) sqrt(0.1 / 40) = 0.14
    g = decide(POLICY, *sides(copy=(40, 30, 2, 2)))
    assert "guard copy with n=40 shows non-inferiority only within a margin of 0.140" in g.warnings[-1]
    assert "about 314 items needed" in g.warnings[-1]
    sized = POLICY.model_copy(update={"min_effect": 0.10})
    assert decide(sized, *GOOD).warnings == []  # 200 items are enough for 0.10 at discordance 0.16
    # fewer discordant items than min_effect: the effect itself falls short, more items would not help
    assert decide(POLICY, *PLUS_ONE).warnings == []
    assert decide(POLICY, GOOD[0], None).warnings == []  # nothing compared, nothing to warn about


BAD_POLICIES = [
    ("alpha 0", {"alpha": 0.0}, "alpha\n  Input should be greater than 0"),
    ("alpha 1", {"alpha": 1.0}, "alpha\n  Input should be less than 1"),
    ("alpha negative", {"alpha": -0.05}, "alpha\n  Input should be greater than 0"),
    ("negative min_effect", {"min_effect": -0.1}, "min_effect\n  Input should be greater than or equal to 0"),
    ("negative guard margin", {"guard_margin": -0.05}, "guard_margin\n  Input should be greater than 0"),
    ("zero guard margin", {"guard_margin": 0.0}, "guard_margin\n  Input should be greater than 0"),
    ("power 1", {"power": 1.0}, "power\n  Input should be less than 1"),
    ("power below alpha", {"power": 0.04}, "power 0.04 must exceed alpha 0.05"),
    ("own suite as guard", {"guard_suites": ["add"]}, "cannot also be a guard"),
    ("own task as guard task", {"guard_tasks": ["add", "sort"]}, "task 'add' is the policy's own suite"),
    ("unknown guard task", {"guard_tasks": ["guard"]}, r"guard_tasks \['guard'\] are not registered tasks"),
    ("floor above 1", {"floors": {"add": 1.5}}, r"floors must lie in \[0, 1\]"),
    ("old raw margin", {"margin": 0.0}, "`margin` .* is gone: use `min_effect`"),
    ("old significance switch", {"significance": "none"}, "`significance` is gone"),
    ("old guard tolerance", {"guard_tolerance": 0.02}, "use `guard_margin`"),
    ("unknown field", {"min_efect": 0.1}, "min_efect"),
]


@pytest.mark.parametrize(("case", "change", "message"), BAD_POLICIES, ids=[c[0] for c in BAD_POLICIES])
def test_policy_rejects(case: str, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GatePolicy(suite="add", **change)


def test_defaults_are_the_statistical_gate() -> None:
    p = GatePolicy(suite="add")
    assert (p.alpha, p.min_effect, p.guard_margin, p.power, p.compare) == (0.05, 0.05, 0.05, 0.8, True)


def test_suite_score_rejects_mismatched_samples() -> None:
    with pytest.raises(ValidationError, match="3 per-sample results but n=4"):
        SuiteScore(name="add", score=0.5, n=4, correct=[True, False, True])
    with pytest.raises(ValueError, match="twice"):
        decide(POLICY, [*GOOD[0], GOOD[0][0]], GOOD[1])


# ---- renderings --------------------------------------------------------------------------------------------


def test_renderings_say_what_failed_and_by_how_much() -> None:
    cand, base = sides(add=(100, 38, 1, 0), copy=(200, 150, 2, 30))
    d = decide(POLICY, cand, base)
    md = d.markdown()
    assert md.startswith("**Gate: failed**")
    assert "| check | result | effect | 95% CI | p | n | MDE | detail |" in md
    assert "| gain:add | FAIL | +0.010 | [" in md and "0.040 short of min_effect 0.05" in md
    guard = d.check("guard:copy")
    assert guard is not None and guard.stats is not None
    assert (
        f"CI lower bound {guard.stats.ci[0]:+.3f} is" in guard.detail
        and "below -margin -0.050" in guard.detail
    )
    console = Console(record=True, width=250)
    console.print(d.table())
    text = console.export_text()
    assert "gain:add" in text and "FAIL" in text and "95% CI" in text
    tag = json.loads(d.tag_value())
    assert tag["passed"] is False and set(tag["failed"]) == {"gain:add", "guard:copy"}
    assert tag["reasons"] == d.reasons and tag["baseline"] == "champion"
    gain = d.check("gain:add")
    assert gain is not None and gain.stats is not None
    # 1 discordant item in 100: no gain is detectable at that discordance, so no MDE
    assert tag["stats"]["gain:add"] == {
        "effect": 0.01,
        "ci": [round(gain.stats.ci[0], 4), round(gain.stats.ci[1], 4)],
        "p": 1.0,
        "n": 100,
        "mde": None,
    }
    assert ": " not in d.tag_value().split('"reasons"')[0]  # compact separators


@pytest.mark.parametrize("n_suites", [150, 400])
def test_tag_value_fits_an_mlflow_tag(n_suites: int) -> None:
    guards = [f"g{i}" for i in range(n_suites)]
    policy = GatePolicy(suite="s", guard_suites=guards, floors={f"g{i}": 0.9 for i in range(n_suites)})
    scores = [paired(name, 40, 10, 0, 8) for name in ["s", *guards]]
    d = decide(policy, [s[0] for s in scores], [s[1] for s in scores])
    tag = d.tag_value()
    assert len(tag) <= 5000 < len(json.dumps(d.reasons))
    doc = json.loads(tag)
    assert doc["truncated"] is True and doc["passed"] is False and doc["reasons"] == []
    # reasons go first (prose of what stats and failed hold), then trailing stats, then names
    assert list(doc["stats"]) == [c.name for c in d.checks if c.stats is not None][: len(doc["stats"])]
    assert doc["failed"] == [c.name for c in d.failed()][: len(doc["failed"])]
    assert doc["stats"] or n_suites > 150


def test_record_gate_on_a_real_registry(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from mint_core.registry.runs import tag_version

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("add-policy")
    mv = client.create_model_version("add-policy", source=str(tmp_path / "rev"))
    d = decide(POLICY, *GOOD, baseline="base")
    tag_version(client, "add-policy", int(mv.version), GATE_TAG, d.tag_value())
    tag = json.loads(client.get_model_version("add-policy", mv.version).tags[GATE_TAG])
    assert tag["passed"] is True and tag["first_revision"] is True and tag["baseline"] == "base"
    assert tag["reasons"] == d.reasons and tag["failed"] == []
    assert set(tag["stats"]) == {"gain:add", "guard:copy"} and tag["stats"]["gain:add"]["n"] == 200
