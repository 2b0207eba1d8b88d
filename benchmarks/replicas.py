"""A fleet of vLLM replicas behind mint's front, which routes over them itself (issues #34 item 5, #45 item 1):
throughput, latency and cold loads through the front over 1 and over 2 replicas against bare vLLM on the same load,
promotion time, and where the CPU goes.

Setup: the tiny dense Llama with head_dim 32 that vLLM's CPU attention runs (mint_testkit.harness
`save_tiny_base(vllm=True)`), float32. Two vLLM replicas (`.venv-vllm`, MINT_VLLM_PYTHON) started as `mint up
--replicas 2` starts them (VLLMConfig with `replica=True`: sealed on every route, the routed key, each answer naming
its replica), `--max-loras` (4) slots each, max_cpu_loras 4 x that, as `mint up`. Then one mint front (`mint serve
--backend vllm`) per target, all on loopback:

  bare          replica 0 itself, with mint's full key, past the front: the baseline. The base is asked as the
                front asks vLLM for it (its zero adapter, `_mint_base`), so the work is the same
  front         mint's front -> replica 0: mint's deployment with one vLLM (`vllm_url`)
  front 1x      the front as a fleet of one (`vllm_replicas: [replica 0]`): the front's own routing, one replica
  front 2x      the front as a fleet of two (`vllm_replicas`: both): each request to one replica by rendezvous
                hashing on the served name (mint's deployment with `--replicas 2`)

The load (the same for every target): --streams (16) closed-loop clients each send --requests (16) non-streaming
completions one after another, client i's request j under name (i + j) % M of the base and --adapters (6) rank-8
adapters (random q,k,v,o weights, loaded through a fleet front onto both replicas): M = 7 names, more than one
replica's slots. Each prompt is 16 random letters (16 tokens, the byte tokenizer), new for every request;
--new-tokens (64) tokens, temperature 0, ignore_eos. A warm-up round on every
target, then --rounds (3) rounds interleaved over the targets so drift hits all alike, each round starting one
target later than the one before (with --rounds a multiple of 4, each target takes each place in a round equally
often; the cyclic order, and so which target runs before which within a round, stays); before each timed round an untimed settling pass (one request per client) puts the replicas' slots in that target's steady state.

Figures of the load (per target, over its timed rounds):
  tok_s, vs_bare         completion tokens / summed round wall time; against bare
  vs_bare_rounds, _ci95  each round's tok/s over bare's in the same round (rounds interleave, so a round's drift
                         hits both), and a 95% interval of their geometric mean (Student's t over the logs; from 2
                         rounds): how far one run pins the ratio
  p50_ms, p99_ms         request latency as the client sees it
  slot_loads_per_1k      adapters moved into one of a replica's --max-loras slots (vLLM's cold load on a GPU)
                         per 1,000 requests; disk_loads_per_1k: adapters read from disk into its CPU cache.
                         Counted from each replica's log: vLLM logs both at DEBUG only, so the replicas run with a
                         logging config (VLLM_LOGGING_CONFIG_PATH, vLLM's seam) that opens DEBUG for
                         `vllm.lora.model_manager` alone ("Activating LoRA", "Adding lora")
  share                  each replica's share of the requests (the X-Mint-Replica header)
  cpu_*_per_1k           where the time goes: CPU seconds per 1,000 requests of the client (this process), the
                         fronts, the replicas' API servers and their engine processes, and `other`
                         (the rest of the machine: other users' work); busy = the machine's busy share of its cores
Ratios, side by side in the summary: front / bare, front 1x / bare and front 2x / bare (the front path's cost;
the goal is >= 0.95), 2x / front (what a second replica brings).

Promotion (--promotions (10) each, after 2 warm-ups, interleaved, the machine otherwise idle): policy `promo-N` has
two revisions registered in a catalog (SQLite) that the fronts read. t0: the catalog's `champion` alias moves to
the other version; the front is asked to load `promo-N@champion` in place (what reconcile does after an alias
move: the front resolves, validates, and with 2 replicas loads on each and smoke-checks each, all or nothing); a
completion through the front must answer with the new revision; t1: each replica itself lists that revision under
the name. p50 and max ms with 1 replica (`front`) and with 2 (`front 2x`).

`--profile`: one more round on `front` (`--profile-target`: or `front 1x`, `front 2x`; untimed for the figures) with py-spy (--py-spy, else on PATH) sampling the
front, and a table of where its CPU goes (innermost frame by package, and the heaviest functions inclusive).

`--quick`: 4 streams x 2 requests x 16 tokens, 1 round, 2 promotions (a few
minutes, most of it two vLLM starts). Every figure line carries the load average after its part: on a shared
machine the figures are only as steady as it. All traffic goes to servers this script started; every loop is
bounded in count and in time.

    MINT_VLLM_PYTHON=... python benchmarks/replicas.py [--quick] [--profile] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked, checked_device, load_avg, pct, report, stop_servers_on_kill

from mint_core.engine.base import Base, load_base
from mint_core.lora.adapter import random_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.store import AdapterStore
from mint_core.serving.fleet import REPLICA_HEADER
from mint_core.serving.gateway import BASE_ADAPTER
from mint_core.serving.vllm_process import VLLMConfig, replica_cpus
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_BASE_NAME,
    VLLM_KEY,
    VLLM_PYTHON,
    free_port,
    launch,
    save_tiny_base,
    server_log,
    start_server,
    stop_server,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
KEY = {"Authorization": f"Bearer {VLLM_KEY}"}
ROUTED_KEY = "routed-key-for-the-benchmark"
SPY_HZ = 250  # py-spy's samples a second
# uvicorn closes a connection idle for 5 s; this script's pool drops its own well before (serving_backends.py)
POOL = httpx.Limits(max_connections=100, max_keepalive_connections=32, keepalive_expiry=1.0)
SLOT_LOAD = "Activating LoRA"  # vllm/lora/model_manager.py, DEBUG: an adapter moved into a slot
DISK_LOAD = (
    "Adding lora"  # the same file, DEBUG: an adapter read into the CPU cache (LRUCacheLoRAModelManager)
)
# vLLM's own logging seam: its default config, plus DEBUG for the LoRA model manager alone
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
    "handlers": {
        "out": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "level": "DEBUG",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "vllm.lora.model_manager": {"level": "DEBUG"},
    },
}


@dataclass
class Replica:
    url: str
    proc: subprocess.Popen[str]
    log: Path

    def counts(self) -> tuple[int, int]:
        """(slot loads, disk loads) so far, from its log."""
        text = self.log.read_text(errors="replace")
        return text.count(SLOT_LOAD), text.count(DISK_LOAD)


@dataclass
class Target:
    name: str
    url: str
    headers: dict[str, str]
    base_model: str
    """The `model` the base is asked under: the base's name, or (bare) the front's zero adapter."""
    replicas: list[int]


@dataclass
class Round:
    wall_s: float = 0.0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    by_replica: Counter[str] = field(default_factory=Counter)


@dataclass
class Tally:
    """A target's timed rounds: the load's answers, the replicas' loads, CPU seconds by component."""

    rounds: list[Round] = field(default_factory=list)
    slot_loads: int = 0
    disk_loads: int = 0
    cpu: Counter[str] = field(default_factory=Counter)
    busy_s: float = 0.0


