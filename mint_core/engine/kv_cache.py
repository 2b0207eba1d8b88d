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

On the CPU the buffers come from a `BufferPool` the engine keeps: a buffer a layer lets go of (a `select` copies
the rows it keeps into a new one, a finished batch drops its cache) waits there for the next of its size. glibc
hands an allocation this large (hundreds of KB) fresh pages from the kernel every time, and faulting them in cost
a GRPO rollout of 32 rows about 6% of its time; from the pool the pages are already there.
"""

from __future__ import annotations

import bisect
import threading

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether `t` is the only tensor over its storage (no view of it is alive anywhere): the storage is then
    free to hand out again once `t` is dropped. Counts `t`'s reference and the storage object asked here
    (torch's private use count: should its meaning change, this answers False and the pool only keeps nothing,
    which `tests/unit/test_kv_pool.py` would show)."""
    return bool(torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2)


class BufferPool:
    """Spare CPU buffers for KV caches, by size: `take` hands out an uninitialised tensor of a shape, from a
    spare buffer of at least its size (at most twice it) when there is one; `give` takes back a tensor that
    nothing else refers to. At most `max_bytes` in at most `max_buffers` spares are kept: past the bytes the
    largest go first, past the count the smallest. Thread-safe (serving's batcher and a training rollout may
    share an engine)."""

    def __init__(self, max_bytes: int = 256 << 20, max_buffers: int = 256):
        self.max_bytes = max_bytes
        self.max_buffers = max_buffers
        self._spare: list[torch.Tensor] = []  # flat, one per storage, by size
        self._sizes: list[int] = []  # the spares' numel, in the same order (for bisect)
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of `shape` with `like`'s dtype and device."""
        numel = 1
        for n in shape:
            numel *= n
        if like.device.type == "cpu":
            with self._lock:
                i = bisect.bisect_left(self._sizes, numel)
                while i < len(self._sizes) and self._sizes[i] <= 2 * numel:
                    if self._spare[i].dtype == like.dtype:
                        flat = self._remove(i)
                        self.hits += 1
                        return flat[:numel].view(shape)
                    i += 1
                self.misses += 1
        return like.new_empty(shape)

    def give(self, t: torch.Tensor | None) -> None:
        """Keep `t`'s storage for a later `take`, if it is a CPU tensor that nothing else refers to."""
        if t is None or t.device.type != "cpu" or not _sole_owner(t):
            return
        storage = t.untyped_storage()
        size = storage.nbytes()
        if size > self.max_bytes or size < t.element_size():
            return
        flat = t.new_empty(0).set_(storage, 0, (size // t.element_size(),), (1,))
        with self._lock:
            i = bisect.bisect_right(self._sizes, flat.numel())
            self._spare.insert(i, flat)
            self._sizes.insert(i, flat.numel())
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._remove(len(self._spare) - 1)
            while len(self._spare) > self.max_buffers:
                self._remove(0)

    def _remove(self, i: int) -> torch.Tensor:
        flat = self._spare.pop(i)
        del self._sizes[i]
        self._bytes -= flat.numel() * flat.element_size()
        return flat


class RaggedLayer(DynamicLayer):
    def __init__(self, capacity: int = 0, pool: BufferPool | None = None):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.pool = pool

    def _new(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return like.new_empty(shape) if self.pool is None else self.pool.take(shape, like)

    def _drop(self, *buffers: torch.Tensor) -> None:
        """Hand buffers this layer no longer uses back to the pool (the caller holds no other reference)."""
        if self.pool is not None:
            for b in buffers:
                self.pool.give(b)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        cap = max(self.capacity, key_states.shape[-2])
        self._k = self._new((*key_states.shape[:2], cap, key_states.shape[-1]), key_states)
        self._v = self._new((*value_states.shape[:2], cap, value_states.shape[-1]), value_states)
        self.length = 0
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self._k.shape[2], 16)
        old_k, old_v = self._k, self._v
        self._k = F.pad(old_k[:, :, : self.length], (0, 0, 0, cap - self.length))
        self._v = F.pad(old_v[:, :, : self.length], (0, 0, 0, cap - self.length))
        self.keys = self.values = None  # type: ignore[assignment]  # views of the old buffers
        self._drop(old_k, old_v)

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
            old_k, old_v = self._k, self._v
            self._k = torch.index_select(
                old_k, 0, indices, out=self._new((len(indices), *old_k.shape[1:]), old_k)
            )
            self._v = torch.index_select(
                old_v, 0, indices, out=self._new((len(indices), *old_v.shape[1:]), old_v)
            )
            self._views()
            self._drop(old_k, old_v)

    def release(self) -> None:
        """Give this layer's buffers back to the pool; the layer is empty after it."""
        if self.is_initialized:
            k, v = self._k, self._v
            del self._k, self._v
            self.keys = self.values = None  # type: ignore[assignment]
            self.reset()
            self._drop(k, v)

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
            self.__dict__.update({k: v for k, v in other.__dict__.items() if k != "pool"})
            other.__dict__.pop("_k", None)  # the buffers are this layer's now, never released through `other`
            other.__dict__.pop("_v", None)
            other.keys = other.values = None  # type: ignore[assignment]
            other.reset()
            return
        length = max(self.length, other.length)
        cap = length + room

        def aligned(buf: torch.Tensor, n: int) -> torch.Tensor:
            return F.pad(buf[:, :, :n], (0, 0, length - n, cap - length))

        old_k, old_v = self._k, self._v
        self._k = torch.cat([aligned(old_k, self.length), aligned(other._k, other.length)], dim=0)
        self._v = torch.cat([aligned(old_v, self.length), aligned(other._v, other.length)], dim=0)
        self.length = length
        self._views()
        self._drop(old_k, old_v)

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False


class RaggedIndexedLayer(RaggedLayer):
    """A RaggedLayer that also holds a DSA layer's indexer keys, [B, T, D], column for column with its keys.

    The attention writes its keys first, then the indexer its own for the same tokens (`update_indexer`), so the
    indexer has its own length, equal to the attention's once both wrote a step."""

    def __init__(self, capacity: int = 0, pool: BufferPool | None = None):
        super().__init__(capacity, pool)
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
    """A DynamicCache of RaggedLayers: full attention, and DSA's indexed attention (`RaggedIndexedLayer`);
    their buffers from `pool` when one is given."""

    def __init__(self, config: PretrainedConfig, capacity: int = 0, pool: BufferPool | None = None):
        super().__init__(config=config)
        layers: list[RaggedLayer] = []
        for layer in self.layers:
            if type(layer) is DynamicLayer:
                layers.append(RaggedLayer(capacity, pool))
            elif type(layer) is DynamicIndexedLayer:
                layers.append(RaggedIndexedLayer(capacity, pool))
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

    def release(self) -> None:
        """Give every layer's buffers back to the pool (the cache is done with)."""
        for layer in self._ragged():
            layer.release()
