"""Canary splits and online scores: a share of a policy's requests answered by a candidate, and how both answer.

Both backends (the embedded server and the vLLM front) wrap their app in `CanaryMiddleware` and mount the routes
of `serving/routes/canary.py` over one `CanaryState`, so a split works the same whichever serves:

- **The split.** `PUT /v1/mint/canary/{name}` {"canary", "control", "share"} (admin): requests for `name` go to the
  served name `canary` (the candidate, loaded as `<policy>@canary`) with probability `share` and to `control`
  (the champion's name, or the base's while a policy has none) otherwise. Which arm answers is a hash of the
  request's key: the OpenAI `user` field, else an `X-Mint-Key` header, else the response id (one request). The
  same key always lands on the same arm, so one user's conversation stays on one revision.
- **Naming the revision.** The response's `model` is the served name that answered (`add@canary` or `add`), its
  `system_fingerprint` the revision's sha256 (as for every response), and the header `X-Mint-Arm` says
  `canary` or `control`. A request with `X-Mint-Route: direct` is answered by the name it asks for, past the
  split: the promotion's smoke check of the name.
- **Scores.** Every answer under a served policy name is remembered by its response id for a while
  (`MAX_RESPONSES`). An answer to a registered task's prompt (a row of its data: `TaskRegistry.lookup`, the
  completion's prompt text or the chat's messages) is scored at once with the task's own rewards (its spec, in
  [0, 1]); anything else is scored by `POST /v1/feedback` {"id",
  "score"} (the API key). Scores are kept as events per requested name, read back in order by
  `GET /v1/mint/canary/{name}?after=<seq>`: what the canary watch flow turns into its sequential test and into
  MLflow metrics. Each score is also handed to the `on_score` callbacks: the router of `model: "auto"`
  (serving/routing.py) learns from them, and has the answers it routed remembered even under the base's name.

The split lives in the server's memory: a restarted server answers every request from the champion until the
watch flow, which puts the split again on every poll, restores it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mint_core.data.rewards import Rewarder
from mint_core.data.spec import is_messages
from mint_core.errors import MintError

Arm = Literal["canary", "control", "none"]
ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_RESPONSES = 200_000
"""Response ids remembered for feedback (oldest forgotten first): minutes of traffic at hundreds of requests/s."""
REQUESTED_STATE = "mint_requested"
"""Where the middleware keeps, in the request's state, the name a request asked for when a split answers it with
another: a serving key is checked against both (serving/admin.py `Auth.check_call`)."""
AUTO = "auto"
"""The model name a caller sends to have the server choose (`auto:<patterns>` narrows it): serving/routing.py. No
adapter may be loaded under it."""
ROUTED_STATE = "mint_routed"
"""Where `RoutingMiddleware` (serving/routing.py) marks, in the request's state, a request whose `model: "auto"` it
routed: its answer is remembered for scores even under the base's name, so the router learns what the base earns."""
MAX_EVENTS = 200_000
"""Scores kept per requested name, oldest dropped first; a reader that falls this far behind is told so."""


class Split(BaseModel):
    """One policy's canary: where its requests go."""

    canary: str = Field(min_length=1)
    """Served name of the candidate (mint loads it as `<policy>@canary`)."""
    control: str = Field(min_length=1)
    """Served name of the rest: the policy's own name (its champion), or the base's while it has none."""
    share: float = Field(gt=0.0, lt=1.0)
    """Fraction of request keys the canary answers."""


class ScoreEvent(BaseModel):
    seq: int
    t: float
    arm: Arm
    model: str
    """The served name that answered."""
    revision: str
    score: float
    source: Literal["task", "feedback"]


class ArmSummary(BaseModel):
    requests: int = 0
    scored: int = 0
    score_sum: float = 0.0


class CanaryView(BaseModel):
    """What `GET /v1/mint/canary/{name}` answers: the split (None: no canary now), per-arm counts since it was
    put, and the score events after the reader's cursor."""

    name: str
    split: Split | None
    since: float | None
    arms: dict[str, ArmSummary]
    events: list[ScoreEvent]
    next: int
    """Pass as `after` to read on from here."""
    missed: bool
    """Whether events after the reader's cursor were dropped before it read them (`MAX_EVENTS`)."""


class Feedback(BaseModel):
    id: str = Field(min_length=1)
    """The `id` of the response being scored."""
    score: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    """How good the answer was, 0 (useless) to 1 (right)."""


@dataclass
class _Answered:
    name: str
    arm: Arm
    model: str
    revision: str
    scored: bool


@dataclass
class _Stream:
    events: deque[ScoreEvent] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    arms: dict[str, ArmSummary] = field(default_factory=dict)
    since: float | None = None
    dropped_seq: int = 0
    """The newest seq dropped to keep within MAX_EVENTS."""


class UnknownResponse(KeyError):
    pass


class AlreadyScored(ValueError):
    pass


