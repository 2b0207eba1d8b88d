"""The fault suite's rows for a fleet of vLLM replicas (issue #34, item 3): `mint up --serving vllm --replicas 2`
as `mint up` starts it (two sealed, supervised vLLM replicas, mint serve before them routing over them itself, each
on a free port in the suite's temporary state dir), over the tiny head_dim-32 base, with the suite's MLflow and
Prefect for the promotion flows. One fleet serves the rows in turn; each row leaves both replicas up and routed
to. Imported by faults.py.

Each replica runs in a mount namespace of its own, as a replica in its own container would: vLLM's interpreter
is given as a two-line wrapper that starts it under `unshare --mount` (the `unreadable` row hides a revision from
one replica's view of the store that way). Nothing else about `mint up` changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psutil
from fault_stack import (
    Faults,
    Row,
    back,
    champion_of,
    child,
    free_port,
    kill9,
    nan_adapter,
    say,
    seed_revisions,
    tiny_vllm_base,
)

from mint_app.services.config import ServiceName, ServicesConfig
from mint_app.services.control import start, status, stop
from mint_app.services.processes import service_log
from mint_core.engine.base import load_base
from mint_core.lifecycle.smoke import served_revision
from mint_core.lifecycle.workspace import Workspace
from mint_core.serving.config import ServingConfig
from mint_core.serving.fleet import replica_name

ROOT = Path(__file__).resolve().parents[1]
REPLICAS: list[ServiceName] = ["vllm", "vllm-1"]
RESTART_S = 1200.0  # a vLLM restart: 1-2 min on 2 idle cores, 9 min measured beside other engineers' vLLMs


def free_pair(step: int) -> int:
    """A port p with p + step free too (the replicas are at vllm_port + i)."""
    for _ in range(100):
        p = free_port()
        with contextlib.suppress(OSError):
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", p + step))
            return p
    raise RuntimeError("no two free ports side by side")


@dataclass
class FleetStack:
    """The fleet the rows share, a Workspace over it (the suite's MLflow, the fleet's store and catalog)."""

    config: ServicesConfig
    ws: Workspace
    base_dir: Path
    key: dict[str, str]  # mint's full key: what a compromised path would hold (the rows force faults with it)
    front: str
    urls: dict[ServiceName, str] = field(default_factory=dict)

    def name(self, service: ServiceName) -> str:
        return replica_name(self.urls[service])

    @property
    def admin(self) -> dict[str, str]:
        """The front's admin token as a header (mint's own credential: every policy, and /metrics)."""
        return {"Authorization": f"Bearer {self.ws.admin_token()}"}

    def service(self, replica: str) -> ServiceName:
        return next(s for s in REPLICAS if self.name(s) == replica)

    def seed(self, policy: str, seeds: list[int]) -> dict[int, str]:
        """Random revisions of `policy` (version -> digest); v1 promoted and served on every replica."""
        return seed_revisions(self.ws, load_base(self.base_dir), policy, seeds, std=0.3)

    def champion(self, policy: str) -> tuple[int | None, str | None]:
        return champion_of(self.ws, policy)

    def held(self, service: ServiceName, name: str) -> str | None:
        """The digest the replica itself lists under `name` (asked past the front)."""
        r = httpx.get(self.urls[service] + "/v1/models", headers=self.key, timeout=30)
        r.raise_for_status()
        return next((Path(c["root"]).name for c in r.json()["data"] if c["id"] == name), None)

    def ask_replica(self, service: ServiceName, name: str) -> httpx.Response:
        """A request straight to one replica (a name it does not hold is resolved through the front)."""
        body = {"model": name, "prompt": "add: 1+2 =", "max_tokens": 2, "temperature": 0.0}
        return httpx.post(self.urls[service] + "/v1/completions", json=body, headers=self.key, timeout=120)

    def report(self) -> dict[str, Any]:
        token = (self.config.state_dir / "serve.token").read_text().strip()
        r = httpx.get(
            self.front + "/v1/mint/replicas", headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
        return dict(r.json())

    def agree(self, policy: str) -> tuple[bool, str]:
        """Whether the alias, the front's listing, an answer and every replica name one revision."""
        v, digest = self.champion(policy)
        with self.ws.client(timeout=60) as c:
            listed = served_revision(c, policy)
            answered = str(c.complete(policy, "add: 1+2 =", max_tokens=2)["system_fingerprint"])
        held = [self.held(s, policy) for s in REPLICAS]
        ok = (
            digest is not None
            and listed == f"sha256:{digest}"
            and answered.removeprefix("sha256:") == digest
            and held == [digest, digest]
        )
        return ok, (
            f"champion v{v} {str(digest)[:8]}, listed {str(listed)[7:15]}, answered "
            f"{answered.removeprefix('sha256:')[:8]}, "
            f"held by the replicas {[str(h)[:8] for h in held]}"
        )

    def ready(self) -> None:
        """Both replicas up and routed to (a row starts on a whole fleet, whatever the row before left)."""
        for r in REPLICAS:
            self.in_rotation(r, time.time(), timeout=RESTART_S)

    def in_rotation(self, service: ServiceName, after: float, timeout: float = RESTART_S) -> float:
        """Seconds from `after` until `service` answers /health and is healthy and in rotation in the front's
        report."""
        url = self.urls[service]
        while time.time() - after < timeout:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", headers=self.key, timeout=5).status_code == 200:
                    report = {r["url"]: r for r in self.report()["replicas"]}
                    if report[url]["healthy"] and report[url].get("out_of_rotation") is None:
                        return time.time() - after
            time.sleep(0.5)
        raise TimeoutError(f"{service} not back in rotation within {timeout:.0f} s")


