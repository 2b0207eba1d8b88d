"""The one device switch: where the base, the engine's slot banks and the trainer live (cpu, cuda, cuda:N).

Every entry point (`mint serve --device`, `mint train --device`, the main job's `device`, the benchmarks'
`--device`) checks its value here before it loads anything, so a machine without the GPU asked for is told so at
once, and the rest follows the base: the engine allocates its slots where the base's weights are, the trainer
its batches and optimizer state where the slots are.
"""

from __future__ import annotations

import os

import torch

from mint_core.errors import MintError
from mint_core.types import parse_device


class DeviceError(MintError, ValueError):
    """A device that is not cpu, cuda or cuda:N, or a CUDA device this process cannot see; names the setting."""


def check_device(name: str, what: str = "device") -> torch.device:
    """`name` as a torch device; `DeviceError` naming `what` (the flag or field it came from) and the value when
    it is no device, or a CUDA device that is not visible here."""
    try:
        parse_device(name)
    except ValueError as e:
        raise DeviceError(f"{what} {e}") from None
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise DeviceError(
                f"{what} {name}: no CUDA device is visible (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda or 'none'}; CUDA_VISIBLE_DEVICES="
                f"{'unset' if visible is None else repr(visible)})"
            )
        count = torch.cuda.device_count()
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            raise DeviceError(f"{what} {name}: {count} CUDA device(s) visible, cuda:0 to cuda:{count - 1}")
    return torch.device(name)
