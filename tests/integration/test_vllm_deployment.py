"""The vLLM deployment in infra/vllm: the launch script's command line (checked here, no GPU needed) and, on a
machine where vLLM is installed, a real server answering the serving contract (DESIGN.md, "Serving API")."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "infra" / "vllm" / "launch.sh"
SERVE_YAML = ROOT / "infra" / "vllm" / "serve.yaml"
KEY = "test-key-not-a-secret-1234"


def launch(
    *args: str, key: str | None = KEY, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MINT_VLLM_API_KEY", "MINT_VLLM_CONFIG")}
    env["MINT_PYTHON"] = sys.executable  # a python that has PyYAML, whatever python3 is on PATH
    if key is not None:
        env["MINT_VLLM_API_KEY"] = key
    env.update(extra_env or {})
    return subprocess.run(
        ["bash", str(LAUNCH), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} should appear once in {argv}"
    return argv[argv.index(flag) + 1]


def test_dry_run_prints_the_vllm_command_from_serve_yaml() -> None:
    cfg = yaml.safe_load(SERVE_YAML.read_text())
    out = launch("--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    argv = shlex.split(lines[0])

    # vLLM starts inside the adapter store, so relative lora_paths resolve there
    assert argv[:3] == ["cd", cfg["adapter_store"], "&&"]
    argv = argv[3:]
    env = {}
    while "=" in argv[0]:
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # the load/unload routes exist only with it
    assert Path(argv[0]).name == "vllm"
    assert argv[1:3] == ["serve", cfg["model"]]

    assert "--enable-lora" in argv
    assert flag_value(argv, "--max-loras") == str(cfg["max_loras"])
    assert flag_value(argv, "--max-cpu-loras") == str(cfg["max_cpu_loras"])
    assert flag_value(argv, "--max-lora-rank") == str(cfg["max_lora_rank"])
    assert flag_value(argv, "--max-model-len") == str(cfg["max_model_len"])
    assert flag_value(argv, "--served-model-name") == cfg["served_model_name"]
    assert flag_value(argv, "--host") == cfg["host"]
    assert flag_value(argv, "--port") == str(cfg["port"])
    assert float(flag_value(argv, "--gpu-memory-utilization")) == cfg["gpu_memory_utilization"]
    assert flag_value(argv, "--dtype") == cfg["dtype"]
    assert cfg["max_cpu_loras"] >= cfg["max_loras"]

    # the key is on the command line vLLM gets, but a dry run shows only where it comes from
    assert flag_value(argv, "--api-key") == "$MINT_VLLM_API_KEY"
    assert KEY not in out.stdout + out.stderr


def test_refuses_to_start_without_an_api_key() -> None:
    out = launch("--dry-run", key=None)
    assert out.returncode != 0
    assert "MINT_VLLM_API_KEY" in out.stderr and "refusing to start" in out.stderr
    assert "vllm serve" not in out.stdout

    out = launch("--dry-run", key="")
    assert out.returncode != 0 and "MINT_VLLM_API_KEY" in out.stderr


def test_bad_config_is_refused_with_every_problem_named(tmp_path: Path) -> None:
    cfg = yaml.safe_load(SERVE_YAML.read_text())
    cfg.update(max_loras=16, max_cpu_loras=4, max_lora_rank=12, colour="blue")
    bad = tmp_path / "serve.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = launch("--dry-run", "--config", str(bad))
    assert out.returncode != 0
    for what in ("max_cpu_loras", "max_loras (16)", "max_lora_rank: 12", "colour: unknown setting"):
        assert what in out.stderr, out.stderr


def test_exec_passes_the_key_and_the_environment_to_vllm(tmp_path: Path) -> None:
    """Without --dry-run the script execs vLLM: a stand-in executable records what it was given."""
    base, store = tmp_path / "base", tmp_path / "store"
    base.mkdir()
    store.mkdir()
    cfg = yaml.safe_load(SERVE_YAML.read_text())
    cfg.update(model=str(base), adapter_store=str(store))
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(cfg))
    fake = tmp_path / "vllm"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'printf "%s\\n" "$@" > "$(dirname "$0")/argv.txt"\n'
        'printf "%s|%s|%s|%s\\n" "$VLLM_ALLOW_RUNTIME_LORA_UPDATING" "$HF_HUB_OFFLINE" "${VLLM_API_KEY-unset}" "$PWD"'
        ' > "$(dirname "$0")/env.txt"\n'
    )
    fake.chmod(0o755)
    out = launch(
        "--config",
        str(config),
        "--",
        "--enforce-eager",
        extra_env={"MINT_VLLM_BIN": str(fake), "VLLM_API_KEY": "stale-key"},
    )
    assert out.returncode == 0, out.stderr
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert argv[:2] == ["serve", str(base)]
    assert flag_value(argv, "--api-key") == KEY
    assert argv[-1] == "--enforce-eager"  # pass-through arguments come last
    assert (tmp_path / "env.txt").read_text().strip() == f"True|1|unset|{store}"
    assert KEY not in out.stderr  # the script logs the command it starts, with the key hidden


# ---------------------------------------------------------------------------------------------------------------
# A real vLLM server (GPU machine only).


def http(method: str, url: str, body: dict[str, Any] | None = None, key: str | None = KEY) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (needs a GPU machine)"
)
def test_live_vllm_serves_the_contract(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("vllm is installed but no CUDA GPU is visible")
    from mint_core.engine.base import build_tiny_base
    from mint_core.engine.tokenizer import byte_tokenizer
    from mint_core.lora.adapter import random_adapter, save_adapter

    # a tiny Llama (head_dim 64, which every vLLM attention backend supports) and two revisions of one adapter
    base_dir, store = tmp_path / "base", tmp_path / "store"
    tiny = build_tiny_base(
        "dense", seed=0, tokenizer=byte_tokenizer(), hidden_size=256, intermediate_size=512
    )
    tiny.model.save_pretrained(base_dir)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(base_dir)
    for seed in (1, 2):
        a = random_adapter(tiny.sites, ["q_proj", "k_proj", "v_proj", "o_proj"], 8, seed=seed, std=0.2)
        save_adapter(a, store / f"rev{seed}", tiny.sites)

    port = free_port()
    cfg = yaml.safe_load(SERVE_YAML.read_text())
    cfg.update(
        model=str(base_dir),
        adapter_store=str(store),
        served_model_name="tiny-base",
        host="127.0.0.1",
        port=port,
        max_model_len=256,
        gpu_memory_utilization=0.3,
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=8,
    )
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "MINT_VLLM_API_KEY": KEY, "MINT_PYTHON": sys.executable}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = (tmp_path / "vllm.log").open("w")
    proc = subprocess.Popen(
        ["bash", str(LAUNCH), "--config", str(config), "--", "--enforce-eager"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            try:
                if http("GET", f"{url}/health", key=None)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vLLM did not become healthy in time"
            time.sleep(2)

        assert http("GET", f"{url}/v1/models", key=None)[0] == 401  # --api-key guards /v1
        status, body = http("GET", f"{url}/v1/models")
        assert status == 200 and "tiny-base" in body

        def complete(model: str) -> str:
            status, body = http(
                "POST",
                f"{url}/v1/completions",
                {"model": model, "prompt": "2+3=", "max_tokens": 8, "temperature": 0},
            )
            assert status == 200, body
            return str(json.loads(body)["choices"][0]["text"])

        complete("tiny-base")
        load = {"lora_name": "tenant-a", "lora_path": "rev1"}  # relative: resolved inside the store
        assert http("POST", f"{url}/v1/load_lora_adapter", load, key=None)[0] == 401  # admin route guarded
        assert http("POST", f"{url}/v1/load_lora_adapter", load)[0] == 200
        models = json.loads(http("GET", f"{url}/v1/models")[1])["data"]
        assert {"id": "tenant-a", "parent": "tiny-base"}.items() <= next(
            m for m in models if m["id"] == "tenant-a"
        ).items()
        complete("tenant-a")
        assert http("POST", f"{url}/v1/load_lora_adapter", load)[0] == 400  # duplicate name, not in place
        swap = {"lora_name": "tenant-a", "lora_path": str(store / "rev2"), "load_inplace": True}
        assert http("POST", f"{url}/v1/load_lora_adapter", swap)[0] == 200  # promote: new revision in place
        complete("tenant-a")
        missing = {"lora_name": "tenant-b", "lora_path": str(store / "no-such-revision")}
        assert http("POST", f"{url}/v1/load_lora_adapter", missing)[0] == 404
        assert http("POST", f"{url}/v1/unload_lora_adapter", {"lora_name": "tenant-a"})[0] == 200
        assert http("POST", f"{url}/v1/unload_lora_adapter", {"lora_name": "tenant-a"})[0] == 404
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the session this test started: launch.sh exec'd into vllm
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
