"""Pretrain the built-in base: a small Llama over the byte tokenizer, trained here on the synthetic task corpus.

The base is meant to be *partly* right: answers well formed and the easy tasks (copy, upper) mostly right, the
harder ones (reverse, sort, add) only sometimes, so GRPO has something to improve. Everything is seeded and the kernels
pinned (`cpu_pin`), so a rerun with the same params and corpus gives the same weights on any x86-64 machine with
the same torch build.

Written to `out_dir`: the Hugging Face model and tokenizer (loadable by `load_base`), and `metrics.json` with the
held-out greedy exact-match and well-formed rates per task, measured with mint's own engine. The wall times of
training and evaluation go only to a separate timings file: they are the one thing that differs between rebuilds
on one machine, so the directory and the metrics (both hashed by DVC) are the same on every rebuild.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from mint_core.data.build import CORPUS, read_corpus, read_split
from mint_core.data.generators import Example, is_well_formed
from mint_core.engine.base import load_base
from mint_core.engine.cpu_pin import PINNED_CAPABILITY, REPRODUCIBLE_CPU_ENV
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.tokenizer import byte_tokenizer

logger = logging.getLogger(__name__)


class PretrainParams(BaseModel):
    """The `base:` section of params.yaml."""

    model_config = ConfigDict(extra="forbid")

    # model
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int | None = None  # None: as many as num_heads
    intermediate_size: int = Field(384, ge=8)
    max_position_embeddings: int = Field(128, ge=8)
    tie_embeddings: bool = False
    # optimisation
    steps: int = Field(1000, ge=1)
    batch_size: int = Field(64, ge=1)
    seq_len: int = Field(32, ge=4)
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    prompt_loss_weight: float = Field(0.0, ge=0, le=1)
    """Weight of the prompt tokens in the loss (0: learn the answers only)."""
    task_weights: dict[str, float] = Field(default_factory=dict)
    """Relative sampling weight of each task's corpus lines (missing tasks: 1); tilts the training budget
    toward hard tasks and away from easy ones."""
    seed: int = 0
    threads: int = Field(2, ge=1)
    # evaluation
    eval_per_task: int = Field(200, ge=0)
    eval_max_tokens: int = Field(10, ge=1)
    log_every: int = Field(100, ge=1)


def model_config(params: PretrainParams, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_kv_heads or params.num_heads,
        max_position_embeddings=params.max_position_embeddings,
        tie_word_embeddings=params.tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def encode_corpus(
    pairs: Sequence[tuple[str, str]], tokenizer: PreTrainedTokenizerBase, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [N, seq_len] and a mask [N, seq_len] that is 1 on answer tokens (answer + EOS),
    0.5 on prompt tokens and 0 on padding (scaled by `prompt_loss_weight` later). No BOS: the engine
    encodes prompts without one."""
    eos, pad = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)  # type: ignore[arg-type]
    ids = torch.full((len(pairs), seq_len), pad, dtype=torch.long)
    kind = torch.zeros((len(pairs), seq_len), dtype=torch.float32)
    prompts = tokenizer([p for p, _ in pairs])["input_ids"]
    answers = tokenizer([" " + a for _, a in pairs])["input_ids"]
    too_long = 0
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        row = (list(p) + list(a) + [eos])[:seq_len]
        too_long += len(p) + len(a) + 1 > seq_len
        ids[i, : len(row)] = torch.tensor(row)
        kind[i, : min(len(p), seq_len)] = 0.5
        kind[i, len(p) : len(row)] = 1.0
    if too_long:
        logger.warning(
            "%d of %d corpus lines are longer than seq_len %d (cut)", too_long, len(pairs), seq_len
        )
    return ids, kind


def sampling_weights(pairs: Sequence[tuple[str, str]], task_weights: dict[str, float]) -> torch.Tensor:
    """Per-line sampling weight from its task (the prompt's `<task>:` prefix)."""
    tasks = [p.partition(":")[0] for p, _ in pairs]
    absent = set(task_weights) - set(tasks)
    if absent:  # e.g. data.tasks narrowed to a subset: not an error
        logger.warning("task_weights names tasks not in the corpus (ignored): %s", sorted(absent))
    w = torch.tensor([task_weights.get(t, 1.0) for t in tasks], dtype=torch.float64)
    if not w.sum() > 0:
        raise ValueError("task_weights leave nothing to sample")
    return w


