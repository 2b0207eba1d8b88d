"""Validate an adapter directory before anything changes state, collecting every problem into one error.

Checked, in order, without ever unpickling: the path is inside an allowed root; the config is PEFT LoRA with
supported options; the weights are safetensors (a `.bin`/`.pt` is refused unread); the safetensors header is
sane (length, JSON, dtypes, offsets inside the file); every tensor is finite; the rank fits the engine; the
base fingerprint matches; each key names a module of the base with matching shapes.
"""

from __future__ import annotations

import json
import math
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from mint_core.errors import AdapterError
from mint_core.lora import hostmem
from mint_core.lora.adapter import (
    CONFIG_FILE,
    DTYPE_KEY,
    DTYPE_NAMES,
    FINGERPRINT_KEY,
    WEIGHTS_FILE,
    AdapterWeights,
    digest_files,
    from_peft_state,
)
from mint_core.types import Digest, Site

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
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHUNK = 1 << 20  # bytes read (and hashed while still in cache) at a time
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


class _Entry(NamedTuple):
    """One tensor of a safetensors header, its byte range relative to the start of the data (a named tuple: a
    header has hundreds, and a frozen dataclass is several times slower to make)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class _Header:
    """A parsed safetensors header: where the data starts, its tensors (only those whose entry is sane) and
    metadata."""

    data_start: int
    entries: list[_Entry]
    metadata: dict[str, str]


def _parse_header(data: bytes | bytearray | memoryview) -> tuple[_Header | None, list[str]]:
    """The header of a safetensors file and the problems with its framing, found without reading any tensor."""
    if len(data) < 8:
        return None, [f"{WEIGHTS_FILE} is truncated ({len(data)} bytes; no header length)"]
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or n > len(data) - 8:
        return None, [
            f"{WEIGHTS_FILE} header length {n} exceeds the file ({len(data)} bytes): truncated or not safetensors"
        ]
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [
            f"{WEIGHTS_FILE} header is not valid JSON ({e.__class__.__name__}): garbage or not safetensors"
        ]
    if not isinstance(header, dict):
        return None, [f"{WEIGHTS_FILE} header is not a JSON object"]
    problems = []
    beyond: list[str] = []
    body = len(data) - 8 - n
    entries: list[_Entry] = []
    metadata: dict[str, str] = {}
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                problems.append(f"{WEIGHTS_FILE} __metadata__ is not an object of strings")
            else:
                metadata = info
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise TypeError(key)
            numel = math.prod(shape)
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
        elif end <= body and begin >= 0:
            entries.append(_Entry(key, dtype, tuple(shape), begin, end))
        if end > body or begin < 0:
            beyond.append(key)
    if beyond:
        problems.append(
            f"{WEIGHTS_FILE} is truncated: {len(beyond)} tensor(s) end beyond its {body} data bytes "
            f"(first: {beyond[0]!r})"
        )
    if not problems:
        # safetensors' own rule: the tensors tile the data exactly, in order, with no gap or overlap
        at = 0
        for ent in sorted(entries, key=lambda x: (x.begin, x.end)):
            if ent.begin != at:
                problems.append(
                    f"tensor {ent.key!r}: data starts at byte {ent.begin}, expected {at} (tensors overlap or leave "
                    "a gap): not a valid safetensors file"
                )
                break
            at = ent.end
        else:
            if at != body:
                problems.append(f"{WEIGHTS_FILE} has {body - at} bytes after its last tensor")
    return _Header(8 + n, entries, metadata), problems


def recorded_base(path: str | Path) -> tuple[str | None, str | None]:
    """The base an adapter directory says it was made for: (its config's `base_model_name_or_path`, the base
    fingerprint mint's exporter writes into the safetensors header), each None where it records none or cannot
    be read. Reads the config and the header only, so it is cheap beside `read_adapter`, which is what refuses a
    recorded fingerprint that is not the base's; the name is PEFT's free text (often a path on the machine that
    trained it) and proves nothing either way."""
    path = Path(path)
    name = fingerprint = None
    try:
        config = json.loads((path / CONFIG_FILE).read_bytes())
        if isinstance(config, dict) and isinstance(config.get("base_model_name_or_path"), str):
            name = config["base_model_name_or_path"] or None
    except (OSError, ValueError):
        pass
    try:
        with open(path / WEIGHTS_FILE, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if n <= MAX_HEADER_BYTES else {}
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        if isinstance(meta, dict) and isinstance(meta.get(FINGERPRINT_KEY), str):
            fingerprint = meta[FINGERPRINT_KEY]
    except (OSError, ValueError, struct.error):
        pass
    return name, fingerprint


def _tensor(data: memoryview, start: int, e: _Entry) -> torch.Tensor:
    """The tensor of entry `e`, a view of `data` (a copy when its bytes are not aligned for its dtype)."""
    dtype, size = _TORCH_DTYPES[e.dtype], _DTYPE_BYTES[e.dtype]
    numel = (e.end - e.begin) // size
    if numel == 0:
        return torch.empty(e.shape, dtype=dtype)
    offset = start + e.begin
    if offset % size:
        return torch.frombuffer(bytearray(data[offset : offset + e.end - e.begin]), dtype=dtype).view(e.shape)
    return torch.frombuffer(data, dtype=dtype, count=numel, offset=offset).view(e.shape)


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite: its min and max are, since both propagate NaN (one pass, no
    temporary; `isfinite(t).all()` writes a bool per value, 18x slower on bfloat16 on CPU)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def nonfinite_sites(tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """The sites of in-memory LoRA factors (a trainer's handoff) that hold NaN or inf: one max-abs pass over all
    the tensors in a single call (`_foreach_norm` with ord inf, as `clip_grad_norm_` does; NaN propagates
    through a max), and only if that finds one, a look at each site for the names."""
    flat = [t.detach() for pair in tensors.values() for t in pair if t.numel()]
    if not flat or bool(
        torch.stack([n.float().cpu() for n in torch._foreach_norm(flat, math.inf)]).isfinite().all()
    ):
        return []
    return [site for site, (A, B) in tensors.items() if not (_all_finite(A) and _all_finite(B))]


def _views(
    data: memoryview, header: _Header
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, list[_Entry]]]]:
    """Every tensor of the header as a view of `data`, and the runs of adjacent tensors of one dtype, each as one
    flat tensor over its bytes (the whole data of a single-dtype file is one run). A tensor is a strided view of
    its run's tensor: one call each, where a buffer view of its own and a reshape are two."""
    runs: list[list[_Entry]] = []
    for e in sorted(header.entries, key=lambda e: e.begin):
        if runs and runs[-1][-1].dtype == e.dtype and runs[-1][-1].end == e.begin:
            runs[-1].append(e)
        else:
            runs.append([e])
    views: dict[str, torch.Tensor] = {}
    flat_runs = []
    for run in runs:
        begin, end, dtype = run[0].begin, run[-1].end, run[0].dtype
        size = _DTYPE_BYTES[dtype]
        flat = _tensor(data, header.data_start, _Entry("", dtype, ((end - begin) // size,), begin, end))
        at = flat.storage_offset()
        for e in run:
            if e.end == e.begin:
                views[e.key] = torch.empty(e.shape, dtype=flat.dtype)
            else:
                views[e.key] = flat.as_strided(e.shape, _strides(e.shape), at + (e.begin - begin) // size)
        flat_runs.append((flat, run))
    return {e.key: views[e.key] for e in header.entries}, flat_runs


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def _nonfinite(runs: list[tuple[torch.Tensor, list[_Entry]]], tensors: dict[str, torch.Tensor]) -> list[str]:
    """Problems naming each tensor with NaN or inf. Checked over runs of adjacent tensors of one dtype at
    once (`_views`), so a file of 500 tensors costs a few calls; a run that is not all finite is then searched
    tensor by tensor for the names."""
    problems = []
    for flat, run in runs:
        if _all_finite(flat):
            continue
        for e in run:
            t = tensors[e.key]
            if not _all_finite(t):
                bad = int((~torch.isfinite(t)).sum())
                problems.append(f"tensor {e.key!r} has {bad} non-finite value(s) (NaN or inf)")
    return problems


Prepare = Callable[
    [dict[str, tuple[torch.Tensor, torch.Tensor]], float], dict[str, tuple[torch.Tensor, torch.Tensor]]
]


def read_adapter(
    path: str | Path,
    spec: BaseSpec,
    name: str | None = None,
    allowed_roots: list[Path] | None = None,
    prepare: Prepare | None = None,
) -> AdapterWeights:
    """Read and validate one adapter directory; raise a single AdapterError listing every problem.

    `prepare` (an engine's `LoRAModel.prepare`) is run on the tensors once they pass every check, while the
    digest is still being hashed, into `AdapterWeights.prepared`."""
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
    weights_bytes: memoryview | None = None
    hashing: _Hashing | None = None
    if not weights.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            problems.append(
                f"weights only in pickle format {pickles}; refused without loading (use safetensors)"
            )
        else:
            problems.append(f"{WEIGHTS_FILE} is missing")
    else:
        weights_bytes, hashing = _read_hashed(weights, config_bytes)
    read_s = time.perf_counter() - t0
    digest = None if hashing is None else hashing.finish()
    out = validate_bytes(
        config_bytes, weights_bytes, spec, label, str(path), problems, digest=digest, prepare=prepare
    )
    out.load_s["read"] = read_s
    if hashing is not None:
        out.load_s["digest"] = hashing.busy_s
    return out


class _Hashing:
    """The revision's digest, hashed on a thread of its own from the pieces of the weights file as they are read,
    so that hashing overlaps the rest of the read and the validation (sha256 releases the GIL) instead of
    following them. `result()` waits for it; `busy_s` is the time spent hashing. The threads are kept between
    loads (`_HashWorkers`)."""

    def __init__(self, config_bytes: bytes, weights_size: int):
        self._h = Digest.hasher(config_bytes, weights_size)
        self._pieces: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._done: Future[Digest] = Future()
        self.busy_s = 0.0
        _HASH_WORKERS.submit(self)

    def feed(self, piece: memoryview) -> None:
        self._pieces.put(piece)

    def finish(self) -> Future[Digest]:
        self._pieces.put(None)
        return self._done

    def run(self) -> None:
        try:
            while (piece := self._pieces.get()) is not None:
                t = time.perf_counter()
                self._h.update(piece)
                self.busy_s += time.perf_counter() - t
            self._done.set_result(Digest.trusted(self._h.hexdigest()))
        except BaseException as e:  # reported to whoever waits for the digest
            self._done.set_exception(e)


class _HashWorkers:
    """Daemon threads that run `_Hashing`s, one each at a time, started only when none is idle. A thread start
    waits for the new thread to be scheduled: ~0.1 ms on an idle machine, but ~4 ms with every core busy, and
    it held up every load's read. Daemons, so that a hash that never gets its last piece cannot hold up exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Hashing] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, job: _Hashing) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._work, name="mint-digest", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._jobs.get().run()
            with self._lock:
                self._idle += 1


_HASH_WORKERS = _HashWorkers()


def _read_hashed(path: Path, config_bytes: bytes | None) -> tuple[memoryview, _Hashing | None]:
    """The file's bytes in writable memory of their own (`hostmem`: tensors view it without a copy; not
    zero-filled first, since the read overwrites every byte), and the revision's digest being hashed from them as
    they arrive (None without a config to hash first, or when the file changed size while it was read)."""
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        data = hostmem.take(size).data
        hashing = None if config_bytes is None else _Hashing(config_bytes, size)
        at = 0
        try:
            while at < size:
                n = f.readinto(data[at : at + _CHUNK])
                if not n:
                    break
                if hashing is not None:
                    hashing.feed(data[at : at + n])
                at += n
            whole = at == size and not f.read(1)
        finally:
            if hashing is not None:  # also when the read failed, so that its hashing thread is free again
                hashing.finish()
    if whole:
        return data, hashing
    # written to while we read: take it whole as it is now; the caller's digest covers those bytes
    return memoryview(bytearray(path.read_bytes())), None


def validate_bytes(
    config_bytes: bytes | None,
    weights_bytes: bytes | bytearray | memoryview | None,
    spec: BaseSpec,
    label: str,
    where: str | None = None,
    problems: list[str] | None = None,
    digest: Digest | Future[Digest] | None = None,
    prepare: Prepare | None = None,
) -> AdapterWeights:
    """Validate an adapter given as PEFT's two files' bytes (None: the file is missing, already reported in
    `problems`); raise a single AdapterError listing every problem.

    The tensors returned are views of `weights_bytes` in the file's dtype when it is writable memory (immutable
    `bytes` are copied once first). `digest`, when the caller hashes the files while reading them (a future:
    still being hashed, waited for once the checks pass), is taken as theirs; otherwise it is computed here."""
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
        named = config.get(DTYPE_KEY)
        if named is not None and named not in DTYPE_NAMES.values():
            problems.append(f"{DTYPE_KEY} is {named!r}, expected one of {sorted(DTYPE_NAMES.values())}")

    state: dict[str, torch.Tensor] = {}
    if weights_bytes is not None:
        data = memoryview(weights_bytes)
        if data.readonly:
            data = memoryview(bytearray(data))
        header, header_problems = _parse_header(data)
        problems += header_problems
        if header is not None and not header_problems:
            state, runs = _views(data, header)
            fp = header.metadata.get(FINGERPRINT_KEY)
            if fp is not None and fp != spec.fingerprint:
                problems.append(f"made for base {fp[:12]}, but this engine's base is {spec.fingerprint[:12]}")
            problems += _nonfinite(runs, state)
            named = config.get(DTYPE_KEY)
            dtypes = sorted({DTYPE_NAMES[t.dtype] for t in state.values()})
            if isinstance(named, str) and named in DTYPE_NAMES.values() and dtypes and dtypes != [named]:
                problems.append(f"{CONFIG_FILE} names {DTYPE_KEY} {named!r}, but the tensors are {dtypes}")
    tensors = from_peft_state(state, spec.sites, rank, problems, spec.base_modules) if state and rank else {}
    if rank and not tensors and not problems:
        problems.append("no LoRA tensors found")
    if problems:
        raise AdapterError(label, where, problems)
    assert config_bytes is not None and weights_bytes is not None
    t1 = time.perf_counter()
    load_s = {"validate": t1 - t0}
    out = AdapterWeights(
        rank=int(rank),  # type: ignore[arg-type]
        alpha=float(alpha),  # type: ignore[arg-type]
        tensors=tensors,
        base_fingerprint=spec.fingerprint,
        base_name=config.get("base_model_name_or_path"),
        use_rslora=bool(config.get("use_rslora", False)),
        load_s=load_s,
    )
    if prepare is not None:
        out.prepared = prepare(out.tensors, out.scale)
        load_s["prepare"] = time.perf_counter() - t1
        t1 = time.perf_counter()
    if isinstance(digest, Future):
        out.digest = digest.result()
        load_s["digest_wait"] = time.perf_counter() - t1
    elif digest is None:
        out.digest = digest_files(config_bytes, weights_bytes)
        load_s["digest"] = time.perf_counter() - t1
    else:
        out.digest = digest
    return out
