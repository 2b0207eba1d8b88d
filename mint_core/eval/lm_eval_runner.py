"""Evaluate one adapter revision on the lm-eval suites, two ways that must agree.

- served: lm-eval's `local-completions` model against a server that speaks the serving contract (mint's
  embedded server or vLLM). The revision is first loaded there under a name (`candidate` by default) through the
  admin route, so what is scored is exactly what is served; the revision under that name is checked again after
  the run, and a swap in between is an error. Prompts go as token ids, tokenized with the base's own Hugging Face
  tokenizer read from a local directory (no hub), and several go in one request (the server batches them).
- in process: lm-eval's `hf` model built around the base loaded here with transformers, the revision applied
  by PEFT (`PeftModel.from_pretrained` on the adapter directory). No mint code sits between lm-eval and the
  weights, so agreement with the served path checks mint's engine against PEFT.

Both decode greedily and end a sequence at the tokenizer's EOS (mint's engine contract; the HF model's
generation config is set to the same), so on the same revision they give the same answers and scores.
Both return an `EvalResult`; `log_to_mlflow` records it in a run (`eval/<suite>/<metric>` metrics plus the raw
lm-eval results and the per-sample results as JSON artifacts) and `load_from_mlflow` reads it back.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from mint_core.errors import MintError
from mint_core.eval.suites import SUITES_DIR, SuiteError, available_suites, suite_tasks
from mint_core.registry.runs import RunRecordError, log_run_record, read_run_documents

if TYPE_CHECKING:
    from lm_eval.api.model import LM

    from mint_core.eval.gate import SuiteScore
    from mint_core.serving.client import ServingClient

logger = logging.getLogger(__name__)

EvalPath = Literal["served", "in_process"]
RESULT_ARTIFACT = "result.json"
RAW_ARTIFACT = "lm_eval_results.json"


class EvalError(MintError):
    """An evaluation that could not run as asked: server unreachable, revision not loadable or swapped
    mid-run, model files missing, lm-eval failing."""


# ---- configuration -----------------------------------------------------------------------------------------


class EvalConfig(BaseModel):
    """What to evaluate on, the same for both paths."""

    model_config = ConfigDict(extra="forbid")

    suites: list[str] | None = None
    """Suite names (`add`, ..., `guard`); None: every suite in `suites_dir`."""
    limit: int | None = Field(None, ge=1)
    """At most this many items per lm-eval task (a group's tasks each get this many); None: all."""
    batch_size: int = Field(32, ge=1)
    """Prompts per HTTP request (served) or per forward batch (in process)."""
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
        from mint_core.eval.gate import SuiteScore

        return {
            name: SuiteScore(name=name, score=s.score, n=s.n, correct=[x.correct for x in s.samples])
            for name, s in self.suites.items()
        }


# ---- running lm-eval -------------------------------------------------------------------------------------


def _run_lm_eval(lm: LM, config: EvalConfig) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """lm-eval's results for the configured suites, and each suite's lm-eval task names."""
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager

    by_suite = suite_tasks(config.suite_names(), config.suites_dir)
    tm = TaskManager(include_path=str(Path(config.suites_dir).resolve()), include_defaults=False)
    loaded = tm.load([cfg for cfgs in by_suite.values() for cfg in cfgs])
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)
    # evaluate(), not simple_evaluate(): the same run without collecting environment info (seconds of
    # subprocesses) or asking the hub for model hashes
    out = evaluate(lm=lm, task_dict=loaded, limit=config.limit, bootstrap_iters=0, log_samples=True)
    if out is None:
        raise EvalError("lm-eval returned no results")
    return dict(out), {name: [cfg["task"] for cfg in cfgs] for name, cfgs in by_suite.items()}


def _json_safe(obj: Any) -> Any:
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(obj, default=handle_non_serializable))


def _metrics_of(entry: dict[str, Any]) -> dict[str, float]:
    """`{"exact_match,strip": 0.4, "exact_match_stderr,strip": ..., "alias": ...}` -> `{"exact_match": 0.4}`
    (the filter name is kept only where one metric comes under several filters)."""
    pairs = []
    for key, v in entry.items():
        metric, sep, filt = key.partition(",")
        if sep and not metric.endswith("_stderr") and isinstance(v, int | float) and not isinstance(v, bool):
            pairs.append((metric, filt, float(v)))
    counts: dict[str, int] = {}
    for m, _, _ in pairs:
        counts[m] = counts.get(m, 0) + 1
    return {(m if counts[m] == 1 else f"{m}_{f}"): v for m, f, v in pairs}


