"""A task is data, not code: one small YAML file names its data, its rewards and the lm-eval task its gate reads.

Layout: one task is one folder with a `task.yaml` in it, beside its data, its reward's `.py` and its eval YAML;
every relative path of the spec resolves against that folder. So a user's task is a folder they own and can copy,
version and track with DVC as one unit (`examples/gsm8k-format/`), the spec stays small (it names files, it does
not hold them), and the task's name is the folder's unless the spec says otherwise. mint's five built-in tasks are
the same kind of folders (`mint_core/data/builtin/<task>/task.yaml`), read by the same code. The registry reads a
list of folders, each either a task folder or a folder of task folders (one level down): the built-ins, then
`MINT_TASK_DIRS` (`:`-separated); a task folder added to one shows up with no code change.

    name: add                      # default: the file's stem
    description: the sum of two numbers below 100
    data:
      train: data/train.jsonl      # JSONL or parquet; local, or an fsspec URL
      heldout: data/heldout.jsonl  # the gate's items; never trained on
      columns: {prompt: question}  # mint's name -> the file's column, where they differ
    rewards:                       # weighted sum, each in [0, 1]
      - builtin: exact_match       # exact_match | math_verify | regex_match | char_overlap
        column: answer             # the ground truth it compares with
        weight: 0.8
      - function: reward.py:score  # or module:function; TRL's keyword convention
        weight: 0.2
    answer_format: '\\d{1,3}'     # a well-formed answer matches this (data checks, the `well_formed` reward)
    generation: {max_new_tokens: 16}
    gate:                          # optional: what else may reject a revision (default: its own suite only)
      guards: [other_task]         # registered tasks it must not forget (non-inferiority on their suites)
      min_effect: 0.05
    recipe: {rank: 16, replay: 0.25}  # optional training hints
    eval:
      task: my_task                # the lm-eval task the gate scores
      include: eval.yaml           # a task YAML (or a folder of them) for lm-eval's include path
      metric: exact_match          # the per-item metric key the gate reads

A row is an `Example`: its `prompt` is plain text or a list of chat messages, its `answer` the `answer` column
(empty where the data has none), and every other column is kept in `columns` for the rewards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeGuard

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mint_core.data.generators import Example, example_of, has_generator, split
from mint_core.errors import MintError

logger = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
"""The five built-in tasks' specs (their data: the DVC `task_data` stage's output under data/tasks)."""
DEMO_FILE = BUILTIN_DIR / "demo.yaml"
"""The built-in demo's choice of policies, for the commands given no task (`demo_policies`)."""
SPEC_FILE = "task.yaml"
TASK_DIRS_ENV = "MINT_TASK_DIRS"
"""More task folders, `:`-separated, read after the built-ins (a name defined twice is an error)."""
BuiltinReward = Literal["exact_match", "math_verify", "regex_match", "char_overlap", "well_formed"]
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state")
"""Keywords TRL's convention gives a reward itself, so no data column may take them."""


class SpecError(MintError):
    """A task spec, its data, its reward or its eval that cannot be used; names the file and the field."""


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: str = Field(min_length=1)
    """Training rows: a JSONL or parquet file, relative to the spec's folder, absolute, or an fsspec URL."""
    heldout: str = Field(min_length=1)
    """Held-out rows, the gate's items: no prompt of train may appear here."""
    columns: dict[str, str] = Field(default_factory=dict)
    """mint's column name -> the file's, where they differ: `{prompt: question, answer: solution}`."""


