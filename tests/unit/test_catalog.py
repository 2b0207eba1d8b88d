"""The catalog over SQLite: address parsing, the four address kinds, versions, aliases, listing, bulk writes."""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from mint_core.errors import MintError
from mint_core.registry.catalog import (
    Address,
    AddressError,
    Catalog,
    CatalogConfig,
    CatalogError,
    UnknownAddress,
    parse_address,
)
from mint_core.registry.catalog_schema import Registration, versions
from mint_core.registry.index import reindex_rows
from mint_core.registry.leases import CatalogLeases, RedisLeases, leases_for


def dg(i: int | str) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


D1, D2, D3 = dg(1), dg(2), dg(3)


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    cat = Catalog(CatalogConfig(url=f"sqlite:///{tmp_path}/sub/catalog.db"))
    yield cat  # type: ignore[misc]
    cat.close()


# ---- addresses ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("p", Address("policy", policy="p")),
        ("Policy-1.a_b", Address("policy", policy="Policy-1.a_b")),
        ("sha256", Address("policy", policy="sha256")),
        ("p@champion", Address("alias", policy="p", alias="champion")),
        ("p@candidate", Address("alias", policy="p", alias="candidate")),
        ("p/v1", Address("version", policy="p", version=1)),
        ("p/v70", Address("version", policy="p", version=70)),
        (f"sha256:{D1}", Address("digest", digest=D1)),
        ("a" * 128, Address("policy", policy="a" * 128)),
    ],
)
def test_parse_valid(text: str, expected: Address) -> None:
    addr = parse_address(text)
    assert addr == expected
    assert str(addr) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("p@", "empty alias"),
        ("@champion", "empty policy"),
        ("p/", "version must be `v`"),
        ("p/vX", "version must be `v`"),
        ("p/7", "version must be `v`"),
        ("p/v0", "version must be `v`"),
        ("p/v07", "version must be `v`"),
        ("p/v1/x", "version must be `v`"),
        ("/v1", "empty policy"),
        ("sha256:", "64 lowercase hex"),
        ("sha256:abc", "64 lowercase hex"),
        (f"sha256:{D1.upper()}", "64 lowercase hex"),
        (f"sha256:{D1}0", "64 lowercase hex"),
        ("md5:abc", "policy 'md5:abc' must be"),
        ("p q", "must be 1-128"),
        (" p", "must be 1-128"),
        ("-p", "starting with a letter or digit"),
        ("p@a@b", "alias 'a@b'"),
        ("p@a/v1", "alias 'a/v1'"),
        ("a" * 129, "must be 1-128"),
    ],
)
def test_parse_malformed(text: str, message: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_address(text)
    assert message in str(info.value)
    assert repr(text)[:40].rstrip("'") in str(info.value)  # names the input
    assert "expected `policy`, `policy@alias`" in str(info.value)
    assert isinstance(info.value, MintError)


# ---- register / resolve ----


def test_resolve_all_four_kinds(catalog: Catalog) -> None:
    assert catalog.register(D1, "tiny", 8, "/store/d1", policy="p") == 1
    assert catalog.register(D2, "tiny", 8, "/store/d2", policy="p") == 2
    catalog.set_alias("p", "champion", 1)
    catalog.set_alias("p", "candidate", 2)

    assert catalog.resolve("p") == catalog.resolve("p@champion")
    champ = catalog.resolve("p")
    assert (champ.digest, champ.location, champ.policy, champ.version) == (D1, "/store/d1", "p", 1)
    cand = catalog.resolve("p@candidate")
    assert (cand.digest, cand.location, cand.version) == (D2, "/store/d2", 2)
    v2 = catalog.resolve("p/v2")
    assert (v2.digest, v2.policy, v2.version) == (D2, "p", 2)
    bare = catalog.resolve(f"sha256:{D1}")
    assert (bare.digest, bare.location, bare.policy, bare.version) == (D1, "/store/d1", None, None)
    assert catalog.resolve(parse_address("p/v1")).digest == D1


def test_versions_count_up_per_policy(catalog: Catalog) -> None:
    assert catalog.register(D1, "tiny", 4, "l1", policy="a") == 1
    assert catalog.register(D2, "tiny", 4, "l2", policy="b") == 1
    assert catalog.register(D3, "tiny", 4, "l3", policy="a") == 2
    assert catalog.register(D2, "tiny", 4, "l2", policy="a") == 3  # same revision in a second policy
    assert catalog.register(D1, "tiny", 4, "l1", policy="a") == 4  # an old revision again: a new version
    assert catalog.register(D3, "tiny", 4, "l3") is None
    assert catalog.count() == 3
    assert catalog.count("a") == 4
    assert catalog.count("b") == 1


def test_reregister_is_idempotent(catalog: Catalog) -> None:
    assert catalog.register(D1, "tiny", 8, "l1", tags={"k": "v"}, policy="p") == 1
    assert catalog.register(f"sha256:{D1}", "tiny", 8, "l1", policy="p") == 1  # the latest already
    assert catalog.register(D1, "tiny", 8, "l1") is None
    assert catalog.count() == 1
    assert catalog.count("p") == 1
    assert catalog.list()[0].tags == {"k": "v"}  # tags=None keeps the recorded tags
    # the blob moved: location follows, the version stays
    assert catalog.register(D1, "tiny", 8, "elsewhere", policy="p") == 1
    assert catalog.resolve("p/v1").location == "elsewhere"


def test_alias_moves(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    catalog.register(D2, "tiny", 8, "l2", policy="p")
    assert catalog.set_alias("p", "champion", 1) is None
    assert catalog.resolve("p").digest == D1
    assert catalog.set_alias("p", "champion", 2) == 1
    assert catalog.resolve("p").digest == D2
    assert catalog.set_alias("p", "champion", 2) == 2  # again: harmless
    assert catalog.set_alias("p", "champion", 1) == 2  # rollback
    assert catalog.resolve("p").version == 1


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("nobody", "unknown policy 'nobody'"),
        ("nobody@candidate", "unknown policy 'nobody'"),
        ("nobody/v1", "unknown policy 'nobody'"),
        ("p", "has no alias 'champion' (a bare policy means p@champion); its aliases: candidate"),
        ("p@staging", "has no alias 'staging'; its aliases: candidate"),
        ("p/v9", "policy 'p' has 1 version(s), v1..v1, and not that one"),
        (f"sha256:{D3}", f"no revision sha256:{D3}"),
    ],
)
def test_unknown_addresses(catalog: Catalog, address: str, message: str) -> None:
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    catalog.set_alias("p", "candidate", 1)
    with pytest.raises(UnknownAddress) as info:
        catalog.resolve(address)
    assert message in str(info.value)
    assert isinstance(info.value, MintError)


