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
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import typer
import yaml
from rich.table import Table
from tqdm import tqdm

from mint_app.console import make_console
from mint_app.eval_cli import eval_app
from mint_app.registry_cli import _version, catalog_app, registry_app, run_canary_cmd
from mint_app.services_cli import register as register_service_commands
from mint_app.task_cli import TasksOption, add_task_dirs, task_app
from mint_core import __version__
from mint_core.data.build import DataParams, write_task_data
from mint_core.engine.cpu_pin import pin_cpu_kernels
from mint_core.errors import BaseError, DataCheckError, MintError

if TYPE_CHECKING:
    from mint_core.rl.recipe import TrainingRun

app = typer.Typer(help="mint: many LoRA policies over one resident base model.", no_args_is_help=True)
adapter_app = typer.Typer(help="Inspect and convert adapter revisions.", no_args_is_help=True)
base_app = typer.Typer(help="Build and inspect bases.", no_args_is_help=True)
data_app = typer.Typer(help="Build and check the datasets.", no_args_is_help=True)
app.add_typer(adapter_app, name="adapter")
app.add_typer(base_app, name="base")
app.add_typer(data_app, name="data")
app.add_typer(catalog_app, name="catalog")
app.add_typer(registry_app, name="registry")
app.add_typer(eval_app, name="eval")
app.add_typer(task_app, name="task")
register_service_commands(app)  # mint up / down / status
console = make_console()  # a kept log's tables keep their width


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


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


