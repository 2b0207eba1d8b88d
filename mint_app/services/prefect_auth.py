"""The Prefect server's auth string: where mint's servers, workers, flow runs and clients get it.

Prefect 3's server takes one `user:password` string (`PREFECT_SERVER_API_AUTH_STRING`) and asks it, as HTTP
basic auth, on every API route but its health probes (`/api/health`, `/api/ready`); its dashboard asks for it at
a login prompt; its clients send `PREFECT_API_AUTH_STRING`. `mint up` starts the server with the access file's
`service.prefect_auth` (`mint_core.access`), gives it to the worker (its flow runs inherit it) and to every mint
command that talks to that server, and writes it, for the owner's own Prefect clients run in the project's
directory (`prefect deployment run ...`, a script's `get_client()`), into a `prefect.toml` there that git
ignores and only its owner may read (Prefect reads that file from the working directory).

Prefect has one credential for everyone: whoever holds the string may do everything Prefect does. Operators and
admins hold it; viewers and reviewers do not (docs/lifecycle.md, "The Prefect server's auth string").
"""

from __future__ import annotations

import base64
import logging
import os
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from mint_app.services.config import ServicesConfig
from mint_app.services.processes import read_record
from mint_core.access import access_path, ensure, load

logger = logging.getLogger(__name__)

AUTH_ENV = "PREFECT_API_AUTH_STRING"
"""What Prefect's clients (workers, flow runs, `prefect` commands, `get_client()`) send."""
SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"
"""What the Prefect server asks for."""
CLIENT_SETTINGS = "prefect.toml"
"""The file Prefect's clients read from their working directory: `mint up` writes the string there."""
MARK = "# written by `mint up`"
"""The first line of a client settings file that `mint up` wrote, and so may write again."""


def server_auth(config: ServicesConfig) -> str:
    """The auth string of the Prefect server of this state dir (the access file, made if there is none)."""
    return ensure(access_path(config.state_dir))[0].service.prefect_auth


def client_auth(config: ServicesConfig) -> str | None:
    """The auth string mint's clients send to `config.url("prefect")`: the access file's of this state dir when
    this state dir runs that server; for one it does not run (another host's `prefect_url`, another stack's
    port), the exported PREFECT_API_AUTH_STRING (its owner's), else this state dir's. None: no access file and
    nothing exported."""
    exported = os.environ.get(AUTH_ENV) or None
    own = config.prefect_url is None and read_record(config, "prefect") is not None
    if exported and not own:
        return exported
    path = access_path(config.state_dir)
    return load(path).service.prefect_auth if path.exists() else exported


def basic_auth(auth: str | None) -> httpx.BasicAuth | None:
    """The httpx auth of a `user:password` string (None: none)."""
    if not auth:
        return None
    user, _, password = auth.partition(":")
    return httpx.BasicAuth(user, password)


def auth_header(auth: str | None) -> dict[str, str]:
    """The Authorization header Prefect's clients send for `auth` ({} for none)."""
    if not auth:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}


@contextmanager
def prefect_api(url: str, auth: str | None) -> Iterator[None]:
    """Prefect clients of this process (flow runs, `get_client()`) talk to `url` with `auth` (if any)."""
    # deferred: Prefect takes seconds to import, which `mint --help` need not pay
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    updates: dict[object, object] = {PREFECT_API_URL: url}
    if auth:
        updates[PREFECT_API_AUTH_STRING] = auth
    with temporary_settings(updates=updates):  # type: ignore[arg-type]
        yield


def write_client_settings(config: ServicesConfig, root: Path | None = None) -> Path | None:
    """Give the owner's Prefect clients in `root` (the working directory) the string of this state dir's server:
    `root/prefect.toml`, mode 0600, `[api] auth_string`. Only for a state dir inside `root` (a test's stack in
    a temporary directory leaves the owner's file alone), and never over a prefect.toml that `mint up` did not
    write (says so instead). Returns the file written, or None."""
    root = (root or Path.cwd()).resolve()
    if not config.state_dir.resolve().is_relative_to(root):
        return None
    path = root / CLIENT_SETTINGS
    auth = server_auth(config)
    if path.exists() and not path.read_text().startswith(MARK):
        logger.warning(
            "prefect: %s is not mint's: left as it is; Prefect clients here need the server's auth string "
            "(service.prefect_auth in %s) as api.auth_string there or in PREFECT_API_AUTH_STRING",
            path,
            access_path(config.state_dir),
        )
        return None
    text = (
        f"{MARK} for the Prefect clients of this directory (git ignores it; its owner alone reads it):\n"
        f"# the auth string of the Prefect server of {config.state_dir} (service.prefect_auth in\n"
        f"# {access_path(config.state_dir)}). An exported PREFECT_API_AUTH_STRING wins over it.\n"
        f"[api]\nauth_string = {_toml_string(auth)}\n"
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    assert tomllib.loads(text)["api"]["auth_string"] == auth
    return path


def _toml_string(value: str) -> str:
    """A TOML basic string of `value` (the secrets are URL-safe; quotes and backslashes escaped anyway)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
