"""The `mint` command line."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.table import Table
from tqdm import tqdm

from mint_app.cli.access import access_app
from mint_app.cli.base import adapter_app, base_app, data_app
from mint_app.cli.eval import eval_app
from mint_app.cli.help import default_of, with_default
from mint_app.cli.registry import _version, catalog_app, registry_app, run_canary_cmd
from mint_app.cli.services import register as register_service_commands
from mint_app.cli.task import TasksOption, add_task_dirs, task_app
from mint_app.console import make_console
from mint_app.job.config import MainJobConfig
from mint_core import __version__
from mint_core.data.spec import demo_policies
from mint_core.errors import BaseError, MintError
from mint_core.process import freeze_at_exit
from mint_core.rl.recipe_defaults import RECIPE
from mint_core.serving.config import ServingConfig

if TYPE_CHECKING:
    from mint_core.rl.recipe import TrainingRun
    from mint_core.rl.trainer import MultiPolicyTrainer

app = typer.Typer(help="mint: many LoRA policies over one resident base model.", no_args_is_help=True)
app.add_typer(adapter_app, name="adapter")
app.add_typer(base_app, name="base")
app.add_typer(data_app, name="data")
app.add_typer(catalog_app, name="catalog")
app.add_typer(registry_app, name="registry")
app.add_typer(eval_app, name="eval")
app.add_typer(task_app, name="task")
app.add_typer(access_app, name="access")
register_service_commands(app)  # mint up / down / status
console = make_console()  # a kept log's tables keep their width


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    freeze_at_exit()  # a command that imported torch exits a second sooner (mint_core/process.py)


@app.command()
def version() -> None:
    """Print mint's version."""
    console.print(__version__)


def _check_device(name: str, what: str = "--device") -> None:
    """Refuse a device that is not cpu, cuda or cuda:N, or a CUDA device not visible here, before any work."""
    from mint_core.engine.device import DeviceError, check_device

    try:
        check_device(name, what)
    except DeviceError as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def serve(
    config: Annotated[
        Path | None, typer.Option(help="YAML or JSON settings file (ServingConfig fields).")
    ] = None,
    base: Annotated[
        str | None, typer.Option(help="Model directory or tiny-dense|tiny-moe|tiny-mla|tiny-dsa.")
    ] = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    adapter_root: Annotated[
        Path | None, typer.Option(help="Adapter store: load requests may only name paths here.")
    ] = None,
    max_loras: Annotated[int | None, typer.Option()] = None,
    device: Annotated[
        str | None,
        typer.Option(help="cpu, cuda or cuda:N: where the base, its adapter slots and every forward run."),
    ] = None,
    backend: Annotated[
        Literal["mint", "vllm"] | None,
        typer.Option(
            help=with_default(
                "Who runs the model: mint's embedded engine, or the vLLM server at vllm_url that this "
                "server fronts (MINT_SERVE_VLLM_URL, MINT_SERVE_VLLM_API_KEY)",
                ServingConfig,
                "backend",
            )
        ),
    ] = None,
) -> None:
    """Serve the base and its adapters over the OpenAI/vLLM HTTP contract (settings: file, then MINT_SERVE_*)."""
    from mint_core.serving.app import serve as run_server
    from mint_core.tinker.mount import build_app

    if device is not None:
        _check_device(device)  # before the settings file is read, which would name the field, not the flag
    cfg = ServingConfig.load(
        config,
        base=base,
        host=host,
        port=port,
        adapter_root=adapter_root,
        max_loras=max_loras,
        device=device,
        backend=backend,
    )
    _check_device(cfg.device, "device")  # from the file or MINT_SERVE_DEVICE
    # a token given (environment, file, `mint up`'s token file) is not printed; a generated one must be
    generated = cfg.admin_token is None
    token = cfg.admin_secret()
    console.print(f"mint serving [bold]{cfg.base}[/] at http://{cfg.host}:{cfg.port}/v1  (metrics: /metrics)")
    if cfg.backend == "vllm":
        console.print(f"backend: the vLLM server at {cfg.vllm_url}")
    console.print(f"adapter store: {cfg.adapter_root.resolve()}")
    # the log outlives the run (appended, `mint logs`): a secret the user gave is never written into it
    console.print(f"admin token (load/unload): {token if generated else 'as configured (not shown)'}")
    if cfg.tinker and cfg.backend == "mint":  # the training API lives on the embedded engine
        configured = cfg.tinker_api_keys is not None or cfg.tinker_api_keys_file is not None
        key = cfg.tinker_keys().get_secret_value()  # generated now when none is configured
        shown = "the configured keys" if configured else f"generated key {key}"
        console.print(f"Tinker training API at http://{cfg.host}:{cfg.port} (api_key: {shown})")
    try:
        run_server(cfg, build_app)  # serving's app, the Tinker API mounted on it
    except BaseError as e:  # the base cannot be served: said plainly, before anything loads
        console.print(f"[red]{e}[/]", soft_wrap=True)
        raise typer.Exit(1) from None


