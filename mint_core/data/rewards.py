"""Rewards: what a task's spec names (`mint_core.data.spec.RewardSpec`), computed for a batch of completions.

Every reward follows TRL's keyword convention: it is called with `prompts`, `completions` and each of the
dataset's other columns as keywords (one list per keyword, one item per completion), and returns one float in
[0, 1] or None (does not apply) per completion. Completions of a chat prompt are passed as TRL passes them,
`[{"role": "assistant", "content": text}]`; of a text prompt, as text. A task's reward is the weighted mean of its
rewards (weights normalised; None counts 0).

The built-ins run in this process. A user's function runs in a process pool (`spawn`: no fork of a process
holding torch threads), one call per task and batch, with the spec's `timeout_s`: never SIGALRM in a thread, so
`math_verify`'s own timeouts work in the workers' main threads. A call that raises, hangs, returns NaN or a value
outside [0, 1], or the wrong number of scores scores those completions 0; each failure is counted, the first
traceback of each reward is logged, and `RewardFailures` is raised once more than `max_failure_share` of a
task's calls have failed (after `MIN_CALLS_FOR_SHARE` calls).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing as mp
import re
import sys
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

from mint_core.data.generators import Example
from mint_core.data.spec import (
    RewardSpec,
    SpecError,
    TaskRegistry,
    TaskSpec,
    prompt_text,
    registry,
    reward_source,
)
from mint_core.errors import MintError

logger = logging.getLogger(__name__)

MIN_CALLS_FOR_SHARE = 20
"""Calls of a task's user rewards before the failure share may stop training (one early failure is no trend)."""

# ---- the built-ins ----------------------------------------------------------------------------------------


def _text(c: Any) -> str:
    """A completion as text: itself, or the content of TRL's `[{"role": "assistant", "content": ...}]`."""
    if isinstance(c, list):
        return "".join(str(m.get("content", "")) for m in c if isinstance(m, dict))
    return str(c)


def _truth(v: Any) -> str:
    return "" if v is None else str(v).strip()


def builtin_exact_match(completions: Sequence[Any], truth: Sequence[Any]) -> list[float | None]:
    return [float(_text(c).strip() == _truth(t)) for c, t in zip(completions, truth, strict=True)]


def builtin_char_overlap(completions: Sequence[Any], truth: Sequence[Any]) -> list[float | None]:
    out: list[float | None] = []
    for c, t in zip(completions, truth, strict=True):
        got, want = _text(c).strip(), _truth(t)
        if not want:
            out.append(float(not got))
            continue
        out.append(sum(a == b for a, b in zip(got, want, strict=False)) / max(len(want), len(got)))
    return out


def builtin_regex(
    completions: Sequence[Any], truth: Sequence[Any] | None, pattern: str, full: bool = False
) -> list[float | None]:
    """With `truth`: the pattern's first group (or whole match), searched in the completion, equals it. Without:
    1 when the completion matches (`full`: matches whole, stripped)."""
    rx = re.compile(pattern)
    out: list[float | None] = []
    for i, c in enumerate(completions):
        text = _text(c)
        m = rx.fullmatch(text.strip()) if full else rx.search(text)
        if truth is None:
            out.append(float(m is not None))
            continue
        got = None if m is None else (m.group(1) if m.groups() else m.group(0))
        out.append(float(got is not None and got.strip() == _truth(truth[i])))
    return out


def builtin_math_verify(completions: Sequence[Any], truth: Sequence[Any]) -> list[float | None]:
    """Numeric or symbolic equivalence (`math-verify`) of the completion's answer with the ground truth; timeouts
    off: the caller runs it in a pool worker or accepts no limit."""
    from math_verify import parse, verify

    out: list[float | None] = []
    for c, t in zip(completions, truth, strict=True):
        gold = parse(_truth(t), parsing_timeout=None)  # type: ignore[arg-type]
        pred = parse(_text(c), parsing_timeout=None)  # type: ignore[arg-type]
        out.append(float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)))  # type: ignore[arg-type]
    return out