@base_app.command("build-tiny")
def build_tiny(
    out: Annotated[Path, typer.Argument(help="Directory to write the Hugging Face model into.")],
    family: Annotated[
        str, typer.Option(help="dense, moe, mla or dsa; with --chat: llama, qwen2 or qwen3")
    ] = "dense",
    seed: int = 0,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help="A chat base: a BPE tokenizer trained here, the family's special tokens and chat template, "
            "generation_config listing EOS and the end-of-turn token.",
        ),
    ] = False,
) -> None:
    """Write a tiny random base of one family (with a byte-level tokenizer, or with --chat a BPE one and a chat
    template) as a local HF model directory."""
    # deferred: torch and transformers, which `mint --help` need not load
    from mint_core.engine.base import FAMILIES, build_tiny_base, build_tiny_chat_base
    from mint_core.engine.chat_tokenizer import CHAT_FAMILIES
    from mint_core.engine.tokenizer import byte_tokenizer

    if chat:
        if family not in CHAT_FAMILIES:
            raise typer.BadParameter(
                f"with --chat, family must be one of {', '.join(CHAT_FAMILIES)}, not {family!r}"
            )
        build_tiny_chat_base(out, family, seed=seed)  # type: ignore[arg-type]
        console.print(f"wrote a tiny {family} chat base to {out}")
        return
    if family not in FAMILIES:
        raise typer.BadParameter(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")
    base = build_tiny_base(family, seed=seed, tokenizer=byte_tokenizer())  # type: ignore[arg-type]
    base.model.save_pretrained(out)
    assert base.tokenizer is not None
    base.tokenizer.save_pretrained(out)
    console.print(f"wrote {family} base to {out} (fingerprint {base.fingerprint[:16]})")


def _params(path: Path, section: str) -> dict[str, Any]:
    """One section of a params.yaml (the DVC pipeline's parameters); {} (defaults) if the file is missing."""
    if not path.is_file():
        console.print(f"[yellow]{path} not found: using default {section} parameters[/]")
        return {}
    doc = yaml.safe_load(path.read_text()) or {}
    got = doc.get(section) or {}
    if not isinstance(got, dict):
        raise typer.BadParameter(f"{path}: section {section!r} is not a mapping")
    return got


@data_app.command("build")
def data_build(
    out: Annotated[Path, typer.Option(help="Directory for train/, heldout/, corpus.txt.")] = Path(
        "data/tasks"
    ),
    params: Annotated[Path, typer.Option(help="YAML file whose data: section is used.")] = Path(
        "params.yaml"
    ),
) -> None:
    """Write each task's train and held-out sets and the pretraining corpus (the `task_data` stage)."""
    p = DataParams(**_params(params, "data"))
    manifest = write_task_data(out, p.tasks, p.n_train, p.n_heldout, p.seed)
    console.print(
        f"wrote {len(p.tasks)} tasks ({p.n_train} train + {p.n_heldout} held-out each, seed {p.seed}) "
        f"and a {manifest['corpus_lines']}-line corpus to {out}"
    )


@data_app.command("check")
def data_check(
    path: Annotated[Path, typer.Argument(help="A file, or for prompts a directory of *.jsonl files.")],
    kind: Annotated[str, typer.Option(help="prompts, rollouts or eval")] = "prompts",
    params: Annotated[Path, typer.Option(help="YAML file whose checks: section is used.")] = Path(
        "params.yaml"
    ),
    report: Annotated[
        Path | None, typer.Option(help="Write a JSON summary here (a DVC metrics file).")
    ] = None,
    result: Annotated[
        Path | None, typer.Option(help="Write the full Great Expectations result (JSON) here.")
    ] = None,
) -> None:
    """Validate a dataset with its Great Expectations suite; exit 1 naming every failing expectation."""
    # deferred: Great Expectations and pandas, which `mint --help` need not load
    from mint_core.data.checks import KINDS, CheckParams, Kind, check, read_table

    if kind not in KINDS:
        raise typer.BadParameter(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    which = cast(Kind, kind)
    try:
        frame = read_table(path, which)
    except DataCheckError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    rep = check(frame, which, CheckParams(**_params(params, "checks")), str(path), raise_on_failure=False)
    for out, doc in ((report, rep.summary()), (result, rep.result_json)):
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if not rep.success:
        console.print(f"[red]{kind} check of {path} failed ({len(rep.failed)} expectation(s)):[/]")
        for line in rep.failed:
            console.print(f"  - {line}", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"{kind} check of {path}: {rep.rows} rows, {rep.evaluated} expectations met")


@base_app.command("pretrain")
def base_pretrain(
    data: Annotated[Path, typer.Option(help="Output of `mint data build`.")] = Path("data/tasks"),
    out: Annotated[Path, typer.Option(help="Directory to write the base into.")] = Path("data/base"),
    params: Annotated[Path, typer.Option(help="YAML file whose base: section is used.")] = Path(
        "params.yaml"
    ),
    metrics: Annotated[
        Path | None, typer.Option(help="Also write metrics.json here (a DVC metrics file).")
    ] = None,
    timings: Annotated[
        Path | None,
        typer.Option(
            help="Write the wall times of training and evaluation here (kept out of the metrics: they alone "
            "differ between rebuilds)."
        ),
    ] = None,
) -> None:
    """Pretrain the built-in base on the task corpus, save it, and record its held-out accuracy per task."""
    # before torch loads: the same bytes on every machine (mint_core/engine/cpu_pin.py)
    pin_cpu_kernels()
    # deferred: torch and transformers, which `mint --help` need not load
    from mint_core.engine.pretrain import PretrainParams, pretrain

    m = pretrain(
        out,
        PretrainParams(**_params(params, "base")),
        data,
        metrics_path=metrics,
        timings_path=timings,
        progress=os.isatty(2),  # a bar in a terminal; none in a kept log (the main job's DVC step in a file)
    )
    table = Table("task", "exact match", "well formed", "n")
    for task_name, v in m["heldout"].items():
        table.add_row(task_name, f"{v['exact_match']:.3f}", f"{v['well_formed']:.3f}", str(v["n"]))
    console.print(table)
    console.print(
        f"wrote base to {out} ({m['parameters'] / 1e6:.2f}M parameters, final loss {m['final_loss']:.3f}, "
        f"{m['train_seconds']:.0f} s training)"
    )


@base_app.command("info")
def base_info(path: Path) -> None:
    """Load a local HF model directory and print its fingerprint and LoRA sites."""
    # deferred: torch and transformers, which `mint --help` need not load
    from mint_core.engine.base import load_base

    base = load_base(path)
    console.print(f"[bold]{path}[/]  {type(base.model).__name__}  fingerprint {base.fingerprint}")
    table = Table("site", "in", "out", "experts")
    for s in base.sites.values():
        table.add_row(s.name, str(s.in_features), str(s.out_features), str(s.experts or ""))
    console.print(table)


@base_app.command("check")
def base_check(
    path: Path,
    serving: Annotated[
        Literal["mint", "vllm"] | None,
        typer.Option(help="Also check what this serving backend runs (vllm: its architectures, head sizes)."),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="A JSONL file whose rows' `prompt` (text or chat messages) the chat template must render, "
            "e.g. a task's train file (the first 50 rows)."
        ),
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(min=1, help="The context vLLM will serve.")] = None,
) -> None:
    """Check a base directory before training or serving it: tokenizer, EOS, chat template on the prompts, and
    what the serving backend runs. Exit 1 naming the directory and every problem."""
    from mint_core.serving.base_check import check_base

    samples: list[Any] | None = None
    if prompts is not None:
        try:
            rows = [json.loads(line) for line in prompts.read_text().splitlines()[:50] if line.strip()]
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"{prompts}: {e}", param_hint="--prompts") from None
        samples = [r["prompt"] for r in rows if isinstance(r, dict) and "prompt" in r]
        if not samples:
            raise typer.BadParameter(f"{prompts} has no row with a prompt", param_hint="--prompts")
    try:
        report = check_base(path, samples, serving=serving, max_model_len=max_model_len)
    except BaseError as e:
        console.print(f"[red]{e}[/]", soft_wrap=True)
        raise typer.Exit(1) from None
    template = "its own chat template" if report.chat_template else "no chat template (role: content lines)"
    console.print(
        f"{path}: {report.model_type} {list(report.architectures)}, {template}, generation stops at token ids "
        f"{sorted(report.stop_token_ids)}; {len(report.rendered)} prompt(s) rendered"
    )


