"""`mint access`: who may do what on a stack, in its access file (`<state dir>/access.json`, mint_core.access):
users and their roles (their MLflow logins), and serving keys with the policies each may call. Each command
checks its input first, then changes the file under a lock and writes it atomically; mint serve reads it again
on change (a rotated or revoked key is refused without a restart), and a user change reaches MLflow's auth app
at once when MLflow runs."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, TypeVar, cast

import typer
from rich.table import Table

from mint_app.cli.services import ConfigFile, StateDir, _config
from mint_app.console import make_console
from mint_core import access
from mint_core.access import ROLES, Access, AccessError, Role, ServingKey, User

console = make_console()
T = TypeVar("T")

access_app = typer.Typer(
    help="Users, roles and serving keys of the stack (its access file, <state dir>/access.json).",
    no_args_is_help=True,
)
users_app = typer.Typer(help="Users and their roles (their MLflow logins).", no_args_is_help=True)
keys_app = typer.Typer(help="Serving keys and the policies each may call.", no_args_is_help=True)
access_app.add_typer(users_app, name="users")
access_app.add_typer(keys_app, name="keys")

RoleArg = Annotated[
    str, typer.Option("--role", help=f"One of {', '.join(ROLES)} (docs/security.md says what each may do).")
]
Policies = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated policy names or globs (`my-policy`, `tenant-a/*`, `*`): for a key, what it may "
        "call; for a reviewer, whose aliases they may move."
    ),
]


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]{message}[/]", soft_wrap=True)
    return typer.Exit(1)


def _path(state_dir: Path | None, config: Path | None) -> Path:
    """The access file of the stack these options name."""
    return access.access_path(_config(config, state_dir=state_dir).state_dir)


@contextmanager
def _editing(path: Path) -> Iterator[Access]:
    """The access file, changed under its lock and saved when the block ends; a failure writes nothing."""
    try:
        with access.edit(path) as (found, made):
            yield found
    except AccessError as e:
        raise _fail(str(e)) from None
    if made:
        console.print(f"wrote {path} (readable by you only), with an admin user and a default key")


def _policies(raw: str | None, what: str) -> list[str]:
    """`a, b/*` -> ["a", "b/*"]; BadParameter naming the pattern that is not one."""
    items = [p.strip() for p in (raw or "").split(",")]
    if raw is None or not all(items):
        raise typer.BadParameter(
            f"{what} needs --policies: comma-separated names or globs, none empty (got {raw!r})",
            param_hint="--policies",
        )
    try:
        return access.check_patterns(items)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--policies") from None


def _name(name: str, what: str) -> str:
    if not re.match(access.NAME_PATTERN, name):
        raise typer.BadParameter(
            f"{name!r} is not a valid {what} name: a letter or digit, then up to 63 of letters, digits and _.@-",
            param_hint="NAME",
        )
    return name


def _role(role: str) -> Role:
    if role not in ROLES:
        raise typer.BadParameter(
            f"{role!r} is not a role: choose one of {', '.join(ROLES)}", param_hint="--role"
        )
    return cast(Role, role)


def _user_policies(role: Role, policies: str | None) -> list[str]:
    """A reviewer's policies (required: they are what it may move); other roles take none."""
    if role == "reviewer":
        return _policies(policies, "a reviewer")
    if policies is not None:
        raise typer.BadParameter(
            f"--policies is for reviewers (whose aliases they may move); a {role} has no such list",
            param_hint="--policies",
        )
    return []


def _sync(config: Path | None, state_dir: Path | None) -> None:
    """Hand a user change to MLflow's auth app when this stack's MLflow runs (else its next start reads it)."""
    from mint_app.services.control import status

    cfg = _config(config, state_dir=state_dir)
    (mlflow,) = status(cfg, ["mlflow"])
    if mlflow.state != "running":
        console.print("MLflow is not running here: it takes the change when mint up starts it")
        return
    from mint_app.services.config import ServiceError
    from mint_app.services.mlflow_auth import sync_users  # loads MLflow: only when there is one to tell

    try:
        changes = sync_users(cfg)
    except ServiceError as e:
        raise _fail(f"saved in the access file, but MLflow at {mlflow.url} did not take it: {e}") from None
    console.print(f"MLflow at {mlflow.url}: " + ("; ".join(changes) or "its users already matched"))


def _named(lookup: Callable[[str], T], name: str, path: Path) -> T:
    """`lookup(name)` (a user or a key of the file), or exit 1 naming the file and what it has."""
    try:
        return lookup(name)
    except AccessError as e:
        raise _fail(str(e) if str(e).startswith(str(path)) else f"{path}: {e}") from None


def _last_admin(found: Access, name: str) -> bool:
    return [n for n, u in found.users.items() if u.role == "admin"] == [name]


