"""MLflow as the registry of adapter revisions: where people see, review, promote and roll back policies.

    policy      = an MLflow registered model
    revision    = a model version; its `source` is the revision's store URI, its tags say what it is:
                  mint.digest, mint.base, mint.parent, mint.rank, mint.data_rev (and mint.gate once gated)
    champion    = the alias serving follows; `candidate` = the revision under evaluation

Every write goes through the catalog's per-policy lock, so concurrent writers (two flows, a person in a shell)
run one at a time: a version is created once per digest, and an alias moves only from where the mover saw it.
Each version is mirrored into the catalog under the same number, so `policy/v7` means the same revision to
MLflow, the catalog and the server; each alias move is logged in the catalog (when, from, to, why, who) and
summarised on the registered model's `mint.last_move.<alias>` tag for the MLflow UI.

MLflow refuses a local path as a version source (unless it sits inside a run's artifacts): a revision in a local
store gets the source `mint-store://<dir>` (not `mint+file`: MLflow unquotes `+` to a space), which `source_location` turns back into the path.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, Field
from sqlalchemy.engine import Connection

from mint_core.errors import MintError
from mint_core.registry.catalog import CHAMPION, AliasMove, Catalog, Registration, parse_address
from mint_core.registry.store import AdapterStore, normalize_digest

logger = logging.getLogger(__name__)
T = TypeVar("T")

CANDIDATE = "candidate"
TAG_PREFIX = "mint."
LOCAL_SCHEME = "mint-store://"
# Left alone, MLflow's client retries a dead server for minutes; a registry call should fail in seconds.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


class RegistryError(MintError):
    """The registry could not do what was asked; nothing was changed."""


class RegistryUnavailable(RegistryError):
    """The MLflow server cannot be reached."""


class UnknownRevision(RegistryError):
    """A policy, version or alias that the registry does not hold."""


class AliasConflict(RegistryError):
    """An alias had moved since the caller looked at it (another writer won the race)."""


class RegistryConfig(BaseModel):
    """Where the MLflow registry is."""

    tracking_uri: str = Field(
        default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    )
    """The MLflow tracking server (`mint up` starts one); default `$MLFLOW_TRACKING_URI`."""

    retries: int = Field(default=8, ge=1)
    """Attempts for a write that failed on a transient error ("database is locked" on the server's SQLite)."""


@dataclass(frozen=True, slots=True)
class Revision:
    """One model version of a policy, as the registry holds it."""

    policy: str
    version: int
    digest: str
    source: str
    base: str
    rank: int
    parent: str | None
    data_rev: str | None
    run_id: str | None
    aliases: tuple[str, ...] = ()
    tags: dict[str, str] = field(default_factory=dict)
    created_ms: int = 0

    @property
    def address(self) -> str:
        return f"{self.policy}/v{self.version}"

    @property
    def gate(self) -> dict[str, Any] | None:
        raw = self.tags.get("mint.gate")
        return json.loads(raw) if raw else None


def source_uri(location: str) -> str:
    """A store location as an MLflow version source."""
    return location if "://" in location else LOCAL_SCHEME + os.path.abspath(location)


def source_location(source: str) -> str:
    """The store location a version source names (inverse of `source_uri`)."""
    return source[len(LOCAL_SCHEME) :] if source.startswith(LOCAL_SCHEME) else source


def _transient(e: BaseException) -> bool:
    text = str(e).lower()
    return "database is locked" in text or "deadlock" in text or "could not serialize" in text


class Registry:
    """Policies and their revisions in MLflow, mirrored into the catalog, with the adapter bytes in the store."""

    def __init__(self, store: AdapterStore, catalog: Catalog, config: RegistryConfig | None = None):
        from mlflow import MlflowClient

        self.config = config or RegistryConfig()
        self.store = store
        self.catalog = catalog
        self.uri = self.config.tracking_uri
        self._check_reachable()
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.actor = os.environ.get("MINT_ACTOR") or _user()

    # ---- plumbing ----

    def _check_reachable(self) -> None:
        if not self.uri.startswith(("http://", "https://")):
            return
        try:
            r = httpx.get(self.uri.rstrip("/") + "/health", timeout=3.0)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise RegistryUnavailable(
                f"the MLflow registry at {self.uri} is unreachable ({type(e).__name__}: {e}); "
                "start it with `mint up --only mlflow` or set MLFLOW_TRACKING_URI"
            ) from e

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """An MLflow call, retried on transient server errors, with unreachable turned into one clear error."""
        from mlflow.exceptions import MlflowException

        for attempt in range(self.config.retries):
            try:
                return fn()
            except MlflowException as e:
                if not _transient(e) or attempt == self.config.retries - 1:
                    # a missing alias comes back as INVALID_PARAMETER_VALUE "... alias x not found."
                    if "RESOURCE_DOES_NOT_EXIST" in str(e.error_code) or "not found" in e.message.lower():
                        raise UnknownRevision(f"{what}: {e.message}") from e
                    if _unreachable(e):
                        raise RegistryUnavailable(
                            f"{what}: the MLflow registry at {self.uri} is unreachable"
                        ) from e
                    raise RegistryError(f"{what}: {e.message}") from e
                logger.info("%s: transient MLflow error (%s), retrying", what, e.message[:80])
            except OSError as e:
                raise RegistryUnavailable(
                    f"{what}: the MLflow registry at {self.uri} is unreachable: {e}"
                ) from e
            time.sleep(random.uniform(0.05, 0.1 * 2**attempt))
        raise AssertionError("unreachable")

    def _locked(self, policy: str, fn: Callable[[Connection], T]) -> T:
        return self.catalog.locked(policy, self.actor, fn)

    def _revision(self, mv: Any) -> Revision:
        tags = dict(mv.tags or {})
        return Revision(
            policy=mv.name,
            version=int(mv.version),
            digest=tags.get("mint.digest", ""),
            source=mv.source,
            base=tags.get("mint.base", ""),
            rank=int(tags.get("mint.rank", "0") or 0),
            parent=tags.get("mint.parent") or None,
            data_rev=tags.get("mint.data_rev") or None,
            run_id=mv.run_id or None,
            aliases=tuple(sorted(getattr(mv, "aliases", None) or ())),
            tags=tags,
            created_ms=int(mv.creation_timestamp or 0),
        )

    # ---- writes ----

    def ensure_policy(self, policy: str, description: str | None = None) -> None:
        """Create the registered model if it does not exist (idempotent)."""
        parse_address(policy)  # names the bad character, if any
        from mlflow.exceptions import MlflowException

        try:
            self._call(f"get policy {policy!r}", lambda: self.client.get_registered_model(policy))
        except UnknownRevision:
            try:
                self._call(
                    f"create policy {policy!r}",
                    lambda: self.client.create_registered_model(
                        policy, tags={"mint.policy": "true"}, description=description
                    ),
                )
            except RegistryError as e:
                if not isinstance(e.__cause__, MlflowException) or "ALREADY_EXISTS" not in str(
                    e.__cause__.error_code
                ):
                    raise

    def create_revision(
        self,
        policy: str,
        digest: str,
        *,
        base: str,
        rank: int,
        parent: str | None = None,
        data_rev: str | None = None,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
        alias: str | None = CANDIDATE,
        reason: str = "new revision",
    ) -> Revision:
        """Make the stored revision `digest` the policy's next version (and point `alias` at it).

        Idempotent by digest: if the policy already has a version of these bytes, that version is returned and
        nothing is created, so a rerun of an export that had finished makes no second version."""
        digest = normalize_digest(digest)
        location = self.store.path(digest)  # raises if the bytes are not in the store: nothing written
        if parent is not None:
            parse_address(parent)
        self.ensure_policy(policy)
        mint_tags = {
            "mint.digest": digest,
            "mint.base": base,
            "mint.rank": str(rank),
            "mint.parent": parent or "",
            "mint.data_rev": data_rev or "",
        }
        extra = {k: str(v) for k, v in (tags or {}).items()}
        bad = [
            k for k in extra if k.startswith(TAG_PREFIX) and k not in ("mint.gate", "mint.idempotency_key")
        ]
        if bad:
            raise RegistryError(
                f"tags {bad} are reserved for mint; pass base/rank/parent/data_rev as arguments"
            )

        def create(conn: Connection) -> Revision:
            found = self._by_digest(policy, digest)
            if found is not None:
                logger.info("%s already holds sha256:%s as v%d", policy, digest[:12], found.version)
                rev = found
            else:
                mv = self._call(
                    f"create a version of {policy!r}",
                    lambda: self.client.create_model_version(
                        policy,
                        source_uri(location),
                        run_id=run_id,
                        tags={**mint_tags, **extra},
                        description=f"adapter revision sha256:{digest}",
                    ),
                )
                rev = self._revision(mv)
                logger.info("created %s (sha256:%s)", rev.address, digest[:12])
            self.catalog.record_version(
                policy, rev.version, Registration(digest, base, rank, location, {"policy": policy}), conn=conn
            )
            if alias is not None and alias not in rev.aliases:
                self._move(conn, policy, alias, rev.version, reason, expect=...)
            return self.revision(policy, rev.version)

        return self._locked(policy, create)

    def set_alias(
        self, policy: str, alias: str, version: int, reason: str, expect: int | Any | None = ...
    ) -> AliasMove:
        """Move `policy@alias` to `version`, logged with `reason`. With `expect`, only if the alias still points
        where the caller saw it (None: unset); otherwise `AliasConflict` and nothing moves."""
        if not reason.strip():
            raise RegistryError(f"moving {policy}@{alias} needs a reason (it is logged with the move)")
        self.revision(policy, version)  # exists? (clear error before taking the lock)
        return self._locked(policy, lambda conn: self._move(conn, policy, alias, version, reason, expect))

    def promote(self, policy: str, version: int, reason: str, expect: int | Any | None = ...) -> AliasMove:
        """`champion` := version."""
        return self.set_alias(policy, CHAMPION, version, reason, expect)

    def rollback(self, policy: str, to_version: int | None = None, reason: str = "rollback") -> AliasMove:
        """Move `champion` back: to `to_version`, or by default to the champion before the current one."""
        current = self.alias_version(policy, CHAMPION)
        if to_version is None:
            to_version = self.previous_champion(policy, current)
        if current is not None and to_version == current:
            raise RegistryError(f"{policy}@{CHAMPION} already is v{current}; nothing to roll back")
        if to_version is not None and current is not None and to_version > current:
            logger.warning("rolling %s@%s forward from v%d to v%d", policy, CHAMPION, current, to_version)
        return self.set_alias(policy, CHAMPION, to_version, reason, expect=current)

    def previous_champion(self, policy: str, current: int | None) -> int:
        """The version `champion` pointed at before it pointed at `current`, from the move log."""
        for move in self.catalog.alias_moves(policy, CHAMPION, limit=1000):
            if move.to_version == current and move.from_version is not None and move.from_version != current:
                return move.from_version
        raise UnknownRevision(
            f"no earlier champion of {policy!r} is recorded (current: "
            f"{'v' + str(current) if current else 'none'}); name the version to roll back to"
        )

    def _move(
        self, conn: Connection, policy: str, alias: str, version: int | None, reason: str, expect: Any
    ) -> AliasMove:
        before = self._mlflow_alias(policy, alias)
        if expect is not ... and before != expect:
            raise AliasConflict(
                f"{policy}@{alias} moved while you were deciding: expected "
                f"{_v(expect)}, found {_v(before)}; nothing changed"
            )
        if version is None:
            self._call(
                f"delete {policy}@{alias}", lambda: self.client.delete_registered_model_alias(policy, alias)
            )
        else:
            self._call(
                f"set {policy}@{alias}",
                lambda: self.client.set_registered_model_alias(policy, alias, str(version)),
            )
        move = self.catalog.move_alias(conn, policy, alias, version, reason, self.actor, before)
        summary = (
            f"{_v(before)} -> {_v(version)} at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(move.at))}Z"
        )
        summary += f" by {self.actor}: {reason}"
        self._call(
            "tag the move",
            lambda: self.client.set_registered_model_tag(policy, f"mint.last_move.{alias}", summary[:4900]),
        )
        logger.info("%s@%s: %s", policy, alias, summary)
        return move

    def set_tag(self, policy: str, version: int, key: str, value: str) -> None:
        """Set one tag on a version (e.g. `mint.gate`)."""
        self._call(
            f"tag {policy}/v{version}",
            lambda: self.client.set_model_version_tag(policy, str(version), key, value),
        )

    def sync_alias(self, policy: str, alias: str = CHAMPION) -> AliasMove | None:
        """Bring the catalog's `policy@alias` in line with MLflow's (moved in the MLflow UI, say), logging the
        move as seen by mint. Returns the move, or None when they already agree."""

        def sync(conn: Connection) -> AliasMove | None:
            now = self._mlflow_alias(policy, alias)
            before = self.catalog.alias_version(policy, alias)
            if now == before:
                return None
            if now is not None:
                rev = self.revision(policy, now)
                location = self.store.path(rev.digest)
                reg = Registration(rev.digest, rev.base, rev.rank, location, {"policy": policy})
                self.catalog.record_version(policy, now, reg, conn=conn)
            return self.catalog.move_alias(
                conn, policy, alias, now, "moved in MLflow (seen by reconcile)", "mlflow", before
            )

        return self._locked(policy, sync)

    # ---- reads ----

    def _mlflow_alias(self, policy: str, alias: str) -> int | None:
        try:
            mv = self._call(
                f"resolve {policy}@{alias}", lambda: self.client.get_model_version_by_alias(policy, alias)
            )
        except UnknownRevision:
            return None
        return int(mv.version)

    def alias_version(self, policy: str, alias: str = CHAMPION) -> int | None:
        """The version MLflow's `policy@alias` points at, or None when unset."""
        return self._mlflow_alias(policy, alias)

    def resolve(self, policy: str, alias: str = CHAMPION) -> Revision:
        """The revision `policy@alias` names; a clear error when unset or when its version was deleted."""
        version = self._mlflow_alias(policy, alias)
        if version is None:
            self.revisions(policy)  # unknown policy -> its own error
            last = self.catalog.alias_moves(policy, alias, limit=1)
            if last and last[0].to_version is not None:
                m = last[0]
                raise UnknownRevision(
                    f"{policy}@{alias} is gone: it last pointed at v{m.to_version} (moved "
                    f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(m.at))}Z by {m.actor}), and MLflow no longer "
                    f"has that version (deleted?); point it at an existing version with "
                    f"`mint registry promote {policy} <version>`"
                )
            raise UnknownRevision(f"{policy} has no alias {alias!r}")
        return self.revision(policy, version)

    def revision(self, policy: str, version: int) -> Revision:
        try:
            mv = self._call(
                f"get {policy}/v{version}", lambda: self.client.get_model_version(policy, str(version))
            )
        except UnknownRevision as e:
            have = [r.version for r in self.revisions(policy)]  # an unknown policy raises its own error here
            listed = f"v{have[0]}..v{have[-1]}" if have else "none"
            raise UnknownRevision(f"{policy} has no version v{version} (its versions: {listed})") from e
        return self._revision(mv)

    def revisions(self, policy: str) -> list[Revision]:
        """Every version of a policy, oldest first."""
        rm = self._call(f"get policy {policy!r}", lambda: self.client.get_registered_model(policy))
        mvs = self._call(
            f"list versions of {policy!r}",
            lambda: self.client.search_model_versions(f"name = '{policy}'", max_results=10_000),
        )
        # search results carry no aliases; the registered model has them all
        by_version: dict[int, list[str]] = {}
        for alias, version in (getattr(rm, "aliases", None) or {}).items():
            by_version.setdefault(int(version), []).append(alias)
        revs = [self._revision(mv) for mv in mvs]
        revs = [replace(r, aliases=tuple(sorted(by_version.get(r.version, [])))) for r in revs]
        return sorted(revs, key=lambda r: r.version)

    def _by_digest(self, policy: str, digest: str) -> Revision | None:
        try:
            mvs = self._call(
                f"find sha256:{digest[:12]} in {policy!r}",
                lambda: self.client.search_model_versions(
                    f"name = '{policy}' and tags.`mint.digest` = '{digest}'", max_results=10
                ),
            )
        except UnknownRevision:
            return None
        found = sorted((self._revision(mv) for mv in mvs), key=lambda r: r.version)
        return found[0] if found else None

    def policies(self) -> list[str]:
        names: list[str] = []
        token: str | None = None
        while True:
            page = self._call(
                "list policies",
                partial(self.client.search_registered_models, max_results=1000, page_token=token),
            )
            names.extend(rm.name for rm in page)
            token = page.token
            if not token:
                return sorted(names)

    def lineage(self, policy: str, version: int, max_depth: int = 1000) -> list[Revision]:
        """The revision and its ancestors through `mint.parent`, newest first (parents may be other policies)."""
        out = [self.revision(policy, version)]
        while out[-1].parent and len(out) < max_depth:
            addr = parse_address(out[-1].parent)
            if addr.kind == "version":
                assert addr.policy is not None and addr.version is not None
                out.append(self.revision(addr.policy, addr.version))
            elif addr.kind == "digest":
                assert addr.digest is not None
                found = self._by_digest(policy, addr.digest)
                if found is None:
                    break  # a parent outside the registry (e.g. an imported adapter): lineage ends here
                out.append(found)
            else:
                break
        return out

    def history(self, policy: str, alias: str | None = None, limit: int = 100) -> list[AliasMove]:
        """Alias moves, newest first."""
        return self.catalog.alias_moves(policy, alias, limit)


def _v(version: Any) -> str:
    return "unset" if version is None else f"v{version}"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _unreachable(e: BaseException) -> bool:
    text = str(e)
    return "Max retries exceeded" in text or "Connection refused" in text or "API request to" in text
