"""Promotions of one policy run one at a time: Prefect's SERIALIZABLE transactions lock through the catalog's
leases (`tasks.common.CatalogLocks`), with no Redis; a lease whose holder died frees itself."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prefect.results import ResultStore
from prefect.transactions import IsolationLevel, transaction

from mint_core.registry.catalog import Catalog, CatalogConfig
from tasks.common import CatalogLocks

pytestmark = pytest.mark.integration


def test_serializable_transactions_of_one_policy_run_one_at_a_time(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/catalog.db"
    inside: list[str] = []
    most = [0]
    guard = threading.Lock()

    def promotion(policy: str, t: int) -> None:
        store = ResultStore(lock_manager=CatalogLocks(url, hold_timeout=30))
        with transaction(
            key=f"promote-{policy}",
            isolation_level=IsolationLevel.SERIALIZABLE,
            store=store,
            overwrite=True,
            write_on_commit=False,
        ):
            with guard:
                inside.append(policy)
                most[0] = max(most[0], inside.count(policy))
            time.sleep(0.05)
            with guard:
                inside.remove(policy)

    threads = [threading.Thread(target=promotion, args=(p, t)) for t in range(4) for p in ("a", "b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert most[0] == 1  # never two promotions of one policy at once (a and b may overlap)
    with Catalog(CatalogConfig(url=url)) as cat:
        assert cat.lock_holder("promote-a") is None and cat.lock_holder("promote-b") is None


def test_lock_manager_contract(tmp_path: Path) -> None:
    locks = CatalogLocks(f"sqlite:///{tmp_path}/catalog.db", hold_timeout=0.1)
    assert locks.acquire_lock("k", "h1", acquire_timeout=0)
    assert locks.is_locked("k") and locks.is_lock_holder("k", "h1") and not locks.is_lock_holder("k", "h2")
    assert not locks.acquire_lock("k", "h2", acquire_timeout=0)
    assert locks.wait_for_lock("k", timeout=5)  # the hold timeout passes: free
    assert locks.acquire_lock("k", "h2", acquire_timeout=0)
    locks.release_lock("k", "h1")  # expired and taken by h2 since: logged, not raised
    assert locks.is_lock_holder("k", "h2")
    locks.release_lock("k", "h2")
    assert not locks.is_locked("k")
