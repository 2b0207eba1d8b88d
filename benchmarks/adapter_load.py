"""Adapter load: store-to-servable latency at ranks 1, 8 and 64, and the memory each resident adapter takes.

Setup: the 6-layer, 256-wide Llama of mixed_adapter_decode.py (random weights, float32 on CPU, vocab 4096) under
an engine with `--slots` device slots sized for the largest rank (64); LoRA on q,k,v,o, and, in a second engine
over a second copy of the base, on every linear of the decoder layers (q,k,v,o,gate,up,down; the `all_linear_`
figures). `--repeats` + 1 distinct random revisions per rank and target set are put in a local AdapterStore first.

One load, timed alone: from the revision's content address to a device slot, i.e. `AdapterStore.local_dir`
(read and verify the digest) + `Engine.load_adapter` (read, validate, digest, register) + the first
`WorkingSet.acquire` (write the slot). Then, untimed, the slot is released and the adapter unloaded. The
first revision of each rank is a warm-up; ranks and target sets are interleaved round-robin. The files were just
written, so they come from the page cache. With 30 repeats, p99 is close to the slowest load.

Figures, per rank r and target set:
  load_p50_ms_r<r>, load_p99_ms_r<r>   store-to-servable latency
  slot_write_p50_ms_r<r>               the part of it spent in acquire, writing the slot
  host_bytes_r<r>                      the revision in the host cache (its tensors at its own rank)
  disk_bytes_r<r>                      its two files in the store
  slot_bytes                           device bytes of one slot: what every resident adapter takes, whatever its
                                       rank, since slots are sized for the engine's max rank (equal to
                                       host_bytes at that rank)

    python benchmarks/adapter_load.py [--ranks 1,8,64] [--repeats 30] [--slots 8] [--no-all-linear]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report
from mixed_adapter_decode import TARGETS, build_model

from mint_core.engine.base import from_model
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter
from mint_core.lora.validate import read_adapter
from mint_core.registry.store import AdapterStore

ALL_LINEAR = [*TARGETS, "gate_proj", "up_proj", "down_proj"]


def measure(args: argparse.Namespace, ranks: list[int], store: AdapterStore) -> dict[str, float | int]:
    """Put the revisions in `store`, time their loads, print the table; returns the figures."""
    max_rank = max(ranks)
    target_sets = {"": TARGETS, **({"all_linear_": ALL_LINEAR} if args.all_linear else {})}
    engines: dict[str, Engine] = {}
    digests: dict[tuple[str, int], list[str]] = {}
    figures: dict[str, float | int] = {}
    for prefix, targets in target_sets.items():
        engine = engines[prefix] = Engine(
            from_model(build_model(0, args.vocab, "sdpa"), byte_tokenizer(), "bench-llama"),
            EngineConfig(max_loras=args.slots, max_lora_rank=max_rank, target_modules=targets),
        )
        figures[f"{prefix}slot_bytes"] = engine.lora.slot_bytes()
        for r in ranks:
            digests[prefix, r] = [
                store.put_weights(
                    random_adapter(
                        engine.sites, targets, r, seed=1000 * r + i, base_fingerprint=engine.base.fingerprint
                    ),
                    engine.sites,
                )
                for i in range(args.repeats + 1)
            ]
            path = store.local_dir(digests[prefix, r][0])
            figures[f"{prefix}host_bytes_r{r}"] = read_adapter(path, engine.spec).num_bytes()
            figures[f"{prefix}disk_bytes_r{r}"] = sum(f.stat().st_size for f in path.iterdir())

    def load(prefix: str, r: int, i: int) -> tuple[float, float]:
        """(seconds for the whole load, seconds of it spent in acquire writing the slot)"""
        engine, digest = engines[prefix], digests[prefix, r][i]
        name = f"r{r}-{i}"
        t0 = time.perf_counter()
        engine.load_adapter(name, store.local_dir(digest))
        t1 = time.perf_counter()
        slot = engine.working_set.acquire(name)
        t2 = time.perf_counter()
        engine.working_set.release(slot)
        engine.unload_adapter(name)
        return t2 - t0, t2 - t1

    times: dict[tuple[str, int], list[tuple[float, float]]] = {key: [] for key in digests}
    for i in range(args.repeats + 1):
        for prefix, r in digests:
            seconds = load(prefix, r, i)
            if i > 0:
                times[prefix, r].append(seconds)

    print(
        f"threads={torch.get_num_threads()} slots={args.slots} max_lora_rank={max_rank} repeats={args.repeats} "
        f"(one revision per load, ranks interleaved)"
    )
    for prefix, targets in target_sets.items():
        print(f"  LoRA on {','.join(targets)}: slot {figures[f'{prefix}slot_bytes'] / 2**20:.2f} MiB")
        for r in ranks:
            ms = np.asarray(times[prefix, r]) * 1e3
            p50, p99 = float(np.percentile(ms[:, 0], 50)), float(np.percentile(ms[:, 0], 99))
            write_p50 = float(np.percentile(ms[:, 1], 50))
            figures[f"{prefix}load_p50_ms_r{r}"] = round(p50, 3)
            figures[f"{prefix}load_p99_ms_r{r}"] = round(p99, 3)
            figures[f"{prefix}slot_write_p50_ms_r{r}"] = round(write_p50, 3)
            print(
                f"    rank {r:3d}  load p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  (slot write p50 {write_p50:5.2f} ms)  "
                f"host {figures[f'{prefix}host_bytes_r{r}'] / 2**20:6.3f} MiB  "
                f"disk {figures[f'{prefix}disk_bytes_r{r}'] / 2**20:6.3f} MiB"
            )
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,8,64", help="comma-separated; slots are sized for the largest")
    ap.add_argument("--repeats", type=int, default=30, help="timed loads per rank (distinct revisions)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--all-linear", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ranks = [int(r) for r in args.ranks.split(",")]

    with tempfile.TemporaryDirectory(prefix="mint-bench-load-") as tmp:
        figures = measure(args, ranks, AdapterStore(Path(tmp)))
    report({**figures, "max_lora_rank": max(ranks), "repeats": args.repeats})


if __name__ == "__main__":
    main()
