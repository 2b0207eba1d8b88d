"""LoRA on vLLM's CPU backend as one matrix product per adapter in the batch, instead of one per token.

vLLM's CPU backend applies LoRA with its PyTorch-native punica ops (`vllm.lora.ops.torch_ops`). Each call gathers
the adapter weights of every token (`weights[indices]`: for a 480-token prefill through a 256 x 1376 layer, 21 MB
copied) and multiplies token by token (`einsum("bi, boi -> bo")`). Profiled under an evaluation (lm-eval through
vLLM, one adapter), those two lines were 60% of vLLM's worker process.

This module replaces the six ops with ones that do, for each adapter slot present in the batch, one product of
that slot's rows with its weights (one product for the whole batch when every token has the same slot, the usual
case: an evaluation, one policy's canary traffic). The arithmetic per row is the same `x @ W^T`; only how rows are
grouped changes. A token whose index is -1 gets no LoRA, as vLLM's punica contract says ("-1 means no lora should
be applied"); the native ops index slot -1, the last one, instead. Shapes the grouped ops do not expect (fewer
output rows than tokens, which the native expand broadcasts) go to the native op unchanged.

Enabled by the `vllm.general_plugins` entry point `mint_lora_cpu`, which vLLM loads in each of its processes
before the model: on the CPU platform only, and not when MINT_VLLM_NATIVE_LORA is set (a way back to vLLM's own
ops). It imports nothing of mint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)
NAME = "mint_lora_cpu"
OFF_ENV = "MINT_VLLM_NATIVE_LORA"

Groups = list[tuple[int, torch.Tensor | None]]


def groups(indices: torch.Tensor) -> Groups:
    """(slot, rows) for every adapter slot among `indices` (rows None: every row has that slot); -1 is no slot."""
    if indices.numel() == 0:
        return []
    lo, hi = torch.aminmax(indices)
    first, last = int(lo), int(hi)
    if first == last:
        return [] if first < 0 else [(first, None)]
    return [(s, (indices == s).nonzero().squeeze(1)) for s in torch.unique(indices).tolist() if s >= 0]


def _weights(stacked: torch.Tensor) -> torch.Tensor:
    """[slots, out, in] from vLLM's [slots, 1, out, in] (or already 3-D)."""
    return stacked.squeeze(1) if stacked.dim() == 4 else stacked


def _product(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    part = x if rows is None else x.index_select(0, rows)
    return part.to(dtype) @ w.to(dtype).t()


def _write(out: torch.Tensor, rows: torch.Tensor | None, y: torch.Tensor, add: bool) -> None:
    """out[rows] (+)= y, `out` a column slice of the output."""
    if rows is None:
        out.add_(y) if add else out.copy_(y)
    elif add:
        out.index_add_(0, rows, y)
    else:
        out.index_copy_(0, rows, y)


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """output[:, :rank] = scaling * inputs @ A[slot]^T, row by row's slot (0 for a row without one)."""
    w = _weights(lora_b_weights)
    n = lora_indices_tensor.shape[0]
    if inputs.shape[0] != n or output_tensor.shape[0] != n:
        return _native["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    out = output_tensor[:, : w.shape[1]]
    found = groups(lora_indices_tensor)
    if not (len(found) == 1 and found[0][1] is None):
        out.zero_()
    for slot, rows in found:
        y = _product(inputs, w[slot], rows, output_tensor.dtype)
        _write(out, rows, y.mul_(scaling), add=False)
    return None


def _expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    start: int,
    width: int,
    add_inputs: bool,
) -> None:
    """output[:, start:start+width] (+)= (inputs @ B[slot]^T)[:, :width], row by row's slot."""
    w = _weights(lora_b_weights)
    out = output_tensor[:, start : start + width]
    found = groups(lora_indices_tensor)
    if not add_inputs and not (len(found) == 1 and found[0][1] is None):
        out.zero_()
    for slot, rows in found:
        y = _product(inputs, w[slot, :width], rows, output_tensor.dtype)
        _write(out, rows, y, add=add_inputs)


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    n = lora_indices_tensor.shape[0]
    if inputs.shape[0] != n or output_tensor.shape[0] != n:
        return _native["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    width = min(_weights(lora_b_weights).shape[1], output_tensor.shape[1])
    _expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, width, add_inputs)
    return None


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    n = lora_indices_tensor.shape[0]
    if inputs.shape[0] != n or output_tensor.shape[0] != n or _weights(lora_b_weights).shape[1] != slice_size:
        return _native["bgmv_expand_slice"](
            inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs
        )
    _expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs)
    return None


def _explode(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    bgmv_expand(
        inputs, lora_b_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor), add_inputs
    )


def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    bgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        _explode(lora_indices_tensor, seq_len_tensor),
        slice_offset,
        slice_size,
        add_inputs,
    )


OPS: dict[str, Callable[..., Any]] = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
    "sgmv_shrink": sgmv_shrink,
    "sgmv_expand": sgmv_expand,
    "sgmv_expand_slice": sgmv_expand_slice,
}
_native: dict[str, Callable[..., Any]] = {}


def install() -> bool:
    """Put the grouped ops where vLLM's CPU punica wrapper calls them (idempotent); False when vLLM lacks them."""
    import importlib

    try:
        ops = importlib.import_module("vllm.lora.ops.torch_ops.lora_ops")
        package = importlib.import_module("vllm.lora.ops.torch_ops")
        punica = importlib.import_module("vllm.lora.punica_wrapper.punica_cpu")
    except ImportError as e:
        logger.warning("mint lora ops: vLLM's CPU LoRA ops not found (%s); vLLM's own stay", e)
        return False
    if not all(callable(getattr(ops, name, None)) for name in OPS):
        logger.warning("mint lora ops: vLLM's torch_ops lack one of %s; vLLM's own stay", sorted(OPS))
        return False
    for name, fn in OPS.items():
        current = getattr(ops, name)
        if current is not fn:
            _native[name] = current
        for module in (ops, package, punica):
            if hasattr(module, name):
                setattr(module, name, fn)
    return True


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: install the grouped ops on the CPU platform."""
    if os.environ.get(OFF_ENV):
        return
    try:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    except Exception as e:  # a platform vLLM cannot detect: leave its ops alone
        logger.warning("mint lora ops: vLLM's platform unknown (%s); vLLM's own ops stay", e)
        return
    if on_cpu and install():
        logger.info("mint lora ops: LoRA grouped by adapter slot on the CPU (%s)", ", ".join(sorted(OPS)))
