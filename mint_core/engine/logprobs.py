"""Log-probabilities of chosen tokens, without a float32 copy of the logits kept for backward.

`log_softmax(logits.float()).gather(target)` keeps, for backward, a float32 tensor as large as the logits (and
first makes a float32 copy of bfloat16 logits). At a 151,936-token vocabulary that is 0.6 MB per position: an
update over 32 rows of 256 tokens would hold 5 GB for it alone.

- `selected_logprobs` keeps only the logits, in their own dtype, and one float per logits row (its log-sum-exp);
  the softmax is recomputed chunk by chunk in backward.
- `head_logprobs` also fuses the output projection in: it takes the hidden states and the head's weight, and
  makes the logits a chunk of rows at a time, in forward and again in backward, so no [positions, vocab] tensor
  exists at all (at the price of one more projection).

Values and gradients are those of log_softmax + gather computed in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows per chunk are chosen so that one chunk's float32 temporaries stay near this many elements (64 MB).
CHUNK_ELEMENTS = 1 << 24


def _chunks(n_rows: int, vocab: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return [(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]


def log_normalizer(logits: Tensor) -> Tensor:
    """float32 logsumexp over the last dimension, a chunk of rows at a time (no float32 copy of all the logits):
    log_softmax(logits) = logits - log_normalizer(logits)[..., None]. No gradient."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for a, b in _chunks(flat.shape[0], flat.shape[1]):
        out[a:b] = torch.logsumexp(flat[a:b].float(), dim=-1)
    return out.view(logits.shape[:-1])


def _dlogits(
    logits_cV: Tensor, a: int, lse_N: Tensor, g_N: Tensor, rows_M: Tensor, targets_M: Tensor, grad_M: Tensor
) -> Tensor:
    """The gradient of sum_m grad_M[m] * lp_M[m] with respect to the float32 logits of rows a .. a + c:
    d lp_m / d logits[r, v] = [r = rows_m] ([v = targets_m] - softmax(logits[r])[v]); g_N[r] is the sum of
    grad_M over the reads of row r."""
    b = a + logits_cV.shape[0]
    d = torch.exp(logits_cV - lse_N[a:b, None]).mul_(-g_N[a:b, None])
    here = (rows_M >= a) & (rows_M < b)
    return d.index_put_((rows_M[here] - a, targets_M[here]), grad_M[here], accumulate=True)


def _read_sums(n_rows: int, rows_M: Tensor, grad_M: Tensor) -> Tensor:
    return torch.zeros(n_rows, dtype=torch.float32, device=grad_M.device).index_add_(0, rows_M, grad_M)


def _check_reads(rows_M: Tensor, targets_M: Tensor) -> None:
    if rows_M.shape != targets_M.shape or rows_M.ndim != 1:
        raise ValueError(
            f"rows and targets must be 1-D and alike, got {tuple(rows_M.shape)} and {tuple(targets_M.shape)}"
        )


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_NV: Tensor, rows_M: Tensor, targets_M: Tensor) -> Tensor:
        lse_N = log_normalizer(logits_NV)
        ctx.save_for_backward(logits_NV, rows_M, targets_M, lse_N)
        return logits_NV[rows_M, targets_M].float() - lse_N[rows_M]

    @staticmethod
    def backward(ctx: Any, grad_M: Tensor) -> tuple[Tensor, None, None]:
        logits_NV, rows_M, targets_M, lse_N = ctx.saved_tensors
        N, V = logits_NV.shape
        grad_M = grad_M.float()
        g_N = _read_sums(N, rows_M, grad_M)
        grad_NV = torch.empty_like(logits_NV)
        for a, b in _chunks(N, V):
            grad_NV[a:b] = _dlogits(logits_NV[a:b].float(), a, lse_N, g_N, rows_M, targets_M, grad_M)
        return grad_NV, None, None


def selected_logprobs(logits_NV: Tensor, rows_M: Tensor, targets_M: Tensor) -> Tensor:
    """float32 [M]: log softmax(logits_NV[rows_M[m]])[targets_M[m]]. A logits row may be read by several m
    (a prompt's last position, read by every completion of its group)."""
    if logits_NV.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits_NV.shape)}")
    _check_reads(rows_M, targets_M)
    out: Tensor = _SelectedLogprobs.apply(logits_NV, rows_M, targets_M)
    return out


def token_logprobs(logits_BTV: Tensor, ids_BT: Tensor) -> Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position: float32 [B, T-1]."""
    B, T, V = logits_BTV.shape
    dev = logits_BTV.device
    rows = (torch.arange(B, device=dev)[:, None] * T + torch.arange(T - 1, device=dev)).reshape(-1)
    lp = selected_logprobs(logits_BTV.reshape(B * T, V), rows, ids_BT[:, 1:].reshape(-1))
    return lp.view(B, T - 1)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h_KH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, rows_M: Tensor, targets_M: Tensor
    ) -> Tensor:
        K, V = h_KH.shape[0], weight_VH.shape[0]
        lse_K = torch.empty(K, dtype=torch.float32, device=h_KH.device)
        lp_M = torch.empty(rows_M.shape, dtype=torch.float32, device=h_KH.device)
        for a, b in _chunks(K, V):
            logits = F.linear(h_KH[a:b], weight_VH, bias_V).float()
            lse_K[a:b] = torch.logsumexp(logits, dim=-1)
            here = (rows_M >= a) & (rows_M < b)
            lp_M[here] = logits[rows_M[here] - a, targets_M[here]] - lse_K[rows_M[here]]
        ctx.save_for_backward(h_KH, weight_VH, bias_V, rows_M, targets_M, lse_K)
        return lp_M

    @staticmethod
    def backward(ctx: Any, grad_M: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        h_KH, weight_VH, bias_V, rows_M, targets_M, lse_K = ctx.saved_tensors
        K, V = h_KH.shape[0], weight_VH.shape[0]
        grad_M = grad_M.float()
        g_K = _read_sums(K, rows_M, grad_M)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h_KH) if need_h else None
        grad_w = torch.zeros_like(weight_VH, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(V, dtype=torch.float32, device=h_KH.device) if need_b else None
        for a, b in _chunks(K, V):
            logits = F.linear(h_KH[a:b], weight_VH, bias_V).float()  # the chunk's logits again
            d = _dlogits(logits, a, lse_K, g_K, rows_M, targets_M, grad_M)
            if grad_h is not None:
                grad_h[a:b] = d.to(weight_VH.dtype) @ weight_VH
            if grad_w is not None:
                grad_w += d.T @ h_KH[a:b].float()
            if grad_b is not None:
                grad_b += d.sum(dim=0)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight_VH.dtype),
            None if grad_b is None else grad_b.to(bias_V.dtype),
            None,
            None,
        )


def head_logprobs(
    h_KH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, rows_M: Tensor, targets_M: Tensor
) -> Tensor:
    """float32 [M]: log softmax(h_KH[rows_M[m]] @ weight_VH.T + bias_V)[targets_M[m]], the output projection
    fused in: its logits are made a chunk of rows at a time, in forward and again in backward, so no [K, V]
    tensor exists at any moment (one more projection's worth of work for that). The gradient reaches h (and the
    weight and bias if they train)."""
    if h_KH.ndim != 2 or weight_VH.ndim != 2 or h_KH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden states [rows, H] and a head weight [vocab, H] are needed, got {tuple(h_KH.shape)} "
            f"and {tuple(weight_VH.shape)}"
        )
    _check_reads(rows_M, targets_M)
    out: Tensor = _HeadLogprobs.apply(h_KH, weight_VH, bias_V, rows_M, targets_M)
    return out