def wrapper(root: Path) -> Path:
    """vLLM's interpreter, started in a mount namespace of its own (a container's view of the store)."""
    python = (ROOT / ".venv-vllm" / "bin" / "python").absolute()
    out = root / "vllm-python"
    out.write_text(f'#!/bin/sh\nexec unshare --mount --propagation private {python} "$@"\n')
    out.chmod(0o755)
    return out


def fleet(f: Faults) -> FleetStack:
    """The suite's fleet, started by the first row that needs it (stopped with the suite)."""
    if "fleet" in f.shared:
        if f.shared["fleet"] is None:
            raise RuntimeError("the fleet did not start (see the first fleet row)")
        return f.shared["fleet"]  # type: ignore[no-any-return]
    if not (ROOT / ".venv-vllm" / "bin" / "python").is_file():
        raise RuntimeError("no .venv-vllm (make vllm-venv)")
    root = f.root / "fleet"
    root.mkdir()
    base_dir = tiny_vllm_base(root / "tiny-vllm")
    cfg = ServicesConfig.model_validate(
        {
            "state_dir": root / "run",
            "serving": "vllm",
            "replicas": 2,
            "vllm_python": wrapper(root),
            "vllm_port": free_pair(1),
            "serve_port": free_port(),
            "serve_base": str(base_dir),
            "serve_adapter_root": root / "store",
            "catalog_url": f"sqlite:///{root / 'catalog.db'}",
            "startup_timeout": 300,
            "vllm_start_timeout_s": RESTART_S,  # two vLLM starts at once on a shared 2-core machine
        }
    )
    t0 = time.time()
    f.cleanup.append(lambda: stop(cfg))
    f.shared["fleet"] = None  # tried: a fleet that did not start is not started again by the next row
    start(cfg, [*REPLICAS, "serve"], progress=lambda m: say(m))
    say(f"a fleet of 2 vLLM replicas and the front up ({time.time() - t0:.0f} s)")
    ws = f.ws.model_copy(
        update={
            "store": str(root / "store"),
            "catalog_url": f"sqlite:///{root / 'catalog.db'}",
            "base": base_dir,
            "serving_url": cfg.url("serve"),
            "admin_token_file": cfg.state_dir / "serve.token",
            "work_dir": root / "work",
        }
    )
    key = {"Authorization": "Bearer " + (cfg.state_dir / "vllm.key").read_text().strip()}
    stack = FleetStack(cfg, ws, base_dir, key, cfg.url("serve"), {s: cfg.url(s) for s in REPLICAS})
    f.shared["fleet"] = stack
    return stack


@dataclass
class Answer:
    start: float
    end: float
    model: str
    status: int  # 0: no answer (a transport error)
    replica: str | None
    revision: str | None
    text: str | None


