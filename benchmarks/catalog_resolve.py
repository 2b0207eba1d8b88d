"""Catalog at scale: bulk registration of N revisions, then resolve latency over mixed address kinds.

Setup: a fresh catalog (SQLite in a temporary directory, or `--url` with any SQLAlchemy URL whose database is
empty). N rank-1 revisions are registered with one `register_many` call as versions of N/10 policies (10
versions each, p<i>/v1..v10); then every policy gets `champion` (v10) and `candidate` (v9) aliases. Then
`--resolves` addresses, drawn at random and in equal shares from the four kinds (`p<i>`, `p<i>@candidate`,
`p<i>/v<k>`, `sha256:<hex>`), are resolved one at a time, each timed alone; every answer is checked.

Figures:
  entries                         N
  register_s                      wall time of the bulk registration (chunks of 10,000, one transaction each)
  register_rows_per_s             N / register_s
  resolve_p50_ms, resolve_p99_ms  latency of one `Catalog.resolve` call, all kinds together
  resolve_p50_ms_<kind>           the median per address kind

    python benchmarks/catalog_resolve.py [--entries 100000] [--resolves 10000] [--url URL]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report

from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.catalog_schema import Registration, aliases
from mint_core.types import Digest

VERSIONS_PER_POLICY = 10


def digest(i: int) -> Digest:
    return Digest(hashlib.sha256(i.to_bytes(8, "little")).hexdigest())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--resolves", type=int, default=10_000)
    ap.add_argument("--url", default=None, help="SQLAlchemy URL of an empty database (default: temp SQLite)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f"sqlite:///{tmp}/catalog.db"
        catalog = Catalog(CatalogConfig(url=url))
        if catalog.count():
            sys.exit(f"{url} already holds a catalog; give an empty database")
        n = args.entries
        n_policies = max(1, n // VERSIONS_PER_POLICY)
        # row i is version i // n_policies + 1 of policy i % n_policies
        rows = [
            Registration(
                digest(i), "bench-base", 1, f"/store/{digest(i)[:2]}/{digest(i)}", policy=f"p{i % n_policies}"
            )
            for i in range(n)
        ]
        t0 = time.perf_counter()
        got = catalog.register_many(rows)
        register_s = time.perf_counter() - t0
        assert got[-1] == (n - 1) // n_policies + 1, got[-1]
        print(f"registered {n} entries over {n_policies} policies in {register_s:.2f} s", flush=True)

        top = n // n_policies  # full policies have `top` versions
        alias_rows = [
            {"policy": f"p{p}", "alias": alias, "version": v}
            for p in range(n_policies)
            for alias, v in (("champion", top), ("candidate", max(1, top - 1)))
        ]
        with catalog.engine.begin() as conn:
            for start in range(0, len(alias_rows), 10_000):
                conn.execute(aliases.insert(), alias_rows[start : start + 10_000])

        rng = random.Random(args.seed)
        kinds = ["policy", "alias", "version", "digest"]
        queries: list[tuple[str, str, str]] = []  # kind, address, expected digest
        for _ in range(args.resolves):
            kind = rng.choice(kinds)
            i = rng.randrange(n)
            p, v = i % n_policies, i // n_policies + 1
            if kind == "policy":
                queries.append((kind, f"p{p}", digest((top - 1) * n_policies + p)))
            elif kind == "alias":
                queries.append((kind, f"p{p}@candidate", digest((max(1, top - 1) - 1) * n_policies + p)))
            elif kind == "version":
                queries.append((kind, f"p{p}/v{v}", digest(i)))
            else:
                queries.append((kind, digest(i).prefixed, digest(i)))

        for _, address, _ in queries[:200]:  # warm the connection pool and statement cache
            catalog.resolve(address)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for kind, address, expected in queries:
            t = time.perf_counter()
            r = catalog.resolve(address)
            times[kind].append(time.perf_counter() - t)
            assert r.digest == expected, (address, r, expected)
        catalog.close()

    all_ms = np.array([t for ts in times.values() for t in ts]) * 1e3
    result = {
        "benchmark": "catalog_resolve",
        "backend": sa.make_url(url).get_backend_name(),
        "entries": n,
        "policies": n_policies,
        "register_s": round(register_s, 3),
        "register_rows_per_s": round(n / register_s),
        "resolves": len(all_ms),
        "resolve_p50_ms": round(float(np.percentile(all_ms, 50)), 4),
        "resolve_p99_ms": round(float(np.percentile(all_ms, 99)), 4),
    }
    for kind, ts in times.items():
        if ts:
            result[f"resolve_p50_ms_{kind}"] = round(float(np.median(ts)) * 1e3, 4)
    report(result)


if __name__ == "__main__":
    main()
