"""Validate an adapter directory before anything changes state, collecting every problem into one error.

Checked, in order, without ever unpickling: the path is inside an allowed root; the config is PEFT LoRA with
supported options; the weights are safetensors (a `.bin`/`.pt` is refused unread); the safetensors header is
sane (length, JSON, dtypes, offsets inside the file); every tensor is finite; the rank fits the engine; the
base fingerprint matches; each key names a module of the base with matching shapes.
"""

from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from mint_core.errors import AdapterError
from mint_core.lora.adapter import (
    CONFIG_FILE,
    FINGERPRINT_KEY,
    WEIGHTS_FILE,
    AdapterWeights,
    digest_files,
    from_peft_state,
)
from mint_core.types import Site

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "modules_to_save (full copies of base modules)",
    "lora_bias": "LoRA bias",
    "layer_replication": "layer_replication",
}


@dataclass(frozen=True)
class BaseSpec:
    """What an adapter is checked against: the base's fingerprint and its LoRA sites."""

    fingerprint: str
    sites: dict[str, Site]
    max_rank: int
    base_modules: frozenset[str] = frozenset()
    """Every module and expert parameter of the base, to tell "not in the base" from "not enabled here"."""


def _within(path: Path, roots: list[Path]) -> bool:
    real = path.resolve()
    return any(real == r or r in real.parents for r in (root.resolve() for root in roots))


def check_safetensors_header(data: bytes) -> list[str]:
    """Problems with a safetensors file's framing, found without parsing any tensor."""
    if len(data) < 8:
        return [f"{WEIGHTS_FILE} is truncated ({len(data)} bytes; no header length)"]
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or n > len(data) - 8:
        return [
            f"{WEIGHTS_FILE} header length {n} exceeds the file ({len(data)} bytes): truncated or not safetensors"
        ]
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [
            f"{WEIGHTS_FILE} header is not valid JSON ({e.__class__.__name__}): garbage or not safetensors"
        ]
    if not isinstance(header, dict):
        return [f"{WEIGHTS_FILE} header is not a JSON object"]
    problems = []
    beyond: list[str] = []
    body = len(data) - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                problems.append(f"{WEIGHTS_FILE} __metadata__ is not an object of strings")
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(int(s) for s in shape)
            if not isinstance(dtype, str) or not isinstance(begin, int) or not isinstance(end, int):
                raise TypeError(key)
        except (KeyError, TypeError, ValueError):
            problems.append(f"tensor {key!r}: malformed header entry")
            continue
        if dtype not in _DTYPE_BYTES:
            problems.append(f"tensor {key!r}: unsupported dtype {dtype}")
        elif dtype not in _FLOAT_DTYPES:
            problems.append(f"tensor {key!r}: dtype {dtype} is not floating point")
        elif end - begin != numel * _DTYPE_BYTES[dtype]:
            problems.append(f"tensor {key!r}: byte range {end - begin} does not fit shape {shape} of {dtype}")
        if end > body or begin < 0:
            beyond.append(key)
    if beyond:
        problems.append(
            f"{WEIGHTS_FILE} is truncated: {len(beyond)} tensor(s) end beyond its {body} data bytes "
            f"(first: {beyond[0]!r})"
        )
    return problems


def read_adapter(
    path: str | Path,
    spec: BaseSpec,
    name: str | None = None,
    allowed_roots: list[Path] | None = None,
) -> AdapterWeights:
    """Read and validate one adapter directory; raise a single AdapterError listing every problem."""
    path = Path(path)
    label = name or path.name
    problems: list[str] = []

    def fail() -> AdapterError:
        return AdapterError(label, str(path), problems)

    if allowed_roots is not None and not _within(path, allowed_roots):
        problems.append(f"path is outside the allowed roots {[str(r) for r in allowed_roots]}")
        raise fail()
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            problems.append(
                f"{path.name} is a pickle-based checkpoint; refused without loading (use safetensors)"
            )
        else:
            problems.append(
                "expected an adapter directory (adapter_config.json + adapter_model.safetensors), got a file"
            )
        raise fail()
    if not path.is_dir():
        problems.append("no adapter directory at this path")
        raise fail()
    if allowed_roots is not None:
        # a file symlinked out of an allowed directory escapes the roots as much as the directory would
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            if (path / f).exists() and not _within(path / f, allowed_roots):
                problems.append(f"{f} resolves outside the allowed roots {[str(r) for r in allowed_roots]}")
        if problems:
            raise fail()

    t0 = time.perf_counter()
    config_bytes: bytes | None = None
    if not (path / CONFIG_FILE).is_file():
        problems.append(f"{CONFIG_FILE} is missing")
    else:
        config_bytes = (path / CONFIG_FILE).read_bytes()
    weights = path / WEIGHTS_FILE
    weights_bytes: bytes | None = None
    if not weights.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            problems.append(
                f"weights only in pickle format {pickles}; refused without loading (use safetensors)"
            )
        else:
            problems.append(f"{WEIGHTS_FILE} is missing")
    else:
        weights_bytes = weights.read_bytes()
    read_s = time.perf_counter() - t0
    out = validate_bytes(config_bytes, weights_bytes, spec, label, str(path), problems)
    out.load_s["read"] = read_s
    return out


