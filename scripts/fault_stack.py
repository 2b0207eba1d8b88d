"""The stack the fault suite (scripts/faults.py) drives: real services started as `mint up` starts them (under
supervision, on free ports, in a temporary state dir, over a tiny base), a Workspace over them, the row each
scenario ends with, and the suite's small helpers. Imported by faults.py, which runs as a script from scripts/."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mint_app.services.config import ServiceName, ServicesConfig  # noqa: E402
from mint_app.services.control import start, status, stop  # noqa: E402
from mint_app.services.mlflow_auth import PASSWORD_ENV, USER_ENV, service_env  # noqa: E402
from mint_app.services.prefect_auth import server_auth  # noqa: E402
from mint_app.services.processes import service_log  # noqa: E402
from mint_core.engine.base import Base, build_tiny_base, load_base  # noqa: E402
from mint_core.engine.tokenizer import byte_tokenizer  # noqa: E402
from mint_core.eval.suites import standalone_suites  # noqa: E402
from mint_core.lifecycle.reconcile import reconcile  # noqa: E402
from mint_core.lifecycle.smoke import served_revision  # noqa: E402
from mint_core.lifecycle.workspace import Workspace  # noqa: E402
from mint_core.lora.adapter import random_adapter  # noqa: E402

TARGETS = ["q_proj", "v_proj"]


@dataclass
class Row:
    scenario: str
    tried: str
    result: str
    lost: int  # revisions, aliases or answers lost or wrong: must be 0
    ok: bool
    seconds: float


def seed_revisions(
    ws: Workspace, base: Base, policy: str, seeds: list[int], std: float, champion: int | None = 1
) -> dict[int, str]:
    """A random rank-4 revision of `policy` per seed, registered (version -> digest); `champion` promoted and
    served (reconciled), or none with None."""
    reg = ws.registry()
    out = {}
    for s in seeds:
        w = random_adapter(
            base.sites, TARGETS, 4, alpha=8, seed=s, std=std, base_fingerprint=base.fingerprint
        )
        digest = reg.store.put_weights(w, base.sites)
        rev = reg.create_revision(policy, digest, base=base.fingerprint, rank=4, alias=None)
        out[rev.version] = str(digest)
    if champion is not None:
        reg.promote(policy, champion, "seeded by the fault suite")
        reconcile(ws, policy)
    return out


def champion_of(ws: Workspace, policy: str) -> tuple[int | None, str | None]:
    """`policy`'s champion: (version, digest), or (None, None) without one."""
    reg = ws.registry()
    v = reg.alias_version(policy)
    return v, (None if v is None else reg.revision(policy, v).digest)


