"""What the front serves: GET /v1/models (what vLLM holds, and the catalog's champions from the first second:
serving/champions.py), and the LoRA admin routes that change it (admin token), with mint serve's
checks (serving/admin.py): a revision is read and validated here before vLLM is handed its verified copy.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from mint_core.errors import AdapterError
from mint_core.registry.store import StoreError
from mint_core.serving.admin import load_target, loaded, other_base_warning, unload_target, unloaded
from mint_core.serving.champions import ChampionListing, by_name, model_list
from mint_core.serving.fleet import digest_of_path
from mint_core.serving.front.state import BASE_ADAPTER, Gateway, GatewayDep
from mint_core.serving.http_errors import load_error
from mint_core.serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from mint_core.serving.relay import parse

router = APIRouter(tags=["models"])


def _json(obj: object) -> bytes:
    """As Starlette's JSONResponse writes it."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def champions_of(request: Request, gw: Gateway) -> ChampionListing[bytes]:
    """The front's listing of the catalog's champions, made on first use and kept on the app."""
    listing: ChampionListing[bytes] | None = getattr(request.app.state, "champions", None)
    if listing is None:

        def card(policy: str, digest: str) -> bytes:
            body = {"id": policy, "object": "model", "created": gw.created, "owned_by": "mint"}
            return _json({**body, "root": f"sha256:{digest}", "parent": gw.base_name})

        listing = request.app.state.champions = ChampionListing(gw.catalog, card)
    return listing


@router.get("/v1/models")
async def models(request: Request, gw: GatewayDep) -> Response:
    """The base, every name vLLM holds with the revision it serves now, then by name every policy whose catalog
    champion a request would be served though vLLM holds nothing under its name yet (its `root` the champion's
    digest, no `revision`). A serving key sees only what it may call."""
    caller = gw.auth.check_api_key(request)
    champions = await champions_of(request, gw).get()
    if caller.policies is not None:
        champions = {p: c for p, c in champions.items() if caller.may(p, gw.base_name)}
    cards = await gw.backend.models()
    await gw.refresh()
    out = []
    for c in cards:
        if c.get("id") == BASE_ADAPTER:  # the base itself, listed once under its own name
            continue
        card = {k: c.get(k) for k in ("id", "object", "created", "root", "parent", "max_model_len")}
        card["owned_by"] = "mint"
        card["created"] = gw.created  # vLLM stamps each listing anew
        if c.get("parent"):
            card["parent"] = gw.base_name
            card.pop("max_model_len", None)
            if (digest := digest_of_path(c.get("root"))) is not None:
                card["revision"] = f"sha256:{digest}"
        else:
            card["root"] = gw.base_name
        if caller.may(str(card["id"]), gw.base_name):
            out.append({k: v for k, v in card.items() if v is not None})
    held = {str(c["id"]): _json(c) for c in out}
    hidden = {gw.base_name, BASE_ADAPTER}
    return model_list([*held.values(), *by_name({}, champions, hidden | held.keys())])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, gw: GatewayDep) -> PlainTextResponse:
    gw.auth.check_admin(request)
    gw.golden.check_rotation()
    _, body = parse(await request.body(), LoadLoRAAdapterRequest)

    async def served(name: str) -> bool:
        await gw.refresh()
        return name in gw.served

    path = await load_target(gw, body, gw.base_name, served, reserved=BASE_ADAPTER)
    try:
        digest, verified = await run_in_threadpool(gw.vet, body.lora_name, path)
    except (AdapterError, StoreError) as e:
        raise load_error(e) from None
    await gw.load(body.lora_name, digest, verified, body.load_inplace)
    champions_of(request, gw).invalidate()  # a promotion, rollback or reconcile ends here
    warning = await run_in_threadpool(other_base_warning, verified, (gw.base_name, gw.config.base))
    return loaded(body.lora_name, warning)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, gw: GatewayDep) -> PlainTextResponse:
    gw.auth.check_admin(request)
    _, body = parse(await request.body(), UnloadLoRAAdapterRequest)
    name = unload_target(body, reserved=BASE_ADAPTER)
    await gw.unload(name)
    champions_of(request, gw).invalidate()
    return unloaded(name)
