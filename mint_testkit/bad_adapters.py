"""Adapters broken one way each, for the serving contract's refusals and the bad-adapter benchmark: every function
takes a healthy adapter directory as mint writes it (PEFT's format, rank `RANK` on `TARGETS` of the tiny dense
base, whose hidden size is 64 over 2 layers) and breaks it in place."""

from __future__ import annotations

import json
import pickle
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mint_core.lora.adapter import CONFIG_FILE, FINGERPRINT_KEY, WEIGHTS_FILE

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
"""The first layer's q_proj, as PEFT names its tensors: where a single bad value goes."""


class Payload:
    """Unpickling this creates the file `marker`: proof that a server unpickled the adapter (or, as the contract
    asserts, that it did not)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def edit_weights(
    d: Path, edit: Callable[[dict[str, torch.Tensor]], None], metadata: dict[str, str] | None = None
) -> None:
    """Rewrite the adapter's tensors through `edit` (in place on the dict), its header metadata kept and updated
    with `metadata`."""
    with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
        meta = dict(f.metadata() or {})
    state = {k: v.clone() for k, v in load_file(str(d / WEIGHTS_FILE)).items()}
    edit(state)
    save_file(state, str(d / WEIGHTS_FILE), metadata={**meta, **(metadata or {})})


def edit_config(d: Path, **changes: object) -> None:
    config = json.loads((d / CONFIG_FILE).read_text())
    config.update(changes)
    (d / CONFIG_FILE).write_text(json.dumps(config))


def nan_value(d: Path, matrix: str = "lora_A") -> None:
    """One NaN in `Q0`'s `matrix` (lora_A or lora_B)."""

    def edit(state: dict[str, torch.Tensor]) -> None:
        state[f"{Q0}.{matrix}.weight"][0, 0] = float("nan")

    edit_weights(d, edit)


def nan_everywhere(d: Path) -> None:
    def edit(state: dict[str, torch.Tensor]) -> None:
        for t in state.values():
            t.fill_(float("nan"))

    edit_weights(d, edit)


def shape_mismatch(d: Path) -> None:
    """`Q0`'s lora_A one input column short: A(RANK, 63) against a 64-wide base."""

    def edit(state: dict[str, torch.Tensor]) -> None:
        state[f"{Q0}.lora_A.weight"] = state[f"{Q0}.lora_A.weight"][:, :-1].contiguous()

    edit_weights(d, edit)


def rank_above_max(d: Path, rank: int = 32) -> None:
    """Config and tensors agree on r=`rank`: the only problem is the server's max rank (16)."""
    g = torch.Generator().manual_seed(5)

    def edit(state: dict[str, torch.Tensor]) -> None:
        for k, t in state.items():
            shape = (rank, t.shape[1]) if ".lora_A." in k else (t.shape[0], rank)
            state[k] = torch.randn(*shape, generator=g) * 0.3

    edit_weights(d, edit)
    edit_config(d, r=rank, lora_alpha=2 * rank)


def other_base(d: Path, fingerprint: str) -> None:
    """Same shapes, recorded (in the safetensors metadata, as mint writes it) as made for the base `fingerprint`."""
    edit_weights(d, lambda state: None, {FINGERPRINT_KEY: fingerprint})


def without_fingerprint(d: Path) -> None:
    """The adapter as PEFT writes it: no base fingerprint in the safetensors header."""
    with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k != FINGERPRINT_KEY}
    save_file(load_file(str(d / WEIGHTS_FILE)), str(d / WEIGHTS_FILE), metadata=meta)


def pickle_weights(d: Path, marker: Path) -> None:
    """The weights only as a pickle (`adapter_model.bin`) that touches `marker` when unpickled."""
    (d / WEIGHTS_FILE).unlink()
    (d / "adapter_model.bin").write_bytes(pickle.dumps(Payload(marker)))


def pickle_beside(d: Path, marker: Path, name: str = "adapter.pt") -> Path:
    """A pickle-based checkpoint `name` beside the healthy files (touches `marker` when unpickled); its path."""
    (d / name).write_bytes(pickle.dumps(Payload(marker)))
    return d / name


def truncated(d: Path) -> None:
    data = (d / WEIGHTS_FILE).read_bytes()
    (d / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])


def garbage_header(d: Path) -> None:
    """The safetensors header's bytes replaced by random ones of the same length."""
    data = (d / WEIGHTS_FILE).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    (d / WEIGHTS_FILE).write_bytes(data[:8] + random.Random(0).randbytes(n) + data[8 + n :])


def layer_not_in_base(d: Path) -> None:
    """Layer 9's q_proj: a module type the base has, at a place it lacks (it has 2 layers)."""

    def edit(state: dict[str, torch.Tensor]) -> None:
        layer9 = "base_model.model.model.layers.9.self_attn.q_proj"
        state[f"{layer9}.lora_A.weight"] = torch.full((RANK, 64), 0.3)
        state[f"{layer9}.lora_B.weight"] = torch.full((64, RANK), 0.3)

    edit_weights(d, edit)


def module_unknown(d: Path) -> None:
    """An x_proj: a module type the base does not have at all (named in the config's target_modules too)."""

    def edit(state: dict[str, torch.Tensor]) -> None:
        bogus = "base_model.model.model.layers.0.self_attn.x_proj"
        state[f"{bogus}.lora_A.weight"] = torch.full((RANK, 64), 0.3)
        state[f"{bogus}.lora_B.weight"] = torch.full((64, RANK), 0.3)

    edit_weights(d, edit)
    edit_config(d, target_modules=[*TARGETS, "x_proj"])


def missing_config(d: Path) -> None:
    (d / CONFIG_FILE).unlink()


def dora_config(d: Path) -> None:
    edit_config(d, use_dora=True)
