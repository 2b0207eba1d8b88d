"""Trainer -> server handoff: adapter-only (mint) against merged full weights, trainer and server in separate processes.

Model (`--shape`): a Qwen2-0.5B-shaped dense model (`qwen2-0.5b`, the default: hidden 896, 24 layers, 14 heads /
2 KV heads, MLP 4864, vocab 151936, tied embeddings), or a Qwen3-4B-shaped one (`qwen3-4b`: hidden 2560, 36 layers,
32 heads / 8 KV heads, MLP 9728; 8 GB of weights), with random weights in bfloat16, saved once to a temporary
Hugging Face directory with mint's byte tokenizer (prompt ids < 259 are valid ids of the larger vocabulary).
`--shape small` (or `--small`): hidden 128, 2 layers, vocab 1000, for a quick smoke run. `--device cuda` runs the
trainer's base and both servers on the GPU.

Processes, all on 127.0.0.1:
  trainer   this script: holds each new revision of a LoRA adapter, rank 8 (and rank 1) on every linear layer
            of the decoder (q,k,v,o,gate,up,down), random float32 factors exported in the base's dtype (bf16);
            it loads the base (as a trainer does) for the merged path, which merges into its weights
  mint      `mint serve --base <dir> --adapter-root <store>` (bf16, max LoRA rank 8), adapters "policy-r8/r1"
  receiver  benchmarks/_handoff_server.py: the same base in an inference process that takes full weights; it
            answers through mint's Engine (base requests), so both paths end in the same forward code
Both paths move the new weights through the local filesystem (one directory on the same disk) and make HTTP calls:
  adapter   t0 = trainer holds the new adapter; save_adapter into a new directory of the store (PEFT's files);
            POST /v1/load_lora_adapter (load_inplace) on mint; POST /v1/completions (max_tokens 1, greedy) on
            that adapter; t1 = the answer is back and its `system_fingerprint` is the new revision's digest
  merged    (the baseline, as TRL's GRPOTrainer syncs LoRA weights into vLLM) t0 = trainer holds the new adapter,
            before merging; merge it into a copy of the base weights (W + scale * B @ A per targeted linear, bf16);
            write all weights (tied embedding once) with safetensors' save_file; POST /update_weights (the
            receiver reads the file and copies every tensor into its model); POST /generate (1 greedy token);
            t1 = the answer is back and names the new revision
Every revision is new (fresh random weights, a new directory or file). One untimed warm-up revision per path and
rank, then rounds interleaved (adapter r8, merged r8, adapter r1, merged r1) so drift in machine speed hits all
alike: `--adapter-rounds` (default 5) of the adapter path, `--merged-rounds` (default 3) of the merged one; medians.

Figures: adapter_s, merged_s (rank 8), speedup = merged_s / adapter_s (target >= 50), the same at rank 1
(adapter_s_rank1, merged_s_rank1, speedup_rank1), adapter_bytes / merged_bytes (tensor payload moved at rank 8)
and bytes_ratio. `--adapter-only`: no receiver and no merged path (the trainer then holds no copy of the base
either), for a shape whose merged baseline does not fit in memory next to the servers (qwen3-4b on a small CPU
machine): the adapter figures alone. The table splits each path into its steps (medians). Both paths end in the same one-token
forward of the base, which on a few CPU cores costs about a second and is most of the adapter path; so also:
  *_ready_s, ready_speedup(_rank1)   t0 to the server's acknowledgement of the new weights (all but the answer;
                                     mint copies an adapter into its slot at the first request, in `answer`)
  *_answer_only_s                    the same request once more right after each handoff: an answer alone

Both servers and the trainer use `--threads` torch threads (default 2); each handoff starts after `--gap` s idle
(default 0.5, so OpenMP workers left spinning by the previous one are quiet). The merged file is written and
read back through the page cache (the fastest a shared filesystem can be), so the merged figures are a lower
bound. During a merge the trainer holds the base and a merged copy of every targeted weight (its peak RSS,
printed, is about 2 GiB at the full size); each server holds one copy of the base.

    python benchmarks/handoff.py [--shape qwen2-0.5b|qwen3-4b|small] [--device cpu] [--adapter-only]
                                 [--adapter-rounds 5] [--merged-rounds 3] [--threads 2] [--gap 0.5]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHAPES, peak_rss_bytes, report, shape_config, stop_servers_on_kill

from mint_core.engine.base import Base, discover_sites, fingerprint, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import WEIGHTS_FILE, AdapterWeights, random_adapter, save_adapter
from mint_core.serving.client import ServingClient
from mint_core.types import Site
from mint_testkit.harness import ADMIN_TOKEN, free_port, server_log, start_server, stop_server

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "hand"  # 4 byte tokens
RECEIVER = Path(__file__).resolve().parent / "_handoff_server.py"


def model_config(shape: str) -> PretrainedConfig:
    if shape == "small":
        return Qwen2Config(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rope_theta=1e6,
        )
    return shape_config(shape)  # type: ignore[no-any-return]


def write_base(path: Path, shape: str, seed: int = 0) -> Base:
    """A random model of `shape` in bf16, saved as a Hugging Face directory with the byte tokenizer; returns what the
    adapter path needs of it (fingerprint, sites, name) without its weights: its model on the meta device."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    fp = fingerprint(model)  # after saving: save_pretrained completes the config as loading will see it
    del model
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model_config(shape), dtype=torch.bfloat16)
    return Base(meta, None, fp, path.name, discover_sites(meta))


