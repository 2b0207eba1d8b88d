"""The adapter manager: loads by path walked one step at a time (which revision sits in each slot after each),
a bad adapter refused with nothing evicted, and on-demand loads of catalog addresses: packs, prefetch, bounded
memory."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mint_core.engine.engine import Engine
from mint_core.engine.loader import AdapterManager, NoCatalog
from mint_core.engine.working_set import AdapterExists
from mint_core.errors import AdapterError
from mint_core.lora.adapter import WEIGHTS_FILE, AdapterWeights, random_adapter, save_adapter
from mint_core.registry.catalog import AddressError, Catalog, CatalogConfig, UnknownAddress
from mint_core.registry.catalog_schema import Registration
from mint_core.registry.packs import write_pack
from mint_core.registry.store import AdapterStore

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture
def setup(make_engine, tmp_path: Path):  # type: ignore[no-untyped-def]
    engine: Engine = make_engine("dense", max_loras=2, max_cpu_loras=3)
    store = AdapterStore(tmp_path / "store")
    catalog = Catalog(CatalogConfig(url=f"sqlite:///{tmp_path}/catalog.db"))
    loader = AdapterManager(engine, store, catalog, workers=2, alias_ttl_s=0.0)
    yield engine, store, catalog, loader, tmp_path
    loader.close()
    catalog.close()


@pytest.fixture
def manager(make_engine, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A manager without a catalog (what admin loads use), over two slots and a host cache of three."""
    engine: Engine = make_engine("dense", max_loras=2, max_cpu_loras=3)
    m = AdapterManager(engine, AdapterStore(tmp_path / "store"))
    yield m
    m.close()


def _saved(engine: Engine, path: Path, seed: int, rank: int = 2) -> AdapterWeights:
    a = random_adapter(
        engine.sites, TARGETS, rank=rank, seed=seed, std=0.2, base_fingerprint=engine.base.fingerprint
    )
    a.digest = save_adapter(a, path, engine.sites)
    return a


def _owners(engine: Engine) -> list[tuple[str | None, int]]:
    """(revision, running requests) per device slot."""
    return [(digest, n) for _, digest, n in engine.working_set.slot_table()]


def test_load_reload_swap_unload_step_by_step(manager: AdapterManager, tmp_path: Path) -> None:
    engine, ws = manager.engine, manager.working_set
    v1, v2 = _saved(engine, tmp_path / "v1", 1), _saved(engine, tmp_path / "v2", 2)

    assert manager.load("p", tmp_path / "v1") is True
    assert ws.names() == {"p": v1.digest}
    assert _owners(engine) == [(None, 0), (None, 0)]  # loading registers; a request places it in a slot
    old = ws.acquire("p")  # a request starts on v1
    assert _owners(engine) == [(v1.digest, 1), (None, 0)]

    # the same revision again, by name or in place: nothing changes
    assert manager.load("p", tmp_path / "v1") is False
    assert manager.load("p", tmp_path / "v1", replace=True) is False
    assert ws.names() == {"p": v1.digest}
    assert _owners(engine) == [(v1.digest, 1), (None, 0)]

    # another revision without replace: refused, still v1
    with pytest.raises(AdapterExists, match="'p'"):
        manager.load("p", tmp_path / "v2")
    assert ws.names() == {"p": v1.digest}

    # the swap: new requests get v2, the running one stays on v1 until it ends
    assert manager.load("p", tmp_path / "v2", replace=True) is True
    assert ws.names() == {"p": v2.digest}
    assert _owners(engine) == [(v1.digest, 1), (None, 0)]
    new = ws.acquire("p")
    assert _owners(engine) == [(v1.digest, 1), (v2.digest, 1)]
    ws.release(old)
    assert _owners(engine) == [(None, 0), (v2.digest, 1)]  # the old revision left with its last request
    ws.release(new)
    assert _owners(engine) == [(None, 0), (v2.digest, 0)]

    assert manager.unload("p") is True
    assert ws.names() == {}
    assert _owners(engine) == [(None, 0), (None, 0)]
    assert ws.host_size() == 0
    assert manager.unload("p") is False  # unloading again is safe
    assert manager.unload("never-loaded") is False


