"""MLflow behind its own auth app, its users and their rights taken from the access file (`mint_core.access`).

`mint up` starts MLflow with `--app-name mint-auth` (this module's `create_app`: MLflow's `basic-auth` app and
two hooks). Its config (`mlflow-auth.ini`, 0600) and its users' database (`mlflow-auth.db`, SQLite) are kept in
the state dir. Anyone without a login gets 401; every login reads (the default permission is READ); the rest
comes from the access file, by `sync_users`:

- the service account (`service.mlflow_user`, mint's components) and every `admin` are MLflow admins;
- a `reviewer` has EDIT (what setting and deleting an alias ask) on every registered model its `policies`
  patterns match, so it moves those policies' aliases in the UI and gets 403 on any other;
- `viewer` and `operator` read only; a user no longer in the file is deleted from MLflow.

A model created later is granted to the reviewers whose patterns match it when it is created (the app's
`after_request` hook), and `sync_users` runs on `mint up` and after each `mint access` change.

Who moved an alias: before MLflow sets or deletes an alias for a login it has let through, the app records the
login on the registered model (tag `mint.alias_mover.<alias>`: the version it moves to, the user, the time).
When reconcile finds the move and the catalog's index logs it, that user is the move's actor
(`mint registry history`), instead of a bare `mlflow`.

Every mint component that talks to MLflow logs in as the service account: MLflow's client reads
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (`service_env` gives them to the services `mint up` starts,
`as_service` to a process that talks to the stack's MLflow).
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mint_core.access import Access, AccessError, access_path, allows, load
from mint_core.registry.reader import MOVER_TAG

if TYPE_CHECKING:
    from mint_app.services.config import ServicesConfig

logger = logging.getLogger(__name__)

APP_NAME = "mint-auth"
"""The `mlflow.app` entry point of `create_app` (pyproject.toml): `mlflow server --app-name mint-auth`."""
INI_FILE = "mlflow-auth.ini"
DB_FILE = "mlflow-auth.db"
ACCESS_FILE_ENV = "MINT_MLFLOW_ACCESS_FILE"
"""The access file the app reads when a model is created (its reviewers' patterns)."""
USER_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
AUTH_CACHE_S = 10
"""How long MLflow's auth app trusts a checked login (its auth_cache_ttl_seconds)."""
REVIEWER_PERMISSION = "EDIT"
"""A reviewer's permission on its policies: MLflow's alias set and delete ask `update` / `delete` (EDIT)."""
_ALIAS_PATHS = ("/api/2.0/mlflow/registered-models/alias", "/ajax-api/2.0/mlflow/registered-models/alias")
_CREATE_PATHS = ("/api/2.0/mlflow/registered-models/create", "/ajax-api/2.0/mlflow/registered-models/create")


def ini_path(config: ServicesConfig) -> Path:
    return config.state_dir / INI_FILE


def db_uri(config: ServicesConfig) -> str:
    return f"sqlite:///{(config.state_dir / DB_FILE).resolve()}"


def _access(config: ServicesConfig) -> Access:
    from mint_app.services.config import ServiceError

    try:
        return load(access_path(config.state_dir))
    except AccessError as e:
        raise ServiceError(f"mlflow: {e}") from None


def write_ini(config: ServicesConfig) -> Path:
    """The auth app's config in the state dir (0600: it holds the service password MLflow makes its admin
    with on first start): users' database in the state dir, every login reads, the service account is admin."""
    service = _access(config).service
    text = (
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = {db_uri(config)}\n"
        f"admin_username = {service.mlflow_user}\n"
        f"admin_password = {service.mlflow_password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # a login's password hash (PBKDF2, near a second on a loaded core) is checked once per AUTH_CACHE_S,
        # not on every request: a reconcile's burst of reads would take seconds; a removed user or an old
        # password is refused at most AUTH_CACHE_S later
        f"auth_cache_ttl_seconds = {AUTH_CACHE_S}\n"
    )
    path = ini_path(config)
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def service_env(config: ServicesConfig) -> dict[str, str]:
    """MLflow's client login as mint's service account (empty without an access file). For an MLflow this state
    dir does not run (another host's `mlflow_url`, another stack's port), an exported login (its owner's) wins,
    as the Prefect auth string does (`prefect_auth.client_auth`)."""
    from mint_app.services.processes import read_record

    exported = {k: os.environ[k] for k in (USER_ENV, PASSWORD_ENV) if os.environ.get(k)}
    own = config.mlflow_url is None and read_record(config, "mlflow") is not None
    if len(exported) == 2 and not own:
        return exported
    try:
        service = load(access_path(config.state_dir)).service
    except AccessError:
        return {}
    return {USER_ENV: service.mlflow_user, PASSWORD_ENV: service.mlflow_password}


@contextmanager
def as_service(config: ServicesConfig) -> Iterator[dict[str, str]]:
    """This process's MLflow clients log in as the service account inside the block (the variables restored
    after it)."""
    env = service_env(config)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- users: from the access file into MLflow's auth database ---------------------------------------------


QUIET_IMPORT_WARNING = "ignore:starlette.middleware.wsgi is deprecated:UserWarning"
"""The one warning importing `mlflow.server` gives with Starlette >= 1.10 (MLflow's FastAPI app imports Starlette's
WSGI middleware), as a `-W` / PYTHONWARNINGS filter."""


def _auth_store(config: ServicesConfig) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUIET_IMPORT_WARNING.split(":")[1], category=UserWarning)
        from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore()
    store.init_db(db_uri(config))
    return store


