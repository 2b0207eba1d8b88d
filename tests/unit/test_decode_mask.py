"""The batcher hands the decode forward a ready 4-D attention mask (`Batcher._decode_mask`) instead of letting
transformers build one from the 2-D mask each step: the same logits, so the same sampled tokens and logprobs, for
sdpa (a boolean mask) and eager attention (an additive one), with left padding, joins and rows leaving."""

from __future__ import annotations

import pytest
import torch

from mint_core.engine.batcher import Batcher
from mint_core.engine.engine import Request
from mint_core.engine.sampling import SamplingParams
from mint_core.lora.adapter import random_adapter, save_adapter
from tests.conftest import FAMILIES, TARGETS, peft_loadable_sites


def _run(engine, reqs):  # type: ignore[no-untyped-def]
    """Tokens and logprobs of `reqs` decoded in one batch, the last request joining two steps late."""
    batcher = Batcher(engine)
    seqs = [engine.new_sequence(r) for r in reqs]
    for s in seqs:
        engine.acquire_slot(s)
    batcher.admit(seqs[:-1])
    for step in range(40):
        if step == 2:
            batcher.admit(seqs[-1:])
        batcher.step()
        if not len(batcher):
            break
    assert all(s.finished for s in seqs)
    return [(s.out_ids, s.out_logprobs) for s in seqs]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_ready_decode_mask_gives_the_tokens_of_the_built_one(
    family, impl, make_engine, adapter_dir, monkeypatch
):
    engine = make_engine(family, seed=2)
    engine.base.model.config._attn_implementation = impl
    sites = peft_loadable_sites(family, engine.sites)
    a = random_adapter(sites, TARGETS[family], 4, seed=0, std=0.2, base_fingerprint=engine.base.fingerprint)
    save_adapter(a, adapter_dir / "a0", engine.sites)
    engine.load_adapter("a0", adapter_dir / "a0")
    g = torch.Generator().manual_seed(3)
    reqs = [
        Request(
            torch.randint(0, 256, (n,), generator=g).tolist(),
            adapter,
            SamplingParams(max_tokens=m, temperature=1.0, seed=i, logprobs=True, ignore_eos=True),
        )
        for i, (n, adapter, m) in enumerate([(11, "a0", 3), (4, None, 9), (7, "a0", 6), (2, "a0", 5)])
    ]
    masks: list[torch.Tensor] = []
    ready = Batcher._decode_mask

    def spy(self):  # type: ignore[no-untyped-def]
        masks.append(ready(self))
        return masks[-1]

    monkeypatch.setattr(Batcher, "_decode_mask", spy)
    got = _run(engine, reqs)
    assert masks and all(m.dim() == 4 for m in masks)
    assert all((m.dtype == torch.bool) == (impl == "sdpa") for m in masks)
    monkeypatch.setattr(Batcher, "_decode_mask", lambda self: self.mask)  # transformers builds it
    built = _run(engine, reqs)
    for (tokens, lps), (tokens_b, lps_b) in zip(got, built, strict=True):
        assert tokens == tokens_b
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps_b), rtol=1e-5, atol=1e-6)
