"""Reads of the MLflow registry without the `mlflow` package: policies, their revisions, aliases and lineage.

MLflow's aliases are the truth for which revision `policy@alias` names, so every read that decides something
(promote's expectation, rollback, reconcile, `mint registry ...`) asks MLflow. Against a tracking server
(`http(s)://`) the reads speak MLflow's documented REST API with httpx (`registered-models/get` carries the
aliases, `model-versions/search|get` the versions): importing `mlflow` costs over a second, which `mint registry
ls` should not pay. Any other tracking URI (a local `sqlite:///` or file store) is read through `MlflowClient`,
imported only then; both return MLflow's JSON shapes, so one parser serves both.

The errors and the `Revision` record live here (and are re-exported by `mlflow_registry`), so a reader of the
registry needs nothing heavier than httpx and pydantic.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, Field

from mint_core.errors import MintError
from mint_core.registry.address import CHAMPION, parse_address
from mint_core.registry.retry import is_transient, retried
from mint_core.types import Digest, DigestError

logger = logging.getLogger(__name__)
T = TypeVar("T")

CANDIDATE = "candidate"
TAG_PREFIX = "mint."
DIGEST_TAG = "mint.digest"
LOCAL_SCHEME = "mint-store://"
_API = "/api/2.0/mlflow"
KIND_TAG = "mint.kind"
"""Registered-model tag saying what a registered model holds: `policy` (the lifecycle, people), `tinker` (Tinker
API saves), or `router` (the `model: "auto"` router's revisions, `mint_core.registry.routers`)."""
ROUTER_KIND = "router"
"""`KIND_TAG` of a router's registered model: not a policy (its versions are no adapter revisions), so the policy
listings (`policies`, reconcile, retraining, the catalog's rebuild) leave it out."""


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

    timeout_s: float = Field(default=30.0, gt=0)
    """Seconds one HTTP request to the server may take."""


@dataclass(frozen=True, slots=True)
class Revision:
    """One model version of a policy, as the registry holds it."""

    policy: str
    version: int
    digest: Digest
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
    def location(self) -> str:
        """Where the version's source says the revision's bytes are."""
        return source_location(self.source)

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


def parse_revision(mv: dict[str, Any], aliases: tuple[str, ...] | None = None) -> Revision:
    """A `Revision` from MLflow's JSON of a model version (REST, or `MlflowClient` entities as JSON)."""
    raw = mv.get("tags") or []
    tags = {t["key"]: t.get("value", "") for t in raw} if isinstance(raw, list) else dict(raw)
    where = f"{mv.get('name')}/v{mv.get('version')}"
    try:
        digest = Digest.parse(tags.get(DIGEST_TAG, ""))
    except DigestError as e:
        raise RegistryError(f"{where} is not a mint revision: its {DIGEST_TAG} tag is {e}") from e
    return Revision(
        policy=str(mv["name"]),
        version=int(mv["version"]),
        digest=digest,
        source=str(mv.get("source") or ""),
        base=tags.get("mint.base", ""),
        rank=int(tags.get("mint.rank", "0") or 0),
        parent=tags.get("mint.parent") or None,
        data_rev=tags.get("mint.data_rev") or None,
        run_id=mv.get("run_id") or None,
        aliases=tuple(sorted(mv.get("aliases") or ())) if aliases is None else aliases,
        tags=tags,
        created_ms=int(mv.get("creation_timestamp") or 0),
    )


def _tags_of(rm: dict[str, Any]) -> dict[str, str]:
    raw = rm.get("tags") or []
    return {t["key"]: t.get("value", "") for t in raw} if isinstance(raw, list) else dict(raw)


def is_router(rm: dict[str, Any]) -> bool:
    """A registered model (MLflow's JSON) that holds router revisions, not a policy."""
    return _tags_of(rm).get(KIND_TAG) == ROUTER_KIND


def _aliases_of(rm: dict[str, Any]) -> dict[str, int]:
    return {a["alias"]: int(a["version"]) for a in rm.get("aliases") or ()}


MOVER_TAG = "mint.alias_mover."
"""Prefix of the registered-model tag in which mint's MLflow auth app names who last set or deleted an alias
(`<prefix><alias>`: JSON with the version it moved to, null for a deletion, and the MLflow user)."""


def movers_of(rm: dict[str, Any]) -> dict[str, tuple[int | None, str]]:
    """Who last set or deleted each alias of a registered model (its tags): alias -> (the version it was moved
    to, None for a deletion; the MLflow user)."""
    tags = _tags_of(rm)
    out: dict[str, tuple[int | None, str]] = {}
    for key, value in tags.items():
        if not key.startswith(MOVER_TAG):
            continue
        try:
            got = json.loads(value)
            version = None if got.get("version") is None else int(got["version"])
            out[key.removeprefix(MOVER_TAG)] = (version, str(got["user"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


# ---- the two ways of asking MLflow ---------------------------------------------------------------------


class _ServerBusy(RuntimeError):
    """A 5xx answer whose message is a transient database error (the server's own store was locked)."""


class _Rest:
    """MLflow's REST API over httpx; errors keep MLflow's `error_code` and `message`."""

    def __init__(self, uri: str, timeout_s: float):
        self.uri = uri.rstrip("/")
        # MLflow's auth app: the login MLflow's own client sends (MLFLOW_TRACKING_USERNAME / _PASSWORD)
        user, password = (
            os.environ.get("MLFLOW_TRACKING_USERNAME"),
            os.environ.get("MLFLOW_TRACKING_PASSWORD"),
        )
        auth = httpx.BasicAuth(user, password) if user and password else None
        self.http = httpx.Client(base_url=self.uri + _API, timeout=timeout_s, auth=auth)

    def get(self, what: str, path: str, params: dict[str, Any]) -> dict[str, Any]:
        def once() -> httpx.Response:
            r = self.http.get(path, params=params)
            if r.status_code >= 500 and is_transient(_ServerBusy(r.text)):
                raise _ServerBusy(r.text[:300])
            return r

        try:
            r = retried(once)
        except httpx.TransportError as e:
            raise RegistryUnavailable(f"{what}: the MLflow registry at {self.uri} is unreachable: {e}") from e
        except _ServerBusy as e:
            raise RegistryError(f"{what}: the MLflow server stayed busy: {e}") from e
        if r.status_code == 200:
            return dict(r.json())
        try:
            body = r.json()
        except ValueError:
            body = {"error_code": str(r.status_code), "message": r.text[:200]}
        raise registry_error(what, str(body.get("error_code", r.status_code)), str(body.get("message", "")))

    def registered_model(self, name: str) -> dict[str, Any]:
        what = f"get policy {name!r}"
        return dict(self.get(what, "/registered-models/get", {"name": name})["registered_model"])

    def model_version(self, name: str, version: int) -> dict[str, Any]:
        what = f"get {name}/v{version}"
        got = self.get(what, "/model-versions/get", {"name": name, "version": str(version)})
        return dict(got["model_version"])

    def search_versions(self, what: str, filter_string: str) -> Iterator[dict[str, Any]]:
        params: dict[str, Any] = {"filter": filter_string, "max_results": 10_000}
        while True:
            page = self.get(what, "/model-versions/search", params)
            yield from page.get("model_versions") or ()
            if not page.get("next_page_token"):
                return
            params["page_token"] = page["next_page_token"]

    def search_models(self) -> Iterator[dict[str, Any]]:
        params: dict[str, Any] = {"max_results": 1000}
        while True:
            page = self.get("list policies", "/registered-models/search", params)
            yield from page.get("registered_models") or ()
            if not page.get("next_page_token"):
                return
            params["page_token"] = page["next_page_token"]

    def health(self) -> None:
        try:
            self.http.get(self.uri + "/health", timeout=3.0).raise_for_status()
        except httpx.HTTPError as e:
            raise RegistryUnavailable(
                f"the MLflow registry at {self.uri} is unreachable ({type(e).__name__}: {e}); "
                "start it with `mint up --only mlflow` or set MLFLOW_TRACKING_URI"
            ) from e


class _Client:
    """`MlflowClient` for tracking URIs that are not a server (a local SQLite or file store)."""

    def __init__(self, uri: str):
        # deferred: mlflow takes over a second to import, and only a non-server URI needs it here
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException
        from mlflow.utils.proto_json_utils import message_to_json

        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self._exc = MlflowException
        self._json = message_to_json

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return retried(fn)
        except self._exc as e:
            raise registry_error(what, str(e.error_code), e.message) from e

    def _as_dict(self, entity: Any) -> dict[str, Any]:
        return dict(json.loads(self._json(entity.to_proto())))

    def registered_model(self, name: str) -> dict[str, Any]:
        rm = self._call(f"get policy {name!r}", lambda: self.client.get_registered_model(name))
        return self._as_dict(rm)

    def model_version(self, name: str, version: int) -> dict[str, Any]:
        mv = self._call(f"get {name}/v{version}", lambda: self.client.get_model_version(name, str(version)))
        return self._as_dict(mv)

    def search_versions(self, what: str, filter_string: str) -> Iterator[dict[str, Any]]:
        mvs = self._call(what, lambda: self.client.search_model_versions(filter_string, max_results=10_000))
        return (self._as_dict(mv) for mv in mvs)

    def search_models(self) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            page = self._call(
                "list policies",
                partial(self.client.search_registered_models, max_results=1000, page_token=token),
            )
            yield from (self._as_dict(rm) for rm in page)
            token = page.token
            if not token:
                return

    def health(self) -> None:
        return None


def registry_error(what: str, code: str, message: str) -> RegistryError:
    """The error of an MLflow call that failed with MLflow's `error_code` and `message`."""
    # a missing alias comes back as INVALID_PARAMETER_VALUE "... alias x not found."
    if "RESOURCE_DOES_NOT_EXIST" in code or "not found" in message.lower():
        return UnknownRevision(f"{what}: {message}")
    if "connection refused" in message.lower() or "max retries exceeded" in message.lower():
        return RegistryUnavailable(f"{what}: the MLflow registry is unreachable: {message}")
    return RegistryError(f"{what}: {message}")


# ---- the reader ----------------------------------------------------------------------------------------


class RegistryReader:
    """Policies, revisions and aliases as MLflow holds them now."""

    def __init__(self, config: RegistryConfig | None = None):
        self.config = config or RegistryConfig()
        self.uri = self.config.tracking_uri
        if self.uri.startswith(("http://", "https://")):
            self._api: _Rest | _Client = _Rest(self.uri, self.config.timeout_s)
        else:
            self._api = _Client(self.uri)

    def check_reachable(self) -> None:
        """`RegistryUnavailable` naming the server when it does not answer."""
        self._api.health()

    def policies(self) -> list[str]:
        """Every policy's name: the registered models, but a router's (`ROUTER_KIND`)."""
        return sorted(str(rm["name"]) for rm in self._api.search_models() if not is_router(rm))

    def aliases(self, policy: str) -> dict[str, int]:
        """The policy's aliases and the versions they name (`UnknownRevision` for an unknown policy)."""
        return _aliases_of(self._api.registered_model(policy))

    def aliases_and_movers(self, policy: str) -> tuple[dict[str, int], dict[str, tuple[int | None, str]]]:
        """`aliases` and, from the same read, who last moved each one in MLflow (`movers_of`)."""
        rm = self._api.registered_model(policy)
        return _aliases_of(rm), movers_of(rm)

    def alias_version(self, policy: str, alias: str = CHAMPION) -> int | None:
        """The version MLflow's `policy@alias` points at; None when unset (or the policy is unknown)."""
        try:
            return self.aliases(policy).get(alias)
        except UnknownRevision:
            return None

    def revision(self, policy: str, version: int) -> Revision:
        try:
            mv = self._api.model_version(policy, version)
        except UnknownRevision as e:
            have = [r.version for r in self.revisions(policy)]  # an unknown policy raises its own error here
            listed = f"v{have[0]}..v{have[-1]}" if have else "none"
            raise UnknownRevision(f"{policy} has no version v{version} (its versions: {listed})") from e
        return parse_revision(mv)

    def revisions(self, policy: str) -> list[Revision]:
        """Every mint revision of a policy, oldest first (versions without a `mint.digest` tag are skipped)."""
        by_version: dict[int, list[str]] = {}
        for alias, version in self.aliases(policy).items():  # search results carry no aliases
            by_version.setdefault(version, []).append(alias)
        revs = []
        for mv in self._api.search_versions(f"list versions of {policy!r}", f"name = '{policy}'"):
            try:
                revs.append(parse_revision(mv, tuple(sorted(by_version.get(int(mv["version"]), [])))))
            except RegistryError as e:
                logger.warning("%s", e)
        return sorted(revs, key=lambda r: r.version)

    def by_digest(self, policy: str, digest: Digest) -> Revision | None:
        """The policy's oldest version of these bytes, if any."""
        try:
            mvs = list(
                self._api.search_versions(
                    f"find {digest.prefixed[:19]} in {policy!r}",
                    f"name = '{policy}' and tags.`{DIGEST_TAG}` = '{digest}'",
                )
            )
        except UnknownRevision:
            return None
        found = sorted((parse_revision(mv) for mv in mvs), key=lambda r: r.version)
        return found[0] if found else None

    def children(self, address: str) -> list[Revision]:
        """The versions, of any policy, whose `mint.parent` is `address` (`policy/vN`)."""
        found = self._api.search_versions(
            f"find the children of {address}", f"tags.`mint.parent` = '{parse_address(address)}'"
        )
        return sorted((parse_revision(mv) for mv in found), key=lambda r: (r.policy, r.version))

    def everything(self) -> tuple[dict[str, dict[str, int]], list[Revision]]:
        """Every policy's aliases and every mint revision of every policy, in one pass over the registry (two
        paged searches): what a decision that follows lineage across policies reads."""
        models = list(self._api.search_models())
        aliased = {str(rm["name"]): _aliases_of(rm) for rm in models if not is_router(rm)}
        routers = {str(rm["name"]) for rm in models if is_router(rm)}
        revs = []
        for mv in self._api.search_versions("list every version", ""):
            if str(mv.get("name")) in routers:
                continue  # a router's version: no adapter revision
            try:
                revs.append(parse_revision(mv))
            except RegistryError as e:
                logger.warning("%s", e)
        return aliased, sorted(revs, key=lambda r: (r.policy, r.version))

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
                found = self.by_digest(policy, addr.digest)
                if found is None:
                    break  # a parent outside the registry (e.g. an imported adapter): lineage ends here
                out.append(found)
            else:
                break
        return out
