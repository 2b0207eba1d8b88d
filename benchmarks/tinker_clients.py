"""Tinker SDK training clients on one `mint serve`: 8 clients at once (threads) against the same 8 one after another,
and the API's latency on one step against the same step called in process.

Starts `mint serve` (the Tinker API on, `--window-ms` batching window) on a free port. Each client is the real
`tinker` SDK (`ServiceClient(base_url=..., api_key=...)` -> `create_lora_training_client`), and a step is what a
training loop does: `forward_backward` (cross_entropy over `--batch` data of `--tokens` tokens) then `optim_step`,
both submitted before waiting. Concurrent: the clients' steps arrive together and the server runs their
forward_backward calls as one batched step and their optim_steps as one fused AdamW; sequential: each client runs
all its steps alone.

Latency: one client's step, SDK call to result (median of `--latency-steps`), against the same step on a
TinkerService built in this process over the same base with the same window (no HTTP, no SDK). The in-process
service also runs the clients one after another and at once: the batching gain without HTTP and the SDK.

    .venv/bin/python benchmarks/tinker_clients.py [--base tiny-dense|builtin-shape|DIR] [--clients 8] [--steps 6]
        [--rounds 3] [--torch-threads 1]

The four phases (SDK one after another, SDK at once, in process one after another, in process at once) run in
`--rounds` rounds, so drift in the machine's load hits all alike; the rates reported are the medians. Prints a line
per round, then one JSON object.
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
from _common import report, stop_servers_on_kill  # noqa: E402
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
    cmd = [sys.executable, "-m", "mint_app.cli.app", "serve", "--base", base, "--port", str(port)]
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
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the four phases; rates are medians")
    ap.add_argument("--torch-threads", type=int, default=None)
    args = ap.parse_args()
    stop_servers_on_kill()

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
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

        sdk_steps = [lambda tc=tc, d=d: sdk_step(tc, d) for tc, d in zip(tcs, data, strict=True)]
        inproc = InProcess(args, data)  # built now, so the latency steps can alternate with the SDK's
        seq_rates, conc_rates, seq_in, conc_in = [], [], [], []
        for r in range(args.rounds):
            seq_rates.append(sequential(sdk_steps, args.steps))
            conc_rates.append(concurrent(sdk_steps, args.steps))
            seq_in.append(sequential(inproc.steps, args.steps))
            conc_in.append(concurrent(inproc.steps, args.steps))
            print(
                f"round {r}: SDK sequential {seq_rates[-1]:.2f}, concurrent {conc_rates[-1]:.2f} steps/s; "
                f"in process sequential {seq_in[-1]:.2f}, concurrent {conc_in[-1]:.2f} steps/s",
                flush=True,
            )
        time.sleep(1.5)  # the other clients are idle now: a lone step waits for no window
        lat_sdk, lat_inproc = [], []
        for _ in range(args.latency_steps):  # alternated, so load on the machine hits both alike
            for fn, out in ((sdk_steps[0], lat_sdk), (inproc.steps[0], lat_inproc)):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
        inproc.svc.close()
        for s in service:
            s.close("success").result()
    finally:
        proc.terminate()
        proc.wait(30)

    med = statistics.median
    seq_rate, conc_rate = med(seq_rates), med(conc_rates)
    sdk_ms, inproc_ms = med(lat_sdk) * 1e3, med(lat_inproc) * 1e3
    print(
        f"SDK: sequential {seq_rate:.2f} steps/s, concurrent {conc_rate:.2f} steps/s (x{conc_rate / seq_rate:.2f})"
    )
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
            "rounds": args.rounds,
            "in_process_sequential_steps_per_s": round(med(seq_in), 3),
            "in_process_concurrent_steps_per_s": round(med(conc_in), 3),
            "in_process_speedup": round(med(conc_in) / med(seq_in), 2),
            "step_ms_sdk": round(sdk_ms, 1),
            "step_ms_in_process": round(inproc_ms, 1),
            "api_overhead_ms": round(sdk_ms - inproc_ms, 1),
        }
    )


def sequential(steps: list[Any], n: int) -> float:
    """Steps/s of the clients run one after another, `n` steps each. Between two clients the benchmark pauses
    (untimed) until the previous one no longer counts as training, so no step of the baseline waits the batching
    window for a client that will not come."""
    from mint_core.tinker.service import ACTIVE_S

    total = 0.0
    for step in steps:
        time.sleep(ACTIVE_S + 0.1)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        total += time.perf_counter() - t0
    return len(steps) * n / total


def concurrent(steps: list[Any], n: int) -> float:
    """Steps/s of the clients run at once, one thread each, `n` steps each."""
    barrier = threading.Barrier(len(steps))

    def loop(step: Any) -> None:
        barrier.wait()
        for _ in range(n):
            step()

    threads = [threading.Thread(target=loop, args=(step,)) for step in steps]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(steps) * n / (time.perf_counter() - t0)


class InProcess:
    """The same clients on a TinkerService in this process over the same base (the same queue, window, batched
    step and optimizer; no HTTP, no SDK)."""

    def __init__(self, args: argparse.Namespace, data: list[list[types.Datum]]):
        from mint_core.engine.engine import Engine, EngineConfig
        from mint_core.registry.store import AdapterStore
        from mint_core.serving.app import load_serving_base
        from mint_core.serving.config import ServingConfig
        from mint_core.tinker.optim import AdamStep
        from mint_core.tinker.service import TinkerService
        from mint_core.tinker.wire import Datum

        tmp = Path(tempfile.mkdtemp(prefix="mint-tinker-bench-inproc-"))
        base = load_serving_base(ServingConfig(base=args.base))
        engine = Engine(base, EngineConfig(max_loras=args.clients + 2, max_lora_rank=8))
        name = args.base if "/" not in args.base else Path(args.base).name
        svc = self.svc = TinkerService(
            engine,
            AdapterStore(tmp / "store"),
            name,
            tmp / "tinker",
            {KEY: "bench"},
            window_ms=args.window_ms,
        )
        sid = svc.create_session("bench")
        self.steps = []
        for i, ds in enumerate(data):
            m = svc.create_model("bench", sid, i, name, 8, i)
            mine = [
                Datum(
                    np.asarray(d.model_input.to_ints()),
                    {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()},
                )
                for d in ds
            ]

            def step(m: Any = m, mine: list[Datum] = mine) -> None:
                fb = svc.forward_backward(m, mine, "cross_entropy", {}, False)
                opt = svc.optim(m, AdamStep(1e-3))
                fb.result()
                opt.result()

            step()
            self.steps.append(step)


if __name__ == "__main__":
    main()