_TrainLr = Annotated[
    float,
    typer.Option(
        help=f"Learning rate at rank {RECIPE.rank} (scaled by sqrt({RECIPE.rank} / rank); "
        f"{RECIPE.lr_decay} decay to 0)."
    ),
]
_TrainRank = Annotated[
    int | None,
    typer.Option(
        min=1,
        help=f"LoRA rank (alpha = 2 x rank). Default: each task's spec's recipe.rank, else {RECIPE.rank}.",
    ),
]
_TrainDeepSpeed = Annotated[
    Path | None,
    typer.Option(
        help="Train under DeepSpeed with this config (infra/deepspeed/zero2.json or zero3.json); for "
        "several GPUs launch with `deepspeed --no_local_rank --num_gpus N --module mint_app.cli.app train`."
    ),
]
_TrainCheckpointEvery = Annotated[
    int,
    typer.Option(min=0, help="Save the trainer's state every N steps (0: only at the end and on Ctrl-C)."),
]
_TrainResume = Annotated[
    bool,
    typer.Option(
        help="Continue the run whose newest checkpoint is in OUT/checkpoints (same policies, prompts, "
        "group, lr, rank, seed and base; --steps may be larger)."
    ),
]
_TrainPolicies = Annotated[
    str,
    typer.Option(
        help="Comma-separated registered tasks, one policy per task (`mint task list`; a user's with --tasks)."
    ),
]


