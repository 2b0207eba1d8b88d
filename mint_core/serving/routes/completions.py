"""Generation: POST /v1/completions and POST /v1/chat/completions, whole or streamed as server-sent events.

`model` is an adapter's name, a catalog address (with a catalog; loaded on demand) or the base's name. Every
response names the adapter revision that served it in `system_fingerprint` (its sha256, or "base"). A request's
choices (`n`, and for completions every prompt of a batch) run as separate sequences of one continuous batch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from mint_core.engine.engine import Engine
from mint_core.engine.sequence import Sequence
from mint_core.serving.chat import chat_ids
from mint_core.serving.protocol import (
    APIError,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    OpenAIBaseModel,
    StreamOptions,
    UsageInfo,
)
from mint_core.serving.server import Job, Server, ServerDep

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(
    request: Request, body: CompletionRequest, server: ServerDep
) -> CompletionResponse | Response:
    request.state.model = body.model  # for the error handler's request counter
    server.auth.check_call(request, body.model, server.base_name)
    adapter = await server.resolve_model(body.model)
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", "BadRequestError", "prompt")
    if body.stream and body.echo:
        raise APIError(400, "echo is not supported with stream", "BadRequestError", "echo")
    jobs: list[Job] = []
    for p in prompts:
        ids = server.tokenize(p)
        max_tokens = server.max_tokens(body.max_tokens, len(ids), echo=body.echo)
        jobs += [(adapter, ids, server.sampling_params(body, max_tokens, j)) for j in range(body.n)]
    rid = f"cmpl-{uuid.uuid4().hex}"
    engine = server.engine

    if body.stream:
        created = int(time.time())

        def event(
            choices: list[CompletionResponseStreamChoice], fp: str | None, usage: UsageInfo | None
        ) -> CompletionStreamResponse:
            return CompletionStreamResponse(
                id=rid, created=created, model=body.model, system_fingerprint=fp, choices=choices, usage=usage
            )

        return await _stream(server, body.model, jobs, body.stream_options, event, _completion_chunk)

    seqs = await _run(server, body.model, jobs)
    choices = []
    # the prompt each sequence continues: n sequences per prompt, in order
    sources = [p for p in prompts for _ in range(body.n)]
    for i, (p, s) in enumerate(zip(sources, seqs, strict=True)):
        text = s.completion(engine.decode).text
        prefix = (p if isinstance(p, str) else engine.decode(list(p))) if s.params.echo else ""
        choices.append(
            CompletionResponseChoice(
                index=i,
                text=prefix + text,
                logprobs=_completion_logprobs(engine, s) if s.params.logprobs else None,
                finish_reason=s.finish_reason,
                stop_reason=None,
            )
        )
    return CompletionResponse(
        id=rid,
        model=body.model,
        system_fingerprint=server.fingerprint(seqs),
        choices=choices,
        usage=_usage(seqs),
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(
    request: Request, body: ChatCompletionRequest, server: ServerDep
) -> ChatCompletionResponse | Response:
    request.state.model = body.model
    server.auth.check_call(request, body.model, server.base_name)
    adapter = await server.resolve_model(body.model)
    engine = server.engine
    ids = server.tokenize(chat_ids(engine.tokenizer, body.messages))
    max_tokens = server.max_tokens(body.requested_max_tokens(), len(ids), echo=False)
    jobs: list[Job] = [(adapter, ids, server.sampling_params(body, max_tokens, j)) for j in range(body.n)]
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    if body.stream:
        created = int(time.time())

        def chat_event(
            choices: list[ChatCompletionResponseStreamChoice], fp: str | None, usage: UsageInfo | None
        ) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=rid, created=created, model=body.model, system_fingerprint=fp, choices=choices, usage=usage
            )

        return await _stream(server, body.model, jobs, body.stream_options, chat_event, _chat_chunk)

    seqs = await _run(server, body.model, jobs)
    choices = [
        ChatCompletionResponseChoice(
            index=i,
            message=ChatMessage(role="assistant", content=s.completion(engine.decode).text),
            logprobs=_chat_logprobs(engine, s) if body.logprobs else None,
            finish_reason=s.finish_reason,
        )
        for i, s in enumerate(seqs)
    ]
    return ChatCompletionResponse(
        id=rid,
        model=body.model,
        system_fingerprint=server.fingerprint(seqs),
        choices=choices,
        usage=_usage(seqs),
    )


# ---- running a request ----------------------------------------------------------------------------------


async def _run(server: Server, model: str, jobs: list[Job]) -> list[Sequence]:
    """Submit the request's sequences and wait until all of them finished."""
    wake: asyncio.Queue[None] = asyncio.Queue()
    seqs = await server.submit_all(jobs, wake)
    await server.wait(seqs, wake)
    server.count(model, seqs, "200")
    return seqs


# (choice index, its sequence, new text, whether it finished, whether this is the stream's opening) -> choices
ChoiceRender = Callable[[int, Sequence, str, bool, bool], list[Any]]
# (choices, system_fingerprint, usage) -> the endpoint's stream event
EventShape = Callable[[list[Any], str | None, UsageInfo | None], OpenAIBaseModel]


