"""MLflow as the registry of adapter revisions: where people see, review, promote and roll back policies.

    policy      = an MLflow registered model
    revision    = a model version; its `source` is the revision's store URI, its tags say what it is:
                  mint.digest, mint.base, mint.parent, mint.rank, mint.data_rev (and mint.gate once gated; mint.task,
                  mint.task_spec and mint.reward where a training run made it)
    champion    = the alias serving follows; `candidate` = the revision under evaluation

MLflow is the truth for which versions a policy has and where its aliases point; the catalog is an index of it
(`mint_core.registry.index` rebuilds it from MLflow and the store). Every write holds the policy's registry lock
(a lease from `mint_core.registry.leases`, the one lock mechanism of mint: the catalog's or Redis's), so concurrent writers (two flows, a person in a shell)
run one at a time: a version is created once per digest, and an alias moves only from where MLflow says the
mover saw it. Each write is then indexed in the catalog under MLflow's number, so `policy/v7` means the same
revision to MLflow, the catalog and the server; each alias move is logged in the catalog (when, from, to, why,
who) and summarised on the registered model's `mint.last_move.<alias>` tag for the MLflow UI.

Reads go through `RegistryReader` (MLflow's REST API, no `mlflow` import); writes through `MlflowClient`. Calls
are retried by the shared policy in `mint_core.registry.retry`; MLflow's own HTTP retries are turned off so that
policy is the only one.

MLflow refuses a local path as a version source (unless it sits inside a run's artifacts): a revision in a local
store gets the source `mint-store://<dir>` (not `mint+file`: MLflow unquotes `+` to a space), which `source_location` turns back into the path.
"""

from __future__ import annotations

import getpass
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, TypeVar

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from mint_core.registry.catalog import CHAMPION, Catalog, CatalogError, parse_address
from mint_core.registry.catalog_schema import AliasMove, Registration
from mint_core.registry.index import RebuildReport, new_holder, rebuild_catalog, registry_lock, reindex_policy
from mint_core.registry.leases import Leases, default_leases, held
from mint_core.registry.reader import (
    CANDIDATE,
    KIND_TAG,
    LOCAL_SCHEME,
    TAG_PREFIX,
    AliasConflict,
    RegistryConfig,
    RegistryError,
    RegistryReader,
    RegistryUnavailable,
    Revision,
    UnknownRevision,
    parse_revision,
    registry_error,
    source_location,
    source_uri,
)
from mint_core.registry.retention import RetentionPlan, protected
from mint_core.registry.retry import retried
from mint_core.registry.store import AdapterStore
from mint_core.registry.tags import fit_tag
from mint_core.types import Digest

