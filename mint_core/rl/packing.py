"""Packing an update's rows that share a prompt: one sequence per distinct (slot, prompt), behind a block mask.

The G rows of a group repeat one prompt under one slot, so the update packs them: the prompt once, then the
completions of its rows one after another, each completion attending to the prompt and to its own earlier
tokens only, at the positions it had in its own row. The prompt's forward and backward are paid once per group,
not G times, with no copies of its keys and values, and the logprobs and gradients are those of the full rows
(`tests/unit/test_trainer.py` holds them equal). Sequences of similar length share a forward (`PACK_FILL`).

This module builds the packed inputs and says where each completion token's logits come out; the trainer runs
the forwards (`MultiPolicyTrainer._logprobs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# A sequence joins the current bucket (padded to the bucket's longest) while it is at least this fraction of
# that length; shorter ones start a new bucket.
PACK_FILL = 0.75


@dataclass
class Bucket:
    """One forward of the packed update: sequences of similar width, right-padded to the longest, on the host."""

    sequences: list[int]
    """The packed sequences it holds, in row order."""
    ids: torch.Tensor  # [b, w]
    positions: torch.Tensor  # [b, w] each token's position in its own row
    mask: torch.Tensor  # [b, 1, w, w] bool: which keys each query sees
    keep: torch.Tensor  # [b, w] bool: the positions whose logits some completion token reads


@dataclass
class Packing:
    """The packed layout of an update's rows: `sequences[u]` the ids of packed sequence u (its prompt, then the
    first m - 1 tokens of each of its rows' completions of m tokens: the last is only a target)."""

    slots: list[int]
    """Each packed sequence's slot."""
    seq_of_row: list[int]
    """Each row's packed sequence."""
    prompt_lens: list[int]
    comp_lens: list[int]
    sequences: list[list[int]] = field(default_factory=list)
    positions: list[list[int]] = field(default_factory=list)
    segments: list[list[int]] = field(default_factory=list)
    """Per token, -1 for the prompt, else the row its completion belongs to."""
    reads: list[list[int]] = field(default_factory=list)
    """Per row, where in its sequence the logits of each of its completion tokens are: for token 0 the prompt's
    last position, for token j its input j - 1."""
    _where: dict[int, torch.Tensor] = field(default_factory=dict)
    """Packed sequence -> the rows of its positions in the kept outputs of all buckets (see `buckets`)."""

    @classmethod
    def plan(
        cls, ids: torch.Tensor, lens: list[int], slots: list[int], prompt_lens: list[int]
    ) -> Packing | None:
        """The packing of rows `ids` [B, T] (on the host) of `lens` tokens each, row i under slots[i] with a
        prompt of prompt_lens[i] tokens; None when packing saves nothing (no two rows share a prompt, or every
        row shares one with every other and has an empty completion)."""
        keys: dict[tuple[int, tuple[int, ...]], int] = {}  # (slot, prompt) -> its packed sequence
        inv: list[int] = []
        comp_lens: list[int] = []
        for i, (slot, p_len) in enumerate(zip(slots, prompt_lens, strict=True)):
            inv.append(keys.setdefault((slot, tuple(ids[i, :p_len].tolist())), len(keys)))
            comp_lens.append(int(lens[i]) - p_len)
        if len(keys) in (0, len(slots)) or max(comp_lens) == 0:
            return None
        packing = cls([s for s, _ in keys], inv, list(prompt_lens), comp_lens)
        packing.sequences = [list(p) for _, p in keys]
        packing.positions = [list(range(len(p))) for _, p in keys]
        packing.segments = [[-1] * len(p) for _, p in keys]
        for i, u in enumerate(inv):
            p_len, m = prompt_lens[i], comp_lens[i]
            at = len(packing.sequences[u])
            packing.sequences[u].extend(ids[i, p_len : p_len + m - 1].tolist())
            packing.positions[u].extend(range(p_len, p_len + m - 1))
            packing.segments[u].extend([i] * (m - 1))
            packing.reads.append([p_len - 1, *range(at, at + m - 1)][:m])  # none for an empty completion
        return packing

    def sequence_reads(self) -> list[list[int]]:
        """Per packed sequence, the positions any of its rows reads."""
        out: list[list[int]] = [[] for _ in self.sequences]
        for u, where in zip(self.seq_of_row, self.reads, strict=True):
            out[u].extend(where)
        return out

    def kept_positions(self) -> int:
        """How many positions' logits the update needs, over all sequences."""
        return sum(len(set(r)) for r in self.sequence_reads())

    def bucket_order(self) -> list[list[int]]:
        """The packed sequences in buckets of similar width, longest first. Sequences of one policy are about as
        long as each other, but policies on different tasks are not (8 short answers against 8 long ones), so
        one forward padded to the longest would waste much of its work (one autograd graph holds every
        bucket, so one backward still covers all)."""
        order = sorted(range(len(self.sequences)), key=lambda u: -len(self.sequences[u]))
        buckets: list[list[int]] = []
        for u in order:
            if buckets and len(self.sequences[u]) >= PACK_FILL * len(self.sequences[buckets[-1][0]]):
                buckets[-1].append(u)
            else:
                buckets.append([u])
        return buckets

    def buckets(self, pad_id: int) -> Iterator[Bucket]:
        """Each bucket's inputs, in `bucket_order`; the kept outputs of the forwards, concatenated in this order,
        are what `targets` indexes."""
        seq_reads = self.sequence_reads()
        kept = 0
        for bucket in self.bucket_order():
            width = len(self.sequences[bucket[0]])
            ids = torch.full((len(bucket), width), pad_id, dtype=torch.long)
            pos = torch.zeros((len(bucket), width), dtype=torch.long)
            seg_t = torch.full((len(bucket), width), -2, dtype=torch.long)  # -2: padding
            keep = torch.zeros((len(bucket), width), dtype=torch.bool)
            for j, u in enumerate(bucket):
                k = len(self.sequences[u])
                ids[j, :k] = torch.tensor(self.sequences[u])
                pos[j, :k] = torch.tensor(self.positions[u])
                seg_t[j, :k] = torch.tensor(self.segments[u])
                keep[j, seq_reads[u]] = True
            index = torch.full((len(bucket), width), -1, dtype=torch.long)
            n_kept = int(keep.sum())
            index[keep] = torch.arange(kept, kept + n_kept)
            kept += n_kept
            for j, u in enumerate(bucket):
                self._where[u] = index[j]
            # a query sees earlier keys of the prompt and of its own completion; padding sees earlier padding
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            mask = causal & ((seg_t[:, None, :] == -1) | (seg_t[:, None, :] == seg_t[:, :, None]))
            yield Bucket(bucket, ids, pos, mask[:, None], keep)

    def targets(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every completion token of every row (after `buckets` ran): the row of the kept outputs that predicts
        it, the token, and where it goes in the full rows' layout (completion token j of row i is target
        prompt_len - 1 + j): rows_M, targets_M, row_of_M, col_of_M, on the host."""
        rows_M = torch.cat(
            [self._where[u][where] for u, where in zip(self.seq_of_row, self.reads, strict=True)]
        )
        lens = zip(self.prompt_lens, self.comp_lens, strict=True)
        targets_M = torch.cat([ids[i, p : p + m] for i, (p, m) in enumerate(lens)])
        row_of_M = torch.repeat_interleave(torch.arange(len(self.seq_of_row)), torch.tensor(self.comp_lens))
        col_of_M = torch.cat(
            [torch.arange(p - 1, p - 1 + m) for p, m in zip(self.prompt_lens, self.comp_lens, strict=True)]
        )
        return rows_M, targets_M, row_of_M, col_of_M