@dataclass
class Fleet:
    work: Path
    base_dir: Path
    base: Base
    store: AdapterStore
    catalog_url: str
    replicas: list[Replica] = field(default_factory=list)
    fronts: dict[str, tuple[subprocess.Popen[str], str]] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    seed: int = 1000

    def revision(self) -> str:
        """A new random rank-8 revision in the store; its digest."""
        self.seed += 1
        w = random_adapter(
            self.base.sites, TARGETS, RANK, seed=self.seed, std=0.05, base_fingerprint=self.base.fingerprint
        )
        return str(self.store.put_weights(w, self.base.sites))


def wait_healthy(procs: dict[str, subprocess.Popen[str]], headers: dict[str, str], timeout_s: float) -> None:
    """Until each URL answers /health 200 (or its process exits: RuntimeError with its log)."""
    deadline = time.monotonic() + timeout_s
    pending = dict(procs)
    while pending and time.monotonic() < deadline:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}:\n{server_log(proc)[-4000:]}")
            try:
                if httpx.get(url + "/health", headers=headers, timeout=5).status_code == 200:
                    del pending[url]
            except httpx.HTTPError:
                pass
        time.sleep(1)
    if pending:
        raise RuntimeError(f"not healthy within {timeout_s:g} s: {list(pending)}")


