"""Servers as the tests and the benchmarks start them: `mint serve` on a free loopback port with the tiny dense
base (`start_server`), a vLLM from `.venv-vllm` (`start_vllm`) and mint's front before it (`start_front`), each
process's output in a log file read back with `server_log`, and `mint` run as a subprocess (`mint_cli`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mint_core.engine.base import Base, build_tiny_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.serving.client import ServingClient
from mint_core.serving.vllm_process import DEFAULT_PYTHON, VLLMConfig

ROOT = Path(__file__).resolve().parents[1]
"""The repository (the project is installed editable: `pip install -e .`)."""
VLLM_PYTHON = Path(os.environ.get("MINT_VLLM_PYTHON", DEFAULT_PYTHON))
VLLM_BASE_NAME = "tiny-vllm"
VLLM_KEY = "vllm-key-for-tests"
RESOLVER_TOKEN = "resolver-token-for-tests"
ADMIN_TOKEN = "admin-secret"
"""The admin token `start_server` gives `mint serve` (its load and unload routes)."""


def cli_env(unset: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a `mint` or `dvc` subprocess: this interpreter's commands first on PATH, a
    wide terminal (rich wraps no table row or URL), no telemetry, no hub; the variables named in `unset` left out,
    `extra` added."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "COLUMNS": "240",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DVC_NO_ANALYTICS": "1",
            "HF_HUB_OFFLINE": "1",
            **extra,
        }
    )
    return env


def mint_cli(
    *args: str,
    timeout: float = 300,
    check: bool = False,
    cwd: Path | None = None,
    unset: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """`mint <args>` in a subprocess of this interpreter, in `cli_env(unset)`."""
    return subprocess.run(
        [sys.executable, "-m", "mint_app.cli.app", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=cli_env(unset),
        timeout=timeout,
        check=check,
    )


def vllm_tiny_base() -> Base:
    """The tiny dense base with the head_dim vLLM's CPU attention needs (32: two heads over 64 channels)."""
    return build_tiny_base(
        "dense", seed=0, tokenizer=byte_tokenizer(), num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )


def save_tiny_base(base_dir: Path, vllm: bool = False) -> Path:
    """The tiny dense test base (seed 0, byte tokenizer) written as a local Hugging Face model directory (with
    `vllm`, the variant vLLM can run)."""
    tiny = vllm_tiny_base() if vllm else build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    tiny.model.save_pretrained(base_dir)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(base_dir)
    return base_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LOGS: dict[int, Path] = {}


def server_log(proc: subprocess.Popen[str]) -> str:
    """What a server started by `start_server` has printed so far."""
    path = LOGS.get(proc.pid)
    return path.read_text(errors="replace") if path and path.exists() else ""


