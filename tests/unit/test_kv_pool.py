"""The engine's pool of spare KV-cache buffers: a buffer comes back only when nothing refers to it, and a batch
run on pooled buffers chooses the same tokens as one run on fresh memory."""

from __future__ import annotations

import torch

from mint_core.engine.engine import Request
from mint_core.engine.kv_cache import BufferPool
from mint_core.engine.sampling import SamplingParams


def test_a_given_buffer_is_taken_again_by_a_size_it_fits() -> None:
    pool = BufferPool(max_bytes=1 << 20)
    like = torch.empty(0)
    a = pool.take((4, 8, 10, 16), like)
    ptr = a.data_ptr()
    pool.give(a)
    del a
    b = pool.take((3, 8, 10, 16), like)  # smaller, within twice: the same memory
    assert b.data_ptr() == ptr and b.shape == (3, 8, 10, 16) and b.is_contiguous()
    c = pool.take((1, 8, 10, 16), like)  # the pool is empty again: fresh memory
    assert c.data_ptr() != ptr
    assert (pool.hits, pool.misses) == (1, 2)


def test_a_buffer_with_a_live_view_is_not_taken_back() -> None:
    pool = BufferPool()
    a = torch.empty(4, 8, 10, 16)
    view = a[:, :, :5]
    pool.give(a)
    assert pool.take((4, 8, 10, 16), a).data_ptr() != a.data_ptr()
    del view
    pool.give(a)
    assert pool.take((4, 8, 10, 16), a).data_ptr() == a.data_ptr()


def test_the_pool_keeps_at_most_its_bytes_and_no_other_dtype() -> None:
    pool = BufferPool(max_bytes=64 * 4)
    pool.give(torch.empty(100))  # larger than the whole pool: not kept
    pool.give(torch.empty(64))
    assert pool.take((64,), torch.empty(0, dtype=torch.float16)).dtype == torch.float16
    assert pool.misses == 1 and pool.hits == 0  # float32 spare, float16 asked
    assert pool.take((40,), torch.empty(0)).numel() == 40 and pool.hits == 1


def test_pooled_and_fresh_buffers_sample_the_same_tokens(make_engine) -> None:
    engine = make_engine("dense", seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 5, 12)]
    # a GRPO-like batch: each prompt 4 times (prefilled once, then expanded), sampled with seeds, rows ending
    # at different lengths so the batch selects its survivors on the way
    reqs = [
        Request(
            p, None, SamplingParams(max_tokens=3 + 2 * j, temperature=1.0, seed=10 * i + j, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
        for j in range(4)
    ]
    assert engine.kv_pool is not None
    pooled = [[c.token_ids for c in engine.generate(reqs)] for _ in range(3)]
    assert engine.kv_pool.hits > 0
    engine.kv_pool = None
    fresh = [c.token_ids for c in engine.generate(reqs)]
    assert all(run == fresh for run in pooled)


def test_the_pool_keeps_at_most_its_count_the_smallest_leaving_first() -> None:
    pool = BufferPool(max_buffers=3)
    kept = [torch.empty(n) for n in (10, 20, 30, 40)]
    ptrs = [t.data_ptr() for t in kept]
    for t in kept:
        pool.give(t)
    del t, kept
    assert pool.take((10,), torch.empty(0)).data_ptr() == ptrs[1]  # the 10 left; 20 is the smallest fit now
    assert pool.take((40,), torch.empty(0)).data_ptr() == ptrs[3]