# ---- user functions ------------------------------------------------------------------------------------------


def load_function(ref: str, folder: Path) -> Callable[..., Any]:
    """`module:function` or `file.py:function` (relative to `folder`) as a callable; raises SpecError naming the
    reference and what failed."""
    target, _, name = ref.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target) if Path(target).is_absolute() else folder / target
            if not path.is_file():
                raise SpecError(f"reward {ref!r}: no file {path}")
            mod_name = f"mint_reward_{abs(hash(str(path.resolve())))}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise SpecError(f"reward {ref!r}: cannot load {path}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = mod
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(target)
    except SpecError:
        raise
    except Exception as e:  # the user's module may raise anything while importing
        raise SpecError(f"reward {ref!r} does not import: {type(e).__name__}: {e}") from e
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise SpecError(f"reward {ref!r}: {target} has no function {name!r}")
    return fn  # type: ignore[no-any-return]


def check_signature(fn: Callable[..., Any], ref: str, columns: Sequence[str]) -> None:
    """The function takes `prompts` and `completions` (or **kwargs) and needs no argument the data lacks."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise SpecError(f"reward {ref!r}: cannot read its signature: {e}") from e
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    offered = {"prompts", "completions", "completion_ids", *columns}
    positional_only = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)]
    if positional_only:
        raise SpecError(
            f"reward {ref!r}: takes positional-only {positional_only}; TRL's convention passes keywords "
            "(prompts, completions, and each data column)"
        )
    for need in ("prompts", "completions"):
        if need not in params and not var_kw:
            raise SpecError(
                f"reward {ref!r}: must accept the keyword {need!r} (or **kwargs); signature {sig}"
            )
    missing = [
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and n not in offered
    ]
    if missing:
        raise SpecError(
            f"reward {ref!r}: needs {missing}, which the data does not have (columns: {', '.join(columns) or 'none'})"
        )


_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}


def _call_user(ref: str, folder: str, kwargs: dict[str, Any]) -> list[Any]:
    """In a pool worker: call a user's reward (loaded once per worker), return its raw result as a list."""
    key = (ref, folder)
    if key not in _LOADED:
        _LOADED[key] = load_function(ref, Path(folder))
    params = inspect.signature(_LOADED[key]).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    result = _LOADED[key](**kwargs)
    if inspect.isawaitable(result):
        import asyncio

        async def wait() -> Any:
            return await result

        result = asyncio.run(wait())
    return list(result)


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+, in .*$')


def user_traceback(e: BaseException, folder: str | Path, source: str | Path | None = None) -> str:
    """What a user's reward raised, as its author needs it: the frames of their own files (under the task's
    `folder`, or the reward's `source`), each with its line, and the exception. The pool's own frames (mint's,
    multiprocessing's) are left out; the traceback the worker sent (`e.__cause__`) is read when there is one."""
    remote = getattr(e.__cause__, "tb", None)
    text = remote if isinstance(remote, str) else "".join(traceback.format_exception(e))
    roots = [str(Path(folder).resolve())] + ([str(Path(source).resolve())] if source else [])
    lines = text.strip("\n").splitlines()
    kept: list[str] = []
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m and any(m["file"].startswith(r) for r in roots):
            kept.append(line)
            if i + 1 < len(lines) and lines[i + 1].startswith("    ") and not _FRAME.match(lines[i + 1]):
                kept.append(lines[i + 1])
    last = f"{type(e).__name__}: {e}"
    return "\n".join(["Traceback (the reward's own frames):", *kept, last] if kept else [last])


