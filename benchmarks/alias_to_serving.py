"""MLflow alias -> serving: how long after `set_registered_model_alias` the server answers with that revision.

Setup: what `mint up` runs, started through `mint_app.services.control` on free ports in a temporary state dir (or the
services of `--state-dir` when they run there already): MLflow (SQLite store, the webhook settings), `mint serve`
on the tiny built-in base, and the `hooks` receiver, with MLflow's alias webhook registered to it. `--versions`
random rank-4 adapter revisions of one policy are put in the store and registered (not timed); `champion` starts
on v1 and serving is brought in line.

Timed, `--moves` times: a bare `MlflowClient` (what the MLflow UI does: no mint code on the writer's side) moves
`champion` to the next version, then `GET /v1/models` is polled every `--poll-ms` until the policy's name is listed
with that version's digest. Nothing but the webhook moves serving here (no reconcile deployment runs).

Figures: p50_s, p95_s, max_s over the moves (the issue's target: p95 <= 3 s), moves, timeouts (moves not served
within `--timeout` s), seconds (each move), and the receiver's own reconcile time from its log when present.

`--device` (cpu by default) is that of the `mint serve` this benchmark starts (with `--state-dir`, services
already running there keep theirs).

    python benchmarks/alias_to_serving.py [--moves 20] [--versions 3] [--state-dir DIR] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from mlflow import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, report, stop_servers_on_kill

from mint_app.services.commands import hooks_workspace
from mint_app.services.config import ServicesConfig
from mint_app.services.control import start, stop
from mint_app.services.mlflow_auth import service_env
from mint_core.engine.base import build_tiny_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lifecycle.leases import policy_lock
from mint_core.lifecycle.reconcile import reconcile
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.store import AdapterStore

SERVICES = ["mlflow", "serve", "hooks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served(url: str, name: str, admin: dict[str, str]) -> str | None:
    r = httpx.get(url + "/v1/models", headers=admin, timeout=10, trust_env=False)
    r.raise_for_status()
    card = next((m for m in r.json()["data"] if m.get("id") == name), None)
    return None if card is None else card.get("revision")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moves", type=int, default=20)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--poll-ms", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one move may take to be served")
    ap.add_argument("--state-dir", type=Path, default=None, help="use (or start) the services of this dir")
    add_device(ap)
    args = ap.parse_args()
    stop_servers_on_kill()
    checked_device(ap, args.device)
    logging.basicConfig(level=logging.WARNING)

    tmp = Path(tempfile.mkdtemp(prefix="mint-alias-bench-"))
    state = args.state_dir or tmp / "run"
    own = args.state_dir is None
    config = ServicesConfig.model_validate(
        {
            "state_dir": state,
            "mlflow_port": free_port() if own else 5000,
            "serve_port": free_port() if own else 8000,
            "hooks_port": free_port() if own else 8001,
            "serve_base": "tiny-dense",
            "serve_adapter_root": tmp / "store" if own else None,
            "serve_device": args.device,
            "stop_timeout": 10,
        }
    )
    t0 = time.perf_counter()
    services = {s.name: s for s in start(config, SERVICES)}  # type: ignore[arg-type]
    startup_s = time.perf_counter() - t0
    # its MLflow asks a login: the registry and the bare client (a UI user's move) log in as mint's service account
    os.environ.update(service_env(config))
    try:
        ws = Workspace.model_validate(hooks_workspace(config))
        reg = ws.registry()
        store = AdapterStore(ws.store)
        # the weights `mint serve --base tiny-dense` builds (seed 0), so these adapters fit the served base
        base = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
        policy = f"bench-{uuid.uuid4().hex[:6]}"
        digests: dict[int, str] = {}
        for i in range(args.versions):
            weights = random_adapter(
                base.sites, ["q_proj", "v_proj"], 4, seed=100 + i, base_fingerprint=base.fingerprint
            )
            save_adapter(weights, tmp / f"a{i}", base.sites)
            rev = reg.create_revision(policy, store.put_dir(tmp / f"a{i}"), base=base.fingerprint, rank=4)
            digests[rev.version] = f"sha256:{rev.digest}"
        versions = sorted(digests)
        reg.promote(policy, versions[0], "benchmark start")
        with policy_lock(ws, policy, "bench"):
            reconcile(ws, policy)
        serve_url = services["serve"].url
        # mint's own credential: serving keys are on in a stack `mint up` starts
        admin = {"Authorization": f"Bearer {ws.admin_token()}"}
        mlflow = MlflowClient(tracking_uri=services["mlflow"].url)  # bare: what the MLflow UI does

        seconds: list[float] = []
        timeouts = 0
        current = versions[0]
        for i in range(args.moves):
            target = versions[(versions.index(current) + 1) % len(versions)]
            t = time.perf_counter()
            mlflow.set_registered_model_alias(policy, "champion", str(target))
            while served(serve_url, policy, admin) != digests[target]:
                if time.perf_counter() - t > args.timeout:
                    timeouts += 1
                    break
                time.sleep(args.poll_ms / 1000)
            seconds.append(time.perf_counter() - t)
            current = target
            print(f"move {i + 1:2d}: v{target} served after {seconds[-1]:.3f} s", flush=True)
    finally:
        if own:
            stop(config, SERVICES)  # type: ignore[arg-type]
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]
    report(
        {
            "benchmark": "alias_to_serving",
            "device": args.device,
            "moves": len(seconds),
            "versions": args.versions,
            "p50_s": round(statistics.median(seconds), 3),
            "p95_s": round(p95, 3),
            "max_s": round(max(seconds), 3),
            "timeouts": timeouts,
            "target_p95_s": 3.0,
            "services_startup_s": round(startup_s, 1),
            "seconds": [round(s, 3) for s in seconds],
        }
    )


if __name__ == "__main__":
    main()