@contextmanager
def fleet(args: argparse.Namespace) -> Iterator[Fleet]:
    """Two replicas and a front per target; all stopped and the files removed on exit, with the last lines of
    every log on stderr when the run failed."""
    work = Path(tempfile.mkdtemp(prefix="mint-replicas-"))
    base_dir = save_tiny_base(work / VLLM_BASE_NAME, vllm=True)
    (work / "store").mkdir()
    f = Fleet(
        work, base_dir, load_base(base_dir), AdapterStore(work / "store"), f"sqlite:///{work / 'catalog.db'}"
    )
    logging_config = work / "vllm-logging.json"
    logging_config.write_text(json.dumps(LOGGING))
    procs: list[subprocess.Popen[str]] = []
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        try:
            # -- the replicas, as `mint up --replicas 2` starts them
            t = time.perf_counter()
            for i in range(2):
                port = free_port()
                cmd, env = VLLMConfig(
                    python=VLLM_PYTHON,
                    model=base_dir,
                    served_model_name=base_dir.name,
                    port=port,
                    api_key=VLLM_KEY,
                    max_loras=args.max_loras,
                    max_cpu_loras=4 * args.max_loras,
                    max_lora_rank=16,
                    max_model_len=512,
                    device="cpu" if args.device == "cpu" else "cuda",
                    replica=True,
                    cpus=replica_cpus(i, 2) if args.device == "cpu" else None,  # as `mint up` binds them
                    routed_key=ROUTED_KEY,
                ).command()
                env |= {"VLLM_LOGGING_CONFIG_PATH": str(logging_config), "PYTHONUNBUFFERED": "1"}
                if args.device.startswith("cuda"):  # replica i on GPU i, as `mint up` places them
                    first = int(args.device.removeprefix("cuda:")) if ":" in args.device else 0
                    env["CUDA_VISIBLE_DEVICES"] = str(first + i)
                log = work / f"replica-{i}.log"
                proc = launch(cmd, env, log)
                procs.append(proc)
                stack.callback(stop_server, proc, 60)
                f.replicas.append(Replica(f"http://127.0.0.1:{port}", proc, log))
            wait_healthy({r.url: r.proc for r in f.replicas}, KEY, args.start_timeout)
            print(f"2 replicas up in {time.perf_counter() - t:.1f} s (load {load_avg()})", flush=True)
            urls = [r.url for r in f.replicas]
            plans = {"front 1x": urls[:1], "front 2x": urls}
            # -- the fronts, started together
            common = {
                "MINT_SERVE_BACKEND": "vllm",
                "MINT_SERVE_VLLM_API_KEY": VLLM_KEY,
                "MINT_SERVE_MAX_LORA_RANK": "16",
                "MINT_SERVE_CATALOG_URL": f.catalog_url,
                "MINT_SERVE_GOLDEN_INTERVAL_S": "0",
                "MINT_SERVE_LOG_LEVEL": "warning",  # no access log
                "MINT_SERVE_TINKER": "false",
            }
            envs = {"front": common | {"MINT_SERVE_VLLM_URL": urls[0]}}
            for name, workers in plans.items():
                envs[name] = common | {
                    "MINT_SERVE_VLLM_REPLICAS": json.dumps(workers),
                    "MINT_SERVE_VLLM_ROUTED_KEY": ROUTED_KEY,
                }
            with ThreadPoolExecutor(len(envs)) as pool:
                started = {
                    name: pool.submit(
                        start_server,
                        work / "store",
                        *("--base", str(base_dir), "--device", args.device),
                        env=env,
                        healthy_within_s=300,
                    )
                    for name, env in envs.items()
                }
                for name, fut in started.items():
                    proc, url = fut.result()
                    procs.append(proc)
                    stack.callback(stop_server, proc)
                    f.fronts[name] = (proc, url)
            print(f"{len(f.fronts)} fronts up (load {load_avg()})", flush=True)
            base = base_dir.name
            f.targets = [Target("bare", urls[0], KEY, BASE_ADAPTER, [0])]
            f.targets.append(Target("front", f.fronts["front"][1], {}, base, [0]))
            f.targets += [
                Target(n, f.fronts[n][1], {}, base, [0] if n == "front 1x" else [0, 1]) for n in plans
            ]
            yield f
        except BaseException:
            for p in procs:
                print(f"--- log of pid {p.pid} (last lines):\n{server_log(p)[-3000:]}", file=sys.stderr)
            raise