class Faults:
    """The services, a Workspace over them, and what each scenario needs."""

    def __init__(self, root: Path):
        self.root = root
        self.base_dir = root / "base"
        tiny = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
        tiny.model.save_pretrained(self.base_dir)
        assert tiny.tokenizer is not None
        tiny.tokenizer.save_pretrained(self.base_dir)
        self.base = load_base(self.base_dir)
        self.suites = standalone_suites(root, limit=20)
        ports = {f"{n}_port": free_port() for n in ("mlflow", "prefect", "serve", "hooks", "worker")}
        self.config = ServicesConfig.model_validate(
            {
                "state_dir": root / "run",
                **ports,
                "serve_base": str(self.base_dir),
                "serve_adapter_root": root / "store",
                "catalog_url": f"sqlite:///{root / 'catalog.db'}",
                "startup_timeout": 300,
            }
        )
        self.ws = Workspace(
            tracking_uri=self.config.url("mlflow"),
            store=str(root / "store"),
            catalog_url=f"sqlite:///{root / 'catalog.db'}",
            base=self.base_dir,
            serving_url=self.config.url("serve"),
            admin_token_file=root / "run" / "serve.token",
            work_dir=root / "work",
            lock_hold_s=20,
        )
        self.env = {
            **os.environ,
            "PREFECT_API_URL": self.config.url("prefect") + "/api",
            "PREFECT_API_AUTH_STRING": server_auth(self.config),  # what its Prefect server will ask
            "MLFLOW_TRACKING_URI": self.config.url("mlflow"),
            **service_env(
                self.config
            ),  # its MLflow asks a login: mint's service account (server_auth made it)
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        shared = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_URI", USER_ENV, PASSWORD_ENV)
        os.environ.update({k: self.env[k] for k in shared})
        self.cleanup: list[Callable[[], object]] = []
        self.shared: dict[str, Any] = {}  # what scenarios share (one fleet for the fleet rows)

    # -- services -----------------------------------------------------------------------------------------

    def up(self, names: list[ServiceName]) -> None:
        t0 = time.monotonic()
        start(self.config, names, progress=lambda m: say(m))
        say(f"services up: {', '.join(names)} ({time.monotonic() - t0:.0f} s)")

    def down(self) -> None:
        for done in reversed(self.cleanup):  # stacks a scenario started of its own (a fleet of vLLM replicas)
            with contextlib.suppress(Exception):
                done()
        stop(self.config)

    def child(self, name: ServiceName) -> psutil.Process:
        return child(self.config, name)

    def kill9(self, name: ServiceName) -> int:
        return kill9(self.config, name)

    def back(self, name: ServiceName, after_pid: int, timeout: float = 240) -> float:
        return back(self.config, name, after_pid, timeout)

    # -- registry and serving -----------------------------------------------------------------------------

    def seed(self, policy: str, seeds: list[int], champion: int | None = 1) -> dict[int, str]:
        """Random revisions of `policy` registered (version -> digest); `champion` promoted and served."""
        return seed_revisions(self.ws, self.base, policy, seeds, std=0.05, champion=champion)

    def champion(self, policy: str) -> tuple[int | None, str | None]:
        return champion_of(self.ws, policy)

    def answered_by(self, policy: str) -> str:
        with self.ws.client(timeout=60) as c:
            return str(c.complete(policy, "add: 1+2 =", max_tokens=2, temperature=0.0)["system_fingerprint"])

    def listed(self, policy: str) -> str | None:
        with self.ws.client(timeout=30) as c:
            return served_revision(c, policy)

    def agree(self, policy: str) -> tuple[bool, str]:
        """Whether the alias, the server's listing and an answer name one revision (after a reconcile)."""
        reconcile(self.ws, policy)
        v, digest = self.champion(policy)
        listed, answered = self.listed(policy), self.answered_by(policy)
        ok = (
            digest is not None and listed == f"sha256:{digest}" and answered.removeprefix("sha256:") == digest
        )
        return ok, f"champion v{v} {str(digest)[:8]}, listed {str(listed)[7:15]}, answered {answered[:8]}"

    # -- flows ----------------------------------------------------------------------------------------------

    def flow_params(self, policy: str, steps: int, round: str) -> dict[str, Any]:
        return {
            "policy": {
                "spec": {"name": policy, "task": "add", "rank": 4, "alpha": 8},
                "gate": {"suite": "add", "compare": False},
            },
            "training": {
                "steps": steps,
                "prompts_per_step": 4,
                "seed": 0,
                "round": round,
                "data_dir": None,
                "dry_run": 0,  # a random base: its completions score alike, which the dry run would refuse
                "grpo": {
                    "group_size": 4,
                    "max_new_tokens": 8,
                    "learning_rate": 0.01,
                    "drop_zero_variance": False,
                },
            },
            "evaluation": {"limit": 4, "batch_size": 16, "suites_dir": str(self.suites)},
            "workspace": json.loads(self.ws.model_dump_json()),
        }

    def lifecycle_process(self, policy: str, steps: int, round: str) -> subprocess.Popen[str]:
        """`mint lifecycle --params FILE` in its own process, reporting to the Prefect server."""
        params = self.root / f"{policy}-{round}.json"
        params.write_text(json.dumps(self.flow_params(policy, steps, round)))
        cmd = [sys.executable, "-m", "mint_app.cli.app", "lifecycle", "--params", str(params)]
        return subprocess.Popen(
            cmd, env=self.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def checkpointed(self, proc: subprocess.Popen[str] | None = None, timeout: float = 300) -> None:
        """Until a training run under the work dir wrote its first checkpoint (`proc`: the process that trains,
        which must not end first)."""
        t0 = time.monotonic()
        d = self.ws.work_dir / "checkpoints"
        while not (d.is_dir() and any(p.is_file() for p in d.rglob("*"))):
            if proc is not None and proc.poll() is not None:
                out = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(
                    f"the flow ended ({proc.returncode}) before its first checkpoint:{last_line(out)}"
                )
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"no checkpoint under {d} within {timeout:.0f} s")
            time.sleep(0.2)

    def resumed_from(self, policy: str, version: int) -> str:
        """The step a version's training run resumed from (its MLflow run's `resumed_from_step`)."""
        reg = self.ws.registry()
        run_id = reg.revision(policy, version).run_id
        if run_id is None:
            return "?"
        return str(reg.client.get_run(run_id).data.params.get("resumed_from_step", "?"))

    def versions(self, policy: str) -> list[int]:
        reg = self.ws.registry()
        return [r.version for r in reg.revisions(policy)] if policy in reg.policies() else []


def child(config: ServicesConfig, name: ServiceName) -> psutil.Process:
    """The service's own process (the child of its supervisor, the recorded pid)."""
    sup = psutil.Process(status(config, [name])[0].pid or 0)
    kids = sup.children()
    assert kids, f"{name} has no running process under its supervisor (pid {sup.pid})"
    return kids[0]


def kill9(config: ServicesConfig, name: ServiceName) -> int:
    p = child(config, name)
    log = service_log(config, name)
    deadline = time.monotonic() + 120
    # a crash before its supervisor saw it healthy is not restarted, by design: wait for that
    while f"pid {p.pid} healthy" not in log.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}'s supervisor never saw pid {p.pid} healthy")
        time.sleep(0.1)
    p.kill()
    p.wait(10)
    return p.pid


