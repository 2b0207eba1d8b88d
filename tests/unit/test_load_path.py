"""The adapter load path reads each byte about once: exported revisions are in the base's dtype (half the bytes
of float32 for a bfloat16 base) and name it in adapter_config.json, re-exporting them is idempotent, PEFT loads
them, the tensors a read returns stay in the file's dtype and view the bytes read, and the slot the working set
writes from them serves what PEFT computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open

from mint_core.errors import AdapterError
from mint_core.lora import hostmem
from mint_core.lora.adapter import (
    CONFIG_FILE,
    DTYPE_KEY,
    WEIGHTS_FILE,
    digest_dir,
    random_adapter,
    save_adapter,
)
from mint_core.lora.layers import slot_banks
from mint_core.lora.validate import read_adapter
from mint_core.types import Site
from tests.conftest import DEVICES, TARGETS

RANK = 4


def _file_dtypes(d: Path) -> set[torch.dtype]:
    with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def test_export_in_the_base_dtype_halves_the_files(make_engine, adapter_dir):
    engine = make_engine("dense")
    a = random_adapter(engine.sites, TARGETS["dense"], RANK, seed=1, base_fingerprint=engine.base.fingerprint)
    assert all(A.dtype == torch.float32 for A, _ in a.tensors.values())  # the trainer's float32 factors
    save_adapter(a, adapter_dir / "f32", engine.sites)
    a.dtype = torch.bfloat16  # as exported over a bfloat16 base
    save_adapter(a, adapter_dir / "bf16", engine.sites)

    assert _file_dtypes(adapter_dir / "f32") == {torch.float32}
    assert _file_dtypes(adapter_dir / "bf16") == {torch.bfloat16}
    # the safetensors header names the dtype; adapter_config.json does not (PEFT warns on keys it does not know)
    assert DTYPE_KEY not in json.loads((adapter_dir / "bf16" / CONFIG_FILE).read_text())
    payload = a.num_bytes()  # the factors in float32
    size = {n: (adapter_dir / n / WEIGHTS_FILE).stat().st_size for n in ("f32", "bf16")}
    assert size["f32"] > payload and size["bf16"] < payload // 2 + 16 * 1024  # header only on top

    # the same weights give the same bytes again; and a revision read back and exported is the same revision
    assert save_adapter(a, adapter_dir / "again", engine.sites) == digest_dir(adapter_dir / "bf16")
    back = read_adapter(adapter_dir / "bf16", engine.spec)
    assert {A.dtype for A, _ in back.tensors.values()} == {torch.bfloat16}
    assert back.digest == digest_dir(adapter_dir / "bf16")
    assert save_adapter(back, adapter_dir / "re-exported", engine.sites) == back.digest


def test_trainer_exports_in_the_base_dtype(make_base, adapter_dir):
    from mint_core.engine.engine import Engine, EngineConfig
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.policy import PolicySpec
    from mint_core.rl.trainer import MultiPolicyTrainer

    base = make_base("dense")
    base.model.to(torch.bfloat16)
    engine = Engine(base, EngineConfig(max_loras=1, max_lora_rank=RANK))
    spec = PolicySpec(name="p", task="add", rank=RANK, alpha=8)
    trainer = MultiPolicyTrainer(engine, GRPOConfig(), [spec], seed=0)
    digest = trainer.export("p", adapter_dir / "p")
    assert _file_dtypes(adapter_dir / "p") == {torch.bfloat16}
    assert DTYPE_KEY not in json.loads((adapter_dir / "p" / CONFIG_FILE).read_text())
    # nothing trained in between: the same revision
    assert trainer.export("p", adapter_dir / "again") == digest
    assert engine.load_adapter("p-served", adapter_dir / "p")


def test_peft_loads_a_bfloat16_export_and_the_engine_matches_it(make_engine, make_base, adapter_dir):
    engine = make_engine("dense", seed=1)
    a = random_adapter(engine.sites, TARGETS["dense"], RANK, seed=2, base_fingerprint=engine.base.fingerprint)
    a.dtype = torch.bfloat16
    save_adapter(a, adapter_dir / "a", engine.sites)
    assert engine.load_adapter("a", adapter_dir / "a")

    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    got = engine.logits(ids, ["a"])
    peft = PeftModel.from_pretrained(make_base("dense", seed=1).model, adapter_dir / "a")
    with torch.no_grad():
        want = peft(input_ids=ids).logits
        bare = make_base("dense", seed=1).model(input_ids=ids).logits
    # both run the same bfloat16-rounded factors in float32: float32 agreement, not bfloat16's
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert (want - bare).abs().max() > 1e-3  # the adapter changes the output


def test_read_tensors_keep_the_file_dtype_and_view_one_buffer(make_engine, adapter_dir):
    engine = make_engine("dense")
    a = random_adapter(engine.sites, TARGETS["dense"], RANK, seed=1, base_fingerprint=engine.base.fingerprint)
    a.dtype = torch.bfloat16
    save_adapter(a, adapter_dir / "a", engine.sites)
    got = read_adapter(adapter_dir / "a", engine.spec)
    tensors = [t for pair in got.tensors.values() for t in pair]
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    # views of the bytes read, not copies: each tensor sits where its bytes sit in the file, relative to the others
    data = (adapter_dir / "a" / WEIGHTS_FILE).read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    begin = {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    at = {}
    for name, (A, B) in got.tensors.items():
        at[f"base_model.model.{name}.lora_A.weight"] = A.data_ptr()
        at[f"base_model.model.{name}.lora_B.weight"] = B.data_ptr()
    first = min(begin, key=begin.__getitem__)
    assert {k: p - at[first] for k, p in at.items()} == {k: b - begin[first] for k, b in begin.items()}
    assert set(got.load_s) >= {"read", "validate", "digest"}
    for name, (A, B) in a.tensors.items():
        assert torch.equal(got.tensors[name][0], A.to(torch.bfloat16))
        assert torch.equal(got.tensors[name][1], B.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_slot_write_from_the_host_cache_holds_the_revision(device):
    """prepare + write_prepared put the revision (B transposed, scale folded in) into the slot; on CUDA the host
    copy is pinned and the write does not block, and what the slot holds is the same."""
    # out features a multiple of 64 (B transposed in blocks) and not (a plain transposed copy)
    sites = {
        "l0": Site("l0", in_features=24, out_features=40),
        "l1": Site("l1", in_features=24, out_features=192),
        "e0": Site("e0.gate_up_proj", in_features=16, out_features=12, experts=3),
        "e1": Site("e1.gate_up_proj", in_features=16, out_features=128, experts=3),
    }
    lora = slot_banks(sites.values(), num_slots=2, max_rank=8, dtype=torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(0)
    tensors = {
        name: (
            torch.randn(*lead, 4, site.in_features, generator=g),
            torch.randn(*lead, site.out_features, 4, generator=g),
        )
        for name, site in sites.items()
        for lead in [(site.experts,) if site.experts else ()]
    }
    lora.banks = {name: lora.banks[site.name] for name, site in sites.items()}
    prepared = lora.prepare(tensors, scale=0.5)
    for A_RI, B_RO in prepared.values():
        assert A_RI.device.type == "cpu" and A_RI.is_contiguous() and B_RO.is_contiguous()
        if device == "cuda":
            assert A_RI.is_pinned() and B_RO.is_pinned()
    lora.write_prepared(1, prepared)
    for name, (A, B) in tensors.items():
        bank = lora.banks[name]
        got_A, got_B = bank.read(1, 4, scale=0.5)
        assert torch.equal(got_A.cpu(), A.to(torch.bfloat16))
        assert torch.allclose(got_B.cpu().float(), B.to(torch.bfloat16).float(), rtol=1e-2, atol=0)
        assert not bank.A[0].any() and not bank.B[0].any()  # the other slot untouched


def test_in_memory_handoff_names_every_non_finite_site_and_changes_nothing(make_engine):
    """Engine.add_adapter (a trainer's in-process handoff) checks all factors for NaN and inf in one pass, and on
    a hit names each bad site, beside any other problem, before the working set changes."""
    engine = make_engine("dense")
    fp = engine.base.fingerprint
    good = random_adapter(engine.sites, TARGETS["dense"], RANK, seed=1, base_fingerprint=fp)
    good.dtype = torch.bfloat16
    assert engine.add_adapter("good", good)
    before = (engine.working_set.names(), engine.working_set.host_size())

    bad = random_adapter(engine.sites, TARGETS["dense"], RANK, seed=2, base_fingerprint=fp)
    sites = sorted(bad.tensors)
    bad.tensors[sites[0]][0][1, 2] = float("nan")  # an A
    bad.tensors[sites[5]][1][3, 0] = float("-inf")  # a B
    A, B = bad.tensors[sites[9]]
    bad.tensors[sites[9]] = (A[:, :-1], B)  # and a shape that does not fit
    with pytest.raises(AdapterError) as info:
        engine.add_adapter("bad", bad)
    problems = info.value.problems
    assert f"target {sites[0]} has non-finite values" in problems
    assert f"target {sites[5]} has non-finite values" in problems
    assert sum("non-finite" in p for p in problems) == 2
    assert any(f"target {sites[9]}: shapes" in p for p in problems)
    assert (engine.working_set.names(), engine.working_set.host_size()) == before


@pytest.mark.parametrize(
    "keep",
    [
        ("a tensor", lambda buf: torch.from_numpy(buf)),
        ("a view of a tensor", lambda buf: torch.from_numpy(buf).view(torch.bfloat16)[1:]),
        ("a memoryview", lambda buf: buf.data),
        ("a tensor over a memoryview", lambda buf: torch.frombuffer(buf.data, dtype=torch.uint8)),
    ],
    ids=lambda k: k[0],
)
def test_host_buffers_are_reused_only_once_nothing_refers_to_them(keep, monkeypatch):
    """hostmem hands a large buffer out again (no fresh pages to fault in) only when no tensor, view or
    memoryview of it is left: a buffer in use is never handed out twice."""
    monkeypatch.setattr(hostmem, "_recent", [])
    n = 3 * hostmem.MIN_BYTES
    first = hostmem.take(n)
    address = first.ctypes.data
    held = keep[1](first)
    del first
    second = hostmem.take(n)
    assert second.ctypes.data != address  # still referred to: a new buffer
    del held
    third = hostmem.take(n)
    assert third.ctypes.data == address  # the first, free again
    assert hostmem.take(n).ctypes.data not in (address, third.ctypes.data)  # third is in use
    del second, third
    assert hostmem.take(n // 2).nbytes == n // 2  # far smaller: not a remembered buffer cut down


def test_prepared_revisions_use_one_buffer_each(monkeypatch):
    """prepare puts every site of a revision into one buffer of exactly its bytes, and a revision dropped from
    the host cache gives its buffer to the next one, while a revision still held keeps its own."""
    monkeypatch.setattr(hostmem, "_recent", [])
    sites = {f"l{i}": Site(f"l{i}", in_features=8192, out_features=256 * (1 + i % 3)) for i in range(12)}
    lora = slot_banks(sites.values(), num_slots=2, max_rank=8, dtype=torch.bfloat16, device="cpu")
    g = torch.Generator().manual_seed(0)
    tensors = {
        n: (torch.randn(8, s.in_features, generator=g), torch.randn(s.out_features, 8, generator=g))
        for n, s in sites.items()
    }
    nbytes = sum(A.numel() + B.numel() for A, B in tensors.values()) * 2
    assert nbytes >= hostmem.MIN_BYTES  # large enough to be a remembered buffer
    held = lora.prepare(tensors, scale=2.0)
    storages = {t.untyped_storage().data_ptr() for pair in held.values() for t in pair}
    assert len(storages) == 1 and next(iter(held.values()))[0].untyped_storage().nbytes() == nbytes
    other = lora.prepare(tensors, scale=2.0)
    assert other["l0"][0].data_ptr() != held["l0"][0].data_ptr()
    address = other["l0"][0].data_ptr()
    del other
    again = lora.prepare(tensors, scale=2.0)
    assert again["l0"][0].data_ptr() == address
    for n, (A, B) in tensors.items():
        for got in (held, again):
            assert torch.equal(got[n][0], A.to(torch.bfloat16))
            assert torch.equal(got[n][1], (B.to(torch.bfloat16).t() * 2.0))


def test_a_max_rank_revision_over_every_site_goes_into_its_slot_in_one_copy():
    """A slot's storage is contiguous, in the layout prepare gives a revision of the max rank over every site, so
    writing one is a single copy; a lower rank, a revision over fewer sites, or a bank whose tensor was replaced
    takes the site-by-site path, and every path leaves the same factors in the slot."""
    sites = {
        "l0": Site("l0", in_features=24, out_features=40),
        "l1": Site("l1", in_features=24, out_features=40),
        "l2": Site("l2", in_features=40, out_features=24),
        "e0.gate_up_proj": Site("e0.gate_up_proj", in_features=16, out_features=12, experts=3),
    }
    lora = slot_banks(sites.values(), num_slots=3, max_rank=4, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)

    def revision(rank: int, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            n: (
                torch.randn(*lead, rank, sites[n].in_features, generator=g),
                torch.randn(*lead, sites[n].out_features, rank, generator=g),
            )
            for n in names
            for lead in [(sites[n].experts,) if sites[n].experts else ()]
        }

    def check(slot: int, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for name, bank in lora.banks.items():
            if name not in tensors:
                assert not bank.A[slot].any() and not bank.B[slot].any()
                continue
            A, B = tensors[name]
            got_A, got_B = bank.read(slot, A.shape[-2], scale=0.5)
            assert torch.equal(got_A, A) and torch.allclose(got_B, B)

    full = revision(4, list(sites))
    prepared = lora.prepare(full, scale=0.5)
    assert lora._in_slot_layout(prepared, prepared.flat)
    lora.write_prepared(1, prepared)
    check(1, full)
    assert not lora.slots[0].any() and not lora.slots[2].any()  # only its own slot

    for rank, names in [(2, list(sites)), (4, ["l0", "e0.gate_up_proj"])]:
        part = revision(rank, names)
        other = lora.prepare(part, scale=0.5)
        assert not lora._in_slot_layout(other, other.flat)
        lora.write_prepared(1, other)  # over the full-rank one: its extra rows and sites are cleared
        check(1, part)

    bank = lora.banks["l1"]
    bank.A.data = bank.A.data.clone()  # as moving a model's parameters does: the bank no longer views `slots`
    assert not lora._in_slot_layout(prepared, prepared.flat)
    lora.write_prepared(2, prepared)
    check(2, full)