__all__ = [
    "CANDIDATE",
    "KIND_TAG",
    "LOCAL_SCHEME",
    "TAG_PREFIX",
    "AliasConflict",
    "Registry",
    "RegistryConfig",
    "RegistryError",
    "RegistryUnavailable",
    "Revision",
    "UnknownRevision",
    "source_location",
    "source_uri",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

POLICY_KIND = "policy"
TINKER_KIND = "tinker"


def no_client_retries() -> None:
    """Make MLflow's HTTP client fail at once, within 30 s (unless the environment says otherwise): the shared
    retry policy (`mint_core.registry.retry`) is the only one, MLflow's client must not retry underneath it, and a
    registry call should fail in seconds, not minutes. MLflow reads both variables at each request, so setting
    them before a registry's first call is enough."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


class Registry:
    """Policies and their revisions in MLflow, indexed in the catalog, with the adapter bytes in the store."""

    def __init__(
        self,
        store: AdapterStore,
        catalog: Catalog,
        config: RegistryConfig | None = None,
        leases: Leases | None = None,
    ):
        """`leases`: where the policies' registry locks live (`leases_for(workspace.lock_url, catalog)`); default
        where $MINT_LOCK_URL says, else the catalog."""
        self.config = config or RegistryConfig()
        self.store = store
        self.catalog = catalog
        self.leases = default_leases(catalog) if leases is None else leases
        self.uri = self.config.tracking_uri
        no_client_retries()
        self.reader = RegistryReader(self.config)
        self.reader.check_reachable()
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.actor = os.environ.get("MINT_ACTOR") or _user()

    # ---- plumbing ----

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """An MLflow write, retried on transient errors, its failure turned into one clear error."""
        try:
            return retried(fn)
        except MlflowException as e:
            raise registry_error(what, str(e.error_code), e.message) from e
        except OSError as e:
            raise RegistryUnavailable(f"{what}: the MLflow registry at {self.uri} is unreachable: {e}") from e

    def _locked(self, policy: str, fn: Callable[[], T]) -> T:
        """`fn()` holding the policy's registry lock."""
        with held(self.leases, registry_lock(policy), new_holder(self.actor)):
            return fn()

    # ---- writes ----

    def ensure_policy(self, policy: str, description: str | None = None, kind: str = POLICY_KIND) -> None:
        """Create the registered model if it does not exist (idempotent), tagged `mint.kind` = `kind` (`policy`;
        `tinker` for the Tinker API's sampler saves), which the MLflow UI's model search filters on."""
        parse_address(policy)  # names the bad character, if any
        try:
            self.reader.aliases(policy)
        except UnknownRevision:
            try:
                self._call(
                    f"create policy {policy!r}",
                    lambda: self.client.create_registered_model(
                        policy, tags={"mint.policy": "true", KIND_TAG: kind}, description=description
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
        kind: str = POLICY_KIND,
    ) -> Revision:
        """Make the stored revision `digest` the policy's next version (and point `alias` at it).

        Idempotent by digest: if the policy already has a version of these bytes, that version is returned and
        nothing is created, so a rerun of an export that had finished makes no second version. A policy created
        here is tagged `mint.kind` = `kind`."""
        digest = Digest.parse(digest)
        location = self.store.path(digest)  # raises if the bytes are not in the store: nothing written
        if parent is not None:
            parse_address(parent)
        self.ensure_policy(policy, kind=kind)
        mint_tags = {
            "mint.digest": digest.hex,
            "mint.base": base,
            "mint.rank": str(rank),
            "mint.parent": parent or "",
            "mint.data_rev": data_rev or "",
        }
        extra = {k: str(v) for k, v in (tags or {}).items()}
        bad = [
            k
            for k in extra
            if k.startswith(TAG_PREFIX)
            and k not in ("mint.gate", "mint.idempotency_key", "mint.task", "mint.task_spec", "mint.reward")
        ]
        if bad:
            raise RegistryError(
                f"tags {bad} are reserved for mint; pass base/rank/parent/data_rev as arguments"
            )

        def create() -> Revision:
            found = self.reader.by_digest(policy, digest)
            if found is not None:
                logger.info("%s already holds %s as v%d", policy, digest.prefixed[:19], found.version)
                rev = found
            else:
                mv = self._call(
                    f"create a version of {policy!r}",
                    lambda: self.client.create_model_version(
                        policy,
                        source_uri(location),
                        run_id=run_id,
                        tags={**mint_tags, **extra},
                        description=f"adapter revision {digest.prefixed}",
                    ),
                )
                rev = parse_revision({"name": mv.name, "version": mv.version, "tags": mv.tags or {}})
                logger.info("created %s (%s)", rev.address, digest.prefixed[:19])
            reg = Registration(digest, base, rank, location, {"policy": policy})
            try:
                self.catalog.record_version(policy, rev.version, reg)
            except CatalogError as e:  # the index disagrees with MLflow: rebuild it from MLflow
                logger.warning("%s; rebuilding the catalog's index of %s", e, policy)
                self._reindex_locked(policy)
            if alias is not None and alias not in self.reader.revision(policy, rev.version).aliases:
                self._move(policy, alias, rev.version, reason, expect=...)
            return self.revision(policy, rev.version)

        return self._locked(policy, create)

    def set_alias(
        self, policy: str, alias: str, version: int | None, reason: str, expect: int | Any | None = ...
    ) -> AliasMove:
        """Move `policy@alias` to `version` (None: remove it), logged with `reason`. With `expect`, only if the
        alias still points where the caller saw it (None: unset); otherwise `AliasConflict` and nothing moves."""
        if not reason.strip():
            raise RegistryError(f"moving {policy}@{alias} needs a reason (it is logged with the move)")
        if version is not None:
            self.revision(policy, version)  # exists? (clear error before taking the lock)
        return self._locked(policy, lambda: self._move(policy, alias, version, reason, expect))

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

    def _move(self, policy: str, alias: str, version: int | None, reason: str, expect: Any) -> AliasMove:
        before = self.reader.alias_version(policy, alias)
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
        move = self.catalog.move_alias(policy, alias, version, reason, self.actor, before)
        summary = (
            f"{_v(before)} -> {_v(version)} at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(move.at))}Z"
        )
        summary += f" by {self.actor}: {reason}"
        self._call(
            "tag the move",
            lambda: self.client.set_registered_model_tag(policy, f"mint.last_move.{alias}", fit_tag(summary)),
        )
        logger.info("%s@%s: %s", policy, alias, summary)
        return move

    def set_tag(self, policy: str, version: int, key: str, value: str) -> None:
        """Set one tag on a version (e.g. `mint.gate`)."""
        self._call(
            f"tag {policy}/v{version}",
            lambda: self.client.set_model_version_tag(policy, str(version), key, value),
        )

    def delete_versions(
        self,
        policy: str,
        numbers: Iterable[int],
        reason: str,
        guard: Mapping[str, str] | None = None,
        lineage_of: Callable[[str], bool] = lambda alias: True,
    ) -> RetentionPlan:
        """Delete versions of `policy` from MLflow and the catalog's index (then `mint catalog gc` frees their
        bytes), except those that must stay, which are kept and said why: an aliased version, an ancestor of one
        (for the aliases `lineage_of` accepts), what `guard` names (`retention.protected` over the whole registry),
        and a version whose lineage continues in another policy. Checked again under the policy's lock, all before
        anything changes; a version already gone is skipped. The children of a deleted version get its nearest
        surviving ancestor as `mint.parent`, so every lineage stays a chain of existing versions."""
        if not reason.strip():
            raise RegistryError(f"deleting versions of {policy} needs a reason (it is logged)")
        wanted = sorted(set(numbers))

        def delete() -> RetentionPlan:
            revs = {r.version: r for r in self.reader.revisions(policy)}
            here = protected({policy: self.reader.aliases(policy)}, revs.values(), lineage_of)
            keep = {**here, **(guard or {})}
            plan = RetentionPlan(policy)
            children: dict[int, list[Revision]] = {}
            for v in wanted:
                if v not in revs:
                    continue
                why: str | None = keep.get(f"{policy}/v{v}")
                kids = self.reader.children(f"{policy}/v{v}")
                outside = [c.address for c in kids if c.policy != policy]
                if why is None and outside:
                    why = f"parent of {outside[0]} (another policy)"
                if why is None:
                    plan.delete.append(v)
                    children[v] = kids
                else:
                    plan.keep[v] = why
            going = set(plan.delete)

            def surviving(rev: Revision) -> str:
                parent = rev.parent or ""
                while parent.startswith(f"{policy}/v") and parent[len(policy) + 2 :].isdigit():
                    up = int(parent[len(policy) + 2 :])
                    if up not in going:
                        break
                    parent = revs[up].parent or ""
                return parent

            for v in plan.delete:
                for child in children[v]:
                    if child.policy == policy and child.version in going:
                        continue
                    new_parent = surviving(revs[v])
                    self.set_tag(child.policy, child.version, "mint.parent", new_parent)
                    logger.info(
                        "%s: mint.parent %s/v%d -> %s", child.address, policy, v, new_parent or "none"
                    )
                self._call(f"delete {policy}/v{v}", partial(self.client.delete_model_version, policy, str(v)))
            if plan.delete:
                try:
                    self.catalog.forget_versions(policy, plan.delete)
                except CatalogError as e:  # the index disagrees with MLflow: rebuild it
                    logger.warning("%s; rebuilding the catalog's index of %s", e, policy)
                    self._reindex_locked(policy)
                logger.info("deleted %s/%s: %s", policy, ",".join(f"v{v}" for v in plan.delete), reason)
            return plan

        return self._locked(policy, delete)

    def reindex(self, policy: str) -> list[AliasMove]:
        """Bring the catalog's index of one policy in line with MLflow (an alias moved in the MLflow UI, say),
        logging each alias it corrects as a move by `mlflow`. Returns those moves ([] when they agreed)."""
        return rebuild_catalog(self.reader, self.catalog, self.store, [policy], leases=self.leases).moves

    def _reindex_locked(self, policy: str) -> None:
        reindex_policy(self.reader, self.catalog, self.store, policy, RebuildReport())

    def sync_alias(self, policy: str, alias: str = CHAMPION) -> AliasMove | None:
        """`reindex` the policy; the move of `alias` it made, or None when the index already agreed."""
        return next((m for m in self.reindex(policy) if m.alias == alias), None)

    # ---- reads (MLflow, through the reader) ----

    def alias_version(self, policy: str, alias: str = CHAMPION) -> int | None:
        """The version MLflow's `policy@alias` points at, or None when unset."""
        return self.reader.alias_version(policy, alias)

    def resolve(self, policy: str, alias: str = CHAMPION) -> Revision:
        """The revision `policy@alias` names; a clear error when unset or when its version was deleted."""
        version = self.reader.alias_version(policy, alias)
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
        return self.reader.revision(policy, version)

    def revisions(self, policy: str) -> list[Revision]:
        """Every version of a policy, oldest first."""
        return self.reader.revisions(policy)

    def policies(self) -> list[str]:
        return self.reader.policies()

    def lineage(self, policy: str, version: int, max_depth: int = 1000) -> list[Revision]:
        """The revision and its ancestors through `mint.parent`, newest first (parents may be other policies)."""
        return self.reader.lineage(policy, version, max_depth)

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