async def _stream(
    server: Server,
    model: str,
    jobs: list[Job],
    options: StreamOptions | None,
    event: EventShape,
    render: ChoiceRender,
) -> StreamingResponse:
    """Submit the request's sequences (errors still answer as JSON), then stream them."""
    wake: asyncio.Queue[None] = asyncio.Queue()
    seqs = await server.submit_all(jobs, wake)
    usage = bool(options is not None and options.include_usage)
    events = _events(server, model, seqs, wake, usage, event, render)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(
    server: Server,
    model: str,
    seqs: list[Sequence],
    wake: asyncio.Queue[None],
    include_usage: bool,
    event: EventShape,
    render: ChoiceRender,
) -> AsyncIterator[str]:
    """The SSE loop both endpoints share: each choice's new text as it comes (`render` shapes it), usage if asked,
    then [DONE]; if the client goes away, whatever is still running is cancelled."""
    deltas = [_Deltas(server.engine, s) for s in seqs]
    reported = [False] * len(seqs)
    try:
        for i, s in enumerate(seqs):
            for c in render(i, s, "", False, True):
                yield _sse(event([c], s.revision or "base", None))
        async for _ in _progress(seqs, wake):
            for i, (s, d) in enumerate(zip(seqs, deltas, strict=True)):
                if reported[i]:
                    continue
                text, done = d.next()  # one read of `finished`: the text is final when done
                for c in render(i, s, text, done, False):
                    yield _sse(event([c], s.revision or "base", None))
                reported[i] = done
        # a sequence that failed mid-stream ended with finish_reason "abort"; the stream itself still closes
        server.count(model, seqs, "500" if any(s.error is not None for s in seqs) else "200")
        if include_usage:
            yield _sse(event([], None, _usage(seqs)))
        yield "data: [DONE]\n\n"
    finally:
        for s in seqs:
            if not s.finished:
                server.loop.cancel(s)


async def _progress(seqs: list[Sequence], wake: asyncio.Queue[None]) -> AsyncIterator[None]:
    """Yields whenever any of the sequences made progress, until all finished, then once more: a sequence can
    finish while the caller handles the previous yield, after it was read as running."""
    while not all(s.finished for s in seqs):
        await wake.get()
        while not wake.empty():
            wake.get_nowait()
        yield
    yield


def _sse(event: OpenAIBaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


class _Deltas:
    """Text a stream may send so far: whole characters only, and nothing a stop string could still claim."""

    def __init__(self, engine: Engine, seq: Sequence):
        self.engine, self.seq, self.sent = engine, seq, 0
        self.hold = max((len(x) for x in seq.params.stop), default=1) - 1

    def next(self) -> tuple[str, bool]:
        """(text to send now, whether the sequence had finished when it was read).

        The engine thread may finish the sequence while this runs, so callers must use the flag returned here,
        not read `seq.finished` again: text read before the last token must not go out as the final chunk.
        """
        s = self.seq
        if s.finished:  # out_ids and cut_text are complete once finish_reason is set
            text = s.cut_text if s.cut_text is not None else self.engine.decode(s.out_ids)
            out, self.sent = text[self.sent :], len(text)
            return out, True
        text = self.engine.decode(s.out_ids)
        ready = len(text) - self.hold
        while ready > self.sent and text[ready - 1] == "\ufffd":  # a character still being spelled in bytes
            ready -= 1
        if ready <= self.sent:
            return "", False
        out, self.sent = text[self.sent : ready], ready
        return out, False


def _completion_chunk(
    i: int, s: Sequence, text: str, done: bool, first: bool
) -> list[CompletionResponseStreamChoice]:
    if first or not (text or done):
        return []
    finish = s.finish_reason if done else None
    return [CompletionResponseStreamChoice(index=i, text=text, logprobs=None, finish_reason=finish)]


def _chat_chunk(
    i: int, s: Sequence, text: str, done: bool, first: bool
) -> list[ChatCompletionResponseStreamChoice]:
    if first:  # OpenAI opens each choice with the role
        return [
            ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None
            )
        ]
    out = []
    if text:
        out.append(
            ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(content=text), logprobs=None, finish_reason=None
            )
        )
    if done:
        out.append(
            ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(), logprobs=None, finish_reason=s.finish_reason
            )
        )
    return out


# ---- shaping answers ------------------------------------------------------------------------------------


def _usage(seqs: list[Sequence]) -> UsageInfo:
    prompt = sum(len(s.prompt_ids) for s in seqs)
    completion = sum(len(s.out_ids) for s in seqs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _token_text(engine: Engine, ids: list[int]) -> list[str]:
    return [engine.decode([t]) for t in ids]


def _completion_logprobs(engine: Engine, s: Sequence) -> CompletionLogProbs:
    """Per token of the returned text (the prompt's first, with echo): its text, logprob, top alternatives and
    offset into the returned text."""
    ids: list[int] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    want_top = s.params.top_logprobs > 0
    if s.params.echo:
        ids += s.prompt_ids
        lps += s.prompt_logprobs or [None] * len(s.prompt_ids)
        tops += [
            None if t is None else {engine.decode([k]): v for k, v in t.items()}
            for t in (s.prompt_top or [None] * len(s.prompt_ids))
        ]
    ids += s.out_ids
    lps += list(s.out_logprobs)
    tops += (
        [{engine.decode([k]): v for k, v in t.items()} for t in s.top]
        if want_top
        else [None] * len(s.out_ids)
    )
    texts = _token_text(engine, ids)
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return CompletionLogProbs(
        tokens=texts,
        token_logprobs=lps,
        top_logprobs=tops if want_top else None,
        text_offset=offsets,
    )


def _chat_logprobs(engine: Engine, s: Sequence) -> ChatCompletionLogProbs:
    toks = _token_text(engine, s.out_ids)
    return ChatCompletionLogProbs(
        content=[
            ChatCompletionLogProbsContent(
                token=t,
                logprob=v,
                bytes=list(t.encode()),
                top_logprobs=[
                    ChatCompletionLogProb(token=engine.decode([k]), logprob=x)
                    for k, x in (s.top[n] if n < len(s.top) else {}).items()
                ],
            )
            for n, (t, v) in enumerate(zip(toks, s.out_logprobs, strict=False))
        ]
    )
