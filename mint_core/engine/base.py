"""The resident base: load any local Hugging Face causal LM frozen, fingerprint it, build tiny test bases."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from mint_core.engine.chat_tokenizer import CHAT_TOKENS, ChatFamily, chat_bpe_tokenizer
from mint_core.engine.device import check_device
from mint_core.types import EXPERT_PARAMS, Site

logger = logging.getLogger(__name__)

Family = Literal["dense", "moe", "mla", "dsa"]
FAMILIES: tuple[Family, ...] = ("dense", "moe", "mla", "dsa")
"""The architectures of the tiny test bases: dense (Llama), MoE (Qwen3-MoE), MLA (DeepSeek-V3), DSA (DeepSeek-V3.2,
MLA with DeepSeek sparse attention)."""

FROZEN_MODULES = ("indexer",)
"""Submodules whose linears get no LoRA site. DSA's lightning indexer (DeepSeek-V3.2, `self_attn.indexer`: wq_b,
wk, weights_proj) only chooses which keys each query attends to: transformers runs it under `torch.no_grad` and
hands on a discrete top-k, so a LoRA there would get no gradient from any loss and would never train. The
attention projections around it (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj) are MLA's and are
sites as in the MLA family; an adapter on q_a_proj still moves the indexer's queries (it reads q_a_proj's
normalised output), so a policy steers which tokens it attends to through the frozen indexer."""


@dataclass
class Base:
    """A frozen causal LM held once per process, with what adapters are checked against."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    fingerprint: str
    name: str
    sites: dict[str, Site] = field(default_factory=dict)

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def fingerprint(model: PreTrainedModel) -> str:
    """sha256 over the config and every weight (name, dtype, shape, bytes), in a canonical order."""
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    for volatile in (
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_experts_implementation",
    ):
        cfg.pop(volatile, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    seen: set[int] = set()
    for name, t in sorted(model.state_dict().items()):
        if t.data_ptr() in seen and t.numel():  # tied weights hash once
            h.update(f"{name}=tied".encode())
            continue
        seen.add(t.data_ptr())
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def discover_sites(model: nn.Module) -> dict[str, Site]:
    """Every linear layer and fused expert parameter under the decoder layers (not embeddings or lm_head, nor
    the `FROZEN_MODULES`)."""
    sites: dict[str, Site] = {}
    for name, module in model.named_modules():
        if ".layers." not in f".{name}" or any(f".{frozen}." in f".{name}." for frozen in FROZEN_MODULES):
            continue
        if isinstance(module, nn.Linear):
            sites[name] = Site(name, module.in_features, module.out_features)
        else:
            for pname, p in module.named_parameters(recurse=False):
                if pname in EXPERT_PARAMS and p.dim() == 3:
                    experts, out_f, in_f = p.shape
                    sites[f"{name}.{pname}"] = Site(f"{name}.{pname}", in_f, out_f, experts)
    return sites


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def from_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, name: str) -> Base:
    freeze(model)
    return Base(model, tokenizer, fingerprint(model), name, discover_sites(model))


def load_base(path: str | Path, dtype: torch.dtype | str = "float32", device: str = "cpu") -> Base:
    """Load a local Hugging Face causal-LM directory (never a hub id), frozen and fingerprinted, onto `device`
    (cpu, cuda, cuda:N; a CUDA device that is not visible is refused before anything is read)."""
    path = Path(path)
    where = check_device(device)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"base model directory {path} has no config.json")
    t0 = time.perf_counter()
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    model.to(where)  # type: ignore[arg-type]
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    base = from_model(model, tokenizer, path.name)
    logger.info("loaded base %s (%s) in %.1f s", path, base.fingerprint[:12], time.perf_counter() - t0)
    return base


