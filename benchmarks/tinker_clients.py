"""Tinker SDK training clients on one `mint serve`: 8 clients at once (threads) against the same 8 one after another,
and the API's latency on one step against the same step called in process.

Starts `mint serve` (the Tinker API on, `--window-ms` batching window) on a free port. Each client is the real
`tinker` SDK (`ServiceClient(base_url=..., api_key=...)` -> `create_lora_training_client`), and a step is what a
training loop does: `forward_backward` (cross_entropy over `--batch` data of `--tokens` tokens) then `optim_step`,
both submitted before waiting. Concurrent: the clients' steps arrive together and the server runs their
forward_backward calls as one batched step; sequential: each client runs all its steps alone.

Latency: one client's step, SDK call to result (median of `--latency-steps`), against the same step on a
TinkerService built in this process over the same base with the same window (no HTTP, no SDK).

    .venv/bin/python benchmarks/tinker_clients.py [--base tiny-dense|DIR] [--clients 8] [--steps 6]

Prints a line per phase, then one JSON object.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import tinker  # noqa: E402
from _common import report  # noqa: E402
from tinker import types  # noqa: E402

KEY = "tml-benchmark-key-0000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    base: str, window_ms: float, clients: int, threads: int | None, tmp: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "MINT_SERVE_TINKER_API_KEYS": KEY,
        "MINT_SERVE_TINKER_WINDOW_MS": str(window_ms),
        "MINT_SERVE_TINKER_STATE_DIR": str(tmp / "tinker"),
        "MINT_SERVE_ADMIN_TOKEN": "bench",
        "MINT_SERVE_MAX_LORA_RANK": "8",
    }
    if threads:
        env["MINT_SERVE_TORCH_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "mint_app.cli", "serve", "--base", base, "--port", str(port)]
    cmd += ["--adapter-root", str(tmp / "store"), "--max-loras", str(clients + 2)]
    log = open(tmp / "serve.log", "wb")  # noqa: SIM115 (the server owns it)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp / "serve.log").read_text())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("mint serve did not start")


def builtin_shape(tmp: Path) -> str:
    if (ROOT / "data" / "base" / "config.json").is_file():
        return str(ROOT / "data" / "base")
    import torch
    import yaml
    from transformers import LlamaForCausalLM

    from mint_core.engine.pretrain import PretrainParams, model_config
    from mint_core.engine.tokenizer import byte_tokenizer

    params = PretrainParams(**yaml.safe_load((ROOT / "params.yaml").read_text())["base"])
    tok = byte_tokenizer()
    torch.manual_seed(0)
    out = tmp / "builtin-shape"
    LlamaForCausalLM(model_config(params, tok)).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def batch(seed: int, n: int, tokens: int, vocab: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, min(vocab, 256), tokens + 1).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * tokens},
            )
        )
    return out


def sdk_step(tc: Any, data: list[types.Datum]) -> float:
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return float(loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--base",
        default="tiny-dense",
        help="tiny-dense, a model directory, or builtin-shape: data/base if built, else a random Llama of its shape "
        "(params.yaml base:), which costs the same per step",
    )
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps per client in each phase")
    ap.add_argument("--batch", type=int, default=4, help="data per forward_backward")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per datum")
    ap.add_argument("--window-ms", type=float, default=10.0)
    ap.add_argument("--latency-steps", type=int, default=10)
    ap.add_argument("--torch-threads", type=int, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="mint-tinker-bench-"))
    if args.base == "builtin-shape":
        args.base = builtin_shape(tmp)
    proc, url = start(args.base, args.window_ms, args.clients, args.torch_threads, tmp)
    try:
        service = [tinker.ServiceClient(base_url=url, api_key=KEY) for _ in range(args.clients)]
        base_name = (
            service[0]._rest_client().get_server_capabilities().result().supported_models[0].model_name
        )
        tcs = [
            s.create_lora_training_client(base_model=base_name, rank=8, seed=i).result()
            for i, s in enumerate(service)
        ]
        vocab = len(tcs[0].get_tokenizer())
        data = [batch(i, args.batch, args.tokens, vocab) for i in range(args.clients)]
        for tc, d in zip(tcs, data, strict=True):  # warm up every client's path once
            sdk_step(tc, d)

        t0 = time.perf_counter()
        for tc, d in zip(tcs, data, strict=True):
            for _ in range(args.steps):
                sdk_step(tc, d)
        seq_s = time.perf_counter() - t0
        seq_rate = args.clients * args.steps / seq_s
        print(
            f"sequential: {args.clients} clients x {args.steps} steps in {seq_s:.2f} s = {seq_rate:.2f} steps/s",
            flush=True,
        )

        barrier = threading.Barrier(args.clients)

        def loop(tc: Any, d: list[types.Datum]) -> None:
            barrier.wait()
            for _ in range(args.steps):
                sdk_step(tc, d)

        threads = [threading.Thread(target=loop, args=(tc, d)) for tc, d in zip(tcs, data, strict=True)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conc_s = time.perf_counter() - t0
        conc_rate = args.clients * args.steps / conc_s
        print(
            f"concurrent: {args.clients} clients x {args.steps} steps in {conc_s:.2f} s = {conc_rate:.2f} steps/s",
            flush=True,
        )

        lat_sdk = []
        for _ in range(args.latency_steps):
            t = time.perf_counter()
            sdk_step(tcs[0], data[0])
            lat_sdk.append(time.perf_counter() - t)
        for s in service:
            s.close("success").result()
    finally:
        proc.terminate()
        proc.wait(30)

    lat_inproc = in_process(args, data[0])
    sdk_ms, inproc_ms = statistics.median(lat_sdk) * 1e3, statistics.median(lat_inproc) * 1e3
    print(
        f"one step: SDK {sdk_ms:.1f} ms, in process {inproc_ms:.1f} ms, API overhead {sdk_ms - inproc_ms:.1f} ms"
    )
    report(
        {
            "benchmark": "tinker_clients",
            "base": args.base,
            "clients": args.clients,
            "steps_per_client": args.steps,
            "batch": args.batch,
            "tokens": args.tokens,
            "window_ms": args.window_ms,
            "sequential_steps_per_s": round(seq_rate, 3),
            "concurrent_steps_per_s": round(conc_rate, 3),
            "speedup": round(conc_rate / seq_rate, 2),
            "step_ms_sdk": round(sdk_ms, 1),
            "step_ms_in_process": round(inproc_ms, 1),
            "api_overhead_ms": round(sdk_ms - inproc_ms, 1),
        }
    )


def in_process(args: argparse.Namespace, data: list[types.Datum]) -> list[float]:
    """The same step on a TinkerService in this process: the same queue, window, batched step and optimizer."""
    import torch

    from mint_core.engine.engine import Engine, EngineConfig
    from mint_core.registry.store import AdapterStore
    from mint_core.serving.app import load_serving_base
    from mint_core.serving.config import ServingConfig
    from mint_core.serving.tinker.service import TinkerService
    from mint_core.serving.tinker.wire import Datum

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    tmp = Path(tempfile.mkdtemp(prefix="mint-tinker-bench-inproc-"))
    base = load_serving_base(ServingConfig(base=args.base))
    engine = Engine(base, EngineConfig(max_loras=4, max_lora_rank=8))
    name = args.base if "/" not in args.base else Path(args.base).name
    svc = TinkerService(
        engine, AdapterStore(tmp / "store"), name, tmp / "tinker", {KEY: "bench"}, window_ms=args.window_ms
    )
    m = svc.create_model("bench", svc.create_session("bench"), 0, name, 8, 0)
    mine = [
        Datum(np.asarray(d.model_input.to_ints()), {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})
        for d in data
    ]

    def step() -> None:
        fb = svc.forward_backward(m, mine, "cross_entropy", {}, False)
        opt = svc.call(m, lambda: svc.optim_step(m, 1e-3, 0.9, 0.95, 1e-12, 0.0, 0.0))
        fb.result()
        opt.result()

    step()
    times = []
    for _ in range(args.latency_steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    svc.close()
    return times


if __name__ == "__main__":
    main()