class RewardSpec(BaseModel):
    """One reward of a task: a built-in, or a user's function."""

    model_config = ConfigDict(extra="forbid")

    builtin: BuiltinReward | None = None
    """exact_match: the completion, stripped, equals the ground truth; math_verify: numeric or symbolic
    equivalence (`math-verify`), the completion's last number or expression against the ground truth;
    regex_match: `pattern`'s first group (or whole match) of the completion equals the ground truth, or, without
    a `column`, 1 when the completion matches the pattern at all (a format reward); char_overlap: the share of
    the ground truth's positions the completion gets right; well_formed: the completion matches the task's
    `answer_format`."""
    function: str | None = None
    """A user's reward: `module:function` (importable) or `path/to/file.py:function` (relative to the spec's
    folder), called as TRL calls one: `fn(prompts=..., completions=..., **columns)` with one list per keyword,
    returning one float in [0, 1] (or None: skip) per completion. Runs in a process pool with `timeout_s`."""
    weight: float = Field(1.0, gt=0)
    """Its share of the task's reward; the weights are normalised to sum to 1."""
    column: str | None = "answer"
    """The ground-truth column a built-in compares with (regex_match without one checks the format only)."""
    pattern: str | None = None
    """regex_match: the extraction pattern (Python `re`, searched)."""
    timeout_s: float = Field(10.0, gt=0, le=600)
    """A user function's time limit per call (one call scores a batch of completions)."""

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSpec:
        if (self.builtin is None) == (self.function is None):
            raise ValueError("a reward names exactly one of `builtin` or `function`")
        if self.builtin == "regex_match":
            if not self.pattern:
                raise ValueError("regex_match needs a `pattern`")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {e}") from e
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"function {self.function!r}: write `module:function` or `file.py:function`")
        return self

    @property
    def label(self) -> str:
        return self.builtin or str(self.function)


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(min_length=1)
    """The lm-eval task (or group) the gate scores candidates on."""
    include: str | None = None
    """A task YAML, or a folder of them, for lm-eval's include path (relative to the spec's folder); None: a
    task lm-eval resolves itself, offline."""
    metric: str = "exact_match"
    """The per-item metric the gate reads (each item's value in [0, 1]; 1 counts as right)."""


class GenerationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(16, ge=1, le=4096)
    """Longest completion in rollouts and in served scoring."""


class GateSpec(BaseModel):
    """How the promotion gate judges this task's policies (`mint_core.eval.gate.GatePolicy.for_task`). A task
    that declares nothing is gated on its own suite alone: a significant gain of at least `min_effect`. Every
    other registered task's suite is still scored and shown beside the decision as information ("sort -0.497
    (not a guard)"), so a reviewer sees what an adapter forgot; only the suites named here can reject it. A
    policy's adapter answers only the requests that name it, so which other tasks it must not forget is the
    task owner's call, not mint's."""

    model_config = ConfigDict(extra="forbid")

    guards: list[str] = Field(default_factory=list)
    """Registered tasks each guarded on its own suite (`guard:<task>`): the candidate must stay non-inferior
    there within `task_guard_margin`. The built-in tasks guard each other."""
    guard_suites: list[str] = Field(default_factory=list)
    """lm-eval suites or groups of the evaluation's suites folder, each guarded as one pool of its items within
    `guard_margin` (the built-in tasks name `guard`, the pooled group of every built-in task)."""
    min_effect: float | None = Field(None, ge=0.0, lt=1.0)
    """Smallest own-suite gain worth a promotion; None: the gate's default (`GatePolicy.min_effect`)."""
    alpha: float | None = Field(None, gt=0.0, lt=1.0)
    """Significance level of every test; None: the gate's default (`GatePolicy.alpha`)."""
    guard_margin: float | None = Field(None, gt=0.0, lt=1.0)
    """Non-inferiority margin of `guard_suites`; None: the gate's default (`GatePolicy.guard_margin`)."""
    task_guard_margin: float | None = Field(None, gt=0.0, lt=1.0)
    """Non-inferiority margin of `guards`; None: the gate's default (`GatePolicy.task_guard_margin`)."""