def _nan(path: Path) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, path / WEIGHTS_FILE)


def _no_weights(path: Path) -> None:
    (path / WEIGHTS_FILE).unlink()


BROKEN = [
    # (case, how the adapter is broken, rank it is saved at, expected message)
    ("non-finite values", _nan, 2, "non-finite"),
    ("rank above the engine's", lambda _p: None, 32, "rank 32 is above the engine's max rank 16"),
    ("no weights file", _no_weights, 2, f"{WEIGHTS_FILE} is missing"),
]


@pytest.mark.parametrize(("case", "breaks", "rank", "message"), BROKEN, ids=[b[0] for b in BROKEN])
def test_bad_adapter_is_refused_with_nothing_evicted(
    manager: AdapterManager,
    tmp_path: Path,
    case: str,
    breaks: Callable[[Path], None],
    rank: int,
    message: str,
) -> None:
    engine, ws = manager.engine, manager.working_set
    a, b = _saved(engine, tmp_path / "a", 1), _saved(engine, tmp_path / "b", 2)
    manager.load("a", tmp_path / "a")
    manager.load("b", tmp_path / "b")
    for name in ("a", "b"):  # both slots full, neither in use: the next placement would evict one
        ws.release(ws.acquire(name))
    before = (_owners(engine), ws.names(), ws.host_size(), ws.stats.evictions, ws.stats.host_evictions)
    logits_a = _logits(engine, "a")
    _saved(engine, tmp_path / "bad", 3, rank=rank)
    breaks(tmp_path / "bad")

    for name, replace in (("a", True), ("c", False)):  # in place over a served name, and as a new name
        with pytest.raises(AdapterError, match=message):
            manager.load(name, tmp_path / "bad", replace=replace)
        after = (_owners(engine), ws.names(), ws.host_size(), ws.stats.evictions, ws.stats.host_evictions)
        assert after == before, case
    assert _owners(engine) == [(a.digest, 0), (b.digest, 0)]
    assert torch.equal(_logits(engine, "a"), logits_a)  # the old revision still serves


def test_on_demand_loads_need_a_catalog(manager: AdapterManager) -> None:
    with pytest.raises(NoCatalog):
        manager.ensure("p/v1")
    with pytest.raises(NoCatalog):
        manager.prefetch(["p/v1"])


def _stored(engine: Engine, store: AdapterStore, tmp: Path, seed: int, rank: int = 2) -> str:
    a = random_adapter(engine.sites, TARGETS, rank=rank, seed=seed, base_fingerprint=engine.base.fingerprint)
    save_adapter(a, tmp / f"src{seed}", engine.sites)
    return store.put_dir(tmp / f"src{seed}")


def _register(catalog: Catalog, store: AdapterStore, engine: Engine, digest: str, policy: str | None) -> None:
    catalog.register(digest, engine.base.fingerprint, 2, store.path(digest), policy=policy)


def _logits(engine: Engine, name: str | None) -> torch.Tensor:
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    return engine.logits(ids, [name])


def test_cold_load_then_hit(setup) -> None:  # type: ignore[no-untyped-def]
    engine, store, catalog, loader, tmp = setup
    d = _stored(engine, store, tmp, 1)
    _register(catalog, store, engine, d, "p")
    assert loader.load_address("p/v1") == "p/v1"
    assert engine.working_set.digest_of("p/v1") == d
    # the same adapter loaded by path gives the same logits
    engine.load_adapter("direct", store.path(d))
    assert torch.equal(_logits(engine, "p/v1"), _logits(engine, "direct"))
    assert not torch.equal(_logits(engine, "p/v1"), _logits(engine, None))
    loader.load_address("p/v1")
    assert (loader.stats.cold_loads, loader.stats.hits) == (1, 1)


