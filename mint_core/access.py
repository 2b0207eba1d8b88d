"""Who may do what: the one file of a stack's users, roles, service credentials and serving keys.

`mint up` writes it on first start (`<state dir>/access.json`, mode 0600, readable by its owner only, as a
Jupyter token file is) and every service reads its part from it:

- **users** and their role. `viewer` reads (the MLflow UI, the Prefect dashboard is not theirs); `reviewer`
  reads and moves the aliases of the policies its `policies` patterns match, in the MLflow UI (rollback and
  promotion); `operator` starts, cancels and changes runs (the Prefect dashboard and API) and reads; `admin`
  does everything, users and keys included. A user's password is its login to MLflow.
- **service**: the credentials mint's own components use (flows, workers, the webhook receiver, reconcile,
  the Tinker registry): an MLflow account with every permission, and the Prefect server's auth string.
- **keys**: serving keys (`Authorization: Bearer <secret>` on mint serve). Each calls only the policies its
  `policies` patterns match (`*` every one, `tenant-a/*` a catalog prefix, `my-policy` one name); another's
  gets a 403 that names nothing the key may not see, and `/v1/models` lists only what it may call.
  mint serve reads the file again when it changes: a rotated key works, and the old one is refused, without
  a restart (`KeyRing`).

The file holds secrets in the clear (mint logs in with them), so it is written 0600 and atomically (a reader
never sees half a file); `load` refuses one that others may read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mint_core.errors import MintError

Role = Literal["viewer", "reviewer", "operator", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "reviewer", "operator", "admin")
ACCESS_FILE = "access.json"
"""Its name in a state directory."""
ADMIN_USER = "admin"
"""The user `mint up` makes on first start."""
SERVICE_USER = "mint"
"""mint's own MLflow account (every permission), used by its components, never by people."""
DEFAULT_KEY = "default"
"""The serving key `mint up` makes on first start: every policy."""
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"


class AccessError(MintError):
    """The access file is missing, unreadable, readable by others, or not what it should be; names the file."""


def new_secret(prefix: str = "") -> str:
    return prefix + secrets.token_urlsafe(24)


def check_patterns(v: list[str]) -> list[str]:
    """The patterns, or ValueError naming the first that is empty or holds white space."""
    for p in v:
        if not p or p != p.strip() or any(c in p for c in " \t\n"):
            raise ValueError(f"a policy pattern must be a non-empty name or glob without spaces, not {p!r}")
    return v