@adapter_app.command("inspect")
def adapter_inspect(
    path: Path,
    base: Annotated[Path, typer.Option(help="Base model directory the adapter is checked against.")],
    max_rank: int = 64,
) -> None:
    """Validate an adapter against a base; print its digest, rank and targets, or every problem found."""
    from mint_core.engine.base import load_base
    from mint_core.errors import AdapterError
    from mint_core.lora.validate import BaseSpec, read_adapter

    b = load_base(base)
    try:
        a = read_adapter(path, BaseSpec(b.fingerprint, b.sites, max_rank))
    except AdapterError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None
    console.print(
        f"digest {a.digest.prefixed if a.digest else None}\nrank {a.rank}, alpha {a.alpha}, {len(a.tensors)} sites, {a.num_bytes()} bytes"
    )


@adapter_app.command("convert")
def adapter_convert(
    src: Path,
    dst: Path,
    base: Annotated[Path, typer.Option(help="Base model directory.")],
    layout: Annotated[
        str, typer.Option(help="packed (PEFT target_parameters) or unpacked (per expert)")
    ] = "packed",
) -> None:
    """Rewrite an adapter with MoE experts in the packed or unpacked layout (lossless)."""
    from mint_core.engine.base import load_base
    from mint_core.lora.adapter import save_adapter
    from mint_core.lora.validate import BaseSpec, read_adapter

    if layout not in ("packed", "unpacked"):
        raise typer.BadParameter("layout must be packed or unpacked")
    b = load_base(base)
    a = read_adapter(src, BaseSpec(b.fingerprint, b.sites, 1024))
    digest = save_adapter(a, dst, b.sites, layout=layout)  # type: ignore[arg-type]
    console.print(f"wrote {layout} adapter to {dst} ({digest.prefixed})")


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
            help="Who runs the model: mint's embedded engine, or the vLLM server at vllm_url that this "
            "server fronts (MINT_SERVE_VLLM_URL, MINT_SERVE_VLLM_API_KEY) \\[default: mint]."
        ),
    ] = None,
) -> None:
    """Serve the base and its adapters over the OpenAI/vLLM HTTP contract (settings: file, then MINT_SERVE_*)."""
    from mint_core.serving.app import serve as run_server
    from mint_core.serving.config import ServingConfig
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


