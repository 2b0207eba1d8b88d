"""Serving under load: 64 concurrent streaming completions over 32 adapters, against the same load on the base.

Setup: a `mint serve` subprocess on 127.0.0.1 (the built-in tiny-dense base, or `--base DIR`) with max_loras 32
and max_num_seqs 64; 32 adapters (rank 8 on q,k,v,o, random weights) written into a temporary store, loaded
over the admin route and warmed into their device slots. A wave is 64 streaming /v1/completions sent at once
(asyncio + httpx), request i on adapter i % 32, each a 32-token prompt (token ids, so any tokenizer gives 32)
and 64 new tokens (greedy, EOS ignored); the same wave with `model` = the base's name is the baseline. Waves
alternate adapters/base (after one warm-up wave of each) so drift in machine speed hits both alike.

Figures (over all timed waves of a kind):
  tokens_per_s        generated tokens (the server's usage counts) / summed wave wall time
  ttft_p50/p99        ms from sending a request to its first chunk with text (client side, HTTP included)
  itl_p99             ms between consecutive chunks with text of one request
  engine_ttft_mean    ms from submission to the engine to the first token (the server's own histogram):
                      the difference to ttft is HTTP handling and event-loop queueing in both processes
  vs_base             tokens_per_s with adapters / tokens_per_s on the base. Target >= 0.8.
A stream holds its text back while it ends in U+FFFD (a character perhaps still being spelled in bytes); the
random tiny bases emit many bytes that are not UTF-8, so one chunk often carries several tokens, and ITL is
between chunks, not tokens.

The server gets `--server-threads` torch threads (default 1): the load generator runs on the same machine, and
torch's OpenMP workers, preempted by it mid-step, stall decode steps when they oversubscribe the cores. All
traffic goes to the server this script started; every loop is bounded in count and in time.

    python benchmarks/serving_load.py [--base tiny-dense|DIR] [--waves 3] [--server-threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, pct, report, stop_servers_on_kill

from mint_core.engine.base import Base, build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_testkit.harness import ADMIN_TOKEN, server_log, start_server, stop_server

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Server:
    """A `mint serve` subprocess on loopback (its log goes to a file; see `tail`)."""

    def __init__(
        self, store: Path, base: str, max_loras: int, max_num_seqs: int, threads: int, device: str = "cpu"
    ):
        env = {
            "OMP_NUM_THREADS": str(threads),
            "MINT_SERVE_MAX_NUM_SEQS": str(max_num_seqs),
            "MINT_SERVE_LOG_LEVEL": "warning",
        }
        self.proc, self.url = start_server(
            store, "--base", base, "--max-loras", str(max_loras), "--device", device, env=env
        )

    def stop(self) -> int:
        return stop_server(self.proc)


def local_base(base: str) -> tuple[Base, str]:
    """A base equal to the served one (to build adapters for it) and its served name."""
    if base.startswith("tiny-"):
        family = base.removeprefix("tiny-")
        return build_tiny_base(family, seed=0, tokenizer=byte_tokenizer()), base  # type: ignore[arg-type]
    return load_base(base), Path(base).name


def write_adapters(base: Base, store: Path, n: int, rank: int) -> list[str]:
    names = []
    for i in range(n):
        a = random_adapter(base.sites, TARGETS, rank, seed=100 + i, base_fingerprint=base.fingerprint)
        save_adapter(a, store / f"adapter{i:02d}", base.sites)
        names.append(f"adapter{i:02d}")
    return names


@dataclass
class Wave:
    server_ttft: tuple[float, float] = (
        0.0,
        0.0,
    )  # (sum of seconds, count) of the server's own TTFT histogram
    wall_s: float = 0.0
    tokens: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], new_tokens: int, wave: Wave
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    last: float | None = None
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("text") for c in chunk["choices"]):
                    now = time.perf_counter()
                    if last is None:
                        wave.ttft.append(now - sent)
                    else:
                        wave.itl.append(now - last)
                    last = now
        if usage is None:
            raise RuntimeError("the stream carried no usage")
        wave.tokens += int(usage["completion_tokens"])
    except Exception as e:
        wave.failed += 1
        wave.errors.append(f"{type(e).__name__}: {e}")


async def server_ttft(client: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of mint_time_to_first_token_seconds: from submission to the engine to its first token."""
    found = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(
            ("mint_time_to_first_token_seconds_sum ", "mint_time_to_first_token_seconds_count ")
        ):
            name, value = line.split()
            found[name.rsplit("_", 1)[1]] = float(value)
    return found.get("sum", 0.0), found.get("count", 0.0)


async def run_wave(
    client: httpx.AsyncClient, models: list[str], prompts: list[list[int]], new_tokens: int, timeout: float
) -> Wave:
    wave = Wave()
    before = await server_ttft(client)
    t0 = time.perf_counter()
    tasks = [
        asyncio.create_task(one_request(client, m, p, new_tokens, wave))
        for m, p in zip(models, prompts, strict=True)
    ]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
        wave.failed += 1
        wave.errors.append(f"no answer in {timeout:.0f} s")
    await asyncio.gather(*pending, return_exceptions=True)
    wave.wall_s = time.perf_counter() - t0
    after = await server_ttft(client)
    wave.server_ttft = (after[0] - before[0], after[1] - before[1])
    return wave


