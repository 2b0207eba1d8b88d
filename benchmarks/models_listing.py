"""`GET /v1/models` over a large catalog: what listing every champion costs (`mint_core.serving.champions`).

Setup: a fresh SQLite catalog of `--policies` N policies, each with one revision that is its champion (the worst
case for the listing: every adapter a champion), registered in bulk.

Timed (median of `--rounds`, interleaved):
  read      what a listing pays when its cache is stale (once per CHAMPIONS_TTL_S, or after a load or unload):
            `Catalog.champions(CHAMPIONS_LISTED_MAX + 1)` and each card rendered to JSON as mint serve renders it,
            off the event loop
  listing   what every other listing pays, on the event loop: 8 held names' cards merged by name with the
            cached champions' and joined into the list (`by_name`, `model_list`)
  uncached  the baseline: the same list built and encoded from ModelCards on every listing
  all       `Catalog.champions(N)`: the uncapped read a listing of every champion would need, once

Figures: policies, listed, read_ms, listing_ms, uncached_ms, uncached_vs_listing, listing_bytes, all_read_s,
all_listing_bytes (the JSON an uncapped listing would send, from the capped one's size per card).

    python benchmarks/models_listing.py [--policies 1000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, report

from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.catalog_schema import Registration, aliases
from mint_core.serving.champions import CHAMPIONS_LISTED_MAX, ChampionListing, by_name, model_list
from mint_core.serving.protocol import ModelCard, ModelList


def champions_catalog(url: str, n: int) -> Catalog:
    """n policies `p<i>`, each with one revision, its champion."""
    catalog = Catalog(CatalogConfig(url=url))
    rows = []
    for i in range(n):
        d = hashlib.sha256(i.to_bytes(8, "little")).hexdigest()
        rows.append(Registration(d, "bench-base", 1, f"/store/{d[:2]}/{d}", policy=f"p{i:07d}"))
    catalog.register_many(rows)
    with catalog.engine.begin() as conn:
        for start in range(0, n, 10_000):
            part = range(start, min(n, start + 10_000))
            conn.execute(
                aliases.insert(), [{"policy": f"p{i:07d}", "alias": "champion", "version": 1} for i in part]
            )
    return catalog


def card(policy: str, digest: str, revision: str | None = None) -> ModelCard:
    return ModelCard(id=policy, created=0, root=f"sha256:{digest}", parent="base", revision=revision)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        catalog = champions_catalog(f"sqlite:///{tmp}/catalog.db", args.policies)
        print(f"built {args.policies} champions in {time.perf_counter() - t0:.1f} s", flush=True)
        listing = ChampionListing(
            catalog, lambda p, d: card(p, d).model_dump_json().encode(), ttl_s=float("inf")
        )
        champions = asyncio.run(listing.get())
        digests = dict(catalog.champions(CHAMPIONS_LISTED_MAX))
        held = {f"held{i}": card(f"held{i}", "0" * 64, "sha256:" + "0" * 64) for i in range(8)}
        held_json = {name: c.model_dump_json().encode() for name, c in held.items()}

        def read() -> None:
            listing.invalidate()
            asyncio.run(listing.get())

        def listed() -> bytes:
            return bytes(model_list(by_name(held_json, champions)).body)

        def uncached() -> bytes:
            cards = [*held.values(), *(card(p, d) for p, d in digests.items())]
            return ModelList(data=cards).model_dump_json().encode()

        times = interleaved({"read": read, "listing": listed, "uncached": uncached}, args.rounds)
        body = listed()
        t0 = time.perf_counter()
        every = catalog.champions(args.policies)
        all_read_s = time.perf_counter() - t0
        catalog.close()
    report(
        {
            "benchmark": "models_listing",
            "policies": args.policies,
            "listed": len(champions),
            "read_ms": round(times["read"] * 1e3, 1),
            "listing_ms": round(times["listing"] * 1e3, 2),
            "uncached_ms": round(times["uncached"] * 1e3, 1),
            "uncached_vs_listing": round(times["uncached"] / times["listing"], 1),
            "listing_bytes": len(body),
            "all_read_s": round(all_read_s, 2),
            "all_listing_bytes": round(len(body) / max(1, len(champions)) * len(every)),
        }
    )


if __name__ == "__main__":
    main()