def validate_bytes(
    config_bytes: bytes | None,
    weights_bytes: bytes | None,
    spec: BaseSpec,
    label: str,
    where: str | None = None,
    problems: list[str] | None = None,
) -> AdapterWeights:
    """Validate an adapter given as PEFT's two files' bytes (None: the file is missing, already reported in
    `problems`); raise a single AdapterError listing every problem."""
    t0 = time.perf_counter()
    problems = [] if problems is None else problems
    config: dict = {}
    parsed = False
    if config_bytes is not None:
        try:
            config = json.loads(config_bytes)
            if not isinstance(config, dict):
                raise ValueError("not an object")
            parsed = True
        except (ValueError, UnicodeDecodeError) as e:
            problems.append(f"{CONFIG_FILE} is not valid JSON ({e})")
            config = {}
    rank = config.get("r")
    alpha = config.get("lora_alpha")
    if parsed:  # `{}` too: an empty config must fail these checks, not slip past them
        if config.get("peft_type") != "LORA":
            problems.append(f"peft_type is {config.get('peft_type')!r}, expected 'LORA'")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            problems.append(f"r must be a positive integer, got {rank!r}")
            rank = None
        elif rank > spec.max_rank:
            problems.append(f"rank {rank} is above the engine's max rank {spec.max_rank}")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
            problems.append(f"lora_alpha must be a finite number, got {alpha!r}")
        for key, what in _UNSUPPORTED.items():
            if config.get(key):
                problems.append(f"{what} is not supported ({key}={config[key]!r})")

    state: dict[str, torch.Tensor] = {}
    if weights_bytes is not None:
        header_problems = check_safetensors_header(weights_bytes)
        problems += header_problems
        if not header_problems:
            try:
                state = load_safetensors(weights_bytes)
            except Exception as e:
                problems.append(f"{WEIGHTS_FILE} could not be read: {e}")
            n = struct.unpack("<Q", weights_bytes[:8])[0]
            meta = json.loads(weights_bytes[8 : 8 + n]).get("__metadata__") or {}
            fp = meta.get(FINGERPRINT_KEY)
            if fp is not None and fp != spec.fingerprint:
                problems.append(f"made for base {fp[:12]}, but this engine's base is {spec.fingerprint[:12]}")
    for key, t in state.items():
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            problems.append(f"tensor {key!r} has {bad} non-finite value(s) (NaN or inf)")
    tensors = from_peft_state(state, spec.sites, rank, problems, spec.base_modules) if state and rank else {}
    if rank and not tensors and not problems:
        problems.append("no LoRA tensors found")
    if problems:
        raise AdapterError(label, where, problems)
    assert config_bytes is not None and weights_bytes is not None
    tensors = {k: (a.float(), b.float()) for k, (a, b) in tensors.items()}
    t1 = time.perf_counter()
    digest = digest_files(config_bytes, weights_bytes)
    t2 = time.perf_counter()
    return AdapterWeights(
        rank=int(rank),  # type: ignore[arg-type]
        alpha=float(alpha),  # type: ignore[arg-type]
        tensors=tensors,
        base_fingerprint=spec.fingerprint,
        base_name=config.get("base_model_name_or_path"),
        use_rslora=bool(config.get("use_rslora", False)),
        digest=digest,
        load_s={"validate": t1 - t0, "digest": t2 - t1},
    )
