"""The two serving backends side by side: mint serve against vLLM behind mint's front, one base, 4 figures.

Both serve the same base: the tiny dense Llama with head_dim 32 (mint_testkit.harness
`save_tiny_base(vllm=True)`; vLLM's CPU attention needs head_dim >= 32), float32, written once to a temporary
Hugging Face directory. mint: `mint serve --base <dir>`. vLLM: the interpreter MINT_VLLM_PYTHON names (default
.venv-vllm/bin/python), started by mint_testkit's `start_vllm` (loopback, its own key, max_loras 4, max rank 16),
behind `mint serve --backend vllm` (the front, `start_front`). Each backend has its own adapter
store; every adapter is rank 8 on q,k,v,o with random weights, written into both. Every server computes on one
CPU thread: on a 2-core machine vLLM binds its worker to one core (and keeps the other for its scheduler), and
mint serve gets MINT_SERVE_TORCH_THREADS=1. mint serve and the front log at warning (no access log); vLLM runs
without its access log (as mint's VLLMConfig starts it).

Figures (one JSON line each, "figure" naming it, then a "summary" line with the ratios):

  decode    Mixed-adapter decode. --streams (16) concurrent closed-loop clients each send --requests (16)
            non-streaming completions one after another: a 16-token prompt, --new-tokens (64) new tokens,
            ignore_eos, temperature 0; client i's request j names model (i + j) % 3 of the base, "a", "b".
            The same load on mint serve, on vLLM through the front and on vLLM directly (its key, no front):
            a warm-up round each, then --rounds (3) rounds interleaved (mint, front, direct) so drift hits
            all alike. tok/s = completion tokens (usage) / summed round wall time; p50 request latency.
            Ratios: mint / vLLM (through the front), and front / direct (the front's overhead).
  servable  Store -> servable. A new revision is in the store; t0 = POST /v1/load_lora_adapter under a new
            name, t1 = the first completion under that name (1 token, greedy) has answered with the
            revision's digest as system_fingerprint. mint serve (read, validate, host cache; the slot is
            written at the first request) against the front (mint's validation and store copy, then vLLM's
            load). --revisions (20) each, interleaved, after 2 warm-ups; medians, with the split load / first
            answer. The name is unloaded afterwards (untimed). Ratio mint / vLLM.
  handoff   A new revision's first answer on vLLM. In place: t0 = the trainer holds the new adapter in
            memory; write it into the store, POST load_inplace of name "h" on the front, t1 = its first
            completion (1 token) answered with the new digest. Merged (serving without adapters): t0 = the
            same; W + scale * B @ A on every targeted linear of the trainer's copy of the base, written as a
            Hugging Face directory (model.safetensors beside the base's config and tokenizer files), a fresh
            vLLM started on it (`start_vllm`, which polls /health once a second: up to 1 s of the figure),
            t1 = its first completion answered. --handoff-rounds (5) in place and --merged-rounds (2) merged,
            interleaved, each after --gap (1) s idle; medians. The merged model's 8 greedy tokens are
            compared with the same adapter's through the front (merged_matches_adapter): the baseline serves
            the same model. Ratio merged / in place.
  hot_swap  8 clients (4 streaming, 4 not) loop greedy completions (max_tokens 16) on "p" through the front
            for --duration (60) s while every --swap-every (5) s "p" is loaded in place with v2 (promote) or
            v1 (rollback), alternately. requests; failed (raised, or not a whole 200); mixed (a stream whose
            events carry two fingerprints, a fingerprint of neither revision, or a text that is not exactly
            the greedy text recorded for the revision its fingerprint names); overlapped (in flight while a
            swap was: the front holds a swap until the requests before it end, and new ones until it is
            done); promotes, rollbacks, swap p50/p99 (the admin POST as the client sees it). Targets:
            failed = 0, mixed = 0.

`--quick`: 4 streams x 1 request x 16 tokens, 1 round; 3 revisions; 2 in-place and 1 merged handoff; 10 s of
hot swapping, a swap every 2.5 s (about 4 minutes, most of it two vLLM starts). One vLLM and its front serve
every part (the merged baseline starts its own vLLMs); mint serve runs for the parts that measure it. Idle,
vLLM takes no CPU, so the server not under test does not slow the one that is. Every figure line carries the
load average after its part (`load_avg`): on a shared machine the figures are only as steady as it. All
traffic goes to servers this script started; every loop is bounded in count and in time.

    MINT_VLLM_PYTHON=... python benchmarks/serving_backends.py [--quick] [--only 1,2,3,4] [--duration 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checked, load_avg, pct, report, stop_servers_on_kill
from handoff import merge, unique_state
from hot_swap import ask

from mint_core.engine.base import Base, load_base
from mint_core.lora.adapter import WEIGHTS_FILE, AdapterWeights, random_adapter, save_adapter
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_BASE_NAME,
    VLLM_KEY,
    VLLM_PYTHON,
    free_port,
    save_tiny_base,
    server_log,
    start_front,
    start_server,
    start_vllm,
    stop_server,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
# the admin token start_server sets, on mint serve and on the front alike
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT = "Which backend answers this one?"
# This script's own connections: uvicorn (mint serve, the front, vLLM) closes one idle for 5 s, and httpx's pool
# keeps one 5 s by default; a request sent on one as the server closes it would fail here, not in the server.
POOL = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=1.0)
PARTS = {1: "decode", 2: "servable", 3: "handoff", 4: "hot_swap"}


@dataclass
class Backends:
    """The base, one store per backend, and the servers of this run (stopped by `backends`)."""

    work: Path
    base_dir: Path
    base: Base
    stores: dict[str, Path]  # "mint", "vllm"
    mint_url: str = ""
    front_url: str = ""
    vllm_url: str = ""
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    seed: int = 1000

    def adapter(self) -> AdapterWeights:
        """A new revision (fresh random weights), in memory."""
        self.seed += 1
        return random_adapter(
            self.base.sites, TARGETS, RANK, seed=self.seed, base_fingerprint=self.base.fingerprint
        )

    def write(self, name: str, adapter: AdapterWeights | None = None, only: str | None = None) -> str:
        """`adapter` (a new one by default) into each store (or store `only`) as `name`; its digest."""
        adapter = adapter or self.adapter()
        digest = ""
        for key, store in self.stores.items():
            if only in (None, key):
                digest = str(save_adapter(adapter, store / name, self.base.sites))
        return digest


@contextmanager
def backends(mint: bool, vllm: bool) -> Iterator[Backends]:
    """mint serve and/or vLLM + its front on the tiny head_dim-32 base; all stopped (and the files removed) on
    exit, with the servers' last log lines on stderr when the run failed."""
    work = Path(tempfile.mkdtemp(prefix="mint-serving-backends-"))
    base_dir = save_tiny_base(work / VLLM_BASE_NAME, vllm=True)
    stores = {k: work / f"store-{k}" for k in ("mint", "vllm")}
    for s in stores.values():
        s.mkdir()
    b = Backends(work, base_dir, load_base(base_dir), stores)  # as both servers fingerprint it
    os.environ["MINT_SERVE_LOG_LEVEL"] = "warning"  # mint serve and the front alike: no access log
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        try:
            if mint:
                env = {"MINT_SERVE_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "MINT_SERVE_TINKER": "false"}
                proc, b.mint_url = start_server(stores["mint"], "--base", str(base_dir), env=env)
                stack.callback(stop_server, proc)
                b.procs.append(proc)
            if vllm:
                vport, fport = free_port(), free_port()
                t = time.perf_counter()
                proc = start_vllm(base_dir, vport, None, work / "vllm.log")
                stack.callback(stop_server, proc, 60)
                b.procs.append(proc)
                b.vllm_url = f"http://127.0.0.1:{vport}"
                print(f"vLLM up in {time.perf_counter() - t:.1f} s", flush=True)
                proc, b.front_url = start_front(b.vllm_url, stores["vllm"], base_dir, fport, None)
                stack.callback(stop_server, proc)
                b.procs.append(proc)
            yield b
        except BaseException:
            for p in b.procs:
                print(f"--- log of pid {p.pid} (last lines):\n{server_log(p)[-3000:]}", file=sys.stderr)
            raise


def first_answer(http: httpx.Client, model: str, digest: str, max_tokens: int = 1) -> str:
    """One greedy completion of PROMPT under `model`, answered by revision `digest` (or raises); its text."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    out = checked(http.post("/v1/completions", json=body), f"completion on {model}").json()
    if out["system_fingerprint"] != digest:
        raise RuntimeError(f"{model} answered as {out['system_fingerprint']}, expected {digest}")
    return str(out["choices"][0]["text"])


# -- 1. mixed-adapter decode ---------------------------------------------------------------------------------


@dataclass
class Round:
    wall_s: float = 0.0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def closed_loop(
    url: str, headers: dict[str, str], models: list[str], args: argparse.Namespace, requests: int
) -> Round:
    """`args.streams` clients, each sending `requests` completions one after another."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (16,), generator=g).tolist() for _ in range(args.streams)]
    rnd = Round()
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=POOL, timeout=300) as client:

        async def lane(i: int) -> None:
            for j in range(requests):
                body = {
                    "model": models[(i + j) % len(models)],
                    "prompt": prompts[i],
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


def part_decode(b: Backends, args: argparse.Namespace) -> dict[str, Any]:
    base_name = b.base_dir.name
    for name in ("a", "b"):
        b.write(name)
        for url in (b.mint_url, b.front_url):
            checked(
                httpx.post(
                    url + "/v1/load_lora_adapter",
                    json={"lora_name": name, "lora_path": name},
                    headers=ADMIN,
                    timeout=120,
                ),
                f"load {name}",
            )
    models = [base_name, "a", "b"]
    targets = {
        "mint": (b.mint_url, {}),
        "front": (b.front_url, {}),
        "direct": (b.vllm_url, {"Authorization": f"Bearer {VLLM_KEY}"}),  # vLLM itself, past the front
    }
    for k, (url, headers) in targets.items():  # warm-up: slots written, code paths and sockets warm
        w = asyncio.run(closed_loop(url, headers, models, args, 1))
        if w.errors:
            raise RuntimeError(f"warm-up on {k} failed: {w.errors[:3]}")
    rounds: dict[str, list[Round]] = {k: [] for k in targets}
    deadline = time.monotonic() + args.time_limit
    for n in range(args.rounds):
        if time.monotonic() > deadline:
            break
        for k, (url, headers) in targets.items():
            rnd = asyncio.run(closed_loop(url, headers, models, args, args.requests))
            rounds[k].append(rnd)
            print(
                f"  decode round {n} {k:6s} {rnd.tokens / rnd.wall_s:8.1f} tok/s  {rnd.wall_s:6.2f} s  "
                f"failed {len(rnd.errors)}",
                flush=True,
            )
    tok_s = {k: sum(r.tokens for r in rs) / sum(r.wall_s for r in rs) for k, rs in rounds.items()}
    errors = [e for rs in rounds.values() for r in rs for e in r.errors]
    for e in errors[:3]:
        print(f"  e.g. {e}", file=sys.stderr)
    out: dict[str, Any] = {"figure": "decode"}
    for k, rs in rounds.items():
        out[f"{k}_tok_s"] = round(tok_s[k], 1)
        out[f"{k}_latency_p50_ms"] = round(pct([x for r in rs for x in r.latencies], 50) * 1e3, 1)
    return out | {
        "mint_over_vllm": round(tok_s["mint"] / tok_s["front"], 3),
        "front_over_direct": round(tok_s["front"] / tok_s["direct"], 3),
        "rounds": min(len(rs) for rs in rounds.values()),
        "streams": args.streams,
        "requests_per_stream": args.requests,
        "new_tokens": args.new_tokens,
        "requests": sum(len(r.latencies) + len(r.errors) for rs in rounds.values() for r in rs),
        "failed": len(errors),
        "load_avg": load_avg(),
    }


# -- 2. store -> servable ------------------------------------------------------------------------------------


def servable_once(http: httpx.Client, name: str, digest: str) -> tuple[float, float]:
    """(load s, load to first answer s) of revision `name` (in the store) under the new name `name`."""
    t0 = time.perf_counter()
    checked(
        http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name}, headers=ADMIN),
        f"load {name}",
    )
    t1 = time.perf_counter()
    first_answer(http, name, digest)
    t2 = time.perf_counter()
    checked(http.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN), f"unload {name}")
    return t1 - t0, t2 - t0


