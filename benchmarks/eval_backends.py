"""One revision's evaluation, as the main job runs it, on mint serve and on vLLM behind mint's front: seconds each.

Setup: the built-in base (`--base`, default data/base: `make run` builds it; vLLM's CPU attention needs its head_dim
32). A champion: a rank-8 adapter with small random weights (std 0.02) on every linear of the decoder layers, written
into each backend's store. mint serve as the job starts it (one torch thread, `--adapter-root` the store). vLLM with
the flags the job gives it (`mint_app.services.commands.vllm_config`: the serving config's LoRA slots, rank and
model length, `--lora-target-modules` from the base), its key the test harness's, behind `mint serve --backend vllm`
(the front). Nothing else runs in this script's servers.

Each round evaluates the champion on each backend in turn (mint, then vLLM), exactly as the job's `evaluate` task
does (`mint_core.eval.lm_eval_runner.evaluate_served`: load the revision under a name, lm-eval's local-completions
over every suite, unload): `--limit` (320, the job's EVAL_LIMIT and GUARD_LIMIT) items a task, so 1,920 greedy
generations (12 tokens at most) and 640 log-likelihood requests (the guard's 320 two-choice items). After a warm-up
round (vLLM's first prompt-logprobs request compiles), `--rounds` (3) timed rounds; medians.

Figures (one JSON line each, then a summary):
  eval      seconds of the whole evaluation per backend; `vllm_vs_mint` (>1: vLLM slower)
  guard     the same for the guard suite alone (its log-likelihood half is where vLLM lost most: issue #45)
  agree     both backends gave every item the same answer (scores and per-sample responses)

`--vllm-lora-targets default` leaves `--lora-target-modules` to vLLM (it then wraps lm_head too), the flag mint
passed before; `--batch-size` / `--concurrent` set lm-eval's prompts per request and requests in flight.
`--only mint,vllm,vllm-native` adds a third backend: vLLM with its own CPU LoRA ops (`MINT_VLLM_NATIVE_LORA=1`)
instead of mint's plugin's (vllm_plugin/mint_vllm_lora_cpu.py), and `lora_ops_speedup` = its seconds over vLLM's
with mint's ops, in the same run.

    .venv/bin/python benchmarks/eval_backends.py [--rounds 3] [--limit 320] [--only mint,vllm[,vllm-native]]
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
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pydantic import SecretStr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_avg, report, stop_servers_on_kill

from mint_app.services.commands import vllm_config
from mint_app.services.config import ServicesConfig
from mint_core.engine.base import load_base
from mint_core.eval.lm_eval_runner import evaluate_served
from mint_core.eval.results import EVAL_LIMIT, EvalConfig, EvalResult, ServedModel
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_KEY,
    free_port,
    launch,
    server_log,
    start_front,
    start_server,
    stop_server,
    vllm_healthy,
)

ROOT = Path(__file__).resolve().parent.parent
NAME = "bench-champion"


def vllm_process(
    base_dir: Path, work: Path, port: int, targets: str, native_lora: bool = False
) -> subprocess.Popen[str]:
    """vLLM with the job's flags (its key the harness's, no resolver: the revision is loaded by path), healthy;
    `native_lora`: with vLLM's own CPU LoRA ops instead of mint's plugin's."""
    python = Path(os.environ.get("MINT_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    services = ServicesConfig(
        state_dir=work / "state", serving="vllm", serve_base=str(base_dir), vllm_port=port, vllm_python=python
    )
    services.state_dir.mkdir(parents=True, exist_ok=True)
    update: dict[str, Any] = {"api_key": SecretStr(VLLM_KEY), "resolver_url": None}
    if targets == "default":
        update["lora_target_modules"] = []  # no flag: vLLM's own choice (lm_head wrapped too)
    cfg = vllm_config(services).model_copy(update=update)
    cmd, env = cfg.command()
    if native_lora:
        env = {**env, "MINT_VLLM_NATIVE_LORA": "1"}
    print("vLLM:", " ".join(cmd[1:]), "(vLLM's own LoRA ops)" if native_lora else "", flush=True)
    proc = launch(cmd, env, work / f"vllm-{port}.log")
    deadline = time.monotonic() + 900
    while not vllm_healthy(f"http://127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"vLLM did not start:\n{server_log(proc)[-4000:]}")
        time.sleep(1)
    return proc


@contextmanager
def servers(base_dir: Path, only: list[str], targets: str) -> Iterator[dict[str, tuple[str, Path]]]:
    """Each backend's URL and store (the champion written into it); every server stopped on exit."""
    work = Path(tempfile.mkdtemp(prefix="mint-eval-backends-"))
    base = load_base(base_dir)
    adapter = random_adapter(
        base.sites, sorted({s.short for s in base.sites.values()}), 8, seed=7, std=0.02,
        base_fingerprint=base.fingerprint,
    )  # fmt: skip
    os.environ["MINT_SERVE_LOG_LEVEL"] = "warning"
    serve_env = {"MINT_SERVE_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "MINT_SERVE_TINKER": "false"}
    out: dict[str, tuple[str, Path]] = {}
    procs: list[subprocess.Popen[str]] = []
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        try:
            for backend in only:
                store = work / f"store-{backend}"
                save_adapter(adapter, store / "champion", base.sites)
                if backend == "mint":
                    proc, url = start_server(store, "--base", str(base_dir), env=serve_env)
                    stack.callback(stop_server, proc)
                    procs.append(proc)
                else:
                    t0 = time.perf_counter()
                    vport = free_port()
                    proc = vllm_process(base_dir, work, vport, targets, native_lora=backend == "vllm-native")
                    stack.callback(stop_server, proc, 60)
                    procs.append(proc)
                    print(f"vLLM up in {time.perf_counter() - t0:.0f} s", flush=True)
                    proc, url = start_front(f"http://127.0.0.1:{vport}", store, base_dir, free_port(), None)
                    stack.callback(stop_server, proc)
                    procs.append(proc)
                out[backend] = (url, store / "champion")
            yield out
        except BaseException:
            for p in procs:
                print(f"--- log of pid {p.pid} (last lines):\n{server_log(p)[-3000:]}", file=sys.stderr)
            raise


def evaluation(
    url: str, adapter: Path, base_dir: Path, config: EvalConfig
) -> Callable[[], tuple[float, EvalResult]]:
    """One evaluation of the champion as the job's `evaluate` task runs it: seconds and the result."""
    target = ServedModel(
        url=url,
        tokenizer=base_dir,
        adapter=str(adapter),
        name=NAME,
        admin_token=SecretStr(ADMIN_TOKEN),
        unload_after=True,
    )

    def run() -> tuple[float, EvalResult]:
        t0 = time.perf_counter()
        result = evaluate_served(target, config)
        return time.perf_counter() - t0, result

    return run


def answers(result: EvalResult) -> dict[str, list[tuple[int, str, bool]]]:
    return {n: [(s.doc_id, s.response, s.correct) for s in r.samples] for n, r in result.suites.items()}


def measure(
    urls: dict[str, tuple[str, Path]], base_dir: Path, configs: dict[str, EvalConfig], rounds: int
) -> tuple[dict[str, dict[str, float]], bool]:
    """Per part (eval, guard) and backend the median seconds over `rounds` after a warm-up; whether every
    backend answered every item alike."""
    times: dict[str, dict[str, list[float]]] = {part: {b: [] for b in urls} for part in configs}
    last: dict[str, EvalResult] = {}
    for r in range(rounds + 1):
        for part, config in configs.items():
            for backend, (url, adapter) in urls.items():
                wall, result = evaluation(url, adapter, base_dir, config)()
                print(f"round {r} {part} {backend}: {wall:.1f} s (load {load_avg()[0]})", flush=True)
                if r > 0:
                    times[part][backend].append(wall)
                if part == "eval":
                    last[backend] = result
    agree = len({repr(answers(x)) for x in last.values()}) == 1
    return {p: {b: statistics.median(v) for b, v in t.items()} for p, t in times.items()}, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=ROOT / "data" / "base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=EVAL_LIMIT)
    ap.add_argument("--only", default="mint,vllm", help="backends, comma-separated: mint, vllm, vllm-native")
    ap.add_argument("--vllm-lora-targets", choices=["base", "default"], default="base")
    ap.add_argument("--batch-size", type=int, default=None, help="default: EvalConfig's")
    ap.add_argument("--concurrent", type=int, default=None, help="default: EvalConfig's")
    args = ap.parse_args()
    stop_servers_on_kill()
    if not (args.base / "config.json").is_file():
        sys.exit(f"{args.base} is not built: run `make run` once, or `dvc repro builtin_base`")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    os.environ.setdefault("TQDM_DISABLE", "1")
    knobs = {"batch_size": args.batch_size, "num_concurrent": args.concurrent}
    common = {
        "limit": args.limit,
        "guard_limit": args.limit,
        **{k: v for k, v in knobs.items() if v is not None},
    }
    configs = {"eval": EvalConfig(**common), "guard": EvalConfig(suites=["guard"], **common)}
    only = args.only.split(",")
    unknown = sorted(set(only) - {"mint", "vllm", "vllm-native"})
    if unknown:
        ap.error(f"--only: no backend {', '.join(unknown)} (mint, vllm, vllm-native)")
    with servers(args.base.resolve(), only, args.vllm_lora_targets) as urls:
        medians, agree = measure(urls, args.base.resolve(), configs, args.rounds)
    settings = {
        "rounds": args.rounds,
        "limit": args.limit,
        "vllm_lora_targets": args.vllm_lora_targets,
        "batch_size": configs["eval"].batch_size,
        "num_concurrent": configs["eval"].num_concurrent,
        "cpus": os.cpu_count(),
    }
    summary: dict[str, Any] = {"figure": "summary", **settings, "agree": agree, "load_avg": load_avg()}
    for part, by in medians.items():
        line = {"figure": part, **{f"{b}_s": round(s, 2) for b, s in by.items()}}
        if "mint" in by and "vllm" in by:
            line["vllm_vs_mint"] = summary[f"{part}_vllm_vs_mint"] = round(by["vllm"] / by["mint"], 2)
        if "vllm" in by and "vllm-native" in by:
            speedup = round(by["vllm-native"] / by["vllm"], 2)
            line["lora_ops_speedup"] = summary[f"{part}_lora_ops_speedup"] = speedup
        print(line, flush=True)
        summary.update({f"{part}_{b}_s": round(s, 2) for b, s in by.items()})
    report(summary)


if __name__ == "__main__":
    main()