def launch(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """`cmd` with `env` over this environment less the project's own interpreter settings (a vLLM interpreter
    must not import this venv's packages), its output in `log` (read back with `server_log`)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen(
        cmd, env={**clean, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True
    )
    LOGS[proc.pid] = log
    return proc


def start_server(
    store: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    healthy_within_s: float = 90,
) -> tuple[subprocess.Popen[str], str]:
    """`mint serve` on the built-in tiny dense base; returns the process and its URL once healthy (within
    `healthy_within_s`: a benchmark's multi-GB base takes longer to load and fingerprint)."""
    port = port or free_port()
    # Output goes to a file: a pipe nobody reads would block the server once its buffer fills.
    log = tempfile.NamedTemporaryFile("w", prefix=f"mint-serve-{port}-", suffix=".log", delete=False)  # noqa: SIM115 (the server owns it)
    full_env = {**os.environ, "MINT_SERVE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mint_app.cli.app",
            "serve",
            "--port",
            str(port),
            "--adapter-root",
            str(store),
            *extra,
        ],
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    LOGS[proc.pid] = Path(log.name)
    url = f"http://127.0.0.1:{port}"
    client = ServingClient(url)
    deadline = time.monotonic() + healthy_within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mint serve exited with {proc.returncode}:\n{server_log(proc)}")
        if client.health():
            return proc, url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"mint serve did not become healthy in {healthy_within_s:g} s")


def stop_server(proc: subprocess.Popen[str], timeout: float = 30) -> int:
    """SIGTERM, then SIGKILL after `timeout`; to the server's whole process group when it leads one (vLLM's engine
    core and worker would otherwise outlive a killed API server)."""

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        return proc.wait()


def run_fault_suite(*args: str, timeout: float = 3500) -> subprocess.CompletedProcess[str]:
    """`scripts/faults.py` with `args`. On a timeout, or when the test itself is stopped (pytest-timeout), the
    suite gets SIGTERM and time to stop the services its scenarios started; only then is it killed. (A bare
    `subprocess.run` timeout kills it at once, and its vLLM, front and servers run on.)"""
    cmd = [sys.executable, str(ROOT / "scripts" / "faults.py"), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def vllm_command(
    base_dir: Path, port: int, resolver_url: str | None, max_loras: int = 4, seal: bool = True
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a test's vLLM (key VLLM_KEY, sealed unless `seal` is False)."""
    return VLLMConfig(
        python=VLLM_PYTHON,
        model=base_dir,
        served_model_name=base_dir.name,
        port=port,
        api_key=VLLM_KEY,
        max_loras=max_loras,
        max_lora_rank=16,  # as mint serve's default, so the contract's rank checks read the same
        max_model_len=512,
        resolver_url=resolver_url,
        resolver_token=RESOLVER_TOKEN,
        seal=seal,
    ).command()


def vllm_healthy(url: str) -> bool:
    """vLLM answers /health (asked with its key: the seal refuses every route without it)."""
    try:
        r = httpx.get(url + "/health", headers={"Authorization": f"Bearer {VLLM_KEY}"}, timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def start_vllm(
    base_dir: Path,
    port: int,
    resolver_url: str | None,
    log: Path,
    max_loras: int = 4,
    timeout_s: float = 300,
    seal: bool = True,
) -> subprocess.Popen[str]:
    """vLLM from `.venv-vllm` on loopback `port` (its key VLLM_KEY), once it answers /health. (Not in a session of
    its own: started so, `test_late_joiner_is_served_right[vllm]` failed its overlap check twice in two runs.)"""
    cmd, env = vllm_command(base_dir, port, resolver_url, max_loras, seal)
    out = log.open("w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, text=True)
    LOGS[proc.pid] = log
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-5000:]}")
        if vllm_healthy(f"http://127.0.0.1:{port}"):
            return proc
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vLLM did not become healthy in {timeout_s:g} s:\n{log.read_text()[-5000:]}")


def start_front(
    vllm_url: str,
    store: Path,
    base_dir: Path,
    port: int,
    catalog_url: str | None,
    *extra: str,
    api_key: str | None = None,
    golden_interval_s: float = 0,
) -> tuple[subprocess.Popen[str], str]:
    """`mint serve --backend vllm` before the vLLM at `vllm_url` (inference keyed with `api_key` if given). Its
    golden probe is off unless `golden_interval_s` is given: the session's vLLM is not supervised (a poisoned one
    would be killed for good), and tests that count vLLM's requests must see only their own."""
    env = {
        "MINT_SERVE_BACKEND": "vllm",
        "MINT_SERVE_VLLM_URL": vllm_url,
        "MINT_SERVE_VLLM_API_KEY": VLLM_KEY,
        "MINT_SERVE_RESOLVER_TOKEN": RESOLVER_TOKEN,
        "MINT_SERVE_MAX_LORA_RANK": "16",
        "MINT_SERVE_GOLDEN_INTERVAL_S": str(golden_interval_s),
    }
    if catalog_url:
        env["MINT_SERVE_CATALOG_URL"] = catalog_url
    if api_key:
        env["MINT_SERVE_API_KEY"] = api_key
    return start_server(store, "--base", str(base_dir), *extra, env=env, port=port)


def unload_all(url: str) -> None:
    """Unload every adapter the server at `url` lists (vLLM's adapters are shared by every front before it)."""
    http = httpx.Client(base_url=url, timeout=60)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for card in http.get("/v1/models").json()["data"]:
        if card.get("parent"):
            http.post("/v1/unload_lora_adapter", json={"lora_name": card["id"]}, headers=admin)
