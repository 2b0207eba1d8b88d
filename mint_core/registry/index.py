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
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from mint_core.registry.address import CatalogError, check_name
from mint_core.registry.catalog import Catalog
from mint_core.registry.catalog_schema import AliasMove, Registration, aliases, revisions, validated, versions
from mint_core.registry.leases import Leases, default_leases, held
from mint_core.registry.reader import RegistryReader, UnknownRevision
from mint_core.registry.store import AdapterStore
from mint_core.types import Digest

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
        pointed, movers = reader.aliases_and_movers(policy)
    except UnknownRevision:
        revs, pointed, movers = [], {}, {}  # deleted in MLflow: its versions and aliases leave the index
    truth: dict[int, Registration] = {}
    for rev in revs:
        location = rev.location
        if store is not None and store.exists(rev.digest):
            location = store.path(rev.digest)
        elif store is not None:
            report.not_in_store.append(f"{rev.address} ({rev.digest.prefixed})")
        truth[rev.version] = Registration(rev.digest, rev.base, rev.rank, location, {"policy": policy})
    alias_truth = {a: v for a, v in pointed.items() if v in truth}
    # a move found in MLflow is the MLflow user's who made it, when its auth app named them for this very move
    actors = {a: who for a, (v, who) in movers.items() if alias_truth.get(a) == v} if actor == ACTOR else {}
    changes, moves = reindex_rows(catalog, policy, truth, alias_truth, actor, reason, dry_run, actors)
    report.policies += 1
    report.changes += changes
    report.moves += moves


def _reindex_revisions(
    conn: Connection,
    rows: Mapping[int, Registration | None],
    now: float,
    dry_run: bool,
    changes: list[str],
) -> None:
    """The revision rows of a reindex: a revision the catalog lacks is added, one whose base, rank or location
    disagrees is overwritten (each change appended to `changes`; with `dry_run`, only appended)."""
    for reg in rows.values():
        assert reg is not None
        have = conn.execute(
            sa.select(revisions.c.base, revisions.c.rank, revisions.c.location).where(
                revisions.c.digest == reg.digest
            )
        ).first()
        if have is None:
            changes.append(f"revision {Digest(reg.digest).prefixed}: added")
            if not dry_run:
                conn.execute(
                    revisions.insert().values(
                        digest=reg.digest,
                        base=reg.base,
                        rank=reg.rank,
                        location=reg.location,
                        tags=reg.tags,
                        created=now,
                    )
                )
        elif tuple(have) != (reg.base, reg.rank, reg.location):
            changes.append(
                f"revision {Digest(reg.digest).prefixed}: base/rank/location {tuple(have)} -> "
                f"{(reg.base, reg.rank, reg.location)}"
            )
            if not dry_run:
                conn.execute(
                    revisions.update()
                    .where(revisions.c.digest == reg.digest)
                    .values(base=reg.base, rank=reg.rank, location=reg.location)
                )


def reindex_rows(
    catalog: Catalog,
    policy: str,
    truth: Mapping[int, Registration],
    alias_truth: Mapping[str, int],
    actor: str,
    reason: str,
    dry_run: bool = False,
    actors: Mapping[str, str] | None = None,
) -> tuple[list[str], list[AliasMove]]:
    """Make the catalog's index of one policy say what the registry says: its versions (number -> revision) are
    `truth` and its aliases are `alias_truth`. Rows that are missing are added, rows that disagree are
    overwritten, versions and aliases the registry no longer has are removed; each alias change is logged as
    a move by `actor` (or by `actors[alias]`, where given). Idempotent. Returns what changed (or, with `dry_run`, what would) and the moves."""
    check_name(policy, "policy", policy)
    problems: list[str] = []
    rows = {v: validated(v, reg, problems) for v, reg in truth.items()}
    if problems:
        raise CatalogError(f"cannot reindex {policy}: " + "; ".join(problems))

    def apply(conn: Connection) -> tuple[list[str], list[AliasMove]]:
        changes: list[str] = []
        moves: list[AliasMove] = []
        now = time.time()
        _reindex_revisions(conn, rows, now, dry_run, changes)
        indexed: dict[int, str] = {
            r.version: r.digest
            for r in conn.execute(
                sa.select(versions.c.version, versions.c.digest).where(versions.c.policy == policy)
            )
        }
        for version, reg in sorted(rows.items()):
            assert reg is not None
            was = indexed.get(version)
            if was == reg.digest:
                continue
            if was is None:
                changes.append(f"{policy}/v{version}: added")
                if not dry_run:
                    conn.execute(
                        versions.insert().values(
                            policy=policy, version=version, digest=reg.digest, created=now
                        )
                    )
            else:
                changes.append(f"{policy}/v{version}: sha256:{was} -> {Digest(reg.digest).prefixed}")
                if not dry_run:
                    conn.execute(
                        versions.update()
                        .where(versions.c.policy == policy, versions.c.version == version)
                        .values(digest=reg.digest)
                    )
        for version in sorted(set(indexed) - set(rows)):
            changes.append(f"{policy}/v{version}: removed (the registry no longer has it)")
            if not dry_run:
                conn.execute(
                    versions.delete().where(versions.c.policy == policy, versions.c.version == version)
                )
        pointed: dict[str, int] = {
            r.alias: r.version
            for r in conn.execute(
                sa.select(aliases.c.alias, aliases.c.version).where(aliases.c.policy == policy)
            )
        }
        for alias in sorted(set(pointed) | set(alias_truth)):
            before, after = pointed.get(alias), alias_truth.get(alias)
            if before == after:
                continue
            changes.append(f"{policy}@{alias}: {_v(before)} -> {_v(after)}")
            if not dry_run:
                who = (actors or {}).get(alias, actor)
                moves.append(catalog.move_alias(policy, alias, after, reason, who, before, conn=conn))
        return changes, moves

    return catalog.transaction(apply)


def _v(version: int | None) -> str:
    return "unset" if version is None else f"v{version}"
