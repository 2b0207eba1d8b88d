"""The engine demo (`mint demo`, `make demo`): one resident base, several adapters, one mixed batch.

The engine contract end to end, with no servers: a local HF model directory loaded and fingerprinted, adapters
written in PEFT's format and validated, a bad adapter refused with every problem named, and one batch in which
each row runs its own adapter. The whole lifecycle is the main job (`mint run`, `mint_core/main_job.py`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mint_core.data.spec import BUILTIN_DIR, TaskRegistry
from mint_core.engine.base import build_tiny_base, load_base
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.errors import AdapterError
from mint_core.lora.adapter import WEIGHTS_FILE, random_adapter, save_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def demo_prompts() -> list[str]:
    """A held-out prompt of each built-in task (their specs' rows, or their generators' where the data is not
    built)."""
    rows = [spec.heldout_rows()[0].prompt for spec in TaskRegistry.load([BUILTIN_DIR]).specs.values()]
    return [p for p in rows if isinstance(p, str)]


BUILTIN = Path("data/base")


@contextmanager
def step(console: Console, what: str):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    yield
    console.print(f"[green]✓[/] {what} [dim]({time.perf_counter() - t0:.2f} s)[/]")


def run_demo(workdir: Path, n_adapters: int, console: Console) -> None:
    builtin = (BUILTIN / "config.json").is_file()
    if builtin:
        base_dir = BUILTIN
        console.print(f"using the built-in base at {BUILTIN} (pretrained here on the synthetic tasks)")
    else:
        base_dir = workdir / "base"
        with step(
            console, f"no built-in base yet (`dvc repro` builds it): wrote a random tiny base to {base_dir}"
        ):
            tiny = build_tiny_base(
                "dense", seed=0, tokenizer=byte_tokenizer(), hidden_size=128, num_hidden_layers=4
            )
            tiny.model.save_pretrained(base_dir)
            assert tiny.tokenizer is not None
            tiny.tokenizer.save_pretrained(base_dir)

    with step(console, "loaded the base once (frozen, fingerprinted)"):
        engine = Engine(
            load_base(base_dir),
            EngineConfig(max_loras=max(2, n_adapters), max_lora_rank=16, allowed_roots=[workdir]),
        )
    console.print(f"  fingerprint {engine.base.fingerprint[:16]}, {len(engine.sites)} LoRA sites")

    names = [f"policy-{i}" for i in range(n_adapters)]
    ranks = [[2, 4, 8, 16][i % 4] for i in range(n_adapters)]
    with step(console, f"wrote {n_adapters} adapters in PEFT format and loaded them (validated first)"):
        for i, (name, r) in enumerate(zip(names, ranks, strict=True)):
            # small random adapters: each nudges the base differently (trained ones come from `mint train`)
            std = 0.05 if builtin else 0.2
            a = random_adapter(
                engine.sites, TARGETS, r, seed=100 + i, std=std, base_fingerprint=engine.base.fingerprint
            )
            save_adapter(a, workdir / "adapters" / name, engine.sites)
            engine.load_adapter(name, workdir / "adapters" / name)

    bad = workdir / "adapters" / "broken"
    save_adapter(random_adapter(engine.sites, TARGETS, 32, seed=7), bad, engine.sites)
    data = (bad / WEIGHTS_FILE).read_bytes()
    (bad / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    try:
        engine.load_adapter("broken", bad)
    except AdapterError as e:
        console.print(f"[green]✓[/] a bad adapter is refused before anything changes:\n[yellow]{e}[/]")

    params = SamplingParams(max_tokens=12)
    prompts = demo_prompts()
    requests = [Request(prompts[i % len(prompts)], name, params) for i, name in enumerate(names)]
    requests.append(Request(prompts[0], None, params))
    with step(
        console, f"generated {len(requests)} requests with {n_adapters} adapters + the bare base in ONE batch"
    ):
        mixed = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in requests]

    table = Table("adapter", "rank", "revision", "prompt", "answer (greedy)", "same as alone")
    for req, out, ref in zip(requests, mixed, alone, strict=True):
        rank = str(ranks[names.index(req.adapter)]) if req.adapter else "-"
        table.add_row(
            req.adapter or "(base)",
            rank,
            (out.revision or "")[:12],
            str(req.prompt),
            repr(out.text),
            "✓" if out.token_ids == ref.token_ids else "✗",
        )
    console.print(table)
    if not builtin:
        console.print(
            "[dim]The base is random (run `dvc repro` for the built-in one), so answers are noise; what matters is "
            "that each row's answer is its own adapter's and matches running it alone.[/]"
        )