class RecipeSpec(BaseModel):
    """What training this task needs beyond the run's recipe (`mint_core.rl.builder.recipe_spec`): hints that
    belong to the task, measured on it, so they travel with its folder. Unset fields take the recipe's
    defaults; a dashboard form or `mint run --rank` still overrides them."""

    model_config = ConfigDict(extra="forbid")

    rank: int | None = Field(None, ge=1, le=512)
    """LoRA rank of the task's policies (alpha = 2 x rank; the rate scales by sqrt(8 / rank)); None: the
    recipe's `DEFAULT_RANK`."""
    group_size: int | None = Field(None, ge=2, le=64)
    """Completions sampled per prompt (the GRPO group); None: the run's. More samples give a task whose base
    rarely samples a right answer a signal in more groups."""
    replay: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of each step's prompts drawn from the tasks the gate guards (`gate.guards`), scored by their own
    rewards, so the adapter keeps answering what it must not forget. 0: its own prompts only."""


class TaskSpec(BaseModel):
    """One task: what a policy learns and how its revisions are judged."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    description: str = ""
    data: DataSpec
    rewards: list[RewardSpec] = Field(min_length=1)
    eval: EvalSpec
    answer_format: str | None = None
    """A regex every well-formed answer fully matches (`well_formed` reward; the data checks' answer column)."""
    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    gate: GateSpec = Field(default_factory=GateSpec)
    """What judges its revisions besides its own suite (default: nothing else)."""
    recipe: RecipeSpec = Field(default_factory=RecipeSpec)
    """Its training hints (rank, group size, replay)."""
    path: Path = Field(Path("."), exclude=True)
    """The spec file (set by `load_spec`; paths resolve against its folder)."""

    @field_validator("answer_format")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"{v!r} is not a regular expression: {e}") from e
        return v

    @model_validator(mode="after")
    def _own_name_is_no_guard(self) -> TaskSpec:
        if self.name in self.gate.guards:
            raise ValueError(f"gate.guards names the task itself ({self.name!r}): its own suite is its gain")
        if self.recipe.replay > 0 and not self.gate.guards:
            raise ValueError("recipe.replay draws from the tasks gate.guards names, and it names none")
        return self

    @property
    def folder(self) -> Path:
        return self.path.parent

    def resolve(self, ref: str) -> str:
        """A path of the spec as a place to read: URLs and absolute paths as they are, others against the
        spec's folder."""
        if "://" in ref or Path(ref).is_absolute():
            return ref
        return str((self.folder / ref).resolve())

    def column(self, name: str) -> str:
        """The file's column that holds mint's `name` column."""
        return self.data.columns.get(name, name)

    def digest(self) -> str:
        """sha256 of the spec file's bytes (`mint.task_spec` on MLflow runs and versions)."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest() if self.path.is_file() else ""

    def reward_digest(self) -> str:
        """sha256 over the source of every user reward (the files, or the modules' files), and the built-ins'
        names: what a revision was rewarded by (`mint.reward`)."""
        h = hashlib.sha256()
        for r in self.rewards:
            h.update(json.dumps(r.model_dump(mode="json"), sort_keys=True).encode())
            src = reward_source(self, r)
            if src is not None:
                h.update(src.read_bytes())
        return h.hexdigest()

    def train_rows(self) -> list[Example]:
        return read_rows(self, "train")

    def heldout_rows(self) -> list[Example]:
        return read_rows(self, "heldout")


def reward_source(spec: TaskSpec, r: RewardSpec) -> Path | None:
    """The file a user reward's code is in (None for a built-in, or a module that cannot be found)."""
    if r.function is None:
        return None
    target, _, _ = r.function.rpartition(":")
    if target.endswith(".py"):
        p = Path(spec.resolve(target))
        return p if p.is_file() else None
    import importlib.util

    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


# ---- loading specs ------------------------------------------------------------------------------------------


def load_spec(path: str | Path) -> TaskSpec:
    """One spec file, validated; a SpecError names the file and every field that is wrong."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as e:
        raise SpecError(f"task spec {p}: cannot read: {e}") from e
    except yaml.YAMLError as e:
        raise SpecError(f"task spec {p}: not YAML: {e}") from e
    if not isinstance(doc, dict):
        raise SpecError(f"task spec {p}: expected a mapping of fields, got {type(doc).__name__}")
    doc.setdefault("name", p.parent.name if p.name == SPEC_FILE else p.stem)
    try:
        return TaskSpec(**doc, path=p.resolve())
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise SpecError(f"task spec {p}: {problems}") from e


@functools.cache
def demo_policies() -> list[str]:
    """The built-in tasks the demo trains when a command names none (`DEMO_FILE`)."""
    doc = yaml.safe_load(DEMO_FILE.read_text()) or {}
    return [str(p) for p in doc.get("policies", [])]


def task_dirs(extra: Sequence[str | Path] = ()) -> list[Path]:
    """The task folders of this process: the built-ins, $MINT_TASK_DIRS, then `extra`."""
    env = [d for d in os.environ.get(TASK_DIRS_ENV, "").split(":") if d]
    out: list[Path] = []
    for d in [BUILTIN_DIR, *env, *extra]:
        p = Path(d).resolve()
        if p not in out:
            out.append(p)
    return out


@dataclass
class TaskRegistry:
    """Every task spec in some folders, by name."""

    specs: dict[str, TaskSpec]
    dirs: tuple[Path, ...] = ()
    """The task folders the specs were read from."""
    _index: dict[str, Example] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, dirs: Iterable[str | Path] | None = None) -> TaskRegistry:
        """The specs in `dirs` (default: `task_dirs()`): each folder's own `task.yaml`, or those of its
        subfolders; a folder that does not exist, or holds no spec, is an error, and so is a name two specs
        define."""
        specs: dict[str, TaskSpec] = {}
        folders = task_dirs() if dirs is None else [Path(x) for x in dirs]
        for d in folders:
            if not Path(d).is_dir():
                raise SpecError(f"task folder {d} does not exist")
            own = Path(d) / SPEC_FILE
            files = [own] if own.is_file() else sorted(Path(d).glob(f"*/{SPEC_FILE}"))
            if not files:
                raise SpecError(f"task folder {d} holds no {SPEC_FILE}, nor any subfolder with one")
            for f in files:
                spec = load_spec(f)
                if spec.name in specs:
                    raise SpecError(f"task {spec.name!r} is defined twice: {specs[spec.name].path} and {f}")
                specs[spec.name] = spec
        for spec in specs.values():
            unknown = [g for g in spec.gate.guards if g not in specs]
            if unknown:
                raise SpecError(
                    f"task spec {spec.path}: gate.guards names {', '.join(map(repr, unknown))}, not registered "
                    f"tasks ({', '.join(specs)})"
                )
        return cls(specs, tuple(folders))

    def names(self) -> list[str]:
        return list(self.specs)

    def get(self, name: str) -> TaskSpec:
        if name not in self.specs:
            raise SpecError(f"unknown task {name!r}; registered: {', '.join(self.specs) or 'none'}")
        return self.specs[name]

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    @property
    def indexed(self) -> bool:
        """Whether `lookup` has its index (and so answers without reading any file)."""
        return self._index is not None

    def lookup(self, prompt: str | list[dict[str, str]]) -> Example | None:
        """The row of a registered task whose prompt this is (held-out rows first, then train), or None: what
        lets a server score its answers to a task's prompts with the task's own rewards. Rows of a task whose
        files are missing or unreadable are left out (logged once)."""
        with self._lock:  # built once, by the first caller; the others wait for it
            if self._index is None:
                self._index = self._build_index()
        found = self._index.get(prompt_text(prompt))
        if found is None and isinstance(prompt, str):  # a generated task's prompt outside its files
            found = example_of(prompt)
        return found if found is None or found.task in self.specs else None

    def __getstate__(
        self,
    ) -> dict[str, Any]:  # a lock does not pickle; the index is rebuilt where it is needed
        return {"specs": self.specs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.specs, self._index, self._lock = state["specs"], None, threading.Lock()

    def _build_index(self) -> dict[str, Example]:
        index: dict[str, Example] = {}
        for spec in self.specs.values():
            for which in ("train", "heldout"):  # held-out last, so it wins a prompt in both
                try:
                    rows = read_rows(spec, which)  # type: ignore[arg-type]
                except SpecError as e:
                    logger.info("task %s: its %s rows are not indexed: %s", spec.name, which, e)
                    continue
                index.update((prompt_text(r.prompt), r) for r in rows)
        return index


_REGISTRY: dict[tuple[str, ...], TaskRegistry] = {}


def registry(extra: Sequence[str | Path] = ()) -> TaskRegistry:
    """The process's task registry (the built-ins, $MINT_TASK_DIRS and `extra`), read once per set of folders;
    a spec file's change is seen after `reload_registry()` (or in a new process)."""
    key = tuple(str(d) for d in task_dirs(extra))
    if key not in _REGISTRY:
        _REGISTRY[key] = TaskRegistry.load([Path(k) for k in key])
    return _REGISTRY[key]


def reload_registry() -> None:
    _REGISTRY.clear()


TASKS_CONTEXT = "tasks"
"""The key under which a caller passes the task registry to validate against in pydantic's validation context
(`Model.model_validate(doc, context={TASKS_CONTEXT: registry})`): the forms that name tasks (a gate's suite and
guards, a policy's task) read it there (`registry_in`)."""


def registry_in(context: Any) -> TaskRegistry:
    """The task registry a validation was given (its context's `TASKS_CONTEXT`), else the process's (`registry()`:
    what a form validated without one, e.g. a flow's parameters in a Prefect worker, is checked against)."""
    given = context.get(TASKS_CONTEXT) if isinstance(context, dict) else None
    return given if isinstance(given, TaskRegistry) else registry()


# ---- reading rows -------------------------------------------------------------------------------------------


def _read_table(ref: str) -> list[dict[str, Any]]:
    import fsspec

    suffix = ref.rsplit("?", 1)[0].lower()
    if suffix.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fsspec.open(ref, "rb") as f:
            return list(pq.read_table(f).to_pylist())
    if suffix.endswith((".jsonl", ".json")):
        rows: list[dict[str, Any]] = []
        with fsspec.open(ref, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"line {i} is not JSON: {e}") from e
                if not isinstance(row, dict):
                    raise ValueError(f"line {i} is not a JSON object")
                rows.append(row)
        return rows
    raise ValueError("not a .jsonl or .parquet file")


def is_messages(prompt: Any) -> TypeGuard[list[dict[str, str]]]:
    """Chat messages: a non-empty list of {role, content} mappings with string values."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    )


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    """The text of a prompt that identifies it: itself, or a conversation's messages joined (for the checks
    that no held-out prompt is in train, and for looking up served prompts)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def check_columns(spec: TaskSpec) -> None:
    """Every column the spec's `data.columns` map names is in both data files: a map naming a column a file lacks
    would read an empty answer (or lose a reward's keyword) for every row, and every later check would pass on
    it. A SpecError names the mapped column, the file and the columns it has."""
    if not spec.data.columns:
        return
    for which in ("train", "heldout"):
        ref = spec.resolve(getattr(spec.data, which))
        try:
            rows = _read_table(ref)
        except FileNotFoundError:
            continue  # read_rows names a missing file
        except (OSError, ValueError) as e:
            raise SpecError(f"task {spec.name!r} ({spec.path}), data.{which} {ref}: cannot read: {e}") from e
        have = list(dict.fromkeys(k for row in rows[:1000] for k in row))
        for ours, theirs in spec.data.columns.items():
            if theirs not in have:
                raise SpecError(
                    f"task {spec.name!r} ({spec.path}): data.columns maps {ours!r} to column {theirs!r}, which "
                    f"data.{which} {ref} does not have (its columns: {', '.join(have) or 'none'})"
                )