def _model_names(config: ServicesConfig) -> list[str]:
    """Every registered model of the stack's MLflow, read from its backend store (the server need not run)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=config.mlflow_backend(), registry_uri=config.mlflow_backend())
    names, token = [], None
    while True:
        page = client.search_registered_models(max_results=1000, page_token=token)
        names += [rm.name for rm in page]
        token = page.token
        if not token:
            return names


def _sync_account(store: Any, name: str, password: str, admin: bool, changes: list[str]) -> None:
    if not store.has_user(name):
        store.create_user(name, password, is_admin=admin)
        changes.append(f"{name}: created{' (admin)' if admin else ''}")
        return
    if not store.authenticate_user(name, password):
        store.update_user(name, password=password)
        changes.append(f"{name}: password changed")
    if store.get_user(name).is_admin != admin:
        store.update_user(name, is_admin=admin)
        changes.append(f"{name}: {'made' if admin else 'no longer'} an admin")


def _sync_grants(store: Any, name: str, want: set[str], changes: list[str]) -> None:
    """The user's registered-model permissions become EDIT on exactly `want`."""
    have = {p.name: p.permission for p in store.list_registered_model_permissions(name)}
    for model in sorted(want):
        if model not in have:
            store.create_registered_model_permission(model, name, REVIEWER_PERMISSION)
            changes.append(f"{name}: may move {model}'s aliases")
        elif have[model] != REVIEWER_PERMISSION:
            store.update_registered_model_permission(model, name, REVIEWER_PERMISSION)
    for model in sorted(set(have) - want):
        store.delete_registered_model_permission(model, name)
        changes.append(f"{name}: no longer moves {model}'s aliases")


def sync_users(config: ServicesConfig) -> list[str]:
    """Make MLflow's users and their rights what the state dir's access file says (see the module's doc):
    idempotent; returns one line per change. Works whether MLflow runs or not (its auth database directly)."""
    from mint_app.services.config import ServiceError

    access = _access(config)
    service = access.service
    if service.mlflow_user in access.users:
        raise ServiceError(
            f"mlflow: the user {service.mlflow_user!r} has the name of mint's service account; rename it"
        )
    store = _auth_store(config)
    changes: list[str] = []
    _sync_account(store, service.mlflow_user, service.mlflow_password, True, changes)
    models = _model_names(config) if any(u.role == "reviewer" for u in access.users.values()) else []
    for name, user in sorted(access.users.items()):
        _sync_account(store, name, user.password, user.role == "admin", changes)
        want = {m for m in models if allows(user.policies, m)} if user.role == "reviewer" else set()
        _sync_grants(store, name, want, changes)
    for u in store.list_users():
        if u.username != service.mlflow_user and u.username not in access.users:
            store.delete_user(u.username)
            changes.append(f"{u.username}: deleted (not in {access_path(config.state_dir)})")
    return changes


# ---- the app: MLflow's basic-auth, plus who moved an alias and grants on new models ----------------------


def _record_mover() -> None:
    """Before MLflow sets or deletes an alias for a login its auth let through: name the login on the model."""
    from flask import g, request
    from mlflow.entities.model_registry import RegisteredModelTag
    from mlflow.server.auth import _get_request_param
    from mlflow.server.handlers import _get_model_registry_store

    if request.path not in _ALIAS_PATHS or request.method not in ("POST", "DELETE"):
        return
    user = getattr(g, "mlflow_authenticated_user", None)
    if user is None:
        return
    try:
        name, alias = _get_request_param("name"), _get_request_param("alias")
        version = _get_request_param("version") if request.method == "POST" else None
        value = json.dumps(
            {"version": None if version is None else int(version), "user": user, "at": time.time()}
        )
        _get_model_registry_store().set_registered_model_tag(
            name, RegisteredModelTag(MOVER_TAG + alias, value)
        )
    except Exception as e:  # a bad request or unknown model: MLflow's handler answers it
        logger.debug("no alias mover recorded: %s", e)


def _grant_new_model(response: Any) -> Any:
    """After a registered model is created: EDIT on it to each reviewer whose patterns match its name."""
    from flask import request
    from mlflow.server.auth import store

    if request.path not in _CREATE_PATHS or response.status_code != 200:
        return response
    path = os.environ.get(ACCESS_FILE_ENV)
    try:
        name = str(response.get_json()["registered_model"]["name"])
        access = load(Path(path)) if path else None
    except (AccessError, KeyError, TypeError, ValueError) as e:
        logger.warning("no reviewer grants for the new model: %s", e)
        return response
    for user_name, user in (access.users if access else {}).items():
        if user.role == "reviewer" and allows(user.policies, name):
            try:
                store.create_registered_model_permission(name, user_name, REVIEWER_PERMISSION)
            except Exception as e:  # not synced yet, or already granted
                logger.warning("could not grant %s EDIT on %s: %s", user_name, name, e)
    return response


def create_app() -> Any:
    """`mlflow server --app-name mint-auth`: MLflow's basic-auth app with mint's two hooks (after its own, so
    they see only requests it let through)."""
    from mlflow.server import app as flask_app
    from mlflow.server.auth import create_app as basic_auth

    made = basic_auth(flask_app)
    flask_app.before_request(_record_mover)
    flask_app.after_request(_grant_new_model)
    return made
