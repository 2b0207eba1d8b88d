"""A pandas reading of an expectation suite, for the check that runs before every GRPO update.

Great Expectations spends ~65 ms validating a 256-row rollout batch against the rollouts suite, almost all of it
building its metric graph, not computing; a run of a few hundred steps pays it on every step. `verdict(frame,
suite)` evaluates the same suite (the same `ExpectationSuite` object, its expectations and their kwargs: there
is no second list of rules) with vectorised pandas in well under a millisecond, for the expectation types and
kwargs whose meaning it reproduces exactly. It answers only:

- True: every expectation holds, as GX would find (tests/unit/test_fast_checks.py holds the two to the same
  verdict on passing and on corrupted frames, expectation by expectation);
- None: it cannot tell (an expectation type or kwarg it does not read, a missing column, values GX might treat
  otherwise, or one that fails): the caller validates with GX, whose result names what failed.

So a failing batch is always reported by GX itself, and a passing one skips GX's graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

# kwargs each type may carry at these values (GX's defaults) and still be read here; any other value: None
_NEUTRAL: dict[str, Any] = {
    "mostly": (None, 1, 1.0),
    "row_condition": (None, ""),
    "condition_parser": (None, "pandas", "great_expectations"),
    "strict_min": (None, False),
    "strict_max": (None, False),
    "ignore_row_if": (None, "both_values_are_missing", "never"),
    "result_format": (None, "BASIC", "BOOLEAN_ONLY", "SUMMARY", "COMPLETE"),
    "catch_exceptions": (None, True, False),
    "meta": (None,),
    "notes": (None,),
    "description": (None,),
    "id": (None,),
    "rendered_content": (None,),
    "windows": (None,),
    "batch_id": (None,),
}


class _Frame:
    """The frame's columns as numpy arrays, each made once (pandas' per-call overhead is most of the cost on a
    few hundred rows), with their null masks."""

    def __init__(self, frame: pd.DataFrame):
        self.frame = frame
        self.columns = set(frame.columns)
        self.rows = len(frame)
        self._values: dict[str, np.ndarray] = {}
        self._nulls: dict[str, np.ndarray] = {}

    def values(self, column: str) -> np.ndarray:
        if column not in self._values:
            self._values[column] = self.frame[column].to_numpy()
        return self._values[column]

    def nulls(self, column: str) -> np.ndarray:
        if column not in self._nulls:
            self._nulls[column] = pd.isna(self.values(column))
        return self._nulls[column]

    def numeric(self, column: str) -> np.ndarray | None:
        """The column's non-null values as a float or int array; None unless the column is numeric (not bool)."""
        dtype = self.frame[column].dtype
        if not pd.api.types.is_numeric_dtype(dtype) or pd.api.types.is_bool_dtype(dtype):
            return None
        v = self.values(column)
        return v[~self.nulls(column)] if self.nulls(column).any() else v


def _between(f: _Frame, kw: dict[str, Any]) -> bool | None:
    v = f.numeric(kw["column"])
    if v is None:
        return None
    lo, hi = kw.get("min_value"), kw.get("max_value")
    return bool((lo is None or (v >= lo).all()) and (hi is None or (v <= hi).all()))


def _pair_a_gt_b(f: _Frame, kw: dict[str, Any]) -> bool | None:
    a, b = kw["column_A"], kw["column_B"]
    if f.nulls(a).any() or f.nulls(b).any():
        return None  # GX's handling of half-missing pairs is its own
    va, vb = f.numeric(a), f.numeric(b)
    if va is None or vb is None:
        return None
    return bool((va >= vb).all() if kw.get("or_equal") else (va > vb).all())


def _in_set(f: _Frame, kw: dict[str, Any]) -> bool | None:
    values = kw.get("value_set")
    if values is None:
        return None
    column = kw["column"]
    v = f.values(column)[~f.nulls(column)]
    if f.numeric(column) is not None:
        return bool(np.isin(v, [x for x in values if isinstance(x, int | float)]).all())
    if not all(isinstance(x, str) for x in v):
        return None
    allowed = set(values)
    return all(x in allowed for x in v)


def _unique_count(f: _Frame, kw: dict[str, Any]) -> bool | None:
    n = f.frame[kw["column"]].nunique(dropna=True)
    lo, hi = kw.get("min_value"), kw.get("max_value")
    return (lo is None or n >= lo) and (hi is None or n <= hi)


def _unique(f: _Frame, kw: dict[str, Any]) -> bool | None:
    column = kw["column"]
    v = f.values(column)[~f.nulls(column)]
    return len(set(v.tolist())) == len(v)


def _row_count(f: _Frame, kw: dict[str, Any]) -> bool | None:
    lo, hi = kw.get("min_value"), kw.get("max_value")
    return (lo is None or f.rows >= lo) and (hi is None or f.rows <= hi)


def _columns_match(f: _Frame, kw: dict[str, Any]) -> bool | None:
    if not kw.get("exact_match", True):
        return None
    return f.columns == set(kw["column_set"])


def _not_null(f: _Frame, kw: dict[str, Any]) -> bool | None:
    return not f.nulls(kw["column"]).any()


_READERS: dict[str, tuple[Callable[[_Frame, dict[str, Any]], bool | None], tuple[str, ...]]] = {
    # type -> (reader, the kwargs it reads besides the neutral ones)
    "expect_table_columns_to_match_set": (_columns_match, ("column_set", "exact_match")),
    "expect_table_row_count_to_be_between": (_row_count, ("min_value", "max_value")),
    "expect_column_values_to_not_be_null": (_not_null, ("column",)),
    "expect_column_values_to_be_between": (_between, ("column", "min_value", "max_value")),
    "expect_column_pair_values_a_to_be_greater_than_b": (
        _pair_a_gt_b,
        ("column_A", "column_B", "or_equal"),
    ),
    "expect_column_values_to_be_in_set": (_in_set, ("column", "value_set")),
    "expect_column_unique_value_count_to_be_between": (
        _unique_count,
        ("column", "min_value", "max_value"),
    ),
    "expect_column_values_to_be_unique": (_unique, ("column",)),
}


def _one(frame: _Frame, kind: str, kw: dict[str, Any]) -> bool | None:
    entry = _READERS.get(kind)
    if entry is None:
        return None
    reader, reads = entry
    for k, v in kw.items():
        if k not in reads and v not in _NEUTRAL.get(k, (object(),)):
            return None
    for k in ("column", "column_A", "column_B"):
        if k in kw and kw[k] not in frame.columns:
            return None
    return reader(frame, kw)


Rules = list[tuple[str, dict[str, Any]]]


def rules(suite: Any) -> Rules:
    """Each expectation of `suite` (a GX ExpectationSuite) as (type, kwargs): what `verdict` reads. Reading a
    GX expectation's configuration costs ~0.3 ms, so callers keep these per suite."""
    out: Rules = []
    for exp in suite.expectations:
        cfg = exp.configuration
        out.append((cfg.type, dict(cfg.kwargs)))
    return out


def verdict(frame: pd.DataFrame, suite_rules: Rules) -> bool | None:
    """True when every expectation holds on `frame`; None when one does not, or when this reading cannot tell:
    then GX must validate."""
    f = _Frame(frame)
    for kind, kw in suite_rules:
        if _one(f, kind, kw) is not True:
            return None
    return True