@app.command()
def train(
    policies: _TrainPolicies = ",".join(demo_policies()),
    tasks: TasksOption = None,
    base: Annotated[
        Path, typer.Option(help="Base model directory (the default is the built-in base).")
    ] = default_of(MainJobConfig, "base"),
    # the built-in recipe's defaults (mint_core.rl.recipe_defaults: the flows and `mint run` read them too)
    steps: Annotated[int, typer.Option(min=1)] = RECIPE.steps,
    prompts: Annotated[
        int, typer.Option(min=1, help="Prompts per policy per step.")
    ] = RECIPE.prompts_per_step,
    group: Annotated[int, typer.Option(min=2, help="Samples per prompt (G).")] = RECIPE.group_size,
    lr: _TrainLr = RECIPE.learning_rate,
    temperature: Annotated[
        float, typer.Option(min=0.01, help="Sampling temperature of the rollouts.")
    ] = RECIPE.temperature,
    rank: _TrainRank = None,
    out: Annotated[Path, typer.Option(help="Where revisions and trainer state are written.")] = Path(
        "runs/train"
    ),
    seed: int = RECIPE.seed,
    heldout: Annotated[
        int, typer.Option(min=20, help="Held-out prompts per policy, scored before and after (paired test).")
    ] = RECIPE.heldout,
    device: Annotated[
        str,
        typer.Option(help="cpu, cuda or cuda:N: where the base, the adapters and the update run."),
    ] = default_of(MainJobConfig, "device"),
    deepspeed: _TrainDeepSpeed = None,
    checkpoint_every: _TrainCheckpointEvery = 10,
    resume: _TrainResume = False,
    compile_decode: Annotated[
        bool,
        typer.Option(
            help="Roll out through the engine's compiled decode step (Llama, Mistral and Qwen2 bases): the same "
            "tokens, faster steps, after a compile at the first step (about 27 s on a 2-core CPU, seconds once "
            "its cache is warm)."
        ),
    ] = RECIPE.compile_decode,
) -> None:
    """Train several policies with GRPO at once on one base; print held-out reward before and after.

    The trainer's state (adapters, optimizer moments, step) is checkpointed to OUT/checkpoints every
    --checkpoint-every steps, at the end, and on Ctrl-C; --resume continues from the newest, drawing the same
    prompts and samples as an uninterrupted run would. The recipe is mint_core.rl.recipe, as in the flows."""
    # OpenMP threads that spin while they wait stall each other when other processes hold the cores: on this
    # 2-core machine, beside a test run, a step of 5 policies took 30 s with spinning threads, 4 s with one
    # thread and 2.9 s with two passive ones (set before torch loads; the environment wins)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # deferred: torch and transformers load for this command only, so `mint --help` stays fast
    from mint_core.engine.compiled_decode import UnsupportedBase
    from mint_core.rl.builder import load_trainer, recipe_spec
    from mint_core.rl.checkpoints import is_lead_process
    from mint_core.rl.grpo import GRPOConfig

    _check_device(device)  # before any work, as an unknown task below
    if not lr > 0:  # NaN too
        raise typer.BadParameter(f"{lr} is not a learning rate: it must be above 0", param_hint="--lr")
    names = [t.strip() for t in policies.split(",") if t.strip()]
    add_task_dirs(tasks)
    ckpt_dir = out / "checkpoints"
    data = _train_data(names, base, ckpt_dir, steps, prompts, heldout, seed, resume)
    specs = [recipe_spec(t, t, rank, lr) for t in names]
    try:
        trainer = load_trainer(
            base,
            specs,
            GRPOConfig(
                **{
                    **RECIPE.grpo_fields(),
                    "group_size": group,
                    "learning_rate": lr,
                    "temperature": temperature,
                }
            ),
            seed,
            deepspeed=deepspeed,
            device=device,
            compile_decode=compile_decode,
        )
    except UnsupportedBase as e:
        raise typer.BadParameter(str(e), param_hint="--compile-decode") from None
    lead = is_lead_process()  # the process that prints and exports (rank 0 under DeepSpeed)
    run = _start_run(trainer, data, steps, prompts, ckpt_dir, checkpoint_every, resume, lead)
    _train_until_done_or_stopped(run, ckpt_dir, steps, lead)


def _train_data(
    names: list[str],
    base: Path,
    ckpt_dir: Path,
    steps: int,
    prompts: int,
    heldout: int,
    seed: int,
    resume: bool,
) -> dict[str, tuple[list[Any], list[Any]]]:
    """`mint train`'s inputs checked before any work (each task registered, the base a model directory, a
    checkpoint to resume), then each policy's train and held-out prompts; a problem is a usage error naming the
    option."""
    from mint_core.data.spec import SpecError
    from mint_core.data.spec import registry as task_registry
    from mint_core.lifecycle.prompts import train_and_heldout
    from mint_core.rl.checkpoints import latest_checkpoint

    for t in names:
        try:
            task_registry().get(t)  # unknown task: a clear error before any work
        except SpecError as e:
            raise typer.BadParameter(str(e), param_hint="--policies") from None
    if not (base / "config.json").is_file():
        raise typer.BadParameter(
            f"{base} is not a model directory (build the built-in base with `dvc repro`)"
        )
    if resume and latest_checkpoint(ckpt_dir) is None:
        raise typer.BadParameter(f"no checkpoint of a `mint train` run in {ckpt_dir}", param_hint="--resume")
    try:
        return {t: train_and_heldout(t, prompts * steps, heldout, seed) for t in names}
    except SpecError as e:
        raise typer.BadParameter(str(e), param_hint="--policies") from None
    except ValueError as e:  # a task with fewer distinct prompts than the run asks for
        raise typer.BadParameter(
            f"{e}: --steps {steps} x --prompts {prompts} asks for {steps * prompts} distinct train prompts per "
            f"policy, and {heldout} more held out",
            param_hint="--steps",
        ) from None


