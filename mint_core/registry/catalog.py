"""The catalog: every addressable adapter revision, address -> digest -> blob location.

Its addresses (`policy`, `policy@alias`, `policy/v7`, `sha256:<hex>`) are parsed in `mint_core.registry.address`
and re-exported here. The catalog is an index: MLflow is the truth for a policy's versions and aliases, and
`mint_core.registry.index` rebuilds the catalog's rows of them from MLflow and the store.

Three tables hold it: `revisions` (one row per digest: base, rank, blob location, tags), `versions` (policy,
version -> digest) and `aliases` (policy, alias -> version). SQLite by default (WAL, busy timeout), any
SQLAlchemy URL otherwise (PostgreSQL for many writers). SQLAlchemy Core rather than the ORM so that a million
entries register in bulk in seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy.engine import Connection, Engine

from mint_core.registry.address import (
    CHAMPION,
    NAME_RE,
    Address,
    AddressError,
    AddressKind,
    CatalogError,
    check_name,
    parse_address,
)
from mint_core.registry.retry import retried
from mint_core.types import Digest, DigestError

logger = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK = 10_000
_PG_VERSIONS_LOCK = 0x6D696E745F766572  # "mint_ver": the advisory lock that serializes version appends

__all__ = [
    "CHAMPION",
    "Address",
    "AddressError",
    "AddressKind",
    "AliasMove",
    "Catalog",
    "CatalogConfig",
    "CatalogError",
    "Entry",
    "Registration",
    "Resolved",
    "UnknownAddress",
    "parse_address",
]

# ---- errors -------------------------------------------------------------------------------------------------


class UnknownAddress(CatalogError):
    """A well-formed address that names nothing in the catalog."""


# ---- config -------------------------------------------------------------------------------------------------


class CatalogConfig(BaseModel):
    """Where the catalog index lives."""

    url: str = "sqlite:///.mint/catalog.db"
    """Any SQLAlchemy URL. SQLite (the default, a file under `.mint/`) for one machine;
    `postgresql+psycopg://user@host:5432/db` when several processes or machines write."""

    busy_timeout_ms: int = Field(default=5000, ge=0)
    """SQLite only: how long a writer waits for another writer's lock before failing."""

    echo: bool = False
    """Log every SQL statement (debugging)."""


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


def _validated(i: int, row: Registration | Mapping[str, Any], problems: list[str]) -> Registration | None:
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


def _chunks(rows: Sequence[Registration], n: int) -> Iterator[Sequence[Registration]]:
    for start in range(0, len(rows), n):
        yield rows[start : start + n]


def _sqlite_pragmas(busy_timeout_ms: int, in_memory: bool):  # type: ignore[no-untyped-def]
    def on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cur = dbapi_connection.cursor()
        if not in_memory:
            cur.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: durable across process crashes, and a commit costs no fsync of the main file
            cur.execute("PRAGMA synchronous=NORMAL")
        # 64 MiB page cache (default 2 MiB): random digest keys touch index pages all over the file
        cur.execute("PRAGMA cache_size=-65536")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    return on_connect


# ---- the catalog --------------------------------------------------------------------------------------------