class Load:
    """Clients sending greedy requests through the front, round robin over `models`, each answer kept."""

    def __init__(
        self,
        front: str,
        models: list[str],
        clients: int = 2,
        max_tokens: int = 8,
        headers: dict[str, str] | None = None,
    ):
        self.front, self.models, self.max_tokens, self.headers = front, models, max_tokens, headers
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.front, timeout=120, trust_env=False, headers=self.headers) as h:
            while not self._stop.is_set():
                model = self.models[i % len(self.models)]
                i += 1
                body = {"model": model, "prompt": "Hello, world", "max_tokens": self.max_tokens}
                t0 = time.time()
                try:
                    r = h.post("/v1/completions", json={**body, "temperature": 0.0, "ignore_eos": True})
                except httpx.HTTPError:
                    self.answers.append(Answer(t0, time.time(), model, 0, None, None, None))
                    continue
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200]
                self.answers.append(
                    Answer(
                        t0,
                        time.time(),
                        model,
                        r.status_code,
                        r.headers.get("x-mint-replica"),
                        r.headers.get("x-mint-revision"),
                        text,
                    )
                )
                if r.status_code != 200:
                    time.sleep(0.1)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def by(self, replica: str, since: float = 0.0) -> list[Answer]:
        return [a for a in self.answers if a.replica == replica and a.start >= since]


def metric(front: str, admin: dict[str, str], series: str) -> float | None:
    """One series of the front's /metrics (the admin token reads it: serving keys are on in a stack)."""
    for line in httpx.get(front + "/metrics", headers=admin, timeout=30).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


# ---------------------------------------------------------------------------------------------------------
# the rows


def scenario_fleet_kill(f: Faults) -> Row:
    """kill -9 of the replica that serves the champion, under load through the front: the requests in flight on
    it may fail; none sent after the kill does (the front passes it over once it refuses a connection, and sends
    a request it could not deliver to the next replica); its supervisor restarts it and it rejoins, answering with the champion."""
    s = fleet(f)
    s.ready()
    policy = "fk"
    digests = s.seed(policy, [51])
    later = f.shared.get("only", [])  # the rows still to run: the promote row's fault fits in this outage
    later = later[later.index("fleet-kill") :] if "fleet-kill" in later else []
    promotion = PromotionWhileDown(s) if "fleet-promote" in later else None
    base_name = s.base_dir.name
    with Load(s.front, [policy, base_name], clients=3, headers=s.admin) as load:
        t0 = time.time()
        while len(load.by(s.name("vllm")) + load.by(s.name("vllm-1"))) < 12 and time.time() - t0 < 120:
            time.sleep(0.2)
        hot = next(a.replica for a in reversed(load.answers) if a.model == policy and a.replica)
        assert hot is not None
        victim = s.service(hot)
        time.sleep(1.0)
        killed_at = time.time()
        pid = kill9(s.config, victim)
        say(f"killed {victim} ({hot}, pid {pid}), the replica serving {policy}")
        if promotion is not None:  # the promote row's fault, in this outage
            promotion.during(victim, killed_at)
        back(s.config, victim, pid, timeout=RESTART_S)
        restarted = time.time() - killed_at
        t1 = time.time()  # requests for the champion land on it again (its place in the front's hash)
        while len([a for a in load.by(hot, t1) if a.model == policy]) < 5 and time.time() - t1 < 180:
            time.sleep(0.5)
    answers = load.answers
    in_flight = [a for a in answers if a.start < killed_at < a.end]
    failed_in_flight = [a for a in in_flight if a.status != 200]
    after = [a for a in answers if a.start >= killed_at]
    failed_after = [a for a in after if a.status != 200]
    # the front's last pick of the dead replica: after it, every answer came from the other one until it rejoined
    served_after = [a for a in after if a.status == 200]
    champion_back = [a for a in load.by(hot, t1) if a.model == policy]
    rejoin = min([a.start for a in load.by(hot, killed_at + restarted)], default=None)
    back_right = bool(champion_back) and all(
        a.status == 200 and a.revision == f"sha256:{digests[1]}" for a in champion_back
    )
    agree, detail = s.agree(policy)
    if promotion is not None:
        f.shared["fleet-promote"] = promotion.row(restarted)
    ok = not failed_after and back_right and agree
    result = (
        f"{len(answers)} requests from 3 clients over {policy} and the base; at the kill {len(in_flight)} in "
        f"flight ({len(failed_in_flight)} of them failed: "
        f"{sorted({str(a.text)[:60] for a in failed_in_flight}) or 'none'}); after it {len(after)} sent, "
        f"{len(failed_after)} failed, {len(served_after)} answered; back {restarted:.0f} s after the kill; "
        f"its first answer through the front {'never' if rejoin is None else f'{rejoin - killed_at:.0f} s'} "
        f"after the kill; then {len(champion_back)} answers for {policy} from it, "
        f"all the champion: {back_right}; {detail}"
    )
    return Row(
        "kill -9 one replica of two under load",
        "3 clients through the front over the champion and the base; kill -9 of the replica serving the champion",
        result,
        len(failed_after) + (0 if back_right and agree else 1),
        ok,
        0,
    )


