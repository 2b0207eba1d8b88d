"""A million addressable adapters behind a small working set: register, resolve, sweep, Zipf stream.

Setup: the built-in base (`data/base`, after `dvc repro`; a random base of the same shape otherwise, said in
`notes`). N rank-1 revisions of it (LoRA on q_proj and v_proj of every layer, bfloat16) are written into packs of
4,096 (`mint_core.registry.packs`: one safetensors file per pack, each member still its own revision with its
own digest) and registered in a fresh SQLite catalog as `t<i>/v1` (one tenant policy each) in one bulk call.

Phases, each timed:
  resolve   `--resolves` random addresses, half `t<i>/v1`, half `sha256:<hex>`, each `Catalog.resolve` timed alone
  sweep     ONE engine (1,024 device slots, host cache 4,096) made every one of the N servable once: the loader
            resolves the addresses (in bulk), reads the members from their packs, checks each against the base
            and its recorded checksum, and adds them; then a device slot is taken and released for each. Loads
            run on the loader's threads one `--window` ahead.
  zipf      after `--warmup` untimed ones, `--requests` generation requests (4 new tokens, greedy, `--batch` at
            a time) whose adapters follow Zipf(1.0) over all N, with the next batch's cold loads prefetched (in
            bulk) while the current batch generates; against the same stream shape over 100 adapters that all
            stay resident (pinned), in the same engine configuration. zipf_vs_resident = requests/s ratio.
            Each request has its own prompt (the "add" task's, 8 to 12 tokens), the same list in both streams:
            with one shared prompt the engine would prefill each (adapter, prompt) pair once per batch, which
            favours the resident stream (100 adapters repeat far more within a batch than a million).

Figures: adapters, register_s, resolve_p50_ms, resolve_p99_ms, sweep_covered (must equal N), sweep_s,
cold_load_p50_ms, cold_load_p99_ms (`--cold` single cold loads of non-resident addresses, one at a time:
resolve + read + check + add + into a device slot), zipf_rps,
resident_rps, zipf_vs_resident, zipf_hit_rate, disk_bytes (packs + catalog), peak_rss_bytes.

    python benchmarks/catalog_scale.py --adapters 1000000 [--out DIR] [--device cpu]

`--device` (cpu by default) is where the base and the engine's slots are: on cuda a load's last step, into a
slot, is a host-to-GPU copy.

`--out DIR` keeps the packs and the catalog; a later run with `--reuse` over the same N starts from them (no
build; `register_s` and `build_s` are then null), and `--no-sweep` leaves the sweep out (its keys null), for
measuring the other phases again without the 20 minutes of a million-adapter build and sweep.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, peak_rss_bytes, report

from mint_core.data.generators import split
from mint_core.engine.base import build_tiny_base, load_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.loader import AdapterManager
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.sequence import Request
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import AdapterWeights
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.catalog_schema import Registration
from mint_core.registry.packs import write_pack
from mint_core.registry.store import AdapterStore
from mint_core.types import Site

PACK = 4096
TARGETS = ("q_proj", "v_proj")


def percentile_ms(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs), q)) * 1e3, 3)


def zipf_indices(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Zipf(1.0) over 0..n-1 (rank 0 the most popular), by inverse CDF."""
    weights = 1.0 / np.arange(1, n + 1)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return np.searchsorted(cdf, rng.random(size))


def load_builtin(notes: list[str], device: str = "cpu"):  # type: ignore[no-untyped-def]
    path = Path("data/base")
    if (path / "config.json").is_file():
        return load_base(path, device=device)
    notes.append("data/base not built (run `dvc repro`): a random base of the built-in base's shape")
    return build_tiny_base(
        "dense",
        tokenizer=byte_tokenizer(),
        device=device,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=384,
        max_position_embeddings=128,
    )


def _write_pack(job: tuple[int, int, str, dict, str, str]) -> list[str]:
    """One pack of random rank-1 members (seeded by its index, so reruns write the same bytes)."""
    start, m, path, site_shapes, fp, _ = job
    sites = {name: Site(name, i, o) for name, (i, o) in site_shapes.items()}
    g = torch.Generator().manual_seed(start)
    stacked = {
        name: (
            (torch.randn(m, 1, i, generator=g) * 0.05).to(torch.bfloat16),
            (torch.randn(m, o, 1, generator=g) * 0.05).to(torch.bfloat16),
        )
        for name, (i, o) in site_shapes.items()
    }
    members = [
        AdapterWeights(1, 2.0, {n: (A[j], B[j]) for n, (A, B) in stacked.items()}, fp) for j in range(m)
    ]
    return write_pack(path, members, sites)


