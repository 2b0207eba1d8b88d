"""The on-disk adapter format: MoE experts convert between PEFT's packed and vLLM's per-expert layout without
loss, PEFT loads mint's packed export unchanged, digests name exactly the bytes of a revision, saves are
atomic, and a base's fingerprint follows its weights."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from mint_core.engine.base import fingerprint
from mint_core.lora.adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    digest_dir,
    from_peft_state,
    random_adapter,
    save_adapter,
    to_peft_state,
)
from tests.conftest import FAMILIES, TARGETS, peft_loadable_sites

RANK = 4
EXPERT_FAMILIES = ["moe", "mla", "dsa"]


def _assert_same_tensors(got, want):  # type: ignore[no-untyped-def]
    assert got.keys() == want.keys()
    for name, (A, B) in want.items():
        assert torch.equal(got[name][0], A) and torch.equal(got[name][1], B), name


# ---- packed <-> unpacked ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", EXPERT_FAMILIES)
def test_packed_unpacked_packed_is_bit_exact(family, make_base):
    sites = make_base(family).sites
    a = random_adapter(sites, TARGETS[family], RANK, seed=0)
    assert any(sites[name].experts for name in a.tensors)
    packed = to_peft_state(a.tensors, sites, "packed")
    unpacked = to_peft_state(a.tensors, sites, "unpacked")
    # the unpacked state really is per expert, so this is a conversion and not the packed layout twice
    assert "base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_A.weight" in unpacked
    assert not any(".experts.lora_" in k or ".experts.base_layer." in k for k in unpacked)

    problems: list[str] = []
    from_unpacked = from_peft_state(unpacked, sites, RANK, problems)
    assert problems == []
    _assert_same_tensors(from_unpacked, a.tensors)
    repacked = to_peft_state(from_unpacked, sites, "packed")
    assert repacked.keys() == packed.keys()
    assert all(torch.equal(repacked[k], packed[k]) for k in packed)

    from_packed = from_peft_state(packed, sites, RANK, problems)
    assert problems == []
    _assert_same_tensors(from_packed, a.tensors)


@pytest.mark.parametrize("family", EXPERT_FAMILIES)
def test_unpacked_files_serve_like_packed_files(family, make_engine, adapter_dir):
    engine = make_engine(family)
    a = random_adapter(engine.sites, TARGETS[family], RANK, seed=0, base_fingerprint=engine.base.fingerprint)
    save_adapter(a, adapter_dir / "packed", engine.sites, layout="packed")
    save_adapter(a, adapter_dir / "unpacked", engine.sites, layout="unpacked")
    assert digest_dir(adapter_dir / "packed") != digest_dir(adapter_dir / "unpacked")
    engine.load_adapter("packed", adapter_dir / "packed")
    engine.load_adapter("unpacked", adapter_dir / "unpacked")

    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0)).repeat(3, 1)
    got = engine.logits(ids, ["packed", "unpacked", None])
    torch.testing.assert_close(got[1], got[0], atol=1e-6, rtol=0)
    assert (got[0] - got[2]).abs().max() > 1e-3  # the adapter changes the output, so equality means something


@pytest.mark.parametrize("family", EXPERT_FAMILIES)
def test_unpacked_gate_and_up_with_different_a_cannot_be_packed(family, make_base):
    sites = make_base(family).sites
    a = random_adapter(sites, TARGETS[family], RANK, seed=0)
    state = to_peft_state(a.tensors, sites, "unpacked")
    key = "base_model.model.model.layers.1.mlp.experts.2.up_proj.lora_A.weight"
    state[key] = state[key] + 1e-3
    problems: list[str] = []
    from_peft_state(state, sites, RANK, problems)
    assert len(problems) == 1, problems
    assert "experts.2: gate_proj and up_proj have different lora_A" in problems[0]
    assert "cannot be packed without loss" in problems[0]


@pytest.mark.parametrize("layout", ["packed", "unpacked"])
def test_expert_tensors_without_a_site_are_refused_in_either_layout(layout, make_base, make_engine):
    # an engine with no down_proj slots must not serve such an adapter with its down_proj silently dropped
    sites = make_base("moe").sites
    a = random_adapter(sites, ["gate_up_proj", "down_proj"], RANK, seed=0)
    state = to_peft_state(a.tensors, sites, layout)
    engine_sites = make_engine("moe", target_modules=["gate_up_proj"]).sites
    assert not any(name.endswith("down_proj") for name in engine_sites)
    problems: list[str] = []
    from_peft_state(state, engine_sites, RANK, problems)
    assert any("model.layers.0.mlp.experts" in p for p in problems), problems


# ---- PEFT compatibility ------------------------------------------------------------------------------------


def test_peft_loads_packed_moe_export_unchanged(make_base, adapter_dir):
    base = make_base("moe", seed=1)
    sites = peft_loadable_sites("moe", base.sites)
    a = random_adapter(sites, TARGETS["moe"], RANK, seed=0, base_fingerprint=base.fingerprint)
    save_adapter(a, adapter_dir / "a", base.sites)
    saved = load_file(str(adapter_dir / "a" / WEIGHTS_FILE))
    assert any(".mlp.experts.base_layer.lora_A" in k for k in saved)  # both expert parameters, nested

    model = PeftModel.from_pretrained(make_base("moe", seed=1).model, adapter_dir / "a")
    loaded = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    # PEFT's in-memory names carry the adapter name: lora_A.weight -> lora_A.default.weight
    expected = {k.replace(".weight", ".default.weight"): v for k, v in saved.items()}
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


# ---- digest --------------------------------------------------------------------------------------------------


def test_digest_names_the_bytes_of_a_revision(make_engine, adapter_dir):
    engine = make_engine("dense")
    a = random_adapter(
        engine.sites, ["q_proj", "down_proj"], RANK, seed=0, base_fingerprint=engine.base.fingerprint
    )
    one = save_adapter(a, adapter_dir / "one", engine.sites)
    two = save_adapter(a, adapter_dir / "two", engine.sites)
    assert one == two == digest_dir(adapter_dir / "one") == digest_dir(adapter_dir / "two")
    engine.load_adapter("one", adapter_dir / "one")
    assert engine.working_set.digest_of("one") == one

    # the lowest bit of the first weight: a different revision, though it still loads
    weights = adapter_dir / "two" / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    first = 8 + int.from_bytes(data[:8], "little")
    data[first] ^= 1
    weights.write_bytes(bytes(data))
    assert digest_dir(adapter_dir / "two") != one
    engine.load_adapter("two", adapter_dir / "two")
    assert engine.working_set.digest_of("two") == digest_dir(adapter_dir / "two")


# ---- atomic save -------------------------------------------------------------------------------------------------


def test_save_refuses_a_non_empty_dir_and_leaves_no_temporary(make_base, adapter_dir):
    sites = make_base("dense").sites
    a = random_adapter(sites, ["q_proj"], RANK, seed=0)
    taken = adapter_dir / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        save_adapter(a, taken, sites)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    assert (taken / "notes.txt").read_text() == "keep"

    empty = adapter_dir / "empty"
    empty.mkdir()
    save_adapter(a, empty, sites)
    save_adapter(a, adapter_dir / "nested" / "fresh", sites)
    for d in (empty, adapter_dir / "nested" / "fresh"):
        assert sorted(p.name for p in d.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert [p for p in adapter_dir.rglob("*") if ".tmp-" in p.name] == []


# ---- base fingerprint --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fingerprint_follows_the_weights(family, make_base):
    base = make_base(family, seed=0)
    assert make_base(family, seed=0).fingerprint == base.fingerprint
    assert make_base(family, seed=1).fingerprint != base.fingerprint
    with torch.no_grad():
        next(base.model.parameters()).view(-1)[0] += 1e-3
    assert fingerprint(base.model) != base.fingerprint
