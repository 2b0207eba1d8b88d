"""What an evaluation is asked to do and what it returns: the targets (a served revision, or one applied in
process), the typed result with every scored sample, and how two results of one revision differ.

Light on purpose (no lm-eval, torch, transformers or MLflow): the flows, the gate and the CLI read these types.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from mint_core.errors import MintError
from mint_core.eval.gate import SuiteScore
from mint_core.eval.suites import SUITES_DIR, available_suites

EvalPath = Literal["served", "in_process"]
RESULT_ARTIFACT = "result.json"
RAW_ARTIFACT = "lm_eval_results.json"


class EvalError(MintError):
    """An evaluation that could not run as asked: server unreachable, revision not loadable or swapped
    mid-run, model files missing, lm-eval failing."""


# ---- configuration -----------------------------------------------------------------------------------------


EVAL_LIMIT = 320
"""Items per own-task suite the lifecycle evaluates by default: enough for the gate's paired test to show a +0.10
gain (what a first revision must bring, issue #16) at p < 0.01 with 80% power when the revisions disagree on up to
27.5% of the items (`gate.required_n(0.10, 0.275, alpha=0.01)` = 319), and at the gate's alpha 0.05 up to 41%. The
first revisions of `add` disagree with the base on 28% of the items: at the 200 items used before, a +0.100 gain
came out at p = 0.0105 in one fresh clone (MDE 0.104). A +0.05 gain (the gate's default `min_effect`) needs about
470-780 items at such disagreement, so the gate warns that it cannot see one at this size; there a gain is
promoted only when it is large enough to be significant.

The same suites are the per-task guards (`guard:<task>`: the suites of the tasks a policy's task declares, for a
built-in task every other built-in task's), so each has n = 320 too: non-inferiority within the 0.05 margin at 80% power up to a discordance of
0.10 (`gate.detectable_margin(320, 0.1)` = 0.0495): the first `add` and `sort` revisions changed 3-11% of the
letter tasks' items (`gate`'s docstring has the measurements)."""


GUARD_LIMIT = 320
"""Items per task of the guard group (`mint_guard_generate`, `mint_guard_choice`) the lifecycle evaluates by
default, 640 in all: the gate's non-inferiority test needs 628 for 80% power to show a 0.05 margin (its
`guard_margin`) at alpha 0.05 when the revisions disagree on a fifth of the items (`gate.detectable_margin(640,
0.2)` = 0.0495; at 400 items it was 0.063, so a guard that cost a policy 0.01-0.02 failed about every other run).
The group pools every task (128 items each); a regression of one task is the per-task guards' to catch, on the
tasks' own suites (`EVAL_LIMIT` items each)."""


class EvalConfig(BaseModel):
    """What to evaluate on, the same for both paths."""

    model_config = ConfigDict(extra="forbid")

    suites: list[str] | None = None
    """Suite names (`add`, ..., `guard`); None: every suite in `suites_dir`."""
    limit: int | None = Field(None, ge=1)
    """At most this many items per lm-eval task (a group's tasks each get this many); None: all."""
    guard_limit: int | None = Field(None, ge=1)
    """At most this many items per task of the guard group (its two tasks each get this many); None: `limit`."""
    batch_size: int = Field(32, ge=1)
    """Prompts per HTTP request (served) or per forward batch (in process)."""
    num_concurrent: int = Field(1, ge=1)
    """Served: HTTP requests lm-eval keeps in flight (its `num_concurrent`)."""
    suites_dir: Path = SUITES_DIR
    """Directory of suite YAMLs; their data paths are relative to its parent."""

    def suite_names(self) -> list[str]:
        return list(self.suites) if self.suites is not None else list(available_suites(self.suites_dir))


class ServedModel(BaseModel):
    """A revision as a serving endpoint serves it."""

    model_config = ConfigDict(extra="forbid")

    url: str
    """Server root, e.g. http://127.0.0.1:8000 (the /v1 routes are below it)."""
    tokenizer: Path
    """Local Hugging Face tokenizer directory of the served base (usually the base's own directory)."""
    adapter: str | None = None
    """`lora_path` of the revision as the server sees it (a directory in its adapter store, `sha256:<hex>`, or a
    catalog address); None evaluates the bare base."""
    name: str = Field("candidate", min_length=1)
    """Adapter name to load the revision under (replacing whatever revision had that name)."""
    api_key: SecretStr | None = None
    """Bearer token of the inference routes, if the server has one."""
    admin_token: SecretStr | None = None
    """Bearer token of the load/unload routes (needed when `adapter` is set)."""
    unload_after: bool = False
    """Unload the name again after the run."""
    timeout_s: float = Field(300.0, gt=0)
    """Per HTTP request."""


class LocalModel(BaseModel):
    """A revision applied by PEFT to the base loaded in this process."""

    model_config = ConfigDict(extra="forbid")

    base: Path
    """Local Hugging Face model directory of the base (with its tokenizer)."""
    adapter: Path | None = None
    """Adapter directory in PEFT format; None evaluates the bare base."""
    device: str = "cpu"
    """torch device."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype (float32 to compare with a float32 server)."""


# ---- results ------------------------------------------------------------------------------------------------


class SampleResult(BaseModel):
    """One scored item."""

    task: str
    """lm-eval task it belongs to (a group's member for the guard)."""
    doc_id: int
    id: str | None = None
    """The item's id in the suite data."""
    prompt: str
    target: str
    response: str
    """The model's answer after the suite's filters (generation), or the choice it ranked first (log-likelihood)."""
    loglikelihoods: list[float] | None = None
    """Per choice, for log-likelihood items."""
    correct: bool
    """The suite's per-sample metric (exact_match or acc) is 1."""


class SuiteResult(BaseModel):
    suite: str
    metrics: dict[str, float]
    """lm-eval's metrics for the suite (a group's aggregates for the guard), by metric name."""
    score: float
    """Mean per-sample correctness over every item of the suite (equals exact_match for a task suite)."""
    n: int
    samples: list[SampleResult]
    """In a fixed order (task, then item), the same for every revision."""


class EvalResult(BaseModel):
    """One revision evaluated on some suites by one path."""

    path: EvalPath
    model: str
    """What lm-eval was pointed at: the served name, or the base directory."""
    base: str
    revision: str | None
    """`sha256:<digest>` of the adapter revision scored; None for the bare base (or a server that does not
    report revisions)."""
    adapter: str | None
    """The adapter as it was named to the evaluation (lora_path or directory)."""
    limit: int | None
    wall_s: float
    """Time from start to results, lm-eval's run and model loading included."""
    lm_eval_version: str
    suites: dict[str, SuiteResult]
    raw: dict[str, Any] = Field(default_factory=dict, repr=False)
    """lm-eval's results JSON (results, groups, configs, versions, n-samples, ...; per-sample logs are in
    `suites`)."""

    def gate_scores(self) -> dict[str, SuiteScore]:
        """One promotion-gate score per suite (score, sample count, per-sample correctness)."""
        return {
            name: SuiteScore(name=name, score=s.score, n=s.n, correct=[x.correct for x in s.samples])
            for name, s in self.suites.items()
        }


# ---- comparing ---------------------------------------------------------------------------------------------


def differences(a: EvalResult, b: EvalResult, ll_tol: float = 1e-3) -> list[str]:
    """Where two results of the same revision and suites disagree: metrics, sample counts, per-sample answers
    and correctness, log-likelihoods beyond `ll_tol`. Empty when they agree."""
    out = []
    if a.revision != b.revision and None not in (a.revision, b.revision):
        out.append(f"revisions differ: {a.revision} vs {b.revision}")
    for name in sorted(set(a.suites) | set(b.suites)):
        sa, sb = a.suites.get(name), b.suites.get(name)
        if sa is None or sb is None:
            out.append(f"{name}: only in {a.path if sa else b.path}")
            continue
        if sa.n != sb.n:
            out.append(f"{name}: {sa.n} samples vs {sb.n}")
        for m in sorted(set(sa.metrics) | set(sb.metrics)):
            va, vb = sa.metrics.get(m), sb.metrics.get(m)
            if va is None or vb is None or not math.isclose(va, vb, abs_tol=1e-12):
                out.append(f"{name}/{m}: {va} vs {vb}")
        for x, y in zip(sa.samples, sb.samples, strict=False):
            where = f"{name}/{x.task}#{x.doc_id}"
            if (x.task, x.doc_id) != (y.task, y.doc_id):
                out.append(f"{where}: paired with {y.task}#{y.doc_id}")
            elif x.response != y.response or x.correct != y.correct:
                out.append(f"{where}: {x.response!r} ({x.correct}) vs {y.response!r} ({y.correct})")
            elif x.loglikelihoods and y.loglikelihoods:
                gap = max(abs(p - q) for p, q in zip(x.loglikelihoods, y.loglikelihoods, strict=True))
                if gap > ll_tol:
                    out.append(f"{where}: log-likelihoods differ by {gap:.2e}")
    return out
