"""A run of the `wave` deployment started the way the dashboard's Run button starts it, against the same wave run
in-process (what `mint wave --params FILE` does), on the tiny setup: one policy, a few GRPO steps, a tiny eval.

Starts its own servers in a temporary state dir on free ports (MLflow, Prefect, `mint serve` on the built-in tiny
dense base, and the Prefect worker with infra/prefect.yaml's deployments on a pool of its own, without their
schedules), through mint_app.services.control as `mint up` does. Prints, per round: seconds from the run's creation to
Completed, the states in between (Scheduled -> Pending: the worker's poll; Pending -> Running: the flow run's
process start and imports; Running -> Completed: the flow), the in-process wall time of the same wave, and
Prefect's overhead (the difference). Last line: one JSON object.

`--device` (cpu by default): where `mint serve` holds the base and where the waves train (the deployments'
workspace and the in-process run's alike).

    .venv/bin/python benchmarks/dashboard_run.py [--rounds 2] [--steps 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.chdir(ROOT)  # flow runs start in the repository (the deployments' pull step)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import add_device, checked_device, report, stop_servers_on_kill  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    add_device(ap)
    args = ap.parse_args()
    stop_servers_on_kill()
    checked_device(ap, args.device)

    from mint_app.services.config import ServicesConfig
    from mint_app.services.control import start, stop
    from mint_app.services.mlflow_auth import service_env
    from mint_app.services.prefect_auth import server_auth

    tmp = Path(tempfile.mkdtemp(prefix="mint-dashboard-bench-"))
    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    pool = f"mint-bench-{uuid.uuid4().hex[:8]}"
    for d in spec["deployments"]:
        d["work_pool"] = {**d["work_pool"], "name": pool}
        d.pop("schedules", None)
    (tmp / "prefect.yaml").write_text(yaml.safe_dump(spec))
    config = ServicesConfig.model_validate(
        {
            "state_dir": tmp / "run",
            "mlflow_port": free_port(),
            "prefect_port": free_port(),
            "serve_port": free_port(),
            "worker_port": free_port(),
            "serve_base": "tiny-dense",
            "serve_adapter_root": tmp / "store",
            "serve_device": args.device,
            "deployments": tmp / "prefect.yaml",
        }
    )
    names = ["mlflow", "prefect", "serve", "worker"]
    os.environ["MINT_SERVE_TORCH_THREADS"] = "1"
    t0 = time.perf_counter()
    # the base file the flows read: the weights `mint serve --base tiny-dense` builds (seed 0)
    from mint_core.engine.base import build_tiny_base
    from mint_core.engine.tokenizer import byte_tokenizer

    base_dir = tmp / "base"
    tiny = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
    tiny.model.save_pretrained(base_dir)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(base_dir)
    config = config.model_copy(update={"serve_base": str(base_dir)})
    services = {s.name: s for s in start(config, names)}  # type: ignore[arg-type]
    startup_s = time.perf_counter() - t0
    worker_detail = services["worker"].detail
    os.environ["PREFECT_API_URL"] = services["prefect"].api_url
    os.environ["PREFECT_API_AUTH_STRING"] = server_auth(config)  # the server asks it
    os.environ["MLFLOW_TRACKING_URI"] = services["mlflow"].api_url
    os.environ.update(service_env(config))  # its MLflow asks a login: mint's service account
    try:
        rows = run_rounds(tmp, config, args.rounds, args.steps)
    finally:
        stop(config, names)  # type: ignore[arg-type]

    dash = [r["created_to_completed_s"] for r in rows]
    inproc = [r["in_process_s"] for r in rows]
    result: dict[str, Any] = {
        "benchmark": "dashboard_run",
        "policies": 1,
        "steps": args.steps,
        "rounds": args.rounds,
        "device": args.device,
        "services_startup_s": round(startup_s, 1),
        "worker": worker_detail,
        "created_to_completed_s": round(statistics.median(dash), 2),
        "in_process_s": round(statistics.median(inproc), 2),
        "prefect_overhead_s": round(statistics.median(dash) - statistics.median(inproc), 2),
        "rows": rows,
    }
    report(result)


def run_rounds(tmp: Path, config: Any, rounds: int, steps: int) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.forms import PolicyRun, Training
    from flows.lifecycle import wave
    from mint_app.services.deployments import workspace_defaults
    from mint_core.eval.gate import GatePolicy
    from mint_core.eval.results import EvalConfig
    from mint_core.eval.suites import standalone_suites
    from mint_core.lifecycle.workspace import Workspace
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.policy import PolicySpec

    suites = standalone_suites(tmp, limit=20)
    ws = Workspace.model_validate(workspace_defaults(config))
    evaluation = EvalConfig(limit=4, batch_size=16, suites_dir=suites)
    grpo = GRPOConfig(
        group_size=4, max_new_tokens=8, learning_rate=1e-2, weight_decay=0.5, drop_zero_variance=False
    )

    def params(name: str, round_name: str) -> tuple[list[PolicyRun], Training]:
        run = PolicyRun(spec=PolicySpec(name=name, task="add", rank=4, alpha=8), gate=GatePolicy(suite="add"))
        training = Training(  # dry_run 0: a random base's completions score alike, which the dry run refuses
            steps=steps, prompts_per_step=4, grpo=grpo, data_dir=None, round=round_name, dry_run=0
        )
        return [run], training

    rows = []
    api = {
        PREFECT_API_URL: os.environ["PREFECT_API_URL"],
        PREFECT_API_AUTH_STRING: os.environ["PREFECT_API_AUTH_STRING"],
    }
    with temporary_settings(updates=api):
        # warm this process (imports, first MLflow experiment) so the in-process time is the wave's own
        warm_runs, warm_training = params("bench-warm", "warm")
        wave(warm_runs, warm_training, evaluation, workspace=ws)
        for i in range(rounds):
            runs, training = params(f"bench-inproc-{i}", f"r{i}")
            t0 = time.perf_counter()
            wave(runs, training, evaluation, workspace=ws)
            in_process = time.perf_counter() - t0

            runs, training = params(f"bench-dash-{i}", f"r{i}")
            parameters = {
                "policies": [r.model_dump(mode="json") for r in runs],
                "training": training.model_dump(mode="json"),
                "evaluation": evaluation.model_dump(mode="json"),
            }
            t0 = time.perf_counter()
            fr = run_deployment(
                "wave/wave", parameters=parameters, timeout=900, poll_interval=0.5, as_subflow=False
            )
            dashboard = time.perf_counter() - t0
            assert isinstance(fr, FlowRun)
            assert fr.state is not None and fr.state.is_completed(), fr.state
            with get_client(sync_client=True) as client:
                states = sorted(client.read_flow_run_states(fr.id), key=lambda s: s.timestamp)
            t_first = states[0].timestamp
            timeline = {
                s.type.value.lower(): round((s.timestamp - t_first).total_seconds(), 2) for s in states
            }
            rows.append(
                {
                    "round": i,
                    "created_to_completed_s": round(dashboard, 2),
                    "in_process_s": round(in_process, 2),
                    "states_s": timeline,
                }
            )
            print(
                f"round {i}: dashboard run created -> Completed {dashboard:.1f} s (states {timeline}); "
                f"in-process {in_process:.1f} s",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