@access_app.command("show")
def show(
    secrets: Annotated[bool, typer.Option("--secrets", help="Also print passwords and key secrets.")] = False,
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Where the access file is, its users and their roles, its serving keys and their policies (the secrets
    only with --secrets)."""
    path = _path(state_dir, config)
    try:
        found = access.load(path)
    except AccessError as e:
        raise _fail(f"{e} (mint up writes it on first start)") from None
    console.print(f"access file: {path}")
    users = Table("user", "role", "policies (reviewer)", *(["password"] if secrets else []), title="users")
    for name, u in sorted(found.users.items()):
        users.add_row(name, u.role, ", ".join(u.policies) or "-", *([u.password] if secrets else []))
    console.print(users)
    keys = Table("key", "policies", "created", *(["secret"] if secrets else []), title="serving keys")
    for name, k in sorted(found.keys.items()):
        created = _when(k.created)
        keys.add_row(name, ", ".join(k.policies), created, *([k.secret] if secrets else []))
    console.print(keys)
    svc = found.service
    console.print(f"mint's own components: MLflow user {svc.mlflow_user!r}, the Prefect auth string")
    if secrets:
        console.print(f"  MLflow password {svc.mlflow_password}; Prefect auth string {svc.prefect_auth}")


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds")


@users_app.command("add")
def users_add(
    name: Annotated[str, typer.Argument(help="The user's name (their MLflow login).")],
    role: RoleArg,
    policies: Policies = None,
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Add a user with a role and a new password (printed once here)."""
    name, checked = _name(name, "user"), _role(role)
    pols = _user_policies(checked, policies)
    path = _path(state_dir, config)
    with _editing(path) as found:
        if name == found.service.mlflow_user:
            raise _fail(
                f"{path}: {name!r} is mint's own MLflow account (its components'); choose another name"
            )
        if name in found.users:
            raise _fail(
                f"{path}: a user named {name!r} exists ({found.users[name].role}); users set-role changes it"
            )
        user = User(role=checked, password=access.new_secret(), policies=pols)
        found.users[name] = user
    console.print(f"added {name} ({checked}{': ' + ', '.join(pols) if pols else ''})")
    console.print(f"password of {name}: {user.password}")
    _sync(config, state_dir)


@users_app.command("set-role")
def users_set_role(
    name: Annotated[str, typer.Argument(help="The user.")],
    role: RoleArg,
    policies: Policies = None,
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Change a user's role (a reviewer's policies with it); the last admin stays an admin."""
    checked = _role(role)
    pols = _user_policies(checked, policies)
    path = _path(state_dir, config)
    with _editing(path) as found:
        user = _named(found.user_named, name, path)
        if checked != "admin" and _last_admin(found, name):
            raise _fail(f"{path}: {name!r} is the last admin; make another user admin first")
        user.role, user.policies = checked, pols
    console.print(f"{name}: now {checked}{': ' + ', '.join(pols) if pols else ''}")
    _sync(config, state_dir)


@users_app.command("remove")
def users_remove(
    name: Annotated[str, typer.Argument(help="The user.")],
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Remove a user (their MLflow login with them); the last admin cannot be removed."""
    path = _path(state_dir, config)
    with _editing(path) as found:
        _named(found.user_named, name, path)
        if _last_admin(found, name):
            raise _fail(f"{path}: {name!r} is the last admin; make another user admin first")
        del found.users[name]
    console.print(f"removed user {name}")
    _sync(config, state_dir)


@users_app.command("reset-password")
def users_reset_password(
    name: Annotated[str, typer.Argument(help="The user.")],
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Give a user a new password (printed once here); the old one stops working."""
    path = _path(state_dir, config)
    with _editing(path) as found:
        user = _named(found.user_named, name, path)
        user.password = access.new_secret()
    console.print(f"password of {name}: {user.password}")
    _sync(config, state_dir)


@keys_app.command("add")
def keys_add(
    name: Annotated[str, typer.Argument(help="The key's name (what metrics and logs call it).")],
    policies: Policies = None,
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Add a serving key that may call the given policies; its secret is printed once here."""
    name, pols = _name(name, "key"), _policies(policies, "a serving key")
    path = _path(state_dir, config)
    with _editing(path) as found:
        if name in found.keys:
            raise _fail(f"{path}: a key named {name!r} exists; keys rotate gives it a new secret")
        key = ServingKey(secret=access.new_secret("mint-"), policies=pols)
        found.keys[name] = key
    console.print(f"added key {name}: may call {', '.join(pols)}")
    console.print(f"secret (Authorization: Bearer ...): {key.secret}")


@keys_app.command("rotate")
def keys_rotate(
    name: Annotated[str, typer.Argument(help="The key.")],
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Give a key a new secret (printed once here): mint serve refuses the old one within a second, no restart."""
    path = _path(state_dir, config)
    with _editing(path) as found:
        old = _named(found.key_named, name, path)
        key = ServingKey(secret=access.new_secret("mint-"), policies=old.policies)
        found.keys[name] = key
    console.print(f"rotated key {name} (policies {', '.join(key.policies)}); the old secret is refused")
    console.print(f"secret (Authorization: Bearer ...): {key.secret}")


@keys_app.command("revoke")
def keys_revoke(
    name: Annotated[str, typer.Argument(help="The key.")],
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Remove a key: mint serve refuses it within a second, no restart."""
    path = _path(state_dir, config)
    with _editing(path) as found:
        _named(found.key_named, name, path)
        del found.keys[name]
    console.print(f"revoked key {name}")


@keys_app.command("secret")
def keys_secret(
    name: Annotated[str, typer.Argument(help="The key.")] = access.DEFAULT_KEY,
    state_dir: StateDir = None,
    config: ConfigFile = None,
) -> None:
    """Print a key's secret alone, for a script or a client: KEY=$(mint access keys secret)."""
    path = _path(state_dir, config)
    secret = _named(lambda n: access.load(path).key_named(n), name, path).secret
    print(secret)
