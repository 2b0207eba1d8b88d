"""`GET /v1/models` names every policy whose catalog champion a request would be served, from the server's first
second: the catalog's champions (`Catalog.champions`), read through a cache that a load or unload invalidates
(`ChampionListing`), and mint serve's listing of them beside the names it holds, which carry a `revision` only once
held (reconcile and promote read a missing one as "load it")."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.catalog import Catalog, CatalogConfig, CatalogError
from mint_core.registry.store import AdapterStore
from mint_core.serving.app import build_app, load_serving_base
from mint_core.serving.champions import ChampionListing, by_name
from mint_core.serving.config import ServingConfig

ADMIN = "t0ken"


def digest_of(policy: str, digest: str) -> str:
    """A listing's card, as the tests read it: the champion's digest."""
    return digest


@dataclass
class Revisions:
    store: AdapterStore
    digests: list[str]  # four revisions of the tiny base, each in the store
    fingerprint: str


@dataclass
class Workspace:
    catalog: Catalog
    url: str
    revs: Revisions

    @property
    def digests(self) -> list[str]:
        return self.revs.digests

    def version(self, policy: str, i: int) -> int:
        digest, store = self.digests[i], self.revs.store
        v = self.catalog.register(
            digest, self.revs.fingerprint, 4, str(store.local_dir(digest)), policy=policy
        )
        assert v is not None
        return v


@pytest.fixture(scope="module")
def revs(tmp_path_factory: pytest.TempPathFactory) -> Revisions:
    root = tmp_path_factory.mktemp("champions")
    base = load_serving_base(ServingConfig(adapter_root=root / "store"))
    store = AdapterStore(root / "store")
    digests = []
    for seed in range(4):
        a = random_adapter(base.sites, ["q_proj", "v_proj"], 4, seed=seed, base_fingerprint=base.fingerprint)
        save_adapter(a, root / f"rev{seed}", base.sites)
        digests.append(str(store.put_dir(root / f"rev{seed}")))
    return Revisions(store, digests, base.fingerprint)


@pytest.fixture
def cat(revs: Revisions, tmp_path: Path) -> Iterator[Workspace]:
    """A fresh catalog: policy a (v1, v2; champion v2), b (champion v1), c (v1 and a candidate only), and a bare
    revision."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    catalog = Catalog(CatalogConfig(url=url))
    here = Workspace(catalog, url, revs)
    here.version("a", 0)
    catalog.set_alias("a", "champion", here.version("a", 1))
    catalog.set_alias("b", "champion", here.version("b", 2))
    catalog.set_alias("c", "candidate", here.version("c", 3))
    catalog.register(revs.digests[0], revs.fingerprint, 4, str(revs.store.local_dir(revs.digests[0])))
    yield here
    catalog.close()


def test_champions_are_the_policies_whose_champion_resolves_by_name(cat: Workspace) -> None:
    d = cat.digests
    assert cat.catalog.champions(10) == [("a", d[1]), ("b", d[2])]
    assert cat.catalog.champions(1) == [("a", d[1])]
    with pytest.raises(CatalogError, match="limit must be >= 0, got -1"):
        cat.catalog.champions(-1)


def test_held_names_and_champions_are_listed_by_name_a_held_one_as_held() -> None:
    held = {"m": "m held", "b": "b held"}
    champions = {"a": "a", "b": "b", "base": "base", "z": "z"}  # in name order, as the catalog reads them
    assert list(by_name(held, champions, {"base"})) == ["a", "b held", "m held", "z"]


