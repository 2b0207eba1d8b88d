"""Adapter load: store-to-servable latency, its split into steps, and the memory each resident adapter takes.

Two setups:
- `--shape tiny` (default): the 6-layer, 256-wide Llama of mixed_adapter_decode.py (random weights, float32,
  vocab 4096) under an engine with `--slots` device slots sized for the largest rank (default ranks 1, 8, 64);
  LoRA on q,k,v,o, and, in a second engine over a second copy of the base, on every linear of the decoder layers
  (q,k,v,o,gate,up,down; the `all_linear_` figures).
- `--shape qwen2-0.5b | qwen3-4b`: the LoRA sites of that base (every linear of the decoder layers) without
  the base's weights: the model is built on the meta device for its shapes, and only the slot banks
  (`layers.slot_banks`) and a working set over them are real, in `--dtype` (default bfloat16) on `--device`.
  Default rank 8: at the Qwen3-4B shape, 252 linears, 504 tensors, 33 MB of LoRA factors in bf16.
`--repeats` + 1 distinct random revisions per rank and target set, in `--dtype`, are put in a local AdapterStore
first (the first of each is a warm-up).

One load, timed alone: from the revision's content address to a device slot, the steps of the server's load
path, `Engine.read_adapter` then `WorkingSet.add` and the first `WorkingSet.acquire`:
  store        `AdapterStore.path`: the revision's directory (the read verifies the digest against the content
               address, as `AdapterManager` does for a catalog load, so the bytes are hashed once, not once more
               by a verifying `AdapterStore.local_dir`)
  read         the two files into memory
  validate     config, header, finiteness, shapes
  prepare      the tensors into slot layout for the host cache, one buffer filled by a few grouped copies (while
               the digest is still being hashed)
  digest_wait  the wait for the digest after that; `digest` is the time the hashing took on its own thread,
               from the first piece read on, so it overlaps read, validate and prepare
  register     `WorkingSet.add`
  slot_write   the first `WorkingSet.acquire`: the copy into a slot (one copy for a revision of the max rank over
               every site, since a slot is one contiguous buffer in the host cache's layout)
(`read_adapter`'s split is its `AdapterWeights.load_s`.) Then, untimed, the slot is released and the adapter
unloaded. Ranks and target sets are interleaved round-robin. The files were just written, so they come from the
page cache. With 30 repeats, p99 is close to the slowest load.

The floor, measured in the same run on the same bytes: what the issue budgets a load at, two passes over
the weights file's bytes (its read from the page cache into memory, and one copy of that size) plus one
sha256 pass; `floor_ratio_r<r>` = load p50 / floor.

Figures, per rank r and target set:
  load_p50_ms_r<r>, load_p99_ms_r<r>   store-to-servable latency
  <step>_p50_ms_r<r>                   its steps, as above
  floor_ms_r<r>, floor_ratio_r<r>      the floor above, and the load's p50 over it
  host_bytes_r<r>                      the revision in the host cache (its tensors at its own rank)
  disk_bytes_r<r>                      its two files in the store
  slot_bytes                           device bytes of one slot: what every resident adapter takes, whatever its
                                       rank, since slots are sized for the engine's max rank (equal to
                                       host_bytes at that rank in the slots' dtype)

    python benchmarks/adapter_load.py [--shape tiny|qwen2-0.5b|qwen3-4b] [--ranks 1,8,64] [--repeats 30]
                                      [--slots 8] [--dtype bfloat16] [--device cpu] [--no-all-linear]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Before torch starts OpenMP: its idle workers sleep instead of spinning, as `mint train` runs them. On
# a machine with more busy threads than cores, spinning workers stall each parallel copy at its barrier (p50
# swung between 70 ms and 2.3 s with two torch threads on two shared cores, when a load was ~750 small copies).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHAPES, report, shape_sites
from mixed_adapter_decode import TARGETS, build_model

from mint_core.engine.base import from_model
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.engine.working_set import WorkingSet
from mint_core.lora.adapter import AdapterWeights, random_adapter
from mint_core.lora.layers import slot_banks
from mint_core.lora.validate import BaseSpec, read_adapter
from mint_core.registry.store import AdapterStore
from mint_core.types import WEIGHTS_FILE, Site

ALL_LINEAR = [*TARGETS, "gate_proj", "up_proj", "down_proj"]
STEPS = ("store", "read", "validate", "prepare", "digest_wait", "register", "slot_write", "digest")


@dataclass
class Target:
    """What a load goes into: the sites, the spec adapters are checked against, and a working set."""

    sites: dict[str, Site]
    spec: BaseSpec
    working_set: WorkingSet
    slot_bytes: int


def tiny_target(args: argparse.Namespace, targets: list[str], max_rank: int, dtype: torch.dtype) -> Target:
    model = build_model(0, args.vocab, "sdpa").to(device=args.device, dtype=dtype)
    engine = Engine(
        from_model(model, byte_tokenizer(), "bench-llama"),
        EngineConfig(max_loras=args.slots, max_lora_rank=max_rank, target_modules=targets),
    )
    return Target(engine.sites, engine.spec, engine.working_set, engine.lora.slot_bytes())


def shape_target(args: argparse.Namespace, max_rank: int, dtype: torch.dtype) -> Target:
    """The working set of a real base's shape, with no base weights (see the module docstring)."""
    sites = shape_sites(args.shape)
    lora = slot_banks(sites.values(), args.slots, max_rank, dtype, args.device)
    spec = BaseSpec(f"meta-{args.shape}", sites, max_rank, frozenset(sites))
    return Target(sites, spec, WorkingSet(lora, 4 * args.slots), lora.slot_bytes())