def part_servable(b: Backends, args: argparse.Namespace) -> dict[str, Any]:
    clients = {
        "mint": httpx.Client(base_url=b.mint_url, limits=POOL, timeout=300),
        "vllm": httpx.Client(base_url=b.front_url, limits=POOL, timeout=300),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in clients}
    deadline = time.monotonic() + args.time_limit
    try:
        for i in range(-2, args.revisions):  # two untimed warm-ups
            if time.monotonic() > deadline:
                break
            name = f"new{i + 2:03d}"
            digest = b.write(name)  # a new revision, in both stores
            for k, http in clients.items():
                t = servable_once(http, name, digest)
                if i >= 0:
                    times[k].append(t)
    finally:
        for http in clients.values():
            http.close()
    med = {
        k: (statistics.median(x for x, _ in ts), statistics.median(y for _, y in ts))
        for k, ts in times.items()
    }
    for k, (load, total) in med.items():
        print(
            f"  servable {k:5s} load {load * 1e3:7.1f} ms  to first answer {total * 1e3:7.1f} ms", flush=True
        )
    return {
        "figure": "servable",
        "mint_ms": round(med["mint"][1] * 1e3, 1),
        "vllm_ms": round(med["vllm"][1] * 1e3, 1),
        "mint_load_ms": round(med["mint"][0] * 1e3, 1),
        "vllm_load_ms": round(med["vllm"][0] * 1e3, 1),
        "mint_p90_ms": round(pct([y for _, y in times["mint"]], 90) * 1e3, 1),
        "vllm_p90_ms": round(pct([y for _, y in times["vllm"]], 90) * 1e3, 1),
        "mint_over_vllm": round(med["mint"][1] / med["vllm"][1], 3),
        "revisions": min(len(ts) for ts in times.values()),
        "failed": 0,  # any failure raises
        "load_avg": load_avg(),
    }