def lr_at(step: int, params: PretrainParams) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < params.warmup_steps:
        return params.lr * (step + 1) / params.warmup_steps
    progress = (step - params.warmup_steps) / max(1, params.steps - params.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return params.lr * (params.min_lr_ratio + (1 - params.min_lr_ratio) * cos)


def loss_fn(
    model: LlamaForCausalLM, ids: torch.Tensor, kind: torch.Tensor, prompt_weight: float
) -> torch.Tensor:
    """Weighted next-token cross-entropy (answer tokens weigh 1, prompt tokens `prompt_weight`, padding 0)."""
    logits = model(input_ids=ids[:, :-1]).logits
    target, k = ids[:, 1:], kind[:, 1:]
    weight = torch.where(k == 1.0, 1.0, torch.where(k > 0, prompt_weight, 0.0))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return (ce * weight.reshape(-1)).sum() / weight.sum().clamp_min(1.0)


def evaluate(
    base_dir: str | Path, heldout: dict[str, list[Example]], per_task: int, max_tokens: int = 10
) -> dict[str, dict[str, float]]:
    """Greedy exact-match and well-formed rates per task on the first `per_task` held-out examples, generated
    by mint's engine over the saved base (so the numbers are what serving and RL will see)."""
    engine = Engine(load_base(base_dir), EngineConfig(max_loras=1, max_lora_rank=1))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out: dict[str, dict[str, float]] = {}
    for name, examples in heldout.items():
        exs = examples[:per_task]
        if not exs:
            continue
        done = engine.generate([Request(str(e.prompt), None, greedy) for e in exs])
        texts = [c.text for c in done]
        out[name] = {
            "exact_match": sum(t.strip() == e.answer for t, e in zip(texts, exs, strict=True)) / len(exs),
            "well_formed": sum(is_well_formed(name, t) for t in texts) / len(exs),
            "n": len(exs),
        }
        logger.info("held-out %s: %s (e.g. %r -> %r)", name, out[name], exs[0].prompt, texts[0])
    return out


# Fields of the result that are wall-clock times (they differ between rebuilds of the same weights).
TIMINGS = ("train_seconds", "eval_seconds")


def pretrain(
    out_dir: str | Path,
    params: PretrainParams,
    data_dir: str | Path,
    metrics_path: str | Path | None = None,
    progress: bool = True,
    timings_path: str | Path | None = None,
) -> dict[str, Any]:
    """Train the base on `data_dir/corpus.txt`, save it to `out_dir`, evaluate on `data_dir/heldout`; returns
    the metrics and their wall times (TIMINGS). The metrics without the wall times go to `out_dir/metrics.json`
    and to `metrics_path` if given; the wall times to `timings_path` if given."""
    threads = torch.get_num_threads()
    torch.set_num_threads(params.threads)
    try:
        return _pretrain(Path(out_dir), params, Path(data_dir), metrics_path, progress, timings_path)
    finally:
        torch.set_num_threads(threads)


def _write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def _pretrain(
    out: Path,
    params: PretrainParams,
    data: Path,
    metrics_path: str | Path | None,
    progress: bool,
    timings_path: str | Path | None,
) -> dict[str, Any]:
    if torch.backends.cpu.get_cpu_capability() != PINNED_CAPABILITY:
        logger.warning(
            "pretraining with %s kernels, not %s: the weights will be those of this CPU, not the ones dvc.lock "
            "records (set %s before torch loads, as `mint base pretrain` does)",
            torch.backends.cpu.get_cpu_capability(),
            PINNED_CAPABILITY,
            " ".join(f"{k}={v}" for k, v in REPRODUCIBLE_CPU_ENV.items()),
        )
    torch.manual_seed(params.seed)
    t0 = time.perf_counter()
    tokenizer = byte_tokenizer()
    pairs = read_corpus(data / CORPUS)
    ids, kind = encode_corpus(pairs, tokenizer, params.seq_len)
    lengths = (kind > 0).sum(dim=1)
    weights = sampling_weights(pairs, params.task_weights)
    model = LlamaForCausalLM(model_config(params, tokenizer))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("pretraining a %.2fM-parameter Llama on %d lines", n_params / 1e6, len(ids))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": params.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=params.lr,
        betas=(0.9, 0.98),
    )
    gen = torch.Generator().manual_seed(params.seed)
    history: list[dict[str, float]] = []
    running: float | None = None
    bar = tqdm(range(params.steps), desc="pretrain", disable=not progress, mininterval=1.0)
    for step in bar:
        idx = torch.multinomial(weights, params.batch_size, replacement=True, generator=gen)
        width = int(lengths[idx].max())  # trailing padding is masked out of the loss and the causal past
        for g in opt.param_groups:
            g["lr"] = lr_at(step, params)
        loss = loss_fn(model, ids[idx, :width], kind[idx, :width], params.prompt_loss_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), params.grad_clip)
        opt.step()
        value = loss.item()
        running = value if running is None else 0.95 * running + 0.05 * value
        bar.set_postfix(loss=f"{running:.3f}", refresh=False)
        if (step + 1) % params.log_every == 0 or step == 0 or step + 1 == params.steps:
            history.append({"step": step + 1, "loss": value, "smoothed": running, "lr": lr_at(step, params)})
            logger.info("step %d loss %.4f (smoothed %.4f)", step + 1, value, running)
    bar.close()
    train_s = time.perf_counter() - t0

    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    t1 = time.perf_counter()
    heldout = read_split(data, "heldout") if params.eval_per_task else {}
    per_task = evaluate(out, heldout, params.eval_per_task, params.eval_max_tokens)
    metrics: dict[str, Any] = {
        "heldout": per_task,
        "mean_exact_match": _mean(v["exact_match"] for v in per_task.values()),
        "mean_well_formed": _mean(v["well_formed"] for v in per_task.values()),
        "final_loss": running,
        "loss_history": history,
        "parameters": n_params,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # AVX2 when pinned (cpu_pin)
    }
    timings = {"train_seconds": round(train_s, 1), "eval_seconds": round(time.perf_counter() - t1, 1)}
    # Without the wall times, a rebuild that gives the same weights gives the same directory and metrics file
    # (the same hashes in dvc.lock: a rebuild leaves the checkout clean).
    _write_json(out / "metrics.json", metrics)
    if metrics_path is not None:
        _write_json(metrics_path, metrics)
    if timings_path is not None:
        _write_json(timings_path, timings)
    return {**metrics, **timings}


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0