def read_rows(spec: TaskSpec, which: Literal["train", "heldout"]) -> list[Example]:
    """One split of a task as Examples; a SpecError names the file, the row and the column that is wrong."""
    ref = spec.resolve(getattr(spec.data, which))
    where = f"task {spec.name!r} ({spec.path}), data.{which} {ref}"
    try:
        raw = _read_table(ref)
    except FileNotFoundError as e:
        if has_generator(spec.name):  # a checkout without the DVC outputs: the rows `mint data build` writes
            return list(_generated(spec.name)[0 if which == "train" else 1])
        raise SpecError(f"{where}: no such file") from e
    except (OSError, ValueError) as e:
        raise SpecError(f"{where}: cannot read: {e}") from e
    if not raw:
        raise SpecError(f"{where}: no rows")
    pcol, acol, icol = spec.column("prompt"), spec.column("answer"), spec.column("id")
    rename = {v: k for k, v in spec.data.columns.items()}
    out = []
    for i, row in enumerate(raw, 1):
        if pcol not in row:
            raise SpecError(f"{where}: row {i} has no prompt column {pcol!r} (columns: {', '.join(row)})")
        prompt = row[pcol]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise SpecError(f"{where}: row {i} has an empty prompt")
        elif not is_messages(prompt):
            raise SpecError(
                f"{where}: row {i}: {pcol!r} must be text or a list of {{role, content}} messages, "
                f"got {type(prompt).__name__}"
            )
        elif not any(m["content"].strip() for m in prompt):
            raise SpecError(f"{where}: row {i} has an empty prompt (every message is empty)")
        columns = {rename.get(k, k): v for k, v in row.items() if k not in (pcol, acol, icol)}
        bad = [c for c in columns if c in RESERVED_COLUMNS]
        if bad:
            raise SpecError(
                f"{where}: column {bad[0]!r} is a name the reward keywords reserve; map it elsewhere"
            )
        answer = row.get(acol)
        out.append(
            Example(
                id=str(row.get(icol, f"{spec.name}-{which}-{i - 1}")),
                task=spec.name,
                prompt=prompt,
                answer="" if answer is None else str(answer),
                columns=columns,
            )
        )
    return out


@functools.cache
def _generated(task: str) -> tuple[list[Example], list[Example]]:
    """A generated task's train and held-out rows as the DVC `task_data` stage writes them (params.yaml's
    `data` section beside the repository's dvc.yaml, else its defaults)."""
    from mint_core.data.build import DataParams

    params = BUILTIN_DIR.parents[2] / "params.yaml"
    doc = (yaml.safe_load(params.read_text()) or {}).get("data", {}) if params.is_file() else {}
    p = DataParams(**doc)
    return split(task, p.n_train, p.n_heldout, p.seed)
