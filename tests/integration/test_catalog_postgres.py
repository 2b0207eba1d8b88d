"""The catalog's core behaviours against a real PostgreSQL (127.0.0.1:5432, user postgres, database `test`).

Each test gets its own temporary database, `mint_test_<uuid>`, created through an autocommit connection to
`test` and dropped afterwards. Set MINT_TEST_PG_URL to point elsewhere (an admin URL; its database is only used
to create and drop the temporary ones).
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from mint_core.registry.catalog import AddressError, Catalog, CatalogConfig, CatalogError, UnknownAddress
from mint_core.registry.catalog_schema import Registration, versions
from mint_core.registry.index import reindex_rows
from mint_testkit.skips import require

pytestmark = pytest.mark.integration

ADMIN_URL = os.environ.get("MINT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def dg(i: int | str) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


D1, D2, D3 = dg(1), dg(2), dg(3)


@pytest.fixture(scope="module")
def admin() -> Iterator[sa.Engine]:
    try:
        engine = sa.create_engine(
            ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
        )
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except ImportError as e:
        require(False, f"no PostgreSQL driver ({e}); pip install 'psycopg[binary]>=3'")
    except sa.exc.OperationalError as e:
        require(False, f"PostgreSQL not reachable at {ADMIN_URL}: {str(e.orig).strip().splitlines()[0]}")
    yield engine
    engine.dispose()


@pytest.fixture
def catalog(admin: sa.Engine) -> Iterator[Catalog]:
    name = f"mint_test_{uuid.uuid4().hex}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    cat = Catalog(CatalogConfig(url=admin.url.set(database=name).render_as_string(hide_password=False)))
    try:
        yield cat
    finally:
        cat.close()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_resolve_all_four_kinds_and_alias_moves(catalog: Catalog) -> None:
    assert catalog.register(D1, "tiny", 8, "/store/d1", policy="p") == 1
    assert catalog.register(D2, "tiny", 8, "/store/d2", policy="p") == 2
    assert catalog.set_alias("p", "champion", 1) is None
    catalog.set_alias("p", "candidate", 2)
    champ = catalog.resolve("p")
    assert (champ.digest, champ.location, champ.policy, champ.version) == (D1, "/store/d1", "p", 1)
    assert catalog.resolve("p@candidate").digest == D2
    assert catalog.resolve("p/v2").location == "/store/d2"
    assert catalog.resolve(f"sha256:{D1}").policy is None
    assert catalog.set_alias("p", "champion", 2) == 1
    assert catalog.resolve("p").digest == D2


def test_versions_and_idempotent_reregister(catalog: Catalog) -> None:
    assert catalog.register(D1, "tiny", 4, "l1", tags={"k": "v"}, policy="a") == 1
    assert catalog.register(D1, "tiny", 4, "l1", policy="a") == 1
    assert catalog.register(D2, "tiny", 4, "l2", policy="b") == 1
    assert catalog.register(D3, "tiny", 4, "l3", policy="a") == 2
    assert catalog.register(D1, "tiny", 4, "l1", policy="a") == 3
    assert (catalog.count(), catalog.count("a"), catalog.count("b")) == (3, 3, 1)
    assert catalog.list(policy="a")[0].tags == {"k": "v"}


def test_unknown_and_deleted(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    catalog.register(D2, "tiny", 8, "l2", policy="p")
    catalog.set_alias("p", "champion", 2)
    with pytest.raises(UnknownAddress, match="unknown policy 'nobody'"):
        catalog.resolve("nobody")
    with pytest.raises(UnknownAddress, match="has no alias 'staging'; its aliases: champion"):
        catalog.resolve("p@staging")
    with pytest.raises(UnknownAddress, match=r"has 2 version\(s\), v1..v2"):
        catalog.resolve("p/v3")
    with pytest.raises(AddressError, match="64 lowercase hex"):
        catalog.resolve("sha256:abc")
    with catalog.engine.begin() as conn:
        conn.execute(sa.delete(versions).where(versions.c.policy == "p", versions.c.version == 2))
    with pytest.raises(UnknownAddress, match=r"alias p@champion points at p/v2, a version missing"):
        catalog.resolve("p")


def test_list_filters(catalog: Catalog) -> None:
    catalog.register(D1, "tiny", 8, "l1", tags={"task": "math"}, policy="a")
    catalog.register(D2, "tiny", 16, "l2", tags={"task": "code"}, policy="a")
    catalog.register(D3, "other", 8, "l3", policy="b")
    catalog.register(dg(4), "tiny", 8, "l4")
    assert [(e.policy, e.version) for e in catalog.list(policy="a")] == [("a", 1), ("a", 2)]
    assert {e.digest for e in catalog.list(base="tiny", rank=8)} == {D1, dg(4)}
    assert [e.digest for e in catalog.list(tag="task=math")] == [D1]
    assert {e.digest for e in catalog.list(tag="task")} == {D1, D2}
    assert [e.digest for e in catalog.list(policy="a", limit=1, offset=1)] == [D2]
    assert catalog.referenced_digests() == {D1, D2, D3, dg(4)}


def test_validation_writes_nothing(catalog: Catalog) -> None:
    with pytest.raises(CatalogError, match="rank must be an integer >= 1"):
        catalog.register_many(
            [Registration(D1, "tiny", 8, "l1", policy="p"), Registration(D2, "tiny", 0, "l")]
        )
    catalog.register(D1, "tiny", 8, "l1", policy="p")
    with pytest.raises(CatalogError, match="base and rank cannot change"):
        catalog.register(D1, "tiny", 16, "l1", policy="q")
    assert (catalog.count(), catalog.count("p"), catalog.count("q")) == (1, 1, 0)


def test_bulk_register_then_resolve(catalog: Catalog) -> None:
    n = 10_000
    rows = [Registration(dg(i), "tiny", 1, f"/store/{i}", policy=f"p{i % 1000}") for i in range(n)]
    assert catalog.register_many(rows) == [i // 1000 + 1 for i in range(n)]
    assert catalog.count() == n
    catalog.set_alias("p7", "champion", 10)
    assert catalog.resolve("p7").digest == dg(9007)
    assert catalog.resolve("p123/v4").location == "/store/3123"
    assert len(catalog.referenced_digests()) == n


def test_concurrent_writers_get_distinct_versions(catalog: Catalog) -> None:
    """Eight threads append to one policy at once: every version from 1 to 80 exists exactly once."""
    got: list[int | None] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        for i in range(10):
            v = catalog.register(dg(f"{t}-{i}"), "tiny", 1, "l", policy="p")
            with lock:
                got.append(v)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(v for v in got if v is not None) == list(range(1, 81))
    assert catalog.count("p") == 80


def test_reindex_policy(catalog: Catalog) -> None:
    truth = {1: Registration(D1, "tiny", 8, "/d1"), 2: Registration(D2, "tiny", 8, "/d2")}
    catalog.register(D3, "tiny", 8, "/d3", policy="p")
    changes, moves = reindex_rows(catalog, "p", truth, {"champion": 2}, "mlflow", "rebuild")
    assert "p/v1: sha256:" in changes[2] and len(moves) == 1
    assert catalog.resolve("p").digest == D2 and catalog.resolve("p/v1").digest == D1
    assert reindex_rows(catalog, "p", truth, {"champion": 2}, "mlflow", "rebuild") == ([], [])
