"""The checks a request passes before anything changes or is served, the same on both backends: the bearer tokens
(`Auth`), a load's or an unload's fields and the path it names, a prefetch's addresses, and the answer to a load.

mint serve's routes (serving/routes/) and the vLLM front's (serving/front/) both call these, so a bad request gets
one answer whichever backend serves it.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Protocol

from fastapi import Request
from fastapi.responses import PlainTextResponse

from mint_core.access import KeyRing
from mint_core.lora.validate import recorded_base
from mint_core.registry.catalog import AddressError, Catalog, UnknownAddress, parse_address
from mint_core.registry.store import AdapterStore, StoreError, UnknownRevision
from mint_core.serving.canary import AUTO, REQUESTED_STATE
from mint_core.serving.config import ServingConfig
from mint_core.serving.keys import ADMIN, ANONYMOUS, Caller
from mint_core.serving.protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger(__name__)

# catalog addresses a load request may name (a bare policy name stays a store path): policy@alias, policy/vN
_CATALOG_ADDRESS = re.compile(r"^[^/@]+(@[^/@]*|/v[^/]*)$")


class Auth:
    """The bearer credentials of one server: who may call what (`identify`, `check_call`), the admin token for loads
    and mint's routes, the resolver token for vLLM's resolver plugin.

    With an access file (`config.access_file`), every /v1 route and /metrics needs a serving key of the file or the
    admin token: no or an unknown credential is a 401, a key calling a model outside its patterns a 403 that names
    nothing it may not see, and a key on an admin route a 403. The file is read again when it changes
    (`KeyRing`): a rotated or revoked key takes effect without a restart. Without one, `config.api_key` (when set)
    is the one key of every /v1 route, and the admin token is taken in its place."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.keys = KeyRing(config.access_file) if config.access_file is not None else None

    def identify(self, request: Request) -> Caller:
        """The caller the request's credential names (kept on the request for the routes and the per-key
        counter); 401 when a credential is needed and this one names nobody."""
        token = _token(request)
        admin = token is not None and hmac.compare_digest(token, self.config.admin_secret())
        caller = ADMIN if admin else None
        if caller is None and self.keys is not None:
            found = self.keys.match(token)
            if found is None:
                raise APIError(
                    401, "missing or unknown serving key (Authorization: Bearer <key>)", "Unauthorized"
                )
            caller = Caller(found[0], tuple(found[1].policies))
        elif caller is None and self.config.api_key is not None:
            bearer(request, self.config.api_key.get_secret_value(), "api key")
            caller = Caller("api_key")
        request.state.mint_caller = caller or ANONYMOUS
        return caller or ANONYMOUS

    def check_api_key(self, request: Request) -> Caller:
        """The caller of a read or inference route (see `identify`)."""
        return self.identify(request)

    def check_call(self, request: Request, model: str, base_name: str) -> Caller:
        """The caller, once it may call `model`, and the name it asked for if a canary split answers it with
        another (`CanaryMiddleware` keeps it in the request's state): that name must be the caller's, and what the
        split sends it to must be too, or the base (the control of a policy without a champion). 403 otherwise,
        the same whether or not the model exists (no 404 tells a key what others serve)."""
        caller = self.identify(request)
        asked = getattr(request.state, REQUESTED_STATE, None) or model
        inside = caller.may(asked, base_name) and (
            model in (asked, base_name) or caller.may(model, base_name)
        )
        if not inside:
            raise APIError(403, "this key may not call the model it named", "PermissionDeniedError", "model")
        return caller

    def check_admin(self, request: Request) -> None:
        """The admin token: 401 without it, 403 for a serving key of the access file (a credential without the
        right)."""
        token = _token(request)
        if token is not None and hmac.compare_digest(token, self.config.admin_secret()):
            return
        if self.keys is not None and self.keys.match(token) is not None:
            raise APIError(403, "a serving key may not use the admin routes", "PermissionDeniedError")
        raise APIError(401, "missing or wrong admin token (Authorization: Bearer ...)", "Unauthorized")

    def check_metrics(self, request: Request) -> None:
        """/metrics names every tenant's models and keys: with an access file, only the admin token reads it (a
        Prometheus scrape sends it as its bearer token); without one it stays open, as vLLM's is."""
        if self.keys is not None:
            self.check_admin(request)

    def check_resolver(self, request: Request) -> None:
        bearer(request, self.config.resolver_secret(), "resolver token")


def _token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:] if header[:7].lower() == "bearer " and len(header) > 7 else None


def bearer(request: Request, secret: str, what: str) -> None:
    """401 unless the request carries `Authorization: Bearer <secret>`."""
    header = request.headers.get("authorization", "")
    if not hmac.compare_digest(header.encode(), f"Bearer {secret}".encode()):
        raise APIError(401, f"missing or wrong {what} (Authorization: Bearer ...)", "Unauthorized")


class StoreView(Protocol):
    """Where load requests may point: the embedded server and the vLLM front both have one."""

    store: AdapterStore
    root: Path
    catalog: Catalog | None


