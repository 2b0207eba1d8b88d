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
Both return an `EvalResult` (`mint_core.eval.results`); the in-process path is `mint_core.eval.in_process`, which
alone loads torch, transformers and PEFT.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from operator import itemgetter
from pathlib import Path
from typing import Any

import lm_eval
from lm_eval.api.model import LM
from lm_eval.evaluator import evaluate
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

from mint_core.eval.results import (
    EvalConfig,
    EvalError,
    EvalPath,
    EvalResult,
    SampleResult,
    ServedModel,
    SuiteResult,
)
from mint_core.eval.suites import GUARD, SuiteError, chat_tasks, spec_metrics, suite_tasks
from mint_core.lora.adapter import digest_dir
from mint_core.serving.client import ServingClient, ServingError

logger = logging.getLogger(__name__)


# ---- running lm-eval -------------------------------------------------------------------------------------


def run_lm_eval(lm: LM, config: EvalConfig) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """lm-eval's results for the configured suites, and each suite's lm-eval task names."""
    by_suite = suite_tasks(config.suite_names(), config.suites_dir)
    tm = TaskManager(include_path=str(Path(config.suites_dir).resolve()), include_defaults=False)
    loaded = tm.load([cfg for cfgs in by_suite.values() for cfg in cfgs])
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)
    # evaluate(), not simple_evaluate(): the same run without collecting environment info (seconds of
    # subprocesses) or asking the hub for model hashes
    samples = _samples(config, by_suite, loaded["tasks"])
    limit = None if samples is not None else config.limit
    # a task whose rows are chat messages is asked through the base's chat template (lm-eval's
    # apply_chat_template, the question as the user's turn), as rollouts and serving render it; the rest as text
    chat = chat_tasks()
    out: dict[str, Any] = {}
    for as_chat in (False, True):
        part = {k: v for k, v in loaded["tasks"].items() if (k in chat) == as_chat}
        if not part:
            continue
        got = evaluate(
            lm=lm,
            task_dict={**loaded, "tasks": part},
            limit=limit,
            samples=None if samples is None else {k: v for k, v in samples.items() if k in part},
            bootstrap_iters=0,
            log_samples=True,
            apply_chat_template=as_chat,
        )
        if got is None:
            raise EvalError("lm-eval returned no results")
        for key, value in got.items():
            out[key] = {**out[key], **value} if isinstance(value, dict) and key in out else value
    return out, {name: [cfg["task"] for cfg in cfgs] for name, cfgs in by_suite.items()}


def _samples(
    config: EvalConfig, by_suite: dict[str, list[dict[str, Any]]], tasks: dict[str, Any]
) -> dict[str, list[int]] | None:
    """lm-eval's per-task item indices when the guard's tasks take another number of items than the others
    (`guard_limit`): the first `limit` (or `guard_limit`) items of each task, all of them where it has fewer;
    None when one `limit` serves every task."""
    if config.guard_limit is None or config.guard_limit == config.limit or GUARD not in by_suite:
        return None
    out: dict[str, list[int]] = {}
    for suite, cfgs in by_suite.items():
        cap = config.guard_limit if suite == GUARD else config.limit
        for cfg in cfgs:
            n = len(tasks[cfg["task"]].eval_docs)
            out[cfg["task"]] = list(range(n if cap is None else min(n, cap)))
    return out


def _json_safe(obj: Any) -> Any:
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


def _sample(task: str, s: dict[str, Any], metric: str | None = None) -> SampleResult:
    """One item; `metric`: the one its task's spec names, else lm-eval's first."""
    metric = metric if metric is not None and metric in s else s["metrics"][0]
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
    wanted = spec_metrics()
    for name, leaves in tasks.items():
        missing = [t for t in leaves if t not in results]
        if missing:
            raise EvalError(f"lm-eval returned no results for suite {name!r} (tasks {missing})")
        items = [
            _sample(leaf, s, wanted.get(leaf))
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


def build_result(
    path: EvalPath,
    model: str,
    base: str,
    revision: str | None,
    adapter: str | None,
    config: EvalConfig,
    run: tuple[dict[str, Any], dict[str, list[str]]],
    t0: float,
) -> EvalResult:
    out, tasks = run
    suites = _suite_results(out, tasks)
    raw = _json_safe({k: v for k, v in out.items() if k != "samples"})
    raw["config"] = {
        "path": path,
        "model": model,
        "base": base,
        "revision": revision,
        "limit": config.limit,
        "guard_limit": config.guard_limit,
    }
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

    class Completions(LocalCompletionsAPI):  # type: ignore[misc]
        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            # no "Tokenizing inputs" bar (lm-eval passes disable=False to tqdm, whatever TQDM_DISABLE says): the
            # callers report what an evaluation did
            return list(super().loglikelihood(requests, disable_tqdm=True))

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
        want = digest_dir(local).prefixed
        if revision != want:
            raise EvalError(f"{target.url} serves {target.name!r} as {revision}, but {local} is {want}")
    return str(revision) if revision else None


def evaluate_served(target: ServedModel, config: EvalConfig | None = None) -> EvalResult:
    """Load the revision on the server under `target.name`, run the suites through `local-completions`."""
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
            num_concurrent=config.num_concurrent,
            max_length=int(base_card.get("max_model_len") or 2048),
            max_retries=2,
            timeout=int(target.timeout_s),
            # a serving key, else the admin token (mint's own evaluation calls every policy)
            header={"Authorization": f"Bearer {api_key or admin}"} if api_key or admin else None,
        )
        try:
            run = run_lm_eval(lm, config)
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
        return build_result("served", model, base_name, revision, target.adapter, config, run, t0)
    finally:
        if loaded and target.unload_after:
            try:
                client.unload_adapter(target.name)
            except ServingError as e:
                logger.warning("could not unload %s from %s: %s", target.name, target.url, e)
        client.close()


# ---- in-process path --------------------------------------------------------------------------------------