@app.command()
def train(
    policies: Annotated[
        str, typer.Option(help="Comma-separated tasks, one policy per task (add,reverse,...).")
    ] = "add,sort",
    base: Annotated[Path, typer.Option(help="Base model directory (default: the built-in base).")] = Path(
        "data/base"
    ),
    # the defaults are mint_core.rl.recipe.BUILTIN_RECIPE's and builtin_spec's (literals here: importing it would load torch)
    steps: Annotated[int, typer.Option(min=1)] = 300,
    prompts: Annotated[int, typer.Option(min=1, help="Prompts per policy per step.")] = 16,
    group: Annotated[int, typer.Option(min=2, help="Samples per prompt (G).")] = 8,
    lr: Annotated[
        float, typer.Option(help="Learning rate at rank 8 (scaled by sqrt(8 / rank); decays linearly to 0).")
    ] = 1e-3,
    temperature: Annotated[float, typer.Option(min=0.01, help="Sampling temperature of the rollouts.")] = 0.7,
    rank: Annotated[
        int | None, typer.Option(min=1, help="LoRA rank (alpha = 2 x rank). Default: add 32, the others 8.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Where revisions and trainer state are written.")] = Path(
        "runs/train"
    ),
    seed: int = 0,
    heldout: Annotated[
        int, typer.Option(min=20, help="Held-out prompts per policy, scored before and after (paired test).")
    ] = 200,
    device: Annotated[
        str,
        typer.Option(help="cpu, cuda or cuda:N: where the base, the adapters and the update run."),
    ] = "cpu",
    deepspeed: Annotated[
        Path | None,
        typer.Option(
            help="Train under DeepSpeed with this config (infra/deepspeed/zero2.json or zero3.json); for "
            "several GPUs launch with `deepspeed --no_local_rank --num_gpus N --module mint_app.cli train`."
        ),
    ] = None,
    checkpoint_every: Annotated[
        int,
        typer.Option(
            min=0, help="Save the trainer's state every N steps (0: only at the end and on Ctrl-C)."
        ),
    ] = 10,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue the run whose newest checkpoint is in OUT/checkpoints (same policies, prompts, "
            "group, lr, rank, seed and base; --steps may be larger)."
        ),
    ] = False,
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
    from mint_core.data.tasks import split, task
    from mint_core.rl.checkpoints import checkpoints, is_lead_process, latest_checkpoint
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.recipe import ResumeError, TrainingRun, builtin_spec, load_trainer

    _check_device(device)  # before any work, as an unknown task below
    if not lr > 0:  # NaN too
        raise typer.BadParameter(f"{lr} is not a learning rate: it must be above 0", param_hint="--lr")
    names = [t.strip() for t in policies.split(",") if t.strip()]
    for t in names:
        try:
            task(t)  # unknown task: a clear error before any work
        except KeyError as e:
            raise typer.BadParameter(str(e.args[0]), param_hint="--policies") from None
    if not (base / "config.json").is_file():
        raise typer.BadParameter(
            f"{base} is not a model directory (build the built-in base with `dvc repro`)"
        )
    ckpt_dir = out / "checkpoints"
    if resume and latest_checkpoint(ckpt_dir) is None:
        raise typer.BadParameter(f"no checkpoint of a `mint train` run in {ckpt_dir}", param_hint="--resume")
    try:
        data = {t: split(t, prompts * steps, heldout, seed) for t in names}
    except ValueError as e:  # a task with fewer distinct prompts than the run asks for
        raise typer.BadParameter(
            f"{e}: --steps {steps} x --prompts {prompts} asks for {steps * prompts} distinct train prompts per "
            f"policy, and {heldout} more held out",
            param_hint="--steps",
        ) from None
    specs = [builtin_spec(t, t, rank, lr) for t in names]
    trainer = load_trainer(
        base,
        specs,
        GRPOConfig(group_size=group, learning_rate=lr, lr_decay="linear", temperature=temperature),
        seed,
        deepspeed=deepspeed,
        device=device,
    )
    lead = is_lead_process()  # the process that prints and exports (rank 0 under DeepSpeed)
    if not resume and checkpoints(ckpt_dir) and lead:
        console.print(f"starting afresh: the checkpoints of an earlier run in {ckpt_dir} will be replaced")
    try:
        run = TrainingRun.start(
            trainer,
            {t: data[t][0] for t in names},
            steps,
            prompts,
            ckpt_dir,
            checkpoint_every,
            resume=resume,
            heldout={t: data[t][1] for t in names},
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

    # Ctrl-C stops after the step under way (a step cut short would leave some policies updated and others not);
    # a second Ctrl-C stops at once, without saving.
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
        finished = run.run(step, stop=lambda: stop_asked)
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
        _train_results(run, out)


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
    from mint_app.demo import run_demo

    t0 = time.perf_counter()
    if workdir.exists():
        shutil.rmtree(workdir)
    run_demo(workdir, adapters, console)
    console.print(f"\n[bold]done in {time.perf_counter() - t0:.1f} s[/]")


@app.command("run")
def run_cmd(
    policies: Annotated[
        str | None,
        typer.Option(help="Comma-separated tasks, one policy per task \\[default: add,sort]."),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help="GRPO steps of the wave from the champions \\[default: 40].")
    ] = None,
    first_steps: Annotated[
        int | None,
        typer.Option(
            min=1, help="GRPO steps of the first wave, for policies with no champion \\[default: 300]."
        ),
    ] = None,
    eval_limit: Annotated[
        int | None, typer.Option(min=20, help="Items per lm-eval task the gate reads \\[default: 200].")
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where everything is kept: run/ (services), store/, catalog.db, lifecycle/ \\[default: .mint]."
        ),
    ] = None,
    build: Annotated[bool, typer.Option(help="Build what is missing with DVC first.")] = True,
    round: Annotated[
        str | None, typer.Option(help="Training round name \\[default: a timestamp, so every run trains].")
    ] = None,
    mlflow_port: Annotated[int | None, typer.Option(help="\\[default: 5000]")] = None,
    prefect_port: Annotated[int | None, typer.Option(help="\\[default: 4200]")] = None,
    serve_port: Annotated[int | None, typer.Option(help="\\[default: 8000]")] = None,
    serving: Annotated[
        Literal["mint", "vllm"] | None,
        typer.Option(
            help="Who serves the policies: mint's embedded engine, or a vLLM server (from .venv-vllm, `make "
            "vllm-venv`) behind mint serve \\[default: mint]."
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="cpu, cuda or cuda:N: where the waves train and mint serve serves \\[default: cpu]."
        ),
    ] = None,
    base: Annotated[
        Path | None,
        typer.Option(
            help="The base: a Hugging Face causal-LM directory with its tokenizer (and chat template), which the "
            "waves train and mint serve (or vLLM) serves; checked before anything starts \\[default: data/base]."
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="YAML/JSON of MainJobConfig fields; then MINT_RUN_<FIELD> variables, then flags."),
    ] = None,
    tasks: TasksOption = None,
) -> None:
    """The main job: build what is missing (DVC), start the servers, train/evaluate/gate/promote/serve a wave
    of policies, show a served completion from each and a rollback, and say where to look. The servers stay up
    (`mint down` stops them)."""
    # deferred: the main job imports torch, Prefect and MLflow, which `mint --help` need not load
    from mint_app.job_config import MainJobConfig, MainJobError
    from mint_app.main_job import run_main_job

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
    from flows.lifecycle import WaveFailed, lifecycle, wave
    from mint_app.stack import flow_run_url, flow_workspace, on_stack

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
) -> None:
    """Train, evaluate, gate and promote several policies at once (the wave flow; needs `mint up`)."""
    doc = _flow_params(params)
    doc.setdefault("policies", [{"spec": {"name": t, "task": t}} for t in policies.split(",") if t.strip()])
    if steps is not None:
        doc.setdefault("training", {})["steps"] = steps
    _run_wave(False, doc)


@app.command("lifecycle")
def lifecycle_cmd(
    task: Annotated[str, typer.Option(help="The policy's task; the policy is named after it.")] = "add",
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