def _sample(task: str, s: dict[str, Any]) -> SampleResult:
    metric = s["metrics"][0]
    value = float(s[metric])
    doc = s.get("doc") or {}
    prompt = s["arguments"][0][0]
    resps = s["filtered_resps"]
    if resps and isinstance(resps[0], list | tuple):  # log-likelihood: (loglikelihood, is_greedy) per choice
        lls = [float(r[0]) for r in resps]
        choices = [str(c) for c in doc.get("choices", [])]
        best = max(range(len(lls)), key=lls.__getitem__)
        target = s["target"]
        return SampleResult(
            task=task,
            doc_id=int(s["doc_id"]),
            id=doc.get("id"),
            prompt=prompt,
            target=choices[target] if isinstance(target, int) and target < len(choices) else str(target),
            response=choices[best] if best < len(choices) else str(best),
            loglikelihoods=lls,
            correct=value == 1.0,
        )
    return SampleResult(
        task=task,
        doc_id=int(s["doc_id"]),
        id=doc.get("id"),
        prompt=prompt,
        target=str(s["target"]),
        response=str(resps[0]) if resps else "",
        correct=value == 1.0,
    )


def _suite_results(out: dict[str, Any], tasks: dict[str, list[str]]) -> dict[str, SuiteResult]:
    results, samples = out.get("results", {}), out.get("samples", {})
    suites = {}
    for name, leaves in tasks.items():
        missing = [t for t in leaves if t not in results]
        if missing:
            raise EvalError(f"lm-eval returned no results for suite {name!r} (tasks {missing})")
        items = [
            _sample(leaf, s)
            for leaf in leaves
            for s in sorted(samples.get(leaf, []), key=lambda s: s["doc_id"])
        ]
        # a group's metrics: each metric's mean over the member tasks that report it, weighted by their sizes
        # (what lm-eval's aggregate_metric_list with weight_by_size computes)
        sums: dict[str, float] = {}
        sizes: dict[str, int] = {}
        for leaf in leaves:
            n = sum(1 for x in items if x.task == leaf)
            for m, v in _metrics_of(results[leaf]).items():
                sums[m] = sums.get(m, 0.0) + v * n
                sizes[m] = sizes.get(m, 0) + n
        metrics = {m: sums[m] / sizes[m] if sizes[m] else math.nan for m in sums}
        scores = [1.0 if x.correct else 0.0 for x in items]
        suites[name] = SuiteResult(
            suite=name,
            metrics=metrics,
            score=sum(scores) / len(scores) if scores else math.nan,
            n=len(items),
            samples=items,
        )
    return suites


def _result(
    path: EvalPath,
    model: str,
    base: str,
    revision: str | None,
    adapter: str | None,
    config: EvalConfig,
    run: tuple[dict[str, Any], dict[str, list[str]]],
    t0: float,
) -> EvalResult:
    import lm_eval

    out, tasks = run
    suites = _suite_results(out, tasks)
    raw = _json_safe({k: v for k, v in out.items() if k != "samples"})
    raw["config"] = {"path": path, "model": model, "base": base, "revision": revision, "limit": config.limit}
    return EvalResult(
        path=path,
        model=model,
        base=base,
        revision=revision,
        adapter=adapter,
        limit=config.limit,
        wall_s=time.perf_counter() - t0,
        lm_eval_version=str(lm_eval.__version__),
        suites=suites,
        raw=raw,
    )


# ---- served path ------------------------------------------------------------------------------------------


def _served_card(client: ServingClient, name: str) -> dict[str, Any] | None:
    return next((m for m in client.models() if m.get("id") == name), None)


