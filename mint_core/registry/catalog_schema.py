"""What the catalog stores: its tables (SQLAlchemy Core) and the records it takes and gives back
(`Registration` in, checked by `validated`; `Resolved`, `Entry` and `AliasMove` out). `catalog.py` reads and
writes them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from mint_core.registry.address import NAME_RE
from mint_core.types import Digest, DigestError

# ---- tables -------------------------------------------------------------------------------------------------

metadata = sa.MetaData()

revisions = sa.Table(
    "revisions",
    metadata,
    sa.Column("digest", sa.CHAR(64), primary_key=True),
    sa.Column("base", sa.Text, nullable=False),
    sa.Column("rank", sa.Integer, nullable=False),
    sa.Column("location", sa.Text, nullable=False),
    sa.Column("tags", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("created", sa.Float, nullable=False),
    sa.Index("ix_revisions_base_rank", "base", "rank"),
    sa.Index("ix_revisions_rank", "rank"),
    sa.Index("ix_revisions_created", "created", "digest"),
)

versions = sa.Table(
    "versions",
    metadata,
    sa.Column("policy", sa.String(128), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("digest", sa.CHAR(64), sa.ForeignKey("revisions.digest"), nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Index("ix_versions_digest", "digest"),
)

# No foreign key to `versions`: an alias may outlive the version it names, and resolve says so.
aliases = sa.Table(
    "aliases",
    metadata,
    sa.Column("policy", sa.String(128), primary_key=True),
    sa.Column("alias", sa.String(128), primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
)

# Every alias move made through mint (and every move made elsewhere, e.g. in the MLflow UI, once reconcile sees
# it): when, from, to, why, by whom. Append-only; the newest row per (policy, alias) says where it points.
alias_moves = sa.Table(
    "alias_moves",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("policy", sa.String(128), nullable=False),
    sa.Column("alias", sa.String(128), nullable=False),
    sa.Column("from_version", sa.Integer, nullable=True),
    sa.Column("to_version", sa.Integer, nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("actor", sa.String(128), nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Index("ix_alias_moves_policy", "policy", "alias", "id"),
)

# Named leases (`mint_core.registry.leases.CatalogLeases`): one row per name ever locked; held while `holder` is
# set and `expires` (unix seconds) is in the future.
locks = sa.Table(
    "locks",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("holder", sa.Text, nullable=True),
    sa.Column("expires", sa.Float, nullable=True),
)


# ---- records ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Registration:
    """One revision to register, optionally as the next version of `policy`."""

    digest: Digest | str
    base: str
    rank: int
    location: str
    tags: Mapping[str, str] | None = None
    policy: str | None = None


@dataclass(frozen=True, slots=True)
class Resolved:
    """What an address names: the revision's digest and blob location, and the policy version if any."""

    digest: Digest
    location: str
    policy: str | None = None
    version: int | None = None


@dataclass(frozen=True, slots=True)
class AliasMove:
    """One move of `policy@alias`: from one version to another (None: unset), when, why and by whom."""

    policy: str
    alias: str
    from_version: int | None
    to_version: int | None
    reason: str
    actor: str
    at: float


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of `Catalog.list`: a revision, and the policy version it is (None for a bare revision)."""

    digest: Digest
    base: str
    rank: int
    location: str
    tags: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    policy: str | None = None
    version: int | None = None


def validated(i: int, row: Registration | Mapping[str, Any], problems: list[str]) -> Registration | None:
    """The row with its digest normalized, or None after appending what is wrong with it to `problems`."""
    where = f"row {i}"
    try:
        reg = row if isinstance(row, Registration) else Registration(**row)
    except TypeError as e:
        problems.append(f"{where}: {e}")
        return None
    bad: list[str] = []
    digest = Digest.trusted("")
    try:
        digest = Digest.parse(reg.digest)
    except DigestError as e:
        bad.append(str(e))
    where = f"row {i} ({reg.digest!r})"
    if not isinstance(reg.base, str) or not reg.base:
        bad.append(f"base must be a non-empty string, got {reg.base!r}")
    if not isinstance(reg.rank, int) or isinstance(reg.rank, bool) or reg.rank < 1:
        bad.append(f"rank must be an integer >= 1, got {reg.rank!r}")
    if not isinstance(reg.location, str) or not reg.location:
        bad.append(f"location must be a non-empty string, got {reg.location!r}")
    if reg.tags is not None and not (
        isinstance(reg.tags, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in reg.tags.items())
    ):
        bad.append(f"tags must be a mapping of str to str, got {reg.tags!r}")
    if reg.policy is not None and not (isinstance(reg.policy, str) and NAME_RE.fullmatch(reg.policy)):
        bad.append(f"policy {reg.policy!r} must be 1-128 of [A-Za-z0-9._-], starting with a letter or digit")
    if bad:
        problems.extend(f"{where}: {b}" for b in bad)
        return None
    tags = dict(reg.tags) if reg.tags is not None else None
    return Registration(digest, reg.base, reg.rank, reg.location, tags, reg.policy)
