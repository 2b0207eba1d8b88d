"""The working set, walked one cache operation at a time: which revision sits in which device slot, what the
host cache holds, and that nothing a running request uses is ever overwritten or leaked."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError

from mint_core.engine.engine import EngineConfig, Request
from mint_core.engine.working_set import AdapterExists, WorkingSet
from mint_core.errors import UnknownAdapter, WorkingSetFull
from mint_core.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterWeights, random_adapter, save_adapter
from tests.conftest import DEVICES, TARGETS

SITE = "model.layers.0.self_attn.q_proj"
IDS = torch.tensor([[5, 17, 99, 3, 42, 7]])


@pytest.fixture
def engine(make_engine, request):  # type: ignore[no-untyped-def]
    """A dense engine with 2 slots and 3 host-cache entries; on the CPU unless parametrised (indirect) with a
    device."""
    return make_engine("dense", device=getattr(request, "param", "cpu"), max_loras=2, max_cpu_loras=3)


@pytest.fixture
def save(engine, adapter_dir):  # type: ignore[no-untyped-def]
    """save(dirname, seed, rank=4) -> (path, weights): a random adapter written to disk, digest set."""

    def _save(dirname: str, seed: int, rank: int = 4):  # type: ignore[no-untyped-def]
        weights = random_adapter(
            engine.sites, TARGETS["dense"], rank, seed=seed, std=0.2, base_fingerprint=engine.base.fingerprint
        )
        path = adapter_dir / dirname
        save_adapter(weights, path, engine.sites)
        return path, weights

    return _save


@pytest.fixture
def load(engine, save):  # type: ignore[no-untyped-def]
    """load(name, seed, rank=4) -> weights: saved under a fresh directory and loaded as `name`."""

    def _load(name: str, seed: int, rank: int = 4) -> AdapterWeights:
        path, weights = save(f"{name}-{seed}", seed, rank)
        assert engine.load_adapter(name, path)
        return weights

    return _load


def owners(ws: WorkingSet) -> list[str | None]:
    return [digest for _, digest, _ in ws.slot_table()]


def refs(ws: WorkingSet) -> list[int]:
    return [n for _, _, n in ws.slot_table()]


def assert_slot_holds(engine, slot: int, weights: AdapterWeights) -> None:  # type: ignore[no-untyped-def]
    for site, (A, B) in weights.tensors.items():
        got_A, got_B = engine.lora.banks[site].read(slot, weights.rank, weights.scale)
        torch.testing.assert_close(got_A.cpu(), A, msg=f"slot {slot} {site} A")
        torch.testing.assert_close(got_B.cpu(), B, msg=f"slot {slot} {site} B")


def assert_slot_empty(engine, slot: int) -> None:  # type: ignore[no-untyped-def]
    for site, bank in engine.lora.banks.items():
        assert not bank.A[slot].any() and not bank.B[slot].any(), f"slot {slot} {site} not cleared"


def test_lru_eviction_step_by_step(engine, load):
    ws = engine.working_set
    a, b, c = load("a", 0), load("b", 1), load("c", 2, rank=8)
    assert owners(ws) == [None, None]  # loading registers; only acquire places in a slot

    assert ws.acquire("a") == 0
    assert ws.acquire("b") == 1
    assert ws.slot_table() == [(0, a.digest, 1), (1, b.digest, 1)]
    ws.release(0)
    ws.release(1)
    # released revisions stay resident for the next request
    assert ws.slot_table() == [(0, a.digest, 0), (1, b.digest, 0)]
    assert (ws.stats.hits, ws.stats.misses, ws.stats.evictions) == (0, 2, 0)

    assert ws.acquire("c") == 0  # a was used least recently
    assert ws.slot_table() == [(0, c.digest, 1), (1, b.digest, 0)]
    assert_slot_holds(engine, 0, c)  # rank 8 over rank 4: no columns of a left behind
    assert ws.stats.evictions == 1
    ws.release(0)

    # recency, not slot order: c was just used, so b goes although it sits in the higher slot
    assert ws.acquire("a") == 1
    ws.release(1)
    assert ws.slot_table() == [(0, c.digest, 0), (1, a.digest, 0)]

    assert ws.acquire("c") == 0  # a hit refreshes c too, leaving a least recent
    ws.release(0)
    assert ws.acquire("b") == 1
    ws.release(1)
    assert owners(ws) == [c.digest, b.digest]
    assert_slot_holds(engine, 0, c)
    assert_slot_holds(engine, 1, b)
    assert (ws.stats.hits, ws.stats.misses, ws.stats.evictions) == (1, 5, 3)


def test_release_more_than_acquired_raises(engine, load):
    ws = engine.working_set
    load("a", 0)
    slot = ws.acquire("a")
    ws.release(slot)
    with pytest.raises(RuntimeError, match="released more often"):
        ws.release(slot)
    assert refs(ws) == [0, 0]


def test_slots_in_use_are_never_overwritten(engine, load):
    ws = engine.working_set
    a, b, _ = load("a", 0), load("b", 1), load("c", 2)
    sa, sb = ws.acquire("a"), ws.acquire("b")
    assert ws.acquire("a") == sa  # a second request on a: refcount 2
    snapshot = {s: (bank.A.clone(), bank.B.clone()) for s, bank in engine.lora.banks.items()}

    with pytest.raises(WorkingSetFull, match="in use"):
        ws.acquire("c")
    # the engine's own acquire path gives back what it took before failing
    with pytest.raises(WorkingSetFull):
        engine.generate([Request("hi", "a"), Request("hi", "c")])
    assert ws.slot_table() == [(sa, a.digest, 2), (sb, b.digest, 1)]
    assert ws.stats.evictions == 0
    for s, bank in engine.lora.banks.items():
        assert torch.equal(bank.A, snapshot[s][0]) and torch.equal(bank.B, snapshot[s][1]), s
    assert torch.equal(engine.lora.banks[SITE].A[sa], snapshot[SITE][0][sa])

    ws.release(sa)
    with pytest.raises(WorkingSetFull):  # one request still runs on a
        ws.acquire("c")
    ws.release(sa)
    assert ws.acquire("c") == sa
    assert owners(ws)[sb] == b.digest
    assert_slot_holds(engine, sb, b)


def test_pinned_name_stays_resident(engine, load):
    ws = engine.working_set
    a = load("a", 0)
    for i, name in enumerate("bcd", start=1):
        load(name, i)
    assert ws.pin("a") == 0
    assert ws.slot_table()[0] == (0, a.digest, 0)  # pinned, not in use

    for name in "bcdbc":  # each needs a slot; only slot 1 may give way although a is least recent
        assert ws.acquire(name) == 1
        ws.release(1)
        assert ws.slot_table()[0] == (0, a.digest, 0)
    assert_slot_holds(engine, 0, a)

    ws.acquire("d")
    with pytest.raises(WorkingSetFull, match="pinned"):
        ws.acquire("b")
    ws.release(1)

    ws.unpin("a")
    assert ws.acquire("b") == 0  # once unpinned a is just the least recently used
    ws.release(0)


def test_unloading_a_pinned_name_frees_its_slot(engine, load):
    ws = engine.working_set
    load("a", 0)
    ws.pin("a")
    assert engine.unload_adapter("a")
    assert owners(ws) == [None, None]
    assert_slot_empty(engine, 0)
    assert ws.host_size() == 0


def test_load_is_idempotent_and_unload_reports_unknown(engine, save):
    ws = engine.working_set
    path, a = save("a", 0)
    assert engine.load_adapter("a", path) is True
    assert engine.load_adapter("a", path) is False
    assert (ws.slots_in_use(), ws.host_size()) == (0, 1)

    slot = ws.acquire("a")
    ws.release(slot)
    assert engine.load_adapter("a", path) is False
    hits = ws.stats.hits
    assert ws.acquire("a") == slot  # the same revision keeps its slot: no reload, no second slot
    ws.release(slot)
    assert ws.stats.hits == hits + 1
    assert ws.slots_in_use() == 1

    # a second name for the same revision shares its slot and its host copy
    assert engine.load_adapter("alias", path) is True
    assert ws.acquire("alias") == slot
    ws.release(slot)
    assert (ws.slots_in_use(), ws.host_size()) == (1, 1)

    other, _ = save("other", 1)
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_adapter("a", other)
    assert ws.digest_of("a") == a.digest

    assert engine.unload_adapter("nope") is False
    assert engine.unload_adapter("a") is True
    assert engine.unload_adapter("a") is False
    assert ws.slot_table()[slot] == (slot, a.digest, 0)  # still the revision of "alias"
    with pytest.raises(UnknownAdapter):
        ws.acquire("a")
    assert engine.unload_adapter("alias") is True
    assert (ws.slots_in_use(), ws.host_size()) == (0, 0)
    assert_slot_empty(engine, slot)


def test_refused_add_changes_nothing(engine, save):
    ws = engine.working_set
    _, v1 = save("v1", 0)
    _, v2 = save("v2", 1)
    assert ws.add("e", v1, ephemeral=True)  # loaded on demand
    with pytest.raises(AdapterExists, match="'e'"):
        ws.add("e", v2)  # another revision, no replace
    assert ws.names() == {"e": v1.digest}
    assert ws.is_ephemeral("e")  # the refused add did not make it a permanent name
    assert ws.host_size() == 1


def test_host_cache_is_bounded_and_cold_reloads_from_disk(engine, load):
    ws = engine.working_set
    a0 = load("a0", 0)
    before = engine.logits(IDS, ["a0"])
    assert ws.stats.cold_loads == 0
    for i in range(1, 5):
        load(f"a{i}", i)
        assert ws.host_size() <= 3
    assert ws.host_size() == 3
    assert ws.stats.host_evictions == 2  # a0 and a1 left host memory, oldest first

    for name in ("a1", "a2", "a3"):  # push a0 out of its device slot as well
        engine.logits(IDS, [name])
        assert ws.host_size() <= 3
    assert a0.digest not in owners(ws)

    cold = ws.stats.cold_loads
    after = engine.logits(IDS, ["a0"])
    assert ws.stats.cold_loads == cold + 1
    assert torch.equal(after, before)
    assert not torch.allclose(after, engine.logits(IDS, [None]), atol=1e-3)  # a0 really acts on the output
    assert ws.host_size() <= 3

    # a2 was read back for a slot and lost it to a0, but stayed in host memory: it returns without the disk
    assert owners(ws) == [a0.digest, ws.digest_of("a3")]
    cold, misses = ws.stats.cold_loads, ws.stats.misses
    assert ws.acquire("a2") == 1
    ws.release(1)
    assert (ws.stats.cold_loads, ws.stats.misses) == (cold, misses + 1)


def test_cold_reload_of_a_changed_file_raises(engine, load, save, adapter_dir):
    ws = engine.working_set
    a0 = load("a0", 0)
    for i in range(1, 4):
        load(f"a{i}", i)
    assert ws.stats.host_evictions == 1  # a0 now lives only on disk

    replacement, _ = save("replacement", 9)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copyfile(replacement / f, adapter_dir / "a0-0" / f)
    with pytest.raises(ValueError, match=r"'a0'.*changed on disk"):
        ws.acquire("a0")
    assert ws.slot_table() == [(0, None, 0), (1, None, 0)]
    assert ws.digest_of("a0") == a0.digest  # the name still means the revision it was loaded as
    engine.logits(IDS, ["a1", "a2"])  # the rest of the working set is unharmed


@pytest.mark.parametrize("engine", DEVICES, indirect=True)
def test_in_place_replace_leaves_running_request_on_old_revision(engine, save):
    ws = engine.working_set
    p1, v1 = save("v1", 0)
    p2, v2 = save("v2", 1, rank=8)
    engine.load_adapter("p", p1)
    held = ws.acquire("p")  # a request still decoding with v1

    assert engine.load_adapter("p", p2, replace=True) is True
    assert engine.load_adapter("p", p2, replace=True) is False
    assert ws.digest_of("p") == v2.digest
    new = ws.acquire("p")
    assert new != held
    assert ws.slot_table()[held] == (held, v1.digest, 1)
    assert ws.slot_table()[new] == (new, v2.digest, 1)
    assert_slot_holds(engine, held, v1)
    assert_slot_holds(engine, new, v2)

    ws.release(new)
    assert ws.slot_table()[new] == (new, v2.digest, 0)  # current revision stays resident
    ws.release(held)
    assert ws.slot_table()[held] == (held, None, 0)  # the old one is gone with its last request
    assert_slot_empty(engine, held)
    assert ws.host_size() == 1
    assert ws.acquire("p") == new
    ws.release(new)


def test_repeated_load_unload_cycles_leave_nothing_behind(engine, save):
    ws = engine.working_set
    paths = [save(f"d{i}", i)[0] for i in range(3)]
    in_memory = random_adapter(engine.sites, TARGETS["dense"], 2, seed=7)
    ids = IDS[:, :2]
    for cycle in range(20):
        for i, path in enumerate(paths):
            assert engine.load_adapter(f"d{i}", path)
        assert engine.add_adapter("m", in_memory)
        engine.logits(ids.expand(2, -1), ["d0", None])
        engine.logits(ids.expand(2, -1), ["d1", "m"])
        held = ws.acquire("d2")
        names = ["d0", "d1", "d2", "m"]
        if cycle % 2:  # unload while a request still holds d2, then finish the request
            for n in names:
                assert engine.unload_adapter(n)
            assert ws.slots_in_use() == 1
            ws.release(held)
        else:
            ws.release(held)
            for n in names:
                assert engine.unload_adapter(n)
        assert (ws.slots_in_use(), ws.host_size(), ws.names()) == (0, 0, {}), f"cycle {cycle}"
    assert refs(ws) == [0, 0]
    for site, bank in engine.lora.banks.items():
        assert not bank.A.any() and not bank.B.any(), site
        assert bank.filled == 0, site


def test_max_cpu_loras_below_max_loras_is_rejected(engine):
    with pytest.raises(ValidationError, match=r"max_cpu_loras \(3\) must be >= max_loras \(4\)"):
        EngineConfig(max_loras=4, max_cpu_loras=3)
    assert EngineConfig(max_loras=4, max_cpu_loras=4).max_cpu_loras == 4
    assert EngineConfig(max_loras=4).max_cpu_loras == 16
    with pytest.raises(ValueError, match="max_cpu_loras"):
        WorkingSet(engine.lora, max_cpu_loras=1)


def test_in_memory_adapter_never_leaves_host_cache(engine, load):
    ws = engine.working_set
    mem = random_adapter(engine.sites, TARGETS["dense"], 4, seed=50, std=0.2)
    assert mem.digest is None
    assert engine.add_adapter("m", mem)
    assert mem.digest is not None
    before = engine.logits(IDS, ["m"])

    for i in range(5):
        load(f"a{i}", i)
    for i in range(5):  # churn both slots and the host cache
        engine.logits(IDS, [f"a{i}"])
    assert mem.digest not in owners(ws)
    assert mem.digest in ws._host
    assert ws.host_size() == 3

    cold = ws.stats.cold_loads
    assert torch.equal(engine.logits(IDS, ["m"]), before)  # would raise if its weights had been dropped
    assert ws.stats.cold_loads == cold


def test_disk_adapter_is_served_when_host_cache_is_all_in_memory_adapters(engine, save):
    # in-memory adapters fill the host cache and cannot leave, so the disk revision is dropped again right
    # after it is read back; the slot must still get its weights
    ws = engine.working_set
    for i in range(3):
        engine.add_adapter(f"m{i}", random_adapter(engine.sites, TARGETS["dense"], 2, seed=20 + i))
    path, d = save("d", 0)
    engine.load_adapter("d", path)
    assert ws.host_size() == 3
    assert d.digest not in ws._host

    slot = ws.acquire("d")
    assert ws.stats.cold_loads == 1
    assert_slot_holds(engine, slot, d)
    ws.release(slot)
    assert ws.host_size() == 3