def _completions_model(**kwargs: Any) -> LM:
    """lm-eval's `local-completions` model, reading a continuation's log-probabilities by its length.

    lm-eval scores a continuation with `echo` and `max_tokens=1` and takes `token_logprobs[ctxlen:-1]`, assuming
    the list ends with exactly one generated token. A server that stops on EOS without returning the EOS token
    (mint's embedded server does; vLLM returns it) then loses the continuation's last token, and a trained model
    predicts EOS right after an answer. Slicing `[ctxlen:len(prompt)]` is right either way."""
    from operator import itemgetter

    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class Completions(LocalCompletionsAPI):  # type: ignore[misc]
        @staticmethod
        def parse_logprobs(
            outputs: dict[str, Any] | list[dict[str, Any]],
            tokens: list[list[int]] | None = None,
            ctxlens: list[int] | None = None,
            **kw: Any,
        ) -> list[tuple[float, bool]]:
            if tokens is None or ctxlens is None:
                raise EvalError("log-likelihood requests need their token ids and context lengths")
            outs = outputs if isinstance(outputs, list) else [outputs]
            choices = [c for out in outs for c in sorted(out["choices"], key=itemgetter("index"))]
            res = []
            for choice, toks, ctxlen in zip(choices, tokens, ctxlens, strict=True):
                lps = choice["logprobs"]["token_logprobs"]
                tops = choice["logprobs"]["top_logprobs"]
                if len(lps) < len(toks) or tops is None:
                    raise EvalError(
                        f"the server echoed {len(lps)} token logprobs for a {len(toks)}-token prompt "
                        "(it must honour echo with logprobs)"
                    )
                cont, cont_tops = lps[ctxlen : len(toks)], tops[ctxlen : len(toks)]
                greedy = all(lp == max(top.values()) for lp, top in zip(cont, cont_tops, strict=True))
                res.append((float(sum(cont)), greedy))
            return res

    return Completions(**kwargs)


def _load_candidate(client: ServingClient, target: ServedModel) -> str | None:
    """Load the revision under `target.name` (replacing any revision of that name); its served digest."""
    from mint_core.lora.adapter import digest_dir
    from mint_core.serving.client import ServingError

    assert target.adapter is not None
    try:
        client.load_adapter(target.name, target.adapter, inplace=True)
        card = _served_card(client, target.name)
    except ServingError as e:
        raise EvalError(
            f"loading revision {target.adapter!r} as {target.name!r} on {target.url} failed: {e}"
        ) from e
    if card is None:
        raise EvalError(f"{target.url} does not list {target.name!r} after loading {target.adapter!r}")
    revision = card.get("revision")  # mint reports it; a vLLM server does not
    local = Path(target.adapter)
    if revision and local.is_absolute() and local.is_dir():
        want = f"sha256:{digest_dir(local)}"
        if revision != want:
            raise EvalError(f"{target.url} serves {target.name!r} as {revision}, but {local} is {want}")
    return str(revision) if revision else None