class PromotionWhileDown:
    """The `promote` row's fault: v2 of a policy promoted while one replica is down (killed; its supervisor
    restarts it). The chosen behaviour (docs/serving.md): the promotion completes on the others, and the replica
    that comes back answers with the new champion. Run inside the kill row's outage when both rows run (one vLLM
    restart for the two), on an outage of its own otherwise."""

    def __init__(self, s: FleetStack, policy: str = "fp"):
        self.s, self.policy = s, policy
        self.digests = s.seed(policy, [61, 62])

    def during(self, down: ServiceName, killed_at: float) -> None:
        from flows.promotion import promote_flow

        s = self.s
        self.down, self.killed_at, self.error = down, killed_at, None
        say(f"promoting {self.policy} v2 while {down} is down")
        try:
            promote_flow(self.policy, 2, workspace=s.ws)
        except Exception as e:  # the row records it: the chosen behaviour is that it completes
            self.error = f"{type(e).__name__}: {str(e)[:200]}"
        self.took = time.time() - killed_at
        self.was_down: int | None = None
        with contextlib.suppress(httpx.HTTPError):
            self.was_down = httpx.get(s.urls[down] + "/health", headers=s.key, timeout=5).status_code
        self.version, _ = s.champion(self.policy)
        self.other = next(r for r in REPLICAS if r != down)
        self.on_other = s.held(self.other, self.policy)

    def row(self, restarted: float) -> Row:
        """Once the replica is back (`restarted`: seconds from the kill to its health)."""
        s, down, policy, digests = self.s, self.down, self.policy, self.digests
        held_back = s.held(down, policy)  # a fresh vLLM holds nothing ...
        r = s.ask_replica(
            down, policy
        )  # ... until the first request for the name, resolved through the front
        now = s.held(down, policy)
        rejoin = s.in_rotation(down, self.killed_at)
        agree, detail = s.agree(policy)
        ok = (
            self.error is None
            and self.version == 2
            and self.on_other == digests[2]
            and held_back is None
            and r.status_code == 200
            and now == digests[2]
            and agree
        )
        return Row(
            "one replica of two down during a promotion",
            f"kill -9 of {s.name(down)}, then promote v2 over v1 while it is down; the replica comes back",
            f"promotion {'completed' if self.error is None else 'failed: ' + self.error} {self.took:.1f} s after "
            f"the kill ({s.name(down)} answering /health then: {self.was_down or 'no'}); champion "
            f"v{self.version}, {s.name(self.other)} holds v2: {self.on_other == digests[2]}; {s.name(down)} back "
            f"{restarted:.0f} s after the kill holding {held_back}, its first request for {policy} answered "
            f"{r.status_code}, then it holds v2: {now == digests[2]}; routed to by the front {rejoin:.0f} s "
            f"after the kill; {detail}",
            0 if ok else 1,
            ok,
            0,
        )


def scenario_fleet_promote(f: Faults) -> Row:
    """A promotion while one replica is down (PromotionWhileDown); the kill row's outage when it ran first."""
    if "fleet-promote" in f.shared:
        row: Row = f.shared.pop("fleet-promote")
        return row
    s = fleet(f)
    s.ready()
    promotion = PromotionWhileDown(s)
    down: ServiceName = "vllm-1"
    pid = kill9(s.config, down)
    killed_at = time.time()
    say(f"killed {down} (pid {pid})")
    promotion.during(down, killed_at)
    back(s.config, down, pid, timeout=RESTART_S)
    return promotion.row(time.time() - killed_at)