def test_set_alias_to_unknown_version(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    with pytest.raises(UnknownAddress, match=r"cannot set p@champion -> v2: policy 'p' has 1 version"):
        catalog.set_alias("p", "champion", 2)
    with pytest.raises(AddressError, match="empty alias"):
        catalog.set_alias("p", "", 1)
    with pytest.raises(CatalogError, match="version must be an integer >= 1"):
        catalog.set_alias("p", "champion", 0)


def test_alias_to_deleted_version_says_so(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    catalog.register(D2, "tiny", 8, "l2", policy="p")
    catalog.set_alias("p", "champion", 2)
    with catalog.engine.begin() as conn:
        conn.execute(sa.delete(versions).where(versions.c.policy == "p", versions.c.version == 2))
    with pytest.raises(UnknownAddress, match=r"alias p@champion points at p/v2, a version missing"):
        catalog.resolve("p")
    assert catalog.resolve("p/v1").digest == D1


# ---- list ----


def test_list_filters(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", tags={"task": "math"}, policy="a")
    catalog.register(D2, "tiny", 16, "l2", tags={"task": "code"}, policy="a")
    catalog.register(D3, "other", 8, "l3", policy="b")
    catalog.register(dg(4), "tiny", 8, "l4")  # in no policy

    assert [(e.policy, e.version) for e in catalog.list(policy="a")] == [("a", 1), ("a", 2)]
    assert {e.digest for e in catalog.list()} == {D1, D2, D3, dg(4)}
    assert {e.digest for e in catalog.list(base="tiny")} == {D1, D2, dg(4)}
    assert {e.digest for e in catalog.list(rank=8)} == {D1, D3, dg(4)}
    assert {e.digest for e in catalog.list(base="tiny", rank=8)} == {D1, dg(4)}
    assert [e.digest for e in catalog.list(policy="a", rank=16)] == [D2]
    assert [e.digest for e in catalog.list(tag="task=math")] == [D1]
    assert {e.digest for e in catalog.list(tag="task")} == {D1, D2}
    assert catalog.list(tag="task=none") == []
    assert [e.digest for e in catalog.list(policy="a", limit=1, offset=1)] == [D2]
    unowned = next(e for e in catalog.list() if e.digest == dg(4))
    assert (unowned.policy, unowned.version, unowned.tags) == (None, None, {})
    entry = catalog.list(policy="a")[0]
    assert (entry.base, entry.rank, entry.location, entry.tags) == ("tiny", 8, "l1", {"task": "math"})


def test_referenced_digests(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    catalog.register(D2, "tiny", 8, "l2")
    assert catalog.referenced_digests() == {D1, D2}


# ---- validation ----


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"digest": "abc"}, "not 64 lowercase hex"),
        ({"digest": D1.upper()}, "not 64 lowercase hex"),
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"rank": "8"}, "rank must be an integer >= 1"),
        ({"rank": True}, "rank must be an integer >= 1"),
        ({"base": ""}, "base must be a non-empty string"),
        ({"location": ""}, "location must be a non-empty string"),
        ({"tags": {"k": 1}}, "tags must be a mapping of str to str"),
        ({"policy": "bad name"}, "policy 'bad name' must be"),
    ],
)
def test_validation_writes_nothing(catalog: Catalog, change: dict, message: str) -> None:
    good = {"digest": D1, "base": "tiny", "rank": 8, "location": "l1", "policy": "p"}
    with pytest.raises(CatalogError, match=message):
        catalog.register(**{**good, **change})
    # one bad row in a batch: the good rows before it are not written either
    with pytest.raises(CatalogError, match=r"1 problem\(s\).*nothing written"):
        catalog.register_many([{**good, "digest": D2}, {**good, **change}])
    assert catalog.count() == 0
    assert catalog.referenced_digests() == set()


