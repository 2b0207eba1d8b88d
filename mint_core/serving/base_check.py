"""Check a base directory before anything trains on it or serves it: one error naming the directory and every
problem (no tokenizer, a chat template that fails on the task's messages, a model a serving backend cannot load).

No torch import here (transformers' tokenizer loading may still pull it in); vLLM's own limits are asked of vLLM's
environment, so they are the installed vLLM's, not a copy that drifts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mint_core.engine.chat import Messages, generation_eos, render_prompt, stop_token_ids
from mint_core.errors import BaseError
from mint_core.serving.vllm_process import DEFAULT_PYTHON, has_chat_template, vllm_available

logger = logging.getLogger(__name__)

Serving = Literal["mint", "vllm"]

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vLLM 0.32's CPU attention head sizes (CPUAttentionBackend.get_supported_head_sizes); used when vLLM's
environment cannot be asked."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DEFAULT_SAMPLE: Messages = ({"role": "user", "content": "Hello"},)

_VLLM_PROBE = """
import json
from vllm import __version__
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
print(json.dumps({"version": __version__, "architectures": sorted(ModelRegistry.get_supported_archs()),
                  "cpu_head_sizes": list(CPUAttentionBackend.get_supported_head_sizes())}))
"""


@dataclass(frozen=True)
class VLLMSupport:
    """What an installed vLLM serves: its architectures and the head sizes of its CPU attention."""

    version: str
    architectures: frozenset[str]
    cpu_head_sizes: tuple[int, ...]


def _install_key(python: Path) -> str | None:
    """What identifies the vLLM installed beside `python` (its dist-info's name and time), None if not found."""
    venv = Path(python).absolute().parent.parent
    found = sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info"))
    if not found:
        return None
    return "|".join(f"{p.resolve()}:{p.stat().st_mtime_ns}" for p in found)


def _cache_file(key: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mint"
    return root / f"vllm-support-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


@functools.lru_cache(maxsize=4)
def vllm_support(python: Path = DEFAULT_PYTHON) -> VLLMSupport:
    """Ask vLLM's own environment (about 10 s: it imports vLLM), once per installation: the answer is kept in
    ~/.cache/mint, keyed by the installed vLLM's dist-info (a reinstall asks again)."""
    key = _install_key(python)
    cached = _cache_file(key) if key else None
    if cached is not None and cached.is_file():
        try:
            doc = json.loads(cached.read_text())
            return VLLMSupport(doc["version"], frozenset(doc["architectures"]), tuple(doc["cpu_head_sizes"]))
        except (OSError, ValueError, KeyError):
            pass  # asked again below
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [str(python), "-c", _VLLM_PROBE], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"could not ask vLLM at {python} what it serves: {tail[0]}")
    line = out.stdout.strip().splitlines()[-1]
    doc = json.loads(line)
    if cached is not None:
        try:  # written whole, then renamed: a reader never sees half of it
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(line)
            tmp.replace(cached)
        except OSError as e:
            logger.info("could not keep vLLM's answer in %s: %s", cached, e)
    return VLLMSupport(doc["version"], frozenset(doc["architectures"]), tuple(doc["cpu_head_sizes"]))


@dataclass(frozen=True)
class BaseReport:
    """What the check read from a usable base."""

    path: Path
    model_type: str
    architectures: tuple[str, ...]
    chat_template: bool
    """Whether the tokenizer brings its own chat template (without one, FALLBACK_CHAT_TEMPLATE renders chats)."""
    stop_token_ids: frozenset[int]
    """The tokenizer's EOS and generation_config's eos_token_id: generation stops at any of them."""
    rendered: list[str] = field(default_factory=list)
    """The sample prompts as rendered, in order."""


def _conversations(sample: Any) -> list[str | Messages]:
    """One conversation (a list of messages), or several prompts (each text or a list of messages)."""
    if sample is None:
        return [_DEFAULT_SAMPLE]
    if isinstance(sample, str):
        return [sample]
    items = list(sample)
    if items and isinstance(items[0], Mapping):
        return [items]
    return items


# vLLM's models of these types size heads as hidden_size / num_attention_heads whatever config.json's head_dim says
# (vllm/model_executor/models/qwen2.py: `self.head_dim = hidden_size // self.total_num_heads`)
_HEAD_DIM_FROM_HIDDEN = frozenset({"qwen2"})


def head_dim(cfg: Mapping[str, Any]) -> int | None:
    """The attention head size vLLM gives a config (its head_dim, else hidden_size / num_attention_heads)."""
    if cfg.get("head_dim") and cfg.get("model_type") not in _HEAD_DIM_FROM_HIDDEN:
        return int(cfg["head_dim"])
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def check_base(
    path: str | Path,
    sample_messages: Sequence[str | Messages] | Messages | None = None,
    serving: Serving | None = None,
    *,
    vllm_python: Path = DEFAULT_PYTHON,
    device: str = "cpu",
    max_model_len: int | None = None,
    load_tokenizer: bool = True,
) -> BaseReport:
    """Check that `path` is a causal-LM directory mint can train and `serving` (None: neither backend's limits)
    can load, and that its chat template renders `sample_messages` (one conversation, or a list of prompts, each
    text or a conversation; None: a one-line user turn). Raises BaseError naming the directory and every problem;
    changes nothing.

    Without `load_tokenizer`, only the files are read (config.json, generation_config.json, which files exist):
    no transformers, so no torch, for the service supervisor."""
    path = Path(path)
    where = str(path)
    if not path.is_dir():
        raise BaseError(where, ["no such directory"])
    problems: list[str] = []
    cfg: dict[str, Any] = {}
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        problems.append("no config.json: not a Hugging Face model directory")
    except ValueError as e:
        problems.append(f"config.json is not JSON ({e})")
    model_type = str(cfg.get("model_type") or "")
    architectures = tuple(cfg.get("architectures") or ())
    if cfg and not model_type:
        problems.append("config.json: no model_type")
    elif cfg and load_tokenizer:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            problems.append(
                f"config.json: model_type {model_type!r} is not a causal LM that transformers knows"
            )
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        problems.append("no weights (model.safetensors or model-*.safetensors)")

    tokenizer: Any = None
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        problems.append(
            "no tokenizer (tokenizer.json or tokenizer_config.json): mint needs the base's own tokenizer"
        )
    elif load_tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # whatever transformers raises, named with the directory
            problems.append(f"tokenizer does not load: {type(e).__name__}: {e}")

    stops: frozenset[int] = frozenset()
    rendered: list[str] = []
    try:
        gen_eos = generation_eos(path)
    except ValueError as e:
        problems.append(f"generation_config.json is not JSON ({e})")
        gen_eos = []
    if tokenizer is not None:
        stops = stop_token_ids(tokenizer, gen_eos)
        vocab = cfg.get("vocab_size")
        if not stops:
            problems.append(
                "no EOS token: neither tokenizer_config.json's eos_token nor generation_config.json's "
                "eos_token_id names one, so generation would stop only at max_tokens"
            )
        if isinstance(vocab, int) and len(tokenizer) > vocab:
            problems.append(
                f"the tokenizer has {len(tokenizer)} tokens, more than config.json's vocab_size {vocab}"
            )
        for i, prompt in enumerate(_conversations(sample_messages)):
            try:
                text = render_prompt(tokenizer, prompt)
            except Exception as e:  # a template error is the user's: name it, go on
                problems.append(f"chat template fails on sample {i}: {type(e).__name__}: {e}")
                continue
            if not text:
                problems.append(f"chat template renders sample {i} as an empty prompt")
            rendered.append(text)

    # (mint's engine serves up to the base's positions whatever max_model_len asks: nothing to check for it)
    if serving == "vllm" and cfg:
        problems += _vllm_problems(cfg, architectures, vllm_python, device, max_model_len)
    if problems:
        raise BaseError(where, problems)
    has_template = bool(getattr(tokenizer, "chat_template", None)) or has_chat_template(path)
    return BaseReport(path, model_type, architectures, has_template, stops, rendered)


def _vllm_problems(
    cfg: Mapping[str, Any],
    architectures: tuple[str, ...],
    python: Path,
    device: str,
    max_model_len: int | None,
) -> list[str]:
    problems = []
    support: VLLMSupport | None = None
    if vllm_available(python):
        try:
            support = vllm_support(python)
        except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as e:
            logger.warning("%s; checking the base against vLLM 0.32's known limits", e)
    if support is not None and not any(a in support.architectures for a in architectures):
        problems.append(
            f"config.json: architectures {list(architectures)} is none that vLLM {support.version} serves"
        )
    mla = "kv_lora_rank" in cfg  # vLLM runs MLA with its own attention; the head size below does not apply
    size = head_dim(cfg)
    sizes = support.cpu_head_sizes if support is not None else VLLM_CPU_HEAD_SIZES
    if device == "cpu" and not mla and size is not None and size not in sizes:
        how = "hidden_size / num_attention_heads" if size != cfg.get("head_dim") else "head_dim"
        problems.append(
            f"config.json: head_dim {size} ({how}) is not a head size vLLM's CPU attention supports "
            f"({', '.join(map(str, sizes))})"
        )
    positions = cfg.get("max_position_embeddings")
    if max_model_len is not None and isinstance(positions, int) and positions < max_model_len:
        problems.append(
            f"config.json: max_position_embeddings {positions} is below vLLM's max_model_len {max_model_len}"
        )
    return problems