# -- 3. handoff on vLLM: in place against a merged model ------------------------------------------------


def merged_handoff(
    b: Backends, state: dict[str, torch.Tensor], adapter: AdapterWeights, out_dir: Path
) -> tuple[float, str]:
    """Seconds from the adapter in memory to the first answer of a fresh vLLM on the merged model; its 8
    greedy tokens (untimed)."""
    t0 = time.perf_counter()
    merged = merge(state, adapter, b.base.sites)
    out_dir.mkdir()
    for f in b.base_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out_dir / f.name)
    save_file(merged, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del merged
    port = free_port()
    proc = start_vllm(out_dir, port, None, b.work / f"{out_dir.name}.log")
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {VLLM_KEY}"},
            limits=POOL,
            timeout=300,
        ) as http:
            body = {"model": out_dir.name, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
            checked(http.post("/v1/completions", json={**body, "max_tokens": 1}), "merged completion")
            seconds = time.perf_counter() - t0
            text = checked(http.post("/v1/completions", json={**body, "max_tokens": 8}), "merged").json()
    finally:
        stop_server(proc, timeout=60)
    shutil.rmtree(out_dir, ignore_errors=True)
    return seconds, str(text["choices"][0]["text"])


def part_handoff(b: Backends, args: argparse.Namespace) -> dict[str, Any]:
    store = b.stores["vllm"]
    http = httpx.Client(base_url=b.front_url, limits=POOL, timeout=300)
    inplace: list[float] = []
    merged: list[float] = []
    matches: list[bool] = []
    n = 0

    def to_front(adapter: AdapterWeights) -> str:
        nonlocal n
        n += 1
        digest = b.write(f"h-{n:03d}", adapter, only="vllm")
        checked(
            http.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "h", "lora_path": f"h-{n:03d}", "load_inplace": True},
                headers=ADMIN,
            ),
            "load h",
        )
        return digest

    try:
        digest = to_front(b.adapter())  # "h" exists and has answered once: every timed load is in place
        first_answer(http, "h", digest)
        state = unique_state(b.base)  # the trainer's copy of the base, to merge into
        deadline = time.monotonic() + args.time_limit
        for i in range(max(args.handoff_rounds, args.merged_rounds)):
            if time.monotonic() > deadline:
                break
            if i < args.handoff_rounds:
                time.sleep(args.gap)  # idle OpenMP workers of the last step (or vLLM) stop spinning first
                adapter = b.adapter()  # t0: the trainer holds it
                t0 = time.perf_counter()
                digest = to_front(adapter)
                first_answer(http, "h", digest)
                inplace.append(time.perf_counter() - t0)
                print(f"  handoff in place {inplace[-1] * 1e3:8.1f} ms", flush=True)
            if i < args.merged_rounds:
                time.sleep(args.gap)
                adapter = b.adapter()
                seconds, text = merged_handoff(b, state, adapter, b.work / f"merged-{i}")
                merged.append(seconds)
                digest = to_front(adapter)  # the same revision as an adapter, untimed: the same model?
                matches.append(first_answer(http, "h", digest, max_tokens=8) == text)
                print(f"  handoff merged   {seconds * 1e3:8.1f} ms  (same text: {matches[-1]})", flush=True)
    finally:
        http.close()
    adapter_bytes = (store / f"h-{n:03d}" / WEIGHTS_FILE).stat().st_size
    merged_bytes = (b.base_dir / "model.safetensors").stat().st_size
    return {
        "figure": "handoff",
        "inplace_ms": round(statistics.median(inplace) * 1e3, 1),
        "merged_ms": round(statistics.median(merged) * 1e3, 1),
        "merged_over_inplace": round(statistics.median(merged) / statistics.median(inplace), 1),
        "merged_matches_adapter": all(matches),
        "inplace_rounds": len(inplace),
        "merged_rounds": len(merged),
        "adapter_bytes": adapter_bytes,
        "merged_bytes": merged_bytes,
        "failed": 0,  # any failure raises
        "load_avg": load_avg(),
    }


