"""End-to-end latency with and without `model: "auto"`: the same prompts through a real server, once naming the
task's policy and once asking for `auto`, interleaved request by request so drift in machine speed hits both alike.

Backends: mint serve (the embedded engine), and vLLM behind mint's front when `.venv-vllm` (MINT_VLLM_PYTHON)
is there. Each serves the reward table's arms (their PEFT files, written when the table was built) from a store
of its own, one key allowed everything (`*`: the base too), a routing dir of its own, the router cold (warm-started
by the server from the registered tasks' held-out prompts). Every request is greedy, `ignore_eos`, with the same
`max_tokens`, so both sides generate the same number of tokens whatever adapter answers. Client-side wall time
per request (HTTP included); all traffic goes to servers started here, which are stopped before returning.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import load_avg, pct
from _reward_table import BASE_ARM, RewardTable

from mint_core.access import Access, ServingKey, new_secret, save
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_PYTHON,
    free_port,
    start_front,
    start_server,
    start_vllm,
    stop_server,
)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_TOKENS = 8


VLLM_MAX_RANK = 16
"""The rank the test harness's vLLM serves up to (its `max_lora_rank`): arms above it are left out there."""


def _sources(table: RewardTable) -> dict[str, Path]:
    """Each served arm's adapter folder, as the table's build wrote it."""
    adapters = Path(table.meta["cache"]) / "adapters"
    return {arm: adapters / col.replace("@", "_at_") for arm, col in table.meta["served_as"].items()}


def _store(table: RewardTable, store: Path, max_rank: int | None = None) -> dict[str, Path]:
    """Each served arm's adapter folder copied into `store` (the base has none), those up to `max_rank`."""
    out = {}
    for arm, src in _sources(table).items():
        if max_rank is not None and json.loads((src / "adapter_config.json").read_text())["r"] > max_rank:
            continue
        shutil.copytree(src, store / arm)
        out[arm] = store / arm
    return out


def _env(root: Path) -> tuple[dict[str, str], str]:
    secret = new_secret("mint-")
    save(root / "access.json", Access(keys={"bench": ServingKey(secret=secret, policies=["*"])}))
    env = {
        "MINT_SERVE_ACCESS_FILE": str(root / "access.json"),
        "MINT_SERVE_ROUTING_DIR": str(root / "routing"),
        "MINT_SERVE_ROUTE_SEED": "0",
        "MINT_SERVE_TORCH_THREADS": "1",
    }
    return env, secret


@contextmanager
def _mint(table: RewardTable, base: Path, root: Path, device: str) -> Iterator[tuple[str, str]]:
    store = root / "store"
    store.mkdir()
    env, secret = _env(root)
    ranks = [json.loads((p / "adapter_config.json").read_text())["r"] for p in _sources(table).values()]
    env |= {"MINT_SERVE_MAX_LORA_RANK": str(max(ranks)), "MINT_SERVE_MAX_LORAS": str(len(ranks))}
    proc, url = start_server(store, "--base", str(base), "--device", device, env=env)
    try:
        _load(url, _store(table, store))
        yield url, secret
    finally:
        stop_server(proc)


@contextmanager
def _vllm(table: RewardTable, base: Path, root: Path) -> Iterator[tuple[str, str]]:
    store = root / "store"
    store.mkdir()
    env, secret = _env(root)
    port = free_port()
    # the harness asks vLLM for 512 positions; the built-in base has 128, and every prompt here fits in them
    with _patched_env({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}):
        vllm = start_vllm(base, port, None, root / "vllm.log", max_loras=len(table.arms))
    procs: list[subprocess.Popen[str]] = [vllm]
    try:
        with _patched_env(env):
            front, url = start_front(f"http://127.0.0.1:{port}", store, base, free_port(), None)
        procs.append(front)
        _load(url, _store(table, store, VLLM_MAX_RANK))
        yield url, secret
    finally:
        for p in reversed(procs):
            stop_server(p)


@contextmanager
def _patched_env(env: dict[str, str]) -> Iterator[None]:
    import os

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _load(url: str, paths: dict[str, Path]) -> None:
    for arm, path in paths.items():
        body = {"lora_name": arm, "lora_path": str(path), "load_inplace": True}
        r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"loading {arm} from {path}: {r.status_code} {r.text[:300]}")


def _measure(table: RewardTable, url: str, secret: str, n: int, seed: int) -> dict[str, Any]:
    """`n` prompts, each sent naming its task's policy and as `auto` (order alternating); p50/p95 ms each."""
    rng = np.random.default_rng(seed)
    with httpx.Client(base_url=url, headers=ADMIN, timeout=60) as http:
        served = {card["id"] for card in http.get("/v1/models").json()["data"]}
    held = [i for i, w in enumerate(table.wording) if w == "heldout" and table.tasks[i] in served]
    rows = rng.choice(held, size=n + 4)
    auth = {"Authorization": f"Bearer {secret}"}
    times: dict[str, list[float]] = {"named": [], "auto": []}
    routed: dict[str, int] = {}
    with httpx.Client(base_url=url, headers=auth, timeout=120) as http:
        for k, i in enumerate(rows):
            models = [("named", table.tasks[i]), ("auto", "auto")]
            for label, model in models if k % 2 == 0 else models[::-1]:
                body = {
                    "model": model,
                    "prompt": table.prompts[i],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                t0 = time.perf_counter()
                r = http.post("/v1/completions", json=body)
                dt = (time.perf_counter() - t0) * 1e3
                if r.status_code != 200:
                    raise RuntimeError(f"{model}: {r.status_code} {r.text[:300]}")
                if k >= 4:  # the first few warm the slots and the router
                    times[label].append(dt)
                    if label == "auto":
                        name = r.headers.get("x-mint-routed", "?")
                        routed[name] = routed.get(name, 0) + 1
    out: dict[str, Any] = {f"{k}_p{q}_ms": round(pct(v, q), 2) for k, v in times.items() for q in (50, 95)}
    out["p95_overhead_pct"] = round(100 * (out["auto_p95_ms"] / out["named_p95_ms"] - 1), 2)
    out["p50_overhead_pct"] = round(100 * (out["auto_p50_ms"] / out["named_p50_ms"] - 1), 2)
    out["routed"] = routed
    out["n"] = n
    out["load_avg"] = load_avg()  # at the end of this backend's requests: the figures are as steady as it
    return out


def e2e(table: RewardTable, base: Path, n: int, device: str, seed: int = 0) -> dict[str, Any]:
    """Per backend (mint, and vllm when its interpreter is there): latency p50/p95 named vs auto."""
    if BASE_ARM not in table.arms or "served_as" not in table.meta:
        raise ValueError("--e2e needs a table built here (its adapters' files): not a --table without them")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "mint"
        root.mkdir()
        with _mint(table, base, root, device) as (url, secret):
            out["mint"] = _measure(table, url, secret, n, seed)
        print(f"e2e mint serve: {out['mint']}", file=sys.stderr, flush=True)
        if Path(VLLM_PYTHON).is_file():
            root = Path(tmp) / "vllm"
            root.mkdir()
            with _vllm(table, base, root) as (url, secret):
                out["vllm"] = _measure(table, url, secret, n, seed)
            print(f"e2e vLLM behind the front: {out['vllm']}", file=sys.stderr, flush=True)
        else:
            out["vllm"] = f"skipped: no vLLM interpreter at {VLLM_PYTHON}"
    return out
