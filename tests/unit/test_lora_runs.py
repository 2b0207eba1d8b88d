"""The no-grad forward of rows in runs of one slot (rollout decode, serving) adds each run's LoRA in place from
factors kept per batch composition; it gives the per-row gather's logits, also after the composition changes."""

from __future__ import annotations

import pytest
import torch

from mint_core.lora import layers
from mint_core.lora.adapter import random_adapter, save_adapter
from tests.conftest import FAMILIES, TARGETS


def _logits(engine, ids, rows, key, clear=True):  # type: ignore[no-untyped-def]
    engine.lora.ctx.set_rows(rows, key=key)
    try:
        with torch.inference_mode():
            return engine.base.model(input_ids=ids).logits.clone()
    finally:
        if clear:
            engine.lora.ctx.clear()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("steps", [1, 5])
def test_no_grad_runs_match_the_per_row_gather(family, steps, make_engine, adapter_dir, monkeypatch):
    engine = make_engine(family, seed=1)
    for i, rank in enumerate([2, 8]):
        a = random_adapter(
            engine.sites, TARGETS[family], rank, seed=i, base_fingerprint=engine.base.fingerprint
        )
        save_adapter(a, adapter_dir / f"a{i}", engine.sites)
        engine.load_adapter(f"a{i}", adapter_dir / f"a{i}")
    s0, s1 = (engine.working_set.pin(n) for n in ("a0", "a1"))
    ids = torch.randint(0, 256, (24, steps), generator=torch.Generator().manual_seed(0))
    compositions = [
        [s0] * 8 + [-1] * 8 + [s1] * 8,  # partial runs, a bare-base run between them
        [s1] * 24,  # one run over every row
        [s0] * 24,  # the same rows under another slot: nothing kept from the last composition
    ]
    got = []
    for key, rows in enumerate(compositions, start=1):
        first = _logits(engine, ids, rows, key, clear=False)  # makes the factors of this composition
        kept = dict(engine.lora.ctx.factors)
        assert kept and all(f is None or f[0].shape[-1] in (2, 8) for f in kept.values())
        got.append(_logits(engine, ids, rows, key))  # the same key: the same factors again
        assert engine.lora.ctx.factors == {}  # clear() dropped them
        torch.testing.assert_close(first, got[-1], rtol=0, atol=0)
    base = _logits(engine, ids, [-1] * 24, 99)
    monkeypatch.setattr(layers, "MIN_RUN", 10**6)
    for rows, by_run in zip(compositions, got, strict=True):
        by_row = _logits(engine, ids, rows, None)
        torch.testing.assert_close(by_run, by_row, rtol=1e-5, atol=1e-6)
        lora_rows = torch.tensor(rows) >= 0
        assert not torch.allclose(by_run[lora_rows], base[lora_rows])  # the adapters do change the logits
    torch.testing.assert_close(got[0][8:16], base[8:16], rtol=1e-5, atol=1e-6)
