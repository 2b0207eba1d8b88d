"""MoE LoRA load: making a revision servable with packed expert tensors vs one tensor per expert.

Setup: a Qwen3-MoE-shaped base with random weights (64 experts, hidden 256, expert intermediate 128, 4 layers by
default), float32, LoRA slots on every expert projection (gate_up_proj and down_proj of each layer) at the adapter's
rank (8), on `--device` (CPU by default); one random rank-8 adapter on all of them, held in host memory.

Main figure, from host memory (a revision as it sits in the host cache, into a device slot the engine can run):
  packed      the layout mint keeps: one tensor per layer, projection and factor for all experts, held in the
              host cache already in slot layout (`LoRAModel.prepare`: A [E, r, in], B [E, r, out] with the scale
              folded in, done once when the revision is read, not timed), written by `LoRAModel.write_prepared`,
              the call `WorkingSet.acquire` makes on a miss
  per_expert  the layout PEFT's per-expert files and vLLM keep: one lora_A / lora_B per expert and projection
              (gate_proj, up_proj, down_proj), already parsed out of the state dict into per-expert tensors
              (parsing is not timed); each copied into its place in the slot (`A[slot, e] = ...`), after zeroing
              the slot once per bank (as vLLM's reset_lora does), with LoRA scaling folded into B once per bank
Both produce bit-identical slots (checked). speedup = per_expert_ms / packed_ms; target >= 10 (the published figure
for packed MoE LoRA tensors is 8.5-8.7x).

Secondary, from the store (content address -> servable): `AdapterStore.local_dir` + `Engine.load_adapter`
(read_adapter: read, validate, digest) + the first `acquire` into a slot, for the same weights saved in each layout;
mint packs the per-expert layout on read. disk_speedup = disk_unpacked_ms / disk_packed_ms. The files were just
written, so they are read from the page cache.

Figures: speedup, packed_ms, per_expert_ms (per revision); disk_speedup, disk_packed_ms, disk_unpacked_ms;
packed_copies and per_expert_copies (tensor copies into the slot per revision: 2 per layer and projection, vs 5
per layer and expert: the shared gate/up A, gate B, up B, down A, down B); revision_bytes. Timings are medians over
`--rounds` (`--disk-rounds`), the variants interleaved round-robin.

    python benchmarks/moe_packed_load.py [--experts 64] [--layers 4] [--rank 8] [--rounds 50] [--device cpu]
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, interleaved, report

from mint_core.engine.base import build_tiny_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import PREFIX, AdapterWeights, random_adapter, to_peft_state
from mint_core.lora.layers import LoRAModel
from mint_core.registry.store import AdapterStore

TARGETS = ["gate_up_proj", "down_proj"]

# One bank's share of a per-expert revision: (expert, A [r, in], [(column offset in the fused output, B [out, r])]).
ExpertTensors = list[tuple[int, torch.Tensor, list[tuple[int, torch.Tensor]]]]


def per_expert_host(state: dict[str, torch.Tensor], lora: LoRAModel) -> dict[str, ExpertTensors]:
    """The per-expert PEFT state dict parsed into per-site, per-expert tensors (what a host cache without packing
    holds). gate_proj and up_proj share A in the fused gate_up_proj, so A is taken once, from gate_proj."""
    host: dict[str, ExpertTensors] = {}
    for name, bank in lora.banks.items():
        site = bank.site
        mod = f"{PREFIX}{site.module_path}"
        experts: ExpertTensors = []
        for e in range(site.experts):
            if site.short == "gate_up_proj":
                gate_B = state[f"{mod}.{e}.gate_proj.lora_B.weight"]
                up_B = state[f"{mod}.{e}.up_proj.lora_B.weight"]
                A = state[f"{mod}.{e}.gate_proj.lora_A.weight"]
                experts.append((e, A, [(0, gate_B), (gate_B.shape[0], up_B)]))
            else:
                A = state[f"{mod}.{e}.down_proj.lora_A.weight"]
                experts.append((e, A, [(0, state[f"{mod}.{e}.down_proj.lora_B.weight"])]))
        host[name] = experts
    return host


@torch.no_grad()
def write_per_expert(lora: LoRAModel, slot: int, host: dict[str, ExpertTensors], scale: float) -> None:
    """One copy per expert tensor into the slot (the bank's `filled` bookkeeping is left out: no forward runs)."""
    for name, experts in host.items():
        bank = lora.banks[name]
        A_ERI, B_ERO = bank.A[slot], bank.B[slot]
        A_ERI.zero_()
        B_ERO.zero_()
        for e, A, Bs in experts:
            r = A.shape[0]
            A_ERI[e, :r].copy_(A)
            for offset, B in Bs:
                B_ERO[e, :r, offset : offset + B.shape[0]].copy_(B.T)
        B_ERO.mul_(scale)


def timed(fns: dict[str, Callable[[], None]], rounds: int, after: Callable[[str], None]) -> dict[str, float]:
    """Median seconds of each function, round-robin; `after(name)` runs untimed after each call (cleanup)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            after(k)
    return {k: statistics.median(v) for k, v in times.items()}


def store_to_servable(
    engine: Engine, weights: AdapterWeights, store: AdapterStore, rounds: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median seconds from a content address to a filled slot, for `weights` stored in each layout."""
    digests = {layout: store.put_weights(weights, engine.sites, layout) for layout in ("packed", "unpacked")}
    held: dict[str, int] = {}

    def load(layout: str) -> None:
        engine.load_adapter(layout, store.local_dir(digests[layout]))
        held[layout] = engine.working_set.acquire(layout)
        sync()

    def unload(layout: str) -> None:
        engine.working_set.release(held.pop(layout))
        engine.unload_adapter(layout)

    return timed({layout: functools.partial(load, layout) for layout in digests}, rounds, after=unload)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=50, help="host-memory timings per variant")
    ap.add_argument("--disk-rounds", type=int, default=15, help="store-to-servable timings per layout")
    add_device(ap)  # the base and the slots; the revision stays in host memory
    args = ap.parse_args()
    device = torch.device(checked_device(ap, args.device))
    logging.basicConfig(level=logging.WARNING)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    base = build_tiny_base(
        "moe",
        tokenizer=byte_tokenizer(),
        num_experts=args.experts,
        num_experts_per_tok=min(8, args.experts),
        hidden_size=args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        head_dim=args.hidden // 4,
        device=args.device,
    )
    engine = Engine(
        base, EngineConfig(max_loras=2, max_lora_rank=args.rank, target_modules=TARGETS, max_model_len=64)
    )
    lora = engine.lora
    weights = random_adapter(engine.sites, TARGETS, args.rank, seed=0, base_fingerprint=base.fingerprint)
    unpacked = to_peft_state(weights.tensors, engine.sites, "unpacked")
    host = per_expert_host(unpacked, lora)
    copies = sum(1 + len(Bs) for experts in host.values() for _, _, Bs in experts)

    prepared = lora.prepare(weights.tensors, weights.scale)  # what the host cache holds (not timed)

    def packed() -> None:
        lora.write_prepared(0, prepared)
        sync()

    def per_expert() -> None:
        write_per_expert(lora, 1, host, weights.scale)
        sync()

    packed()
    per_expert()
    for bank in lora.banks.values():  # the same slot contents, so the same work was done
        assert torch.equal(bank.A[0], bank.A[1]) and torch.equal(bank.B[0], bank.B[1]), bank.site.name
    lora.clear_slot(0)
    lora.clear_slot(1)  # the working set owns the slots from here
    t = interleaved({"packed": packed, "per_expert": per_expert}, rounds=args.rounds)
    lora.clear_slot(0)
    lora.clear_slot(1)

    with tempfile.TemporaryDirectory(prefix="mint-bench-moe-") as tmp:
        disk = store_to_servable(engine, weights, AdapterStore(Path(tmp)), args.disk_rounds, sync)

    ms = {k: v * 1e3 for k, v in t.items()}
    disk_ms = {k: v * 1e3 for k, v in disk.items()}
    host_bytes = weights.num_bytes()
    print(
        f"threads={torch.get_num_threads()} device={device} experts={args.experts} layers={args.layers} "
        f"hidden={args.hidden} moe_intermediate={args.moe_intermediate} rank={args.rank} "
        f"revision={host_bytes / 2**20:.1f} MiB (medians, interleaved)"
    )
    print(f"  from host memory ({args.rounds} rounds)")
    print(f"    packed      {ms['packed']:8.2f} ms/revision  ({2 * len(lora.banks)} copies)")
    print(f"    per_expert  {ms['per_expert']:8.2f} ms/revision  ({copies} copies)")
    print(f"    speedup     {ms['per_expert'] / ms['packed']:8.2f}x")
    print(f"  from the store ({args.disk_rounds} rounds)")
    print(f"    packed      {disk_ms['packed']:8.2f} ms/revision")
    print(f"    unpacked    {disk_ms['unpacked']:8.2f} ms/revision  ({len(unpacked)} tensors in the file)")
    print(f"    speedup     {disk_ms['unpacked'] / disk_ms['packed']:8.2f}x")
    report(
        {
            "speedup": round(ms["per_expert"] / ms["packed"], 2),
            "packed_ms": round(ms["packed"], 3),
            "per_expert_ms": round(ms["per_expert"], 3),
            "disk_speedup": round(disk_ms["unpacked"] / disk_ms["packed"], 2),
            "disk_packed_ms": round(disk_ms["packed"], 3),
            "disk_unpacked_ms": round(disk_ms["unpacked"], 3),
            "packed_copies": 2 * len(lora.banks),
            "per_expert_copies": copies,
            "revision_bytes": host_bytes,
            "experts": args.experts,
            "layers": args.layers,
            "rank": args.rank,
            "device": str(device),
        }
    )


if __name__ == "__main__":
    main()