def back(config: ServicesConfig, name: ServiceName, after_pid: int, timeout: float = 240) -> float:
    """Seconds until the service answers its health check again from a new process."""
    t0 = time.monotonic()
    while True:
        s = status(config, [name])[0]
        with contextlib.suppress(AssertionError, psutil.Error):
            if s.state == "running" and child(config, name).pid != after_pid:
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{name} not back within {timeout:.0f} s (state {s.state})")
        time.sleep(0.25)


def tiny_vllm_base(out: Path) -> Path:
    """The tiny base with head_dim 32, which vLLM's CPU attention runs (its name is the directory's)."""
    tiny = build_tiny_base(
        "dense", seed=0, tokenizer=byte_tokenizer(), num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )
    tiny.model.save_pretrained(out)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(out)
    return out


def nan_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """A healthy-looking adapter for the base with one NaN in a lora_B weight: what mint's validation refuses, and
    what poisons every tenant of a vLLM that loads it (benchmarks/vllm_bad_adapters.py)."""
    from safetensors.torch import load_file, save_file

    from mint_core.lora.adapter import WEIGHTS_FILE, save_adapter

    base = load_base(base_dir)
    save_adapter(
        random_adapter(base.sites, TARGETS, 8, seed=seed, std=0.3, base_fingerprint=base.fingerprint),
        out,
        base.sites,
    )
    w = load_file(out / WEIGHTS_FILE)
    key = sorted(k for k in w if "lora_B" in k)[0]
    w[key][0, 0] = float("nan")
    save_file(w, out / WEIGHTS_FILE, metadata={"format": "pt"})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def last_line(out: str) -> str:
    lines = [x for x in out.strip().splitlines() if x.strip()]
    return f" ({lines[-1].strip()[:100]})" if lines else ""


def say(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def table(rows: list[Row]) -> str:
    lines = ["| scenario | what was tried | result | data lost |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.tried} | {r.result} ({r.seconds:.0f} s) | {r.lost} |")
    return "\n".join(lines)


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="mint-faults-"))
    try:
        yield d
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)
