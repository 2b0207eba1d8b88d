"""The in-process evaluation path: lm-eval's `hf` model around the base loaded here with transformers, the
revision applied by PEFT (`PeftModel.from_pretrained` on the adapter directory). No mint code sits between lm-eval
and the weights, so agreement with the served path (`lm_eval_runner.evaluate_served`) checks mint's engine against
PEFT."""

from __future__ import annotations

import time
from typing import Any

import torch
from lm_eval.models.huggingface import HFLM
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from mint_core.engine.chat import stop_token_ids
from mint_core.eval.lm_eval_runner import build_result, run_lm_eval
from mint_core.eval.results import EvalConfig, EvalError, EvalResult, LocalModel
from mint_core.eval.suites import SuiteError, suite_tasks
from mint_core.lora.adapter import CONFIG_FILE, digest_dir


def evaluate_in_process(target: LocalModel, config: EvalConfig | None = None) -> EvalResult:
    """Load the base with transformers, apply the revision with PEFT, run the suites through lm-eval's `hf`."""
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
    # mint's engine (and vLLM) end a sequence at the tokenizer's EOS and at generation_config's (a chat template's
    # end of turn); make generate() do the same
    model.generation_config.eos_token_id = sorted(
        stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    revision = None
    if target.adapter is not None:
        try:
            model = PeftModel.from_pretrained(model, str(target.adapter), is_trainable=False)
        except Exception as e:
            raise EvalError(f"PEFT cannot apply adapter {target.adapter} to base {target.base}: {e}") from e
        revision = digest_dir(target.adapter).prefixed
    model.to(target.device).eval()
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=config.batch_size,
        device=target.device,
        max_length=getattr(model.config, "max_position_embeddings", None),
    )
    try:
        run = run_lm_eval(lm, config)
    except (SuiteError, EvalError):
        raise
    except Exception as e:
        raise EvalError(f"lm-eval in process on {target.base} failed: {e}") from e
    adapter = str(target.adapter) if target.adapter is not None else None
    return build_result("in_process", str(target.base), str(target.base), revision, adapter, config, run, t0)