def test_concurrent_asks_share_one_load(setup) -> None:  # type: ignore[no-untyped-def]
    engine, store, catalog, loader, tmp = setup
    d = _stored(engine, store, tmp, 1)
    _register(catalog, store, engine, d, None)
    futures = []
    threads = [
        threading.Thread(target=lambda: futures.append(loader.ensure(f"sha256:{d}"))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {f.result(10) for f in futures} == {f"sha256:{d}"}
    assert loader.stats.cold_loads == 1


def test_moved_alias_is_followed(setup) -> None:  # type: ignore[no-untyped-def]
    engine, store, catalog, loader, tmp = setup
    d1, d2 = _stored(engine, store, tmp, 1), _stored(engine, store, tmp, 2)
    _register(catalog, store, engine, d1, "p")
    _register(catalog, store, engine, d2, "p")
    catalog.set_alias("p", "champion", 1)
    loader.load_address("p")
    assert engine.working_set.digest_of("p") == d1
    catalog.set_alias("p", "champion", 2)
    loader.load_address("p")  # alias_ttl_s=0: re-resolved, loaded in place
    assert engine.working_set.digest_of("p") == d2


def test_bad_addresses(setup) -> None:  # type: ignore[no-untyped-def]
    engine, _store, _catalog, loader, _tmp = setup
    with pytest.raises(AddressError):
        loader.ensure("no spaces allowed")
    with pytest.raises(UnknownAddress, match="unknown policy"):
        loader.load_address("nobody/v1")
    assert engine.working_set.names() == {}
    assert loader.stats.failures == 1


def test_packed_members_load_and_verify(setup) -> None:  # type: ignore[no-untyped-def]
    engine, _store, catalog, loader, tmp = setup
    members = [
        random_adapter(engine.sites, TARGETS, rank=1, seed=s, base_fingerprint=engine.base.fingerprint)
        for s in range(5)
    ]
    pack = tmp / "packs" / "0.safetensors"
    digests = write_pack(pack, members, engine.sites)
    catalog.register_many(
        [Registration(d, engine.base.fingerprint, 1, f"{pack}#{i}") for i, d in enumerate(digests)]
    )
    # a member's digest is that of the PEFT files it exports to
    assert save_adapter(members[3], tmp / "m3", engine.sites) == digests[3]
    loader.load_address(f"sha256:{digests[3]}")
    engine.load_adapter("m3", tmp / "m3")
    assert torch.allclose(_logits(engine, f"sha256:{digests[3]}"), _logits(engine, "m3"), rtol=0, atol=0)

    # a location that is not <pack>#<index>, or an index outside the pack, is named
    for bad, why in (
        (f"{pack}#x", "a pack location is"),
        (str(pack), "a pack location is"),
        (f"{pack}#9", "outside"),
    ):
        with pytest.raises(AdapterError, match=why):
            loader._packs.read(bad, engine.spec)

    # a pack changed on disk is caught on read
    raw = bytearray(pack.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in sorted(header) if k.startswith("A."))
    start = 8 + n + header[key]["data_offsets"][0]
    row = 4 * int(np.prod(header[key]["shape"][1:]))  # float32 bytes of one member
    raw[start + 4 * row : start + 4 * row + 4] = b"\x00\x00\xc0\x7f"  # member 4's first value becomes NaN
    pack.write_bytes(bytes(raw))
    loader._packs = type(loader._packs)(engine.sites)  # forget the open handle
    with pytest.raises(AdapterError, match=r"non-finite values[\s\S]*checksum mismatch"):
        loader.load_address(f"sha256:{digests[4]}")


def test_sweep_keeps_memory_bounded(setup) -> None:  # type: ignore[no-untyped-def]
    engine, _store, catalog, loader, tmp = setup
    members = [
        random_adapter(engine.sites, TARGETS, rank=1, seed=s, base_fingerprint=engine.base.fingerprint)
        for s in range(12)
    ]
    pack = tmp / "p.safetensors"
    digests = write_pack(pack, members, engine.sites)
    catalog.register_many(
        [Registration(d, engine.base.fingerprint, 1, f"{pack}#{i}") for i, d in enumerate(digests)]
    )
    ws = engine.working_set
    for d in digests:
        name = loader.load_address(f"sha256:{d}")
        ws.release(ws.acquire(name))  # served once
        assert len(ws.names()) <= ws.max_cpu_loras + ws.lora.num_slots
    assert ws.host_size() <= ws.max_cpu_loras
    assert f"sha256:{digests[0]}" not in ws.names()  # forgotten; the catalog can name it again
    loader.load_address(f"sha256:{digests[0]}")
    assert ws.digest_of(f"sha256:{digests[0]}") == digests[0]
    assert loader.stats.cold_loads == 13 and ws.stats.evictions >= 10


def test_held_names_are_not_forgotten(setup) -> None:  # type: ignore[no-untyped-def]
    engine, _store, catalog, loader, tmp = setup
    members = [
        random_adapter(engine.sites, TARGETS, rank=1, seed=s, base_fingerprint=engine.base.fingerprint)
        for s in range(8)
    ]
    pack = tmp / "p.safetensors"
    digests = write_pack(pack, members, engine.sites)
    catalog.register_many(
        [Registration(d, engine.base.fingerprint, 1, f"{pack}#{i}") for i, d in enumerate(digests)]
    )
    first = loader.ensure(f"sha256:{digests[0]}", hold=True).result(10)
    for d in digests[1:]:
        loader.load_address(f"sha256:{d}")
    assert first in engine.working_set.names()  # held: survived seven later loads into a cache of three
    engine.working_set.unhold(first)
    loader.load_address(f"sha256:{digests[1]}")  # touches the cache again: now `first` may go
    for d in digests[2:6]:
        loader.load_address(f"sha256:{d}")
    assert first not in engine.working_set.names()


def test_prefetch(setup) -> None:  # type: ignore[no-untyped-def]
    engine, store, catalog, loader, tmp = setup
    ds = [_stored(engine, store, tmp, s) for s in range(3)]
    for d in ds:
        _register(catalog, store, engine, d, "q")
    futures = loader.prefetch(["q/v1", "q/v2", "q/v3"])
    assert [f.result(10) for f in futures] == ["q/v1", "q/v2", "q/v3"]
    assert loader.stats.prefetches == 3 and loader.stats.cold_loads == 3


def test_bulk_prefetch_reads_packs_once_per_chunk(setup) -> None:  # type: ignore[no-untyped-def]
    engine, _store, catalog, loader, tmp = setup
    members = [
        random_adapter(engine.sites, TARGETS, rank=1, seed=s, base_fingerprint=engine.base.fingerprint)
        for s in range(6)
    ]
    pack = tmp / "bulk.safetensors"
    digests = write_pack(pack, members, engine.sites)
    catalog.register_many(
        [
            Registration(d, engine.base.fingerprint, 1, f"{pack}#{i}", policy=f"u{i}")
            for i, d in enumerate(digests)
        ]
    )
    asked = ["u1/v1", "u4/v1", "u2/v1", "u9/v1", "bad address", "u1/v1"]
    futures = loader.prefetch(asked, hold=True)
    assert futures[0].result(10) == "u1/v1" and futures[1].result(10) == "u4/v1"
    assert futures[2].result(10) == "u2/v1" and futures[5].result(10) == "u1/v1"
    with pytest.raises(UnknownAddress, match="u9"):
        futures[3].result(10)
    with pytest.raises(AddressError):
        futures[4].result(10)
    ws = engine.working_set
    assert ws.digest_of("u4/v1") == digests[4]
    # bulk-loaded members answer like the same member loaded alone
    lone = AdapterManager(engine, _store, catalog)
    try:
        ws.release(ws.acquire("u4/v1"))
        bulk = _logits(engine, "u4/v1")
        ws.remove("u4/v1")
        lone.load_address("u4/v1")
        assert torch.equal(_logits(engine, "u4/v1"), bulk)
    finally:
        lone.close()
    for name in ("u1/v1", "u4/v1", "u2/v1", "u1/v1"):
        ws.unhold(name)