def evaluate_served(target: ServedModel, config: EvalConfig | None = None) -> EvalResult:
    """Load the revision on the server under `target.name`, run the suites through `local-completions`."""
    from mint_core.serving.client import ServingClient, ServingError

    config = config or EvalConfig()
    t0 = time.perf_counter()
    missing = [m for m in ("tenacity", "aiohttp", "requests") if importlib.util.find_spec(m) is None]
    if missing:
        raise EvalError(f"lm-eval's local-completions model needs lm-eval[api]; missing packages: {missing}")
    # unknown suites, missing data: fail before anything is loaded
    suite_tasks(config.suite_names(), config.suites_dir)
    if not any((target.tokenizer / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise EvalError(
            f"tokenizer directory {target.tokenizer} has no tokenizer.json or tokenizer_config.json "
            "(pass the served base's model directory)"
        )
    api_key = target.api_key.get_secret_value() if target.api_key else None
    admin = target.admin_token.get_secret_value() if target.admin_token else None
    client = ServingClient(target.url, api_key=api_key, admin_token=admin, timeout=target.timeout_s)
    loaded = False
    try:
        if not client.health():
            raise EvalError(f"server {target.url} is unreachable or unhealthy (GET /health failed)")
        try:
            base_card = next((m for m in client.models() if not m.get("parent")), None)
        except ServingError as e:
            raise EvalError(f"server {target.url}: cannot list models: {e}") from e
        if base_card is None:
            raise EvalError(f"server {target.url} lists no base model in /v1/models")
        base_name = str(base_card["id"])
        model, revision = base_name, None
        if target.adapter is not None:
            revision = _load_candidate(client, target)
            model, loaded = target.name, True
        lm = _completions_model(
            base_url=f"{target.url.rstrip('/')}/v1/completions",
            model=model,
            tokenizer=str(target.tokenizer),
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            batch_size=config.batch_size,
            max_length=int(base_card.get("max_model_len") or 2048),
            max_retries=2,
            timeout=int(target.timeout_s),
            header={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )
        try:
            run = _run_lm_eval(lm, config)
        except (SuiteError, EvalError):
            raise
        except Exception as e:
            raise EvalError(f"lm-eval against {target.url} (model {model!r}) failed: {e}") from e
        if loaded:
            after = _served_card(client, target.name)
            now = after.get("revision") if after else None
            if after is None or now != revision:
                raise EvalError(
                    f"the revision under {target.name!r} on {target.url} changed during the evaluation "
                    f"({revision} -> {now}); the scores would mix revisions"
                )
        return _result("served", model, base_name, revision, target.adapter, config, run, t0)
    finally:
        if loaded and target.unload_after:
            try:
                client.unload_adapter(target.name)
            except ServingError as e:
                logger.warning("could not unload %s from %s: %s", target.name, target.url, e)
        client.close()


# ---- in-process path --------------------------------------------------------------------------------------


def evaluate_in_process(target: LocalModel, config: EvalConfig | None = None) -> EvalResult:
    """Load the base with transformers, apply the revision with PEFT, run the suites through lm-eval's `hf`."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mint_core.lora.adapter import CONFIG_FILE, digest_dir

    config = config or EvalConfig()
    t0 = time.perf_counter()
    suite_tasks(config.suite_names(), config.suites_dir)
    if not (target.base / "config.json").is_file():
        raise EvalError(f"base directory {target.base} has no config.json")
    if target.adapter is not None and not (target.adapter / CONFIG_FILE).is_file():
        raise EvalError(f"adapter directory {target.adapter} has no {CONFIG_FILE}")
    tokenizer = AutoTokenizer.from_pretrained(target.base, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(
        target.base, dtype=getattr(torch, target.dtype), local_files_only=True
    )
    # mint's engine ends a sequence at the tokenizer's EOS; make generate() do the same
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    revision = None
    if target.adapter is not None:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, str(target.adapter), is_trainable=False)
        except Exception as e:
            raise EvalError(f"PEFT cannot apply adapter {target.adapter} to base {target.base}: {e}") from e
        revision = f"sha256:{digest_dir(target.adapter)}"
    model.to(target.device).eval()
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=config.batch_size,
        device=target.device,
        max_length=getattr(model.config, "max_position_embeddings", None),
    )
    try:
        run = _run_lm_eval(lm, config)
    except (SuiteError, EvalError):
        raise
    except Exception as e:
        raise EvalError(f"lm-eval in process on {target.base} failed: {e}") from e
    adapter = str(target.adapter) if target.adapter is not None else None
    return _result("in_process", str(target.base), str(target.base), revision, adapter, config, run, t0)


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


# ---- MLflow -------------------------------------------------------------------------------------------------


def log_to_mlflow(result: EvalResult, tracking_uri: str, run_id: str, prefix: str = "eval") -> None:
    """Record `result` in a run through the registry: metrics `<prefix>/<suite>/<metric>` (plus `score` and `n`
    per suite and `<prefix>/wall_s`), tags naming the path and revision, and artifacts `<prefix>/result.json`
    (typed result with per-sample answers) and `<prefix>/lm_eval_results.json` (lm-eval's raw results)."""
    metrics = {f"{prefix}/wall_s": result.wall_s}
    for name, s in result.suites.items():
        values = {**s.metrics, "score": s.score, "n": float(s.n)}
        metrics |= {f"{prefix}/{name}/{m}": v for m, v in values.items()}
    tags = {
        f"mint.{prefix}.path": result.path,
        f"mint.{prefix}.revision": result.revision or "base",
        f"mint.{prefix}.suites": ",".join(result.suites),
    }
    documents = {
        f"{prefix}/{RESULT_ARTIFACT}": result.model_dump(mode="json", exclude={"raw"}),
        f"{prefix}/{RAW_ARTIFACT}": result.raw,
    }
    try:
        log_run_record(tracking_uri, run_id, metrics, tags, documents)
    except RunRecordError as e:
        raise EvalError(f"logging the evaluation: {e}") from e


def load_from_mlflow(tracking_uri: str, run_id: str, prefix: str = "eval") -> EvalResult:
    """The EvalResult `log_to_mlflow` recorded in a run."""
    paths = [f"{prefix}/{RESULT_ARTIFACT}", f"{prefix}/{RAW_ARTIFACT}"]
    try:
        doc, raw = read_run_documents(tracking_uri, run_id, paths).values()
    except RunRecordError as e:
        raise EvalError(f"no evaluation under {prefix}/: {e}") from e
    return EvalResult.model_validate({**doc, "raw": raw})


__all__ = [
    "EvalConfig",
    "EvalError",
    "EvalResult",
    "LocalModel",
    "SampleResult",
    "ServedModel",
    "SuiteResult",
    "differences",
    "evaluate_in_process",
    "evaluate_served",
    "load_from_mlflow",
    "log_to_mlflow",
]
