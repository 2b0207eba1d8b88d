"""The router of `model: "auto"` as a revisioned model in MLflow, beside the policies.

    registered model  `mint-router` (`ROUTER_MODEL`), tagged `mint.kind` = `router`: not a policy, so the policy
                      listings (reconcile, retraining, the catalog) leave it out (`reader.ROUTER_KIND`)
    version           one router revision: the directory `Router.save` wrote (manifest.json + state.npz), logged as
                      the artifacts of an MLflow run of the experiment `mint-router` (with its off-policy estimate
                      as metrics); the version's source is that artifact folder. Tags: `mint.router.revision` (the
                      content digest), `mint.router.ope` (the estimate: value, 95% CI, n, method),
                      `mint.router.baseline` (the serving router's, on the same records), `mint.gate` (decision)
    champion          the alias serving follows: every move (here, in the MLflow UI, a rollback) is pushed to the
                      servers with `PUT /v1/mint/router` (`mint_core.lifecycle.routers.reconcile_router`)

A version that does not load is never given `champion`: `register` loads the directory before it writes anything,
and `promote` downloads the version into the local cache and loads it before it moves the alias (`RouterRefused`,
naming the file and the problem). Writes hold the model's registry lease (`index.registry_lock`), as a policy's do.
The catalog does not index the router (its versions are no adapter revisions); each move is summarised on the
registered model's `mint.last_move.champion` tag for the MLflow UI, as a policy's is.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from mint_core.registry.address import CHAMPION
from mint_core.registry.index import new_holder, registry_lock
from mint_core.registry.leases import Leases, held
from mint_core.registry.reader import (
    KIND_TAG,
    ROUTER_KIND,
    AliasConflict,
    RegistryError,
    RegistryUnavailable,
    UnknownRevision,
    registry_error,
)
from mint_core.registry.retry import retried
from mint_core.registry.tags import fit_tag, json_tag
from mint_core.routing.router import Router, RouterLoadError

logger = logging.getLogger(__name__)
T = TypeVar("T")

ROUTER_MODEL = "mint-router"
"""The MLflow registered model whose versions are the router's revisions and whose `champion` serving follows."""
ROUTER_EXPERIMENT = "mint-router"
"""The MLflow experiment of the runs that carry each version's files and estimate."""
ARTIFACT_PATH = "router"
"""The folder of a run's artifacts that holds the router's directory."""
REVISION_TAG = "mint.router.revision"
OPE_TAG = "mint.router.ope"
BASELINE_TAG = "mint.router.baseline"
GATE_TAG = "mint.gate"
"""The same tag a policy's gate decision is kept in (`mint_core.eval.gate.GATE_TAG`)."""


class RouterRefused(RegistryError):
    """A router version that does not load (missing or corrupt files, another format, another revision than its
    tag names): it is never given `champion`, and serving keeps the router it has."""


@dataclass(frozen=True, slots=True)
class RouterVersion:
    """One version of the router's registered model."""

    model: str
    version: int
    revision: str
    """The router's content digest (`mint.router.revision`; "" when a version was made without it)."""
    source: str
    run_id: str | None
    aliases: tuple[str, ...] = ()
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.model}/v{self.version}"

    def tag_json(self, key: str) -> dict[str, Any] | None:
        raw = self.tags.get(key)
        try:
            return dict(json.loads(raw)) if raw else None
        except (ValueError, TypeError):
            return None

    @property
    def ope(self) -> dict[str, Any] | None:
        return self.tag_json(OPE_TAG)

    @property
    def gate(self) -> dict[str, Any] | None:
        return self.tag_json(GATE_TAG)


@dataclass(frozen=True, slots=True)
class RouterMove:
    """Where `champion` pointed before a move and after it."""

    model: str
    from_version: int | None
    to_version: int
    revision: str
    path: Path
    """The version's directory in the local cache (loaded and checked before the move)."""
    moved: bool
    """False when it already pointed there."""


def load_router(path: Path, what: str) -> Router:
    """`Router.load`, its failure turned into `RouterRefused` naming `what` (a version, a directory)."""
    try:
        return Router.load(Path(path))
    except RouterLoadError as e:
        raise RouterRefused(f"{what} does not load: {e}") from e


