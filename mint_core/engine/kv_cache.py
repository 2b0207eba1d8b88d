"""A KV cache whose layers are allocated once per batch at their final length.

transformers' DynamicLayer concatenates on every step, copying the whole cache each time (quadratic in
length). A batch knows its longest prompt and its largest max_tokens up front, so each layer allocates that
once, writes new keys and values in place, and hands attention a view of the filled part.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h = key_states.shape[:2]
        self._k = key_states.new_empty(b, h, self.capacity, key_states.shape[-1])
        self._v = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.length + t > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({self.length} + {t})")
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

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False


def preallocated_cache(config: PretrainedConfig, capacity: int) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers preallocate `capacity` positions.

    Falls back to transformers' own layers for anything else (sliding windows), which stay correct."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
