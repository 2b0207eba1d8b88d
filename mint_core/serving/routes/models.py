"""What the server serves: GET /v1/models (the names held, and the catalog's champions from the first second:
serving/champions.py), and vLLM's runtime LoRA routes that change it (admin token).

POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}: 200 on success; 400 for a missing field,
the base's name, a duplicate name without `load_inplace`, a path outside the adapter store or an invalid adapter
(one whose recorded base fingerprint is another base's included); 404 for nothing at that path. An adapter that
records no fingerprint but names another base is loaded with a warning (`other_base_warning`). A promote refresh
is this route with `load_inplace`. POST /v1/unload_lora_adapter {"lora_name"}: 200; 404 for a name not loaded.
Both go through the server's AdapterManager, after the checks the vLLM front makes too (serving/admin.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from mint_core.engine.working_set import AdapterExists
from mint_core.errors import AdapterError
from mint_core.registry.store import StoreError
from mint_core.serving.admin import (
    already_loaded,
    load_target,
    loaded,
    not_loaded,
    other_base_warning,
    unload_target,
    unloaded,
)
from mint_core.serving.champions import by_name, model_list
from mint_core.serving.http_errors import load_error
from mint_core.serving.protocol import LoadLoRAAdapterRequest, ModelCard, ModelList, UnloadLoRAAdapterRequest
from mint_core.serving.server import ServerDep

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request, server: ServerDep) -> Response:
    """The base, then by name every adapter name with the revision it serves now (on-demand ones included), and
    every policy whose catalog champion a request would be served though nothing holds it yet (serving/champions.py:
    its `root` the champion's digest, no `revision`). A serving key sees only what it may call."""
    caller = server.auth.check_api_key(request)
    champions = await server.champions.get()
    if caller.policies is not None:
        champions = {p: c for p, c in champions.items() if caller.may(p, server.base_name)}
    base = ModelCard(
        id=server.base_name,
        created=server.created,
        root=server.base_name,
        parent=None,
        max_model_len=server.engine.max_model_len,
    )
    held = {
        name: ModelCard(
            id=name,
            created=server.created,
            root=server.sources.get(name, f"sha256:{digest}"),
            parent=server.base_name,
            revision=f"sha256:{digest}",
        )
        .model_dump_json()
        .encode()
        for name, digest in server.engine.working_set.names().items()
        if name != server.base_name and caller.may(name, server.base_name)
    }
    listed = [base.model_dump_json().encode()] if caller.may(server.base_name, server.base_name) else []
    return model_list([*listed, *by_name(held, champions, {server.base_name})])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    request: Request, body: LoadLoRAAdapterRequest, server: ServerDep
) -> PlainTextResponse:
    server.auth.check_admin(request)

    async def held(name: str) -> bool:
        return server.adapters.working_set.get(name) is not None

    path = await load_target(server, body, server.base_name, held)
    try:
        await run_in_threadpool(server.adapters.load, body.lora_name, path, body.load_inplace)
    except (AdapterError, StoreError) as e:
        raise load_error(e) from None
    except AdapterExists:  # loaded by another request since the check above
        raise already_loaded(body.lora_name) from None
    server.sources[body.lora_name] = body.lora_path
    server.champions.invalidate()  # a promotion, rollback or reconcile ends here
    names = (server.base_name, server.config.base, server.engine.base.name)
    warning = await run_in_threadpool(other_base_warning, path, names)
    return loaded(body.lora_name, warning)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    request: Request, body: UnloadLoRAAdapterRequest, server: ServerDep
) -> PlainTextResponse:
    server.auth.check_admin(request)
    name = unload_target(body)
    if not server.adapters.unload(name):
        raise not_loaded(name)
    server.sources.pop(name, None)
    server.champions.invalidate()
    return unloaded(name)
