"""Great Expectations suites for the three kinds of data mint moves: prompt datasets, rollout batches and
evaluation results.

Each kind has a flat table form (a pandas DataFrame: one row per example, per completion, per suite), typed
bounds (the `checks:` section of params.yaml), and a suite built from those bounds. `check(frame, kind)`
validates a frame on an ephemeral GX context and raises `DataCheckError` naming every failing expectation, its
column and what was observed; the full validation result travels with the error (and the returned report) as
JSON, for a run to store.

Great Expectations takes seconds to import, so it is imported on first use: the frame builders and bounds
below cost nothing to import.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import great_expectations as gx
import great_expectations.expectations as gxe
import pandas as pd
from great_expectations import ExpectationSuite
from great_expectations.core.batch_definition import BatchDefinition
from great_expectations.data_context.types.base import (
    DataContextConfig,
    InMemoryStoreBackendDefaults,
    ProgressBarsConfig,
)
from great_expectations.expectations.row_conditions import Column
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mint_core.data import fast_checks
from mint_core.data.generators import GENERATORS, Example
from mint_core.data.spec import TaskSpec, check_columns, prompt_text
from mint_core.errors import DataCheckError

if TYPE_CHECKING:
    from mint_core.rl.rollout import RolloutRow

Kind = Literal["prompts", "rollouts", "eval"]
KINDS: tuple[Kind, ...] = ("prompts", "rollouts", "eval")

PROMPT_COLUMNS = ["id", "task", "prompt", "answer"]
"""One row per example, the fields of `mint_core.data.generators.Example` (`id` is `<task>-<seed>-<index>`)."""
ROLLOUT_COLUMNS = [
    "policy",  # adapter name that sampled the completion
    "group",  # rows sharing a group share a prompt and a policy
    "group_size",  # rows in this row's group
    "example_id",
    "task",
    "prompt_len",  # prompt tokens
    "completion_len",  # completion tokens, including the EOS the rollout appends when the model stopped
    "n_logprobs",  # sampling logprobs recorded (generated tokens, EOS excluded)
    "nonfinite_logprobs",  # how many of them are NaN or infinite
    "logprob_max",  # the largest finite one (None when there are none); a logprob above 0 is corrupt
    "reward",
    "finish_reason",
]
"""One row per completion of a rollout batch (see `rollout_frame`)."""
EVAL_COLUMNS = ["suite", "score", "n"]
"""One row per evaluation suite of one revision."""

_LOGPROB_SLACK = 1e-4  # log-softmax in low precision can land a hair above 0


class PromptBounds(BaseModel):
    """What a prompt dataset (rows of `mint_core.data.generators.Example`) must satisfy."""

    model_config = ConfigDict(extra="forbid")

    min_rows: int = Field(1, ge=0)
    """Fewest rows a dataset may have; an empty file is a broken build."""
    prompt_chars: tuple[int, int] = (5, 32)
    """Inclusive range of prompt lengths in characters (the byte tokenizer makes these tokens too)."""
    answer_chars: tuple[int, int] = (1, 16)
    """Inclusive range of answer lengths in characters (without the leading space and EOS)."""

    @model_validator(mode="after")
    def _ranges(self) -> PromptBounds:
        for name in ("prompt_chars", "answer_chars"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be 0 <= min <= max, got {(lo, hi)}")
        return self


class RolloutBounds(BaseModel):
    """What a rollout batch must satisfy before a GRPO update may read it."""

    model_config = ConfigDict(extra="forbid")

    min_rows: int = Field(1, ge=0)
    """Fewest completions a batch may have."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """Inclusive range every reward must lie in (mint's verifiable rewards are in [0, 1])."""
    group_size: int | list[int] | None = None
    """Completions per prompt (GRPO's G), or the sizes a batch's groups may have (policies of one run may sample
    their prompts a different number of times); None: only check that every group has the same size."""
    max_completion_len: int = Field(17, ge=1)
    """Most completion tokens a row may hold: the rollout's max_new_tokens plus the EOS it appends
    (GRPOConfig's default 16 + 1)."""


class EvalBounds(BaseModel):
    """What a revision's evaluation results must satisfy before the gate reads them."""

    model_config = ConfigDict(extra="forbid")

    min_rows: int = Field(1, ge=0)
    """Fewest suites a result may have."""
    min_samples: int = Field(1, ge=1)
    """Fewest samples behind each suite's score."""


class CheckParams(BaseModel):
    """The `checks:` section of params.yaml: the bounds each kind of data is held to."""

    model_config = ConfigDict(extra="forbid")

    prompts: PromptBounds = Field(default_factory=PromptBounds)
    """Bounds of prompt datasets (the `validate_data` DVC stage)."""
    rollouts: RolloutBounds = Field(default_factory=RolloutBounds)
    """Bounds of rollout batches."""
    eval: EvalBounds = Field(default_factory=EvalBounds)
    """Bounds of evaluation results."""


@dataclass
class CheckReport:
    """The outcome of one validation: a small summary, and the full GX result as JSON."""

    kind: Kind
    source: str  # the path checked, or a name for an in-memory frame
    rows: int
    success: bool
    evaluated: int  # expectations run
    failed: list[str] = field(default_factory=list)  # one line per failing expectation: column, observed
    result_json: dict[str, Any] = field(default_factory=dict)  # GX's ExpectationSuiteValidationResult

    def summary(self) -> dict[str, Any]:
        """What the `validate_data` stage writes: no per-row detail, so it changes only when the data does."""
        return {
            "kind": self.kind,
            "source": self.source,
            "rows": self.rows,
            "success": self.success,
            "expectations": self.evaluated,
            "failed": self.failed,
        }


# ---- flat table forms ----------------------------------------------------------------------------------------


def prompts_frame(rows: Iterable[Example | Mapping[str, Any]]) -> pd.DataFrame:
    """Examples (or their JSON objects) as a frame; the columns are whatever the rows carry, so a wrong schema
    shows up in the check rather than here. No rows: an empty frame with the expected columns."""
    records = [_prompt_record(r) if isinstance(r, Example) else dict(r) for r in rows]
    return pd.DataFrame(records) if records else pd.DataFrame(columns=PROMPT_COLUMNS)


def _prompt_record(e: Example) -> dict[str, Any]:
    """An example's row of the prompts table: a chat prompt as its text (`spec.prompt_text`); the other data
    columns stay out (the rewards read them, the checks of `task_suite` look at them)."""
    return {"id": e.id, "task": e.task, "prompt": prompt_text(e.prompt), "answer": e.answer}


def read_prompts(path: str | Path) -> pd.DataFrame:
    """A JSONL file of examples, or every `*.jsonl` under a directory (train/ and heldout/ together, so ids
    and prompts must be unique across splits)."""
    p = Path(path)
    if not p.exists():
        raise DataCheckError("prompts", str(p), [f"no such file or directory: {p}"])
    files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise DataCheckError("prompts", str(p), [f"no *.jsonl files under {p}"])
    return prompts_frame(row for f in files for row in _jsonl(f, "prompts"))


def rollout_frame(rows: Sequence[RolloutRow]) -> pd.DataFrame:
    """A rollout batch as one row per completion (columns: `ROLLOUT_COLUMNS`)."""
    sizes: dict[int, int] = {}
    for r in rows:
        sizes[r.group] = sizes.get(r.group, 0) + 1
    records = []
    for r in rows:
        lps = [float(x) for x in r.sampling_logprobs]
        finite = [x for x in lps if math.isfinite(x)]
        records.append(
            {
                "policy": r.policy,
                "group": r.group,
                "group_size": sizes[r.group],
                "example_id": r.example.id,
                "task": r.example.task,
                "prompt_len": len(r.prompt_ids),
                "completion_len": len(r.completion_ids),
                "n_logprobs": len(lps),
                "nonfinite_logprobs": len(lps) - len(finite),
                "logprob_max": max(finite) if finite else None,
                "reward": float(r.reward),
                "finish_reason": r.finish_reason,
            }
        )
    return pd.DataFrame(records) if records else pd.DataFrame(columns=ROLLOUT_COLUMNS)


def eval_frame(results: Iterable[Any] | Mapping[str, Any]) -> pd.DataFrame:
    """Evaluation results as one row per suite. Takes a list of results or a mapping suite -> result, each result
    an object with `score`, `n` and `suite` or `name` attributes (the gate's `SuiteScore`, the lm-eval runner's
    suite results) or a mapping with those keys; or a whole run's result with such a mapping under "suites".
    Per-sample detail (`correct`, `samples`, `metrics`) is dropped; any other key stays, to fail the schema."""
    if isinstance(results, Mapping) and isinstance(results.get("suites"), Mapping | list):
        return eval_frame(results["suites"])
    if isinstance(results, Mapping):
        records = [_eval_record(v, suite=k) for k, v in results.items()]
    else:
        records = [_eval_record(r) for r in results]
    return pd.DataFrame(records) if records else pd.DataFrame(columns=EVAL_COLUMNS)


def _eval_record(r: Any, suite: str | None = None) -> dict[str, Any]:
    if not isinstance(r, Mapping):
        name = getattr(r, "suite", None) or getattr(r, "name", None) or suite
        return {"suite": name, "score": getattr(r, "score", None), "n": getattr(r, "n", None)}
    d = {k: v for k, v in r.items() if k not in ("correct", "samples", "metrics")}
    if "suite" not in d:
        d["suite"] = d.pop("name", suite)
    return d


def read_table(path: str | Path, kind: Kind) -> pd.DataFrame:
    """A flat table of one kind from a file: `.jsonl`, `.json` (a list of rows, or suite -> {score, n} for
    eval), `.csv` or `.parquet`; a directory of `*.jsonl` for prompts."""
    p = Path(path)
    if kind == "prompts":
        return read_prompts(p)
    if not p.is_file():
        raise DataCheckError(kind, str(p), [f"no such file: {p}"])
    empty = pd.DataFrame(columns=ROLLOUT_COLUMNS if kind == "rollouts" else EVAL_COLUMNS)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return pd.read_parquet(p)
    if suffix == ".csv":
        return pd.read_csv(p) if p.read_text().strip() else empty
    if suffix == ".json":
        text = p.read_text()
        try:
            doc = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise DataCheckError(kind, str(p), [f"not JSON: {e}"]) from e
        if kind == "eval":
            return eval_frame(doc)
        return pd.DataFrame(doc) if doc else empty
    rows = _jsonl(p, kind)
    if kind == "eval":
        return eval_frame(rows)
    return pd.DataFrame(rows) if rows else empty


def _jsonl(path: Path, kind: str) -> list[dict[str, Any]]:
    rows, bad = [], []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append(f"{path}:{i}: not JSON ({e.msg})")
            continue
        if not isinstance(row, dict):
            bad.append(f"{path}:{i}: not a JSON object")
            continue
        rows.append(row)
    if bad:
        raise DataCheckError(kind, str(path), bad)
    return rows


# ---- suites --------------------------------------------------------------------------------------------------


def prompt_suite(bounds: PromptBounds | None = None) -> ExpectationSuite:
    """Schema, no nulls, string fields, unique ids and prompts (a held-out prompt leaking into train is a
    duplicate), known tasks, lengths in range, and every prompt and answer in its task's format."""

    b = bounds or PromptBounds()
    exps: list[Any] = [
        gxe.ExpectTableColumnsToMatchSet(column_set=PROMPT_COLUMNS, exact_match=True),
        gxe.ExpectTableRowCountToBeBetween(min_value=b.min_rows),
    ]
    for c in PROMPT_COLUMNS:
        exps.append(gxe.ExpectColumnValuesToNotBeNull(column=c))
        exps.append(gxe.ExpectColumnValuesToBeOfType(column=c, type_="str"))
    exps += [
        gxe.ExpectColumnValuesToBeUnique(column="id"),
        gxe.ExpectColumnValuesToBeUnique(column="prompt"),
        gxe.ExpectColumnValuesToBeInSet(column="task", value_set=list(GENERATORS)),
        gxe.ExpectColumnValueLengthsToBeBetween(
            column="prompt", min_value=b.prompt_chars[0], max_value=b.prompt_chars[1]
        ),
        gxe.ExpectColumnValueLengthsToBeBetween(
            column="answer", min_value=b.answer_chars[0], max_value=b.answer_chars[1]
        ),
    ]
    for name, t in GENERATORS.items():
        is_task = Column("task") == name
        # the formats of `tasks.prompt_of` and `tasks.is_well_formed`
        exps.append(
            gxe.ExpectColumnValuesToMatchRegex(
                column="prompt", regex=rf"^{re.escape(name)}: \S+ =$", row_condition=is_task
            )
        )
        exps.append(
            gxe.ExpectColumnValuesToMatchRegex(
                column="answer", regex=rf"^(?:{t.answer_pattern})$", row_condition=is_task
            )
        )
    return gx.ExpectationSuite(name="prompts", expectations=exps)


def task_suite(spec: TaskSpec, min_rows: int = 1) -> ExpectationSuite:
    """One task's expectation suite, from its spec alone, over train and held-out rows together (`split` column):
    the columns are there, no prompt is empty, ids and prompts are unique (so no held-out prompt is also a train
    prompt), every row is the task's, and where the spec has an `answer_format`, every answer matches it."""
    cols = [*PROMPT_COLUMNS, "split"]
    exps: list[Any] = [
        gxe.ExpectTableColumnsToMatchSet(column_set=cols, exact_match=True),
        gxe.ExpectTableRowCountToBeBetween(min_value=min_rows),
        gxe.ExpectColumnValuesToNotBeNull(column="prompt"),
        gxe.ExpectColumnValueLengthsToBeBetween(column="prompt", min_value=1),
        gxe.ExpectColumnValuesToMatchRegex(column="prompt", regex=r"\S"),
        gxe.ExpectColumnValuesToBeUnique(column="id"),
        gxe.ExpectColumnValuesToBeUnique(column="prompt"),
        gxe.ExpectColumnValuesToBeInSet(column="task", value_set=[spec.name]),
        gxe.ExpectColumnValuesToBeInSet(column="split", value_set=["train", "heldout"]),
    ]
    if spec.answer_format is not None:
        exps.append(gxe.ExpectColumnValuesToMatchRegex(column="answer", regex=rf"^(?:{spec.answer_format})$"))
    return gx.ExpectationSuite(name=f"task:{spec.name}", expectations=exps)


def check_task(spec: TaskSpec) -> CheckReport:
    """Run `task_suite` on a task's data files; raises DataCheckError naming the spec, the data and every
    failing expectation (and first a SpecError for a `data.columns` map naming a column a file lacks)."""
    check_columns(spec)
    train, heldout = spec.train_rows(), spec.heldout_rows()
    frame = pd.DataFrame(
        [{**_prompt_record(e), "split": "train"} for e in train]
        + [{**_prompt_record(e), "split": "heldout"} for e in heldout]
    )
    source = f"task {spec.name} ({spec.path})"
    return check(frame, "prompts", source=source, suite=task_suite(spec))


def rollout_suite(bounds: RolloutBounds | None = None) -> ExpectationSuite:
    """Schema, finite rewards in range, equal group sizes, completion lengths within the limit, finite
    logprobs (none above 0, no more of them than completion tokens), and only stop/length finishes."""

    b = bounds or RolloutBounds()
    lo, hi = b.reward_range
    exps: list[Any] = [
        gxe.ExpectTableColumnsToMatchSet(column_set=ROLLOUT_COLUMNS, exact_match=True),
        gxe.ExpectTableRowCountToBeBetween(min_value=b.min_rows),
    ]
    exps += [gxe.ExpectColumnValuesToNotBeNull(column=c) for c in ROLLOUT_COLUMNS if c != "logprob_max"]
    exps += [
        # NaN is null to GX (caught above); +-inf falls outside the range here
        gxe.ExpectColumnValuesToBeBetween(column="reward", min_value=lo, max_value=hi),
        gxe.ExpectColumnValuesToBeBetween(
            column="completion_len", min_value=0, max_value=b.max_completion_len
        ),
        gxe.ExpectColumnValuesToBeBetween(column="prompt_len", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="nonfinite_logprobs", min_value=0, max_value=0),
        gxe.ExpectColumnValuesToBeBetween(column="logprob_max", max_value=_LOGPROB_SLACK),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="completion_len", column_B="n_logprobs", or_equal=True
        ),
        gxe.ExpectColumnValuesToBeInSet(column="finish_reason", value_set=["stop", "length"]),
    ]
    if b.group_size is not None:
        sizes = [b.group_size] if isinstance(b.group_size, int) else list(b.group_size)
        exps.append(gxe.ExpectColumnValuesToBeInSet(column="group_size", value_set=sizes))
    else:
        exps.append(
            gxe.ExpectColumnUniqueValueCountToBeBetween(column="group_size", min_value=1, max_value=1)
        )
    return gx.ExpectationSuite(name="rollouts", expectations=exps)


