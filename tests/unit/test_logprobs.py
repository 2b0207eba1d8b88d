"""Selective log-softmax: the values and gradients of log_softmax + gather, without its float32 copy."""

from __future__ import annotations

import pytest
import torch

from mint_core.engine import logprobs
from mint_core.engine.logprobs import selected_logprobs, token_logprobs


def reference(logits_NV: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_NV.float(), dim=-1)[rows, targets]


@pytest.mark.parametrize(
    "chunk_elements", [1 << 24, 3 * 97]
)  # one chunk; many chunks of 3 rows (and a ragged one)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_log_softmax(monkeypatch, chunk_elements, dtype):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    N, V = 10, 97
    base = (torch.randn(N, V, generator=g) * 3).to(dtype)
    # row 4 is read three times (a prompt's last position, read by each completion of its group), row 7 never
    rows = torch.tensor([0, 1, 2, 3, 4, 4, 4, 5, 6, 8, 9])
    targets = torch.randint(0, V, rows.shape, generator=g)
    upstream = torch.randn(rows.shape, generator=g)

    got_in = base.clone().requires_grad_(True)
    got = selected_logprobs(got_in, rows, targets)
    (got * upstream).sum().backward()
    want_in = base.clone().requires_grad_(True)
    want = reference(want_in, rows, targets)
    (want * upstream).sum().backward()

    assert got.dtype == torch.float32
    tol = 1e-6 if dtype == torch.float32 else 1e-5
    assert torch.allclose(got, want, atol=tol, rtol=0)
    assert got_in.grad is not None and want_in.grad is not None
    assert got_in.grad.dtype == dtype
    gtol = 1e-6 if dtype == torch.float32 else 2e-2  # the gradient is rounded to the logits' dtype once
    assert torch.allclose(got_in.grad.float(), want_in.grad.float(), atol=gtol, rtol=0)
    assert got_in.grad[7].abs().sum() == 0  # a row nobody reads gets no gradient


def test_token_logprobs_is_next_token_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    got = token_logprobs(logits, ids)
    want = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == (3, 5)
    assert torch.allclose(got, want, atol=1e-6)
    (ga,) = torch.autograd.grad(got.sum(), logits)
    (gb,) = torch.autograd.grad(want.sum(), logits)
    assert torch.allclose(ga, gb, atol=1e-6)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"logits must be \[rows, vocab\]"):
        selected_logprobs(torch.zeros(2, 3, 4), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows and targets"):
        selected_logprobs(torch.zeros(2, 4), torch.tensor([0, 1]), torch.tensor([0]))


@pytest.mark.parametrize("chunk_elements", [1 << 24, 2 * 53])  # one chunk; chunks of 2 rows
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_matches_projection_then_log_softmax(monkeypatch, chunk_elements, bias, dtype):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(2)
    K, H, V = 7, 16, 53
    h0 = torch.randn(K, H, generator=g).to(dtype)
    w0 = (torch.randn(V, H, generator=g) / 2).to(dtype)
    b0 = torch.randn(V, generator=g).to(dtype) if bias else None
    rows = torch.tensor([0, 1, 1, 1, 2, 4, 5, 6])  # row 1 read three times, row 3 never
    targets = torch.randint(0, V, rows.shape, generator=g)
    upstream = torch.randn(rows.shape, generator=g)

    def leaves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return (
            h0.clone().requires_grad_(True),
            w0.clone().requires_grad_(True),
            None if b0 is None else b0.clone().requires_grad_(True),
        )

    h, w, b = leaves()
    got = logprobs.head_logprobs(h, w, b, rows, targets)
    (got * upstream).sum().backward()
    h2, w2, b2 = leaves()
    want = reference(torch.nn.functional.linear(h2, w2, b2), rows, targets)
    (want * upstream).sum().backward()

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=0)
    for x, y in ((h, h2), (w, w2), (b, b2)):
        if x is None:
            continue
        assert x.grad is not None and y is not None and y.grad is not None
        assert x.grad.dtype == dtype
        scale = float(y.grad.float().abs().max())
        assert torch.allclose(x.grad.float(), y.grad.float(), atol=tol * max(scale, 1.0), rtol=0)
    assert h.grad is not None and h.grad[3].abs().sum() == 0


def test_fused_head_leaves_a_frozen_head_without_gradient():
    h = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4)  # frozen, as the base's head is
    lp = logprobs.head_logprobs(h, w, None, torch.tensor([0, 2]), torch.tensor([1, 4]))
    lp.sum().backward()
    assert w.grad is None and h.grad is not None and h.grad[1].abs().sum() == 0
    with pytest.raises(ValueError, match="head weight"):
        logprobs.head_logprobs(
            torch.zeros(3, 4), torch.zeros(5, 3), None, torch.tensor([0]), torch.tensor([0])
        )


def test_log_normalizer_is_logsumexp_over_the_vocabulary(monkeypatch):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 40)  # chunks of 2 rows of 17
    x = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = logprobs.log_normalizer(x)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    assert torch.allclose(got, torch.logsumexp(x.float(), dim=-1), atol=1e-6)