def scenario_fleet_unreadable(f: Faults) -> Row:
    """The new revision cannot be read by one replica (in that replica's mount namespace only, an empty
    filesystem is mounted over the revision's directory of the store: the front and the other replica read it):
    the promotion fails on that replica, every replica is put back, the alias does not move, the flow says which
    replica."""
    s = fleet(f)
    s.ready()
    policy = "fu"
    digests = s.seed(policy, [71, 72])
    hidden: ServiceName = "vllm-1"
    pid = child(s.config, hidden).pid
    revision_dir = s.ws.registry().store.local_dir(digests[2])
    mount = ["nsenter", "--target", str(pid), "--mount", "mount", "-t", "tmpfs", "-o", "size=64k"]
    made = subprocess.run([*mount, "tmpfs", str(revision_dir)], capture_output=True, text=True)
    if made.returncode != 0:
        return Row(
            "one replica cannot read the revision",
            "",
            f"not run: cannot mount in the replica's namespace ({made.stderr.strip()[:200]})",
            0,
            True,
            0,
        )
    seen = subprocess.run(
        ["nsenter", "--target", str(pid), "--mount", "ls", "-A", str(revision_dir)],
        capture_output=True,
        text=True,
    ).stdout.split()
    say(f"{hidden} (pid {pid}) sees {seen} in {revision_dir}; the front sees {os.listdir(revision_dir)}")
    from flows.promotion import promote_flow

    error = None
    t0 = time.time()
    try:
        promote_flow(policy, 2, workspace=s.ws)
    except Exception as e:
        error = str(e)
    took = time.time() - t0
    subprocess.run(
        ["nsenter", "--target", str(pid), "--mount", "umount", str(revision_dir)], capture_output=True
    )
    v, _ = s.champion(policy)
    held = [s.held(r, policy) for r in REPLICAS]
    named = error is not None and s.name(hidden) in error
    agree, detail = s.agree(policy)
    ok = named and v == 1 and held == [digests[1]] * 2 and agree
    return Row(
        "one replica cannot read the revision",
        "promote v2 over v1 while replica 1's view of the store (its own mount namespace) lacks v2's directory",
        f"promotion failed in {took:.1f} s naming {s.name(hidden)}: {named} "
        f"({(error or 'no error')[:260]}); champion v{v}; the replicas hold {[str(h)[:8] for h in held]}; "
        f"{detail}",
        0 if ok else 1,
        ok,
        0,
    )