class CanaryState:
    """Splits, remembered answers and score events of one server. Thread-safe (routes and the middleware run on
    the event loop; tests and tools may read from other threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.splits: dict[str, Split] = {}
        self._answered: OrderedDict[str, _Answered] = OrderedDict()
        self._streams: dict[str, _Stream] = {}
        self._seq = 0
        self.on_score: list[Callable[[str, ScoreEvent], None]] = []
        """Called with (response id, event) after each score, outside the lock: the router learns from them."""

    # -- the split --------------------------------------------------------------------------------------

    def put(self, name: str, split: Split) -> bool:
        """Route `name` by `split`; True when this changed anything (repeating a put is a no-op)."""
        with self._lock:
            if self.splits.get(name) == split:
                return False
            new_canary = name not in self.splits or self.splits[name].canary != split.canary
            self.splits[name] = split
            if new_canary:  # counts restart with each candidate; events stay readable in order
                s = self._streams.setdefault(name, _Stream())
                s.arms, s.since = {}, time.time()
            return True

    def clear(self, name: str) -> Split | None:
        with self._lock:
            return self.splits.pop(name, None)

    def route(self, name: str, key: str) -> tuple[str, Arm]:
        """The served name that answers a request for `name` with this key, and its arm."""
        split = self.splits.get(name)
        if split is None:
            return name, "none"
        return (split.canary, "canary") if bucket(name, key) < split.share else (split.control, "control")

    # -- answers and scores ------------------------------------------------------------------------------

    def answered(self, rid: str, name: str, arm: Arm, model: str, revision: str, score: float | None) -> None:
        with self._lock:
            self._answered[rid] = _Answered(name, arm, model, revision, score is not None)
            if len(self._answered) > MAX_RESPONSES:
                self._answered.popitem(last=False)
            s = self._streams.setdefault(name, _Stream())
            a = s.arms.setdefault(arm, ArmSummary())
            a.requests += 1
            event = None if score is None else self._event(s, a, arm, model, revision, score, "task")
        if event is not None:
            self._scored(rid, event)

    def feedback(
        self, rid: str, score: float, source: Literal["task", "feedback"] = "feedback"
    ) -> ScoreEvent:
        """Score an earlier answer; KeyError for an id never seen (or forgotten), ValueError for one scored.
        `source` "task": the server's own score of an answer to a task's prompt, given once it is computed."""
        with self._lock:
            ans = self._answered.get(rid)
            if ans is None:
                raise UnknownResponse(rid)
            if ans.scored:
                raise AlreadyScored(rid)
            ans.scored = True
            s = self._streams.setdefault(ans.name, _Stream())
            a = s.arms.setdefault(ans.arm, ArmSummary())
            event = self._event(s, a, ans.arm, ans.model, ans.revision, score, source)
        self._scored(rid, event)
        return event

    def _scored(self, rid: str, event: ScoreEvent) -> None:
        for hook in self.on_score:
            hook(rid, event)

    def name_of(self, rid: str) -> str | None:
        """The name an answer remembered by its response id was asked under (None: unknown or forgotten)."""
        with self._lock:
            ans = self._answered.get(rid)
            return ans.name if ans is not None else None

    def _event(
        self,
        s: _Stream,
        a: ArmSummary,
        arm: Arm,
        model: str,
        revision: str,
        score: float,
        source: Literal["task", "feedback"],
    ) -> ScoreEvent:
        self._seq += 1
        e = ScoreEvent(
            seq=self._seq, t=time.time(), arm=arm, model=model, revision=revision, score=score, source=source
        )
        if len(s.events) == s.events.maxlen:
            s.dropped_seq = s.events[0].seq
        s.events.append(e)
        a.scored += 1
        a.score_sum += score
        return e

    def view(self, name: str, after: int = 0, limit: int = 10_000) -> CanaryView:
        with self._lock:
            s = self._streams.get(name, _Stream())
            events = [e for e in s.events if e.seq > after][:limit]
            return CanaryView(
                name=name,
                split=self.splits.get(name),
                since=s.since,
                arms={k: v.model_copy() for k, v in s.arms.items()},
                events=events,
                next=events[-1].seq if events else min(after, self._seq),
                missed=after < s.dropped_seq,
            )


def bucket(name: str, key: str) -> float:
    """A key's place in [0, 1) for one policy: uniform over keys, stable across servers and restarts."""
    h = hashlib.sha256(f"{name}\0{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def task_score(rewarder: Rewarder, prompt: str | list[dict[str, str]], texts: list[str]) -> float | None:
    """The task's own reward (its spec's rewards, averaged over the choices) when `prompt` is a row of a
    registered task (`TaskRegistry.lookup`); None otherwise, or when the reward failed."""
    ex = rewarder.tasks.lookup(prompt)
    if ex is None or not texts:
        return None
    try:
        scores = rewarder.score([ex] * len(texts), texts)
    except MintError:  # failing past its share: nothing to learn from this answer
        return None
    return sum(scores) / len(scores)


def prompt_of(path: str, data: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """What a request asked, in the form a task row holds it: a completion's text, or a chat's messages."""
    if path.endswith("/chat/completions"):
        msgs = data.get("messages")
        if is_messages(msgs):
            return [{"role": m["role"], "content": m["content"]} for m in msgs]
        return None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


class Collected:
    """What an answer said, read off the response as it passes (whole JSON, or a stream's events)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.id: str | None = None
        self.fingerprint: str | None = None
        self.model: str | None = None
        self.texts: dict[int, str] = {}

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if not self.stream:
            return
        while b"\n\n" in self.buf:
            raw, _, rest = bytes(self.buf).partition(b"\n\n")
            self.buf = bytearray(rest)
            line = raw.decode(errors="replace").strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                with contextlib.suppress(ValueError):
                    self._read(json.loads(line[6:]), delta=True)

    def finish(self) -> None:
        if not self.stream:
            with contextlib.suppress(ValueError):
                self._read(json.loads(bytes(self.buf)), delta=False)

    def _read(self, doc: Any, delta: bool) -> None:
        if not isinstance(doc, dict):
            return
        self.id = doc.get("id") or self.id
        self.fingerprint = doc.get("system_fingerprint") or self.fingerprint
        self.model = doc.get("model") or self.model
        for c in doc.get("choices") or []:
            i = int(c.get("index", 0))
            text = c.get("text")
            if text is None:
                msg = c.get("delta" if delta else "message") or {}
                text = msg.get("content")
            if isinstance(text, str):
                self.texts[i] = self.texts.get(i, "") + text if delta else text


class CanaryMiddleware:
    """ASGI middleware over the completion routes: routes a request by the split of the model it names, and
    remembers (and, for built-in tasks, scores) what answered. Other paths pass through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        state: CanaryState,
        served: Callable[[str], bool] | None = None,
        rewarder: Rewarder | None = None,
    ):
        self.app, self.state = app, state
        self.served = served or (lambda name: True)
        """Whether a requested name is worth remembering answers of (not the base, not unknown names)."""
        self.rewarder = rewarder or Rewarder()
        """Scores an answer to a registered task's prompt by the task's spec (user rewards in its pool)."""
        self._scoring: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return
        try:
            data = json.loads(bytes(body))
        except ValueError:
            data = None
        name = data.get("model") if isinstance(data, dict) else None
        routed = ROUTED_STATE in scope.get("state", {})
        if not isinstance(name, str) or not (name in self.state.splits or self.served(name) or routed):
            await self.app(scope, replay(bytes(body), receive), send)
            return
        assert isinstance(data, dict)
        headers = dict(scope["headers"])
        key = data.get("user") if isinstance(data.get("user"), str) and data.get("user") else None
        key = key or headers.get(b"x-mint-key", b"").decode(errors="replace") or uuid.uuid4().hex
        arm: Arm
        if headers.get(b"x-mint-route", b"") == b"direct":  # a smoke check of the name itself
            target, arm = name, "none"
        else:
            target, arm = self.state.route(name, key)
        if target != name:
            scope.setdefault("state", {})[REQUESTED_STATE] = name
            data["model"] = target
            body = bytearray(json.dumps(data).encode())
            scope = dict(scope)
            scope["headers"] = [
                (k, str(len(body)).encode() if k == b"content-length" else v) for k, v in scope["headers"]
            ]
        collected = Collected(bool(data.get("stream")))
        status = 0

        async def send_on(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if arm != "none":
                    message = dict(message)
                    message["headers"] = [*message.get("headers", []), (b"x-mint-arm", arm.encode())]
            elif message["type"] == "http.response.body" and status == 200:
                collected.feed(message.get("body", b""))
            await send(message)

        await self.app(scope, replay(bytes(body), receive), send_on)
        if status != 200:
            return
        collected.finish()
        if collected.id is None:
            return
        prompt = prompt_of(scope["path"], data)
        texts = [collected.texts[i] for i in sorted(collected.texts)]
        # remembered at once (its feedback may follow on the heels of the answer), scored in the background once
        # the task's reward has run off the event loop (a user's reward runs in a pool, with its timeout): the
        # request is done, and the next one on its connection does not wait for the score
        self.state.answered(
            collected.id, name, arm, collected.model or target, collected.fingerprint or "", None
        )
        tasks = self.rewarder.tasks
        if prompt is not None and not (tasks.indexed and tasks.lookup(prompt) is None):
            # (once the index is built, a prompt of no task costs a dict lookup here, not a thread)
            job = asyncio.create_task(self._score(collected.id, prompt, texts))
            self._scoring.add(job)  # held until done: the loop keeps only weak references to tasks
            job.add_done_callback(self._scoring.discard)

    async def _score(self, rid: str, prompt: str | list[dict[str, str]], texts: list[str]) -> None:
        score = await asyncio.to_thread(task_score, self.rewarder, prompt, texts)
        if score is not None:
            with contextlib.suppress(UnknownResponse, AlreadyScored):  # forgotten, or its feedback came first
                self.state.feedback(rid, score, source="task")


async def read_body(receive: Receive) -> bytearray | None:
    """A request's whole body, read off the ASGI channel (None: the client left before sending it all); what the
    canary and routing middlewares read before they decide, then hand on with `replay`."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


def replay(body: bytes, receive: Receive) -> Receive:
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
