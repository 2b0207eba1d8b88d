"""The engine's logits for a batch mixing adapters of different ranks (and the bare base) equal PEFT's
PeftModel with each adapter applied alone, within 1e-4 relative in float32, for every family."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from mint_core.lora.adapter import random_adapter, save_adapter
from tests.conftest import FAMILIES, TARGETS, peft_loadable_sites

RTOL = 1e-4
RANKS = [1, 4, 8, 16]


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_matches_peft_per_adapter(family, make_engine, make_base, adapter_dir):
    engine = make_engine(family, seed=1)
    sites = peft_loadable_sites(family, engine.sites)
    for i, rank in enumerate(RANKS):
        # adapter 1 targets only two module kinds: sites it leaves out must stay bare in its slot
        targets = TARGETS[family][:2] if i == 1 else TARGETS[family]
        a = random_adapter(
            sites, targets, rank, alpha=rank * (i + 1), seed=i, base_fingerprint=engine.base.fingerprint
        )
        save_adapter(a, adapter_dir / f"a{i}", engine.sites)
        assert engine.load_adapter(f"a{i}", adapter_dir / f"a{i}")

    ids = torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(0))
    names = ["a0", "a1", None, "a2", "a3", "a0"]
    got = engine.logits(ids, names)

    for row, name in enumerate(names):
        reference = make_base(family, seed=1).model
        if name is not None:
            reference = PeftModel.from_pretrained(reference, adapter_dir / name)
        with torch.no_grad():
            want = reference(input_ids=ids[row : row + 1]).logits
        rel = ((got[row : row + 1] - want).abs().max() / want.abs().max()).item()
        assert rel < RTOL, f"{family} row {row} ({name}): relative error {rel:.2e}"
        if name is not None:  # the adapter really changed the output, so the comparison means something
            bare = make_base(family, seed=1).model(input_ids=ids[row : row + 1]).logits
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