def in_dtype(a: AdapterWeights, dtype: torch.dtype) -> AdapterWeights:
    a.tensors = {k: (A.to(dtype), B.to(dtype)) for k, (A, B) in a.tensors.items()}
    return a


def floor_s(path: Path, repeats: int) -> float:
    """Median seconds of the budget of one load of the weights file at `path`: its read into memory, one copy of
    that many bytes, one sha256 pass."""
    n = path.stat().st_size
    buf, dst = bytearray(n), torch.empty(n, dtype=torch.uint8)
    src = torch.frombuffer(buf, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        with path.open("rb", buffering=0) as f:
            f.readinto(buf)  # type: ignore[attr-defined]
        hashlib.sha256(buf).digest()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def measure(args: argparse.Namespace, ranks: list[int], store: AdapterStore) -> dict[str, float | int]:
    """Put the revisions in `store`, time their loads, print the table; returns the figures."""
    max_rank = max(ranks)
    dtype = getattr(torch, args.dtype)
    if args.shape == "tiny":
        target_sets = {"": TARGETS, **({"all_linear_": ALL_LINEAR} if args.all_linear else {})}
        sinks = {prefix: tiny_target(args, t, max_rank, dtype) for prefix, t in target_sets.items()}
    else:
        target_sets = {"": ALL_LINEAR}
        sinks = {"": shape_target(args, max_rank, dtype)}
    digests: dict[tuple[str, int], list[str]] = {}
    figures: dict[str, float | int] = {}
    for prefix, targets in target_sets.items():
        sink = sinks[prefix]
        figures[f"{prefix}slot_bytes"] = sink.slot_bytes
        for r in ranks:
            digests[prefix, r] = [
                store.put_weights(
                    in_dtype(
                        random_adapter(
                            sink.sites, targets, r, seed=1000 * r + i, base_fingerprint=sink.spec.fingerprint
                        ),
                        dtype,
                    ),
                    sink.sites,
                )
                for i in range(args.repeats + 1)
            ]
            path = store.local_dir(digests[prefix, r][0])
            figures[f"{prefix}host_bytes_r{r}"] = read_adapter(path, sink.spec).num_bytes()
            figures[f"{prefix}disk_bytes_r{r}"] = sum(f.stat().st_size for f in path.iterdir())
            figures[f"{prefix}floor_ms_r{r}"] = round(floor_s(path / WEIGHTS_FILE, 10) * 1e3, 3)

    def load(prefix: str, r: int, i: int) -> dict[str, float]:
        """Seconds of the whole load (`total`) and of each of its steps."""
        sink, digest = sinks[prefix], digests[prefix, r][i]
        ws = sink.working_set
        name = f"r{r}-{i}"
        t0 = time.perf_counter()
        path = Path(store.path(digest))  # the read below verifies the digest, as AdapterManager's does
        t1 = time.perf_counter()
        weights = read_adapter(path, sink.spec, name=name, prepare=ws.lora.prepare)  # as Engine.read_adapter
        if weights.digest != digest:
            raise RuntimeError(f"{name}: read {weights.digest}, the store names {digest}")
        t2 = time.perf_counter()
        ws.add(name, weights, source=path)
        t3 = time.perf_counter()
        slot = ws.acquire(name)
        t4 = time.perf_counter()
        ws.release(slot)
        ws.remove(name)
        steps = {"total": t4 - t0, "store": t1 - t0, "register": t3 - t2, "slot_write": t4 - t3}
        read_steps = ("read", "validate", "prepare", "digest_wait", "digest")
        return steps | {k: weights.load_s.get(k, 0.0) for k in read_steps}

    times: dict[tuple[str, int], list[dict[str, float]]] = {key: [] for key in digests}
    for i in range(args.repeats + 1):
        for prefix, r in digests:
            seconds = load(prefix, r, i)
            if i > 0:
                times[prefix, r].append(seconds)

    print(
        f"shape={args.shape} dtype={args.dtype} device={args.device} threads={torch.get_num_threads()} "
        f"slots={args.slots} max_lora_rank={max_rank} repeats={args.repeats} (one revision per load, ranks "
        "interleaved)"
    )
    for prefix, targets in target_sets.items():
        print(f"  LoRA on {','.join(targets)}: slot {figures[f'{prefix}slot_bytes'] / 2**20:.2f} MiB")
        for r in ranks:
            rows = times[prefix, r]

            def pct(key: str, q: float, rows: list[dict[str, float]] = rows) -> float:
                return float(np.percentile([row[key] * 1e3 for row in rows], q))

            p50, p99 = pct("total", 50), pct("total", 99)
            figures[f"{prefix}load_p50_ms_r{r}"] = round(p50, 3)
            figures[f"{prefix}load_p99_ms_r{r}"] = round(p99, 3)
            for step in STEPS:
                figures[f"{prefix}{step}_p50_ms_r{r}"] = round(pct(step, 50), 3)
            floor = figures[f"{prefix}floor_ms_r{r}"]
            figures[f"{prefix}floor_ratio_r{r}"] = round(p50 / floor, 2)
            split = " ".join(f"{step} {figures[f'{prefix}{step}_p50_ms_r{r}']:.2f}" for step in STEPS)
            print(
                f"    rank {r:3d}  load p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  (floor {floor:.2f} ms, "
                f"x{p50 / floor:.2f})  host {figures[f'{prefix}host_bytes_r{r}'] / 2**20:6.3f} MiB  "
                f"disk {figures[f'{prefix}disk_bytes_r{r}'] / 2**20:6.3f} MiB\n"
                f"              p50 split (ms): {split}"
            )
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    ap.add_argument(
        "--ranks",
        default=None,
        help="comma-separated; slots are sized for the largest (default 1,8,64; 8 for a shape)",
    )
    ap.add_argument("--repeats", type=int, default=30, help="timed loads per rank (distinct revisions)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096, help="tiny shape only")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default float32 tiny, bfloat16 a shape",
    )
    ap.add_argument("--device", default="cpu", help="where the slots live: cpu, cuda, cuda:1, ...")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument(
        "--all-linear", action=argparse.BooleanOptionalAction, default=True, help="tiny shape only"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.dtype is None:
        args.dtype = "float32" if args.shape == "tiny" else "bfloat16"
    ranks = [int(r) for r in (args.ranks or ("1,8,64" if args.shape == "tiny" else "8")).split(",")]

    with tempfile.TemporaryDirectory(prefix="mint-bench-load-") as tmp:
        figures = measure(args, ranks, AdapterStore(Path(tmp)))
    report(
        {
            **figures,
            "max_lora_rank": max(ranks),
            "repeats": args.repeats,
            "shape": args.shape,
            "dtype": args.dtype,
            "device": args.device,
        }
    )


if __name__ == "__main__":
    main()
