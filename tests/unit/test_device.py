"""One device switch: every entry point takes cpu, cuda or cuda:N, refuses anything else (and a CUDA device that is
not visible) before it loads anything, naming the flag or field; the base, the engine's slots and the trainer
follow the base onto the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from rich.console import Console
from typer.testing import CliRunner

from mint_app.cli.app import app
from mint_app.job import config as job_config
from mint_app.job import main as main_job
from mint_app.services.commands import command
from mint_app.services.config import ServicesConfig
from mint_app.services.deployments import workspace_defaults
from mint_core.engine.device import DeviceError, check_device
from mint_core.lifecycle.workspace import Workspace
from mint_core.serving.config import ServingConfig
from tests.conftest import DEVICES

CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
# a CUDA device this machine does not have: any CUDA device where none is visible, else one past the last
ABSENT = "cuda" if CUDA_COUNT == 0 else f"cuda:{CUDA_COUNT}"
ABSENT_MESSAGE = "no CUDA device is visible" if CUDA_COUNT == 0 else "CUDA device(s) visible"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gpu", "--device gpu: not a device; expected cpu, cuda or cuda:N"),
        ("cuda:x", "--device cuda:x: not a device"),
        ("CPU", "--device CPU: not a device"),
        ("", "--device : not a device"),
        (ABSENT, f"--device {ABSENT}: {ABSENT_MESSAGE}"),
    ],
)
def test_a_device_that_is_not_there_is_refused_by_name(value: str, message: str) -> None:
    with pytest.raises(DeviceError) as e:
        check_device(value, "--device")
    assert message in str(e.value)


def test_cpu_is_always_a_device() -> None:
    assert check_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("config", [ServingConfig, job_config.MainJobConfig, Workspace, ServicesConfig])
def test_settings_refuse_what_is_no_device_naming_the_field(config: type) -> None:
    field = "serve_device" if config is ServicesConfig else "device"
    assert config(**{field: "cuda:1"}).model_dump()[field] == "cuda:1"  # may exist elsewhere: checked at use
    with pytest.raises(ValidationError, match=rf"{field}\n.*gpu: not a device"):
        config(**{field: "gpu"})


def test_the_device_comes_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINT_SERVE_DEVICE", "cuda:0")
    monkeypatch.setenv("MINT_RUN_DEVICE", "cuda")
    assert ServingConfig.load().device == "cuda:0"
    assert job_config.MainJobConfig.load().device == "cuda"


@pytest.mark.parametrize("cmd", ["serve", "train"])
def test_mint_serve_and_train_refuse_a_missing_device_before_any_work(cmd: str, tmp_path: Path) -> None:
    # train would otherwise first check its tasks and base directory (missing here); serve would build its base
    out = CliRunner().invoke(app, [cmd, "--device", ABSENT, "--base", str(tmp_path / "nothing")])
    assert out.exit_code == 2, out.output
    assert f"--device {ABSENT}: {ABSENT_MESSAGE}" in " ".join(out.output.replace("│", " ").split())


def test_the_main_job_stops_on_a_missing_device_before_it_builds_or_starts_anything(tmp_path: Path) -> None:
    cfg = job_config.MainJobConfig(device=ABSENT, state_dir=tmp_path / "state", base=tmp_path / "none")
    with pytest.raises(DeviceError, match=f"device {ABSENT}: {ABSENT_MESSAGE}"):
        main_job.run_main_job(cfg, Console(file=None, quiet=True))
    assert not (tmp_path / "state").exists()


def test_the_main_job_gives_its_device_to_mint_serve_and_to_the_flows(tmp_path: Path) -> None:
    cfg = job_config.MainJobConfig(device="cuda:1", state_dir=tmp_path / "state")
    services = main_job.services_config(cfg).model_copy(update={"serve_base": "tiny-dense"})
    services.state_dir.mkdir(parents=True)  # as `mint up` makes it
    assert services.serve_device == "cuda:1"
    cmd, _ = command("serve", services)
    assert cmd[cmd.index("--device") + 1] == "cuda:1"
    # the deployments' workspace: a run from the dashboard or a schedule trains on the same device
    assert Workspace(**workspace_defaults(services)).device == "cuda:1"
    other = ServicesConfig(state_dir=services.state_dir, serve_base="tiny-dense")
    assert "--device" not in command("serve", other)[0]  # unset: the serving config's own (cpu by default)
    assert workspace_defaults(other)["device"] == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_base_slots_and_forward_follow_the_device(device: str, make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine("dense", device=device)
    assert engine.base.device.type == device
    assert {b.A.device.type for b in engine.lora.banks.values()} == {device}
    assert engine.logits(torch.tensor([[1, 2, 3]]), [None]).device.type == device
    # the same seed is the same base on every device (weights drawn on the CPU)
    assert engine.base.fingerprint == make_engine("dense").base.fingerprint


def test_mint_run_refuses_a_missing_device_from_its_flag_or_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[job_config.MainJobConfig] = []
    monkeypatch.setattr(main_job, "run_main_job", lambda cfg, console: ran.append(cfg))
    out = CliRunner().invoke(app, ["run", "--device", ABSENT])
    assert out.exit_code == 2, out.output
    assert f"--device {ABSENT}: {ABSENT_MESSAGE}" in " ".join(out.output.replace("│", " ").split())
    monkeypatch.setenv("MINT_RUN_DEVICE", ABSENT)
    out = CliRunner().invoke(app, ["run"])
    assert out.exit_code == 2, out.output
    assert f"device {ABSENT}: {ABSENT_MESSAGE}" in " ".join(out.output.replace("│", " ").split())
    assert not ran  # refused before the job
    out = CliRunner().invoke(app, ["run", "--device", "cpu", "--no-build"])
    assert out.exit_code == 0, out.output
    assert [cfg.device for cfg in ran] == ["cpu"]  # the flag wins over the environment


def test_the_server_mint_up_starts_accepts_the_builtin_recipes_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main job trains `add` at rank 32 (`recipe_spec`); the server `mint up` starts must load it, though the
    serving default (vLLM's) is 16. A serving config or the environment that sets a rank keeps its own."""
    from mint_core.data.spec import BUILTIN_DIR, TaskRegistry
    from mint_core.rl.builder import recipe_spec
    from mint_core.rl.constants import DEFAULT_RANK

    monkeypatch.delenv("MINT_SERVE_MAX_LORA_RANK", raising=False)
    assert job_config.MainJobConfig().rank is None  # each task's own
    builtins = TaskRegistry.load([BUILTIN_DIR]).specs.values()
    largest = max(DEFAULT_RANK, *(s.recipe.rank or DEFAULT_RANK for s in builtins))
    assert recipe_spec("add", "add").rank == largest == 32
    services = ServicesConfig(state_dir=tmp_path / "state", serve_base="tiny-dense")
    services.state_dir.mkdir(parents=True)
    assert services.serve_max_lora_rank == largest  # a literal in services.py: it must not drift
    _, env = command("serve", services)
    assert env["MINT_SERVE_MAX_LORA_RANK"] == str(largest)
    own = tmp_path / "serving.yaml"
    own.write_text("max_lora_rank: 8\n")
    _, env = command("serve", services.model_copy(update={"serve_config": own}))
    assert "MINT_SERVE_MAX_LORA_RANK" not in env
    monkeypatch.setenv("MINT_SERVE_MAX_LORA_RANK", "64")
    _, env = command("serve", services)
    assert env.get("MINT_SERVE_MAX_LORA_RANK", "64") == "64"


def test_recipe_spec_scales_the_rate_to_the_rank() -> None:
    from mint_core.rl.builder import recipe_spec
    from mint_core.rl.constants import BUILTIN_RECIPE

    add, sort = recipe_spec("a", "add"), recipe_spec("s", "sort")
    assert (add.rank, add.alpha, add.learning_rate) == (
        32,
        64.0,
        pytest.approx(BUILTIN_RECIPE.learning_rate / 2),
    )
    assert (sort.rank, sort.alpha, sort.learning_rate) == (8, 16.0, None)  # the run's own rate
    given = recipe_spec("a", "add", rank=8, learning_rate=2e-3)
    assert (given.rank, given.learning_rate) == (8, None)
    assert recipe_spec("s", "sort", rank=2, learning_rate=2e-3).learning_rate == pytest.approx(4e-3)