def _start_run(
    trainer: MultiPolicyTrainer,
    data: dict[str, tuple[list[Any], list[Any]]],
    steps: int,
    prompts: int,
    ckpt_dir: Path,
    checkpoint_every: int,
    resume: bool,
    lead: bool,
) -> TrainingRun:
    """`mint train`'s run, afresh or from the newest checkpoint (--resume): a checkpoint of another run, or one
    already at --steps, is a usage error naming --resume."""
    from mint_core.rl.checkpoints import checkpoints
    from mint_core.rl.recipe import ResumeError, TrainingRun

    if not resume and checkpoints(ckpt_dir) and lead:
        console.print(f"starting afresh: the checkpoints of an earlier run in {ckpt_dir} will be replaced")
    try:
        run = TrainingRun.start(
            trainer,
            {t: d[0] for t, d in data.items()},
            steps,
            prompts,
            ckpt_dir,
            checkpoint_every,
            resume=resume,
            heldout={t: d[1] for t, d in data.items()},
        )
    except ResumeError as e:
        raise typer.BadParameter(str(e), param_hint="--resume") from None
    if run.resumed_checkpoint is not None:
        if run.done:
            raise typer.BadParameter(
                f"{run.resumed_checkpoint} is at step {run.resumed_step} already; pass --steps above it to "
                "train on",
                param_hint="--resume",
            )
        if lead:
            console.print(f"resuming from {run.resumed_checkpoint} at step {run.resumed_step} of {steps}")
    return run


def _train_until_done_or_stopped(run: TrainingRun, ckpt_dir: Path, steps: int, lead: bool) -> None:
    """Run `mint train`'s steps with a progress bar, then print its results. Ctrl-C stops after the step under
    way (a step cut short would leave some policies updated and others not), saved; a second Ctrl-C stops at
    once, without saving. Either exits 130."""
    from mint_core.rl.checkpoints import latest_checkpoint

    stop_asked = False

    def on_sigint(_signum: int, _frame: object) -> None:
        nonlocal stop_asked
        if stop_asked:
            raise KeyboardInterrupt
        stop_asked = True
        if lead:
            console.print("\n[yellow]Ctrl-C[/]: stopping after this step (again to stop at once, unsaved)")

    bar = tqdm(total=steps, initial=run.resumed_step, desc="GRPO steps", unit="step", disable=not lead)

    def step() -> None:
        run.step()
        bar.update()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        finished = run.train(step, stop=lambda: stop_asked)
    except KeyboardInterrupt:  # the second Ctrl-C
        bar.close()
        if lead:
            newest = latest_checkpoint(ckpt_dir)
            console.print(
                f"stopped during step {run.trainer.steps + 1}, unsaved; "
                + (f"the newest checkpoint is {newest} (--resume)" if newest else "no checkpoint yet")
            )
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    bar.close()
    if not finished:
        if lead:
            console.print(
                f"stopped at step {run.trainer.steps}, saved to {latest_checkpoint(ckpt_dir)}; "
                "continue with --resume"
            )
        raise typer.Exit(130)
    if lead:
        _train_results(run, ckpt_dir.parent)