def scenario_fleet_poison(f: Faults) -> Row:
    """The poisoned-replica row with two replicas: a NaN adapter forced with mint's key into the replica that
    serves the champion, behind the front's back, under traffic through the front. The golden probe (each
    replica at its own URL) finds it on that replica only, the front stops routing to it, the other replica
    answers everything, and the poisoned one is restarted by its supervisor and comes back clean."""
    s = fleet(f)
    s.ready()
    policy = "fz"
    s.seed(policy, [81])
    base_name = s.base_dir.name
    interval = ServingConfig().golden_interval_s
    log = service_log(s.config, "serve")
    names = [s.name(r) for r in REPLICAS]

    def recorded(replica: str) -> bool:
        return metric(s.front, s.admin, f'mint_golden_recorded{{of="base",replica="{replica}"}}') is not None

    t0 = time.time()
    while not all(recorded(n) for n in names):
        if time.time() - t0 > 3 * interval + 300:
            raise TimeoutError("the golden probe never recorded both replicas' base answers")
        time.sleep(1)
    with Load(s.front, [policy, base_name], clients=2, headers=s.admin) as load:
        t0 = time.time()
        while len([a for a in load.answers if a.status == 200]) < 10:
            time.sleep(0.2)
        expected = {a.model: a.text for a in load.answers if a.status == 200}
        hot = next(a.replica for a in reversed(load.answers) if a.model == policy and a.replica)
        assert hot is not None
        victim, other = s.service(hot), next(r for r in REPLICAS if s.name(r) != hot)
        passed0 = metric(s.front, s.admin, 'mint_golden_probes_total{outcome="pass"}') or 0
        while (metric(s.front, s.admin, 'mint_golden_probes_total{outcome="pass"}') or 0) < passed0 + 4:
            time.sleep(1)  # two rounds over both replicas beside the traffic: no false alarm
        soak = (metric(s.front, s.admin, 'mint_golden_probes_total{outcome="pass"}') or 0) - passed0
        fails_before = metric(s.front, s.admin, 'mint_golden_probes_total{outcome="fail"}') or 0
        unkeyed = httpx.post(
            s.urls[victim] + "/v1/load_lora_adapter",
            json={"lora_name": "evil", "lora_path": str(f.root / "evil")},
            timeout=30,
        ).status_code
        evil = nan_adapter(s.base_dir, f.root / "fleet" / "evil", seed=6)
        forced = httpx.post(
            s.urls[victim] + "/v1/load_lora_adapter",
            json={"lora_name": "evil", "lora_path": str(evil)},
            headers=s.key,
            timeout=60,
        ).status_code
        poisoned_at = time.time()

        def direct(model: str) -> int:
            body = {"model": model, "prompt": "Hello, world", "max_tokens": 16, "ignore_eos": True}
            with contextlib.suppress(httpx.HTTPError):
                return httpx.post(
                    s.urls[victim] + "/v1/completions", json=body, headers=s.key, timeout=120
                ).status_code
            return 0

        def rotation(replica: str) -> float | None:
            return metric(s.front, s.admin, f'mint_replica_in_rotation{{replica="{replica}"}}')

        bursts, detected_at, other_out = 0, None, False
        while bursts < 20 and detected_at is None:
            bursts += 1
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(direct, ["evil", "_mint_base", "evil", policy] * 3))
            if rotation(hot) == 0:
                detected_at = time.time()
            if any(
                a.replica == hot and a.status == 200 and a.text != expected[a.model] for a in load.answers
            ):
                break
        while detected_at is None and time.time() - poisoned_at < interval + 120:
            if rotation(hot) == 0:
                detected_at = time.time()
            other_out = other_out or rotation(s.name(other)) == 0
            time.sleep(0.25)
        removed = detected_at is not None and any(
            r["replica"] == hot and r.get("out_of_rotation") for r in s.report()["replicas"]
        )
        back_at = None
        while detected_at is not None and time.time() - detected_at < RESTART_S:
            other_out = other_out or rotation(s.name(other)) == 0
            if rotation(hot) == 1:
                back_at = time.time()
                break
            time.sleep(0.5)
        t1 = time.time()  # its names come back to it under the front's hash
        while back_at is not None and len(load.by(hot, t1)) < 10 and time.time() - t1 < 120:
            time.sleep(0.5)
    # the front's own record of the event (epoch seconds, as the answers'): found, and back in rotation
    event = next(r for r in s.report()["replicas"] if r["replica"] == hot)["last_poisoned"] or {}
    if event.get("detected"):
        detected_at, back_at = event["detected"], event.get("back")
    answers = [a for a in load.answers if a.start >= poisoned_at]
    bad = [a for a in answers if a.status == 200 and a.text != expected[a.model]]
    # sent before it was found: a request in flight at detection cannot be taken back, as in the kill row
    bad_before = [a for a in bad if detected_at is None or a.start < detected_at]
    in_flight = [
        a for a in answers if a.replica == hot and detected_at is not None and a.start < detected_at < a.end
    ]
    # sent to it after it was found and answered before it was back (the grace covers the front taking it out of
    # rotation, which follows the failed probe by a few ms). A request sent while it was out and answered after it
    # was back was routed to it once back (held meanwhile behind the restart's golden probe, which runs alone):
    # a clean answer, counted in `came_back`
    from_it_after = [
        a
        for a in answers
        if a.replica == hot
        and detected_at is not None
        and a.start > detected_at + 0.25
        and (back_at is None or a.end < back_at)
    ]
    failed = [a for a in answers if a.status != 200]
    came_back = load.by(hot, back_at or t1)
    clean = bool(came_back) and all(a.status == 200 and a.text == expected[a.model] for a in came_back)
    text = log.read_text()
    evidence = (
        f"golden evidence: replica={hot}" in text and f"golden evidence: replica={s.name(other)}" not in text
    )
    fails = (metric(s.front, s.admin, 'mint_golden_probes_total{outcome="fail"}') or 0) - fails_before
    fmt = lambda x: "never" if x is None else f"{x:.1f} s"  # noqa: E731
    first_bad = min([a.end for a in bad], default=None)
    ok = (
        fails_before == 0
        and unkeyed == 401
        and forced == 200
        and detected_at is not None
        and removed
        and not other_out
        and not from_it_after
        and not failed
        and clean
        and evidence
        and fails == 1
    )
    result = (
        f"{len(names)} replicas, each probed at its own URL every {interval:g} s: {soak:.0f} probes passed "
        f"beside traffic before, {fails_before:.0f} failed; unkeyed load on {hot}: {unkeyed}; forced with mint's key: {forced}, "
        f"{bursts} burst(s) under it; detected on {hot} only: {detected_at is not None and not other_out} "
        f"({fmt(None if detected_at is None or first_bad is None else detected_at - first_bad)} after the first "
        f"garbage answer through the front, {fmt(None if detected_at is None else detected_at - poisoned_at)} "
        f"after the load); out of rotation in the front's report: {removed}; through the front {len(answers)} answers after the "
        f"load: {len(bad_before)} bad sent before detection ({len(in_flight)} of them in flight at it), "
        f"{len(from_it_after)} from it after, {len(failed)} failed; "
        f"out of rotation {fmt(None if back_at is None or detected_at is None else back_at - detected_at)}, "
        f"restarted by its supervisor; back clean: {clean} ({len(came_back)} answers from it after); evidence "
        f"logged naming it: {evidence}"
    )
    return Row(
        "NaN adapter forced into one replica of two",
        "the poison row on `--replicas 2`: a NaN adapter loaded with mint's key straight into the replica "
        "serving the champion, requests under it batched there, under traffic through the front",
        result,
        len(from_it_after) + len(failed) + (0 if clean else 1),
        ok,
        0,
    )


