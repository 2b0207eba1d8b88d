"""A KV cache for continuous batching: rows join, leave and are aligned on the left.

transformers' DynamicLayer concatenates on every step, copying the whole cache each time (quadratic in
length). `RaggedLayer` keeps keys and values in a buffer with room on the right, writes each step in place
and hands attention a view of the filled part. Rows of different lengths share the buffer left-padded (the
attention mask hides the padding), so a sequence can join a running batch between two decode steps:
`join` pads the shorter side on the left and stacks the rows; `select` drops finished rows; `trim_left`
drops leading columns that every row pads.

DSA layers (DeepSeek-V3.2's sparse attention) also cache the lightning indexer's keys, [B, T, D] beside the
attention's latent keys; `RaggedIndexedLayer` keeps them in a second buffer moved by the same joins, selects
and trims, so a decode step's indexer scores the same keys, in the same columns, as its attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer


class RaggedLayer(DynamicLayer):
    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        cap = max(self.capacity, key_states.shape[-2])
        self._k = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[-1])
        self._v = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self._k.shape[2], 16)
        self._k = F.pad(self._k[:, :, : self.length], (0, 0, 0, cap - self.length))
        self._v = F.pad(self._v[:, :, : self.length], (0, 0, 0, cap - self.length))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.length + t > self._k.shape[2]:
            self._grow(self.length + t)
        self._k[:, :, self.length : self.length + t] = key_states
        self._v[:, :, self.length : self.length + t] = value_states
        self.length += t
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k = self._k.index_select(0, indices)
            self._v = self._v.index_select(0, indices)
            self._views()

    def trim_left(self, n: int) -> None:
        if self.is_initialized and n > 0:
            self._k = self._k[:, :, n:]
            self._v = self._v[:, :, n:]
            self.length -= n
            self._views()

    def join(self, other: RaggedLayer, room: int) -> None:
        """Stack `other`'s rows under this layer's, left-padding the shorter so both end at the same column."""
        if not other.is_initialized:
            return
        if not self.is_initialized:
            self.__dict__.update({k: v for k, v in other.__dict__.items()})
            return
        length = max(self.length, other.length)
        cap = length + room

        def aligned(buf: torch.Tensor, n: int) -> torch.Tensor:
            return F.pad(buf[:, :, :n], (0, 0, length - n, cap - length))

        self._k = torch.cat([aligned(self._k, self.length), aligned(other._k, other.length)], dim=0)
        self._v = torch.cat([aligned(self._v, self.length), aligned(other._v, other.length)], dim=0)
        self.length = length
        self._views()

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False


class RaggedIndexedLayer(RaggedLayer):
    """A RaggedLayer that also holds a DSA layer's indexer keys, [B, T, D], column for column with its keys.

    The attention writes its keys first, then the indexer its own for the same tokens (`update_indexer`), so the
    indexer has its own length, equal to the attention's once both wrote a step."""

    def __init__(self, capacity: int = 0):
        super().__init__(capacity)
        self.indexer_length = 0
        self._ik: torch.Tensor | None = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        t = indexer_key_states.shape[1]
        if self._ik is None:
            cap = max(self.capacity, t)
            self._ik = indexer_key_states.new_empty(
                indexer_key_states.shape[0], cap, indexer_key_states.shape[2]
            )
            self.indexer_length = 0
        if self.indexer_length + t > self._ik.shape[1]:
            cap = max(self.indexer_length + t, 2 * self._ik.shape[1], 16)
            self._ik = F.pad(self._ik[:, : self.indexer_length], (0, 0, 0, cap - self.indexer_length))
        self._ik[:, self.indexer_length : self.indexer_length + t] = indexer_key_states
        self.indexer_length += t
        return self._ik[:, : self.indexer_length]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self._ik is not None:
            self._ik = self._ik.index_select(0, indices)

    def trim_left(self, n: int) -> None:
        super().trim_left(n)
        if self._ik is not None and n > 0:
            self._ik = self._ik[:, n:]
            self.indexer_length -= n

    def join(self, other: RaggedLayer, room: int) -> None:
        assert isinstance(other, RaggedIndexedLayer)
        mine, n_mine, theirs, n_theirs = self._ik, self.indexer_length, other._ik, other.indexer_length
        super().join(other, room)  # takes other's state whole when this layer is empty
        if mine is None or theirs is None:
            return
        length = max(n_mine, n_theirs)
        cap = length + room

        def aligned(buf: torch.Tensor, n: int) -> torch.Tensor:
            return F.pad(buf[:, :n], (0, 0, length - n, cap - length))

        self._ik = torch.cat([aligned(mine, n_mine), aligned(theirs, n_theirs)], dim=0)
        self.indexer_length = length

    def reset(self) -> None:
        super().reset()
        self._ik = None
        self.indexer_length = 0


class RaggedCache(DynamicCache):
    """A DynamicCache of RaggedLayers: full attention, and DSA's indexed attention (`RaggedIndexedLayer`)."""

    def __init__(self, config: PretrainedConfig, capacity: int = 0):
        super().__init__(config=config)
        layers: list[RaggedLayer] = []
        for layer in self.layers:
            if type(layer) is DynamicLayer:
                layers.append(RaggedLayer(capacity))
            elif type(layer) is DynamicIndexedLayer:
                layers.append(RaggedIndexedLayer(capacity))
            else:
                raise NotImplementedError(
                    f"{type(layer).__name__} (sliding-window or linear attention) is not supported"
                )
        self.layers = layers  # type: ignore[assignment]

    def _ragged(self) -> list[RaggedLayer]:
        return self.layers  # type: ignore[return-value]

    def select(self, indices: torch.Tensor) -> None:
        for layer in self._ragged():
            layer.batch_select_indices(indices)

    def trim_left(self, n: int) -> None:
        for layer in self._ragged():
            layer.trim_left(n)

    def join(self, other: RaggedCache, room: int) -> None:
        for mine, theirs in zip(self._ragged(), other._ragged(), strict=True):
            mine.join(theirs, room)