def _train_results(run: TrainingRun, out: Path) -> None:
    """Print held-out exact match before and after and the first and last step's reward; write curve.csv and
    summary.json to `out`, and each policy's revision to out/revisions."""
    from mint_core.eval.gate import discordant, mcnemar_p
    from mint_core.rl.evaluate import heldout_correct

    names = list(run.trainer.policies)
    assert run.heldout is not None
    engine = run.trainer.engine
    reward_at = {(int(h["step"]), str(h["policy"])): h["reward"] or 0.0 for h in run.history}
    table = Table(
        "policy",
        "held-out exact match: base",
        "after",
        "+ / - items",
        "p (McNemar)",
        "train reward first step",
        "last step",
        title=f"held-out, {len(next(iter(run.heldout.values())))} items per policy, greedy",
    )
    summary = {}
    for t in names:
        # every `mint train` policy starts from a fresh adapter (B = 0), i.e. from the base itself
        base = heldout_correct(engine, None, run.heldout[t])
        now = heldout_correct(engine, t, run.heldout[t])
        gained, lost = discordant(now, base)
        p = mcnemar_p(gained, lost)
        before, after = sum(base) / len(base), sum(now) / len(now)
        first, last = reward_at.get((1, t), 0.0), reward_at.get((run.steps, t), 0.0)
        table.add_row(
            t,
            f"{before:.3f}",
            f"{after:.3f}",
            f"+{gained} / -{lost}",
            f"{p:.2g}",
            f"{first:.3f}",
            f"{last:.3f}",
        )
        summary[t] = {
            "heldout_before": before,
            "heldout_after": after,
            "n": len(base),
            "gained": gained,
            "lost": lost,
            "p_value": p,
        }
    console.print(table)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "curve.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(run.history[0]) if run.history else ["step"])
        writer.writeheader()
        writer.writerows(run.history)
    (out / "summary.json").write_text(json.dumps({"steps": run.steps, "policies": summary}, indent=2) + "\n")
    console.print(f"learning curves: {out / 'curve.csv'}; held-out before/after: {out / 'summary.json'}")
    for t in names:
        where = out / "revisions" / f"{t}-step{run.steps}"
        digest = run.trainer.export(t, where)
        console.print(f"exported {t}: {digest.prefixed} -> {where}")


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the demo writes its base and adapters.")] = Path(
        ".mint/demo"
    ),
    adapters: Annotated[int, typer.Option(min=1, max=32)] = 4,
) -> None:
    """Load a base once, load several adapters, and generate with all of them mixed in one batch."""
    from mint_app.cli.demo import run_demo

    t0 = time.perf_counter()
    if workdir.exists():
        shutil.rmtree(workdir)
    run_demo(workdir, adapters, console)
    console.print(f"\n[bold]done in {time.perf_counter() - t0:.1f} s[/]")


def _job(text: str, field: str) -> str:
    """Help of a `mint run` flag: `text` and the main job's default for `field` (MainJobConfig)."""
    return with_default(text, MainJobConfig, field)


_RunStateDir = Annotated[
    Path | None,
    typer.Option(
        help=_job("Where everything is kept: run/ (services), store/, catalog.db, lifecycle/", "state_dir")
    ),
]
_RunServing = Annotated[
    Literal["mint", "vllm"] | None,
    typer.Option(
        help=_job(
            "Who serves the policies: mint's embedded engine, or a vLLM server (from .venv-vllm, `make "
            "vllm-venv`) behind mint serve",
            "serving",
        )
    ),
]
_RunReplicas = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=8,
        help=_job(
            "vLLM replicas mint serve routes over (with --serving vllm), loaded all or nothing", "replicas"
        ),
    ),
]
_RunDevice = Annotated[
    str | None,
    typer.Option(help=_job("cpu, cuda or cuda:N: where the waves train and mint serve serves", "device")),
]
_RunBase = Annotated[
    Path | None,
    typer.Option(
        help=_job(
            "The base: a Hugging Face causal-LM directory with its tokenizer (and chat template), which the "
            "waves train and mint serve (or vLLM) serves; checked before anything starts",
            "base",
        )
    ),
]
_RunConfig = Annotated[
    Path | None,
    typer.Option(help="YAML/JSON of MainJobConfig fields; then MINT_RUN_<FIELD> variables, then flags."),
]
_RunFirstSteps = Annotated[
    int | None,
    typer.Option(
        min=1, help=_job("GRPO steps of the first wave, for policies with no champion", "first_steps")
    ),
]


