"""What the server serves: GET /v1/models, and vLLM's runtime LoRA routes that change it (admin token).

POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}: 200 on success; 400 for a missing field,
the base's name, a duplicate name without `load_inplace`, a path outside the adapter store or an invalid adapter
(one whose recorded base fingerprint is another base's included); 404 for nothing at that path. An adapter that
records no fingerprint but names another base is loaded with a warning (`other_base_warning`). A promote refresh
is this route with `load_inplace`. POST /v1/unload_lora_adapter {"lora_name"}: 200; 404 for a name not loaded.
Both go through the server's AdapterManager.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from pathlib import Path
from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from mint_core.engine.working_set import AdapterExists
from mint_core.errors import AdapterError
from mint_core.lora.validate import recorded_base
from mint_core.registry.catalog import AddressError, Catalog, UnknownAddress
from mint_core.registry.store import AdapterStore, StoreError, UnknownRevision
from mint_core.serving.protocol import (
    APIError,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from mint_core.serving.server import ServerDep

logger = logging.getLogger(__name__)
router = APIRouter(tags=["models"])

# catalog addresses a load request may name (a bare policy name stays a store path): policy@alias, policy/vN
_CATALOG_ADDRESS = re.compile(r"^[^/@]+(@[^/@]*|/v[^/]*)$")


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request, server: ServerDep) -> ModelList:
    """The base, then every adapter name with the revision it serves now (on-demand ones included)."""
    server.check_api_key(request)
    cards = [
        ModelCard(
            id=server.base_name,
            created=server.created,
            root=server.base_name,
            parent=None,
            max_model_len=server.engine.max_model_len,
        )
    ]
    for name, digest in sorted(server.engine.working_set.names().items()):
        cards.append(
            ModelCard(
                id=name,
                created=server.created,
                root=server.sources.get(name, f"sha256:{digest}"),
                parent=server.base_name,
                revision=f"sha256:{digest}",
            )
        )
    return ModelList(data=cards)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    request: Request, body: LoadLoRAAdapterRequest, server: ServerDep
) -> PlainTextResponse:
    server.check_admin(request)
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if body.lora_name == server.base_name:
        raise APIError(400, f"'{server.base_name}' is the base model's name", "InvalidUserInput", "lora_name")
    path = resolve_lora_path(server, body.lora_path)
    if server.adapters.working_set.get(body.lora_name) is not None and not body.load_inplace:
        raise APIError(
            400, f"The lora adapter '{body.lora_name}' has already been loaded.", "InvalidUserInput"
        )
    if not path.exists():
        raise APIError(
            404,
            f"No adapter found at {body.lora_path!r} (in the adapter store {server.root})",
            "NotFoundError",
        )
    try:
        await run_in_threadpool(server.adapters.load, body.lora_name, path, body.load_inplace)
    except AdapterError as e:
        raise APIError(400, str(e), "BadRequestError", "lora_path") from None
    except AdapterExists:  # loaded by another request since the check above
        raise APIError(
            400, f"The lora adapter '{body.lora_name}' has already been loaded.", "InvalidUserInput"
        ) from None
    server.sources[body.lora_name] = body.lora_path
    names = (server.base_name, server.config.base, server.engine.base.name)
    warning = await run_in_threadpool(other_base_warning, path, names)
    return loaded(body.lora_name, warning)


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


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    request: Request, body: UnloadLoRAAdapterRequest, server: ServerDep
) -> PlainTextResponse:
    server.check_admin(request)
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided.", "InvalidUserInput")
    if not server.adapters.unload(body.lora_name):
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError")
    server.sources.pop(body.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


class StoreView(Protocol):
    """Where load requests may point: the embedded server and the vLLM front both have one."""

    store: AdapterStore
    root: Path
    catalog: Catalog | None


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