class Catalog:
    """Address -> digest -> location over one SQLAlchemy database; creates its tables on first use."""

    def __init__(self, config: CatalogConfig | None = None):
        self.config = config or CatalogConfig()
        url = sa.make_url(self.config.url)
        in_memory = False
        if url.get_backend_name() == "sqlite":
            in_memory = url.database in (None, "", ":memory:")
            if not in_memory and url.database:
                Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = sa.create_engine(url, echo=self.config.echo)
        if url.get_backend_name() == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_pragmas(self.config.busy_timeout_ms, in_memory))
        self._create_tables()

    def _create_tables(self) -> None:
        """Create what is missing; two processes opening a new catalog at once race, and the loser looks again
        (PostgreSQL may tell the loser "duplicate key" on its own type catalog rather than "already exists")."""
        for attempt in range(3):
            try:
                metadata.create_all(self.engine)
                return
            except (sa.exc.OperationalError, sa.exc.ProgrammingError, sa.exc.IntegrityError) as e:
                lost_race = "already exists" in str(e.orig) or "duplicate key" in str(e.orig)
                if not lost_race or attempt == 2:
                    raise

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writes ----

    def register(
        self,
        digest: str,
        base: str,
        rank: int,
        location: str,
        tags: Mapping[str, str] | None = None,
        policy: str | None = None,
    ) -> int | None:
        """Record a revision (idempotent by digest) and, with `policy`, make it that policy's next version.

        Returns the version, or None without a policy. Registering the digest that already is the policy's
        latest version returns that version instead of appending another, so a retried export is harmless.
        A digest already recorded with another base or rank is an error; its location and tags are updated.
        """
        return self.register_many([Registration(digest, base, rank, location, tags, policy)])[0]

    def register_many(self, rows: Iterable[Registration | Mapping[str, Any]]) -> list[int | None]:
        """`register` for many rows: every row is checked first (a bad one writes nothing), then rows are
        written in chunks of 10,000, one transaction each. Returns each row's version (None without policy)."""
        problems: list[str] = []
        checked: list[Registration] = []
        for i, row in enumerate(rows):
            reg = _validated(i, row, problems)
            if reg is not None:
                checked.append(reg)
        first: dict[str, Registration] = {}
        for i, reg in enumerate(checked):
            seen = first.setdefault(reg.digest, reg)
            if (seen.base, seen.rank) != (reg.base, reg.rank):
                problems.append(
                    f"row {i} ({reg.digest!r}): base/rank {reg.base!r}/{reg.rank} disagree with an earlier "
                    f"row's {seen.base!r}/{seen.rank} for the same digest"
                )
        if problems:
            shown = "\n".join(f"  - {p}" for p in problems[:10])
            more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise CatalogError(f"{len(problems)} problem(s) in registration; nothing written:\n{shown}{more}")

        out: list[int | None] = []
        for chunk in _chunks(checked, CHUNK):
            out.extend(self._transaction(partial(self._write_chunk, chunk=chunk)))
        return out

    def _transaction(self, fn: Callable[[Connection], T]) -> T:
        """`fn(conn)` in one transaction, run again (the shared `RETRY` policy) when it met a transient error:
        a locked SQLite file, a deadlock, or a concurrent writer that took the same key first."""

        def once() -> T:
            with self.engine.begin() as conn:
                return fn(conn)

        try:
            return retried(once)
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as e:
            raise CatalogError(f"catalog write failed: {e.orig}") from e

    def _write_chunk(self, conn: Connection, chunk: Sequence[Registration]) -> list[int | None]:
        now = time.time()
        digests = list({r.digest: None for r in chunk})
        existing = {
            d: (b, k, loc, t)
            for d, b, k, loc, t in conn.execute(
                sa.select(
                    revisions.c.digest,
                    revisions.c.base,
                    revisions.c.rank,
                    revisions.c.location,
                    revisions.c.tags,
                ).where(revisions.c.digest.in_(digests))
            )
        }
        clashes = [
            f"{r.digest}: recorded as base {existing[r.digest][0]!r} rank {existing[r.digest][1]}, "
            f"given base {r.base!r} rank {r.rank}"
            for r in chunk
            if r.digest in existing and existing[r.digest][:2] != (r.base, r.rank)
        ]
        if clashes:
            raise CatalogError(
                "a digest names fixed bytes, so its base and rank cannot change:\n  "
                + "\n  ".join(clashes[:10])
            )

        new: dict[str, dict[str, Any]] = {}
        changed: dict[str, dict[str, Any]] = {}
        for r in chunk:
            if r.digest in existing:
                _, _, old_location, old_tags = existing[r.digest]
                tags = r.tags if r.tags is not None else old_tags
                if (r.location, tags) != (old_location, old_tags):
                    changed[r.digest] = {"d": r.digest, "location": r.location, "tags": tags}
                    existing[r.digest] = (r.base, r.rank, r.location, tags)
            else:
                new[r.digest] = {
                    "digest": r.digest,
                    "base": r.base,
                    "rank": r.rank,
                    "location": r.location,
                    "tags": r.tags,
                    "created": now,
                }
        if new:
            conn.execute(revisions.insert(), list(new.values()))
        if changed:
            conn.execute(
                revisions.update()
                .where(revisions.c.digest == sa.bindparam("d"))
                .values(location=sa.bindparam("location"), tags=sa.bindparam("tags")),
                list(changed.values()),
            )

        policies = list({r.policy: None for r in chunk if r.policy is not None})
        if not policies:
            return [None] * len(chunk)
        # Appends are serialized so that two writers never compute the same next version: on SQLite this
        # transaction holds the write lock since the writes above; on PostgreSQL a transaction-scoped advisory
        # lock does it. Elsewhere a race ends in a key clash and `_transaction` runs the chunk again.
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_VERSIONS_LOCK})
        latest: dict[str, tuple[int, str]] = {}
        for start in range(0, len(policies), 1000):
            part = policies[start : start + 1000]
            v2 = versions.alias("v2")
            rows = conn.execute(
                sa.select(versions.c.policy, versions.c.version, versions.c.digest).where(
                    versions.c.policy.in_(part),
                    versions.c.version
                    == sa.select(sa.func.max(v2.c.version))
                    .where(v2.c.policy == versions.c.policy)
                    .scalar_subquery(),
                )
            )
            latest.update({p: (v, d) for p, v, d in rows})
        out: list[int | None] = []
        inserts: list[dict[str, Any]] = []
        for r in chunk:
            if r.policy is None:
                out.append(None)
                continue
            version, digest = latest.get(r.policy, (0, ""))
            if digest != r.digest:
                version += 1
                latest[r.policy] = (version, r.digest)
                inserts.append({"policy": r.policy, "version": version, "digest": r.digest, "created": now})
            out.append(version)
        if inserts:
            conn.execute(versions.insert(), inserts)
        return out

    def set_alias(self, policy: str, alias: str, version: int) -> int | None:
        """Point `policy@alias` at an existing version; returns the version it pointed at before (or None)."""
        s = f"{policy}@{alias}"
        check_name(s, "policy", policy)
        check_name(s, "alias", alias)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CatalogError(f"cannot set {s}: version must be an integer >= 1, got {version!r}")

        def move(conn: Connection) -> int | None:
            found = conn.execute(
                sa.select(versions.c.version).where(
                    versions.c.policy == policy, versions.c.version == version
                )
            ).first()
            if found is None:
                raise UnknownAddress(
                    f"cannot set {s} -> v{version}: {self._policy_versions_text(conn, policy)}"
                )
            before = conn.execute(
                sa.select(aliases.c.version).where(aliases.c.policy == policy, aliases.c.alias == alias)
            ).scalar_one_or_none()
            if before is None:
                conn.execute(aliases.insert().values(policy=policy, alias=alias, version=version))
            elif before != version:
                conn.execute(
                    aliases.update()
                    .where(aliases.c.policy == policy, aliases.c.alias == alias)
                    .values(version=version)
                )
            return before

        before = self._transaction(move)
        logger.info("alias %s: v%s -> v%d", s, before, version)
        return before

    def record_version(
        self, policy: str, version: int, reg: Registration, conn: Connection | None = None
    ) -> None:
        """Record `policy/v<version>` -> `reg` with a number given by another registry (MLflow numbers the
        versions of a registered model). Idempotent; a different digest already at that number is an error."""
        check_name(f"{policy}/v{version}", "policy", policy)
        problems: list[str] = []
        checked = _validated(0, reg, problems)
        if checked is None:
            raise CatalogError(f"cannot record {policy}/v{version}: " + "; ".join(problems))

        def write(c: Connection) -> None:
            self._write_chunk(
                c, [Registration(checked.digest, checked.base, checked.rank, checked.location, checked.tags)]
            )
            have = c.execute(
                sa.select(versions.c.digest).where(versions.c.policy == policy, versions.c.version == version)
            ).scalar_one_or_none()
            if have is None:
                c.execute(
                    versions.insert().values(
                        policy=policy, version=version, digest=checked.digest, created=time.time()
                    )
                )
            elif have != checked.digest:
                raise CatalogError(
                    f"{policy}/v{version} is already sha256:{have}; it cannot become {Digest(checked.digest).prefixed}"
                )

        if conn is not None:
            write(conn)
        else:
            self._transaction(write)

    def forget_versions(self, policy: str, numbers: Iterable[int]) -> list[str]:
        """Drop `policy/vN` rows the registry deleted, and the revision rows only they named (those the registry
        indexed, tagged `policy`; bare registrations stay), so `gc` may free their bytes. An alias naming one of
        them is an error and nothing is dropped. Idempotent; returns what was dropped."""
        check_name(policy, "policy", policy)
        wanted = sorted(set(numbers))

        def forget(conn: Connection) -> list[str]:
            pointed = conn.execute(
                sa.select(aliases.c.alias, aliases.c.version).where(
                    aliases.c.policy == policy, aliases.c.version.in_(wanted)
                )
            ).all()
            if pointed:
                held_by = ", ".join(f"{policy}@{a} -> v{v}" for a, v in pointed)
                raise CatalogError(f"cannot forget versions an alias names ({held_by}); nothing dropped")
            rows = conn.execute(
                sa.select(versions.c.version, versions.c.digest).where(
                    versions.c.policy == policy, versions.c.version.in_(wanted)
                )
            ).all()
            if not rows:
                return []
            conn.execute(versions.delete().where(versions.c.policy == policy, versions.c.version.in_(wanted)))
            out = [f"{policy}/v{v}" for v, _ in rows]
            digests = list({d for _, d in rows})
            still = set(
                conn.execute(sa.select(versions.c.digest).where(versions.c.digest.in_(digests))).scalars()
            )
            for d, tags in conn.execute(
                sa.select(revisions.c.digest, revisions.c.tags).where(revisions.c.digest.in_(digests))
            ):
                if d not in still and (tags or {}).get("policy"):
                    conn.execute(revisions.delete().where(revisions.c.digest == d))
                    out.append(f"revision sha256:{d}")
            return out

        return self._transaction(forget) if wanted else []

    # ---- leases ----
    #
    # The SQL of `mint_core.registry.leases.CatalogLeases`, the default backend of mint's one lock mechanism: take
    # leases through `leases_for` (which picks this or Redis), never through these methods. One row per name;
    # held while `holder` is set and `expires` has not passed, so a holder that dies frees its lease then.

    def take_lock(self, name: str, holder: str, hold_s: float) -> bool:
        """One try at the lease `name` for `holder` for `hold_s` seconds; taking a lease one already holds renews
        it. False when another holder has it."""
        return bool(self._transaction(lambda conn: self._take(conn, name, holder, hold_s)))

    @staticmethod
    def _take(conn: Connection, name: str, holder: str, hold_s: float) -> bool:
        now = time.time()
        free = sa.or_(locks.c.holder.is_(None), locks.c.holder == holder, locks.c.expires < now)
        taken = conn.execute(
            locks.update().where(locks.c.name == name, free).values(holder=holder, expires=now + hold_s)
        ).rowcount
        if taken:
            return True
        if conn.execute(sa.select(locks.c.name).where(locks.c.name == name)).first() is not None:
            return False
        conn.execute(locks.insert().values(name=name, holder=holder, expires=now + hold_s))
        return True

    def release_lock(self, name: str, holder: str) -> bool:
        """Give the lease back; False when `holder` no longer held it (it had expired and maybe been taken)."""
        return bool(
            self._transaction(
                lambda conn: (
                    conn.execute(
                        locks.update()
                        .where(locks.c.name == name, locks.c.holder == holder)
                        .values(holder=None, expires=None)
                    ).rowcount
                )
            )
        )

    def lock_holder(self, name: str) -> str | None:
        """Who holds the lease `name` now, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(locks.c.holder, locks.c.expires).where(locks.c.name == name)).first()
        if row is None or row[0] is None or (row[1] is not None and row[1] < time.time()):
            return None
        return str(row[0])

    def move_alias(
        self,
        policy: str,
        alias: str,
        version: int | None,
        reason: str,
        actor: str,
        before: int | None,
        conn: Connection | None = None,
    ) -> AliasMove:
        """Point the index's `policy@alias` at `version` (None: remove it) and log the move from `before`. The
        caller moved the alias in MLflow (the truth) first, under the policy's lock."""
        check_name(f"{policy}@{alias}", "alias", alias)
        if conn is None:
            return self._transaction(
                lambda c: self.move_alias(policy, alias, version, reason, actor, before, conn=c)
            )
        conn.execute(aliases.delete().where(aliases.c.policy == policy, aliases.c.alias == alias))
        if version is not None:
            conn.execute(aliases.insert().values(policy=policy, alias=alias, version=version))
        move = AliasMove(policy, alias, before, version, reason, actor, time.time())
        conn.execute(
            alias_moves.insert().values(
                policy=policy,
                alias=alias,
                from_version=before,
                to_version=version,
                reason=reason,
                actor=actor,
                at=move.at,
            )
        )
        return move

    def reindex_policy(
        self,
        policy: str,
        truth: Mapping[int, Registration],
        alias_truth: Mapping[str, int],
        actor: str,
        reason: str,
        dry_run: bool = False,
    ) -> tuple[list[str], list[AliasMove]]:
        """Make the index of one policy say what the registry says: its versions (number -> revision) are
        `truth` and its aliases are `alias_truth`. Rows that are missing are added, rows that disagree are
        overwritten, versions and aliases the registry no longer has are removed; each alias change is logged as
        a move by `actor`. Idempotent. Returns what changed (or, with `dry_run`, what would) and the moves."""
        check_name(policy, "policy", policy)
        problems: list[str] = []
        rows = {v: _validated(v, reg, problems) for v, reg in truth.items()}
        if problems:
            raise CatalogError(f"cannot reindex {policy}: " + "; ".join(problems))

        def apply(conn: Connection) -> tuple[list[str], list[AliasMove]]:
            changes: list[str] = []
            moves: list[AliasMove] = []
            now = time.time()
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
                    moves.append(self.move_alias(policy, alias, after, reason, actor, before, conn=conn))
            return changes, moves

        return self._transaction(apply)

    # ---- reads ----

    def alias_moves(self, policy: str, alias: str | None = None, limit: int = 100) -> list[AliasMove]:
        """The newest `limit` moves of the policy's aliases (or of one alias), newest first."""
        q = sa.select(
            alias_moves.c.policy,
            alias_moves.c.alias,
            alias_moves.c.from_version,
            alias_moves.c.to_version,
            alias_moves.c.reason,
            alias_moves.c.actor,
            alias_moves.c.at,
        ).where(alias_moves.c.policy == policy)
        if alias is not None:
            q = q.where(alias_moves.c.alias == alias)
        with self.engine.connect() as conn:
            rows = conn.execute(q.order_by(alias_moves.c.id.desc()).limit(limit)).all()
        return [AliasMove(*r) for r in rows]

    def entry(self, digest: str) -> Entry:
        """The revision row of one digest (policy and version None). Raises `UnknownAddress`."""
        digest = Digest.parse(digest)
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    revisions.c.digest,
                    revisions.c.base,
                    revisions.c.rank,
                    revisions.c.location,
                    revisions.c.tags,
                    revisions.c.created,
                ).where(revisions.c.digest == digest)
            ).first()
        if row is None:
            raise UnknownAddress(f"no revision {digest.prefixed} in the catalog")
        d, b, k, loc, t, created = row
        return Entry(Digest.trusted(d), b, k, loc, dict(t or {}), created)

    def alias_version(self, policy: str, alias: str) -> int | None:
        """The version the catalog's `policy@alias` names, or None."""
        with self.engine.connect() as conn:
            return conn.execute(
                sa.select(aliases.c.version).where(aliases.c.policy == policy, aliases.c.alias == alias)
            ).scalar_one_or_none()

    def resolve(self, address: str | Address) -> Resolved:
        """The revision an address names; `policy` alone means `policy@champion`. Raises `UnknownAddress`."""
        addr = address if isinstance(address, Address) else parse_address(address)
        with self.engine.connect() as conn:
            if addr.kind == "digest":
                loc = conn.execute(
                    sa.select(revisions.c.location).where(revisions.c.digest == addr.digest)
                ).scalar_one_or_none()
                assert addr.digest is not None
                if loc is None:
                    raise UnknownAddress(f"no revision {addr.digest.prefixed} in the catalog")
                return Resolved(addr.digest, loc)
            policy = addr.policy
            assert policy is not None
            if addr.kind == "version":
                row = conn.execute(
                    sa.select(versions.c.digest, revisions.c.location)
                    .join_from(versions, revisions, versions.c.digest == revisions.c.digest)
                    .where(versions.c.policy == policy, versions.c.version == addr.version)
                ).first()
                if row is None:
                    raise UnknownAddress(
                        f"unknown address {str(addr)!r}: {self._policy_versions_text(conn, policy)}"
                    )
                return Resolved(Digest.trusted(row[0]), row[1], policy, addr.version)
            alias = addr.alias or CHAMPION
            hit = conn.execute(
                sa.select(aliases.c.version, versions.c.digest, revisions.c.location)
                .select_from(
                    aliases.outerjoin(
                        versions,
                        sa.and_(
                            versions.c.policy == aliases.c.policy, versions.c.version == aliases.c.version
                        ),
                    ).outerjoin(revisions, revisions.c.digest == versions.c.digest)
                )
                .where(aliases.c.policy == policy, aliases.c.alias == alias)
            ).first()
            if hit is None:
                raise UnknownAddress(self._missing_alias_text(conn, addr, alias))
            version, digest, location = hit
            if digest is None or location is None:
                raise UnknownAddress(
                    f"address {str(addr)!r}: alias {policy}@{alias} points at {policy}/v{version}, "
                    f"a version missing from the catalog (deleted?); move the alias to an existing version"
                )
            return Resolved(Digest.trusted(digest), location, policy, version)

    def resolve_many(self, addresses: Sequence[str]) -> dict[str, Resolved | CatalogError]:
        """`resolve` for many addresses in a few queries (versions and digests in bulk; aliases one by one).
        Each address maps to its answer or to the error `resolve` would raise for it."""
        out: dict[str, Resolved | CatalogError] = {}
        by_version: dict[tuple[str, int], str] = {}
        by_digest: dict[str, str] = {}
        for a in dict.fromkeys(addresses):
            try:
                addr = parse_address(a)
            except AddressError as e:
                out[a] = e
                continue
            if addr.kind == "version":
                assert addr.policy is not None and addr.version is not None
                by_version[(addr.policy, addr.version)] = a
            elif addr.kind == "digest":
                assert addr.digest is not None
                by_digest[addr.digest] = a
            else:
                try:
                    out[a] = self.resolve(addr)
                except CatalogError as e:
                    out[a] = e
        with self.engine.connect() as conn:
            # per version, `policy IN (..) AND version = v`: one primary-key search per address. SQLite plans a
            # row-value `(policy, version) IN (..)` as a scan of the whole table (80 ms at a million
            # versions), an OR of pairs costs 30x this in planning, and `policy IN AND version IN` can return
            # the cross product of both lists
            policies_of: dict[int, list[str]] = {}
            for p, v in by_version:
                policies_of.setdefault(v, []).append(p)
            for v, names in policies_of.items():
                for start in range(0, len(names), 500):
                    rows = conn.execute(
                        sa.select(versions.c.policy, versions.c.digest, revisions.c.location)
                        .join_from(versions, revisions, versions.c.digest == revisions.c.digest)
                        .where(versions.c.version == v, versions.c.policy.in_(names[start : start + 500]))
                    )
                    for p, d, loc in rows:
                        out[by_version[(p, v)]] = Resolved(Digest.trusted(d), loc, p, v)
            digests = list(by_digest)
            for start in range(0, len(digests), 500):
                some = digests[start : start + 500]
                for d, loc in conn.execute(
                    sa.select(revisions.c.digest, revisions.c.location).where(revisions.c.digest.in_(some))
                ):
                    out[by_digest[d]] = Resolved(Digest.trusted(d), loc)
        for a in list(by_version.values()) + list(by_digest.values()):
            if a not in out:
                try:
                    out[a] = self.resolve(a)  # for its precise error
                except CatalogError as e:
                    out[a] = e
        return out

    def _policy_versions_text(self, conn: Connection, policy: str) -> str:
        lo, hi, n = conn.execute(
            sa.select(
                sa.func.min(versions.c.version), sa.func.max(versions.c.version), sa.func.count()
            ).where(versions.c.policy == policy)
        ).one()
        if not n:
            return f"unknown policy {policy!r} (it has no versions)"
        return f"policy {policy!r} has {n} version(s), v{lo}..v{hi}, and not that one"

    def _missing_alias_text(self, conn: Connection, addr: Address, alias: str) -> str:
        policy = addr.policy
        names = list(
            conn.execute(
                sa.select(aliases.c.alias).where(aliases.c.policy == policy).order_by(aliases.c.alias)
            ).scalars()
        )
        has_versions = conn.execute(
            sa.select(versions.c.version).where(versions.c.policy == policy).limit(1)
        ).first()
        if not names and not has_versions:
            return f"unknown address {str(addr)!r}: unknown policy {policy!r}"
        meaning = f" (a bare policy means {policy}@{CHAMPION})" if addr.kind == "policy" else ""
        have = f"its aliases: {', '.join(names)}" if names else "it has no aliases yet"
        return f"unknown address {str(addr)!r}: policy {policy!r} has no alias {alias!r}{meaning}; {have}"

    def list(
        self,
        policy: str | None = None,
        base: str | None = None,
        rank: int | None = None,
        tag: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[Entry]:
        """Catalog entries, filtered. With `policy`: that policy's versions, oldest first. Without: every
        revision once per version that names it (once with policy None if none does), oldest first.
        `tag` is `key` (the tag is set) or `key=value`."""
        if limit < 0 or offset < 0:
            raise CatalogError(f"limit and offset must be >= 0, got limit={limit} offset={offset}")
        cols = [
            revisions.c.digest,
            revisions.c.base,
            revisions.c.rank,
            revisions.c.location,
            revisions.c.tags,
            revisions.c.created,
            versions.c.policy,
            versions.c.version,
        ]
        if policy is not None:
            q = (
                sa.select(*cols)
                .join_from(versions, revisions, versions.c.digest == revisions.c.digest)
                .where(versions.c.policy == policy)
                .order_by(versions.c.version)
            )
        else:
            q = (
                sa.select(*cols)
                .join_from(revisions, versions, versions.c.digest == revisions.c.digest, isouter=True)
                .order_by(revisions.c.created, revisions.c.digest, versions.c.policy, versions.c.version)
            )
        if base is not None:
            q = q.where(revisions.c.base == base)
        if rank is not None:
            q = q.where(revisions.c.rank == rank)
        if tag is not None:
            key, eq, value = tag.partition("=")
            if not key:
                raise CatalogError(f"tag filter {tag!r} must be `key` or `key=value`")
            tag_value = revisions.c.tags[key].as_string()
            q = q.where(tag_value == value) if eq else q.where(tag_value.is_not(None))
        with self.engine.connect() as conn:
            rows = conn.execute(q.limit(limit).offset(offset)).all()
        return [
            Entry(Digest.trusted(d), b, k, loc, dict(t or {}), created, p, v)
            for d, b, k, loc, t, created, p, v in rows
        ]

    def referenced_digests(self) -> set[Digest]:
        """Every digest a revision or version row names: the blobs the store's garbage collection keeps."""
        q = sa.union(sa.select(revisions.c.digest), sa.select(versions.c.digest))
        with self.engine.connect() as conn:
            return {Digest.trusted(d) for d in conn.execute(q).scalars()}

    def count(self, policy: str | None = None) -> int:
        """Number of revisions, or with `policy` the number of that policy's versions."""
        q = (
            sa.select(sa.func.count()).select_from(revisions)
            if policy is None
            else sa.select(sa.func.count()).select_from(versions).where(versions.c.policy == policy)
        )
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar_one())


def _v(version: int | None) -> str:
    return "unset" if version is None else f"v{version}"