def tiny_config(family: Family, **overrides: Any) -> PretrainedConfig:
    """Small random configs of the families mint supports (`FAMILIES`), for tests and demos."""
    common: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    if family == "dense":
        kw = dict(common, intermediate_size=128, num_key_value_heads=2, model_type="llama")
    elif family == "moe":
        kw = dict(
            common,
            model_type="qwen3_moe",
            intermediate_size=128,
            moe_intermediate_size=32,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    elif family in ("mla", "dsa"):
        kw = dict(
            common,
            model_type="deepseek_v3" if family == "mla" else "deepseek_v32",
            intermediate_size=128,
            moe_intermediate_size=32,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            rope_scaling=None,
        )
        if family == "dsa":
            # Each query attends to the 4 keys the lightning indexer scores highest: sparse from the fifth token
            # on, so tests of a dozen tokens exercise the selection. Eight indexer heads, because with two the
            # ReLU'd scores of several keys were often exactly 0, and torch.topk breaks such ties by position
            # in a tensor whose length differs between a full forward and a decode step (tests/unit/test_dsa.py).
            kw.update(index_topk=4, index_n_heads=8, index_head_dim=16)
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    kw.update(overrides)
    model_type = kw.pop("model_type")
    return AutoConfig.for_model(model_type, **kw)


def build_tiny_base(
    family: Family,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    device: str = "cpu",
    **overrides: Any,
) -> Base:
    """A randomly initialised base of one family on `device`, frozen and fingerprinted (no download). The weights
    are drawn on the CPU, so a seed gives the same base (and fingerprint) on every device."""
    where = check_device(device)
    if tokenizer is not None:
        # the tokenizer's ids, not the family config's defaults (Llama's eos 2, DeepSeek's 1: byte tokens here),
        # since generation stops at the config's and generation_config's EOS too, on mint's engine and on vLLM
        # (not pad_token_id: it would zero that row of the embeddings, so the weights would depend on it)
        for key in ("bos_token_id", "eos_token_id"):
            overrides.setdefault(key, getattr(tokenizer, key))
    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to(where)  # type: ignore[arg-type]
    return from_model(model, tokenizer, f"tiny-{family}")


def tiny_chat_config(
    family: ChatFamily, tokenizer: PreTrainedTokenizerBase, **overrides: Any
) -> PretrainedConfig:
    """A tiny config of a chat family sized to `tokenizer`. Heads of 32 dimensions: the smallest vLLM's CPU attention
    takes (CPUAttentionBackend.get_supported_head_sizes: 32, 64, 80, 96, 112, 128, ...)."""
    kw: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        # the small Qwen checkpoints (0.5B-4B) tie the output head to the embeddings; Llama 3 8B does not
        tie_word_embeddings=family != "llama",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family != "qwen2":  # Qwen2 (in transformers and vLLM) takes hidden_size / num_attention_heads
        kw["head_dim"] = 32
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def build_tiny_chat_base(out: Path, family: ChatFamily, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random chat base of a family as a normal Hugging Face directory and return it: config.json,
    model.safetensors, a BPE tokenizer trained here (tokenizer.json) with the family's special tokens and chat
    template (tokenizer_config.json), and generation_config.json whose eos_token_id lists the EOS and the
    end-of-turn token. No download; the same files for the same seed. `overrides` change the model config."""
    out = Path(out)
    tokenizer = chat_bpe_tokenizer(family)
    spec = CHAT_TOKENS[family]
    torch.manual_seed(seed)
    cfg = tiny_chat_config(family, tokenizer, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in dict.fromkeys((spec.eos, spec.end_of_turn, spec.pad))]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # the template inside tokenizer_config.json, where every transformers version and vLLM look for it
    jinja = out / "chat_template.jinja"
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["chat_template"] = spec.template
    # the generic class, which transformers 4 and 5 (mint's and vLLM's) both map to tokenizer.json as written
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    jinja.unlink(missing_ok=True)
    logger.info("wrote tiny %s chat base to %s (vocab %d)", family, out, len(tokenizer))
    return out