def eval_suite(bounds: EvalBounds | None = None) -> ExpectationSuite:
    """Schema, one row per suite, scores in [0, 1], enough samples behind each."""

    b = bounds or EvalBounds()
    exps: list[Any] = [
        gxe.ExpectTableColumnsToMatchSet(column_set=EVAL_COLUMNS, exact_match=True),
        gxe.ExpectTableRowCountToBeBetween(min_value=b.min_rows),
        *(gxe.ExpectColumnValuesToNotBeNull(column=c) for c in EVAL_COLUMNS),
        gxe.ExpectColumnValuesToBeUnique(column="suite"),
        gxe.ExpectColumnValuesToBeBetween(column="score", min_value=0.0, max_value=1.0),
        gxe.ExpectColumnValuesToBeBetween(column="n", min_value=b.min_samples),
    ]
    return gx.ExpectationSuite(name="eval", expectations=exps)


# ---- validation ----------------------------------------------------------------------------------------------


@functools.cache
def _context() -> Any:
    """A process-wide ephemeral GX context with one pandas data source; nothing is written to disk."""

    # in-memory stores and no docs site: nothing touches the disk; no progress bars in logs
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        progress_bars=ProgressBarsConfig(globally=False),
    )
    ctx = gx.get_context(project_config=config, mode="ephemeral")
    ctx.data_sources.add_pandas("mint")
    return ctx


