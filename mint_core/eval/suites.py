"""The evaluation suites: lm-eval task YAMLs in `eval_suites/` and the local JSONL data they read.

One suite per built-in task (`mint_<task>`: greedy generation, exact match after stripping whitespace, stop at
EOS, as `mint_core.rl.evaluate.heldout_scores` scores it) plus `guard` (`mint_guard`, a group of two tasks over
every built-in task): `mint_guard_generate`, held-out items of all tasks answered by generation, and
`mint_guard_choice`, the same kind of items scored by log-likelihood between the right answer and a near miss
of the same shape (a sum off by one, the word copied instead of reversed, ...). The guard holds the base
capabilities no policy may lose while it learns its own task.

All items come from the held-out split (`mint data build` writes it; the generators of
`mint_core.data.generators` give the same items from a seed), and the per-task suites and the guard use disjoint
slices of it: a task suite takes the first `limit` held-out items of its task, the guard the next ones.

The YAMLs name their data relative to the directory that holds `eval_suites/` (the repository root), so
`lm_eval --include_path eval_suites --tasks mint_add` works from there; `suite_specs` resolves them to absolute
paths so a run works from anywhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mint_core.data.build import DataParams, read_split
from mint_core.data.generators import GENERATORS, Example, split
from mint_core.data.spec import SpecError, TaskSpec
from mint_core.data.spec import registry as task_registry
from mint_core.errors import MintError

logger = logging.getLogger(__name__)
SUITES_DIR = Path(__file__).resolve().parents[2] / "eval_suites"
"""The suites shipped with mint (YAMLs + data/)."""
TASK_PREFIX = "mint_"
"""lm-eval names of the suites: `mint_<suite>` (lm-eval's registry is global, so the prefix keeps them apart)."""
GUARD = "guard"
GUARD_GENERATE, GUARD_CHOICE = "guard_generate", "guard_choice"


class SuiteError(MintError):
    """A suite that does not exist, or suite files that are missing or malformed."""


def suite_name(lm_eval_task: str) -> str:
    return lm_eval_task.removeprefix(TASK_PREFIX)


# ---- the data ------------------------------------------------------------------------------------------------


def _input_of(ex: Example) -> str:
    """The task input inside the prompt `"<task>: <input> ="`."""
    return str(ex.prompt).removeprefix(f"{ex.task}: ").removesuffix(" =")


def _perturb(s: str) -> str:
    """A different string of the same length: swap the first two adjacent characters that differ, or else
    change the last character to the next one of its kind."""
    for i in range(len(s) - 1):
        if s[i] != s[i + 1]:
            return s[:i] + s[i + 1] + s[i] + s[i + 2 :]
    last = s[-1]
    nxt = {"9": "0", "z": "a", "Z": "A"}.get(last, chr(ord(last) + 1))
    return s[:-1] + nxt


def near_miss(ex: Example) -> str:
    """A wrong answer of the same shape and length as the right one, the kind of mistake a model makes on the
    task (so a base that has the skill prefers the right answer by log-likelihood)."""
    inp, ans = _input_of(ex), ex.answer
    wrong = (
        GENERATORS[ex.task].miss(inp, ans) if ex.task in GENERATORS else ans
    )  # the generator's typical mistake
    if wrong == ans or len(wrong) != len(ans):
        wrong = _perturb(ans)
    return wrong


def _task_row(ex: Example) -> dict[str, Any]:
    return {"id": ex.id, "task": ex.task, "prompt": ex.prompt, "answer": ex.answer}


def _choice_row(ex: Example, rng: random.Random) -> dict[str, Any]:
    choices = [ex.answer, near_miss(ex)]
    gold = rng.randrange(2)
    if gold == 1:
        choices.reverse()
    return {"id": ex.id, "task": ex.task, "prompt": ex.prompt, "choices": choices, "gold": gold}


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class SuiteData:
    """What `build_suite_data` wrote."""

    out_dir: Path
    counts: dict[str, int]
    manifest: dict[str, Any]


def build_suite_data(
    out_dir: str | Path,
    tasks_dir: str | Path | None = None,
    limit: int = 100,
    tasks: Sequence[str] | None = None,
    seed: int = 0,
    n_train: int | None = None,
    n_heldout: int | None = None,
    guard_limit: int | None = None,
) -> SuiteData:
    """Write every suite's JSONL (and a manifest) into `out_dir`, deterministically.

    Held-out items come from `tasks_dir/heldout/<task>.jsonl` (the output of `mint data build`) when given,
    else from the task generators with `seed`, `n_train` and `n_heldout` (defaults: those of `DataParams`,
    i.e. what `mint data build` writes with the default params, so both sources give the same files).
    Each task suite gets `limit` items. The guard's two tasks (generation, choice) get `guard_limit` items each,
    or just over (the same number from every task, interleaved); by default `limit // len(tasks)` per task (at
    least 1), so about as many as a task suite.
    """
    if limit < 1:
        raise SuiteError(f"limit must be at least 1, got {limit}")
    if guard_limit is not None and guard_limit < 1:
        raise SuiteError(f"guard_limit must be at least 1, got {guard_limit}")
    defaults = DataParams()
    unknown = [t for t in tasks or () if t not in GENERATORS]
    specs = task_registry().specs if unknown else {}
    for t in unknown:
        if t in specs:  # a user's task brings its own eval: its YAML and data, which nothing here writes
            spec = specs[t]
            raise SuiteError(
                f"task {t!r} is a registered task ({spec.path}) with its own eval, {spec.eval.task!r} from "
                f"{spec.eval.include}: its data is the task's own, and `mint eval ... --suites {t}` scores it. "
                f"Suite data is built for the built-in tasks only: {', '.join(GENERATORS)}"
            )
    if unknown or (tasks is not None and not tasks):
        raise SuiteError(
            f"unknown tasks {unknown}; built-in: {', '.join(GENERATORS)}; registered: {', '.join(specs) or 'none'}"
        )
    if tasks_dir is not None:
        try:
            heldout = read_split(tasks_dir, "heldout")
        except FileNotFoundError as e:
            raise SuiteError(f"{tasks_dir} is not task data (build it with `mint data build`): {e}") from e
        # by default the tasks the data has (params.yaml may narrow them), in mint's order
        names = list(tasks) if tasks is not None else [t for t in GENERATORS if t in heldout]
        missing = [t for t in names if t not in heldout] or ([] if names else ["any"])
        if missing:
            raise SuiteError(f"{tasks_dir}/heldout has no items for tasks {missing}")
        source: dict[str, Any] = {"tasks_dir": str(tasks_dir)}
    else:
        names = list(tasks) if tasks is not None else list(GENERATORS)
        n_tr = n_train if n_train is not None else defaults.n_train
        n_ho = n_heldout if n_heldout is not None else defaults.n_heldout
        heldout = {t: split(t, n_tr, n_ho, seed)[1] for t in names}
        source = {"generated": {"seed": seed, "n_train": n_tr, "n_heldout": n_ho}}
    per_guard = max(1, limit // len(names)) if guard_limit is None else -(-guard_limit // len(names))
    need = limit + 2 * per_guard
    short = {t: len(heldout[t]) for t in names if len(heldout[t]) < need}
    if short:
        raise SuiteError(
            f"limit {limit}{'' if guard_limit is None else f' with guard limit {guard_limit}'} needs {need} held-out "
            f"items per task ({limit} for the task suite, "
            f"{2 * per_guard} for the guard); too few for {short}: lower --limit or --guard-limit, or build more "
            "held-out items"
        )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"mint-guard-choice:{seed}")
    rows: dict[str, list[dict[str, Any]]] = {t: [_task_row(e) for e in heldout[t][:limit]] for t in names}
    # the guard interleaves the tasks, so that its first k items (lm-eval's --limit) still cover all of them
    rows[GUARD_GENERATE] = [_task_row(heldout[t][limit + i]) for i in range(per_guard) for t in names]
    rows[GUARD_CHOICE] = [
        _choice_row(heldout[t][limit + per_guard + i], rng) for i in range(per_guard) for t in names
    ]
    digests = {name: _write_jsonl(out / f"{name}.jsonl", r) for name, r in rows.items()}
    for stale in set(GENERATORS) - set(rows):  # a task left out this time must not keep an older file
        (out / f"{stale}.jsonl").unlink(missing_ok=True)
    counts = {name: len(r) for name, r in rows.items()}
    manifest: dict[str, Any] = {
        "source": source,
        "tasks": names,
        "limit": limit,
        "guard_limit": guard_limit,
        "guard_per_task": per_guard,
        "counts": counts,
        "sha256": digests,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return SuiteData(out, counts, manifest)


def standalone_suites(
    root: str | Path, limit: int = 100, tasks_dir: str | Path | None = None, seed: int = 0
) -> Path:
    """A copy of mint's suite YAMLs at `root/eval_suites` with freshly built data under it (for tests, or a
    worker without the DVC pipeline's outputs); returns the suites directory."""
    d = Path(root) / SUITES_DIR.name
    d.mkdir(parents=True, exist_ok=True)
    for f in SUITES_DIR.iterdir():
        if f.is_file() and (f.suffix == ".yaml" or f.name.endswith("_yaml")):
            shutil.copyfile(f, d / f.name)
    build_suite_data(d / "data", tasks_dir=tasks_dir, limit=limit, seed=seed)
    return d


# ---- the YAMLs --------------------------------------------------------------------------------------------


def _yaml_files(suites_dir: Path) -> list[Path]:
    return sorted(p for p in suites_dir.glob("*.yaml") if p.is_file())


def _load(path: Path) -> dict[str, Any]:
    # lm-eval's own loader (it follows `include:`); deferred: importing lm_eval.tasks takes 1.4 s, and the CLI
    # reads this module's suite names for its help
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path, resolve_func=False)
    except (OSError, yaml.YAMLError, ValueError) as e:
        raise SuiteError(f"{path}: cannot read suite YAML: {e}") from e
    return cfg


def available_suites(suites_dir: str | Path = SUITES_DIR) -> dict[str, Path]:
    """Suite name -> its YAML (task or group), for every `mint_*` task or group defined at the top level of
    `suites_dir` that is not itself part of a group."""
    d = Path(suites_dir)
    if not d.is_dir():
        raise SuiteError(f"suites directory {d} does not exist")
    found: dict[str, Path] = {}
    members: set[str] = set()
    for path in _yaml_files(d):
        cfg = _load(path)
        name = cfg.get("group") or cfg.get("task")
        if isinstance(name, str) and name.startswith(TASK_PREFIX):
            found[suite_name(name)] = path
        if "group" in cfg:
            members.update(suite_name(m) for m in cfg.get("task") or [] if isinstance(m, str))
    return {k: v for k, v in sorted(found.items()) if k not in members}


def _absolute_data(cfg: dict[str, Any], root: Path, path: Path, hint: str | None = None) -> dict[str, Any]:
    """`cfg` with its `data_files` absolute against `root` (then against the folder above it, where mint's own
    suites name theirs from)."""
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if not isinstance(files, dict) or not files:
        raise SuiteError(f"{path}: dataset_kwargs.data_files must map split names to local JSONL files")
    resolved = {}
    for split_name, f in files.items():
        tried = [Path(f)] if Path(f).is_absolute() else [root / f, root.parent / f]
        p = next((t for t in tried if t.is_file()), tried[0])
        if not p.is_file():
            raise SuiteError(
                f"{path}: data file {f} not found (looked at {', '.join(str(t) for t in tried)}); "
                + (hint or "build it with `mint eval build-suites --out eval_suites/data`")
            )
        resolved[split_name] = str(p)
    return {**cfg, "dataset_kwargs": {**kwargs, "data_files": resolved}}


def suite_tasks(
    suites: Sequence[str], suites_dir: str | Path = SUITES_DIR
) -> dict[str, list[dict[str, Any]]]:
    """Suite name -> the lm-eval task configs it runs (one for a task suite, the members of a group), as dicts
    for `TaskManager.load` with their data paths made absolute. Unknown suite names raise a SuiteError listing
    the known ones.

    A group's members are loaded as plain tasks: lm-eval 0.4.13 passes the keys of a group given as a dict on
    to its members, so a group is only usable by name (and then its data paths resolve against the working
    directory); the runner aggregates the members itself, as the group's `aggregate_metric_list` does."""
    d = Path(suites_dir).resolve()
    known = available_suites(d)
    specs = task_registry().specs
    unknown = [s for s in suites if s not in known and s not in specs]
    if unknown or not suites:
        raise SuiteError(
            f"unknown suites {unknown}; known in {d}: {', '.join(known)}; registered tasks: {', '.join(specs)}"
        )
    tasks_by_name = {}
    for path in _yaml_files(d):
        cfg = _load(path)
        if "task" in cfg and "group" not in cfg:
            tasks_by_name[cfg["task"]] = (cfg, path)
    root = d.parent
    out: dict[str, list[dict[str, Any]]] = {}
    for s in suites:
        if s not in known:
            out[s] = [spec_task_config(specs[s])]
            continue
        cfg = _load(known[s])
        if "group" not in cfg:
            out[s] = [_absolute_data(cfg, root, known[s])]
            continue
        members = []
        for m in cfg.get("task") or []:
            if not isinstance(m, str) or m not in tasks_by_name:
                raise SuiteError(f"{known[s]}: group member {m!r} is not a task defined in {d}")
            mcfg, mpath = tasks_by_name[m]
            members.append(_absolute_data(mcfg, root, mpath))
        if not members:
            raise SuiteError(f"{known[s]}: group {cfg['group']!r} has no tasks")
        out[s] = members
    return out


def scorable(suites: Sequence[str], suites_dir: str | Path = SUITES_DIR) -> list[str]:
    """Those of `suites` that can be scored here (`suite_tasks` resolves them and their data is there), in order:
    what the gate only reports is left out where a workspace has no data for it, instead of failing the run."""
    out = []
    for s in suites:
        try:
            suite_tasks([s], suites_dir)
        except SuiteError as e:
            logger.info("suite %s is not scored here: %s", s, e)
            continue
        out.append(s)
    return out


def spec_task_config(spec: TaskSpec) -> dict[str, Any]:
    """The lm-eval task config a task spec's `eval` names: the task of that name in its `include` YAML (or in
    a YAML of its `include` folder), with its local `data_files` made absolute against the YAML's folder."""
    if spec.eval.include is None:
        raise SuiteError(
            f"task {spec.name!r} ({spec.path}): eval.include is not set; mint scores a task's suite from a local "
            "task YAML (lm-eval's hub tasks need a download, which this setup cannot make)"
        )
    inc = Path(spec.resolve(spec.eval.include))
    files = [inc] if inc.is_file() else _yaml_files(inc) if inc.is_dir() else []
    if not files:
        raise SuiteError(
            f"task {spec.name!r} ({spec.path}): eval.include {inc} is no YAML file or folder of them"
        )
    for path in files:
        cfg = _load(path)
        if cfg.get("task") == spec.eval.task and "group" not in cfg:
            return _absolute_data(cfg, path.parent, path, hint=f"task {spec.name!r} ({spec.path})")
    raise SuiteError(
        f"task {spec.name!r} ({spec.path}): eval.task {spec.eval.task!r} is not defined in {inc}"
    )


def spec_metrics() -> dict[str, str]:
    """lm-eval task name -> the per-item metric its spec names (what the gate reads of each item)."""
    return {s.eval.task: s.eval.metric for s in task_registry().specs.values()}


def check_eval(spec: TaskSpec) -> int:
    """A task's eval as lm-eval builds it from its local data, before anything trains: its YAML is found and
    read, lm-eval accepts the config, and its documents load. Returns the number of items; a SuiteError names the
    spec, the YAML and lm-eval's complaint."""
    cfg = spec_task_config(spec)
    from lm_eval.tasks import TaskManager  # deferred: 1.4 s to import

    try:
        loaded = TaskManager(include_defaults=False).load([cfg])
        task = loaded["tasks"][spec.eval.task]
        n = len(task.eval_docs)
    except Exception as e:  # lm-eval raises whatever its config classes and datasets raise
        raise SuiteError(
            f"task {spec.name!r} ({spec.path}): lm-eval rejects eval {spec.eval.task!r} from {spec.eval.include}: "
            f"{type(e).__name__}: {e}"
        ) from e
    metrics = {m.get("metric") for m in cfg.get("metric_list") or [] if isinstance(m, dict)}
    if metrics and spec.eval.metric not in metrics:
        raise SuiteError(
            f"task {spec.name!r} ({spec.path}): eval.metric {spec.eval.metric!r} is not one of the eval's "
            f"metric_list ({', '.join(sorted(str(m) for m in metrics))})"
        )
    if cfg.get("output_type", "generate_until") == "generate_until":
        _check_rendering(spec, task)
    return n


RENDERED_ITEMS = 3
"""Items of a task's eval that `check_eval` renders and compares with the spec's held-out rows."""


def _asked(prompt: str | list[dict[str, str]]) -> str:
    """What an eval item of this prompt must render: the text, or a conversation's last user turn (the runner
    asks chat tasks through the base's chat template with lm-eval's text as that turn)."""
    if isinstance(prompt, str):
        return prompt.strip()
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return (users[-1] if users else prompt[-1]["content"]).strip()


def _same_answer(target: str, answer: str) -> bool:
    """The eval's target is the row's answer, or its end: an eval may score only the final answer of a worked
    solution (gsm8k's `#### 15` against the answer column's whole working)."""
    return target == answer or (bool(target) and answer.endswith(target))


def _check_rendering(spec: TaskSpec, task: Any) -> None:
    """The eval's first items, rendered by lm-eval itself, are the spec's held-out prompts and answers (of a chat
    prompt, its last user turn). A YAML whose `doc_to_text` names a field the rows lack is read by lm-eval as a
    template, so every item would ask the same literal text and the gate would score nonsense; one whose
    `doc_to_target` names the wrong column scores against something else. A SuiteError shows what lm-eval renders
    beside what the spec's row says."""
    heldout = spec.heldout_rows()
    rows = {_asked(e.prompt): e for e in heldout}
    docs = [task.eval_docs[i] for i in range(min(RENDERED_ITEMS, len(task.eval_docs)))]
    where = f"task {spec.name!r} ({spec.path}): eval {spec.eval.task!r} ({spec.eval.include})"
    texts = [str(task.doc_to_text(d)).strip() for d in docs]
    first = repr(_asked(heldout[0].prompt)) if heldout else "none"
    if len(texts) > 1 and len(set(texts)) == 1:
        raise SuiteError(
            f"{where} asks every item the same text, {texts[0]!r}, where the spec's first held-out row asks "
            f"{first}: its doc_to_text names no field of the rows (lm-eval reads an unknown name as literal text)"
        )
    for d, text in zip(docs, texts, strict=True):
        row = rows.get(text)
        if row is None:
            raise SuiteError(
                f"{where} renders the prompt {text!r}, which is no held-out prompt of the spec (its first: "
                f"{first}): the eval's doc_to_text, or its data file, is not the task's"
            )
        target, answer = str(task.doc_to_target(d)).strip(), row.answer.strip()
        if answer and not _same_answer(target, answer):
            raise SuiteError(
                f"{where} expects {target!r} for {text!r}, where the spec's held-out row answers "
                f"{answer!r}: the eval's doc_to_target is not the task's answer column"
            )


def chat_tasks() -> set[str]:
    """lm-eval task names of the registered tasks whose prompts are chat messages (their first held-out row's)."""
    out = set()
    for spec in task_registry().specs.values():
        try:
            rows = spec.heldout_rows()
        except SpecError:
            continue
        if rows and isinstance(rows[0].prompt, list):
            out.add(spec.eval.task)
    return out