# ---------------------------------------------------------------------------------------------------------
# a local process that tries to join the fleet

MARKER = "ROGUE-WORKER-ANSWER"
# every worker-admin route vllm-router 0.1.17 had (and the /workers API of its successors): `{url}` is the rogue's
# own address, `{replica}` a real replica's
ADMIN_ROUTES = [
    ("POST", "/add_worker?url={url}", None),
    ("POST", "/workers", {"url": "{url}"}),
    ("GET", "/list_workers", None),
    ("POST", "/remove_worker?url={replica}", None),
    ("DELETE", "/workers/{replica}", None),
]


class Rogue:
    """An OpenAI-shaped server of a local process: it counts every request it receives (and those that carry a
    key), answers completions with MARKER and claims to be a real replica (`x-mint-replica`)."""

    def __init__(self, claims: str):
        self.received: list[tuple[str, str, bool]] = []  # (method, path, with a key)
        rogue = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                rogue.received.append((self.command, self.path, "authorization" in self.headers))
                model = "base"
                with contextlib.suppress(ValueError, AttributeError):
                    model = str(json.loads(body or b"{}").get("model") or model)
                if self.path.startswith("/v1/completions") or self.path.startswith("/v1/chat/completions"):
                    choice = {"index": 0, "text": MARKER, "finish_reason": "length", "logprobs": None}
                    choice["message"] = {"role": "assistant", "content": MARKER}
                    out = {"id": "cmpl-rogue", "object": "text_completion", "created": 0, "model": model}
                    out |= {"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
                elif self.path.startswith("/v1/models"):
                    out = {"object": "list", "data": [{"id": model, "object": "model"}]}
                else:
                    out = {"status": "ok"}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("x-mint-replica", claims)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Rogue:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def stack_ports(config: ServicesConfig, names: list[ServiceName]) -> dict[int, str]:
    """Every TCP port a process of `names` listens on (the supervisor, the service and its children; psutil reads
    /proc/net/tcp), with the service's name."""
    ports: dict[int, str] = {}
    for svc in status(config, names):
        if svc.pid is None:
            continue
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(svc.pid)
            for proc in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    for c in proc.net_connections("tcp"):
                        if c.status == psutil.CONN_LISTEN and c.laddr:
                            ports[c.laddr.port] = svc.name
    return ports


def try_port(port: int, rogue: str, replica: str) -> dict[str, str]:
    """Each admin route on one port, unkeyed as a local process would send it: route -> what it got. A port that
    does not speak HTTP (vLLM's engine sockets) is tried once: the rest would wait as long."""
    got: dict[str, str] = {}
    for method, route, body in ADMIN_ROUTES:
        name = f"{method} {route.split('?')[0]}"
        path = route.format(url=rogue, replica=replica)
        payload = None if body is None else {k: v.format(url=rogue) for k, v in body.items()}
        try:
            r = httpx.request(method, f"http://127.0.0.1:{port}{path}", json=payload, timeout=2)
            got[name] = str(r.status_code)
        except httpx.ConnectError as e:
            got[name] = type(e).__name__
        except httpx.HTTPError as e:
            got[name] = f"{type(e).__name__} (not HTTP)"
            break
    return got


def try_to_join(ports: dict[int, str], rogue: str, replica: str) -> dict[tuple[int, str], str]:
    """Every admin route on every port, the ports at once: (port, route) -> what it got."""
    with ThreadPoolExecutor(max(len(ports), 1)) as pool:
        results = list(pool.map(lambda port: try_port(port, rogue, replica), ports))
    return {(port, k): v for port, got in zip(ports, results, strict=True) for k, v in got.items()}


def scenario_fleet_rogue(f: Faults) -> Row:
    """A local process starts a server of its own and, under load through the front, keeps trying to add it as a
    worker through every admin route vllm-router had, on every port mint's stack listens on. The front routes over
    the replicas it started and nothing else: the rogue receives no request and no answer of it reaches a client."""
    s = fleet(f)
    s.ready()
    policy = "fr"
    s.seed(policy, [91])
    services: list[ServiceName] = [*REPLICAS, "serve"]
    ports = stack_ports(s.config, services)
    suite = stack_ports(f.config, ["mlflow", "prefect"])  # the suite's own, beside the fleet
    every = {**ports, **suite}
    real = s.urls[REPLICAS[0]]
    tries: list[dict[tuple[int, str], str]] = []
    stop_trying = threading.Event()
    with Rogue(claims=s.name(REPLICAS[0])) as rogue:

        def keep_trying() -> None:
            while not stop_trying.is_set():
                tries.append(try_to_join(every, rogue.url, real))
                stop_trying.wait(1.0)

        trier = threading.Thread(target=keep_trying, daemon=True)
        with Load(s.front, [policy, s.base_dir.name], clients=3, max_tokens=4, headers=s.admin) as load:
            trier.start()
            t0 = time.time()
            while (len(tries) < 3 or len(load.answers) < 60) and time.time() - t0 < 240:
                time.sleep(0.5)
            stop_trying.set()
            trier.join(60)
        received = list(rogue.received)
        self_test = httpx.post(rogue.url + "/v1/completions", json={"model": policy}, timeout=10)
    answers = load.answers
    marked = [a for a in answers if a.text is not None and MARKER in a.text]
    served = [a for a in answers if a.status == 200]
    joined = sorted(
        f"{every[port]}:{port} {route}"
        for attempt in tries
        for (port, route), what in attempt.items()
        if what.startswith("2")
    )
    got: dict[str, Counter[str]] = {}  # service -> what its ports answered, over every round
    for attempt in tries:
        for (port, _), what in attempt.items():
            got.setdefault(every[port], Counter())[what] += 1
    answered = "; ".join(
        f"{svc} ({sum(1 for n in every.values() if n == svc)} ports): "
        + ", ".join(f"{w} x{n}" for w, n in c.most_common())
        for svc, c in sorted(got.items())
    )
    rogue_works = MARKER in self_test.text  # the count means something: it answers anyone who reaches it
    ok = (
        not received
        and not marked
        and not joined
        and len(tries) >= 3
        and len(served) == len(answers) > 0
        and rogue_works
    )
    result = (
        f"the rogue received {len(received)} requests ({sum(k for _, _, k in received)} with a key); "
        f"{len(marked)} answers with its marker reached a client, of {len(answers)} "
        f"({len(served)} answered 200) from 3 clients over {policy} and the base; {len(tries)} rounds of the "
        f"{len(ADMIN_ROUTES)} admin routes on the {len(every)} ports the fleet and the suite listen on: "
        f"{answered}; accepted anywhere: {joined or 'none'}"
    )
    say(result)
    return Row(
        "a local process tries to add its own worker",
        "under load through the front, a server of a local process (answers with a marker, claims to be replica "
        "0) is offered as a worker through /add_worker, /workers, /remove_worker, /list_workers on every port "
        "the fleet and the suite listen on, again every second",
        result,
        len(received) + len(marked),
        ok,
        0,
    )


SCENARIOS = {
    "fleet-poison": scenario_fleet_poison,
    "fleet-kill": scenario_fleet_kill,
    "fleet-promote": scenario_fleet_promote,
    "fleet-unreadable": scenario_fleet_unreadable,
    "fleet-rogue": scenario_fleet_rogue,
}
SERVICES: list[ServiceName] = ["mlflow", "prefect"]  # the promotion flows' registry and Prefect

if __name__ == "__main__":
    sys.exit("run it through scripts/faults.py --only " + ",".join(SCENARIOS))