def _call_builtin(r: RewardSpec, spec: TaskSpec, comps: list[Any], cols: dict[str, list[Any]]) -> list[Any]:
    truth = cols.get(r.column) if r.column else None
    if r.builtin in ("exact_match", "math_verify", "char_overlap") and truth is None:
        raise SpecError(
            f"task {spec.name!r}: reward {r.builtin} compares with column {r.column!r}, which the data lacks"
        )
    if r.builtin == "exact_match":
        return builtin_exact_match(comps, truth or [])
    if r.builtin == "char_overlap":
        return builtin_char_overlap(comps, truth or [])
    if r.builtin == "math_verify":
        return builtin_math_verify(comps, truth or [])
    if r.builtin == "regex_match":
        return builtin_regex(comps, truth, r.pattern or "")
    if r.builtin == "well_formed":
        if spec.answer_format is None:
            raise SpecError(f"task {spec.name!r}: reward well_formed needs the spec's `answer_format`")
        return builtin_regex(comps, None, spec.answer_format, full=True)
    raise SpecError(f"unknown built-in reward {r.builtin!r}")


# ---- running a task's rewards -----------------------------------------------------------------------------


class RewardFailures(MintError):
    """A task's rewards failed on more than the allowed share of calls; names the task and the first error."""


@dataclass
class RewardStats:
    """One task's reward calls so far."""

    calls: int = 0
    failures: int = 0
    first_error: dict[str, str] = field(default_factory=dict)
    """Per reward label, the first failure's traceback (or reason)."""


def _kwargs(examples: Sequence[Example], texts: Sequence[str]) -> tuple[list[Any], dict[str, list[Any]]]:
    """TRL's keywords of a batch: completions (as TRL shapes them) and every column, one list per name."""
    comps: list[Any] = [
        [{"role": "assistant", "content": t}] if isinstance(e.prompt, list) else t
        for e, t in zip(examples, texts, strict=True)
    ]
    names: list[str] = ["answer"]
    for e in examples:
        names += [k for k in e.columns if k not in names]
    cols: dict[str, list[Any]] = {"answer": [e.answer for e in examples]}
    for n in names[1:]:
        cols[n] = [e.columns.get(n) for e in examples]
    return comps, cols


def _valid(values: Any, n: int) -> tuple[list[float | None], str | None]:
    """The scores of one call, or why they are unusable (the wrong count, a non-number, NaN, outside [0, 1])."""
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else type(values).__name__
        return [None] * n, f"returned {got} scores for {n} completions"
    out: list[float | None] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            return [None] * n, f"returned a {type(v).__name__}, not a float"
        f = float(v)
        if math.isnan(f) or not 0.0 <= f <= 1.0:
            return [None] * n, f"returned {f!r}, outside [0, 1]"
        out.append(f)
    return out, None