# -- 4. hot swap under load on vLLM ---------------------------------------------------------------------


@dataclass
class Answer:
    sent: float
    done: float
    fingerprint: str  # "" when failed; "a,b" when one stream named two
    text: str
    error: str = ""


def part_hot_swap(b: Backends, args: argparse.Namespace) -> dict[str, Any]:
    url, max_tokens = b.front_url, 16
    digests = {v: b.write(f"p-{v}", only="vllm") for v in ("v1", "v2")}
    by_digest = {d: v for v, d in digests.items()}
    admin = httpx.Client(base_url=url, headers=ADMIN, limits=POOL, timeout=300)

    def swap(v: str, inplace: bool = True) -> float:
        t0 = time.perf_counter()
        checked(
            admin.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "p", "lora_path": f"p-{v}", "load_inplace": inplace},
            ),
            f"swap to {v}",
        )
        return time.perf_counter() - t0

    texts = {}
    with httpx.Client(base_url=url, timeout=60) as c:
        for i, v in enumerate(("v1", "v2")):
            swap(v, inplace=i > 0)
            fp, texts[v] = ask(c, False, max_tokens)
            if fp != digests[v]:
                raise RuntimeError(f"{v} answered as {fp}")
    if texts["v1"] == texts["v2"]:
        raise RuntimeError("the two revisions answer alike: a swap could not be told from no swap")
    swap("v1")

    answers: list[Answer] = []
    lock = threading.Lock()
    stop = threading.Event()
    start = time.monotonic()
    deadline = start + args.duration

    def client(i: int) -> None:
        with httpx.Client(base_url=url, limits=POOL, timeout=60) as c:
            for _ in range(1_000_000):  # bounded in count and in time
                if stop.is_set() or time.monotonic() > deadline:
                    return
                sent = time.monotonic()
                try:
                    fp, text = ask(c, i % 2 == 1, max_tokens)
                    a = Answer(sent, time.monotonic(), fp, text)
                except Exception as e:
                    a = Answer(sent, time.monotonic(), "", "", f"{type(e).__name__}: {e}")
                with lock:
                    answers.append(a)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    every = min(args.swap_every, args.duration / 3)  # at least a promote and a rollback
    swaps: list[tuple[float, float, str]] = []  # (sent, returned, revision)
    latencies: list[float] = []
    swap_errors: list[str] = []
    try:
        for n in range(100_000):
            next_at = start + (n + 1) * every
            if next_at > deadline:
                break
            time.sleep(max(0.0, next_at - time.monotonic()))
            v = "v2" if n % 2 == 0 else "v1"
            sent = time.monotonic()
            try:
                latencies.append(swap(v))
            except Exception as e:
                swap_errors.append(f"{type(e).__name__}: {e}")
            swaps.append((sent, time.monotonic(), v))
        time.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        admin.close()
    hung = sum(t.is_alive() for t in threads)
    failed = [a for a in answers if a.error]
    mixed = [
        a
        for a in answers
        if not a.error and (a.fingerprint not in by_digest or a.text != texts[by_digest[a.fingerprint]])
    ]
    overlapped = sum(any(a.sent < r and a.done > s for s, r, _ in swaps) for a in answers)
    for a in (failed + mixed)[:3]:
        print(f"  e.g. {a.error or (a.fingerprint[:40], a.text)!r}", file=sys.stderr)
    for e in swap_errors[:3]:
        print(f"  swap error: {e}", file=sys.stderr)
    lat_ms = [x * 1e3 for x in latencies]
    return {
        "figure": "hot_swap",
        "requests": len(answers),
        "failed": len(failed) + hung,
        "mixed": len(mixed),
        "overlapped": overlapped,
        "promotes": sum(v == "v2" for _, _, v in swaps),
        "rollbacks": sum(v == "v1" for _, _, v in swaps),
        "swap_errors": len(swap_errors),
        "swap_p50_ms": round(pct(lat_ms, 50), 1),
        "swap_p99_ms": round(pct(lat_ms, 99), 1),
        "swap_max_ms": round(max(lat_ms, default=float("nan")), 1),
        "revisions_seen": len({a.fingerprint for a in answers if a.fingerprint in by_digest}),
        "clients": len(threads),
        "duration_s": args.duration,
        "load_avg": load_avg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts for a smoke run (minutes, not ten)")
    ap.add_argument("--only", default="1,2,3,4", help="the figures to measure: 1 decode, 2 servable, ...")
    ap.add_argument("--duration", type=float, default=None, help="seconds of hot swapping (default 60)")
    ap.add_argument("--swap-every", type=float, default=None, help="seconds between swaps (default 5)")
    ap.add_argument("--streams", type=int, default=None, help="decode: concurrent clients (default 16)")
    ap.add_argument("--requests", type=int, default=None, help="decode: requests per client per round (16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode: tokens per request (default 64)")
    ap.add_argument("--rounds", type=int, default=None, help="decode: timed rounds of each target (3)")
    ap.add_argument("--revisions", type=int, default=None, help="servable: timed revisions each (20)")
    ap.add_argument("--handoff-rounds", type=int, default=None, help="handoff: in-place rounds (5)")
    ap.add_argument("--merged-rounds", type=int, default=None, help="handoff: merged rounds (2)")
    ap.add_argument("--gap", type=float, default=1.0, help="handoff: idle seconds before each round")
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for one part's timed loop")
    args = ap.parse_args()
    stop_servers_on_kill()
    full = dict(
        duration=60.0,
        swap_every=5.0,
        streams=16,
        requests=16,
        new_tokens=64,
        rounds=3,
        revisions=20,
        handoff_rounds=5,
        merged_rounds=2,
    )
    quick = dict(
        duration=10.0,
        swap_every=2.5,
        streams=4,
        requests=1,
        new_tokens=16,
        rounds=1,
        revisions=3,
        handoff_rounds=2,
        merged_rounds=1,
    )
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        only = sorted({int(x) for x in args.only.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--only takes numbers 1-4 separated by commas, not {args.only!r}")
    if not only or not set(only) <= set(PARTS):
        ap.error(f"--only takes numbers 1-4 separated by commas, not {args.only!r}")
    if args.duration <= 0 or args.swap_every <= 0:
        ap.error("--duration and --swap-every must be positive")
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"no vLLM interpreter at {VLLM_PYTHON}: set MINT_VLLM_PYTHON")

    t0 = time.perf_counter()
    load_before = load_avg()
    results: dict[str, dict[str, Any]] = {}
    parts = {1: part_decode, 2: part_servable, 3: part_handoff, 4: part_hot_swap}
    with backends(mint=bool({1, 2} & set(only)), vllm=True) as b:
        print(f"servers up in {time.perf_counter() - t0:.1f} s (load {load_avg()})", flush=True)
        for p in only:
            t = time.perf_counter()
            res = parts[p](b, args)
            res["seconds"] = round(time.perf_counter() - t, 1)
            results[PARTS[p]] = res
            report(res)
    summary: dict[str, Any] = {"figure": "summary"}
    if "decode" in results:
        summary["decode_mint_over_vllm"] = results["decode"]["mint_over_vllm"]
        summary["decode_front_over_direct"] = results["decode"]["front_over_direct"]
    if "servable" in results:
        summary["servable_mint_over_vllm"] = results["servable"]["mint_over_vllm"]
    if "handoff" in results:
        summary["handoff_merged_over_inplace"] = results["handoff"]["merged_over_inplace"]
    if "hot_swap" in results:
        summary["hot_swap_failed"] = results["hot_swap"]["failed"]
        summary["hot_swap_mixed"] = results["hot_swap"]["mixed"]
        summary["hot_swap_swap_errors"] = results["hot_swap"]["swap_errors"]
    summary |= {
        "figures": list(results),
        "failed": sum(r["failed"] for r in results.values()),
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": load_avg(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    report(summary)


if __name__ == "__main__":
    main()
