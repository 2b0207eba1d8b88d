"""The catalog: every addressable adapter revision, address -> digest -> blob location.

Its addresses (`policy`, `policy@alias`, `policy/v7`, `sha256:<hex>`) are parsed in `mint_core.registry.address`
and re-exported here. The catalog is an index: MLflow is the truth for a policy's versions and aliases, and
`mint_core.registry.index` rebuilds the catalog's rows of them from MLflow and the store. Its tables and
records are in `mint_core.registry.catalog_schema`, the SQL of the leases it holds in `mint_core.registry.leases`.

Three tables hold it: `revisions` (one row per digest: base, rank, blob location, tags), `versions` (policy,
version -> digest) and `aliases` (policy, alias -> version). SQLite by default (WAL, busy timeout), any
SQLAlchemy URL otherwise (PostgreSQL for many writers). SQLAlchemy Core rather than the ORM so that a million
entries register in bulk in seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy.engine import Connection, Engine

from mint_core.registry.address import (
    CHAMPION,
    Address,
    AddressError,
    AddressKind,
    CatalogError,
    check_name,
    parse_address,
)
from mint_core.registry.catalog_schema import (
    AliasMove,
    Entry,
    Registration,
    Resolved,
    alias_moves,
    aliases,
    metadata,
    revisions,
    validated,
    versions,
)
from mint_core.registry.retry import retried
from mint_core.types import Digest

logger = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK = 10_000
_PG_VERSIONS_LOCK = 0x6D696E745F766572  # "mint_ver": the advisory lock that serializes version appends

__all__ = [
    "CHAMPION",
    "Address",
    "AddressError",
    "AddressKind",
    "Catalog",
    "CatalogConfig",
    "CatalogError",
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
            reg = validated(i, row, problems)
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
            out.extend(self.transaction(partial(self._write_chunk, chunk=chunk)))
        return out

    def transaction(self, fn: Callable[[Connection], T]) -> T:
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

        before = self.transaction(move)
        logger.info("alias %s: v%s -> v%d", s, before, version)
        return before

    def record_version(
        self, policy: str, version: int, reg: Registration, conn: Connection | None = None
    ) -> None:
        """Record `policy/v<version>` -> `reg` with a number given by another registry (MLflow numbers the
        versions of a registered model). Idempotent; a different digest already at that number is an error."""
        check_name(f"{policy}/v{version}", "policy", policy)
        problems: list[str] = []
        checked = validated(0, reg, problems)
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
            self.transaction(write)

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

        return self.transaction(forget) if wanted else []

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
            return self.transaction(
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

    def champions(self, limit: int) -> list[tuple[str, Digest]]:
        """(policy, digest) of every policy whose `champion` resolves (what a request naming the policy alone is
        served), by policy name, at most `limit`: one walk of the aliases' primary key, however large the catalog."""
        if limit < 0:
            raise CatalogError(f"limit must be >= 0, got {limit}")
        q = (
            sa.select(aliases.c.policy, versions.c.digest)
            .join_from(
                aliases,
                versions,
                sa.and_(versions.c.policy == aliases.c.policy, versions.c.version == aliases.c.version),
            )
            .where(aliases.c.alias == CHAMPION)
            .order_by(aliases.c.policy)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [(p, Digest.trusted(d)) for p, d in conn.execute(q)]

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