class Rewarder:
    """Scores completions of any registered task with its spec's rewards. `close()` (or `with`) ends the pool."""

    def __init__(
        self,
        tasks: TaskRegistry | None = None,
        max_failure_share: float = 0.1,
        workers: int = 1,
        log_failures: bool = True,
    ) -> None:
        self.tasks = tasks if tasks is not None else registry()
        self.max_failure_share = max_failure_share
        self.workers = workers
        self.log_failures = log_failures
        """Log each reward's first failure (off where the caller raises it itself: one report, not two)."""
        self.stats: dict[str, RewardStats] = {}
        self._pool: Pool | None = None
        self._checked: set[tuple[str, str]] = set()

    def __enter__(self) -> Rewarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:  # a trainer that holds one is checkpointed and pickled
        return {**self.__dict__, "_pool": None}

    def _workers(self) -> Pool:
        if self._pool is None:
            self._pool = mp.get_context("spawn").Pool(self.workers)
            # ended with its owner (a trainer, a server) even if nobody calls close(), not by Pool.__del__ at exit
            weakref.finalize(self, self._pool.terminate)
        return self._pool

    def check(self, spec: TaskSpec, columns: Sequence[str]) -> None:
        """Every user reward of `spec` imports here and has a signature the data can call (before training)."""
        for r in spec.rewards:
            if r.function is not None and (spec.name, r.function) not in self._checked:
                check_signature(load_function(r.function, spec.folder), r.function, columns)
                self._checked.add((spec.name, r.function))

    def score(self, examples: Sequence[Example], texts: Sequence[str]) -> list[float]:
        """The task reward of each completion (examples of several tasks may mix), in order."""
        out = [0.0] * len(examples)
        by_task: dict[str, list[int]] = {}
        for i, e in enumerate(examples):
            by_task.setdefault(e.task, []).append(i)
        for task, idx in by_task.items():
            scores = self.score_task(
                self.tasks.get(task), [examples[i] for i in idx], [texts[i] for i in idx]
            )
            for i, s in zip(idx, scores, strict=True):
                out[i] = s
        return out

    def score_task(self, spec: TaskSpec, examples: Sequence[Example], texts: Sequence[str]) -> list[float]:
        n = len(examples)
        if n == 0:
            return []
        comps, cols = _kwargs(examples, texts)
        total_w = sum(r.weight for r in spec.rewards)
        acc = [0.0] * n
        for r in spec.rewards:
            values = self._one(spec, r, examples, comps, cols)
            for i, v in enumerate(values):
                if v is not None:
                    acc[i] += r.weight / total_w * v
        return acc

    def _one(
        self,
        spec: TaskSpec,
        r: RewardSpec,
        examples: Sequence[Example],
        comps: list[Any],
        cols: dict[str, list[Any]],
    ) -> list[float | None]:
        n = len(comps)
        if r.function is None:
            values, why = _valid(_call_builtin(r, spec, comps, cols), n)
            if why is not None:  # a built-in that misbehaves is mint's bug, not the user's
                raise RuntimeError(f"built-in reward {r.builtin} {why}")
            return values
        self.check(spec, list(cols))
        st = self.stats.setdefault(spec.name, RewardStats())
        prompts = [e.prompt for e in examples]
        kwargs = {"prompts": prompts, "completions": comps, **cols}
        st.calls += 1
        try:
            job = self._workers().apply_async(_call_user, (r.function, str(spec.folder), kwargs))
            values, why = _valid(job.get(timeout=r.timeout_s), n)
        except mp.TimeoutError:
            self.close()  # the worker still runs the hung call: end it, the next call starts a new pool
            values, why = [None] * n, f"timed out after {r.timeout_s:g} s"
        except Exception as e:  # whatever the user's code raised, re-raised here by the pool
            values, why = [None] * n, "raised " + user_traceback(e, spec.folder, reward_source(spec, r))
        if why is not None:
            st.failures += 1
            if r.label not in st.first_error:
                st.first_error[r.label] = why
                if self.log_failures:
                    logger.warning("task %s: reward %s failed (scored 0): %s", spec.name, r.label, why)
            values = [0.0] * n
            self._stop_if_failing(spec.name, st, r.label)
        return values

    def _stop_if_failing(self, task: str, st: RewardStats, label: str) -> None:
        share = st.failures / st.calls
        if st.calls >= MIN_CALLS_FOR_SHARE and share > self.max_failure_share:
            raise RewardFailures(
                f"task {task!r}: its rewards failed on {st.failures} of {st.calls} calls ({share:.0%}, more than "
                f"the allowed {self.max_failure_share:.0%}); first failure of {label}: {st.first_error.get(label, '')}"
            )


class NoRewardSignal(MintError):
    """Every completion the base gave a task's prompts scores the same: GRPO would learn nothing."""


def check_signal(spec: TaskSpec, scores: Sequence[float], texts: Sequence[str]) -> None:
    """Before the first step (the reward's dry run): `NoRewardSignal` when the base's own completions `texts` of the
    task's prompts all got one score `scores`."""
    if len(scores) > 1 and len(set(scores)) == 1:
        raise NoRewardSignal(
            f"task {spec.name!r}: its reward gave all {len(scores)} of the base's completions the same score "
            f"{scores[0]:g}, so GRPO has no signal; check the reward ({', '.join(r.label for r in spec.rewards)}) "
            f"and the data's answer column against what the base writes (first completion: {texts[0][:60]!r})"
        )


# ---- by name: a policy's override of its task's reward ----------------------------------------------------