@functools.cache
def _batch_definition(kind: Kind) -> BatchDefinition:
    """One whole-dataframe batch definition per kind, built once per process."""
    asset = _context().data_sources.get("mint").add_dataframe_asset(kind)
    return asset.add_batch_definition_whole_dataframe(kind)


def _suite(kind: Kind, params: CheckParams) -> ExpectationSuite:
    if kind == "prompts":
        return prompt_suite(params.prompts)
    if kind == "rollouts":
        return rollout_suite(params.rollouts)
    return eval_suite(params.eval)


def check(
    frame: pd.DataFrame,
    kind: Kind,
    params: CheckParams | None = None,
    source: str = "<frame>",
    raise_on_failure: bool = True,
    quick: bool = False,
    suite: ExpectationSuite | None = None,
) -> CheckReport:
    """Validate a flat table of one kind; raise `DataCheckError` listing every failing expectation (unless
    `raise_on_failure` is False), else return the report.

    `quick` (the rollout check before every GRPO update): validate with GX's BOOLEAN_ONLY results first, which
    skip the counts and unexpected-value samples (65 ms against 135-175 ms for a 256-row rollout batch), and only
    when an expectation fails validate again with SUMMARY results, so a failure names the same values either way.
    Before GX, the suite's own expectations are read with pandas (`fast_checks`: well under a millisecond); when
    they all hold there, GX is not run. A passing quick report's `result_json` holds only each expectation's
    success."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if quick and suite is None:
        fast = _fast_report(frame, kind, params or CheckParams(), source)
        if fast is not None:
            return fast
    suite = suite if suite is not None else _suite(kind, params or CheckParams())
    batch = _batch_definition(kind).get_batch(batch_parameters={"dataframe": frame})
    result = batch.validate(suite, result_format="BOOLEAN_ONLY" if quick else "SUMMARY")
    if quick and not result.success:
        result = batch.validate(suite, result_format="SUMMARY")
    doc = result.to_json_dict()
    failed = [_describe(r) for r in result.results if not r.success]
    report = CheckReport(
        kind=kind,
        source=source,
        rows=len(frame),
        success=bool(result.success),
        evaluated=len(result.results),
        failed=failed,
        result_json=doc,
    )
    if failed and raise_on_failure:
        raise DataCheckError(kind, source, failed, doc)
    return report


@functools.lru_cache(maxsize=64)
def _rules(kind: Kind, params_json: str) -> fast_checks.Rules:
    return fast_checks.rules(_suite(kind, CheckParams.model_validate_json(params_json)))


def _fast_report(frame: pd.DataFrame, kind: Kind, params: CheckParams, source: str) -> CheckReport | None:
    """A passing report when the suite's own expectations, read with pandas (`fast_checks`), all hold; None
    when any does not, or cannot be read so: then GX validates and names what failed."""
    suite_rules = _rules(kind, params.model_dump_json())
    if fast_checks.verdict(frame, suite_rules) is not True:
        return None
    results = [{"success": True, "expectation_config": {"type": t, "kwargs": kw}} for t, kw in suite_rules]
    doc = {
        "success": True,
        "results": results,
        "statistics": {"evaluated_expectations": len(results), "successful_expectations": len(results)},
        "meta": {"validated_by": "mint_core.data.fast_checks (the suite's expectations read with pandas)"},
    }
    return CheckReport(
        kind=kind, source=source, rows=len(frame), success=True, evaluated=len(results), result_json=doc
    )


def check_path(path: str | Path, kind: Kind, params: CheckParams | None = None) -> CheckReport:
    """Read a file (or, for prompts, a directory) of one kind and check it."""
    return check(read_table(path, kind), kind, params, source=str(path))


_SHOWN_KWARGS = ("column_set", "value_set", "min_value", "max_value", "regex", "type_")


def _describe(r: Any) -> str:
    """`expect_x(column=c)` and what was observed: the observed value, or how many rows failed with examples,
    or the error that stopped the expectation (a missing column, say)."""
    cfg = r.expectation_config
    kw = cfg.kwargs
    args = [f"{k}={kw[k]}" for k in ("column", "column_A", "column_B") if k in kw]
    args += [f"{k}={kw[k]!r}" for k in _SHOWN_KWARGS if kw.get(k) is not None]
    where = f" where {_condition(kw['row_condition'])}" if kw.get("row_condition") is not None else ""
    head = f"{cfg.type}({', '.join(args)}){where}"
    res = r.result or {}
    exc = r.exception_info or {}
    if exc.get("raised_exception") is None and exc:  # keyed by metric id when several metrics failed
        exc = next(iter(exc.values()), {})
    if exc.get("raised_exception"):
        return f"{head}: error: {exc.get('exception_message')}"
    if "observed_value" in res:
        return f"{head}: observed {res['observed_value']!r}"
    if "unexpected_count" in res:
        examples = ", ".join(repr(_plain(v)) for v in (res.get("partial_unexpected_list") or [])[:5])
        return f"{head}: {res['unexpected_count']} of {res.get('element_count')} rows unexpected, e.g. {examples}"
    return f"{head}: failed"


def _condition(cond: Any) -> str:
    if isinstance(cond, Mapping) and {"column", "operator", "parameter"} <= set(cond):
        col = cond["column"]
        name = col.get("name") if isinstance(col, Mapping) else col
        return f"{name} {cond['operator']} {cond['parameter']!r}"
    return str(cond)


def _plain(v: Any) -> Any:
    """numpy scalars (and tuples of them) as plain Python values, for readable messages."""
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    return v.item() if hasattr(v, "item") else v
