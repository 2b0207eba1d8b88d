"""The fault suite: each scenario is driven against real services, started here as `mint up` starts them (under
supervision, on free ports, in a temporary state dir, over a tiny base), and ends with what was tried, what
happened, and what was lost. Run with the project's venv from the repository root:

    .venv/bin/python scripts/faults.py [--only NAME[,NAME]] [--json FILE] [--keep]

It prints one Markdown table (docs/faults.md's table is this output) and exits 1 when a scenario lost data or
left serving disagreeing with the registry. Scenarios (names for --only):

  server    kill -9 `mint serve` mid-stream: the client gets a clean error, supervision brings the server back,
            and the champion answers the first request after it
  worker    kill -9 the Prefect worker while a flow run it started trains: the run goes down with it, the worker's
            supervisor requeues it, the new worker runs it again, and it resumes and registers one version
  mlflow    kill -9 MLflow while a promotion runs: after supervision brings it back, the alias and what serving
            answers with agree
  prefect   kill -9 the Prefect server while a flow trains: the run is rerun and resumes from its checkpoint, with
            no duplicate version
  disk      the store's filesystem is full when a revision is exported: the export fails with ENOSPC named, and
            no half revision is left (store, registry, catalog)
  race      two promotions of one policy at once, one as the MLflow UI makes it (REST alias call), one from
            `mint registry promote`: one champion, and serving answers with it
  poison    a NaN adapter forced into vLLM behind mint's back (serving vllm, its own vLLM and front): the sealed
            vLLM refuses it unkeyed; forced with mint's key (a compromised path), the golden probe notices,
            takes the replica out of rotation and has its supervisor restart it, and it comes back clean

A fleet of two vLLM replicas the front routes over (`mint up --serving vllm --replicas 2`, one fleet for these
rows, scripts/fault_fleet.py):

  fleet-poison      the poison row on the fleet: the golden probe, asking each replica at its own URL, finds the
                    poisoned one only; the front stops routing to it, the other answers, it comes back clean
  fleet-kill        kill -9 of one replica under load: only requests in flight on it may fail; its supervisor
                    restarts it and it rejoins, answering with the champion
  fleet-promote     a promotion while one replica is down completes on the other; the replica comes back on the
                    new champion
  fleet-unreadable  one replica cannot read the new revision (its own mount namespace lacks the directory): the
                    promotion fails naming it, every replica is put back, the alias does not move
  fleet-rogue       under load, a local process's own server is offered as a worker through every admin route
                    vllm-router had, on every port the stack listens on: it receives no request, and no answer of
                    it reaches a client

Minutes on 2 cores (a flow trains a few steps of a tiny policy). The `faults` tests run it (tests/integration/
test_faults.py, slow tier).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fault_fleet  # noqa: E402
from fault_stack import (  # noqa: E402
    TARGETS,
    Faults,
    Row,
    free_port,
    last_line,
    nan_adapter,
    say,
    table,
    tiny_vllm_base,
    workdir,
)

from mint_app.services.config import ServiceName, ServicesConfig  # noqa: E402
from mint_app.services.control import start, stop  # noqa: E402
from mint_app.services.mlflow_auth import PASSWORD_ENV, USER_ENV  # noqa: E402
from mint_app.services.processes import service_log  # noqa: E402
from mint_core.engine.base import load_base  # noqa: E402
from mint_core.lora.adapter import random_adapter  # noqa: E402

SCENARIOS = ("server", "worker", "mlflow", "prefect", "disk", "race", "poison", *fault_fleet.SCENARIOS)


# ---------------------------------------------------------------------------------------------------------
# the scenarios


def scenario_server(f: Faults) -> Row:
    policy = "f-serve"
    digests = f.seed(policy, [1])
    url = f.config.url("serve")
    body = {"model": policy, "prompt": "add: 1+2 =", "max_tokens": 400, "ignore_eos": True, "stream": True}
    got: dict[str, Any] = {}

    def stream() -> None:
        t0 = time.monotonic()
        try:
            admin = {"Authorization": f"Bearer {f.ws.admin_token()}"}  # serving keys are on in a stack
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=admin, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.setdefault("first", time.monotonic())
                        if line == "data: [DONE]":
                            got["done"] = True
            got["error"] = "stream ended without [DONE]" if not got.get("done") else None
        except httpx.HTTPError as e:
            got["error"] = type(e).__name__
        got["ended"] = time.monotonic() - t0

    th = threading.Thread(target=stream)
    th.start()
    while "first" not in got and th.is_alive():
        time.sleep(0.01)
    killed_at = time.monotonic()
    pid = f.kill9("serve")
    th.join(60)
    cut = f"client: {got.get('error')} {time.monotonic() - killed_at:.1f} s after the kill"
    back = f.back("serve", pid)
    t0 = time.monotonic()
    answered = f.answered_by(policy)  # the first request after the restart: resolved in the catalog on demand
    first = time.monotonic() - t0
    ok_answer = answered.removeprefix("sha256:") == digests[1]
    agree, detail = f.agree(policy)
    ok = bool(got.get("error")) and not th.is_alive() and ok_answer and agree
    result = (
        f"{cut}; back in {back:.0f} s; first request answered by the champion ({first:.2f} s): {ok_answer}"
    )
    return Row(
        "kill -9 mint serve mid-stream",
        "a 400-token stream; kill -9 of the server after its first chunk",
        f"{result}; {detail}",
        0 if ok_answer and agree else 1,
        ok,
        0,
    )


def scenario_worker(f: Faults) -> Row:
    """A flow run started on the worker (as the dashboard starts one); the worker is killed while it trains. Its
    supervisor requeues the run the dead worker took down, and the new worker runs it again: it resumes."""
    import asyncio

    from prefect.client.orchestration import get_client

    policy = "f-worker"

    async def run_and_kill() -> tuple[str, str | None, int]:
        async with get_client() as c:
            dep = await c.read_deployment_by_name("lifecycle/lifecycle")
            run = await c.create_flow_run_from_deployment(dep.id, parameters=f.flow_params(policy, 6, "w1"))
            say(f"flow run {run.name} created on the worker's pool")
            await asyncio.to_thread(f.checkpointed)
            pid = f.kill9("worker")
            say(f"worker (pid {pid}) killed after the first checkpoint")
            await asyncio.to_thread(f.back, "worker", pid)  # requeued before the new worker started
            t0 = time.monotonic()
            while time.monotonic() - t0 < 600:
                r = await c.read_flow_run(run.id)
                if r.state and r.state.is_final():
                    return r.state.type.value, r.state.message, r.run_count
                await asyncio.sleep(2)
            return "TIMEOUT", None, 0

    state, msg, attempts = asyncio.run(run_and_kill())
    state = f"{state} ({msg[:80]})" if msg and state != "COMPLETED" else state
    requeued = "requeued" in service_log(f.config, "worker").read_text()
    versions = f.versions(policy)
    resumed = f.resumed_from(policy, versions[-1]) if versions else "?"
    agree, detail = f.agree(policy)
    ok = versions == [1] and agree and state == "COMPLETED"
    return Row(
        "kill -9 the Prefect worker mid-wave",
        "a lifecycle run from the worker's deployment (6 steps); kill -9 of the worker after its first checkpoint",
        f"the run was requeued by the worker's supervisor: {requeued}; it ended {state} after {attempts} "
        f"attempt(s), resumed from step {resumed}; versions {versions}; {detail}",
        0 if versions == [1] and agree else 1,
        ok,
        0,
    )


def scenario_mlflow(f: Faults) -> Row:
    policy = "f-mlflow"
    f.seed(policy, [21, 22])
    code = (
        "import sys; from flows.promotion import promote_flow; from mint_core.lifecycle.workspace import Workspace; "
        "promote_flow(sys.argv[1], 2, expect=1, workspace=Workspace.model_validate_json(sys.argv[2]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, policy, f.ws.model_dump_json()],
        env=f.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(4.0)  # the flow is past its imports and speaking to MLflow
    pid = f.kill9("mlflow")
    back = f.back("mlflow", pid)
    out, _ = proc.communicate(timeout=600)
    said = last_line(out) if proc.returncode else ""
    agree, detail = f.agree(policy)
    v, _ = f.champion(policy)
    ok = agree and f.versions(policy) == [1, 2] and v in (1, 2)
    return Row(
        "kill -9 MLflow mid-promote",
        "promote v2 over v1; kill -9 of MLflow 4 s into the promotion",
        f"promotion exited {proc.returncode}{said}; MLflow back in {back:.0f} s; after reconcile {detail}",
        0 if ok else 1,
        ok,
        0,
    )


def scenario_prefect(f: Faults) -> Row:
    policy = "f-prefect"
    proc = f.lifecycle_process(policy, 6, "p1")
    f.checkpointed(proc)
    pid = f.kill9("prefect")
    back = f.back("prefect", pid)
    out, _ = proc.communicate(timeout=900)
    first = f"the run exited {proc.returncode}{last_line(out) if proc.returncode else ''}"
    rerun = ""
    if proc.returncode != 0:
        again = f.lifecycle_process(policy, 6, "p1")
        out2, _ = again.communicate(timeout=900)
        rerun = f"; rerun exited {again.returncode}{last_line(out2) if again.returncode else ''}"
    versions = f.versions(policy)
    if rerun and versions:
        rerun += f", resumed from step {f.resumed_from(policy, versions[-1])}"
    agree, detail = f.agree(policy)
    ok = versions == [1] and agree
    return Row(
        "kill -9 the Prefect server mid-wave",
        "a lifecycle run (6 steps); kill -9 of the Prefect server after its first checkpoint",
        f"{first} (Prefect back in {back:.0f} s){rerun}; versions {versions}; {detail}",
        0 if ok else 1,
        ok,
        0,
    )


def scenario_disk(f: Faults) -> Row:
    from mint_core.errors import MintError

    policy = "f-disk"
    mnt = f.root / "small-disk"
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if made.returncode != 0:
        return Row(
            "disk full during export",
            "a store on a 256 KiB filesystem",
            f"not run: cannot mount a small filesystem here ({made.stderr.strip()})",
            0,
            True,
            0,
        )
    try:
        ws = f.ws.model_copy(update={"store": str(mnt / "store")})
        reg = ws.registry()
        sites = f.base.sites
        w = random_adapter(sites, TARGETS, 4, alpha=8, seed=31, base_fingerprint=f.base.fingerprint)
        first = reg.store.put_weights(w, sites)  # one revision fits
        rev = reg.create_revision(policy, first, base=f.base.fingerprint, rank=4, alias=None)
        with (
            open(mnt / "filler", "wb", buffering=0) as out,
            contextlib.suppress(OSError),
        ):  # fill what is left
            while True:
                out.write(b"\0" * 4096)
                out.flush()
        before = sorted(p.relative_to(mnt) for p in (mnt / "store").rglob("*"))
        w2 = random_adapter(sites, TARGETS, 4, alpha=8, seed=32, base_fingerprint=f.base.fingerprint)
        try:
            reg.store.put_weights(w2, sites)
            error = "none: the export succeeded on a full disk"
        except (MintError, OSError) as e:
            error = f"{type(e).__name__}: {str(e).replace(str(mnt), '<disk>')[:160]}"
        after = sorted(p.relative_to(mnt) for p in (mnt / "store").rglob("*"))
        versions = f.versions(policy)
        (mnt / "filler").unlink()
        ok = "No space" in error or "ENOSPC" in error or "space" in error.lower()
        clean = before == after and versions == [rev.version]
        leftovers = [str(p) for p in after if p not in before]
        return Row(
            "disk full during export",
            "a second revision exported to a store whose filesystem is full",
            f"export refused ({error}); store files unchanged: {before == after} {leftovers[:3]}; versions "
            f"{versions}",
            0 if clean else 1,
            ok and clean,
            0,
        )
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def scenario_race(f: Faults) -> Row:
    policy = "f-race"
    f.seed(policy, [41, 42, 43])
    mlflow = f.config.url("mlflow")
    results: dict[str, str] = {}

    def ui() -> None:  # what the MLflow UI sends when a user sets an alias on a version page
        r = httpx.post(
            mlflow + "/ajax-api/2.0/mlflow/registered-models/alias",
            json={"name": policy, "alias": "champion", "version": "2"},
            auth=(f.env[USER_ENV], f.env[PASSWORD_ENV]),  # a logged-in user: MLflow asks who moves an alias
            timeout=60,
        )
        results["ui"] = f"{r.status_code}"

    def cli() -> None:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "mint_app.cli.app",
                "registry",
                "promote",
                policy,
                "3",
                "-m",
                "fault suite",
                "--catalog",
                f.ws.catalog_url,
                "--store",
                f.ws.store,
                "--tracking-uri",
                mlflow,
            ],
            env=f.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        results["cli"] = f"exit {p.returncode}"

    threads = [threading.Thread(target=ui), threading.Thread(target=cli)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    # serving follows the alias through the webhook receiver within seconds; reconcile is the safety net
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        v, digest = f.champion(policy)
        if digest is not None and f.listed(policy) == f"sha256:{digest}":
            break
        time.sleep(0.5)
    settled = time.monotonic() - (deadline - 30)
    v, digest = f.champion(policy)
    by_webhook = f.listed(policy) == f"sha256:{digest}"
    agree, detail = f.agree(policy)
    ok = agree and v in (2, 3) and f.versions(policy) == [1, 2, 3] and by_webhook
    return Row(
        "two promotions at once (UI and CLI)",
        "v2 from the MLflow UI's alias call and v3 from mint registry promote, together",
        f"UI {results.get('ui')}, CLI {results.get('cli')}; champion v{v}; serving "
        f"followed in {settled:.1f} s: {by_webhook}; {detail}",
        0 if ok else 1,
        ok,
        0,
    )


def scenario_poison(f: Faults) -> Row:
    """serving vllm, started as `mint up --serving vllm` starts it (vLLM sealed and supervised, the front with its
    golden probe at the default interval), over a tiny head_dim-32 base, with a champion in the catalog. Traffic
    runs through the front (base and champion, greedy, each answer compared with the one given before the attack).
    vLLM is attacked as issue #34 describes: unkeyed `POST /adapters` and `/v1/load_lora_adapter` (the seal must
    refuse both); then, since the seal leaves no unkeyed way in, as a compromised path that holds mint's key: the
    NaN adapter loaded straight into vLLM and requests under it in batches with other tenants'. Recorded: seconds
    from the poisoning requests to the front taking the replica out of rotation, bad answers served in between
    (none may follow detection), seconds out of rotation, and whether every answer after it came back equals the
    one before the attack."""
    from mint_app.services.commands import hooks_workspace
    from mint_core.registry.catalog import Catalog, CatalogConfig
    from mint_core.registry.store import AdapterStore
    from mint_core.serving.config import ServingConfig

    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_python.is_file():
        return Row("NaN adapter forced into vLLM", "", "not run: no .venv-vllm (make vllm-venv)", 1, False, 0)
    root = f.root / "poison"
    base_dir = root / "tiny-vllm"
    base = load_base(tiny_vllm_base(base_dir))
    cfg = ServicesConfig.model_validate(
        {
            "state_dir": root / "run",
            "serving": "vllm",
            "vllm_python": vllm_python,
            "vllm_port": free_port(),
            "serve_port": free_port(),
            "serve_base": str(base_dir),
            "serve_adapter_root": root / "store",
            "catalog_url": f"sqlite:///{root / 'catalog.db'}",
            "startup_timeout": 300,
        }
    )
    interval = ServingConfig().golden_interval_s  # the default the front runs with
    # the champion: a healthy revision in the store, the catalog's champion of `f-champ` (resolved on demand)
    store = AdapterStore(cfg.serve_adapter_root or root / "store")
    champ = random_adapter(base.sites, TARGETS, 8, seed=5, std=0.3, base_fingerprint=base.fingerprint)
    digest = str(store.put_weights(champ, base.sites))
    cat = Catalog(CatalogConfig(url=hooks_workspace(cfg)["catalog_url"]))
    version = cat.register(digest, base.fingerprint, 8, str(store.local_dir(digest)), policy="f-champ")
    assert version is not None
    cat.set_alias("f-champ", "champion", version)
    evil = nan_adapter(base_dir, root / "evil", seed=6)
    t_start = time.monotonic()
    f.cleanup.append(
        lambda: stop(cfg)
    )  # a start that fails half way (vLLM up, the front not) still stops both
    start(cfg, ["vllm", "serve"], progress=lambda m: say(m))
    say(f"vllm and its front up ({time.monotonic() - t_start:.0f} s)")
    front, vllm = cfg.url("serve"), cfg.url("vllm")
    key = {"Authorization": "Bearer " + (cfg.state_dir / "vllm.key").read_text().strip()}
    log = service_log(cfg, "serve")
    prompts = {"tiny-vllm": "Hello, world", "f-champ": "add: 2+3 ="}
    gen = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    try:
        admin = {"Authorization": "Bearer " + (cfg.state_dir / "serve.token").read_text().strip()}
        with httpx.Client(timeout=120, trust_env=False, headers=admin) as h:

            def ask(model: str) -> httpx.Response:
                return h.post(
                    front + "/v1/completions", json={"model": model, "prompt": prompts[model], **gen}
                )

            expected = {
                m: ask(m).json()["choices"][0]["text"] for m in prompts
            }  # f-champ: resolved on demand
            t0 = time.monotonic()
            while 'mint_golden_recorded{of="champion f-champ"}' not in h.get(front + "/metrics").text:
                if time.monotonic() - t0 > 120:  # the probe after its load records it
                    raise TimeoutError("the golden probe never recorded the champion's answers")
                time.sleep(0.5)
            say(f"golden answers recorded; before the attack: {expected}")

            answers: list[tuple[float, str, int, bool]] = []  # (when, model, status, as before)
            stop_traffic = threading.Event()

            def traffic() -> None:
                i = 0
                while not stop_traffic.is_set():
                    model = list(prompts)[i % 2]
                    i += 1
                    try:
                        r = ask(model)
                    except httpx.HTTPError:
                        answers.append((time.monotonic(), model, 0, False))
                        time.sleep(0.2)
                        continue
                    good = r.status_code == 200 and r.json()["choices"][0]["text"] == expected[model]
                    answers.append((time.monotonic(), model, r.status_code, good))
                    if r.status_code != 200:
                        time.sleep(0.2)

            def probes(outcome: str) -> float:
                for line in h.get(front + "/metrics").text.splitlines():
                    if line.startswith(f'mint_golden_probes_total{{outcome="{outcome}"}}'):
                        return float(line.split()[-1])
                return 0.0

            # two clients, so the probe runs beside batched traffic before the attack: it must not cry wolf
            threads = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
            for th in threads:
                th.start()
            passed_before = probes("pass")
            t0 = time.monotonic()
            while probes("pass") < passed_before + 2 and time.monotonic() - t0 < 4 * interval:
                time.sleep(1)
            soak = (probes("pass") - passed_before, probes("fail"), time.monotonic() - t0)
            say(f"before the attack, beside traffic: {soak[0]:.0f} probes passed, {soak[1]:.0f} failed")
            # the attack of issue #34, from a process without mint's key
            unkeyed = {
                "POST /adapters": h.post(
                    vllm + "/adapters", json={"name": "evil", "src": str(evil)}
                ).status_code,
                "POST /v1/load_lora_adapter": h.post(
                    vllm + "/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": str(evil)}
                ).status_code,
            }
            sealed = all(code == 401 for code in unkeyed.values())
            # a compromised path with mint's key: straight into vLLM, past the front's validation
            forced = h.post(
                vllm + "/v1/load_lora_adapter",
                json={"lora_name": "evil", "lora_path": str(evil)},
                headers=key,
            ).status_code
            # requests under it that share vLLM's batch with other tenants' (its NaN reaches them there, and
            # stays: measured, one request alone under it left the others' answers as they were)
            poisoned_at = time.monotonic()

            def direct(model: str) -> int:
                body = {"model": model, "prompt": "Hello, world", "max_tokens": 16, "ignore_eos": True}
                return h.post(vllm + "/v1/completions", json=body, headers=key).status_code

            def base_answer() -> str:
                try:
                    r = h.post(
                        vllm + "/v1/completions",
                        json={"model": "tiny-vllm", "prompt": prompts["tiny-vllm"], **gen},
                        headers=key,
                    )
                except httpx.HTTPError as e:  # the probe may have found it first and killed it
                    return f"no answer ({type(e).__name__})"
                return str(r.json()["choices"][0]["text"]) if r.status_code == 200 else str(r.status_code)

            # bursts until vLLM's own base answers garbage (how many a batch needs varies from run to run), or
            # until the front has already taken it out
            bursts, base_now, confirmed_at, codes = 0, expected["tiny-vllm"], None, []
            while bursts < 20 and not any(a[2] == 503 for a in answers if a[0] > poisoned_at):
                bursts += 1
                with ThreadPoolExecutor(8) as pool:
                    codes = list(pool.map(direct, ["evil", "tiny-vllm", "evil", "_mint_base"] * 3))
                base_now = base_answer()
                if base_now != expected["tiny-vllm"]:
                    confirmed_at = time.monotonic()
                    break
            poisoned = confirmed_at is not None or any(
                a[2] == 200 and not a[3] for a in answers if a[0] > poisoned_at
            )
            say(
                f"unkeyed: {unkeyed}; forced with the key: {forced}; {bursts} burst(s) of requests under it "
                f"batched with others ({codes[:4]}...); vLLM's base now answers {base_now!r} "
                f"(before: {expected['tiny-vllm']!r})"
            )
            detected_at = back_at = None
            t0 = time.monotonic()
            while time.monotonic() - t0 < interval + 600:
                time.sleep(0.5)
                after = [a for a in answers if a[0] > poisoned_at]
                if detected_at is None and any(a[2] == 503 for a in after):
                    detected_at = next(a[0] for a in after if a[2] == 503)
                if detected_at is not None:
                    later = [a for a in after if a[0] > detected_at and a[2] == 200]
                    if len(later) >= 20:
                        back_at = later[0][0]
                        break
            stop_traffic.set()
            for th in threads:
                th.join(120)
    finally:
        stop(cfg)
    text = log.read_text()
    after = [a for a in answers if a[0] > poisoned_at]
    bad_before = [
        a for a in after if a[2] == 200 and not a[3] and (detected_at is None or a[0] < detected_at)
    ]
    bad_after = [
        a for a in after if a[2] == 200 and not a[3] and detected_at is not None and a[0] >= detected_at
    ]
    refused = [a for a in after if a[2] == 503]
    came_back = [a for a in after if back_at is not None and a[0] >= back_at]
    clean = bool(came_back) and all(a[2] == 200 and a[3] for a in came_back)
    evidence = "golden evidence:" in text and "restarting it" in text
    bad_times = [a[0] for a in after if a[2] == 200 and not a[3]] + ([confirmed_at] if confirmed_at else [])
    first_bad = min(bad_times) if bad_times else poisoned_at
    detect_s = None if detected_at is None else detected_at - first_bad
    out_s = None if back_at is None or detected_at is None else back_at - detected_at
    quiet = soak[0] >= 2 and soak[1] == 0  # no false alarm beside traffic
    ok = (
        quiet
        and sealed
        and forced == 200
        and poisoned
        and detected_at is not None
        and evidence
        and clean
        and not bad_after
    )
    fmt = lambda x: "never" if x is None else f"{x:.1f} s"  # noqa: E731
    result = (
        f"beside traffic before the attack {soak[0]:.0f} probes passed, {soak[1]:.0f} failed; "
        f"unkeyed {', '.join(f'{k} {v}' for k, v in unkeyed.items())}; forced with mint's key: {forced}, "
        f"poisoned: {poisoned} after {bursts} burst(s) (vLLM's base answered {base_now!r}); "
        f"detected {fmt(detect_s)} after the first garbage answer (probe every {interval:g} s); "
        f"bad answers served: {len(bad_before)} of {len(after)} after it ({len(bad_after)} after detection); "
        f"out of rotation (503, {len(refused)} refused) for {fmt(out_s)}; restarted by its supervisor, "
        f"back clean: {clean} ({len(came_back)} answers after, all as before the attack: {clean}); "
        f"evidence logged: {evidence}"
    )
    return Row(
        "NaN adapter forced into vLLM behind mint's back",
        "issue #34's attack on a sealed vLLM (unkeyed /adapters, /v1/load_lora_adapter); then, as a compromised "
        "path with mint's key, a NaN adapter loaded straight into vLLM and requests under it batched with other "
        "tenants', under traffic through the front",
        result,
        len(bad_after) + (0 if clean else 1),
        ok,
        0,
    )


RUNS: dict[str, tuple[Callable[[Faults], Row], list[ServiceName]]] = {
    "server": (scenario_server, ["mlflow", "serve", "hooks"]),
    "worker": (scenario_worker, ["mlflow", "prefect", "serve", "hooks", "worker"]),
    "mlflow": (scenario_mlflow, ["mlflow", "prefect", "serve", "hooks"]),
    "prefect": (scenario_prefect, ["mlflow", "prefect", "serve", "hooks"]),
    "disk": (scenario_disk, ["mlflow", "serve"]),
    "race": (scenario_race, ["mlflow", "serve", "hooks"]),
    "poison": (scenario_poison, []),  # its own vLLM and front (serving vllm)
    # one fleet of vLLM replicas for these (serving vllm), the suite's MLflow and Prefect for the promotions
    **{name: (fn, fault_fleet.SERVICES) for name, fn in fault_fleet.SCENARIOS.items()},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary state dir (logs) for a look")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}: choose from {','.join(SCENARIOS)}")
    rows: list[Row] = []
    # SIGTERM (a test's timeout, a CI job stopped) unwinds like ^C: the `finally` below stops every service
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with workdir(args.keep) as root:
        say(f"state in {root}")
        f = Faults(root)
        f.shared["only"] = names  # the fleet rows share one outage where they can
        try:
            needed = sorted({s for n in names for s in RUNS[n][1]}, key=list(RUNS["worker"][1]).index)
            if needed:
                f.up(needed)
            for name in names:
                fn, _ = RUNS[name]
                say(f"scenario {name} ...")
                t0 = time.monotonic()
                try:
                    row = fn(f)
                except Exception as e:  # a scenario that breaks is a failed row; the suite goes on
                    row = Row(name, "", f"the scenario broke: {type(e).__name__}: {e}", 1, False, 0)
                row.seconds = time.monotonic() - t0
                say(f"{name}: {'ok' if row.ok else 'FAILED'}: {row.result}")
                rows.append(row)
        finally:
            f.down()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0 if all(r.ok and r.lost == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
