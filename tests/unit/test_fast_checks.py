"""The pandas reading of a suite (`mint_core.data.fast_checks`) never passes what GX fails: on every corrupted
batch and result set of the data-check tests it says "cannot tell" (GX then names the failure), and on clean
ones it passes exactly when GX does."""

from __future__ import annotations

import math
from typing import Any

import great_expectations.expectations as gxe
import pandas as pd
import pytest

from mint_core.data import fast_checks
from mint_core.data.checks import (
    CheckParams,
    EvalBounds,
    RolloutBounds,
    _suite,
    check,
    eval_frame,
    eval_suite,
    rollout_frame,
    rollout_suite,
)
from mint_core.eval.gate import SuiteScore
from tests.unit.test_data_checks import EVAL_CASES, ROLLOUT_CASES, _batch, _row

ROLLOUTS = CheckParams(rollouts=RolloutBounds(group_size=4))
EVALS = CheckParams(eval=EvalBounds(min_samples=10))


def _gx(frame: pd.DataFrame, kind: Any, params: CheckParams) -> bool:
    return check(frame, kind, params, raise_on_failure=False).success  # SUMMARY: GX alone


def _fast(frame: pd.DataFrame, kind: Any, params: CheckParams) -> bool | None:
    return fast_checks.verdict(frame, fast_checks.rules(_suite(kind, params)))


@pytest.mark.parametrize(("case", "batch", "_"), ROLLOUT_CASES, ids=[c[0] for c in ROLLOUT_CASES])
def test_a_corrupt_rollout_batch_is_left_to_gx(case: str, batch: list[Any], _: list[str]) -> None:
    frame = rollout_frame(batch)
    assert not _gx(frame, "rollouts", ROLLOUTS)
    assert _fast(frame, "rollouts", ROLLOUTS) is None, case


@pytest.mark.parametrize(("case", "results", "_"), EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_corrupt_eval_results_are_left_to_gx(case: str, results: Any, _: list[str]) -> None:
    frame = eval_frame(results)
    assert not _gx(frame, "eval", EVALS)
    assert _fast(frame, "eval", EVALS) is None, case


CLEAN: list[tuple[str, pd.DataFrame, Any, CheckParams]] = [
    ("rollouts", rollout_frame(_batch()), "rollouts", ROLLOUTS),
    # an EOS at once: no logprob, logprob_max null (allowed); rewards at both ends of the range
    (
        "rollouts with an empty completion",
        rollout_frame(_batch(_row(2, sampling_logprobs=[], completion_ids=[2], reward=0.0))),
        "rollouts",
        ROLLOUTS,
    ),
    ("rollouts, any equal group size", rollout_frame(_batch()), "rollouts", CheckParams()),
    (
        "eval",
        eval_frame([SuiteScore(name="add", score=0.5, n=20), SuiteScore(name="copy", score=1, n=20)]),
        "eval",
        EVALS,
    ),
]


@pytest.mark.parametrize(("case", "frame", "kind", "params"), CLEAN, ids=[c[0] for c in CLEAN])
def test_clean_data_passes_both_ways(case: str, frame: pd.DataFrame, kind: Any, params: CheckParams) -> None:
    assert _gx(frame, kind, params)
    assert _fast(frame, kind, params) is True
    quick = check(frame, kind, params, quick=True)
    assert quick.success and quick.result_json["meta"]["validated_by"].startswith(
        "mint_core.data.fast_checks"
    )
    assert quick.evaluated == check(frame, kind, params).evaluated


def test_what_it_cannot_read_goes_to_gx() -> None:
    frame = rollout_frame(_batch())
    import great_expectations as gx

    # an expectation type it does not know, a kwarg it does not read (mostly < 1), a missing column
    for exp in (
        gxe.ExpectColumnValuesToMatchRegex(column="policy", regex="^add$"),
        gxe.ExpectColumnValuesToBeBetween(column="reward", min_value=0, max_value=1, mostly=0.5),
        gxe.ExpectColumnValuesToNotBeNull(column="no_such_column"),
    ):
        suite = gx.ExpectationSuite(name="one", expectations=[exp])
        assert fast_checks.verdict(frame, fast_checks.rules(suite)) is None, exp


def test_every_rule_of_the_built_in_suites_is_read() -> None:
    """The suites mint checks on every step are read in full: a clean frame never falls back to GX because
    of a rule the reading does not know."""
    for suite in (rollout_suite(RolloutBounds(group_size=[4, 8])), rollout_suite(), eval_suite()):
        for kind, kw in fast_checks.rules(suite):
            assert kind in fast_checks._READERS, kind
            reads = fast_checks._READERS[kind][1]
            assert all(k in reads or v in fast_checks._NEUTRAL.get(k, ()) for k, v in kw.items()), (kind, kw)


def test_inf_and_nan_read_as_gx_reads_them() -> None:
    """NaN is null to GX (a between-range ignores it, not-null catches it); +-inf is a value out of range."""
    for reward, gx_passes in ((math.inf, False), (-math.inf, False), (0.5, True)):
        frame = rollout_frame(_batch(_row(2, reward=reward)))
        assert _gx(frame, "rollouts", ROLLOUTS) is gx_passes
        assert _fast(frame, "rollouts", ROLLOUTS) is (True if gx_passes else None)