@app.command("run")
def run_cmd(
    policies: Annotated[
        str | None,
        typer.Option(help=_job("Comma-separated tasks, one policy per task", "policies")),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help=_job("GRPO steps of the wave from the champions", "steps"))
    ] = None,
    first_steps: _RunFirstSteps = None,
    eval_limit: Annotated[
        int | None, typer.Option(min=20, help=_job("Items per lm-eval task the gate reads", "eval_limit"))
    ] = None,
    state_dir: _RunStateDir = None,
    build: Annotated[bool, typer.Option(help="Build what is missing with DVC first.")] = True,
    round: Annotated[
        str | None, typer.Option(help="Training round name \\[default: a timestamp, so every run trains].")
    ] = None,
    mlflow_port: Annotated[int | None, typer.Option(help=_job("", "mlflow_port"))] = None,
    prefect_port: Annotated[int | None, typer.Option(help=_job("", "prefect_port"))] = None,
    serve_port: Annotated[int | None, typer.Option(help=_job("", "serve_port"))] = None,
    serving: _RunServing = None,
    replicas: _RunReplicas = None,
    device: _RunDevice = None,
    base: _RunBase = None,
    config: _RunConfig = None,
    tasks: TasksOption = None,
) -> None:
    """The main job: build what is missing (DVC), start the servers, train/evaluate/gate/promote/serve a wave
    of policies, show a served completion from each and a rollback, and say where to look. The servers stay up
    (`mint down` stops them)."""
    # deferred: the main job imports torch, Prefect and MLflow, which `mint --help` need not load
    from mint_app.job.config import MainJobConfig, MainJobError
    from mint_app.job.main import run_main_job

    add_task_dirs(tasks)  # before anything starts: the servers and the worker inherit them
    try:
        cfg = MainJobConfig.load(
            config,
            policies=None if policies is None else [t.strip() for t in policies.split(",") if t.strip()],
            steps=steps,
            first_steps=first_steps,
            eval_limit=eval_limit,
            state_dir=state_dir,
            round=round,
            mlflow_port=mlflow_port,
            prefect_port=prefect_port,
            serve_port=serve_port,
            serving=serving,
            replicas=replicas,
            device=device,
            base=base,
            build=None if build else False,  # --no-build wins; the default leaves the file's value
        )
    except ValueError as e:  # pydantic's ValidationError included
        raise typer.BadParameter(str(e)) from None
    _check_device(cfg.device, "--device" if device is not None else "device")  # before anything starts
    try:
        run_main_job(cfg, console)
    except MainJobError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None


def _flow_params(path: Path | None) -> dict[str, Any]:
    """A flow's parameters from a YAML or JSON file (the same fields as its Prefect form); {} without one."""
    from mint_core.settings import read_mapping

    if path is None:
        return {}
    try:
        return read_mapping(path, "flow parameters")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _run_wave(one: bool, doc: dict[str, Any]) -> None:
    """Run the lifecycle (one policy) or wave flow in this process and print each policy's outcome."""
    from flows.forms import WaveFailed
    from flows.lifecycle import lifecycle, wave
    from mint_app.services.stack import flow_run_url, flow_workspace, on_stack

    with on_stack(console.print) as stack:
        doc["workspace"] = flow_workspace(stack, doc.get("workspace"))
        state = lifecycle(**doc, return_state=True) if one else wave(**doc, return_state=True)
        console.print(f"flow run: {flow_run_url(stack, state.state_details.flow_run_id)}")
        try:
            report = state.result()
        except (WaveFailed, MintError) as e:  # a failure the flow names (its run's log has the traceback)
            console.print(f"[red]{e}[/]")
            raise typer.Exit(1) from None
    assert report is not None
    table = Table("policy", "status", "candidate", "champion before", "champion after", "why")
    for o in report.outcomes:
        table.add_row(
            o.policy,
            o.status,
            o.candidate or "",
            o.champion_before or "",
            o.champion_after or "",
            "; ".join(o.reasons)[:120],
        )
    console.print(table)


