"""The engine's logits for a batch mixing adapters of different ranks (and the bare base) equal PEFT's
PeftModel with each adapter applied alone, within 1e-4 relative in float32, for every family, on the CPU and (marked
cuda, skipped where no GPU is visible) on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from mint_core.lora.adapter import random_adapter, save_adapter
from tests.conftest import DEVICES, FAMILIES, TARGETS, peft_loadable_sites

RTOL = 1e-4
RANKS = [1, 4, 8, 16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_matches_peft_per_adapter(family, device, make_engine, make_base, adapter_dir):
    engine = make_engine(family, seed=1, device=device)
    sites = peft_loadable_sites(family, engine.sites)
    for i, rank in enumerate(RANKS):
        # adapter 1 targets only two module kinds: sites it leaves out must stay bare in its slot
        targets = TARGETS[family][:2] if i == 1 else TARGETS[family]
        a = random_adapter(
            sites, targets, rank, alpha=rank * (i + 1), seed=i, base_fingerprint=engine.base.fingerprint
        )
        save_adapter(a, adapter_dir / f"a{i}", engine.sites)
        assert engine.load_adapter(f"a{i}", adapter_dir / f"a{i}")

    ids = torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(0)).to(device)
    names = ["a0", "a1", None, "a2", "a3", "a0"]
    got = engine.logits(ids, names)
    assert got.device.type == device  # the slots and the forward ran where the base is

    for row, name in enumerate(names):
        reference = make_base(family, seed=1, device=device).model
        if name is not None:
            reference = PeftModel.from_pretrained(reference, adapter_dir / name).to(device)
        with torch.no_grad():
            want = reference(input_ids=ids[row : row + 1]).logits
        rel = ((got[row : row + 1] - want).abs().max() / want.abs().max()).item()
        assert rel < RTOL, f"{family} on {device}, row {row} ({name}): relative error {rel:.2e}"
        if name is not None:  # the adapter really changed the output, so the comparison means something
            bare = make_base(family, seed=1, device=device).model(input_ids=ids[row : row + 1]).logits
            assert (want - bare).abs().max() > 1e-3


def test_base_weights_untouched_by_injection_and_loads(make_engine, make_base, adapter_dir):
    engine = make_engine("dense")
    before = {k: v.clone() for k, v in make_base("dense").model.state_dict().items()}
    a = random_adapter(engine.sites, TARGETS["dense"], 8, seed=3, base_fingerprint=engine.base.fingerprint)
    save_adapter(a, adapter_dir / "a", engine.sites)
    engine.load_adapter("a", adapter_dir / "a")
    engine.logits(torch.randint(0, 256, (2, 5)), ["a", None])
    after = {
        k.replace(".base_layer", ""): v
        for k, v in engine.base.model.state_dict().items()
        if ".bank." not in k
    }
    for k, v in before.items():
        assert torch.equal(after[k], v), k


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_in_runs_of_one_adapter_match_the_per_row_gather(family, make_engine, adapter_dir, monkeypatch):
    """Rows grouped in runs of one slot (a sorted training batch, rollout groups) take the per-run matmuls;
    their logits and the gradients of every slot equal the per-row gather's, which the test above ties to
    PEFT."""
    from mint_core.lora import layers

    engine = make_engine(family, seed=1)
    for i, rank in enumerate([2, 8]):
        a = random_adapter(
            engine.sites, TARGETS[family], rank, seed=i, base_fingerprint=engine.base.fingerprint
        )
        save_adapter(a, adapter_dir / f"a{i}", engine.sites)
        engine.load_adapter(f"a{i}", adapter_dir / f"a{i}")
    slots = [engine.working_set.pin(n) for n in ("a0", "a1")]
    rows = [slots[0]] * 8 + [-1] * 8 + [slots[1]] * 8
    ids = torch.randint(0, 256, (len(rows), 6), generator=torch.Generator().manual_seed(0))
    banks = list(engine.lora.banks.values())

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        for b in banks:
            b.A.requires_grad_(True)
            b.B.requires_grad_(True)
            b.A.grad = b.B.grad = None
        engine.lora.ctx.set_rows(rows)
        try:
            logits = engine.base.model(input_ids=ids).logits
            logits.square().mean().backward()
            assert engine.lora.ctx.runs is not None or len(rows) < layers.MIN_RUN
        finally:
            engine.lora.ctx.clear()
        grads = [g.clone() for b in banks for g in (b.A.grad, b.B.grad) if g is not None]
        for b in banks:
            b.A.requires_grad_(False)
            b.B.requires_grad_(False)
            b.A.grad = b.B.grad = None
        return logits.detach(), grads

    by_run, grads_run = run()
    monkeypatch.setattr(layers, "MIN_RUN", 10**6)
    by_row, grads_row = run()
    torch.testing.assert_close(by_run, by_row, rtol=1e-5, atol=1e-6)
    assert len(grads_run) == len(grads_row) > 0
    for g_run, g_row in zip(grads_run, grads_row, strict=True):
        torch.testing.assert_close(g_run, g_row, rtol=1e-4, atol=1e-7)
