"""Who called, on both backends: the `Caller` a request's bearer credential names, and the per-key request counter.

With an access file (`ServingConfig.access_file`), a request's `Authorization: Bearer <secret>` is a serving key of
the file or the admin token (serving/admin.py `Auth.identify`); the caller is kept on the request's state, where the
routes read what it may call and `KeyCounter` reads its name to count the answer under it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import translate

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mint_core.serving.http_errors import is_completion

STATE_KEY = "mint_caller"
"""Where the caller is kept in the request's state (`scope["state"]`)."""
UNIDENTIFIED = "_none"
"""The `key` label of a request answered before (or without) a credential that names a caller: none, a wrong one,
or a body refused before the key was read."""


@dataclass(frozen=True)
class Caller:
    """A request's credential: `name` (a serving key's name, `admin` for the admin token, `api_key` for the one
    configured key, `anonymous` with no auth) and the policy patterns it may call (None: everything)."""

    name: str
    policies: tuple[str, ...] | None = None
    _match: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.policies is not None:  # one regex for every pattern: a listing filters thousands of names
            joined = "|".join(translate(p) for p in self.policies) or r"(?!)"
            object.__setattr__(self, "_match", re.compile(joined))

    def may(self, model: str, base_name: str) -> bool:
        """Whether this caller may call `model`: a policy name, `policy@alias` or catalog address its patterns
        match (on the whole name or its policy part before `@`, as `mint_core.access.allows`). The base is
        callable only by a caller of every policy (`*`): a key scoped to some policies reaches their adapters,
        not the model under them."""
        if self._match is None:
            return True
        assert self.policies is not None
        if model == base_name:
            return "*" in self.policies
        return bool(self._match.fullmatch(model) or self._match.fullmatch(model.split("@", 1)[0]))

    def visible(self, names: Iterable[str], base_name: str) -> list[str]:
        return [n for n in names if self.may(n, base_name)]


def key_requests(registry: CollectorRegistry) -> Counter:
    """The per-key counter `KeyCounter` adds to (made with the app, so it is registered once)."""
    return Counter(
        "mint_key_requests",
        "Completion requests by the serving key that made them (admin: the admin token) and HTTP status",
        ["key", "outcome"],
        registry=registry,
    )


ADMIN = Caller("admin")
ANONYMOUS = Caller("anonymous")


def caller_of(scope_state: object) -> Caller | None:
    state = scope_state if isinstance(scope_state, dict) else {}
    found = state.get(STATE_KEY)
    return found if isinstance(found, Caller) else None


class KeyCounter:
    """ASGI middleware (outermost) that counts every completion request by the key that made it and its HTTP
    status: `mint_key_requests_total{key, outcome}`, on both backends. Key names come from the access file (or
    `admin`, `api_key`, `anonymous`, `_none`), never from the request, so a client cannot mint label values."""

    def __init__(self, app: ASGIApp, requests: Counter):
        self.app, self.requests = app, requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_completion(scope["path"]):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # shared with every scope copied from this one below
        status = 0

        async def send_on(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_on)
        finally:
            caller = caller_of(state)
            self.requests.labels(caller.name if caller else UNIDENTIFIED, str(status or 500)).inc()