_FlowParams = Annotated[
    Path | None,
    typer.Option(
        "--params", help="YAML/JSON of the flow's parameters (training, evaluation, checks, workspace, ...)."
    ),
]


@app.command("wave")
def wave_cmd(
    policies: Annotated[
        str, typer.Option(help="Comma-separated tasks, one policy per task (unless --params names them).")
    ] = "add,reverse,sort",
    steps: Annotated[
        int | None, typer.Option(min=1, help="GRPO steps (unless --params sets training).")
    ] = None,
    params: _FlowParams = None,
    spread: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Spread the wave over the pool's workers (hosts): one `wave` deployment run per this many "
            "policies, each taken by whichever worker is free (docs/multi-host.md).",
        ),
    ] = None,
) -> None:
    """Train, evaluate, gate and promote several policies at once (the wave flow; needs `mint up`)."""
    doc = _flow_params(params)
    doc.setdefault("policies", [{"spec": {"name": t, "task": t}} for t in policies.split(",") if t.strip()])
    if steps is not None:
        doc.setdefault("training", {})["steps"] = steps
    if spread is not None:
        _run_spread(doc, spread)
        return
    _run_wave(False, doc)


def _run_spread(doc: dict[str, Any], per_run: int) -> None:
    """Run the spread flow in this process (its groups run on the pool's workers) and print each group."""
    from flows.spread import spread
    from mint_app.services.stack import flow_run_url, flow_workspace, on_stack

    with on_stack(console.print) as stack:
        doc["workspace"] = flow_workspace(stack, doc.get("workspace"))
        state = spread(**doc, per_run=per_run, return_state=True)
        console.print(f"flow run: {flow_run_url(stack, state.state_details.flow_run_id)}")
        try:
            report = state.result()
        except MintError as e:  # a group that did not complete, named with its flow run
            console.print(f"[red]{e}[/]")
            raise typer.Exit(1) from None
    table = Table("policies", "flow run", "state", "runs")
    for g in report.groups:
        table.add_row(", ".join(g.policies), f"{g.flow_run_name} ({g.flow_run_id})", g.state, str(g.runs))
    console.print(table)
    console.print(f"{len(report.groups)} group(s) in {report.seconds:.0f} s")


@app.command("lifecycle")
def lifecycle_cmd(
    task: Annotated[
        str, typer.Option(help="The policy's task; the policy is named after it.")
    ] = demo_policies()[0],
    steps: Annotated[
        int | None, typer.Option(min=1, help="GRPO steps (unless --params sets training).")
    ] = None,
    params: _FlowParams = None,
) -> None:
    """Train, evaluate, gate and promote one policy (the lifecycle flow; needs `mint up`)."""
    doc = _flow_params(params)
    doc.setdefault("policy", {"spec": {"name": task, "task": task}})
    if steps is not None:
        doc.setdefault("training", {})["steps"] = steps
    _run_wave(True, doc)


@app.command("canary")
def canary_cmd(
    policy: Annotated[str, typer.Argument(help="The policy (MLflow registered model).")],
    version: Annotated[str, typer.Argument(help="The candidate version: N or vN.")],
    share: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Fraction of the policy's users the candidate answers.",
        ),
    ] = 0.1,
    max_minutes: Annotated[
        float | None, typer.Option(help="Roll back as inconclusive after this long (default 60).")
    ] = None,
    params: _FlowParams = None,
) -> None:
    """Canary a version: it answers `share` of the policy's requests beside the champion until the online test
    (an always-valid sequential test on the answers' scores) promotes it or rolls it back (the canary flow;
    needs `mint up` and traffic). Exit 0 when promoted, 1 when rolled back or inconclusive."""
    doc = _flow_params(params)
    cfg = doc.setdefault("canary", {})
    cfg["share"] = share
    if max_minutes is not None:
        cfg["max_minutes"] = max_minutes
    run_canary_cmd(policy, _version(version), doc)


if __name__ == "__main__":
    app()
