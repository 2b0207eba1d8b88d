"""The `mint base`, `mint data` and `mint adapter` commands: build, pretrain and check bases, build and check the
task datasets (the DVC stages run these), inspect and convert adapter revisions."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import typer
import yaml
from rich.table import Table

from mint_app.console import make_console
from mint_core.data.build import DataParams, write_task_data
from mint_core.engine.cpu_pin import pin_cpu_kernels
from mint_core.errors import BaseError, DataCheckError

if TYPE_CHECKING:
    pass

adapter_app = typer.Typer(help="Inspect and convert adapter revisions.", no_args_is_help=True)
base_app = typer.Typer(help="Build and inspect bases.", no_args_is_help=True)
data_app = typer.Typer(help="Build and check the datasets.", no_args_is_help=True)
console = make_console()  # a kept log's tables keep their width


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
