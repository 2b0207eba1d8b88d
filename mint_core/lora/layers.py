"""Multi-LoRA layers: one base layer, many adapters in stacked slot tensors, chosen per batch row.

Every wrapped layer of a model shares one `LoRAContext`, which holds the slot index of each row of the
batch being run (`-1` = bare base). Slot tensors have one extra, all-zero slot at the end; rows with `-1`
point at it, so a mixed batch needs no branch: gather each row's A and B, then two batched matmuls.
When rows come in long runs of one slot (a training batch sorted by policy, the G samples of a rollout
group) each run instead multiplies by its slot's factors in place, cut to the rank written there: no
per-row copies of the factors (under autograd they were kept for the backward, [B, R, in] per site), no
work for rows on the bare base.
LoRA scaling (alpha / r) is folded into B when a slot is written.

Shapes: S slots (+1 zero slot), R max rank, E experts; `A_SRI` is [S+1, R, in] (PEFT's orientation),
`B_SRO` is [S+1, R, out] (transposed from PEFT's). Those are the layouts the CPU GEMMs run fastest: x A^T with
A row-major [R, in] runs 2.4x faster than x A with A row-major [in, R] at rank 8 (forward, and the gradient
of A 4.5x), while h B runs best with B row-major [R, out].
The banks of one model are views of one storage, [S+1, slot size] (`LoRAModel.slots`): each slot is contiguous,
laid out as `LoRAModel.prepare` lays out a revision in host memory, so loading a revision of rank R over every
site into a slot is one copy (~750 small ones at Qwen3-4B's shape otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mint_core.lora import hostmem
from mint_core.types import EXPERT_PARAMS, Site


class LoRAContext:
    """Which slot each row of the current batch uses; shared by all multi-LoRA layers of one model."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.zero_slot = num_slots
        self.rows: torch.Tensor | None = None  # [B] slot per row, -1 already mapped to zero_slot
        self.any_lora = False
        self._tokens: tuple[int, torch.Tensor] | None = None
        # Each row's A and B, gathered once per batch composition and reused by every decode step (rows keep
        # their slot until the batch changes, and a slot in use is never rewritten). Not used under autograd,
        # where the banks are being trained in place.
        self.gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # (start, stop, slot) of each run of rows that share an adapter slot, bare-base runs left out; None
        # when runs are short (a mixed decode batch) and the per-row gather is cheaper
        self.runs: list[tuple[int, int, int]] | None = None
        # Each run's factors as the no-grad forward multiplies by them (A^T [in, r], B [r, out], views of the
        # bank), made once per batch composition like `gathered`: a decode step then adds each run's LoRA in two
        # matmuls, without the ~10 view and reshape ops per site that slicing the banks again costs.
        self.factors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._key: object = None

    def set_rows(
        self, slots: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu", key: object = None
    ) -> None:
        """Route the next forward: row i uses slot slots[i] (-1: bare base). With the same non-None `key` as the
        previous call (same batch composition), the rows and their gathered factors are kept as they are."""
        if key is not None and key == self._key and self.rows is not None:
            return
        self._key = key
        t = torch.as_tensor(slots, dtype=torch.long, device=device)
        if t.numel() and (int(t.max()) >= self.num_slots or int(t.min()) < -1):
            raise ValueError(f"slot index out of range [-1, {self.num_slots - 1}]: {t.tolist()}")
        self.any_lora = bool((t >= 0).any())
        self.rows = torch.where(t < 0, self.zero_slot, t)
        self._tokens = None
        self.gathered = {}
        self.factors = {}
        self.runs = _runs(t.tolist())

    def clear(self) -> None:
        self._key = None
        self.rows = None
        self.any_lora = False
        self._tokens = None
        self.gathered = {}
        self.factors = {}
        self.runs = None

    def slot_factors(self, bank: _SlotBank, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A^T [in, r] and B [r, out] of `slot` in `bank`, cut to the rank written there (None: nothing written),
        kept for this batch composition. Only for forwards without autograd (the views would hold a graph)."""
        key = (id(bank), slot)
        if key not in self.factors:
            r = bank._rank[slot]
            self.factors[key] = None if r is None else (bank.A[slot, :r].t(), bank.B[slot, :r])
        return self.factors[key]

    def token_slots(self, n_tokens: int) -> torch.Tensor:
        """Slot of each token when a layer sees the batch flattened to [B*T, ...] (MoE experts do)."""
        assert self.rows is not None
        if self._tokens is None or self._tokens[0] != n_tokens:
            per_row = n_tokens // self.rows.numel()
            self._tokens = (n_tokens, self.rows.repeat_interleave(per_row))
        return self._tokens[1]


# Rows per run at which a run's two plain matmuls beat gathering every row's factors for a batched matmul.
MIN_RUN = 8


def _runs(slots: list[int]) -> list[tuple[int, int, int]] | None:
    """The runs of equal slots in `slots` as (start, stop, slot), without bare-base (-1) runs; None when there
    are several runs and they average fewer than MIN_RUN rows."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            runs.append((start, i, slots[start]))
            start = i
    if not slots or (len(runs) > 1 and len(slots) < MIN_RUN * len(runs)):
        return None
    return [r for r in runs if r[2] >= 0]


class _SlotBank(nn.Module):
    """Stacked A/B slot tensors for one site; `lead` is () for a linear and (E,) for an expert parameter."""

    def __init__(
        self,
        site: Site,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """`storage`: zeroed A and B of the shapes below, views of a model's slot storage (`_slot_storage`);
        by default the bank allocates its own."""
        super().__init__()
        self.site = site
        self.max_rank = max_rank
        lead = (site.experts,) if site.experts else ()
        if storage is None:
            storage = (
                torch.zeros(num_slots + 1, *lead, max_rank, site.in_features, dtype=dtype, device=device),
                torch.zeros(num_slots + 1, *lead, max_rank, site.out_features, dtype=dtype, device=device),
            )
        self.A = nn.Parameter(storage[0], requires_grad=False)
        self.B = nn.Parameter(storage[1], requires_grad=False)
        self.filled = 0  # how many slots hold an adapter here; 0 lets the forward skip the site
        # per slot: None (all zero) or the rank written there, so a write touches only what it must: its own
        # columns, plus the columns a previous, higher-rank occupant left (a full zeroing and an `any()` scan
        # made a slot write several passes over max-rank memory)
        self._rank: list[int | None] = [None] * (num_slots + 1)

    @torch.no_grad()
    def write(self, slot: int, A: torch.Tensor, B: torch.Tensor, scale: float) -> None:
        """A: [r, in] or [E, r, in]; B: [out, r] or [E, out, r] (PEFT orientation)."""
        r = A.shape[-2]
        before = self._rank[slot]
        if before is not None and before > r:
            self.A[slot][..., r:before, :].zero_()
            self.B[slot][..., r:before, :].zero_()
        B_slot = self.B[slot][..., :r, :]
        self.A[slot][..., :r, :].copy_(A)
        B_slot.copy_(B.transpose(-1, -2))
        if scale != 1.0:
            B_slot.mul_(scale)
        self._rank[slot] = r
        self.filled += before is None

    def prepare(self, A: torch.Tensor, B: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A revision's factors in slot layout (A [.., r, in], B [.., r, out] with the scale folded in, the bank's
        dtype, contiguous, in host memory), so that putting it into a slot later is one plain copy per factor.

        Both are fresh tensors, so the host cache holds exactly its revision's bytes (an A kept as the view of a
        file read that it often is would keep the whole read buffer alive with it). For CUDA banks both are in
        pinned memory, so the slot write can run without blocking the host (`write_prepared`)."""
        pin = self.A.is_cuda
        A = torch.empty(A.shape, dtype=self.A.dtype, pin_memory=pin).copy_(A.detach())
        B_RO = torch.empty((*B.shape[:-2], B.shape[-1], B.shape[-2]), dtype=self.B.dtype, pin_memory=pin)
        _transpose_into(B_RO, B.detach())
        if scale != 1.0:
            B_RO.mul_(scale)
        return A, B_RO

    def claim(self, slot: int, r: int) -> int:
        """Make `slot` ready for a rank-`r` write (zero the rows a higher-rank occupant left) and record the rank;
        returns `r`. The caller writes rows [:r] of A and B next."""
        before = self._rank[slot]
        if before is not None and before > r:
            self.A[slot][..., r:before, :].zero_()
            self.B[slot][..., r:before, :].zero_()
        self._rank[slot] = r
        if before is None:  # an nn.Module attribute set is slow enough to matter, 252 sites a write
            self.filled += 1
        return r

    @torch.no_grad()
    def write_prepared(self, slot: int, A_RI: torch.Tensor, B_RO: torch.Tensor) -> None:
        """`write` of factors already in slot layout (`prepare`).

        Into CUDA banks the copies do not block the host: they come from pinned memory (`prepare`) and are
        queued on the current stream ahead of any forward that reads the slot, and the caching host allocator
        keeps a pinned block from reuse until copies queued from it have run, even if the host cache drops it."""
        r = self.claim(slot, A_RI.shape[-2])
        async_ = self.A.is_cuda and A_RI.is_pinned() and B_RO.is_pinned()
        self.A[slot][..., :r, :].copy_(A_RI, non_blocking=async_)
        self.B[slot][..., :r, :].copy_(B_RO, non_blocking=async_)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        before = self._rank[slot]
        if before is None:
            return
        self.A[slot][..., :before, :].zero_()
        self.B[slot][..., :before, :].zero_()
        self._rank[slot] = None
        self.filled -= 1

    def read(self, slot: int, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `write`: PEFT-oriented A, B of the first `rank` columns, with scaling taken out."""
        A = self.A[slot][..., :rank, :]
        B = self.B[slot][..., :rank, :].transpose(-1, -2) / scale
        return A.contiguous(), B.contiguous()


def _host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A 1-D host tensor for a revision in slot layout, contents undefined. Pinned memory comes from torch's
    caching host allocator, plain memory from `hostmem` (both reuse blocks nothing refers to any more, instead of
    faulting in fresh pages for every revision)."""
    if pin:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(hostmem.take(numel * itemsize)).view(dtype)


_TRANSPOSE_BLOCK = 64


def _transpose_into(out: torch.Tensor, X: torch.Tensor) -> None:
    """out[.., r, n] = X[.., n, r] in one pass. A plain copy from X's transpose reads and writes one element at a
    time (24 ms for the 17.7 MB of B factors at Qwen3-4B's shape, rank 8, bf16, on one CPU core); viewing n as
    (n / 64, 64) gives it contiguous runs of 64 to write (13 ms)."""
    n, r = X.shape[-2], X.shape[-1]
    if X.is_contiguous() and n % _TRANSPOSE_BLOCK == 0:
        lead = X.shape[:-2]
        blocks = n // _TRANSPOSE_BLOCK
        out.view(*lead, r, blocks, _TRANSPOSE_BLOCK).copy_(
            X.view(*lead, blocks, _TRANSPOSE_BLOCK, r).movedim(-1, -3)
        )
    else:
        out.copy_(X.transpose(-1, -2))


class MultiLoRALinear(nn.Module):
    """An nn.Linear plus per-row LoRA from a slot bank: y = W x + B[slot] A[slot] x."""

    def __init__(self, base: nn.Linear, bank: _SlotBank, ctx: LoRAContext):
        super().__init__()
        self.base_layer = base
        self.bank = bank
        self.ctx = ctx

    @property
    def weight(self) -> torch.Tensor:  # some HF code reads `.weight` of projections (dtype/device checks)
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        out = F.linear(x, base.weight, base.bias)
        ctx = self.ctx
        bank = self.bank
        if not ctx.any_lora or bank.filled == 0:
            return out
        if out._is_view() and torch.is_grad_enabled():
            # with a bias (Qwen2's q/k/v), F.linear on [B, T, in] returns a view of its 2-D addmm; autograd
            # refuses the in-place LoRA adds below on a view of a tensor that needs no grad
            out = out.clone()
        rows = ctx.rows
        assert rows is not None
        if x.dim() == 3 and x.shape[0] == rows.shape[0]:  # [B, T, in], the usual case
            if ctx.runs is not None and not torch.is_grad_enabled():
                return self._runs_no_grad(x, out, ctx.runs)
            if ctx.runs is not None:
                for start, stop, slot in ctx.runs:
                    r = bank._rank[slot]
                    if r is None:  # an empty slot adds nothing
                        continue
                    if stop - start == out.shape[0]:
                        # one run over every row (a policy's update, its rollout's decode): no slices, and
                        # under autograd no copy of a slice back into `out` (CopySlices) and its backward
                        out = out.add_(F.linear(x, bank.A[slot, :r]) @ bank.B[slot, :r])
                    else:
                        h = F.linear(x[start:stop], bank.A[slot, :r])
                        out[start:stop] += h @ bank.B[slot, :r]
                return out
            if torch.is_grad_enabled():
                A_BRI, B_BRO = bank.A.index_select(0, rows), bank.B.index_select(0, rows)
            else:
                pair = ctx.gathered.get(id(bank))
                if pair is None:
                    pair = ctx.gathered[id(bank)] = (
                        bank.A.index_select(0, rows),
                        bank.B.index_select(0, rows),
                    )
                A_BRI, B_BRO = pair
            return torch.baddbmm(out, torch.bmm(x, A_BRI.transpose(1, 2)), B_BRO)
        # tokens flattened to [N, in] (some MoE shared experts): one slot per token
        x2 = x.reshape(-1, x.shape[-1])
        tokens = ctx.token_slots(x2.shape[0])
        h = torch.bmm(x2.unsqueeze(1), bank.A.index_select(0, tokens).transpose(1, 2))
        y = torch.baddbmm(out.reshape(x2.shape[0], 1, -1), h, bank.B.index_select(0, tokens))
        return y.reshape(out.shape)

    def _runs_no_grad(
        self, x: torch.Tensor, out: torch.Tensor, runs: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """`forward`'s runs without autograd (rollouts, serving): each run's rows flattened to [rows * T, in],
        its LoRA added into `out` in place by one addmm over the run's cached factors (`slot_factors`)."""
        steps = x.shape[1]
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        whole = x.shape[0]
        for start, stop, slot in runs:
            factors = self.ctx.slot_factors(self.bank, slot)
            if factors is None:  # an empty slot adds nothing
                continue
            A_IR, B_RO = factors
            if stop - start == whole:
                out2.addmm_(torch.mm(x2, A_IR), B_RO)
            else:
                rows = slice(start * steps, stop * steps)
                out2[rows].addmm_(torch.mm(x2[rows], A_IR), B_RO)
        return out


class MultiLoRAExperts(nn.Module):
    """Fused MoE experts (transformers 5 layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]) with per-token LoRA.

    With no adapter in the batch it defers to the wrapped module (and its fast experts kernel); otherwise it
    runs the reference per-expert loop with each token's own slot added to both projections.
    """

    def __init__(self, base: nn.Module, banks: dict[str, _SlotBank], ctx: LoRAContext):
        super().__init__()
        self.base_layer: Any = base
        self.banks = nn.ModuleDict(banks)
        self.ctx = ctx
        self.num_experts = int(self.base_layer.gate_up_proj.shape[0])  # type: ignore[index]

    def _delta(self, name: str, x: torch.Tensor, slots: torch.Tensor, expert: int) -> torch.Tensor | None:
        if name not in self.banks or self.banks[name].filled == 0:
            return None
        bank: Any = self.banks[name]
        h = torch.bmm(x.unsqueeze(1), bank.A[slots, expert].transpose(1, 2))
        return torch.bmm(h, bank.B[slots, expert]).squeeze(1)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not self.ctx.any_lora or all(b.filled == 0 for b in self.banks.values()):
            return self.base_layer(hidden_states, top_k_index, top_k_weights)
        base: Any = self.base_layer
        token_slots = self.ctx.token_slots(hidden_states.shape[0])
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        for e in hit:
            top_k_pos, token_idx = torch.where(expert_mask[e])
            x = hidden_states[token_idx]
            slots = token_slots[token_idx]
            gate_up = F.linear(x, base.gate_up_proj[e])
            d = self._delta("gate_up_proj", x, slots, e)
            if d is not None:
                gate_up = gate_up + d
            gate, up = gate_up.chunk(2, dim=-1)
            h = base.act_fn(gate) * up
            y = F.linear(h, base.down_proj[e])
            d = self._delta("down_proj", h, slots, e)
            if d is not None:
                y = y + d
            y = y * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final


def _groups(shapes: dict[str, tuple[int, int, int, int]]) -> dict[tuple[int, int, int] | str, list[str]]:
    """Sites grouped for slot layout, from each one's (experts, rank, in, out): linear sites by (rank, in, out),
    in order of first appearance (q, k and v, o, gate and up, down for a decoder layer), each expert site a
    group of its own. A group's A's are one [n, r, in] block of a slot-layout buffer and its B's one
    [n, r, out] block; all A blocks come first, then all B blocks."""
    groups: dict[tuple[int, int, int] | str, list[str]] = {}
    for name, (experts, r, n_in, n_out) in shapes.items():
        groups.setdefault(name if experts else (r, n_in, n_out), []).append(name)
    return groups


def _slot_storage(
    sites: list[Site], num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Zeroed storage for every slot of `sites`, [S+1, slot size], and each site's A [S+1, (E,) R, in] and
    B [S+1, (E,) R, out] as views of it: one slot is contiguous, in the layout `LoRAModel.prepare` gives a
    revision of rank R over every site, so writing such a revision into a slot is one copy."""
    by_name = {s.name: s for s in sites}
    shapes = {s.name: (s.experts, max_rank, s.in_features, s.out_features) for s in sites}
    groups = _groups(shapes)
    size = sum(max(s.experts, 1) * max_rank * (s.in_features + s.out_features) for s in sites)
    slots = torch.zeros(num_slots + 1, size, dtype=dtype, device=device)
    views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    at = 0
    for factor in (0, 1):  # all A's, then all B's
        for names in groups.values():
            for name in names:
                site = by_name[name]
                lead = (site.experts,) if site.experts else ()
                n = site.out_features if factor else site.in_features
                numel = max(site.experts, 1) * max_rank * n
                view = slots[:, at : at + numel].view(num_slots + 1, *lead, max_rank, n)
                views[name] = (views[name][0], view) if factor else (view, view)
                at += numel
    return slots, views


class Prepared(dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """A revision in slot layout, site -> (A [.., r, in], B [.., r, out]), as `LoRAModel.prepare` makes it: every
    factor a view of `flat`, one host buffer (None when prepared site by site)."""

    flat: torch.Tensor | None = None


class LoRAModel:
    """The multi-LoRA view of one base: its context and a slot bank per targeted site."""

    def __init__(
        self,
        ctx: LoRAContext,
        banks: dict[str, _SlotBank],
        max_rank: int,
        slots: torch.Tensor | None = None,
    ):
        """`slots`: the storage the banks' A and B are views of (`_slot_storage`), when they share one."""
        self.ctx = ctx
        self.banks = banks
        self.max_rank = max_rank
        self.slots = slots
        # per bank, for `_in_slot_layout`: its A and B parameters, their byte offsets in a slot and shapes
        Layout = dict[str, tuple[_SlotBank, list[tuple[nn.Parameter, str, int, torch.Size]]]]
        self._layout: Layout = {}
        self._slots_ptr = 0 if slots is None else slots.data_ptr()
        if slots is not None:
            for name, bank in banks.items():
                params = [(bank.A, "A"), (bank.B, "B")]
                self._layout[name] = (
                    bank,
                    [(t, key, t.data_ptr() - self._slots_ptr, t.shape[1:]) for t, key in params],
                )

    @property
    def num_slots(self) -> int:
        return self.ctx.num_slots

    @torch.no_grad()
    def prepare(
        self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """A revision in slot layout (what the host cache keeps: see `_SlotBank.prepare`), in one host buffer.

        Every site's A and B (B transposed, scale folded in) is a view of one contiguous buffer (pinned for CUDA
        banks), all A's first, then all B's, so it holds exactly the revision's bytes and is filled in a few calls
        rather than several per site: linear sites are grouped by shape (a handful of groups: q, k and v, o,
        gate and up, down), and each group's A's are one `cat` into an [n, r, in] block, its B's one transposing
        `cat` into an [n, r, out] block, whose `unbind` gives the sites' views; then one multiply scales all B's.
        At Qwen3-4B's shape (252 sites) that is ~10 calls instead of ~1,500."""
        dtypes = {bank.A.dtype for bank in self.banks.values()}
        if len(dtypes) != 1 or any(t.device.type != "cpu" for pair in tensors.values() for t in pair):
            return {name: self.banks[name].prepare(A, B, scale) for name, (A, B) in tensors.items()}
        (dtype,) = dtypes
        pin = any(bank.A.is_cuda for bank in self.banks.values())
        # in the banks' order, so that a revision of the max rank over every site comes out in a slot's layout
        order = [n for n in self.banks if n in tensors] + [n for n in tensors if n not in self.banks]
        shapes = {}
        for name in order:
            A, B = tensors[name]
            shapes[name] = (A.shape[0] if A.dim() == 3 else 0, A.shape[-2], A.shape[-1], B.shape[-2])
        groups = _groups(shapes)
        n_A = sum(A.numel() for A, _ in tensors.values())
        flat = _host_buffer(n_A + sum(B.numel() for _, B in tensors.values()), dtype, pin)
        A_views: dict[str, torch.Tensor] = {}
        B_views: dict[str, torch.Tensor] = {}
        at_A, at_B = 0, n_A
        for key, names in groups.items():
            if isinstance(key, str):  # experts: A [E, r, in], B [E, out, r] -> [E, r, out]
                name = key
                A, B = tensors[name]
                A_views[name] = flat[at_A : at_A + A.numel()].view(A.shape).copy_(A)
                B_views[name] = flat[at_B : at_B + B.numel()].view(*B.shape[:-2], B.shape[-1], B.shape[-2])
                _transpose_into(B_views[name], B)
                at_A, at_B = at_A + A.numel(), at_B + B.numel()
                continue
            r, n_in, n_out = key
            n = len(names)
            A_NRI = flat[at_A : at_A + n * r * n_in].view(n, r, n_in)
            B_NRO = flat[at_B : at_B + n * r * n_out].view(n, r, n_out)
            torch.cat([tensors[name][0] for name in names], out=A_NRI.view(n * r, n_in))
            torch.cat([tensors[name][1].t() for name in names], out=B_NRO.view(n * r, n_out))
            A_views.update(zip(names, A_NRI.unbind(0), strict=True))
            B_views.update(zip(names, B_NRO.unbind(0), strict=True))
            at_A, at_B = at_A + A_NRI.numel(), at_B + B_NRO.numel()
        if scale != 1.0:
            flat[n_A:].mul_(scale)
        out = Prepared({name: (A_views[name], B_views[name]) for name in tensors})
        out.flat = flat
        return out

    @torch.no_grad()
    def write_prepared(self, slot: int, prepared: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a revision in slot layout (`prepare`) into `slot`, clearing the banks it has no site in.

        On the CPU the copies go in one `_foreach_copy_` call (one Python call instead of a few per site: the
        copies are small, ~40-160 KB each, so per-call overhead was most of the write's time). Into CUDA banks
        each copy is queued without blocking the host (see `_SlotBank.write_prepared`)."""
        flat = getattr(prepared, "flat", None)
        if flat is not None and self._in_slot_layout(prepared, flat):
            assert self.slots is not None
            for bank in self.banks.values():
                bank.claim(slot, bank.max_rank)
            self.slots[slot].copy_(flat, non_blocking=self.slots.is_cuda and flat.is_pinned())
            return
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for name, bank in self.banks.items():
            pair = prepared.get(name)
            A_SRI, B_SRO = bank.A, bank.B
            if pair is None:
                bank.clear(slot)
            elif A_SRI.is_cuda:
                bank.write_prepared(slot, *pair)
            else:
                src += pair
                r = bank.claim(slot, pair[0].shape[-2])
                if r == bank.max_rank:  # the whole slot: a plain index, a third of a slice's cost
                    dst += [A_SRI[slot], B_SRO[slot]]
                else:
                    dst += [A_SRI[slot].narrow(-2, 0, r), B_SRO[slot].narrow(-2, 0, r)]
        if dst:
            torch._foreach_copy_(dst, src)

    def _in_slot_layout(
        self, prepared: dict[str, tuple[torch.Tensor, torch.Tensor]], flat: torch.Tensor
    ) -> bool:
        """Whether copying `flat` whole into a slot of `slots` is what writing each site's factors would do: the
        revision covers every site at the max rank, each factor sits in `flat` where its bank's slot view sits
        in a slot, and the banks still view `slots` (nothing has replaced their parameters or their data)."""
        slots, layout = self.slots, self._layout
        if slots is None or len(prepared) != len(layout) or flat.numel() != slots.shape[1]:
            return False
        if flat.dtype != slots.dtype or flat.device.type != "cpu":
            return False
        src = flat.data_ptr()
        for name, (bank, params) in layout.items():
            pair = prepared.get(name)
            if pair is None or self.banks.get(name) is not bank:
                return False
            for got, (param, key, offset, shape) in zip(pair, params, strict=True):
                if got.data_ptr() - src != offset or got.shape != shape or bank._parameters[key] is not param:
                    return False
                if param.data_ptr() != self._slots_ptr + offset:
                    return False
        return True

    def clear_slot(self, slot: int) -> None:
        for bank in self.banks.values():
            bank.clear(slot)

    def slot_bytes(self) -> int:
        """Device bytes of one slot across all banks."""
        return sum((b.A[0].numel() + b.B[0].numel()) * b.A.element_size() for b in self.banks.values())


def slot_banks(
    sites: Iterable[Site], num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device | str
) -> LoRAModel:
    """The slot banks of `sites` with no model around them: a working set's storage alone, for measuring the
    adapter load path at a real base's shape without holding the base's weights."""
    if num_slots < 1 or max_rank < 1:
        raise ValueError(f"num_slots and max_rank must be >= 1, got {num_slots} and {max_rank}")
    sites = list(sites)
    slots, views = _slot_storage(sites, num_slots, max_rank, dtype, torch.device(device))
    banks = {
        s.name: _SlotBank(s, num_slots, max_rank, dtype, torch.device(device), views[s.name]) for s in sites
    }
    return LoRAModel(LoRAContext(num_slots), banks, max_rank, slots)


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, new)


def inject(model: nn.Module, sites: Iterable[Site], num_slots: int, max_rank: int) -> LoRAModel:
    """Wrap the given sites of a (frozen) HF model with multi-LoRA layers, in place."""
    if num_slots < 1 or max_rank < 1:
        raise ValueError(f"num_slots and max_rank must be >= 1, got {num_slots} and {max_rank}")
    ctx = LoRAContext(num_slots)
    param = next(model.parameters())
    sites = list(sites)
    slots, views = _slot_storage(sites, num_slots, max_rank, param.dtype, param.device)
    banks: dict[str, _SlotBank] = {}
    experts: dict[str, dict[str, _SlotBank]] = {}
    for site in sites:
        bank = _SlotBank(site, num_slots, max_rank, param.dtype, param.device, views[site.name])
        banks[site.name] = bank
        if site.experts:
            experts.setdefault(site.module_path, {})[site.short] = bank
        else:
            module = model.get_submodule(site.name)
            if not isinstance(module, nn.Linear):
                raise TypeError(f"site {site.name} is {type(module).__name__}, not nn.Linear")
            _set_submodule(model, site.name, MultiLoRALinear(module, bank, ctx))
    for path, module_banks in experts.items():
        module = model.get_submodule(path)
        missing = [p for p in EXPERT_PARAMS if not hasattr(module, p)] + (
            [] if hasattr(module, "act_fn") else ["act_fn"]
        )
        if missing or getattr(module, "has_bias", False):
            raise TypeError(
                f"experts module {path} ({type(module).__name__}) has an unsupported layout: missing {missing}"
            )
        _set_submodule(model, path, MultiLoRAExperts(module, module_banks, ctx))
    return LoRAModel(ctx, banks, max_rank, slots)