OVERRIDES = ("exact_match", "char_overlap", "well_formed", "match_and_format")
"""Rewards a policy may name instead of its task's (`PolicySpec.reward`), each on the task's `answer` column and
`answer_format`: `match_and_format` is 0.8 x exact_match + 0.2 x well_formed."""


def override_spec(spec: TaskSpec, name: str) -> TaskSpec:
    """`spec` with its rewards replaced by the override `name`."""
    if name not in OVERRIDES:
        raise SpecError(f"unknown reward {name!r}; choose from {', '.join(OVERRIDES)}")
    if name == "match_and_format":
        rewards = [
            RewardSpec(builtin="exact_match", weight=0.8),
            RewardSpec(builtin="well_formed", weight=0.2),
        ]
    else:
        rewards = [RewardSpec(builtin=name)]  # type: ignore[arg-type]
    return spec.model_copy(update={"rewards": rewards})


def builtin_scores(name: str, examples: Sequence[Example], texts: Sequence[str]) -> list[float]:
    """The override reward `name` of each completion, computed here (no pool: built-ins only)."""
    out = [0.0] * len(examples)
    by_task: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        by_task.setdefault(e.task, []).append(i)
    for task, idx in by_task.items():
        spec = override_spec(registry().get(task), name)
        exs = [examples[i] for i in idx]
        comps, cols = _kwargs(exs, [texts[i] for i in idx])
        total_w = sum(r.weight for r in spec.rewards)
        for r in spec.rewards:
            values, why = _valid(_call_builtin(r, spec, comps, cols), len(exs))
            if why is not None:
                raise RuntimeError(f"built-in reward {r.builtin} {why}")
            for j, v in enumerate(values):
                out[idx[j]] += r.weight / total_w * (v or 0.0)
    return out


RewardFn = Callable[[Example, str], float]


def reward(name: str) -> RewardFn:
    """One completion's override reward `name` (`OVERRIDES`), as a function of (example, completion)."""
    if name not in OVERRIDES:
        raise KeyError(f"unknown reward {name!r}; known: {', '.join(OVERRIDES)}")
    return lambda example, completion: builtin_scores(name, [example], [completion])[0]


GOLD_WARN_BELOW = 0.5
"""`mint task check` warns when the gold answers (the `answer` column scored as completions) average below this:
a right answer should earn most of the reward, so a low score says the answer column or the reward is off (a
format the reward does not parse, a column of another meaning). 0 for every gold answer is an error."""


def check_rewards(spec: TaskSpec, items: int = 32) -> float | None:
    """Before training: a task's rewards import, take TRL's keywords with the data's columns, and can score its
    gold answers (the `answer` column as completions of the first `items` held-out rows) without a failure.
    Returns their mean score (None: the rows have no answers to score); a SpecError names the task and the first
    failure, or says that every gold answer scored 0 (the answer column or the reward is wrong)."""
    with Rewarder(TaskRegistry({spec.name: spec}), log_failures=False) as r:
        heldout = spec.heldout_rows()[:items]
        r.check(spec, sorted({"answer", *(c for e in heldout for c in e.columns)}))
        answered = [e for e in heldout if e.answer.strip()]
        if not answered:  # a task scored by its reward alone: nothing to compare with
            return None
        scores = r.score(answered, [e.answer for e in answered])
        st = r.stats.get(spec.name)
        if st is not None and st.failures:
            first = next(iter(st.first_error.values()))
            raise SpecError(
                f"task {spec.name!r} ({spec.path}): its reward fails on the gold answers: {first}"
            )
    if not any(scores):
        e = answered[0]
        labels = ", ".join(x.label for x in spec.rewards)
        raise SpecError(
            f"task {spec.name!r} ({spec.path}): every gold answer of {len(answered)} held-out rows scores 0 with "
            f"its rewards ({labels}): either the answer column ({spec.column('answer')!r}) or the reward is wrong; "
            f"the first row: prompt {prompt_text(e.prompt)!r}, answer {e.answer!r}, score 0"
        )
    return sum(scores) / len(scores)