class RouterRegistry:
    """The router's versions and its `champion` in MLflow, with a local cache of the versions' directories."""

    def __init__(
        self,
        tracking_uri: str,
        leases: Leases,
        cache_dir: Path | None = None,
        model: str = ROUTER_MODEL,
        actor: str = "mint",
    ):
        """`cache_dir`: where versions are downloaded, one directory per revision (a server loads them from there,
        so it must be inside the server's routing dir; None: reads and registrations only); `leases`: where the
        registry locks live (the policies')."""
        self.uri = tracking_uri
        self.leases = leases
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.model = model
        self.actor = actor
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    # ---- plumbing ----

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return retried(fn)
        except MlflowException as e:
            raise registry_error(what, str(e.error_code), e.message) from e
        except OSError as e:
            raise RegistryUnavailable(f"{what}: the MLflow registry at {self.uri} is unreachable: {e}") from e

    def _locked(self, fn: Callable[[], T]) -> T:
        with held(self.leases, registry_lock(self.model), new_holder(self.actor)):
            return fn()

    def _parse(self, mv: Any, aliases: Mapping[int, list[str]]) -> RouterVersion:
        tags = dict(mv.tags or {})
        return RouterVersion(
            model=self.model,
            version=int(mv.version),
            revision=tags.get(REVISION_TAG, ""),
            source=str(mv.source or ""),
            run_id=mv.run_id or None,
            aliases=tuple(sorted(aliases.get(int(mv.version), []))),
            tags=tags,
        )

    # ---- reads ----

    def aliases(self) -> dict[str, int]:
        """The model's aliases and the versions they name ({} when the model does not exist yet)."""
        try:
            rm = self._call(f"get {self.model}", lambda: self.client.get_registered_model(self.model))
        except UnknownRevision:
            return {}
        return {a: int(v) for a, v in (rm.aliases or {}).items()}

    def _by_version(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for alias, v in self.aliases().items():
            out.setdefault(v, []).append(alias)
        return out

    def version(self, version: int) -> RouterVersion:
        mv = self._call(
            f"get {self.model}/v{version}", lambda: self.client.get_model_version(self.model, str(version))
        )
        return self._parse(mv, self._by_version())

    def versions(self) -> list[RouterVersion]:
        """Every version, oldest first ([] when the model does not exist yet)."""
        try:
            mvs = self._call(
                f"list versions of {self.model}",
                lambda: self.client.search_model_versions(f"name = '{self.model}'", max_results=10_000),
            )
        except UnknownRevision:
            return []
        by = self._by_version()
        return sorted((self._parse(mv, by) for mv in mvs), key=lambda r: r.version)

    def by_revision(self, revision: str) -> RouterVersion | None:
        """The oldest version holding router revision `revision`, if any."""
        found = [r for r in self.versions() if r.revision == revision]
        return found[0] if found else None

    def champion(self) -> RouterVersion | None:
        """The version `champion` names, or None when it is unset."""
        v = self.aliases().get(CHAMPION)
        return None if v is None else self.version(v)

    # ---- files ----

    def fetch(self, version: int) -> Path:
        """The version's router directory in the local cache (`<cache_dir>/<revision>`), downloaded from MLflow
        when it is not there yet, and loaded to check it: `RouterRefused` when it does not load or holds another
        revision than its tag names. Safe to call from several processes (download to a temporary directory,
        then one rename)."""
        if self.cache_dir is None:
            raise RegistryError(f"{self.model}: no cache directory to fetch v{version} into")
        rv = self.version(version)
        if rv.revision:
            cached = self.cache_dir / rv.revision
            if cached.is_dir():
                try:
                    if Router.load(cached).revision == rv.revision:
                        return cached
                except RouterLoadError as e:
                    logger.warning("cached %s is unusable, downloading it again: %s", cached, e)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=self.cache_dir))
        try:
            try:
                got = Path(
                    mlflow.artifacts.download_artifacts(
                        artifact_uri=rv.source, dst_path=str(tmp), tracking_uri=self.uri
                    )
                )
            except (MlflowException, OSError) as e:
                raise RouterRefused(
                    f"{rv.address}: its files at {rv.source} cannot be downloaded: {e}"
                ) from e
            router = load_router(got, rv.address)
            if rv.revision and router.revision != rv.revision:
                raise RouterRefused(
                    f"{rv.address} does not load: its files hold revision {router.revision}, its tag "
                    f"{REVISION_TAG} names {rv.revision}"
                )
            dest = self.cache_dir / router.revision
            if dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            try:
                got.rename(dest)
            except OSError:  # another process placed the same revision first: its copy is as good
                if not dest.is_dir():
                    raise
            return dest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- writes ----

    def _ensure_model(self) -> None:
        try:
            self._call(f"get {self.model}", lambda: self.client.get_registered_model(self.model))
        except UnknownRevision:
            try:
                self._call(
                    f"create {self.model}",
                    lambda: self.client.create_registered_model(
                        self.model,
                        tags={KIND_TAG: ROUTER_KIND},
                        description=(
                            'mint\'s router for model: "auto" (which served adapter answers each request); '
                            "serving follows its champion alias"
                        ),
                    ),
                )
            except RegistryError as e:
                if "ALREADY_EXISTS" not in str(e):
                    raise

    def _experiment(self) -> str:
        found = self._call(
            "find the router experiment", lambda: self.client.get_experiment_by_name(ROUTER_EXPERIMENT)
        )
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(
                self._call(
                    "create the router experiment", lambda: self.client.create_experiment(ROUTER_EXPERIMENT)
                )
            )
        except RegistryError:  # another writer created it first
            found = self.client.get_experiment_by_name(ROUTER_EXPERIMENT)
            if found is None:
                raise
            return str(found.experiment_id)

    def register(
        self,
        router_dir: Path,
        *,
        ope: Mapping[str, Any] | None = None,
        baseline: Mapping[str, Any] | None = None,
        gate: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> RouterVersion:
        """Make the router saved in `router_dir` a version (its files as a run's artifacts, `ope`'s numbers as the
        run's metrics, `params` as its params), tagged with its revision, its estimate, the serving router's
        (`baseline`) and the gate's decision. Loaded first: one that does not load is refused with nothing written.
        Idempotent by revision: a version that already holds these bytes gets the new tags and is returned."""
        router = load_router(router_dir, str(router_dir))
        tags = {REVISION_TAG: router.revision}
        for key, doc in ((OPE_TAG, ope), (BASELINE_TAG, baseline), (GATE_TAG, gate)):
            if doc is not None:
                tags[key] = json_tag(doc, shrink=("reason",))

        def create() -> RouterVersion:
            found = self.by_revision(router.revision)
            if found is not None:
                for k, v in tags.items():
                    self.set_tag(found.version, k, v)
                logger.info("%s already holds router %s", found.address, router.revision[:12])
                return self.version(found.version)
            self._ensure_model()
            run_id = self._log_run(router_dir, router, ope, params)
            run = self._call("read the router's run", lambda: self.client.get_run(run_id))
            mv = self._call(
                f"create a version of {self.model}",
                lambda: self.client.create_model_version(
                    self.model,
                    f"{run.info.artifact_uri}/{ARTIFACT_PATH}",
                    run_id=run_id,
                    tags=tags,
                    description=f"router revision {router.revision} ({len(router.arms())} arms)",
                ),
            )
            rv = self._parse(mv, self._by_version())
            logger.info("registered router %s as %s", router.revision[:12], rv.address)
            return rv

        return self._locked(create)

    def _log_run(
        self,
        router_dir: Path,
        router: Router,
        ope: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
    ) -> str:
        """A finished run of the router experiment carrying the router's directory and its estimate."""
        exp = self._experiment()
        run = self._call(
            "start the router's run",
            lambda: self.client.create_run(
                exp, run_name=f"router-{router.revision[:12]}", tags={REVISION_TAG: router.revision}
            ),
        )
        rid = run.info.run_id
        try:
            self._call(
                "upload the router's files",
                lambda: self.client.log_artifacts(rid, str(router_dir), ARTIFACT_PATH),
            )
            now = int(time.time() * 1000)
            metrics = [
                Metric(f"ope_{k}", float(v), now, 0)
                for k, v in (ope or {}).items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            ]
            given = {"arms": ",".join(router.arms()), **router.hyper(), **(params or {})}
            logged = [Param(k, fit_tag(str(v))) for k, v in given.items()]
            self._call("log the router's estimate", lambda: self.client.log_batch(rid, metrics, logged))
        except BaseException:
            self.client.set_terminated(rid, "FAILED")
            raise
        self._call("end the router's run", lambda: self.client.set_terminated(rid))
        return str(rid)

    def set_tag(self, version: int, key: str, value: str) -> None:
        self._call(
            f"tag {self.model}/v{version}",
            lambda: self.client.set_model_version_tag(self.model, str(version), key, fit_tag(value)),
        )

    def promote(self, version: int, reason: str, expect: int | Any | None = ...) -> RouterMove:
        """`champion` := `version`, once its files are in the cache and load (`RouterRefused` otherwise, nothing
        moved). With `expect`, only if `champion` still points where the caller saw it (None: unset), else
        `AliasConflict`. Moving it to an older version is a rollback."""
        if not reason.strip():
            raise RegistryError(f"moving {self.model}@{CHAMPION} needs a reason (it is logged with the move)")
        path = self.fetch(version)
        revision = path.name

        def move() -> RouterMove:
            before = self.aliases().get(CHAMPION)
            if expect is not ... and before != expect:
                raise AliasConflict(
                    f"{self.model}@{CHAMPION} moved while you were deciding: expected {_v(expect)}, found "
                    f"{_v(before)}; nothing changed"
                )
            if before == version:
                return RouterMove(self.model, before, version, revision, path, moved=False)
            self._call(
                f"set {self.model}@{CHAMPION}",
                lambda: self.client.set_registered_model_alias(self.model, CHAMPION, str(version)),
            )
            summary = (
                f"{_v(before)} -> v{version} at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}Z by "
                f"{self.actor}: {reason}"
            )
            self._call(
                "tag the move",
                lambda: self.client.set_registered_model_tag(
                    self.model, f"mint.last_move.{CHAMPION}", fit_tag(summary)
                ),
            )
            logger.info("%s@%s: %s", self.model, CHAMPION, summary)
            return RouterMove(self.model, before, version, revision, path, moved=True)

        return self._locked(move)

    def unset_champion(self, reason: str) -> None:
        """Remove `champion` (the undo of a first promotion); serving keeps the router it has."""

        def unset() -> None:
            self._call(
                f"delete {self.model}@{CHAMPION}",
                lambda: self.client.delete_registered_model_alias(self.model, CHAMPION),
            )
            logger.info("%s@%s removed: %s", self.model, CHAMPION, reason)

        self._locked(unset)


def _v(version: Any) -> str:
    return "unset" if version is None else f"v{version}"
