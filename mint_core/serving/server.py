"""What the routes of the embedded server share: the engine and its loop, the adapter manager, auth and metrics.

The routes themselves live in `serving/routes/` (one APIRouter per concern), their bodies in `serving/protocol.py`,
and `serving/app.py` assembles them into the FastAPI app. A route reaches this state through `ServerDep`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, cast

from fastapi import Depends, Request

from mint_core.engine.engine import Engine
from mint_core.engine.loader import AdapterManager
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.sequence import Request as GenRequest
from mint_core.engine.sequence import RequestError, Sequence
from mint_core.errors import MintError, UnknownAdapter
from mint_core.registry.catalog import Catalog, CatalogConfig
from mint_core.registry.store import AdapterStore
from mint_core.serving.admin import Auth
from mint_core.serving.champions import ChampionListing
from mint_core.serving.config import ServingConfig
from mint_core.serving.http_errors import model_error, unknown_model
from mint_core.serving.loop import EngineLoop
from mint_core.serving.metrics import Metrics
from mint_core.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard

# a job of a completion request: the adapter (None: the base), the prompt's token ids, how to decode
Job = tuple[str | None, list[int], SamplingParams]


@dataclass(frozen=True)
class PromptLimits:
    """The checks a prompt and its max_tokens pass before any backend sees them (mint's engine or vLLM), with
    the same answers on both."""

    encode: Callable[[str], list[int]]
    vocab_size: int
    max_model_len: int

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.encode(prompt) if prompt else []
        if not ids:
            raise APIError(400, "prompt is empty", "BadRequestError", "prompt")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "BadRequestError", "prompt")
        return ids

    def max_tokens(self, requested: int | None, prompt_len: int, echo: bool) -> int:
        """The tokens to generate after a prompt of `prompt_len`: the request's own, checked against the context
        left (0 is allowed with echo: score the prompt only), or up to 16 when it named none."""
        limit = self.max_model_len - prompt_len
        max_tokens = max(1, min(16, limit)) if requested is None else requested
        if (0 if echo else 1) <= max_tokens <= limit:
            return max_tokens
        if limit < 1 and not echo:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{prompt_len}.",
                "BadRequestError",
                "prompt",
            )
        raise APIError(
            400,
            f"max_tokens must be between {0 if echo else 1} and {max(limit, 0)} for this prompt, got {max_tokens}",
            "BadRequestError",
            "max_tokens",
        )


class Server:
    """State shared by the routes: the engine, its loop, the adapter manager, config, auth, metrics."""

    def __init__(self, engine: Engine, config: ServingConfig, base_name: str):
        self.engine = engine
        self.config = config
        self.base_name = base_name
        self.loop = EngineLoop(engine, config.max_num_seqs)
        self.root = Path(config.adapter_root).resolve()
        self.store = AdapterStore(self.root)
        self.catalog = Catalog(CatalogConfig(url=config.catalog_url)) if config.catalog_url else None
        # every load and unload goes through it; with a catalog, any catalog address is a model name, loaded on
        # demand by its threads
        self.adapters = AdapterManager(engine, self.store, self.catalog, workers=config.loader_workers)
        self.created = int(time.time())
        # /v1/models names them before anything loads them (routes/models.py)
        self.champions = ChampionListing(self.catalog, self.champion_card)
        self.metrics = Metrics(engine, self.loop, self.adapters, base_name)
        self.sources: dict[str, str] = {}  # adapter name -> the lora_path it was loaded from
        self.limits = PromptLimits(engine._encode, engine.base.config.vocab_size, engine.max_model_len)
        self.auth = Auth(config)

    def close(self) -> None:
        """Finish what is queued and running, then stop the loaders."""
        self.loop.stop()
        self.adapters.close()

    # -- adapters ------------------------------------------------------------------------------------------

    def champion_card(self, policy: str, digest: str) -> bytes:
        """The /v1/models card of a policy's champion that no name holds yet: its digest, no `revision`."""
        card = ModelCard(id=policy, created=self.created, root=f"sha256:{digest}", parent=self.base_name)
        return card.model_dump_json().encode()

    async def resolve_model(self, model: str) -> str | None:
        """None for the base; the adapter name otherwise. A catalog address not loaded yet is loaded now (this
        request waits, the batch does not); 404 for anything unknown."""
        if model == self.base_name:
            return None
        ws = self.engine.working_set
        loaded = ws.get(model) is not None
        if self.catalog is None or (loaded and not ws.is_ephemeral(model)):
            if loaded:
                return model
            raise unknown_model(model)
        return await self._ensure(model, hold=False)

    async def _ensure(self, model: str, hold: bool) -> str:
        try:
            return await asyncio.wrap_future(self.adapters.ensure(model, hold=hold))
        except (
            MintError
        ) as e:  # an address that does not resolve, a revision refused, a store not readable now
            raise model_error(model, e) from None

    # -- requests ------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.limits.tokenize(prompt)

    def max_tokens(self, requested: int | None, prompt_len: int, echo: bool) -> int:
        return self.limits.max_tokens(requested, prompt_len, echo)

    @staticmethod
    def sampling_params(
        body: CompletionRequest | ChatCompletionRequest, max_tokens: int, choice: int
    ) -> SamplingParams:
        """The request's parameters for one choice; what the engine refuses is a 400 naming the field."""
        try:
            return body.to_sampling_params(max_tokens, choice)
        except ValueError as e:
            raise APIError(400, str(e).replace("\n", " "), "BadRequestError") from None

    # -- generation ------------------------------------------------------------------------------------

    async def submit(
        self,
        adapter: str | None,
        ids: list[int],
        params: SamplingParams,
        wake: asyncio.Queue[None],
    ) -> Sequence:
        """Queue one sequence; `wake` gets an item whenever it makes progress (one queue per HTTP request)."""
        aloop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        state = {"last": t0, "n": 0}

        def on_event(seq: Sequence) -> None:  # engine-loop thread
            now = time.perf_counter()
            if len(seq.out_ids) > state["n"]:
                if state["n"] == 0:
                    self.metrics.first_token(now - t0)
                else:
                    self.metrics.next_token(now - state["last"])
                state["n"], state["last"] = len(seq.out_ids), now
            if seq.finished:
                self.metrics.sequence_finished(now - t0, seq.finish_reason)
            # RuntimeError: the event loop is gone (shutdown); the sequence still finishes
            with contextlib.suppress(RuntimeError):
                aloop.call_soon_threadsafe(wake.put_nowait, None)

        ws = self.engine.working_set
        if adapter is not None and ws.is_ephemeral(adapter):
            # hold the on-demand name until admission, so a burst of other loads cannot evict it in between
            held: str | None = adapter
            if not ws.hold(adapter):
                await self._ensure(adapter, hold=True)
        else:
            held = None
        try:
            seq = self.loop.submit(GenRequest(ids, adapter, params), on_event, held=held)
        except BaseException as e:
            if held is not None:
                ws.unhold(held)
            if isinstance(e, UnknownAdapter):
                raise APIError(404, str(e), "NotFoundError", "model") from None
            if isinstance(e, RequestError):
                raise APIError(400, str(e), "BadRequestError", "prompt") from None
            if isinstance(e, MintError):
                raise APIError(503, str(e), "ServiceUnavailableError") from None
            raise
        return seq

    async def submit_all(self, jobs: list[Job], wake: asyncio.Queue[None]) -> list[Sequence]:
        seqs: list[Sequence] = []
        try:
            for adapter, ids, params in jobs:
                seqs.append(await self.submit(adapter, ids, params, wake))
        except BaseException:
            for s in seqs:
                self.loop.cancel(s)
            raise
        return seqs

    async def wait(self, seqs: list[Sequence], wake: asyncio.Queue[None]) -> None:
        """Until every sequence finished; cancels them all if the request goes away first."""
        try:
            while not all(s.finished for s in seqs):
                await wake.get()
        except BaseException:
            for s in seqs:
                self.loop.cancel(s)
            raise
        for s in seqs:
            if s.error is not None:
                raise APIError(500, f"generation failed: {s.error}", "InternalServerError")

    def count(self, model: str, seqs: list[Sequence], outcome: str) -> None:
        """A request answered: its outcome and the tokens its usage reports."""
        prompt = sum(len(s.prompt_ids) for s in seqs)
        self.metrics.answered(model, outcome, prompt, sum(len(s.out_ids) for s in seqs))

    def model_label(self, model: object) -> str:
        """`model` as a metrics label: a name this server serves, else "_unknown", so a client cannot mint
        label values."""
        if not isinstance(model, str):
            return "_unknown"
        known = model == self.base_name or self.engine.working_set.get(model) is not None
        return model if known else "_unknown"

    @staticmethod
    def fingerprint(seqs: list[Sequence]) -> str:
        """The revisions that served a request (normally one), or "base": its `system_fingerprint`."""
        revs = {s.revision or "base" for s in seqs}
        return ",".join(sorted(revs))


def get_server(request: Request) -> Server:
    return cast(Server, request.app.state.server)


ServerDep = Annotated[Server, Depends(get_server)]
"""A route's handle on the server's state."""
