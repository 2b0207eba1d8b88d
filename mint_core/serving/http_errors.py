"""The one mapping from what the library raises to the HTTP answer, for mint serve and the vLLM front alike.

Both backends answer one contract (tests/integration/test_serving_contract.py runs the same bad input against
both), so the status a refusal gets is decided here once: what a request naming a model gets when the name cannot be
resolved, read or validated (`model_error`), what an admin load gets when the revision is refused (`load_error`),
and how an `APIError` or a body that does not parse reaches the client (`install_error_handlers`).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from mint_core.errors import AdapterError, MintError
from mint_core.registry.address import AddressError
from mint_core.registry.catalog import UnknownAddress
from mint_core.registry.store import StoreError, UnknownRevision
from mint_core.serving.protocol import APIError, invalid_request

Refused = Callable[[str, object, int], None]
"""(the request's path, the `model` it named if known, the status) of a request answered with an error."""


def unknown_model(model: str) -> APIError:
    """A name the server does not serve, and no catalog to look it up in."""
    return APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def model_error(model: str, e: MintError) -> APIError:
    """What a request naming `model` gets when resolving, reading or validating it raised `e`.

    A malformed address, one the catalog does not name, a revision missing from the store and a revision that fails
    mint's validation are all a 404: on the vLLM backend a name vLLM has not loaded reaches the front through vLLM's
    resolver plugin, which can only answer "found" or "not found" (vLLM's 404, docs/serving.md), so mint serve
    answers a corrupt champion the same way. A store or catalog that cannot be read now is a 503 (try again)."""
    if isinstance(e, AddressError | UnknownAddress | UnknownRevision):
        return APIError(404, f"The model `{model}` does not exist: {e}", "NotFoundError", "model")
    if isinstance(e, AdapterError):
        return APIError(404, f"The model `{model}` is not servable: {e}", "NotFoundError", "model")
    return APIError(503, f"The model `{model}` cannot be loaded now: {e}", "ServiceUnavailableError")


def load_error(e: AdapterError | StoreError) -> APIError:
    """What an admin load gets when the revision it names is invalid (400 naming every problem) or cannot be
    stored now (503)."""
    if isinstance(e, AdapterError):
        return APIError(400, str(e), "BadRequestError", "lora_path")
    return APIError(503, f"cannot store the revision: {e}", "ServiceUnavailableError")


def is_completion(path: str) -> bool:
    """Whether `path` is a completion route (the routes whose refusals the request counter counts)."""
    return path.startswith("/v1/") and path.endswith("completions")


def install_error_handlers(app: FastAPI, refused: Refused) -> None:
    """OpenAI's error shape for every `APIError`, and a 400 for a body FastAPI could not parse; `refused` hears of
    each error answer once (a route counts only what it answers itself)."""

    async def api_error(request: Request, e: APIError) -> JSONResponse:
        if e.status >= 400:
            refused(request.url.path, getattr(request.state, "model", None), e.status)
        return JSONResponse(e.response().model_dump(), status_code=e.status)

    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        """A body that does not parse or fit the protocol: 400 (vLLM's answer; FastAPI's own is 422), naming the
        first few fields, what is wrong with each and the value sent (`protocol.invalid_request`)."""
        errs = e.errors()
        if any(err.get("type") == "json_invalid" for err in errs):
            error = APIError(
                400,
                f"malformed JSON body: {errs[0].get('ctx', {}).get('error', 'cannot be parsed')}",
                "BadRequestError",
            )
        else:
            error = invalid_request(errs)
        # the route never ran, so the model is read from the body, where it parsed
        refused(request.url.path, e.body.get("model") if isinstance(e.body, dict) else None, 400)
        return JSONResponse(error.response().model_dump(), status_code=400)

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
