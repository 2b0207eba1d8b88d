"""The checks a request passes before anything changes or is served, the same on both backends: the bearer tokens
(`Auth`), a load's or an unload's fields and the path it names, a prefetch's addresses, and the answer to a load.

mint serve's routes (serving/routes/) and the vLLM front's (serving/front/) both call these, so a bad request gets
one answer whichever backend serves it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Protocol

from fastapi import Request
from fastapi.responses import PlainTextResponse

from mint_core.lora.validate import recorded_base
from mint_core.registry.catalog import AddressError, Catalog, UnknownAddress, parse_address
from mint_core.registry.store import AdapterStore, StoreError, UnknownRevision
from mint_core.serving.config import ServingConfig
from mint_core.serving.protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger(__name__)

# catalog addresses a load request may name (a bare policy name stays a store path): policy@alias, policy/vN
_CATALOG_ADDRESS = re.compile(r"^[^/@]+(@[^/@]*|/v[^/]*)$")


class Auth:
    """The bearer tokens of one server: the API key for inference (when one is set), the admin token for loads and
    mint's routes, the resolver token for vLLM's resolver plugin."""

    def __init__(self, config: ServingConfig):
        self.config = config

    def check_api_key(self, request: Request) -> None:
        if self.config.api_key is not None:
            bearer(request, self.config.api_key.get_secret_value(), "api key")

    def check_admin(self, request: Request) -> None:
        bearer(request, self.config.admin_secret(), "admin token")

    def check_resolver(self, request: Request) -> None:
        bearer(request, self.config.resolver_secret(), "resolver token")


def bearer(request: Request, secret: str, what: str) -> None:
    """401 unless the request carries `Authorization: Bearer <secret>`."""
    header = request.headers.get("authorization", "")
    if header != f"Bearer {secret}":
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
    unless the load is in place (asked last: the front asks vLLM), something at the path. Nothing has changed
    when this raises."""
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if reserved is not None and body.lora_name == reserved:
        raise APIError(400, f"'{reserved}' is reserved for the base", "InvalidUserInput", "lora_name")
    if body.lora_name == base_name:
        raise APIError(400, f"'{base_name}' is the base model's name", "InvalidUserInput", "lora_name")
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