def build(n: int, engine: Engine, out: Path, catalog: Catalog, workers: int) -> float:
    """Write N members into packs (`workers` processes) and register them; returns the registration time."""
    shapes = {k: (s.in_features, s.out_features) for k, s in engine.sites.items() if s.short in TARGETS}
    fp = engine.base.fingerprint
    (out / "packs").mkdir(parents=True, exist_ok=True)
    jobs = [
        (start, min(PACK, n - start), str(out / "packs" / f"{start // PACK:06d}.safetensors"), shapes, fp, "")
        for start in range(0, n, PACK)
    ]
    rows: list[Registration] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        done = pool.map(_write_pack, jobs)
        for (start, _, path, _, _, _), digests in tqdm(
            zip(jobs, done, strict=True), total=len(jobs), desc="packs", unit="pack", file=sys.stderr
        ):
            rows.extend(
                Registration(d, fp, 1, f"{path}#{j}", policy=f"t{start + j}") for j, d in enumerate(digests)
            )
    t0 = time.perf_counter()
    catalog.register_many(rows)
    return time.perf_counter() - t0


def resolve_latencies(catalog: Catalog, n: int, k: int, rng: random.Random) -> list[float]:
    digests = {e.policy: e.digest for e in catalog.list(limit=min(n, 2000))}
    sample = list(digests.values())
    out = []
    for i in range(k):
        addr = f"t{rng.randrange(n)}/v1" if i % 2 == 0 or not sample else rng.choice(sample).prefixed
        t0 = time.perf_counter()
        catalog.resolve(addr)
        out.append(time.perf_counter() - t0)
    return out


def sweep(loader: AdapterManager, n: int, window: int) -> int:
    """Every address made servable once: bulk prefetches of `window` addresses run on the loader's threads while
    the previous window's revisions are put into device slots."""
    ws = loader.engine.working_set
    covered = 0
    bar = tqdm(total=n, desc="sweep", unit="adapter", file=sys.stderr, mininterval=2.0)

    def ask(lo: int) -> list:  # type: ignore[type-arg]
        return (
            loader.prefetch([f"t{i}/v1" for i in range(lo, min(lo + window, n))], hold=True) if lo < n else []
        )

    ahead = ask(0)
    for lo in range(0, n, window):
        current, ahead = ahead, ask(lo + window)
        for f in current:
            name = f.result()
            try:
                ws.release(ws.acquire(name))  # into a device slot: servable
            finally:
                ws.unhold(name)
            covered += 1
        bar.update(len(current))
    bar.close()
    return covered