def summary(waves: list[Wave]) -> dict[str, float]:
    ttft = [x for w in waves for x in w.ttft]
    itl = [x for w in waves for x in w.itl]
    return {
        "tokens_per_s": sum(w.tokens for w in waves) / sum(w.wall_s for w in waves),
        "ttft_p50_ms": pct(ttft, 50) * 1e3,
        "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "itl_p99_ms": pct(itl, 99) * 1e3,
        "server_ttft_mean_ms": 1e3
        * sum(w.server_ttft[0] for w in waves)
        / max(1, sum(w.server_ttft[1] for w in waves)),
        "failed": sum(w.failed for w in waves),
        "requests": sum(len(w.ttft) for w in waves) + sum(w.failed for w in waves),
    }


async def bench(args: argparse.Namespace, url: str, adapters: list[str], base_name: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    vocab_hi = 256  # byte tokens for the tiny bases; ordinary ids for a real vocabulary
    prompts = [
        torch.randint(0, vocab_hi, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.concurrency)
    ]
    limits = httpx.Limits(
        max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8
    )
    deadline = time.monotonic() + args.time_limit
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        for name in adapters:
            r = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name}, headers=ADMIN
            )
            r.raise_for_status()
        kinds = {
            "adapters": [adapters[i % len(adapters)] for i in range(args.concurrency)],
            "base": [base_name] * args.concurrency,
        }
        waves: dict[str, list[Wave]] = {k: [] for k in kinds}
        for k, models in kinds.items():  # warm-up: slots written, code paths and sockets warm
            w = await run_wave(client, models, prompts, args.new_tokens, timeout=120)
            if w.failed:
                raise SystemExit(f"warm-up wave on {k} failed: {w.errors[:3]}")
        for n in range(args.waves):
            for k, models in kinds.items():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                w = await run_wave(client, models, prompts, args.new_tokens, timeout=min(120.0, left))
                waves[k].append(w)
                print(
                    f"  wave {n} {k:8s} {w.tokens / w.wall_s:8.1f} tokens/s  {w.wall_s:5.2f} s  failed {w.failed}",
                    flush=True,
                )
        if not all(waves.values()):
            raise SystemExit("the time limit left no timed wave of each kind")
    errors = [e for ws in waves.values() for w in ws for e in w.errors]
    if errors:
        print(f"  {len(errors)} failed requests, e.g. {errors[:3]}")
    return {k: summary(ws) for k, ws in waves.items()} | {
        "timed_waves": min(len(ws) for ws in waves.values())
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", default="tiny-dense", help="tiny-dense|tiny-moe|tiny-mla|tiny-dsa or a model directory"
    )
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight in one wave")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3, help="timed waves of each kind")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of the server process")
    ap.add_argument("--time-limit", type=float, default=150.0, help="seconds for the timed waves, at most")
    add_device(ap)  # the server's
    args = ap.parse_args()
    stop_servers_on_kill()
    checked_device(ap, args.device)

    base, base_name = local_base(args.base)
    store = Path(tempfile.mkdtemp(prefix="mint-serving-load-"))
    t0 = time.perf_counter()
    server: Server | None = None
    try:
        adapters = write_adapters(base, store, args.adapters, args.rank)
        del base
        server = Server(store, args.base, args.adapters, args.concurrency, args.server_threads, args.device)
        print(f"server up at {server.url} in {time.perf_counter() - t0:.1f} s", flush=True)
        res = asyncio.run(bench(args, server.url, adapters, base_name))
    except BaseException:
        if server is not None:
            print("server log (last lines):\n" + server_log(server.proc)[-4000:], file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(store, ignore_errors=True)

    a, b = res["adapters"], res["base"]
    print(
        f"base={args.base} adapters={args.adapters} rank={args.rank} concurrency={args.concurrency} "
        f"prompt={args.prompt_tokens} new={args.new_tokens} timed waves={res['timed_waves']} of each "
        f"(interleaved) server threads={args.server_threads}"
    )
    print(
        f"  {'':9s} {'tokens/s':>9s} {'ttft p50':>9s} {'ttft p99':>9s} {'itl p99':>8s} {'engine ttft':>12s}"
        "  (ms)  failed"
    )
    for k, s in (("adapters", a), ("base", b)):
        print(
            f"  {k:9s} {s['tokens_per_s']:9.1f} {s['ttft_p50_ms']:9.1f} {s['ttft_p99_ms']:9.1f} "
            f"{s['itl_p99_ms']:8.1f} {s['server_ttft_mean_ms']:12.1f}        {s['failed']}"
        )
    print(f"  vs_base {a['tokens_per_s'] / b['tokens_per_s']:.3f}   total {time.perf_counter() - t0:.1f} s")
    report(
        {
            "tokens_per_s": round(a["tokens_per_s"], 1),
            "ttft_p50_ms": round(a["ttft_p50_ms"], 1),
            "ttft_p99_ms": round(a["ttft_p99_ms"], 1),
            "itl_p99_ms": round(a["itl_p99_ms"], 1),
            "vs_base": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
            "base_tokens_per_s": round(b["tokens_per_s"], 1),
            "base_ttft_p50_ms": round(b["ttft_p50_ms"], 1),
            "base_ttft_p99_ms": round(b["ttft_p99_ms"], 1),
            "base_itl_p99_ms": round(b["itl_p99_ms"], 1),
            "engine_ttft_mean_ms": round(a["server_ttft_mean_ms"], 1),
            "base_engine_ttft_mean_ms": round(b["server_ttft_mean_ms"], 1),
            "failed": a["failed"] + b["failed"],
            "requests": a["requests"] + b["requests"],
            "timed_waves": res["timed_waves"],
            "server_threads": args.server_threads,
            "device": args.device,
        }
    )


if __name__ == "__main__":
    main()
