"""Continuous batching: sequences that join a running batch at different steps, with different adapters, and
leave at different times, get exactly the tokens they get when run alone (greedy), for every family."""

from __future__ import annotations

import itertools

import pytest
import torch

from mint_core.engine.batcher import Batcher
from mint_core.engine.engine import Request
from mint_core.engine.sampling import SamplingParams
from mint_core.lora.adapter import random_adapter, save_adapter
from tests.conftest import FAMILIES, TARGETS, peft_loadable_sites


@pytest.mark.parametrize("family", FAMILIES)
def test_late_joiners_match_solo_runs(family, make_engine, adapter_dir):
    engine = make_engine(family, seed=2)
    sites = peft_loadable_sites(family, engine.sites)
    for i, rank in enumerate([2, 8]):
        a = random_adapter(
            sites, TARGETS[family], rank, seed=i, std=0.2, base_fingerprint=engine.base.fingerprint
        )
        save_adapter(a, adapter_dir / f"a{i}", engine.sites)
        engine.load_adapter(f"a{i}", adapter_dir / f"a{i}")

    g = torch.Generator().manual_seed(3)
    reqs = [
        # a long prompt that finishes first, so the batch later trims the columns only it needed
        Request(
            torch.randint(0, 256, (23,), generator=g).tolist(),
            "a0",
            SamplingParams(max_tokens=4, ignore_eos=True),
        ),
        Request(
            torch.randint(0, 256, (5,), generator=g).tolist(),
            "a1",
            SamplingParams(max_tokens=12, ignore_eos=True),
        ),
        Request(
            torch.randint(0, 256, (9,), generator=g).tolist(),
            None,
            SamplingParams(max_tokens=10, ignore_eos=True),
        ),
        Request(
            torch.randint(0, 256, (3,), generator=g).tolist(),
            "a0",
            SamplingParams(max_tokens=6, ignore_eos=True),
        ),
    ]
    solo = [engine.generate([r])[0].token_ids for r in reqs]

    batcher = Batcher(engine)
    seqs = [engine.new_sequence(r) for r in reqs]
    join_at = {0: [0, 1], 2: [2], 5: [3]}  # step -> sequences that join before it
    widths = []
    for step in range(40):
        for i in join_at.get(step, []):
            engine.acquire_slot(seqs[i])
            batcher.admit([seqs[i]])
        if not len(batcher) and step > max(join_at):
            break
        batcher.step()
        if batcher.mask is not None:
            widths.append(batcher.mask.shape[1])
    for i, (s, want) in enumerate(zip(seqs, solo, strict=True)):
        assert s.out_ids == want, f"{family} request {i}"
    # the joins, selects and finished batches above ran on KV buffers handed back and out again
    assert engine.kv_pool is not None and engine.kv_pool.hits > 0
    assert all(slot_refs == 0 for _, _, slot_refs in engine.working_set.slot_table())
    # the 23-token prompt left after 4 tokens: the batch's width must have shrunk at least once
    assert any(b < a for a, b in itertools.pairwise(widths))