def stream(
    engine: Engine, loader: AdapterManager | None, addresses: list[str], batch: int, prompts: list[list[int]]
) -> float:
    """Requests/s of generating for `addresses` (request i with prompts[i % len(prompts)]) in batches; with a
    loader, the next batch is prefetched."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    batches = [addresses[i : i + batch] for i in range(0, len(addresses), batch)]
    ws = engine.working_set

    def hold(b: list[str]):  # type: ignore[no-untyped-def]
        return loader.prefetch(b, hold=True) if loader is not None else []

    t0 = time.perf_counter()
    ahead = hold(batches[0])
    for k, b in enumerate(batches):
        names = [f.result() for f in ahead]
        ahead = hold(batches[k + 1]) if k + 1 < len(batches) else []
        try:
            first = k * batch
            engine.generate(
                [Request(prompts[(first + j) % len(prompts)], a, params) for j, a in enumerate(b)]
            )
        finally:
            for name in names:
                ws.unhold(name)
    return len(addresses) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=10_000)
    ap.add_argument("--resolves", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--cold", type=int, default=500, help="single cold loads timed one at a time")
    ap.add_argument("--warmup", type=int, default=4096, help="untimed requests of the Zipf stream first")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--host-cache", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512, help="addresses per bulk prefetch during the sweep")
    ap.add_argument("--workers", type=int, default=2, help="loader threads")
    ap.add_argument("--build-workers", type=int, default=os.cpu_count() or 1, help="processes writing packs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps shared cores steady)")
    ap.add_argument(
        "--out", type=Path, default=None, help="where packs and the catalog go (default: a temp dir)"
    )
    ap.add_argument("--keep", action="store_true", help="keep --out afterwards")
    ap.add_argument("--reuse", action="store_true", help="start from the packs and catalog in --out")
    ap.add_argument("--no-sweep", action="store_true", help="leave the sweep out")
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    notes: list[str] = []
    out = args.out or Path(tempfile.mkdtemp(prefix="mint-catalog-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    n = args.adapters
    try:
        base = load_builtin(notes, device)
        config = EngineConfig(
            max_loras=args.slots, max_cpu_loras=args.host_cache, max_lora_rank=8, target_modules=list(TARGETS)
        )
        engine = Engine(base, config)
        catalog = Catalog(CatalogConfig(url=f"sqlite:///{out}/catalog.db"))
        register_s: float | None = None
        build_s: float | None = None
        if args.reuse:
            if args.out is None:
                ap.error("--reuse needs --out")
            have = catalog.count()
            if have != n:
                ap.error(f"--reuse: {out} holds {have} revisions, not --adapters {n}")
        else:
            t0 = time.perf_counter()
            register_s = build(n, engine, out, catalog, args.build_workers)
            build_s = time.perf_counter() - t0
            print(f"built and registered {n} revisions in {build_s:.1f} s", file=sys.stderr)

        lat = resolve_latencies(catalog, n, args.resolves, random.Random(0))

        loader = AdapterManager(engine, AdapterStore(out / "store"), catalog, workers=args.workers)
        covered: int | None = None
        sweep_s: float | None = None
        if not args.no_sweep:
            t0 = time.perf_counter()
            covered = sweep(loader, n, args.window)
            sweep_s = time.perf_counter() - t0
        # single cold loads, one at a time, of addresses not resident: the latency a request for one sees
        cold: list[float] = []
        picks = random.Random(1)
        while len(cold) < min(args.cold, n):
            a = f"t{picks.randrange(n)}/v1"
            if engine.working_set.get(a) is not None:
                continue
            t = time.perf_counter()
            ws_name = loader.load_address(a)
            engine.working_set.release(engine.working_set.acquire(ws_name))
            cold.append(time.perf_counter() - t)

        rng = np.random.default_rng(0)
        prompts = [engine.tokenizer(ex.prompt)["input_ids"] for ex in split("add", 4096, 1, 5)[0]]
        # warm the working set with a first stretch of the same stream (untimed): the steady state is measured
        stream(engine, loader, [f"t{i}/v1" for i in zipf_indices(n, args.warmup, rng)], args.batch, prompts)
        zipf_addrs = [f"t{i}/v1" for i in zipf_indices(n, args.requests, rng)]
        hits0, loads0 = loader.stats.hits, loader.stats.cold_loads
        zipf_rps = stream(engine, loader, zipf_addrs, args.batch, prompts)
        asked = loader.stats.hits - hits0 + loader.stats.cold_loads - loads0
        zipf_hit_rate = (loader.stats.hits - hits0) / max(asked, 1)

        # the resident baseline: 100 adapters loaded once and pinned, the same stream shape over them
        for name in list(engine.working_set.names()):
            engine.working_set.remove(name)
        resident = [f"t{i}/v1" for i in range(100)]
        for a in resident:
            loader.load_address(a)
            engine.working_set.pin(a)
        stream(
            engine, None, [resident[i] for i in zipf_indices(100, args.batch * 4, rng)], args.batch, prompts
        )
        resident_addrs = [resident[i] for i in zipf_indices(100, args.requests, rng)]
        resident_rps = stream(engine, None, resident_addrs, args.batch, prompts)
        loader.close()

        disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        report(
            {
                "adapters": n,
                "register_s": None if register_s is None else round(register_s, 2),
                "build_s": None if build_s is None else round(build_s, 1),
                "resolve_p50_ms": percentile_ms(lat, 50),
                "resolve_p99_ms": percentile_ms(lat, 99),
                "sweep_covered": covered,
                "sweep_s": None if sweep_s is None else round(sweep_s, 1),
                "cold_load_p50_ms": percentile_ms(cold, 50),
                "cold_load_p99_ms": percentile_ms(cold, 99),
                "zipf_rps": round(zipf_rps, 1),
                "resident_rps": round(resident_rps, 1),
                "zipf_vs_resident": round(zipf_rps / resident_rps, 3),
                "zipf_hit_rate": round(zipf_hit_rate, 3),
                "slots": args.slots,
                "host_cache": args.host_cache,
                "disk_bytes": disk,
                "peak_rss_bytes": peak_rss_bytes(),
                "threads": args.threads,
                "cpus": os.cpu_count(),
                "notes": notes,
                "device": device,
            }
        )
    finally:
        if args.out is None and not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