def new_adapter(base: Base, rank: int, seed: int) -> AdapterWeights:
    """The trainer's new revision: rank-`rank` LoRA on every linear of the decoder, float32 factors that export
    casts to the base's dtype (bf16)."""
    a = random_adapter(base.sites, TARGETS, rank, seed=seed, base_fingerprint=base.fingerprint)
    a.dtype = torch.bfloat16
    a.base_name = base.name
    return a


def unique_state(base: Base) -> dict[str, torch.Tensor]:
    """The base's weights by name, each storage once (the tied lm_head is the embedding), as save_pretrained."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, t in base.model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[k] = t
    return out


def merge(
    state: dict[str, torch.Tensor], adapter: AdapterWeights, sites: dict[str, Site]
) -> dict[str, torch.Tensor]:
    """Full weights with the adapter merged: W + scale * B @ A (in W's dtype) for every targeted linear, a new
    tensor each (the trainer keeps its base); every other weight as it is."""
    merged = dict(state)
    for name, (A, B) in adapter.tensors.items():
        key = f"{sites[name].module_path}.weight"
        W = state[key]
        merged[key] = torch.addmm(W, B.to(W.dtype), A.to(W.dtype), alpha=adapter.scale)
    return merged


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Receiver:
    """benchmarks/_handoff_server.py in a subprocess on a free loopback port (its log goes to a file)."""

    def __init__(self, base_dir: Path, threads: int, log: Path, device: str = "cpu"):
        port = free_port()
        threads_arg = ["--threads", str(threads), "--device", device]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(RECEIVER), "--base", str(base_dir), "--port", str(port), *threads_arg],
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        self.http = httpx.Client(base_url=self.url, timeout=600)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"receiver exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                if self.http.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"receiver not healthy in 300 s:\n{log.read_text()}")

    def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(route, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"receiver {route}: {r.status_code} {r.text[:500]}")
        return dict(r.json())

    def stop(self) -> None:
        self.http.close()
        stop_server(self.proc)  # type: ignore[arg-type]


class Steps:
    """Wall time of the steps of one handoff, from one t0."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.steps: dict[str, float] = {}
        self.again = 0.0  # the same request once more, right after the handoff: what an answer alone costs
        self.nbytes = 0  # the payload moved (an adapter path: its weights file)

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.steps[step] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.t0


def adapter_handoff(
    client: ServingClient,
    store: Path,
    base: Base,
    name: str,
    adapter: AdapterWeights,
    rev: str,
    prompt: list[int],
) -> Steps:
    s = Steps()  # the trainer holds `adapter`
    path = store / f"{name}-{rev}"
    digest = save_adapter(adapter, path, base.sites)
    s.mark("write")
    client.load_adapter(name, str(path), inplace=True)
    s.mark("load")
    out = client.complete(name, prompt, max_tokens=1, temperature=0, ignore_eos=True)  # type: ignore[arg-type]
    s.mark("answer")
    if out["system_fingerprint"] != digest:
        raise RuntimeError(f"{name} answered with revision {out['system_fingerprint']}, expected {digest}")
    if out["usage"]["completion_tokens"] != 1:
        raise RuntimeError(f"expected 1 token, got {out['usage']}")
    t = time.perf_counter()
    client.complete(name, prompt, max_tokens=1, temperature=0, ignore_eos=True)  # type: ignore[arg-type]
    s.again = time.perf_counter() - t
    s.nbytes = (path / WEIGHTS_FILE).stat().st_size
    return s


def merged_handoff(
    receiver: Receiver,
    state: dict[str, torch.Tensor],
    base: Base,
    adapter: AdapterWeights,
    path: Path,
    rev: str,
    prompt: list[int],
) -> tuple[Steps, int]:
    s = Steps()  # the trainer holds `adapter`, not merged yet
    merged = merge(state, adapter, base.sites)
    s.mark("merge")
    save_file(merged, str(path), metadata={"revision": rev})
    s.mark("write")
    receiver.post("/update_weights", {"path": str(path), "revision": rev})
    s.mark("load")
    out = receiver.post("/generate", {"prompt": prompt, "max_tokens": 1})
    s.mark("answer")
    if out["revision"] != rev or len(out["token_ids"]) != 1:
        raise RuntimeError(f"receiver answered {out}, expected one token of revision {rev}")
    t = time.perf_counter()
    receiver.post("/generate", {"prompt": prompt, "max_tokens": 1})
    s.again = time.perf_counter() - t
    size = nbytes(merged)
    del merged
    path.unlink()
    return s, size


def med(steps: list[Steps]) -> dict[str, float]:
    out = {k: statistics.median(s.steps[k] for s in steps) for k in steps[0].steps}
    out["total"] = statistics.median(s.total for s in steps)
    out["again"] = statistics.median(s.again for s in steps)
    out["ready"] = statistics.median(s.total - s.steps["answer"] for s in steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=["small", *SHAPES])
    ap.add_argument("--small", action="store_true", help="--shape small: hidden 128, 2 layers, vocab 1000")
    ap.add_argument(
        "--device", default="cpu", help="where the trainer's base and both servers run: cpu, cuda, ..."
    )
    ap.add_argument(
        "--adapter-only", action="store_true", help="the adapter path alone: no receiver, no merged baseline"
    )
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--low-rank", type=int, default=1)
    ap.add_argument("--adapter-rounds", type=int, default=5)
    ap.add_argument("--merged-rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds of idle time before each handoff")
    ap.add_argument(
        "--server-start-s", type=float, default=600, help="how long the servers may take to start"
    )
    args = ap.parse_args()
    stop_servers_on_kill()
    if args.small:
        args.shape = "small"
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    ranks = [args.rank, args.low_rank]
    merged = not args.adapter_only

    work = Path(tempfile.mkdtemp(prefix="mint-handoff-"))  # one disk for the base, the store and merged files
    base_dir, store, xfer = work / f"{args.shape}-shape", work / "store", work / "xfer"
    store.mkdir()
    xfer.mkdir()
    mint = receiver = None
    try:
        t = time.perf_counter()
        base = write_base(base_dir, args.shape)  # what the adapter path needs: sites and fingerprint
        state: dict[str, torch.Tensor] = {}
        if merged:  # the trainer's copy of the base, to merge into
            trainer_base = load_base(base_dir, dtype=torch.bfloat16, device=args.device)
            if trainer_base.fingerprint != base.fingerprint:
                raise RuntimeError("the base loaded back has another fingerprint than the one written")
            state = unique_state(trainer_base)
        params = sum(p.numel() for p in base.model.parameters())  # each tied weight once
        setup = {"base_s": time.perf_counter() - t, "base_params": params}
        prompt = list(byte_tokenizer()(PROMPT)["input_ids"])

        t = time.perf_counter()
        env = {
            "OMP_NUM_THREADS": str(args.threads),
            "MINT_SERVE_TORCH_THREADS": str(args.threads),
            "MINT_SERVE_DTYPE": "bfloat16",
            "MINT_SERVE_DEVICE": args.device,
            "MINT_SERVE_MAX_LORA_RANK": str(max(ranks)),
            "MINT_SERVE_MAX_LORAS": "2",
            "MINT_SERVE_MAX_MODEL_LEN": "64",
            "MINT_SERVE_LOG_LEVEL": "warning",
            "MINT_SERVE_ADMIN_TOKEN": ADMIN_TOKEN,
        }
        mint, url = start_server(
            store, "--base", str(base_dir), env=env, healthy_within_s=args.server_start_s
        )
        if merged:
            receiver = Receiver(base_dir, args.threads, work / "receiver.log", args.device)
        setup["servers_s"] = time.perf_counter() - t
        client = ServingClient(url, admin_token=ADMIN_TOKEN, timeout=600)

        seeds = iter(range(1000, 10**6))
        adapter_steps: dict[int, list[Steps]] = {r: [] for r in ranks}
        merged_steps: dict[int, list[Steps]] = {r: [] for r in ranks}
        sizes: dict[str, int] = {}

        def run_adapter(rank: int, timed: bool) -> None:
            rev = f"r{rank}-{next(seeds)}"
            a = new_adapter(base, rank, seed=int(rev.rpartition("-")[2]))
            s = adapter_handoff(client, store, base, f"policy-r{rank}", a, rev, prompt)
            sizes[f"adapter_r{rank}"] = s.nbytes
            if timed:
                adapter_steps[rank].append(s)

        def run_merged(rank: int, timed: bool) -> None:
            assert receiver is not None
            rev = f"r{rank}-{next(seeds)}"
            a = new_adapter(base, rank, seed=int(rev.rpartition("-")[2]))
            s, size = merged_handoff(receiver, state, base, a, xfer / f"{rev}.safetensors", rev, prompt)
            sizes["merged"] = size
            if timed:
                merged_steps[rank].append(s)

        for r in ranks:  # warm-up: first load of each name, first update, first forward of each process
            run_adapter(r, timed=False)
            if merged:
                run_merged(r, timed=False)
        jobs: list[Callable[[], None]] = []
        for i in range(max(args.adapter_rounds, args.merged_rounds if merged else 0)):
            for r in ranks:
                if i < args.adapter_rounds:
                    jobs.append(lambda r=r: run_adapter(r, True))  # type: ignore[misc]
                if merged and i < args.merged_rounds:
                    jobs.append(lambda r=r: run_merged(r, True))  # type: ignore[misc]
        t = time.perf_counter()
        for job in jobs:
            time.sleep(args.gap)  # idle OpenMP workers of the last handoff's processes stop spinning first
            job()
        rounds_s = time.perf_counter() - t
    except Exception:
        if mint is not None:
            print(server_log(mint)[-4000:], file=sys.stderr)
        if receiver is not None and receiver.log.exists():
            print(receiver.log.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        if receiver is not None:
            receiver.stop()
        if mint is not None:
            stop_server(mint)
        shutil.rmtree(work, ignore_errors=True)

    ad = {r: med(adapter_steps[r]) for r in ranks}
    mg = {r: med(merged_steps[r]) for r in ranks} if merged else {}
    hi, lo = args.rank, args.low_rank
    print(
        f"{args.shape}-shaped bf16 base, {setup['base_params'] / 1e6:.1f} M params, on {args.device}; "
        f"LoRA on {','.join(TARGETS)}; threads={args.threads}; rounds adapter={args.adapter_rounds} "
        f"merged={args.merged_rounds if merged else 0} (medians, interleaved); setup {setup['base_s']:.1f} s + "
        f"servers {setup['servers_s']:.1f} s, rounds {rounds_s:.1f} s"
    )
    steps = ("merge", "write", "load", "answer", "total", "ready", "again")
    print(f"  {'path':13s} {'bytes':>12s} " + " ".join(f"{k:>7s}" for k in steps) + "   (ms)")
    rows = [
        (f"adapter r{hi}", ad[hi], sizes[f"adapter_r{hi}"]),
        (f"adapter r{lo}", ad[lo], sizes[f"adapter_r{lo}"]),
    ]
    if merged:
        rows += [(f"merged r{hi}", mg[hi], sizes["merged"]), (f"merged r{lo}", mg[lo], sizes["merged"])]
    for label, m, size in rows:
        cells = " ".join(f"{m[k] * 1e3:7.1f}" if k in m else f"{'-':>7s}" for k in steps)
        print(f"  {label:13s} {size:12,d} {cells}")
    print(
        "  ready = t0 to the server's ack of the new weights (total - answer); again = the same request once more"
        " right after the handoff (what an answer alone costs)"
    )
    result: dict[str, Any] = {
        "adapter_s": round(ad[hi]["total"], 4),
        "adapter_s_rank1": round(ad[lo]["total"], 4),
        "adapter_bytes": sizes[f"adapter_r{hi}"],
        "adapter_answer_only_s": round(ad[hi]["again"], 4),
        "adapter_ready_s": round(ad[hi]["ready"], 4),
        "adapter_load_s": round(ad[hi]["load"], 4),
        "rank": hi,
        "low_rank": lo,
        "shape": args.shape,
        "device": args.device,
        "adapter_only": not merged,
        "small": args.shape == "small",
    }
    if merged:
        speedup, speedup_lo = mg[hi]["total"] / ad[hi]["total"], mg[lo]["total"] / ad[lo]["total"]
        ready, ready_lo = mg[hi]["ready"] / ad[hi]["ready"], mg[lo]["ready"] / ad[lo]["ready"]
        bytes_ratio = sizes["merged"] / sizes[f"adapter_r{hi}"]
        print(
            f"  speedup r{hi} {speedup:.1f}x, r{lo} {speedup_lo:.1f}x (to the ack, without the answer: {ready:.1f}x, "
            f"{ready_lo:.1f}x); bytes ratio r{hi} {bytes_ratio:.1f}x; trainer peak RSS "
            f"{peak_rss_bytes() / 2**30:.2f} GiB"
        )
        result |= {
            "merged_s": round(mg[hi]["total"], 4),
            "speedup": round(speedup, 2),
            "merged_s_rank1": round(mg[lo]["total"], 4),
            "speedup_rank1": round(speedup_lo, 2),
            "merged_bytes": sizes["merged"],
            "bytes_ratio": round(bytes_ratio, 1),
            "merged_answer_only_s": round(mg[hi]["again"], 4),
            "merged_ready_s": round(mg[hi]["ready"], 4),
            "ready_speedup": round(ready, 2),
            "ready_speedup_rank1": round(ready_lo, 2),
        }
    report(result)


if __name__ == "__main__":
    main()
