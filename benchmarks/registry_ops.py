"""Registry operation latency against a real MLflow server: create a version, move an alias, resolve champion.

Setup: an MLflow tracking server started by `mint_app.services.control` on a free port (SQLite store by default, or
`--backend-url postgresql+psycopg://postgres@127.0.0.1:5432/<db>`), a local adapter store and a SQLite catalog in
a temporary directory. `--ops` rank-1 adapter revisions of a tiny base are put in the store first (not timed).

Timed, one call at a time:
  create_version   Registry.create_revision: MLflow model version (source = store URI, mint.* tags) + catalog
                   mirror + `candidate` alias, under the policy's lock
  alias_move       Registry.promote: `champion` := the version, logged with a reason (MLflow alias + move log +
                   the registered model's summary tag)
  resolve_mlflow   Registry.resolve(policy): champion through MLflow
  resolve_catalog  Catalog.resolve(policy): champion through the catalog, what serving and the loader use

Then, with the registry filled:
  rebuild          `rebuild_catalog` of the policy into an empty catalog (MLflow + store -> index)
  cli_<command>    wall seconds of `mint registry ls`, `mint registry ls <policy>`, `mint registry lineage`
                   (a chain as deep as --ops, capped at 20), `mint catalog resolve` and `mint --help`, each the
                   median of 3 fresh processes; the issue's target is < 1 s
  cli_heavy        torch / transformers / mlflow modules those read commands imported (should be [])

Figures: <op>_p50_ms and <op>_p99_ms for each op, ops, rebuild_s, cli_*_s, cli_heavy.

    python benchmarks/registry_ops.py [--ops 100] [--backend-url URL]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, stop_servers_on_kill

from mint_app.services.config import ServicesConfig
from mint_app.services.control import start, stop
from mint_app.services.mlflow_auth import service_env
from mint_core.engine.base import build_tiny_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.index import rebuild_catalog
from mint_core.registry.mlflow_registry import Registry, RegistryConfig
from mint_core.registry.store import AdapterStore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ms(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs), q)) * 1e3, 2)


HEAVY_CHECK = """
import json, sys
from typer.testing import CliRunner
from mint_app.cli.app import app
codes = [CliRunner().invoke(app, a).exit_code for a in json.loads(sys.argv[1])]
print(json.dumps([codes, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'mlflow'})]))
"""


def cli_figures(commands: dict[str, list[str]], env: dict[str, str]) -> dict[str, object]:
    """Median wall seconds of each read command in a fresh process, and the heavy modules they import."""
    out: dict[str, object] = {}
    mint = [sys.executable, "-m", "mint_app.cli.app"]
    for name, args in commands.items():
        walls = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run([*mint, *args], env=env, check=True, capture_output=True)
            walls.append(time.perf_counter() - t)
        out[f"cli_{name}_s"] = round(statistics.median(walls), 2)
    got = subprocess.run(
        [sys.executable, "-c", HEAVY_CHECK, json.dumps(list(commands.values()))],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    codes, heavy = json.loads(got.stdout.strip().splitlines()[-1])
    assert codes == [0] * len(commands), codes
    out["cli_heavy"] = heavy
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--backend-url", default=None, help="MLflow store URL (default: SQLite in a temp dir)")
    args = ap.parse_args()
    stop_servers_on_kill()
    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="mint-registry-ops-"))
    config = ServicesConfig(
        state_dir=tmp / "run", mlflow_port=free_port(), mlflow_backend_url=args.backend_url
    )
    t0 = time.perf_counter()
    service = start(config, ["mlflow"])[0]
    startup_s = time.perf_counter() - t0
    os.environ.update(service_env(config))  # its MLflow asks a login: mint's service account (CLI runs too)
    try:
        base = build_tiny_base("dense", tokenizer=byte_tokenizer())
        store = AdapterStore(tmp / "store")
        digests = []
        for i in range(args.ops):
            a = random_adapter(base.sites, ["q_proj"], 1, seed=i, base_fingerprint=base.fingerprint)
            save_adapter(a, tmp / f"a{i}", base.sites)
            digests.append(store.put_dir(tmp / f"a{i}"))
        catalog = Catalog(CatalogConfig(url=f"sqlite:///{tmp}/catalog.db"))
        reg = Registry(store, catalog, RegistryConfig(tracking_uri=service.url))
        policy = "bench"
        times: dict[str, list[float]] = {
            k: [] for k in ("create_version", "alias_move", "resolve_mlflow", "resolve_catalog")
        }
        for i, d in enumerate(digests):
            parent = f"{policy}/v{i}" if i else None
            t = time.perf_counter()
            rev = reg.create_revision(
                policy, d, base=base.fingerprint, rank=1, parent=parent, data_rev="bench"
            )
            times["create_version"].append(time.perf_counter() - t)
            t = time.perf_counter()
            reg.promote(policy, rev.version, reason="benchmark")
            times["alias_move"].append(time.perf_counter() - t)
            t = time.perf_counter()
            got = reg.resolve(policy)
            times["resolve_mlflow"].append(time.perf_counter() - t)
            t = time.perf_counter()
            cat = catalog.resolve(policy)
            times["resolve_catalog"].append(time.perf_counter() - t)
            assert got.version == rev.version == cat.version and cat.digest == d
        out: dict[str, object] = {"ops": args.ops, "mlflow_startup_s": round(startup_s, 1)}
        for k, v in times.items():
            out[f"{k}_p50_ms"] = ms(v, 50)
            out[f"{k}_p99_ms"] = ms(v, 99)

        empty = Catalog(CatalogConfig(url=f"sqlite:///{tmp}/rebuilt.db"))
        t = time.perf_counter()
        rebuilt = rebuild_catalog(reg.reader, empty, store, [policy])
        out["rebuild_s"] = round(time.perf_counter() - t, 3)
        assert empty.resolve(policy).digest == catalog.resolve(policy).digest, rebuilt.changes
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": service.url,
            "MINT_CATALOG_URL": catalog.config.url,
            "MINT_STORE": str(tmp / "store"),
        }
        top = len(digests)
        out.update(
            cli_figures(
                {
                    "help": ["--help"],
                    "registry_ls": ["registry", "ls"],
                    "registry_ls_policy": ["registry", "ls", policy],
                    "registry_lineage": ["registry", "lineage", f"{policy}/v{min(top, 20)}"],
                    "catalog_resolve": ["catalog", "resolve", policy],
                },
                env,
            )
        )
        out["backend"] = "postgresql" if args.backend_url else "sqlite"
        report(out)
    finally:
        stop(config, ["mlflow"])


if __name__ == "__main__":
    main()
