"""What a raw vLLM does with each kind of bad adapter, and what mint's front does with the same files.

Claim (infra/vllm/README.md, "Bad adapters: raw vLLM 0.32 vs through mint"): vLLM 0.32 refuses some malformed
adapters itself but loads and serves others (NaN weights, a shape mismatch, a layer the base lacks, another base's
adapter), and a NaN adapter poisons every other tenant of the server until vLLM restarts; mint's front refuses all
of them before vLLM reads them, and the other tenants keep their answers byte for byte.

Phase `raw`: one vLLM (loopback, its key, no resolver plugin, without mint's seal: vLLM's own surface) on the tiny head_dim-32 base, with two healthy
adapters loaded straight into it. The greedy answers (temperature 0, ignore_eos, 16 tokens, 4 prompts) of the base
and both adapters are the reference. Each case is a healthy adapter corrupted one way, loaded directly into vLLM
(`POST /v1/load_lora_adapter`, absolute path); recorded: vLLM's status and message, whether `/v1/models` lists it,
whether a completion under it answers (and whether its text is finite-looking or degenerate), and whether the
co-tenants' answers are byte for byte the reference: asked alone while it is loaded, in one batch with requests
under it, and after unloading it. A case that changes them poisoned the server: vLLM is restarted (and the
reference checked again) before the next case. A healthy third adapter runs the same protocol first, as the
control (batching with another adapter must not change answers by itself). A changed answer is classified: `nan`
(NaN's degenerate "!!!"), `as <model>` (exactly another model's answer: served with the wrong weights), `other`.
The phase also records which routes answer with no key at all, and ends with the last-slot check: every LoRA slot
taken by a healthy adapter, are requests for the bare base (batched with LoRA requests) still the base's?

Phase `mint`: a fresh vLLM with mint's front (`mint serve --backend vllm`) before it, the same store. The same
cases go to the front's load route (lora_path relative to the store); recorded: the front's status and message,
that neither the front's nor vLLM's own `/v1/models` lists the name, that a completion under it is a 404, and that
the co-tenants' answers (loaded through the front) are unchanged; then the same last-slot check.

    .venv/bin/python benchmarks/vllm_bad_adapters.py [--only CASE ...] [--phases raw mint] [--budget-s 2400]

vLLM runs from MINT_VLLM_PYTHON (default .venv-vllm/bin/python). Prints one JSON line per case and phase, then
the summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, stop_servers_on_kill

from mint_core.engine.base import build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_testkit import bad_adapters as bad
from mint_testkit.bad_adapters import RANK, TARGETS
from mint_testkit.harness import (
    ADMIN_TOKEN,
    VLLM_BASE_NAME,
    VLLM_KEY,
    free_port,
    save_tiny_base,
    start_front,
    start_vllm,
    stop_server,
)

PROMPTS = ["Once upon a time", "2+3=", "The capital of France is", "def main():"]
MAX_TOKENS = 16
HEALTHY = {"good-a": 11, "good-b": 12}  # co-tenants: name -> seed
MARKER = "UNPICKLED"
HTTP_TIMEOUT_S = 120.0


# ---- the cases: a healthy adapter directory corrupted one way (mint_testkit.bad_adapters) ------------------

CASES: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "control_healthy": lambda d, ctx: None,  # the control: nothing wrong with it
    "nan_lora_B_only": lambda d, ctx: bad.nan_value(d, "lora_B"),
    "nan_lora_A_only": lambda d, ctx: bad.nan_value(d, "lora_A"),  # the contract test's "NaN values"
    "nan_everywhere": lambda d, ctx: bad.nan_everywhere(d),
    "shape_mismatch": lambda d, ctx: bad.shape_mismatch(d),
    "rank_32_above_max_16": lambda d, ctx: bad.rank_above_max(d, 32),
    "other_base_fingerprint": lambda d, ctx: bad.other_base(d, ctx["other_fingerprint"]),
    "pickle_bin_weights": lambda d, ctx: bad.pickle_weights(d, ctx["marker"]),
    "truncated_safetensors": lambda d, ctx: bad.truncated(d),
    "garbage_header": lambda d, ctx: bad.garbage_header(d),
    "target_layer_not_in_base": lambda d, ctx: bad.layer_not_in_base(d),
    "target_module_unknown": lambda d, ctx: bad.module_unknown(d),
    "missing_adapter_config": lambda d, ctx: bad.missing_config(d),
    "dora_config": lambda d, ctx: bad.dora_config(d),
}


# ---- HTTP -------------------------------------------------------------------------------------------------


def short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def error_message(r: httpx.Response) -> str:
    try:
        err = r.json()
        if isinstance(err, dict) and isinstance(err.get("error"), dict):
            return short(str(err["error"].get("message")))
        if isinstance(err, dict) and "detail" in err:
            return short(str(err["detail"]))
    except ValueError:
        pass
    return short(r.text)


class Target:
    """One server to speak to: its URL, the key for inference, the token for load/unload."""

    def __init__(self, url: str, key: str | None, admin: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False)
        self.key = {"Authorization": f"Bearer {key}"} if key else {}
        self.admin = {"Authorization": f"Bearer {admin}"}

    def close(self) -> None:
        self.http.close()

    def healthy(self) -> bool:
        try:
            return self.http.get("/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> list[str]:
        r = self.http.get("/v1/models", headers=self.key)
        r.raise_for_status()
        return [m["id"] for m in r.json()["data"]]

    def load(self, name: str, path: str) -> httpx.Response:
        return self.http.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=self.admin
        )

    def unload(self, name: str) -> httpx.Response:
        return self.http.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=self.admin)

    def complete(self, model: str, http: httpx.Client | None = None) -> tuple[int, list[str] | str]:
        """Greedy answers to PROMPTS under `model`: (200, texts) or (status, error message). A 200 whose `model`
        field is not `model` is reported as status -1 (the answer came back for another request)."""
        body = {
            "model": model,
            "prompt": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        try:
            r = (http or self.http).post("/v1/completions", json=body, headers=self.key)
        except httpx.HTTPError as e:
            return 0, f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return r.status_code, error_message(r)
        out = r.json()
        if out.get("model") != model:
            return -1, f"asked for {model!r}, the answer names {out.get('model')!r}"
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return 200, [c["text"] for c in choices]


def tenants(t: Target, names: list[str]) -> dict[str, Any]:
    return {m: t.complete(m)[1] for m in names}


def mixed_batch(t: Target, ref: dict[str, Any], bad: str, rounds: int) -> tuple[dict[str, Any], int]:
    """The co-tenants' answers, each asked at the same moment as two requests under `bad` (one engine batch, each
    request on its own connection); over `rounds` rounds, a tenant's first answer that differs from `ref` (else
    its reference answer), and how many rounds had any difference."""
    out = dict(ref)
    changed_rounds = 0
    for _ in range(rounds):
        results: dict[str, Any] = {}
        start = threading.Barrier(len(ref) + 2)

        def ask(model: str, key: str, start: threading.Barrier, results: dict[str, Any]) -> None:
            with httpx.Client(base_url=t.url, timeout=HTTP_TIMEOUT_S, trust_env=False) as http:
                start.wait(timeout=30)
                results[key] = t.complete(model, http)[1]

        jobs = [(m, m) for m in ref] + [(bad, f"{bad}#{i}") for i in range(2)]
        threads = [threading.Thread(target=ask, args=(m, k, start, results)) for m, k in jobs]
        for th in threads:
            th.start()
        for th in threads:
            th.join(HTTP_TIMEOUT_S + 30)
        if any(results.get(m) != ref[m] for m in ref):
            changed_rounds += 1
        for m in ref:
            if out[m] == ref[m]:
                out[m] = results.get(m, "no answer")
    return out, changed_rounds


def diff(now: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """The co-tenants whose answers differ from the reference."""
    return sorted(m for m in ref if now.get(m) != ref[m])


def how_changed(now: dict[str, Any], ref: dict[str, Any], extra: dict[str, Any]) -> list[str]:
    """Each changed (tenant, prompt) answer, classified: `nan` (the degenerate answer of a NaN forward: token 0,
    "!", every step), `as <model>` (exactly what another model answers to that prompt: served with the wrong
    adapter; `extra` holds more models' answers to compare with), or `other`."""
    others = {**ref, **extra}
    out = []
    for m in diff(now, ref):
        got = now.get(m)
        if not isinstance(got, list):
            out.append(f"{m}: {short(str(got), 120)}")
            continue
        for i, (text, want) in enumerate(zip(got, ref[m], strict=True)):
            if text == want:
                continue
            if text and set(text) == {"!"}:
                kind = "nan"
            else:
                kind = next(
                    (
                        f"as {o}"
                        for o, ans in others.items()
                        if o != m and isinstance(ans, list) and ans[i] == text
                    ),
                    "other",
                )
            out.append(f"{m} p{i}: {kind}")
    return out


def describe_answer(status: int, answer: list[str] | str, base_answer: list[str]) -> dict[str, Any]:
    if status != 200:
        return {"status": status, "message": answer}
    assert isinstance(answer, list)
    distinct = len(set("".join(answer)))
    return {
        "status": 200,
        "sample": answer[0],
        "same_as_base": answer == base_answer,
        "distinct_chars": distinct,  # 1-2 for a degenerate answer (a NaN forward picks token 0 every step)
    }


# ---- the servers --------------------------------------------------------------------------------------------


class RawVLLM:
    """A raw vLLM with the two healthy adapters loaded straight into it; restarted when a case poisons it."""

    def __init__(self, base_dir: Path, store: Path, logs: Path):
        self.base_dir, self.store, self.logs = base_dir, store, logs
        self.proc: Any = None
        self.target: Target | None = None
        self.starts_s: list[float] = []
        self.n = 0

    def start(self) -> Target:
        port = free_port()
        self.n += 1
        t0 = time.monotonic()
        # unsealed: this phase measures what vLLM itself lets through (mint starts every vLLM sealed)
        self.proc = start_vllm(self.base_dir, port, None, self.logs / f"vllm-raw-{self.n}.log", seal=False)
        self.starts_s.append(round(time.monotonic() - t0, 1))
        self.target = Target(f"http://127.0.0.1:{port}", VLLM_KEY, VLLM_KEY)
        for name in HEALTHY:
            r = self.target.load(name, str(self.store / name))
            if r.status_code != 200:
                raise RuntimeError(f"vLLM refused the healthy adapter {name}: {r.status_code} {r.text}")
        return self.target

    def stop(self) -> None:
        if self.target is not None:
            self.target.close()
        if self.proc is not None:
            stop_server(self.proc, timeout=60)
        self.proc = self.target = None

    def restart(self) -> Target:
        self.stop()
        return self.start()


def unkeyed_routes(t: Target, base_name: str, adapter: Path) -> dict[str, Any]:
    """What vLLM answers with no key at all: its keyed /v1 routes, and the routes its key does not cover (the
    SageMaker adapter routes load and unload adapters; a healthy adapter is used here)."""
    bare = httpx.Client(base_url=t.url, timeout=HTTP_TIMEOUT_S, trust_env=False)
    gen = {"model": base_name, "prompt": "hi", "max_tokens": 2}
    out: dict[str, Any] = {
        "GET /v1/models": bare.get("/v1/models").status_code,
        "POST /v1/completions": bare.post("/v1/completions", json=gen).status_code,
        "POST /v1/load_lora_adapter": bare.post(
            "/v1/load_lora_adapter", json={"lora_name": "unkeyed", "lora_path": str(adapter)}
        ).status_code,
    }
    out["POST /adapters"] = bare.post("/adapters", json={"name": "unkeyed", "src": str(adapter)}).status_code
    out["listed after POST /adapters"] = "unkeyed" in t.models()
    out["POST /invocations"] = bare.post("/invocations", json=gen).status_code
    out["POST /tokenize"] = bare.post("/tokenize", json={"model": base_name, "prompt": "hi"}).status_code
    out["DELETE /adapters/unkeyed"] = bare.delete("/adapters/unkeyed").status_code
    out["listed after DELETE"] = "unkeyed" in t.models()
    bare.close()
    return out


def last_slot_check(
    t: Target, ref: dict[str, Any], store: Path, base: Any, relative: bool, rounds: int
) -> dict[str, Any]:
    """With every LoRA slot taken (the two co-tenants and two more healthy adapters, max_loras 4), requests for
    the bare base batched with LoRA requests: are they answered with the base's own weights?"""
    fillers = {"fill-1": 21, "fill-2": 22}
    for name, seed in fillers.items():
        d = store / name
        if not d.exists():
            a = random_adapter(
                base.sites, TARGETS, RANK, seed=seed, std=0.3, base_fingerprint=base.fingerprint
            )
            save_adapter(a, d, base.sites)
        r = t.load(name, name if relative else str(d))
        assert r.status_code == 200, r.text
    own = {name: t.complete(name)[1] for name in fillers}
    batch_ref = {**ref, **own}
    batch, changed = mixed_batch(t, batch_ref, "fill-1", rounds)
    out = {
        "mixed_batch_rounds": [changed, rounds],
        "changes": how_changed(batch, batch_ref, {}),
        "base_alone_unchanged": tenants(t, [VLLM_BASE_NAME]) == {VLLM_BASE_NAME: ref[VLLM_BASE_NAME]},
    }
    for name in fillers:
        t.unload(name)
    return out


class _Skip(Exception):
    pass


def build_case(store: Path, name: str, ctx: dict[str, Any], base: Any) -> Path:
    d = store / name
    if d.exists():
        shutil.rmtree(d)
    a = random_adapter(base.sites, TARGETS, RANK, seed=31, std=0.3, base_fingerprint=base.fingerprint)
    save_adapter(a, d, base.sites)
    CASES[name](d, ctx)
    return d


def run_case(
    t: Target,
    name: str,
    path: str,
    ref: dict[str, Any],
    base_name: str,
    marker: Path,
    rounds: int,
    behind: Target | None = None,
) -> dict[str, Any]:
    """One case on one server: load it, look, ask (alone, then `rounds` mixed batches), unload, look again
    (`behind`: the vLLM behind a front, asked directly whether it lists the name)."""
    names = list(ref)
    marker.unlink(missing_ok=True)
    t0 = time.monotonic()
    r = t.load(name, path)
    rec: dict[str, Any] = {
        "load_status": r.status_code,
        "load_message": short(r.text) if r.status_code == 200 else error_message(r),
        "load_s": round(time.monotonic() - t0, 2),
    }
    rec["unpickled"] = marker.exists()
    if not t.healthy():
        rec["server_died"] = "after load"
        return rec
    rec["listed"] = name in t.models()
    if behind is not None:
        rec["vllm_lists_it"] = name in behind.models()
    status, answer = t.complete(name)
    rec["answer"] = describe_answer(status, answer, ref[base_name])
    alone = tenants(t, names)
    rec["tenants_changed_while_loaded"] = how_changed(alone, ref, {name: answer})
    batch, rounds_changed = mixed_batch(t, ref, name, rounds)
    rec["tenants_changed_in_mixed_batch"] = how_changed(batch, ref, {name: answer})
    rec["mixed_batch_rounds"] = [rounds_changed, rounds]  # rounds with any tenant changed, rounds run
    if rec["listed"]:
        u = t.unload(name)
        rec["unload_status"] = u.status_code
    if not t.healthy():
        rec["server_died"] = "after unload"
        return rec
    rec["listed_after_unload"] = name in t.models()
    after = tenants(t, names)
    rec["tenants_changed_after_unload"] = how_changed(after, ref, {name: answer})
    changes = [
        c for k in ("while_loaded", "in_mixed_batch", "after_unload") for c in rec[f"tenants_changed_{k}"]
    ]
    rec["tenants_changed"] = bool(changes)
    rec["nan_poisoned"] = any(c.endswith(": nan") for c in changes)  # a co-tenant answers NaN's "!!!"
    rec["cross_served"] = any(": as " in c for c in changes)  # a co-tenant answered with another's weights
    rec["changed_after_unload"] = bool(rec["tenants_changed_after_unload"])
    return rec


# ---- the run -------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=list(CASES), help="these cases (the control always runs)")
    ap.add_argument("--phases", nargs="+", choices=["raw", "mint"], default=["raw", "mint"])
    ap.add_argument("--budget-s", type=float, default=2400, help="stop starting new cases after this")
    ap.add_argument("--rounds", type=int, default=5, help="mixed batches per case")
    ap.add_argument("--control-rounds", type=int, default=40, help="mixed batches of the healthy control")
    args = ap.parse_args()
    stop_servers_on_kill()
    deadline = time.monotonic() + args.budget_s
    cases = ["control_healthy", *[c for c in (args.only or CASES) if c != "control_healthy"]]

    root = Path(tempfile.mkdtemp(prefix="mint-vllm-bad-"))
    logs = root / "logs"
    logs.mkdir()
    base_dir = save_tiny_base(root / VLLM_BASE_NAME, vllm=True)
    base = load_base(base_dir)  # as the front fingerprints it
    other = build_tiny_base(
        "dense", seed=1, tokenizer=byte_tokenizer(), num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )
    assert {s: (x.in_features, x.out_features) for s, x in other.sites.items()} == {
        s: (x.in_features, x.out_features) for s, x in base.sites.items()
    }
    ctx: dict[str, Any] = {"other_fingerprint": other.fingerprint, "marker": root / MARKER}
    store = root / "store"
    store.mkdir()
    for name, seed in HEALTHY.items():
        a = random_adapter(base.sites, TARGETS, RANK, seed=seed, std=0.3, base_fingerprint=base.fingerprint)
        save_adapter(a, store / name, base.sites)
    names = [VLLM_BASE_NAME, *HEALTHY]
    summary: dict[str, Any] = {
        "benchmark": "vllm_bad_adapters",
        "vllm_python": os.environ.get("MINT_VLLM_PYTHON", ".venv-vllm/bin/python"),
        "base": {"dir": VLLM_BASE_NAME, "fingerprint": base.fingerprint[:12], "layers": 2, "head_dim": 32},
        "greedy": {"prompts": len(PROMPTS), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        "max_lora_rank": 16,
        "raw": {},
        "mint": {},
    }

    # -- phase raw --------------------------------------------------------------------------------------------
    raw = RawVLLM(base_dir, store, logs)
    ref: dict[str, Any] = {}
    try:
        if "raw" not in args.phases:
            raise _Skip
        t = raw.start()
        ref = tenants(t, names)
        assert all(isinstance(v, list) for v in ref.values()), ref
        assert tenants(t, names) == ref, "greedy answers differ between two identical asks"
        assert ref["good-a"] != ref[VLLM_BASE_NAME] and ref["good-b"] != ref[VLLM_BASE_NAME]
        summary["reference"] = {m: v[0] for m, v in ref.items()}
        restarts = []
        for case in cases:
            if time.monotonic() > deadline:
                summary["raw"][case] = {"skipped": "budget spent"}
                continue
            d = build_case(store, case, ctx, base)
            t0 = time.monotonic()
            rounds = args.control_rounds if case == "control_healthy" else args.rounds
            rec = run_case(t, case, str(d), ref, VLLM_BASE_NAME, ctx["marker"], rounds)
            rec["case_s"] = round(time.monotonic() - t0, 1)
            if rec.get("tenants_changed") or rec.get("server_died"):
                t = raw.restart()
                after = tenants(t, names)
                rec["restarted"] = True
                rec["restart_restores_reference"] = not diff(after, ref)
                restarts.append(case)
            print(json.dumps({"phase": "raw", "case": case, **rec}, sort_keys=True), flush=True)
            summary["raw"][case] = rec
        summary["raw_restarts"] = restarts
        if time.monotonic() < deadline:
            summary["raw_last_slot"] = last_slot_check(t, ref, store, base, False, args.rounds)
            print(json.dumps({"phase": "raw", "check": "last_slot", **summary["raw_last_slot"]}), flush=True)
        # last: a load through the unkeyed route counts as a runtime load (see the last-slot check)
        summary["raw_unkeyed_routes"] = unkeyed_routes(t, VLLM_BASE_NAME, store / "good-a")
        print(
            json.dumps({"phase": "raw", "check": "unkeyed_routes", **summary["raw_unkeyed_routes"]}),
            flush=True,
        )
    except _Skip:
        pass
    finally:
        raw.stop()
    summary["vllm_start_s"] = raw.starts_s

    # -- phase mint ---------------------------------------------------------------------------------------------
    if "mint" in args.phases and time.monotonic() < deadline:
        vport, fport = free_port(), free_port()
        t0 = time.monotonic()
        # as `mint up --serving vllm` starts it: the resolver plugin asks the front about unknown names
        vproc = start_vllm(base_dir, vport, f"http://127.0.0.1:{fport}", logs / "vllm-front.log")
        summary["vllm_start_s"].append(round(time.monotonic() - t0, 1))
        front = None
        try:
            t0 = time.monotonic()
            front, furl = start_front(f"http://127.0.0.1:{vport}", store, base_dir, fport, None)
            summary["front_start_s"] = round(time.monotonic() - t0, 1)
            f = Target(furl, None, ADMIN_TOKEN)
            v = Target(f"http://127.0.0.1:{vport}", VLLM_KEY, VLLM_KEY)
            for name in HEALTHY:
                r = f.load(name, name)
                assert r.status_code == 200, r.text
            ref_front = tenants(f, names)
            if ref:
                summary["front_reference_equals_raw"] = ref_front == ref
            for case in cases:
                if time.monotonic() > deadline:
                    summary["mint"][case] = {"skipped": "budget spent"}
                    continue
                d = build_case(store, case, ctx, base)
                t0 = time.monotonic()
                rounds = args.control_rounds if case == "control_healthy" else args.rounds
                rec = run_case(f, case, d.name, ref_front, VLLM_BASE_NAME, ctx["marker"], rounds, behind=v)
                rec["case_s"] = round(time.monotonic() - t0, 1)
                print(json.dumps({"phase": "mint", "case": case, **rec}, sort_keys=True), flush=True)
                summary["mint"][case] = rec
            if time.monotonic() < deadline:
                summary["mint_last_slot"] = last_slot_check(f, ref_front, store, base, True, args.rounds)
                print(
                    json.dumps({"phase": "mint", "check": "last_slot", **summary["mint_last_slot"]}),
                    flush=True,
                )
            f.close()
            v.close()
        finally:
            if front is not None:
                stop_server(front)
            stop_server(vproc, timeout=60)

    summary["table"] = table(summary)
    summary["logs"] = str(logs)
    summary["wall_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    report(summary)


def table(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case: raw vLLM's outcome beside mint's."""
    rows = []
    for case in dict.fromkeys([*summary["raw"], *summary["mint"]]):
        r, m = summary["raw"].get(case, {}), summary["mint"].get(case, {})
        row: dict[str, Any] = {"case": case}
        if "load_status" in r:
            row["raw_load"] = r["load_status"]
            row["raw_listed"] = r.get("listed")
            row["raw_answers"] = r.get("answer", {}).get("status") == 200
            row["raw_nan_poisons_tenants"] = r.get("nan_poisoned")
            row["raw_cross_served"] = r.get("cross_served")
            row["raw_changed_after_unload"] = r.get("changed_after_unload")
            row["raw_restart"] = bool(r.get("restarted"))
            if r.get("server_died"):
                row["raw_server_died"] = r["server_died"]
        if "load_status" in m:
            row["mint_load"] = m["load_status"]
            row["mint_message"] = m["load_message"][:120]
            row["vllm_lists_it_behind_mint"] = m.get("vllm_lists_it")
            row["mint_tenants_changed"] = m.get("tenants_changed")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
