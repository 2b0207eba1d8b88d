"""The catalog as an index of the registry: rebuilt from MLflow (the truth for versions and aliases) plus the
adapter store (where each revision's bytes are now).

`rebuild_catalog` makes the catalog's versions and aliases of every policy MLflow holds agree with MLflow:
missing rows are added, rows that disagree are overwritten, versions MLflow no longer has are dropped, and each
alias it corrects is logged as a move by `mlflow`. It is idempotent (a second run changes nothing) and reports
what it changed. The registry runs it for one policy after a write and when reconcile sees an alias moved in the
MLflow UI; `mint catalog rebuild` runs it for all. Revisions the catalog holds outside any MLflow policy (bulk
registrations, packs) are left as they are.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from mint_core.registry.catalog import AliasMove, Catalog, Registration
from mint_core.registry.leases import Leases, default_leases, held
from mint_core.registry.reader import RegistryReader, UnknownRevision
from mint_core.registry.store import AdapterStore

ACTOR = "mlflow"
"""Who the move log names for an alias move made in MLflow and found by a rebuild."""
REASON = "moved in MLflow (found by catalog rebuild)"


def registry_lock(policy: str) -> str:
    """Name of the lease that registry writes of `policy` hold (version numbering, alias moves)."""
    return f"registry/{policy}"


def new_holder(actor: str) -> str:
    """A lock holder unique to this call: who, on which machine and process."""
    return f"{actor}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class RebuildReport:
    """What a rebuild changed (or, dry, would change)."""

    policies: int = 0
    """Policies MLflow holds that were compared."""
    changes: list[str] = field(default_factory=list)
    """One line per row added, corrected or removed."""
    moves: list[AliasMove] = field(default_factory=list)
    """The alias corrections, as logged."""
    not_in_store: list[str] = field(default_factory=list)
    """Versions whose bytes the store does not hold (indexed at their MLflow source)."""


def rebuild_catalog(
    reader: RegistryReader,
    catalog: Catalog,
    store: AdapterStore | None,
    policies: Iterable[str] | None = None,
    dry_run: bool = False,
    actor: str = ACTOR,
    reason: str = REASON,
    leases: Leases | None = None,
) -> RebuildReport:
    """Make the catalog's index of `policies` (default: every policy MLflow holds) agree with MLflow, holding each
    policy's registry lease from `leases` (default: where $MINT_LOCK_URL says, else the catalog)."""
    report = RebuildReport()
    leases = default_leases(catalog) if leases is None else leases
    for policy in reader.policies() if policies is None else policies:
        with held(leases, registry_lock(policy), new_holder("rebuild")):
            reindex_policy(reader, catalog, store, policy, report, dry_run, actor, reason)
    return report


def reindex_policy(
    reader: RegistryReader,
    catalog: Catalog,
    store: AdapterStore | None,
    policy: str,
    report: RebuildReport,
    dry_run: bool = False,
    actor: str = ACTOR,
    reason: str = REASON,
) -> None:
    """`rebuild_catalog` of one policy, for a caller that holds its registry lock; adds to `report`."""
    try:
        revs = reader.revisions(policy)
        pointed = reader.aliases(policy)
    except UnknownRevision:
        revs, pointed = [], {}  # deleted in MLflow: its versions and aliases leave the index
    truth: dict[int, Registration] = {}
    for rev in revs:
        location = rev.location
        if store is not None and store.exists(rev.digest):
            location = store.path(rev.digest)
        elif store is not None:
            report.not_in_store.append(f"{rev.address} ({rev.digest.prefixed})")
        truth[rev.version] = Registration(rev.digest, rev.base, rev.rank, location, {"policy": policy})
    alias_truth = {a: v for a, v in pointed.items() if v in truth}
    changes, moves = catalog.reindex_policy(policy, truth, alias_truth, actor, reason, dry_run)
    report.policies += 1
    report.changes += changes
    report.moves += moves