def test_digest_cannot_change_base_or_rank(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    with pytest.raises(CatalogError, match="base and rank cannot change"):
        catalog.register(D1, "tiny", 16, "l1", policy="q")
    with pytest.raises(CatalogError, match="disagree with an earlier row"):
        catalog.register_many([Registration(D2, "tiny", 8, "x"), Registration(D2, "other", 8, "x")])
    assert catalog.count("q") == 0
    assert catalog.count() == 1


# ---- bulk ----


def test_bulk_register_then_resolve(catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mint_core.registry.catalog.CHUNK", 3_000)  # several chunks, versions across them
    n = 10_000
    rows = [Registration(dg(i), "tiny", 1, f"/store/{i}", policy=f"p{i % 1000}") for i in range(n)]
    got = catalog.register_many(rows)
    assert got == [i // 1000 + 1 for i in range(n)]
    assert catalog.count() == n
    assert catalog.count("p7") == 10
    catalog.set_alias("p7", "champion", 10)
    assert catalog.resolve("p7").digest == dg(9007)
    for i in random.Random(0).sample(range(n), 50):
        r = catalog.resolve(f"p{i % 1000}/v{i // 1000 + 1}")
        assert (r.digest, r.location) == (dg(i), f"/store/{i}")
        assert catalog.resolve(f"sha256:{dg(i)}").location == f"/store/{i}"
    # the same batch again changes nothing
    assert catalog.register_many(rows[-1000:]) == got[-1000:]
    assert catalog.count() == n
    assert len(catalog.referenced_digests()) == n


def test_resolve_many_answers_each_address_as_resolve_does(catalog: Catalog) -> None:
    # versions asked across policies (a/v2 and b/v1) while a/v1 and b/v2 exist too: only the pairs asked come back
    rows = [Registration(dg(i), "tiny", 1, f"/store/{i}", policy="ab"[i % 2]) for i in range(4)]
    catalog.register_many(rows)  # a/v1 = 0, b/v1 = 1, a/v2 = 2, b/v2 = 3
    catalog.set_alias("b", "champion", 2)
    asked = ["a/v2", "b/v1", "b", f"sha256:{dg(0)}", "a/v9", "nope/v1", "bad address!", "a/v2"]
    got = catalog.resolve_many(asked)
    assert set(got) == set(asked)
    for address in ("a/v2", "b/v1", "b", f"sha256:{dg(0)}"):
        assert got[address] == catalog.resolve(address), address
    assert (got["a/v2"].digest, got["b/v1"].digest, got["b"].digest) == (dg(2), dg(1), dg(3))
    for address in ("a/v9", "nope/v1"):
        assert isinstance(got[address], UnknownAddress), address
        with pytest.raises(UnknownAddress) as e:
            catalog.resolve(address)
        assert str(got[address]) == str(e.value)
    assert isinstance(got["bad address!"], AddressError)


def test_default_config_and_reopen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Catalog() as cat:
        cat.register(D1, "tiny", 8, "l1", policy="p")
        with cat.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    assert (tmp_path / ".mint" / "catalog.db").exists()
    with Catalog() as cat:
        assert cat.resolve("p/v1").digest == D1


def test_concurrent_writers_get_distinct_versions(tmp_path: Path) -> None:
    """Two catalogs on one SQLite file, four threads each, appending to one policy at once."""
    url = f"sqlite:///{tmp_path}/shared.db"
    cats = [Catalog(CatalogConfig(url=url)) for _ in range(2)]
    got: list[int | None] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        for i in range(10):
            v = cats[t % 2].register(dg(f"{t}-{i}"), "tiny", 1, "l", policy="p")
            with lock:
                got.append(v)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(v for v in got if v is not None) == list(range(1, 81))
    for cat in cats:
        cat.close()


# ---- leases in the catalog (the default backend; every backend: tests/integration/test_leases.py) ----


def test_lease_is_exclusive_renewed_by_its_holder_and_released(catalog: Catalog) -> None:
    leases = CatalogLeases(catalog)
    assert leases.acquire("registry/p", "a", acquire_timeout=0)
    assert leases.holder("registry/p") == "a"
    assert not leases.acquire("registry/p", "b", acquire_timeout=0.05)  # held: b waits, then gives up
    assert leases.acquire("registry/p", "a", acquire_timeout=0)  # taking it again renews it
    assert leases.acquire("registry/q", "b", acquire_timeout=0)  # another name is another lease
    assert not leases.release("registry/p", "b")  # only the holder releases
    assert leases.release("registry/p", "a")
    assert leases.holder("registry/p") is None
    assert leases.acquire("registry/p", "b", acquire_timeout=0)


def test_lease_of_a_dead_holder_expires(catalog: Catalog) -> None:
    leases = CatalogLeases(catalog)
    assert leases.acquire("promote-p", "dead", hold_timeout=0.05)
    assert not leases.acquire("promote-p", "b", acquire_timeout=0)
    assert leases.acquire("promote-p", "b", acquire_timeout=5)  # after 50 ms the lease is free
    assert leases.holder("promote-p") == "b"
    assert not leases.release("promote-p", "dead")


@pytest.mark.parametrize(
    ("url", "backend"),
    [(None, CatalogLeases), ("", CatalogLeases), ("redis://127.0.0.1:6379/0", RedisLeases)],
)
def test_leases_for_picks_the_backend_by_url(catalog: Catalog, url: str | None, backend: type) -> None:
    assert isinstance(leases_for(url, catalog), backend)  # a Redis client connects on first use, not here


@pytest.mark.parametrize("url", ["postgresql://u:secret@h/db", "sqlite:///x.db", "127.0.0.1:6379"])
def test_leases_for_refuses_other_urls(catalog: Catalog, url: str) -> None:
    with pytest.raises(ValueError, match="leases live in the catalog") as e:
        leases_for(url, catalog)
    assert "secret" not in str(e.value)  # a password never reaches an error message


# ---- the index, rebuilt from what the registry says ----


def test_reindex_policy_restores_rows_and_is_idempotent(catalog: Catalog) -> None:
    truth = {
        1: Registration(D1, "tiny", 8, "/store/d1", {"policy": "p"}),
        2: Registration(D2, "tiny", 8, "/store/d2", {"policy": "p"}),
    }
    changes, moves = reindex_rows(catalog, "p", truth, {"champion": 2}, "mlflow", "rebuild")
    assert changes and [(m.alias, m.from_version, m.to_version) for m in moves] == [("champion", None, 2)]
    assert catalog.resolve("p").digest == D2 and catalog.resolve("p/v1").location == "/store/d1"
    assert reindex_rows(catalog, "p", truth, {"champion": 2}, "mlflow", "rebuild") == ([], [])

    # damage the index: a wrong digest at v1, a stray v3, a moved alias, a wrong location
    catalog.register(D3, "tiny", 8, "/elsewhere", policy="p")  # v3
    catalog.set_alias("p", "champion", 3)
    catalog.set_alias("p", "stray", 1)
    with catalog.engine.begin() as conn:
        conn.execute(sa.update(versions).where(versions.c.version == 1).values(digest=D3))
        conn.execute(sa.text("UPDATE revisions SET location = '/wrong' WHERE digest = :d"), {"d": D2})
    dry, _ = reindex_rows(catalog, "p", truth, {"champion": 2}, "mlflow", "rebuild", dry_run=True)
    assert catalog.resolve("p").version == 3  # a dry run changes nothing
    changes, moves = reindex_rows(catalog, "p", truth, {"champion": 2}, "mlflow", "rebuild")
    assert changes == dry
    assert any("p/v3: removed" in c for c in changes) and any("p@stray: v1 -> unset" in c for c in changes)
    assert (catalog.resolve("p").version, catalog.resolve("p").location) == (2, "/store/d2")
    assert catalog.resolve("p/v1").digest == D1
    with pytest.raises(UnknownAddress):
        catalog.resolve("p/v3")
    assert catalog.alias_moves("p", "champion")[0].actor == "mlflow"
    assert reindex_rows(catalog, "p", truth, {"champion": 2}, "mlflow", "rebuild") == ([], [])