def test_the_listing_is_read_again_after_invalidate_or_its_ttl(cat: Workspace) -> None:
    d = cat.digests
    kept = ChampionListing(cat.catalog, digest_of, ttl_s=math.inf)
    assert asyncio.run(kept.get()) == {"a": d[1], "b": d[2]}
    cat.catalog.set_alias("c", "champion", 1)
    cat.catalog.set_alias("a", "champion", 1)
    assert asyncio.run(kept.get()) == {"a": d[1], "b": d[2]}  # cached: no load or unload said otherwise
    kept.invalidate()
    assert asyncio.run(kept.get()) == {"a": d[0], "b": d[2], "c": d[3]}
    expiring = ChampionListing(cat.catalog, digest_of, ttl_s=0)
    assert asyncio.run(expiring.get()) == {"a": d[0], "b": d[2], "c": d[3]}
    cat.catalog.set_alias("a", "champion", 2)
    assert asyncio.run(expiring.get())["a"] == d[1]
    assert (
        asyncio.run(ChampionListing(None, digest_of).get()) == {}
    )  # a server without a catalog lists what it holds


def test_past_its_limit_the_listing_names_the_first_and_warns_once(
    cat: Workspace, caplog: pytest.LogCaptureFixture
) -> None:
    listing = ChampionListing(cat.catalog, digest_of, ttl_s=0, limit=1)
    with caplog.at_level(logging.WARNING, logger="mint_core.serving.champions"):
        assert asyncio.run(listing.get()) == {"a": cat.digests[1]}
        assert asyncio.run(listing.get()) == {"a": cat.digests[1]}
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "the catalog has more than 1 champions: /v1/models lists the first 1 by name (every one is still served "
        "on demand)"
    ]


def test_a_catalog_that_cannot_be_read_leaves_the_last_listing(
    cat: Workspace, caplog: pytest.LogCaptureFixture
) -> None:
    listing = ChampionListing(cat.catalog, digest_of, ttl_s=0)
    first = asyncio.run(listing.get())
    with cat.catalog.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE aliases"))
    with caplog.at_level(logging.WARNING, logger="mint_core.serving.champions"):
        assert asyncio.run(listing.get()) == first
    assert "listing the catalog's champions failed (OperationalError" in caplog.text
    assert "no such table: aliases" in caplog.text


def test_mint_serve_lists_champions_before_anything_loads_them(cat: Workspace) -> None:
    d = cat.digests
    config = ServingConfig(
        adapter_root=Path(cat.revs.store.root),
        catalog_url=cat.url,
        admin_token=ADMIN,
        torch_threads=1,
        max_model_len=64,
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with TestClient(build_app(config)) as c:

        def cards() -> dict[str, dict[str, object]]:
            return {m["id"]: m for m in c.get("/v1/models").json()["data"]}

        listed = cards()
        assert list(listed) == ["tiny-dense", "a", "b"]  # c has no champion: a request naming it is a 404
        assert listed["a"] == {
            "id": "a",
            "object": "model",
            "created": listed["tiny-dense"]["created"],
            "owned_by": "mint",
            "root": f"sha256:{d[1]}",
            "parent": "tiny-dense",
        }  # no `revision`: nothing is held under the name yet
        ask = {"model": "a", "prompt": "hi", "max_tokens": 1, "temperature": 0}
        assert c.post("/v1/completions", json=ask).json()["system_fingerprint"] == d[1]
        assert cards()["a"]["revision"] == f"sha256:{d[1]}"  # held now, on demand
        assert c.post("/v1/completions", json={**ask, "model": "c"}).status_code == 404

        # held names win: b loaded in place at another revision lists that one, until it is unloaded
        load = {"lora_name": "b", "lora_path": "a/v1", "load_inplace": True}
        assert c.post("/v1/load_lora_adapter", json=load, headers=admin).status_code == 200
        assert (cards()["b"]["revision"], cards()["b"]["root"]) == (f"sha256:{d[0]}", "a/v1")
        # an alias set with no load reaching the server is listed once the listing's cache is invalidated
        cat.catalog.set_alias("c", "champion", 1)
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=admin).status_code == 200
        after = cards()
        assert "revision" not in after["b"] and after["b"]["root"] == f"sha256:{d[2]}"
        assert after["c"]["root"] == f"sha256:{d[3]}"
