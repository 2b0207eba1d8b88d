"""What the Tinker service keeps: API keys, sessions, sampling sessions, training models, queued calls, results,
checkpoints and the futures a client retrieves (`service.py` acts on them)."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch

from mint_core.errors import MintError
from mint_core.tinker.optim import AdamStep
from mint_core.tinker.wire import Datum

logger = logging.getLogger("mint_core.tinker.service")  # settle_one's note, as the service logged it

ATTN = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
    }
)
KEY_PREFIX = "tml-"


class TinkerError(MintError):
    """A request refused; `status` is its HTTP status, the message says what was wrong (nothing changed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(what: str) -> TinkerError:
    return TinkerError(404, what)


# ---------------------------------------------------------------------------------------------------------
# keys


def read_keys(keys: str | None, keys_file: Path | None) -> dict[str, str]:
    """API keys -> owner name, from a comma-separated list and/or a file (one key per line, optionally followed by
    an owner name; `#` comments). A key must start with `tml-` (the SDK refuses others)."""
    found: dict[str, str] = {}
    lines = [k.strip() for k in (keys or "").split(",") if k.strip()]
    if keys_file is not None:
        try:
            text = Path(keys_file).read_text()
        except OSError as e:
            raise ValueError(f"cannot read the Tinker API keys file {keys_file}: {e.strerror or e}") from None
        lines += [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    for line in lines:
        if not line:
            continue
        key, _, owner = line.partition(" ")
        if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 8:
            raise ValueError(
                f"Tinker API keys must start with {KEY_PREFIX!r} and have 8 or more characters after it"
            )
        found[key] = owner.strip() or "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return found


# ---------------------------------------------------------------------------------------------------------
# state


@dataclass
class Session:
    id: str
    owner: str
    last_seen: float
    finished: bool = False
    ended: float = 0.0  # time.monotonic() when it finished or expired
    models: set[str] = field(default_factory=set)
    samplers: int = 0


@dataclass
class Sampler:
    id: str
    owner: str
    adapter: str | None  # engine adapter name; None: the bare base
    model_path: str | None
    session_id: str = ""


@dataclass
class TrainModel:
    id: str
    owner: str
    session_id: str
    rank: int
    alpha: float
    sites: list[str]
    slot: int
    optimizer: torch.optim.AdamW
    views: dict[str, tuple[torch.Tensor, torch.Tensor]]
    policy: str
    parent: str | None = None  # the address its next registered version descends from
    steps: int = 0
    snapshots: int = 0
    live_snapshots: deque[str] = field(default_factory=deque)  # its unnamed snapshots' paths, oldest first
    last_call: float = 0.0  # time.monotonic() of its last queued call
    queue: deque[Op] = field(default_factory=deque)
    closed: bool = False
    created: float = field(default_factory=time.time)
    user_metadata: dict[str, str] | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class Op:
    kind: Literal["forward", "forward_backward", "optim", "other"]
    future: Future[Any]
    data: list[Datum] = field(default_factory=list)
    loss_fn: str = ""
    config: dict[str, float | str] = field(default_factory=dict)
    run: Callable[[], Any] | None = None
    adam: AdamStep | None = None  # an optim_step's
    queued: float = field(default_factory=time.monotonic)
    started: bool = False  # taken by the worker: its future is the worker's to settle


@dataclass
class Result:
    """A finished future's payload: protobuf bytes (ForwardBackwardOutput) or a JSON-able dict."""

    proto: bytes | None = None
    json: dict[str, Any] | None = None


@dataclass
class Checkpoint:
    path: str
    owner: str
    model_id: str
    kind: Literal["weights", "sampler_weights"]
    digest: str
    rank: int
    alpha: float
    sites: list[str]
    optimizer_file: str | None = None
    steps: int = 0
    address: str | None = None  # its MLflow version (policy/vN), if registered
    created: float = 0.0  # unix seconds (0: written before checkpoints carried it)
    ephemeral: bool = False  # an unnamed snapshot: released with its model or by newer ones, never registered

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def to_wire(self) -> dict[str, Any]:
        """As the SDK's `types.Checkpoint`."""
        kind = self.path.split("/")[-2]
        return {
            "checkpoint_id": f"{kind}/{self.path.rsplit('/', 1)[-1]}",
            "checkpoint_type": "training" if self.kind == "weights" else "sampler",
            "time": iso_time(self.created),
            "tinker_path": self.path,
            "size_bytes": None,
            "public": False,
        }


class Futures:
    """request id -> (owner, future); a finished future stays retrievable for `keep_s` after it finished (retrieved
    or not: a client that died never retrieves it), then it is forgotten.

    Ids are a random per-process prefix and a counter (no system call per request: a step queues two), and
    finished futures are swept at most once a second rather than on every new id, so neither cost grows with the
    number of futures held. A future's finishing time is when a sweep or a retrieval first sees it done."""

    def __init__(self, keep_s: float = 600.0):
        self._lock = threading.Lock()
        self._items: dict[str, tuple[str, Future[Any], float]] = {}
        self.keep_s = keep_s
        self._prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()
        self._next_sweep = 0.0

    def track(self, owner: str, fut: Future[Any]) -> str:
        """A new request id for `fut`, retrievable by `owner` only."""
        with self._lock:
            rid = f"{self._prefix}{next(self._ids):x}"
            now = time.monotonic()
            if now >= self._next_sweep:
                self._next_sweep = now + 1.0
                self._sweep(now)
            self._items[rid] = (owner, fut, math.inf)
        return rid

    def sweep(self, now: float | None = None) -> None:
        """Forget the futures that finished more than `keep_s` before `now` (default: now)."""
        with self._lock:
            self._sweep(time.monotonic() if now is None else now)

    def _sweep(self, now: float) -> None:
        for r, (owner, fut, until) in list(self._items.items()):
            if until == math.inf:
                if fut.done():
                    self._items[r] = (owner, fut, now + self.keep_s)
            elif until < now:
                del self._items[r]

    def __len__(self) -> int:
        return len(self._items)

    def get(self, owner: str, request_id: str) -> Future[Any]:
        with self._lock:
            item = self._items.get(request_id)
            if item is None or item[0] != owner:
                raise not_found(
                    f"no request {request_id!r} of this API key (unknown, or finished more than "
                    f"{self.keep_s:.0f} s ago: results are kept that long)"
                )
            if item[1].done() and item[2] == math.inf:
                self._items[request_id] = (item[0], item[1], time.monotonic() + self.keep_s)
            return item[1]


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


HISTORY = 4096
"""Most round sizes `TinkerService.batches` and `.optim_rounds` (service.py) keep: a server runs for days."""


def record(history: list[int], n: int) -> None:
    """Append a round's size, dropping the oldest half once `HISTORY` are kept."""
    history.append(n)
    if len(history) > HISTORY:
        del history[: HISTORY // 2]


def settle_one(fut: Future[Any], value: Any = None, error: BaseException | None = None) -> None:
    """Give a future its result or error, once: a future already settled (its model closed while it ran) keeps
    what it has."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except InvalidStateError:
        logger.debug("a tinker call finished after its future was settled; dropped")


def started(heads: list[tuple[TrainModel, Op]]) -> list[tuple[TrainModel, Op]]:
    """Mark a round's calls as taken by the worker (under the lock): closing their model leaves them be."""
    for _, op in heads:
        op.started = True
    return heads