class User(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    password: str = Field(min_length=12)
    policies: list[str] = Field(default_factory=list)
    """For a reviewer: the policies (names or globs) whose aliases they may move. Others: unused."""

    @field_validator("policies")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        return check_patterns(v)


class ServingKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: str = Field(min_length=16)
    policies: list[str] = Field(default_factory=lambda: ["*"])
    """What the key may call: policy names or globs (`*`: all of them, and the base)."""
    created: float = Field(default_factory=time.time)

    @field_validator("policies")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        return check_patterns(v)

    def allows(self, model: str) -> bool:
        return allows(self.policies, model)


class Service(BaseModel):
    """The credentials of mint's own components."""

    model_config = ConfigDict(extra="forbid")

    mlflow_user: str = SERVICE_USER
    mlflow_password: str = Field(default_factory=new_secret, min_length=12)
    prefect_auth: str = Field(default_factory=lambda: f"mint:{new_secret()}")
    """The Prefect server's auth string (`user:password`): one credential, for operators and admins."""


class Access(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    service: Service = Field(default_factory=Service)
    users: dict[str, User] = Field(default_factory=dict)
    keys: dict[str, ServingKey] = Field(default_factory=dict)

    @field_validator("users", "keys")
    @classmethod
    def _names(cls, v: dict[str, object]) -> dict[str, object]:
        for name in v:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not a valid name ({NAME_PATTERN})")
        return v

    @classmethod
    def first(cls) -> Access:
        """What `mint up` writes on first start: an admin with a new password, mint's service account, and a
        default key that calls every policy."""
        return cls(
            users={ADMIN_USER: User(role="admin", password=new_secret())},
            keys={DEFAULT_KEY: ServingKey(secret=new_secret("mint-"))},
        )

    def key_named(self, name: str) -> ServingKey:
        if name not in self.keys:
            raise AccessError(
                f"no serving key named {name!r} (keys: {', '.join(sorted(self.keys)) or 'none'})"
            )
        return self.keys[name]

    def user_named(self, name: str) -> User:
        if name not in self.users:
            raise AccessError(f"no user named {name!r} (users: {', '.join(sorted(self.users)) or 'none'})")
        return self.users[name]


def allows(patterns: list[str], model: str) -> bool:
    """Whether a model name (a policy, `policy@vN`, a catalog address `tenant/policy`) is matched by one of the
    patterns: on the whole name, or on its policy part before `@`."""
    policy = model.split("@", 1)[0]
    return any(fnmatchcase(model, p) or fnmatchcase(policy, p) for p in patterns)


def access_path(state_dir: Path) -> Path:
    return Path(state_dir) / ACCESS_FILE


def load(path: Path) -> Access:
    """The access file at `path`; AccessError naming the file when it is missing, readable by group or others,
    not JSON, or not valid (with the field that is wrong)."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as e:
        raise AccessError(f"{path}: cannot read the access file: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AccessError(
            f"{path}: the access file holds secrets and is open to others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"make it readable by its owner only: chmod 600 {path}"
        )
    try:
        return Access.model_validate(json.loads(text))
    except json.JSONDecodeError as e:
        raise AccessError(f"{path}: not valid JSON: {e}") from None
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise AccessError(f"{path}: {errs}") from None


def save(path: Path, access: Access) -> None:
    """Write the file atomically with mode 0600 (a reader sees the old file or the new one, never a part)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(access.model_dump_json(indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def ensure(path: Path) -> tuple[Access, bool]:
    """The access file, written with `Access.first()` when there is none; (access, whether it was made now)."""
    path = Path(path)
    if path.exists():
        return load(path), False
    access = Access.first()
    save(path, access)
    return access, True


@contextmanager
def edit(path: Path) -> Iterator[tuple[Access, bool]]:
    """Change the access file under a lock (two commands at once never lose one's change): yields (access,
    whether there was no file: `Access.first()` then); on a normal exit the changed access is validated again
    and saved atomically, and after an exception nothing is written (not even a first file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(path.with_name(f".{path.name}.lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = not path.exists()
        access = Access.first() if made else load(path)
        yield access, made
        try:  # what the caller changed in place, checked as a whole (a name, a role, a pattern)
            checked = Access.model_validate(access.model_dump())
        except ValidationError as e:
            errs = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
            raise AccessError(f"{path}: not saved: {errs}") from None
        save(path, checked)
    finally:
        os.close(lock)  # releases the lock


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class KeyRing:
    """The serving keys of an access file, read again when the file changes (checked at most every
    `recheck_s`): `match` finds the key a bearer secret belongs to, by digest, so a lookup takes the same time
    whichever key it is. A file that turns invalid keeps the last good keys (and says so once)."""

    def __init__(self, path: Path, recheck_s: float = 0.5):
        self.path = Path(path)
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._by_digest: dict[bytes, tuple[str, ServingKey]] = {}
        self.error: str | None = None
        self._reload()
        if self.error is not None:
            raise AccessError(self.error)

    def _reload(self) -> None:
        try:
            st = self.path.stat()
        except OSError as e:
            self.error = f"{self.path}: cannot read the access file: {e.strerror or e}"
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        try:
            access = load(self.path)
        except AccessError as e:
            self.error = str(e)
            return
        self._by_digest = {_digest(k.secret): (name, k) for name, k in access.keys.items()}
        self._stamp, self.error = stamp, None

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked >= self.recheck_s:
            with self._lock:
                if now - self._checked >= self.recheck_s:
                    self._reload()
                    self._checked = now

    def match(self, secret: str | None) -> tuple[str, ServingKey] | None:
        """(name, key) of the key whose secret this is, or None."""
        self._refresh()
        if not secret:
            return None
        return self._by_digest.get(_digest(secret))

    def names(self) -> list[str]:
        self._refresh()
        return sorted(name for name, _ in self._by_digest.values())
