"""Hot swaps under a steady stream: 100 in-place loads of adapter "p", alternating two revisions, while clients
keep asking "p" for greedy completions.

Setup: a `mint serve` subprocess on 127.0.0.1 (the built-in tiny-dense base, or `--base DIR`); revisions v1
and v2 of "p" (rank 8 on q,k,v,o, different random weights) in a temporary store. First the greedy text of a
fixed prompt under each revision is recorded (load v1, ask; load v2 in place, ask). Then, with v1 loaded,
`--clients` threads loop requests (max_tokens 24, temperature 0; odd threads stream, even ones do not) while
the main thread swaps "p" in place 100 times (POST /v1/load_lora_adapter, load_inplace), each swap once a few
requests sent after the previous one were answered, so that every revision serves whole requests and others
straddle the swap.

Figures:
  swaps, swap_p50_ms, swap_p99_ms   the swaps and their latency (the admin POST, as the client sees it)
  requests                          completions answered or failed during the swapping
  failed                            requests that raised or were not a 200 with a whole answer
  wrong_revision                    answers whose text is not exactly the recorded text of the revision their
                                    system_fingerprint names, whose fingerprint is of neither revision, or
                                    whose stream carried two fingerprints
  stale                             answers sent after a swap returned and finished before the next one was
                                    sent, yet served by another revision than that swap's
  straddled                         answers that were in flight while a swap was made
Targets: failed = 0, wrong_revision = 0 (and stale = 0).

The server gets `--server-threads` torch threads (default 1; see serving_load.py). All traffic goes to the
server this script started; every loop is bounded in count and in time.

    python benchmarks/hot_swap.py [--swaps 100] [--clients 4] [--time-limit 120] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, report
from serving_load import ADMIN, TARGETS, Server, local_base, server_log

from mint_core.lora.adapter import digest_dir, random_adapter, save_adapter

PROMPT = "Hot swap benchmark: which revision answers this one?"


@dataclass
class Answer:
    sent: float
    done: float
    fingerprint: str  # "" when failed; "a,b" when one stream named two
    text: str
    error: str = ""


def ask(client: httpx.Client, stream: bool, max_tokens: int) -> tuple[str, str]:
    """(fingerprint, text) of one greedy completion of PROMPT on "p"; raises on anything but a whole 200."""
    body = {"model": "p", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        r = client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        out = r.json()
        return out["system_fingerprint"], out["choices"][0]["text"]
    fps: set[str] = set()
    parts: list[str] = []
    finished = done = False
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                fps.add(chunk["system_fingerprint"])
                for c in chunk["choices"]:
                    parts.append(c["text"])
                    finished |= c["finish_reason"] is not None
    if not (finished and done):
        raise RuntimeError("the stream ended without a finish_reason and [DONE]")
    return ",".join(sorted(fps)), "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", default="tiny-dense", help="tiny-dense|tiny-moe|tiny-mla|tiny-dsa or a model directory"
    )
    ap.add_argument("--swaps", type=int, default=100)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--per-swap", type=int, default=2, help="answers sent after a swap before the next")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of the server process")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds for the swapping, at most")
    add_device(ap)  # the server's
    args = ap.parse_args()
    checked_device(ap, args.device)

    base, _ = local_base(args.base)
    store = Path(tempfile.mkdtemp(prefix="mint-hot-swap-"))
    paths = {}
    for v, seed in (("v1", 1), ("v2", 2)):
        a = random_adapter(base.sites, TARGETS, 8, seed=seed, base_fingerprint=base.fingerprint)
        save_adapter(a, store / f"p-{v}", base.sites)
        paths[v] = f"p-{v}"
    digests = {v: digest_dir(store / p) for v, p in paths.items()}
    by_digest = {d: v for v, d in digests.items()}
    del base

    server: Server | None = None
    t_start = time.perf_counter()
    try:
        server = Server(store, args.base, 8, 64, args.server_threads, args.device)
        url = server.url
        admin = httpx.Client(base_url=url, headers=ADMIN, timeout=60)

        def swap(v: str, inplace: bool = True) -> float:
            t0 = time.perf_counter()
            r = admin.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "p", "lora_path": paths[v], "load_inplace": inplace},
            )
            r.raise_for_status()
            return time.perf_counter() - t0

        texts = {}
        with httpx.Client(base_url=url, timeout=60) as c:
            for i, v in enumerate(("v1", "v2")):
                swap(v, inplace=i > 0)
                fp, texts[v] = ask(c, False, args.max_tokens)
                assert fp == digests[v], f"{v} answered as {fp}"
        if texts["v1"] == texts["v2"]:
            raise SystemExit("the two revisions answer alike: a swap could not be told from no swap")
        swap("v1")

        answers: list[Answer] = []
        lock = threading.Lock()
        stop = threading.Event()
        deadline = time.monotonic() + args.time_limit

        def client(i: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                for _ in range(100_000):  # bounded in count and in time
                    if stop.is_set() or time.monotonic() > deadline:
                        return
                    sent = time.monotonic()
                    try:
                        fp, text = ask(c, i % 2 == 1, args.max_tokens)
                        a = Answer(sent, time.monotonic(), fp, text)
                    except Exception as e:
                        a = Answer(sent, time.monotonic(), "", "", f"{type(e).__name__}: {e}")
                    with lock:
                        answers.append(a)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        swaps: list[tuple[float, float, str]] = [(0.0, time.monotonic(), "v1")]  # (sent, returned, revision)
        latencies: list[float] = []
        swap_errors: list[str] = []

        def answered_since(t: float) -> int:
            with lock:
                return sum(a.sent > t for a in answers)

        try:
            for n in range(args.swaps):
                while answered_since(swaps[-1][1]) < args.per_swap and time.monotonic() < deadline:
                    time.sleep(0.002)
                if time.monotonic() > deadline:
                    break
                v = "v2" if n % 2 == 0 else "v1"
                sent = time.monotonic()
                try:
                    latencies.append(swap(v))
                except Exception as e:
                    swap_errors.append(f"{type(e).__name__}: {e}")
                swaps.append((sent, time.monotonic(), v))
            while answered_since(swaps[-1][1]) < args.per_swap and time.monotonic() < deadline:
                time.sleep(0.002)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        admin.close()
        hung = sum(t.is_alive() for t in threads)
    except BaseException:
        if server is not None:
            print("server log (last lines):\n" + server_log(server.proc)[-4000:], file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(store, ignore_errors=True)
    duration = time.perf_counter() - t_start

    failed = [a for a in answers if a.error]
    wrong = [
        a
        for a in answers
        if not a.error and (a.fingerprint not in by_digest or a.text != texts[by_digest[a.fingerprint]])
    ]
    stale = straddled = 0
    ends = [*[s for s, _, _ in swaps[1:]], float("inf")]
    for a in answers:
        straddled += any(a.sent < sent and a.done > returned for sent, returned, _ in swaps[1:])
        if a.error or a.fingerprint not in by_digest:
            continue
        for (_, returned, v), next_sent in zip(swaps, ends, strict=True):
            if returned < a.sent and a.done < next_sent and by_digest[a.fingerprint] != v:
                stale += 1
    seen = {by_digest[a.fingerprint] for a in answers if a.fingerprint in by_digest}
    lat_ms = np.array(latencies) * 1e3 if latencies else np.array([float("nan")])

    print(
        f"base={args.base} clients={args.clients} (odd ones stream) max_tokens={args.max_tokens} "
        f"server threads={args.server_threads}"
    )
    print(
        f"  swaps {len(latencies)} (errors {len(swap_errors)})  latency p50 {np.percentile(lat_ms, 50):.1f} ms  "
        f"p99 {np.percentile(lat_ms, 99):.1f} ms  max {lat_ms.max():.1f} ms"
    )
    print(
        f"  requests {len(answers)} ({straddled} in flight across a swap)  failed {len(failed)}  "
        f"wrong_revision {len(wrong)}  stale {stale}  "
        f"revisions seen {sorted(seen)}  hung clients {hung}  total {duration:.1f} s"
    )
    for a in (failed + wrong)[:3]:
        print(f"  e.g. {a.error or (a.fingerprint[:12], a.text)!r}")
    for e in swap_errors[:3]:
        print(f"  swap error: {e}")
    report(
        {
            "swaps": len(latencies),
            "swap_errors": len(swap_errors),
            "requests": len(answers),
            "failed": len(failed) + hung,
            "wrong_revision": len(wrong),
            "stale": stale,
            "straddled": straddled,
            "swap_p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "swap_p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
            "swap_max_ms": round(float(lat_ms.max()), 2),
            "revisions_seen": len(seen),
            "clients": args.clients,
            "server_threads": args.server_threads,
            "device": args.device,
        }
    )


if __name__ == "__main__":
    main()
