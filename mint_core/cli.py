"""The `mint` command line."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from mint_core import __version__

app = typer.Typer(help="mint: many LoRA policies over one resident base model.", no_args_is_help=True)
adapter_app = typer.Typer(help="Inspect and convert adapter revisions.", no_args_is_help=True)
base_app = typer.Typer(help="Build and inspect bases.", no_args_is_help=True)
app.add_typer(adapter_app, name="adapter")
app.add_typer(base_app, name="base")
console = Console()


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


@base_app.command("build-tiny")
def build_tiny(
    out: Annotated[Path, typer.Argument(help="Directory to write the Hugging Face model into.")],
    family: Annotated[str, typer.Option(help="dense, moe or mla")] = "dense",
    seed: int = 0,
) -> None:
    """Write a tiny random base of one family (with a byte-level tokenizer) as a local HF model directory."""
    from mint_core.engine.base import build_tiny_base
    from mint_core.engine.tokenizer import byte_tokenizer

    if family not in ("dense", "moe", "mla"):
        raise typer.BadParameter(f"family must be dense, moe or mla, not {family!r}")
    base = build_tiny_base(family, seed=seed, tokenizer=byte_tokenizer())  # type: ignore[arg-type]
    base.model.save_pretrained(out)
    assert base.tokenizer is not None
    base.tokenizer.save_pretrained(out)
    console.print(f"wrote {family} base to {out} (fingerprint {base.fingerprint[:16]})")


@base_app.command("info")
def base_info(path: Path) -> None:
    """Load a local HF model directory and print its fingerprint and LoRA sites."""
    from mint_core.engine.base import load_base

    base = load_base(path)
    console.print(f"[bold]{path}[/]  {type(base.model).__name__}  fingerprint {base.fingerprint}")
    table = Table("site", "in", "out", "experts")
    for s in base.sites.values():
        table.add_row(s.name, str(s.in_features), str(s.out_features), str(s.experts or ""))
    console.print(table)


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
        f"digest sha256:{a.digest}\nrank {a.rank}, alpha {a.alpha}, {len(a.tensors)} sites, {a.num_bytes()} bytes"
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
    console.print(f"wrote {layout} adapter to {dst} (sha256:{digest[:16]})")


@app.command()
def serve(
    config: Annotated[
        Path | None, typer.Option(help="YAML or JSON settings file (ServingConfig fields).")
    ] = None,
    base: Annotated[str | None, typer.Option(help="Model directory or tiny-dense|tiny-moe|tiny-mla.")] = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    adapter_root: Annotated[
        Path | None, typer.Option(help="Adapter store: load requests may only name paths here.")
    ] = None,
    max_loras: Annotated[int | None, typer.Option()] = None,
) -> None:
    """Serve the base and its adapters over the OpenAI/vLLM HTTP contract (settings: file, then MINT_SERVE_*)."""
    from mint_core.serving.app import serve as run_server
    from mint_core.serving.config import ServingConfig

    cfg = ServingConfig.load(
        config, base=base, host=host, port=port, adapter_root=adapter_root, max_loras=max_loras
    )
    token = cfg.admin_secret()
    console.print(f"mint serving [bold]{cfg.base}[/] at http://{cfg.host}:{cfg.port}/v1  (metrics: /metrics)")
    console.print(f"adapter store: {cfg.adapter_root.resolve()}")
    console.print(f"admin token (load/unload): {token}")
    run_server(cfg)


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the demo writes its base and adapters.")] = Path(
        ".mint/demo"
    ),
    adapters: Annotated[int, typer.Option(min=1, max=32)] = 4,
) -> None:
    """Load a base once, load several adapters, and generate with all of them mixed in one batch."""
    from mint_core.demo import run_demo

    t0 = time.perf_counter()
    if workdir.exists():
        shutil.rmtree(workdir)
    run_demo(workdir, adapters, console)
    console.print(f"\n[bold]done in {time.perf_counter() - t0:.1f} s[/]")


if __name__ == "__main__":
    app()