# -- the load ------------------------------------------------------------------------------------------------


def prompt(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=16))


async def closed_loop(target: Target, models: list[str], args: argparse.Namespace, requests: int) -> Round:
    """`args.streams` clients, each sending `requests` completions one after another."""
    rng = random.Random(f"{target.name}-{requests}-{time.time_ns()}")
    rnd = Round()
    names = [target.base_model if m == "" else m for m in models]
    async with httpx.AsyncClient(
        base_url=target.url, headers=target.headers, limits=POOL, timeout=300, trust_env=False
    ) as client:

        async def lane(i: int) -> None:
            for j in range(requests):
                body = {
                    "model": names[(i + j) % len(names)],
                    "prompt": prompt(rng),
                    "max_tokens": args.new_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                t = time.perf_counter()
                try:
                    r = checked(await client.post("/v1/completions", json=body), body["model"])
                    n = int(r.json()["usage"]["completion_tokens"])
                    if n != args.new_tokens:
                        raise RuntimeError(f"{n} tokens, not {args.new_tokens}")
                    rnd.tokens += n
                    rnd.latencies.append(time.perf_counter() - t)
                    rnd.by_replica[r.headers.get(REPLICA_HEADER, "?")] += 1
                except Exception as e:
                    rnd.errors.append(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        lanes = [asyncio.create_task(lane(i)) for i in range(args.streams)]
        _, pending = await asyncio.wait(lanes, timeout=600)
        for task in pending:
            task.cancel()
            rnd.errors.append("no answer in 600 s")
        await asyncio.gather(*pending, return_exceptions=True)
        rnd.wall_s = time.perf_counter() - t0
    return rnd


def groups(f: Fleet) -> dict[str, list[psutil.Process]]:
    """This run's processes by component (a replica's engine is its API server's child process)."""
    out: dict[str, list[psutil.Process]] = {"client": [psutil.Process()]}
    out["front"] = [psutil.Process(p.pid) for p, _ in f.fronts.values()]
    out["vllm_api"] = [psutil.Process(r.proc.pid) for r in f.replicas]
    out["vllm_engine"] = [c for api in out["vllm_api"] for c in api.children(recursive=True)]
    return out


def cpu_now(by: dict[str, list[psutil.Process]]) -> tuple[dict[str, float], float]:
    """CPU seconds so far of each component, and of the whole machine (busy: all but idle and iowait)."""
    out = {}
    for k, procs in by.items():
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        out[k] = total
    m = psutil.cpu_times()
    return out, sum(m) - m.idle - getattr(m, "iowait", 0.0)


def pinned(f: Fleet) -> dict[str, list[int]]:
    """The cores each replica's engine threads are bound to (vLLM's CPU backend binds its OpenMP threads)."""
    out = {}
    every = set(range(psutil.cpu_count() or 1))
    for i, r in enumerate(f.replicas):
        cores: set[int] = set()
        for p in psutil.Process(r.proc.pid).children(recursive=True):
            for t in p.threads():
                try:
                    allowed = os.sched_getaffinity(t.id)
                except OSError:
                    continue
                if allowed != every:
                    cores |= allowed
        out[f"replica{i}"] = sorted(cores)
    return out


def settle_and_time(
    f: Fleet, target: Target, models: list[str], args: argparse.Namespace, tally: Tally
) -> Round:
    asyncio.run(closed_loop(target, models, args, 1))  # slots to this target's steady state; untimed
    by = groups(f)
    counts0 = [f.replicas[i].counts() for i in target.replicas]
    cpu0, busy0 = cpu_now(by)
    rnd = asyncio.run(closed_loop(target, models, args, args.requests))
    cpu1, busy1 = cpu_now(by)
    counts1 = [f.replicas[i].counts() for i in target.replicas]
    tally.rounds.append(rnd)
    tally.slot_loads += sum(b[0] - a[0] for a, b in zip(counts0, counts1, strict=True))
    tally.disk_loads += sum(b[1] - a[1] for a, b in zip(counts0, counts1, strict=True))
    for k in cpu0:
        tally.cpu[k] += cpu1[k] - cpu0[k]
    tally.busy_s += busy1 - busy0
    return rnd


def part_load(f: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    names = [f"a{i}" for i in range(args.adapters)]
    first_fleet = next(t for t in f.targets if t.name == "front 2x")
    with httpx.Client(base_url=first_fleet.url, headers=ADMIN, timeout=300) as admin:
        for name in names:  # through a fleet front: every replica loads it
            body = {"lora_name": name, "lora_path": f"sha256:{f.revision()}"}
            checked(admin.post("/v1/load_lora_adapter", json=body), f"load {name}")
    models = ["", *names]  # "": the base, as the target asks for it
    # warm-up, the fleet fronts first: a base request there loads the zero adapter on both replicas
    for target in sorted(f.targets, key=lambda t: (t.name != "front 2x", t.name == "bare")):
        w = asyncio.run(closed_loop(target, models, args, 1))
        if w.errors:
            raise RuntimeError(f"warm-up on {target.name} failed: {w.errors[:3]}")
    tallies = {t.name: Tally() for t in f.targets}
    deadline = time.monotonic() + args.time_limit
    for n in range(args.rounds):
        if time.monotonic() > deadline:
            break
        # each round starts one target later, so no target is always first in its round (the first timed round
        # after another target's round, or after the warm-up)
        k = n % len(f.targets)
        for target in f.targets[k:] + f.targets[:k]:
            rnd = settle_and_time(f, target, models, args, tallies[target.name])
            print(
                f"  round {n} {target.name:18s} {rnd.tokens / rnd.wall_s:8.1f} tok/s  {rnd.wall_s:6.2f} s  "
                f"failed {len(rnd.errors)}  load {load_avg()[0]}",
                flush=True,
            )
    cores = psutil.cpu_count() or 1
    out: dict[str, Any] = {}
    for name, t in tallies.items():
        rs = t.rounds
        lat = [x for r in rs for x in r.latencies]
        requests = sum(len(r.latencies) + len(r.errors) for r in rs)
        wall = sum(r.wall_s for r in rs)
        by_replica: Counter[str] = sum((r.by_replica for r in rs), Counter())
        per_1k = 1000 / max(requests, 1)
        known = sum(t.cpu.values())
        out[name] = {
            "tok_s": round(sum(r.tokens for r in rs) / wall, 1),
            "p50_ms": round(pct(lat, 50) * 1e3, 1),
            "p99_ms": round(pct(lat, 99) * 1e3, 1),
            "requests": requests,
            "failed": sum(len(r.errors) for r in rs),
            "slot_loads_per_1k": round(t.slot_loads * per_1k, 1),
            "disk_loads_per_1k": round(t.disk_loads * per_1k, 1),
            "share": {
                k: round(v / max(sum(by_replica.values()), 1), 3) for k, v in sorted(by_replica.items())
            },
            **{f"cpu_{k}_per_1k": round(v * per_1k, 2) for k, v in t.cpu.items()},
            "cpu_other_per_1k": round(max(t.busy_s - known, 0.0) * per_1k, 2),
            "busy": round(t.busy_s / (wall * cores), 3),
        }
    bare = out["bare"]["tok_s"]
    bare_rounds = [r.tokens / r.wall_s for r in tallies["bare"].rounds]
    for name, v in out.items():
        v["vs_bare"] = round(v["tok_s"] / bare, 3)
        paired = [r.tokens / r.wall_s / b for r, b in zip(tallies[name].rounds, bare_rounds, strict=False)]
        v["vs_bare_rounds"] = [round(x, 3) for x in paired]
        v["vs_bare_ci95"] = ratio_interval(paired)
    errors = [e for t in tallies.values() for r in t.rounds for e in r.errors]
    for e in errors[:3]:
        print(f"  e.g. {e}", file=sys.stderr)
    return {
        "figure": "load",
        "targets": out,
        "engine_cores": pinned(f),
        "cores": cores,
        "rounds": min(len(t.rounds) for t in tallies.values()),
        "streams": args.streams,
        "requests_per_stream": args.requests,
        "new_tokens": args.new_tokens,
        "adapters": args.adapters,
        "max_loras": args.max_loras,
        "failed": len(errors),
        "load_avg": load_avg(),
    }


def ratio_interval(ratios: list[float]) -> list[float] | None:
    """A 95% interval of the geometric mean of per-round ratios (each round's tok/s over bare's in the same round):
    Student's t over their logs. None below 2 rounds."""
    if len(ratios) < 2:
        return None
    from scipy.stats import t

    logs = [math.log(x) for x in ratios]
    mean = statistics.fmean(logs)
    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / len(logs) ** 0.5
    return [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]


def print_load(fig: dict[str, Any]) -> None:
    rows = fig["targets"]
    print(
        f"\n{'target':20s} {'tok/s':>8s} {'vs bare':>8s} {'95% CI':>13s} {'p50 ms':>8s} {'p99 ms':>8s} "
        f"{'slot/1k':>8s} {'disk/1k':>8s}  share"
    )
    for name, r in rows.items():
        share = " ".join(f"{k.rsplit(':', 1)[-1]}:{v:.2f}" for k, v in r["share"].items())
        ci = r["vs_bare_ci95"]
        interval = f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "-"
        print(
            f"{name:20s} {r['tok_s']:8.1f} {r['vs_bare']:8.3f} {interval:>13s} {r['p50_ms']:8.1f} "
            f"{r['p99_ms']:8.1f} {r['slot_loads_per_1k']:8.1f} {r['disk_loads_per_1k']:8.1f}  {share}"
        )
    parts = ["client", "front", "vllm_api", "vllm_engine", "other"]
    print(
        f"\nCPU seconds per 1,000 requests ({fig['cores']} cores; engine threads bound to {fig['engine_cores']})"
    )
    print(f"{'target':20s} " + " ".join(f"{p:>11s}" for p in parts) + f" {'total':>8s} {'busy':>6s}")
    for name, r in rows.items():
        vals = [r[f"cpu_{p}_per_1k"] for p in parts]
        print(f"{name:20s} " + " ".join(f"{v:11.2f}" for v in vals) + f" {sum(vals):8.2f} {r['busy']:6.1%}")
    print(flush=True)


# -- promotion -----------------------------------------------------------------------------------------------


def part_promotion(f: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Alias move -> every replica serving, with 1 replica (`front`) and with 2 (the first fleet front)."""
    setups = {"1 replica": ("front", [0]), "2 replicas": ("front 2x", [0, 1])}
    catalog = Catalog(CatalogConfig(url=f.catalog_url))
    times: dict[str, list[float]] = {k: [] for k in setups}
    loads: dict[str, list[float]] = {k: [] for k in setups}
    plan: dict[str, tuple[str, list[tuple[int, str]]]] = {}
    for n, key in enumerate(setups):
        policy = f"promo-{n + 1}"
        revs = []
        for _ in range(2):
            digest = f.revision()
            version = catalog.register(
                digest, f.base.fingerprint, RANK, str(f.store.local_dir(digest)), policy=policy
            )
            assert version is not None
            revs.append((version, digest))
        plan[key] = (policy, revs)
    clients = {k: httpx.Client(base_url=f.fronts[name][1], timeout=300) for k, (name, _) in setups.items()}
    direct = httpx.Client(headers=KEY, timeout=60, trust_env=False)
    try:
        for i in range(-2, args.promotions):  # two untimed warm-ups
            for key, (_, on) in setups.items():
                policy, revs = plan[key]
                version, digest = revs[i % 2]
                t0 = time.perf_counter()
                catalog.set_alias(policy, "champion", version)
                body = {"lora_name": policy, "lora_path": f"{policy}@champion", "load_inplace": True}
                checked(
                    clients[key].post("/v1/load_lora_adapter", json=body, headers=ADMIN), f"promote {policy}"
                )
                t1 = time.perf_counter()
                ask = {"model": policy, "prompt": "add: 1+1 =", "max_tokens": 1, "temperature": 0}
                out = checked(clients[key].post("/v1/completions", json=ask), f"ask {policy}").json()
                if out["system_fingerprint"] != digest:
                    raise RuntimeError(f"{policy} answered as {out['system_fingerprint']}, not {digest}")
                for r in on:
                    cards = checked(direct.get(f.replicas[r].url + "/v1/models"), "models").json()["data"]
                    root = next((c.get("root", "") for c in cards if c["id"] == policy), "")
                    if Path(root).name != digest:
                        raise RuntimeError(f"replica {r} lists {policy} at {root!r}, not {digest}")
                t2 = time.perf_counter()
                if i >= 0:
                    times[key].append(t2 - t0)
                    loads[key].append(t1 - t0)
    finally:
        for c in clients.values():
            c.close()
        direct.close()
        catalog.close()
    out: dict[str, Any] = {"figure": "promotion"}
    for key, ts in times.items():
        tag = key.split()[0]
        out[f"r{tag}_p50_ms"] = round(statistics.median(ts) * 1e3, 1)
        out[f"r{tag}_max_ms"] = round(max(ts) * 1e3, 1)
        out[f"r{tag}_load_p50_ms"] = round(statistics.median(loads[key]) * 1e3, 1)
    out["r2_over_r1"] = round(out["r2_p50_ms"] / out["r1_p50_ms"], 2)
    print(f"\n{'promotion':12s} {'p50 ms':>8s} {'max ms':>8s} {'load p50 ms':>12s}")
    for key in times:
        tag = key.split()[0]
        print(
            f"{key:12s} {out[f'r{tag}_p50_ms']:8.1f} {out[f'r{tag}_max_ms']:8.1f} "
            f"{out[f'r{tag}_load_p50_ms']:12.1f}"
        )
    print(flush=True)
    return out | {"promotions": args.promotions, "failed": 0, "load_avg": load_avg()}  # a failure raises


# -- the front's profile ---------------------------------------------------------------------------------------


def where(frame: str) -> str:
    """The package (a mint module by its path) of one py-spy frame, `function (path:line)`."""
    path = frame.rsplit(" (", 1)[-1].split(":", 1)[0]
    if path.startswith(("mint_core/", "mint_app/")):
        return path.removesuffix(".py")
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif "/lib/python3" in path:  # the standard library, by its full path
        path = path.split("/lib/python3", 1)[1].partition("/")[2]
    return path.split("/", 1)[0].removesuffix(".py")


def part_profile(f: Fleet, args: argparse.Namespace, py_spy: str) -> dict[str, Any]:
    """One more round on `--profile-target` (`front` by default) with py-spy sampling that front: its busy samples
    by the innermost frame's package, and the heaviest functions under the event loop's callbacks, inclusive."""
    target = next(t for t in f.targets if t.name == args.profile_target)
    models = ["", *[f"a{i}" for i in range(args.adapters)]]
    raw = args.profile_out or f.work / "front.pyspy"
    proc, _ = f.fronts[args.profile_target]
    cmd = [py_spy, "record", "--pid", str(proc.pid), "--format", "raw", "--output", str(raw)]
    spy = subprocess.Popen(
        [*cmd, "--rate", str(SPY_HZ), "--nonblocking", "--duration", str(int(args.time_limit))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2)  # py-spy attaches
    cpu0 = psutil.Process(proc.pid).cpu_times()
    t0 = time.perf_counter()
    rnd = asyncio.run(closed_loop(target, models, args, args.requests))
    wall = time.perf_counter() - t0
    cpu1 = psutil.Process(proc.pid).cpu_times()
    spy.send_signal(2)  # SIGINT: py-spy writes what it has
    _, err = spy.communicate(timeout=60)
    if not Path(raw).exists():
        raise RuntimeError(f"py-spy wrote nothing: {err[-2000:]}")
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = waiting = 0
    for line in Path(raw).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        count = int(n)
        if frames[-1].split(" (", 1)[0].endswith("select"):  # the event loop waiting in epoll: not work
            waiting += count
            continue
        total += count
        own[where(frames[-1])] += count
        # under the loop's callbacks (asyncio's Handle._run): what a request costs, not the loop around it
        cut = max((i for i, fr in enumerate(frames) if fr.startswith("Handle._run (")), default=-1)
        for fr in {fr.split(" (", 1)[0] + "  " + where(fr) for fr in frames[cut + 1 :]}:
            inclusive[fr] += count
    requests = len(rnd.latencies)
    cpu_ms = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) * 1e3 / max(requests, 1)
    print(
        f"\n{args.profile_target} under py-spy: {requests} requests in {wall:.1f} s, {total} busy samples at {SPY_HZ} Hz "
        f"({waiting} more waiting in epoll); the front's CPU {cpu_ms:.2f} ms per request"
    )
    print("innermost frame's package        share of busy samples")
    for k, v in own.most_common(16):
        print(f"  {k:32s} {v / max(total, 1):6.1%}")
    print("heaviest functions under the event loop's callbacks (inclusive)")
    top = inclusive.most_common(args.profile_top)
    for k, v in top:
        print(f"  {k:72s} {v / max(total, 1):6.1%}")
    print(flush=True)
    return {
        "figure": "front_profile",
        "target": args.profile_target,
        "samples": total,
        "waiting_samples": waiting,
        "rate_hz": SPY_HZ,
        "seconds": round(wall, 1),
        "requests": requests,
        "front_cpu_ms_per_request": round(cpu_ms, 2),
        "own": {k: round(v / max(total, 1), 3) for k, v in own.most_common(16)},
        "inclusive": {k: round(v / max(total, 1), 3) for k, v in top},
        "failed": len(rnd.errors),
        "load_avg": load_avg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device(ap)
    ap.add_argument("--quick", action="store_true", help="small counts for a smoke run (minutes, not ten)")
    ap.add_argument("--streams", type=int, default=None, help="concurrent clients (default 16)")
    ap.add_argument("--requests", type=int, default=None, help="requests per client per round (16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 64)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds of each target (3)")
    ap.add_argument("--adapters", type=int, default=6, help="adapters in the load, beside the base (6)")
    ap.add_argument("--max-loras", type=int, default=4, help="each replica's LoRA slots (4)")
    ap.add_argument("--promotions", type=int, default=None, help="timed promotions each (10)")
    ap.add_argument("--profile", action="store_true", help="one more round on a front under py-spy")
    ap.add_argument(
        "--profile-target",
        choices=("front", "front 1x", "front 2x"),
        default="front",
        help="the front --profile samples (front)",
    )
    ap.add_argument("--py-spy", default=None, help="the py-spy program (default: on PATH)")
    ap.add_argument("--profile-out", type=Path, default=None, help="keep py-spy's raw stacks in this file")
    ap.add_argument("--profile-top", type=int, default=30, help="functions the profile lists (30)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds for the replicas to start")
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for one part's timed loop")
    args = ap.parse_args()
    stop_servers_on_kill()
    args.device = checked_device(ap, args.device)
    full = dict(streams=16, requests=16, new_tokens=64, rounds=3, promotions=10)
    quick = dict(streams=4, requests=2, new_tokens=16, rounds=1, promotions=2)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if min(args.streams, args.requests, args.new_tokens, args.rounds, args.adapters, args.max_loras) < 1:
        ap.error("--streams, --requests, --new-tokens, --rounds, --adapters and --max-loras must be >= 1")
    py_spy = args.py_spy or shutil.which("py-spy")
    if args.profile and not py_spy:
        ap.error("--profile needs py-spy (pip install py-spy; --py-spy PATH)")
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"no vLLM interpreter at {VLLM_PYTHON}: set MINT_VLLM_PYTHON")

    t0 = time.perf_counter()
    load_before = load_avg()
    results: dict[str, dict[str, Any]] = {}
    with fleet(args) as f:
        for name, part in (("load", part_load), ("promotion", part_promotion)):
            t = time.perf_counter()
            res = part(f, args)
            res["seconds"] = round(time.perf_counter() - t, 1)
            if name == "load":
                print_load(res)
            results[name] = res
            report(res)
        if args.profile:
            assert py_spy is not None
            results["front_profile"] = part_profile(f, args, py_spy)
            report(results["front_profile"])
    rows = results["load"]["targets"]
    summary: dict[str, Any] = {
        "figure": "summary",
        "front_over_bare": rows["front"]["vs_bare"],
        "front_over_bare_ci95": rows["front"]["vs_bare_ci95"],
        "front_1x_over_bare": rows["front 1x"]["vs_bare"],
        "front_1x_over_bare_ci95": rows["front 1x"]["vs_bare_ci95"],
        "front_2x_over_bare": rows["front 2x"]["vs_bare"],
        "two_over_front": round(rows["front 2x"]["tok_s"] / rows["front"]["tok_s"], 3),
        "slot_loads_per_1k_front": rows["front"]["slot_loads_per_1k"],
        "slot_loads_per_1k_front_2x": rows["front 2x"]["slot_loads_per_1k"],
        "share_front_2x": rows["front 2x"]["share"],
    }
    summary["promotion_r2_over_r1"] = results["promotion"]["r2_over_r1"]
    summary |= {
        "figures": list(results),
        "failed": sum(r["failed"] for r in results.values()),
        "quick": args.quick,
        "device": args.device,
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": load_avg(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    report(summary)


if __name__ == "__main__":
    main()