async def load_target(
    server: StoreView,
    body: LoadLoRAAdapterRequest,
    base_name: str,
    loaded: Callable[[str], Awaitable[bool]],
    reserved: str | None = None,
) -> Path:
    """The directory a load request names, once its fields are checked: both given, a name that is neither the
    base's nor `reserved` (the front's name for the base), a path inside the store, a name not `loaded` yet
    unless the load is in place (asked last: the front asks vLLM), something at the path. `auto` and `auto:...`
    are no adapter's name: they ask the server to choose (serving/routing.py). Nothing has changed
    when this raises."""
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if reserved is not None and body.lora_name == reserved:
        raise APIError(400, f"'{reserved}' is reserved for the base", "InvalidUserInput", "lora_name")
    if body.lora_name == base_name:
        raise APIError(400, f"'{base_name}' is the base model's name", "InvalidUserInput", "lora_name")
    if body.lora_name == AUTO or body.lora_name.startswith(AUTO + ":"):
        raise APIError(
            400,
            f"'{body.lora_name}' is reserved: it asks the server to choose",
            "InvalidUserInput",
            "lora_name",
        )
    path = resolve_lora_path(server, body.lora_path)
    if not body.load_inplace and await loaded(body.lora_name):
        raise already_loaded(body.lora_name)
    if not path.exists():
        raise APIError(
            404,
            f"No adapter found at {body.lora_path!r} (in the adapter store {server.root})",
            "NotFoundError",
        )
    return path


def already_loaded(name: str) -> APIError:
    return APIError(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")


def unload_target(body: UnloadLoRAAdapterRequest, reserved: str | None = None) -> str:
    """The name an unload request names: 400 without one; the front's name for the base is not an adapter."""
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided.", "InvalidUserInput")
    if body.lora_name == reserved:
        raise not_loaded(body.lora_name)
    return body.lora_name


def not_loaded(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")


def unloaded(name: str) -> PlainTextResponse:
    """vLLM's answer to an unload."""
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def check_prefetch(addresses: list[str], catalog: Catalog | None) -> None:
    """A prefetch needs a catalog, and every address it names must parse (400 naming the first few that do not),
    before any is scheduled."""
    if catalog is None:
        raise APIError(400, "this server has no catalog (set catalog_url)", "BadRequestError")
    bad = []
    for a in addresses:
        try:
            parse_address(a)
        except AddressError as e:
            bad.append(str(e))
    if bad:
        raise APIError(400, "; ".join(bad[:5]), "BadRequestError", "addresses")


def loaded(name: str, warning: str | None) -> PlainTextResponse:
    """vLLM's answer to a load, with mint's warning after it (logged too) when there is one: a client that reads
    the answer as vLLM's still finds "Success" first."""
    text = f"Success: LoRA adapter '{name}' added successfully."
    if warning is None:
        return PlainTextResponse(text)
    logger.warning("adapter %s: %s", name, warning)
    return PlainTextResponse(f"{text} Warning: {warning}")


def other_base_warning(path: Path, base_names: Collection[str]) -> str | None:
    """What to tell the admin about an adapter that passed validation but may have been made for another base.

    A base fingerprint recorded by mint's exporter is proof: `read_adapter` refuses one that differs, and one that
    matches needs no word, whatever the config's name says. Without one, only the shapes were checked, so a
    `base_model_name_or_path` that names none of the served base's names is worth a warning, not a refusal: the
    name is free text, often a path on the machine that trained the adapter, and the same model under another
    path or hub id is compared by its last component (`Qwen/Qwen2.5-0.5B` is `/models/Qwen2.5-0.5B`)."""
    name, fingerprint = recorded_base(path)
    if fingerprint is not None or name is None:
        return None
    if _model_id(name) in {_model_id(n) for n in base_names if n}:
        return None
    return (
        f"its adapter_config.json names base_model_name_or_path {name!r}, not this server's base "
        f"({', '.join(sorted({n for n in base_names if n}))}), and it records no base fingerprint: only its "
        "module names and shapes were checked against this base"
    )


def _model_id(name: str) -> str:
    return Path(name.rstrip("/")).name.lower()


def resolve_lora_path(server: StoreView, lora_path: str) -> Path:
    """The directory a load request names: one inside the adapter store, or a content address `sha256:<hex>` of a
    stored revision (digest verified on the way out), or with a catalog a catalog address. Never a place outside
    the store: an admin token must not turn into reading arbitrary files."""
    store, root = server.store, server.root
    if lora_path.startswith("sha256:"):
        try:
            return store.local_dir(lora_path)
        except ValueError as e:
            raise APIError(400, str(e), "BadRequestError", "lora_path") from None
        except UnknownRevision:
            raise APIError(
                404, f"No adapter found at {lora_path!r} in the adapter store {root}", "NotFoundError"
            ) from None
        except StoreError as e:
            raise APIError(400, str(e), "BadRequestError", "lora_path") from None
    p = Path(lora_path)
    if server.catalog is not None and not (root / p).exists() and _CATALOG_ADDRESS.match(lora_path):
        try:
            return store.local_dir(server.catalog.resolve(lora_path).digest)
        except AddressError as e:
            raise APIError(400, str(e), "BadRequestError", "lora_path") from None
        except (UnknownAddress, UnknownRevision) as e:
            raise APIError(404, f"No adapter found at {lora_path!r}: {e}", "NotFoundError") from None
        except StoreError as e:
            raise APIError(400, str(e), "BadRequestError", "lora_path") from None
    real = (p if p.is_absolute() else root / p).resolve()
    if real != root and root not in real.parents:
        raise APIError(
            400,
            f"lora_path {lora_path!r} is outside the adapter store {root}",
            "BadRequestError",
            "lora_path",
        )
    return real
