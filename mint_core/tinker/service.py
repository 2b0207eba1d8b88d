"""The state behind Tinker's training API: sessions, training models on pinned engine slots, futures, batching.

A training model (a Tinker `TrainingClient`) is a LoRA adapter in one device slot of the serving engine, pinned
there while it lives, with its own AdamW over views of that slot (as the multi-policy trainer's `SlotAdamW`).
Its gradient accumulates in the banks' `.grad` at its slot row until `optim_step` applies it, so many models
train over one base and each one's gradient stays in its own slot.

Calls queue per model and one worker thread runs them in rounds: each round takes the oldest call of every model.
Optim_steps, saves and loads never wait: the optim_steps of a round run as one fused AdamW over all their models'
LoRA factors (each model with its own hyper-parameters, clipping and moments: the same update as its own AdamW
step), saves and loads one by one. A round of forward/forward_backward calls waits, while other models are
training (they called in the last second) but have nothing queued, until they all have or `window_ms` has passed,
then runs as ONE batched forward/backward over the base (each datum's row routed to its model's slot). So the
clients of a training loop batch together on every step, and a model's calls run in the order it sent them,
whatever else is batched.

Saving for the sampler writes a content-addressed revision to the adapter store, loads it into the engine under
the Tinker path the SDK returns (so `/v1/completions` serves it by that name at once), and, with a registry,
makes it an MLflow version of the model's policy (alias `candidate`, `mint.parent` = the model's previous
version or the checkpoint it was loaded from, `tinker.session` = its session), from where the lifecycle's
evaluation, gate and promotion take it like any other revision.

Growth stays bounded: a training run (a model id) keeps its newest `keep_sampler_saves` named sampler saves, and a
client deletes a checkpoint (`delete_checkpoint`, as tinker-cookbook's rolling cleanup does). A deleted checkpoint
leaves the engine, the store's refs (so `mint catalog gc` frees its bytes), the run's record and, unless an alias
holds it, the registry. Each run's record (`runs/`, beside the checkpoint index) answers `get_training_run`, also
after its session ended. An unnamed snapshot (`save_weights_and_get_sampling_client`, which RL loops call every
step) lives while it is among its run's newest `keep_snapshots` and its model is open; then it is released the same
way, and the sampling sessions on it with it (a later sample answers 410 naming the snapshot). A finished call's
result stays retrievable for `result_ttl_s`, and a finished or expired session is forgotten `result_ttl_s` after it
ended, with its sampling sessions.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.optim.adamw import adamw

from mint_core.engine.engine import Engine
from mint_core.engine.logprobs import selected_logprobs
from mint_core.errors import AdapterError, MintError
from mint_core.lora.adapter import AdapterWeights
from mint_core.registry.store import AdapterStore
from mint_core.tinker import losses
from mint_core.tinker.wire import Datum, write_forward_backward_output
from mint_core.types import Digest

logger = logging.getLogger(__name__)

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
BATCHED = frozenset({"forward", "forward_backward"})
# A model that queued a call this recently counts as training now: a forward_backward waits the batching window
# for its next call only while another model does.
ACTIVE_S = 1.0
# Sampling sessions released with their snapshot or checkpoint that are still answered with why (410), newest kept.
GONE_KEEP = 4096
SNAPSHOT = "/sampler_weights/snapshot-"


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
    queue: deque[_Op] = field(default_factory=deque)
    closed: bool = False
    created: float = field(default_factory=time.time)
    user_metadata: dict[str, str] | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class AdamStep:
    """One optim_step's AdamW hyper-parameters (the SDK's `AdamParams`)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass
class _Op:
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
            "time": _iso(self.created),
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


# ---------------------------------------------------------------------------------------------------------
# the service


class TinkerService:
    """Everything the Tinker routes do, callable in process too (the latency benchmark does)."""

    def __init__(
        self,
        engine: Engine,
        store: AdapterStore,
        base_name: str,
        state_dir: Path,
        keys: dict[str, str],
        window_ms: float = 10.0,
        lora_alpha: float = 32.0,
        session_ttl_s: float = 900.0,
        register: Callable[[TrainModel, Checkpoint, str], str] | None = None,
        unregister: Callable[[Checkpoint], str | None] | None = None,
        keep_sampler_saves: int | None = None,
        keep_snapshots: int = 4,
        result_ttl_s: float = 600.0,
    ):
        """`register(model, checkpoint, name)` makes a saved sampler revision an MLflow version and returns its
        address (None: saves go to the store and the engine only); `unregister(checkpoint)` deletes that version
        again and returns None, or why the version stays (an alias holds it). `keep_sampler_saves`: each training
        run keeps its newest this many named sampler saves, older ones are deleted (None: all kept).
        `keep_snapshots`: each training run keeps its newest this many unnamed snapshots, older ones are released.
        `result_ttl_s`: how long a finished call's result stays retrievable, and a finished session known."""
        self.engine = engine
        self.store = store
        self.base_name = base_name
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.keys = keys
        self.window_s = window_ms / 1000.0
        self.lora_alpha = lora_alpha
        self.session_ttl_s = session_ttl_s
        self.register = register
        self.unregister = unregister
        self.keep_sampler_saves = keep_sampler_saves
        if keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be 1 or more, not {keep_snapshots}")
        self.keep_snapshots = keep_snapshots
        self.result_ttl_s = result_ttl_s
        self._runs_lock = threading.Lock()  # run records: written by the worker (saves) and routes (deletes)
        self.vocab = int(engine.base.config.vocab_size)
        self.futures = Futures(result_ttl_s)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainModel] = {}
        self.samplers: dict[str, Sampler] = {}
        # sampler id -> (owner, why it is gone): the sampling sessions released with their snapshot or checkpoint
        self._gone: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._next_sweep = 0.0
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._stopping = False
        # models per batched forward_backward round and per fused optim_step round, the newest `HISTORY` of each
        # (for tests and benchmarks)
        self.batches: list[int] = []
        self.optim_rounds: list[int] = []
        self._tokenizer: str | None = None
        self._thread: threading.Thread | None = None  # started by the first call queued
        self._free_since = 0.0  # time.monotonic() when the worker last finished a round
        self._release_orphan_snapshots()

    def counts(self) -> dict[str, int]:
        """What this service holds in memory now (the `mint_tinker_*` gauges of /metrics)."""
        with self._lock:
            return {
                "sessions": len(self.sessions),
                "training_models": len(self.models),
                "sampling_sessions": len(self.samplers),
                "snapshots": sum(len(m.live_snapshots) for m in self.models.values()),
                "futures": len(self.futures),
            }

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(30)

    @property
    def tokenizer_dir(self) -> str:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_dir()
        return self._tokenizer

    def _tokenizer_dir(self) -> str:
        """Where `get_tokenizer()` of the SDK loads the base's tokenizer from: the base's own directory, or a copy
        written here for a base built in memory."""
        path = getattr(self.engine.base.model.config, "_name_or_path", "") or ""
        if path and Path(path, "tokenizer_config.json").is_file():
            return str(Path(path).resolve())
        out = self.state_dir / "tokenizer"
        if not (out / "tokenizer_config.json").is_file():
            self.engine.tokenizer.save_pretrained(out)
        return str(out.resolve())

    # ---- auth and sessions ----------------------------------------------------------------------------------

    def owner_of(self, key: str | None) -> str:
        if not key:
            raise TinkerError(
                401, "missing API key: send it in the X-API-Key header (ServiceClient(api_key=...))"
            )
        owner = self.keys.get(key)
        if owner is None:
            raise TinkerError(401, "invalid API key")
        return owner

    def create_session(self, owner: str) -> str:
        sid = str(uuid.uuid4())
        with self._lock:
            self._maybe_sweep()
            self.sessions[sid] = Session(sid, owner, time.monotonic())
        logger.info("tinker session %s for %s", sid, owner)
        return sid

    def session(self, owner: str, session_id: str) -> Session:
        with self._lock:
            self._maybe_sweep()
            s = self.sessions.get(session_id)
            if s is None or s.owner != owner:
                raise not_found(f"no session {session_id!r} of this API key")
            if s.finished:
                raise TinkerError(410, f"session {session_id} has finished")
            s.last_seen = time.monotonic()
            return s

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.session(owner, session_id)

    def finish_session(self, owner: str, session_id: str) -> None:
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None or s.owner != owner:
                raise not_found(f"no session {session_id!r} of this API key")
            if s.finished:
                return
            self._end(s, time.monotonic())

    def _end(self, s: Session, now: float) -> None:
        """Finish a session (under the lock): its models close, their snapshots are released."""
        s.finished = True
        s.ended = now
        for mid in list(s.models):
            self._drop_model(mid)

    def _maybe_sweep(self) -> None:
        """`sweep`, at most once a second (under the lock)."""
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + 1.0
            self.sweep(now)

    def sweep(self, now: float | None = None) -> None:
        """Expire the sessions that sent nothing for `session_ttl_s`, forget the sessions (and their sampling
        sessions) that ended more than `result_ttl_s` before `now`, and the results that finished that long ago.
        Until then a call on a finished session answers 410, after it 404."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for s in list(self.sessions.values()):
                if not s.finished and now - s.last_seen > self.session_ttl_s:
                    logger.info(
                        "tinker session %s expired (no heartbeat for %.0f s)", s.id, now - s.last_seen
                    )
                    self._end(s, now)
            gone = {s.id for s in self.sessions.values() if s.finished and now - s.ended > self.result_ttl_s}
            for sid in gone:
                del self.sessions[sid]
            if gone:
                for sampler in [x for x in self.samplers.values() if x.session_id in gone]:
                    del self.samplers[sampler.id]
        self.futures.sweep(now)

    def _drop_model(self, model_id: str) -> None:
        """Stop a model (under the lock): its queued calls fail, a call running now ends as it would have, its
        slot is unpinned and freed, its unnamed snapshots are released (its named saves stay)."""
        m = self.models.pop(model_id, None)
        if m is None:
            return
        m.closed = True
        while m.live_snapshots:
            self._release_snapshot(
                m.live_snapshots.popleft(),
                f"released when its training model {model_id} closed with its session",
            )
        while m.queue:
            op = m.queue.popleft()
            if not op.started:
                _settle_one(
                    op.future, error=TinkerError(410, f"model {model_id} was closed with its session")
                )
        ws = self.engine.working_set
        ws.unpin(model_id)
        ws.remove(model_id)
        self._zero_grad(m.slot)

    def _zero_grad(self, slot: int) -> None:
        """Forget gradient left at a slot (a dropped model's), so the next model there starts from none."""
        with self.engine._forward_lock, torch.no_grad():
            for bank in self.engine.lora.banks.values():
                for g in (bank.A.grad, bank.B.grad):
                    if g is not None:
                        g[slot].zero_()

    # ---- models -----------------------------------------------------------------------------------------

    def model(self, owner: str, model_id: str) -> TrainModel:
        with self._lock:
            m = self.models.get(model_id)
            if m is None:
                s = self.sessions.get(model_id.split(":", 1)[0])
                if s is not None and s.owner == owner and s.finished and model_id in s.models:
                    raise TinkerError(
                        410, f"model {model_id} was closed with its session {s.id}, which has finished"
                    )
            if m is None or m.owner != owner:
                raise not_found(
                    f"unknown model_id {model_id!r} (no training model of this API key has that id)"
                )
            s = self.sessions.get(m.session_id)
            if s is not None:
                s.last_seen = time.monotonic()
            return m

    def create_model(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        rank: int,
        seed: int | None,
        train_attn: bool = True,
        train_mlp: bool = True,
        policy: str | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainModel:
        """A fresh LoRA (PEFT's init: A kaiming-uniform, B zero) pinned in a slot of the engine."""
        session = self.session(owner, session_id)
        problems = []
        if base_model != self.base_name:
            problems.append(
                f"base_model {base_model!r} is not served here; this server's base is {self.base_name!r}"
            )
        max_rank = self.engine.config.max_lora_rank
        if not 1 <= rank <= max_rank:
            problems.append(
                f"LoRA rank {rank} is outside [1, {max_rank}] (the engine's maximum rank is {max_rank})"
            )
        sites = [
            s
            for s, site in self.engine.sites.items()
            if (site.short in ATTN and train_attn) or (site.short not in ATTN and train_mlp)
        ]
        if not sites:
            problems.append(
                "train_attn and train_mlp are both off: nothing to train (the unembedding is not adapted)"
            )
        if problems:
            raise TinkerError(400, "; ".join(problems))
        model_id = f"{session_id}:train:{model_seq_id}"
        with self._lock:
            if model_id in self.models:
                raise TinkerError(400, f"model {model_id} already exists")
            free = self.engine.config.max_loras - len(self.models)
            if free <= 1:
                raise TinkerError(
                    400,
                    f"no free adapter slot: {len(self.models)} training models hold {len(self.models)} of the "
                    f"engine's {self.engine.config.max_loras} slots and one stays for serving (raise max_loras)",
                )
            g = torch.Generator().manual_seed(
                seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "big")
            )
            tensors = {}
            for s in sites:
                site = self.engine.sites[s]
                lead = (site.experts,) if site.experts else ()
                bound = 1.0 / math.sqrt(site.in_features)
                A = (torch.rand(*lead, rank, site.in_features, generator=g) * 2 - 1) * bound
                tensors[s] = (A, torch.zeros(*lead, site.out_features, rank))
            weights = AdapterWeights(rank, self.lora_alpha, tensors, self.engine.base.fingerprint)
            # its own identity, not its bytes: the slot is trained in place, so it must never be shared with a
            # served revision that happens to have the same initial bytes
            weights.digest = Digest(hashlib.sha256(f"tinker-training:{model_id}".encode()).hexdigest())
            self.engine.add_adapter(model_id, weights)
            slot = self.engine.working_set.pin(model_id)
            self._zero_grad(slot)
            m = self._new_model(
                model_id,
                owner,
                session_id,
                rank,
                sites,
                slot,
                policy or _policy_name(session_id, model_seq_id),
            )
            m.user_metadata = user_metadata
            self.models[model_id] = m
            session.models.add(model_id)
        self._write_run(m, [])
        logger.info("tinker model %s: rank %d, %d sites, slot %d", model_id, rank, len(sites), slot)
        return m

    def _new_model(
        self, model_id: str, owner: str, session_id: str, rank: int, sites: list[str], slot: int, policy: str
    ) -> TrainModel:
        banks = self.engine.lora.banks
        views = {s: (banks[s].A.data[slot], banks[s].B.data[slot]) for s in sites}
        scale = self.lora_alpha / rank
        opt = torch.optim.AdamW(
            [
                {"params": [a for a, _ in views.values()], "lr": 1e-4, "lr_mult": 1.0},
                {"params": [b for _, b in views.values()], "lr": 1e-4 * scale, "lr_mult": scale},
            ],
            lr=1e-4,
            fused=True,
        )
        return TrainModel(model_id, owner, session_id, rank, self.lora_alpha, sites, slot, opt, views, policy)

    def info(self, m: TrainModel) -> dict[str, Any]:
        cfg = self.engine.base.config
        return {
            "type": "get_info",
            "model_id": m.id,
            "model_data": {
                "arch": str(getattr(cfg, "model_type", "")),
                "model_name": self.base_name,
                "tokenizer_id": self.tokenizer_dir,
            },
            "is_lora": True,
            "lora_rank": m.rank,
            "model_name": self.base_name,
        }

    def weights(self, m: TrainModel) -> AdapterWeights:
        """The model's current LoRA factors (PEFT orientation, scale taken out of B)."""
        with self.engine._forward_lock:
            tensors = {
                s: tuple(t.clone() for t in self.engine.lora.banks[s].read(m.slot, m.rank, m.scale))
                for s in m.sites
            }
        return AdapterWeights(
            m.rank,
            m.alpha,
            tensors,  # type: ignore[arg-type]
            self.engine.base.fingerprint,
            self.base_name,
            dtype=self.engine.base.dtype,
        )

    # ---- queueing ---------------------------------------------------------------------------------------

    def submit(self, m: TrainModel, op: _Op) -> None:
        with self._cv:
            if m.closed:
                raise TinkerError(410, f"model {m.id} was closed with its session")
            m.queue.append(op)
            m.last_call = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mint-tinker-trainer", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def forward_backward(
        self,
        m: TrainModel,
        data: list[Datum],
        loss_fn: str,
        config: dict[str, float | str],
        forward_only: bool,
    ) -> Future[Any]:
        """Check the call, then queue it; the future gets a `Result` with the ForwardBackwardOutput protobuf."""
        if not data:
            raise TinkerError(400, "forward_backward needs at least one datum")
        problems = []
        max_len = self.engine.max_model_len
        for i, d in enumerate(data):
            if len(d.tokens) == 0:
                problems.append(f"datum {i}: model_input is empty")
            elif len(d.tokens) > max_len:
                problems.append(f"datum {i}: {len(d.tokens)} tokens is more than the context ({max_len})")
            elif int(d.tokens.min()) < 0 or int(d.tokens.max()) >= self.vocab:
                problems.append(f"datum {i}: model_input token ids must be in [0, {self.vocab})")
        if problems:
            raise TinkerError(400, "; ".join(problems[:20]))
        try:
            losses.check(loss_fn, config, [d.tokens for d in data], [d.inputs for d in data], self.vocab)
        except losses.LossInputError as e:
            raise TinkerError(400, str(e)) from None
        fut: Future[Any] = Future()
        self.submit(m, _Op("forward" if forward_only else "forward_backward", fut, data, loss_fn, config))
        return fut

    def call(self, m: TrainModel, fn: Callable[[], Any]) -> Future[Any]:
        """Queue `fn` in the model's order (save, load); the future gets what it returns."""
        fut: Future[Any] = Future()
        self.submit(m, _Op("other", fut, run=fn))
        return fut

    def optim(self, m: TrainModel, adam: AdamStep) -> Future[Any]:
        """Queue an optim_step in the model's order; the future gets a `Result` with its metrics. Steps of many
        models that come up in the same round run as one fused AdamW (`optim_steps`)."""
        fut: Future[Any] = Future()
        self.submit(m, _Op("optim", fut, adam=adam))
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                heads = self._next_round()
            if heads is None:
                return
            try:
                fb = [(m, op) for m, op in heads if op.kind in BATCHED]
                if fb:
                    self._batch(fb)
                optims = [(m, op) for m, op in heads if op.kind == "optim"]
                if optims:
                    self._optim(optims)
                for _, op in heads:
                    if op.kind == "other":
                        self._one(op)
            except BaseException as e:  # the worker outlives any one round: its calls fail, later ones run
                logger.exception("tinker round failed")
                for _, op in heads:
                    _settle_one(op.future, error=e)
            with self._cv:
                for m, op in heads:
                    if m.queue and m.queue[0] is op:
                        m.queue.popleft()
                self._free_since = time.monotonic()

    def _next_round(self) -> list[tuple[TrainModel, _Op]] | None:
        """Under the lock: the calls to run next, the oldest of each model that has any (None: stopping).

        Calls other than forward/forward_backward never wait: when some models' oldest call is one, those calls
        make the round (their forward_backward calls run in the next). A round of only forward/forward_backward
        calls waits while models that are training now (called in the last `ACTIVE_S`) have sent nothing, until
        every one of them has or `window_ms` has passed since the oldest call waiting was queued or, if it came while
        the worker was busy, since the worker was free; so the clients of a training loop batch together every step,
        not only on the first."""
        while True:
            if self._stopping:
                return None
            heads = [(m, m.queue[0]) for m in self.models.values() if m.queue]
            if not heads:
                self._cv.wait()
                continue
            rest = [(m, op) for m, op in heads if op.kind not in BATCHED]
            if rest:
                return _started(rest)
            now = time.monotonic()
            left = max(min(op.queued for _, op in heads), self._free_since) + self.window_s - now
            recent = now - ACTIVE_S
            if left <= 0 or not any(not m.queue and m.last_call > recent for m in self.models.values()):
                return _started(heads)
            self._cv.wait(left)

    def _one(self, op: _Op) -> None:
        assert op.run is not None
        try:
            value = op.run()
        except BaseException as e:  # the caller's future carries it
            if not isinstance(e, TinkerError | MintError | ValueError):
                logger.exception("tinker call failed")
            _settle_one(op.future, error=e)
            return
        _settle_one(op.future, value)

    def _batch(self, calls: list[tuple[TrainModel, _Op]]) -> None:
        self._settle(calls, "batched forward_backward", lambda: self.run_batch(calls))

    def _optim(self, calls: list[tuple[TrainModel, _Op]]) -> None:
        def run() -> list[Result]:
            steps = []
            for m, op in calls:
                assert op.adam is not None
                steps.append((m, op.adam))
            metrics = self.optim_steps(steps)
            _record(self.optim_rounds, len(calls))
            return [Result(json=res) for res in metrics]

        self._settle(calls, "optim_step", run)

    @staticmethod
    def _settle(calls: list[tuple[TrainModel, _Op]], what: str, run: Callable[[], list[Result]]) -> None:
        """Run one round for `calls` and give each call's future its result, or the round's error to all."""
        try:
            results = run()
        except BaseException as e:  # the callers' futures carry it
            logger.exception("%s failed", what)
            for _, op in calls:
                _settle_one(op.future, error=e)
            return
        for (_, op), res in zip(calls, results, strict=True):
            _settle_one(op.future, res)

    # ---- the batched step ------------------------------------------------------------------------------

    def run_batch(self, calls: list[tuple[TrainModel, _Op]]) -> list[Result]:
        """One forward (and one backward, if any call wants gradients) over every datum of `calls`, each row under
        its model's slot; each call's loss over its own rows. Gradients accumulate in the banks' slot rows."""
        eng = self.engine
        data = [d for _, op in calls for d in op.data]
        lengths = np.array([len(d.tokens) for d in data])
        width = int(lengths.max())
        dev = eng.base.device
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids_np = np.full((len(data), width), eng.pad_id, dtype=np.int64)
        ids_np[mask] = np.concatenate([d.tokens for d in data])
        ids = torch.from_numpy(ids_np)
        attn = torch.from_numpy(mask.astype(np.int64))
        slots = [m.slot for m, op in calls for _ in op.data]
        train = any(op.kind == "forward_backward" for _, op in calls)
        sites = sorted({s for m, op in calls if op.kind == "forward_backward" for s in m.sites})
        banks = [eng.lora.banks[s] for s in sites]
        _record(self.batches, len(calls))
        # each call's tokens are one run of the real tokens in row order (rows are in call order)
        token_ends = np.concatenate([[0], np.cumsum(lengths)])
        bounds = token_ends[np.cumsum([0] + [len(op.data) for _, op in calls])]
        with eng._forward_lock:
            for b in banks:
                b.A.requires_grad_(True)
                b.B.requires_grad_(True)
            try:
                with torch.enable_grad() if train else torch.no_grad():
                    eng.lora.ctx.set_rows(slots, dev)
                    try:
                        logits = eng.base.model(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits
                    finally:
                        eng.lora.ctx.clear()
                    B, T, V = logits.shape
                    at = torch.from_numpy(np.flatnonzero(mask)).to(dev)  # row * T + t of every real token
                    tgt = torch.from_numpy(
                        np.concatenate([d.inputs["target_tokens"] for d in data]).astype(np.int64)
                    ).to(dev)
                    lp_all = selected_logprobs(logits.reshape(B * T, V), at, tgt)
                    total = lp_all.new_zeros(())
                    call_loss = []
                    for c, (_, op) in enumerate(calls):
                        loss = self._call_loss(op, lp_all[bounds[c] : bounds[c + 1]], dev)
                        call_loss.append(float(loss.detach()))
                        if op.kind == "forward_backward":
                            total = total + loss
                    if train and total.requires_grad:
                        total.backward()
            finally:
                for b in banks:
                    b.A.requires_grad_(False)
                    b.B.requires_grad_(False)
        per_datum = np.split(lp_all.detach().cpu().numpy(), token_ends[1:-1])
        results = []
        start = 0
        for (_, op), loss_sum in zip(calls, call_loss, strict=True):
            outputs = [{"logprobs": lp} for lp in per_datum[start : start + len(op.data)]]
            start += len(op.data)
            results.append(Result(proto=write_forward_backward_output(outputs, {"loss:sum": loss_sum})))
        return results

    @staticmethod
    def _call_loss(op: _Op, lp: torch.Tensor, dev: torch.device) -> torch.Tensor:
        """The loss of one call, its data's target logprobs `lp` concatenated: every loss is a sum over tokens of
        a per-token term, so data with the same inputs go through `losses.datum_loss` together."""
        keys = [sorted(k for k in d.inputs if k != "target_tokens") for d in op.data]
        if all(k == keys[0] for k in keys):
            groups = [(op.data, lp)]
        else:  # some data carry an optional input the others leave out: one datum at a time
            groups, start = [], 0
            for d in op.data:
                groups.append(([d], lp[start : start + len(d.tokens)]))
                start += len(d.tokens)
        total = lp.new_zeros(())
        for data, part in groups:
            ins = {
                k: torch.as_tensor(
                    np.concatenate([d.inputs[k] for d in data]), dtype=torch.float32, device=dev
                )
                for k in data[0].inputs
                if k != "target_tokens"
            }
            total = total + losses.datum_loss(op.loss_fn, op.config, part, ins)
        return total

    # ---- optimizer ------------------------------------------------------------------------------------

    def optim_step(
        self,
        m: TrainModel,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_clip_norm: float,
    ) -> dict[str, Any]:
        """One AdamW step of `m` on the gradient accumulated since its last step (zero if none); clears it."""
        return self.optim_steps([(m, AdamStep(lr, beta1, beta2, eps, weight_decay, grad_clip_norm))])[0]

    def optim_steps(self, steps: list[tuple[TrainModel, AdamStep]]) -> list[dict[str, Any]]:
        """One AdamW step of each model, each with its own hyper-parameters, gradient clipping and moments, on the
        gradient accumulated at its slot since its last step (zero if none), which is cleared: the same updates as
        stepping them one by one, in a few fused AdamW calls over all their LoRA factors (`fused_adamw_step`)."""
        banks = self.engine.lora.banks
        with self.engine._forward_lock, torch.no_grad():
            grads_of: list[list[torch.Tensor]] = []
            for m, _ in steps:
                grads = []
                for s, (A, Bv) in m.views.items():
                    bank = banks[s]
                    # the slot's row of the accumulated gradient itself: clipped in place, zeroed after the step
                    A.grad = bank.A.grad[m.slot] if bank.A.grad is not None else torch.zeros_like(A)
                    Bv.grad = bank.B.grad[m.slot] if bank.B.grad is not None else torch.zeros_like(Bv)
                    grads += [A.grad, Bv.grad]
                grads_of.append(grads)
            per_tensor = iter(torch._foreach_norm([g for grads in grads_of for g in grads]))
            norms = []
            for (m, adam), grads in zip(steps, grads_of, strict=True):
                # the global norm as clip_grad_norm_ takes it: the norm of the per-tensor norms
                norm = float(torch.linalg.vector_norm(torch.stack([next(per_tensor) for _ in grads])))
                norms.append(norm)
                if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
                    torch._foreach_mul_(grads, adam.grad_clip_norm / (norm + 1e-6))
                for group in m.optimizer.param_groups:
                    mult = group["lr_mult"]
                    group["lr"] = adam.lr * mult
                    group["betas"] = (adam.beta1, adam.beta2)
                    group["eps"] = adam.eps
                    # decoupled decay of the bank's B (scale folded in) at lr * scale: divide to decay as PEFT's B
                    group["weight_decay"] = adam.weight_decay / mult
            fused_adamw_step([m.optimizer for m, _ in steps])
            slots: dict[str, list[int]] = {}
            for m, _ in steps:
                for s, (A, Bv) in m.views.items():
                    A.grad = Bv.grad = None
                    slots.setdefault(s, []).append(m.slot)
                m.steps += 1
            for s, rows in slots.items():
                index = torch.tensor(rows, device=banks[s].A.device)
                for acc in (banks[s].A.grad, banks[s].B.grad):
                    if acc is not None:
                        acc.index_fill_(0, index, 0.0)
        return [
            {"metrics": {"grad_norm:mean": norm, "step:max": float(m.steps)}}
            for (m, _), norm in zip(steps, norms, strict=True)
        ]

    # ---- checkpoints ----------------------------------------------------------------------------------

    def _meta_file(self, path: str) -> Path:
        return self.state_dir / "checkpoints" / (hashlib.sha256(path.encode()).hexdigest() + ".json")

    def checkpoint(self, owner: str, path: str) -> Checkpoint:
        f = self._meta_file(path)
        if not path.startswith("tinker://") or not f.is_file():
            raise not_found(f"no checkpoint at {path!r}")
        ck = Checkpoint(**json.loads(f.read_text()))
        if ck.owner != owner:
            raise not_found(f"no checkpoint at {path!r}")  # another key's: not even its existence is told
        return ck

    def _write_meta(self, ck: Checkpoint) -> None:
        f = self._meta_file(ck.path)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(ck.to_json()))
        tmp.replace(f)

    @staticmethod
    def check_name(name: str | None) -> str:
        if not name or "/" in name or len(name) > 200 or name.strip() != name:
            raise TinkerError(
                400, f"checkpoint name {name!r} must be 1-200 characters without '/' or surrounding spaces"
            )
        return name

    def save_weights(self, m: TrainModel, name: str) -> dict[str, Any]:
        """The model's weights and AdamW state: weights to the adapter store, moments beside the checkpoint index."""
        path = f"tinker://{m.id}/weights/{name}"
        weights = self.weights(m)
        digest = self.store.put_weights(weights, self.engine.sites)
        state: dict[str, torch.Tensor] = {}
        for s, views in m.views.items():
            for part, view in zip("AB", views, strict=True):
                st = m.optimizer.state.get(view)
                if st:
                    state[f"{s}.{part}.exp_avg"] = st["exp_avg"].contiguous()
                    state[f"{s}.{part}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
        opt_file = self._meta_file(path).with_suffix(".optimizer.safetensors")
        opt_file.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(opt_file))
        ck = Checkpoint(
            path,
            m.owner,
            m.id,
            "weights",
            str(digest),
            m.rank,
            m.alpha,
            m.sites,
            str(opt_file),
            m.steps,
            created=time.time(),
        )
        self.store.add_ref(path, digest)  # a training checkpoint is in no catalog: the ref keeps it from gc
        self._write_meta(ck)
        self._add_to_run(m, path)
        return {"path": path, "type": "save_weights"}

    def load_weights(self, m: TrainModel, path: str, optimizer: bool) -> dict[str, Any]:
        """Put a checkpoint's weights (and, with `optimizer`, its AdamW state) into the model's slot."""
        ck = self.checkpoint(m.owner, path)
        problems = []
        if ck.rank != m.rank:
            problems.append(f"checkpoint {path} has rank {ck.rank}, this model rank {m.rank}")
        if sorted(ck.sites) != sorted(m.sites):
            problems.append(f"checkpoint {path} adapts other layers than this model")
        if optimizer and ck.optimizer_file is None:
            problems.append(f"checkpoint {path} holds no optimizer state (a sampler checkpoint)")
        if problems:
            raise TinkerError(400, "; ".join(problems))
        weights = self.engine.read_adapter(m.id, Path(self.store.local_dir(ck.digest)))
        opt_state = load_file(ck.optimizer_file) if optimizer and ck.optimizer_file else {}
        with self.engine._forward_lock, torch.no_grad():
            for s, (A, B) in weights.tensors.items():
                self.engine.lora.banks[s].write(m.slot, A, B, weights.scale)
            for s, views in m.views.items():
                for part, view in zip("AB", views, strict=True):
                    m.optimizer.state.pop(view, None)
                    if f"{s}.{part}.exp_avg" in opt_state:
                        m.optimizer.state[view] = {
                            "step": torch.tensor(float(ck.steps), dtype=torch.float32),
                            "exp_avg": opt_state[f"{s}.{part}.exp_avg"].to(view).clone(),
                            "exp_avg_sq": opt_state[f"{s}.{part}.exp_avg_sq"].to(view).clone(),
                        }
            m.steps = ck.steps if optimizer else 0
        m.parent = ck.address or m.parent
        return {"path": path, "model_id": m.id, "type": "load_weights"}

    def save_for_sampler(self, m: TrainModel, name: str | None) -> dict[str, Any]:
        """A revision for sampling: to the store, into the engine under its Tinker path, and (named, with a
        registry) an MLflow version of the model's policy. Unnamed: an ephemeral snapshot, served by a new
        sampling session whose id is returned."""
        weights = self.weights(m)
        digest = self.store.put_weights(weights, self.engine.sites)
        if name is None:
            m.snapshots += 1
            name = f"snapshot-{m.snapshots}"
            ephemeral = True
        else:
            ephemeral = False
        path = f"tinker://{m.id}/sampler_weights/{name}"
        try:
            self.engine.load_adapter(path, self.store.local_dir(digest), replace=True)
        except AdapterError as e:
            raise TinkerError(500, f"the saved revision {digest[:12]} cannot be served: {e}") from None
        ck = Checkpoint(
            path,
            m.owner,
            m.id,
            "sampler_weights",
            str(digest),
            m.rank,
            m.alpha,
            m.sites,
            None,
            m.steps,
            created=time.time(),
            ephemeral=ephemeral,
        )
        # a live snapshot's bytes too are kept from gc: the engine reads them again once they leave host memory
        self.store.add_ref(path, digest)
        if ephemeral:
            self._write_meta(ck)
            return {"sampling_session_id": self._add_snapshot(m, path), "type": "save_weights_for_sampler"}
        if self.register is not None:
            ck.address = self.register(m, ck, name)
            m.parent = ck.address
        self._write_meta(ck)
        older = self._add_to_run(m, path)
        logger.info(
            "tinker %s saved %s (%s)%s", m.id, path, digest[:12], f" as {ck.address}" if ck.address else ""
        )
        if self.keep_sampler_saves is not None:
            samplers = [p for p in older if "/sampler_weights/" in p]
            for old in samplers[: max(0, len(samplers) + 1 - self.keep_sampler_saves)]:
                try:
                    self.delete_checkpoint(m.owner, old)
                except (TinkerError, MintError) as e:  # the save stands; the next save tries again
                    logger.warning("tinker %s: keeping %s for now: %s", m.id, old, e)
        return {"path": path, "type": "save_weights_for_sampler"}

    def _add_snapshot(self, m: TrainModel, path: str) -> str:
        """A new sampling session on the snapshot just saved at `path`; the run's snapshots beyond its newest
        `keep_snapshots` are released. A model closed meanwhile releases this one too (nothing left behind)."""
        with self._lock:
            session = self.sessions.get(m.session_id)
            if m.closed or session is None:
                self._release_snapshot(
                    path, f"released when its training model {m.id} closed with its session"
                )
                raise TinkerError(410, f"model {m.id} was closed with its session")
            sid = self.new_sampler(m.owner, session, path, path)
            m.live_snapshots.append(path)
            while len(m.live_snapshots) > self.keep_snapshots:
                self._release_snapshot(
                    m.live_snapshots.popleft(),
                    f"released: each training run keeps its newest {self.keep_snapshots} unnamed snapshots "
                    "(tinker_keep_snapshots); sample from a newer save_weights_and_get_sampling_client",
                )
            return sid

    def _release_snapshot(self, path: str, why: str) -> None:
        """Release an unnamed snapshot completely (under the lock): out of the engine (a sample running on it
        finishes first), the store's refs (so `mint catalog gc` frees its bytes), the checkpoint index, and the
        sampling sessions on it, which then answer 410 with `why`. Idempotent."""
        if self.engine.working_set.get(path) is not None:
            self.engine.unload_adapter(path)
        self.store.remove_ref(path)
        self._meta_file(path).unlink(missing_ok=True)
        self._forget_samplers(path, why)
        logger.debug("tinker %s %s", path, why)

    def _forget_samplers(self, path: str, why: str) -> None:
        """Drop the sampling sessions on `path` (under the lock); each answers 410 with `why` for a while."""
        for s in [s for s in self.samplers.values() if s.adapter == path]:
            del self.samplers[s.id]
            self._gone[s.id] = (s.owner, f"sampling session {s.id} sampled {path}, which was {why}")
            while len(self._gone) > GONE_KEEP:
                self._gone.popitem(last=False)

    def _release_orphan_snapshots(self) -> None:
        """At start: release the unnamed snapshots a previous process left (their models and sampling sessions
        died with it). Snapshots written before they were marked `ephemeral` are told by their name and by being
        in no run's record."""
        released = 0
        records: dict[str, set[str]] = {}
        for f in sorted((self.state_dir / "checkpoints").glob("*.json")):
            try:
                ck = Checkpoint(**json.loads(f.read_text()))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("tinker: skipping unreadable checkpoint record %s: %s", f, e)
                continue
            if not ck.ephemeral:
                if ck.kind != "sampler_weights" or SNAPSHOT not in ck.path:
                    continue
                if ck.model_id not in records:
                    records[ck.model_id] = set((self._read_run(ck.model_id) or {}).get("checkpoints", []))
                if ck.path in records[ck.model_id]:
                    continue  # a named save called snapshot-N
            self.store.remove_ref(ck.path)
            f.unlink(missing_ok=True)
            released += 1
        if released:
            logger.info("tinker: released %d unnamed snapshots left by a previous process", released)

    def delete_checkpoint(self, owner: str, path: str) -> dict[str, Any]:
        """Delete a named checkpoint: from the registry first (its MLflow version and catalog rows, unless an
        alias holds the version), then from the engine, the store's refs, the run's record and the checkpoint
        index, so `mint catalog gc` frees its bytes. Refused (nothing changed) when unknown, another key's, or
        the registry cannot be reached; deleting it again answers 404."""
        ck = self.checkpoint(owner, path)
        kept = None
        if ck.address is not None and self.unregister is not None:
            try:
                kept = self.unregister(ck)
            except MintError as e:
                raise TinkerError(503, f"cannot delete {path}: its registry version {ck.address}: {e}") from e
        for name in (path, ck.address if kept is None else None):
            if name and self.engine.working_set.get(name) is not None:
                self.engine.unload_adapter(name)
        self.store.remove_ref(path)
        meta = self._meta_file(path)
        meta.with_suffix(".optimizer.safetensors").unlink(missing_ok=True)
        self._remove_from_run(ck.model_id, path)
        meta.unlink(missing_ok=True)
        with self._lock:
            self._forget_samplers(path, "deleted")
        logger.info(
            "tinker deleted %s%s",
            path,
            f" (its version {ck.address} stays: {kept})"
            if kept
            else f" and {ck.address}"
            if ck.address
            else "",
        )
        return {"path": path, "deleted": True, "registry_version_kept": kept}

    # ---- training runs (one per model id) ------------------------------------------------------------------

    def _run_file(self, model_id: str) -> Path:
        return self.state_dir / "runs" / (hashlib.sha256(model_id.encode()).hexdigest() + ".json")

    def _read_run(self, model_id: str) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self._run_file(model_id).read_text()))
        except FileNotFoundError:
            return None

    def _put_run(self, record: dict[str, Any]) -> None:
        f = self._run_file(record["model_id"])
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(f)

    def _write_run(self, m: TrainModel, checkpoints: list[str]) -> None:
        with self._runs_lock:
            self._put_run(
                {
                    "model_id": m.id,
                    "owner": m.owner,
                    "rank": m.rank,
                    "policy": m.policy,
                    "user_metadata": m.user_metadata,
                    "created": m.created,
                    "last_request": time.time(),
                    "checkpoints": checkpoints,
                }
            )

    def _add_to_run(self, m: TrainModel, path: str) -> list[str]:
        """Append a named checkpoint to the run's record; returns the run's checkpoints before it."""
        with self._runs_lock:
            record = self._read_run(m.id) or {
                "model_id": m.id,
                "owner": m.owner,
                "rank": m.rank,
                "policy": m.policy,
                "user_metadata": m.user_metadata,
                "created": m.created,
                "checkpoints": [],
            }
            older = [p for p in record["checkpoints"] if p != path]
            record["checkpoints"] = [*older, path]
            record["last_request"] = time.time()
            self._put_run(record)
            return older

    def _remove_from_run(self, model_id: str, path: str) -> None:
        with self._runs_lock:
            record = self._read_run(model_id)
            if record is not None and path in record["checkpoints"]:
                record["checkpoints"].remove(path)
                self._put_run(record)

    def training_run(self, owner: str, model_id: str) -> dict[str, Any]:
        """The SDK's `types.TrainingRun` of a model id: live, or from its record once its session ended."""
        record = self._read_run(model_id)
        if record is None or record["owner"] != owner:
            raise not_found(f"no training run {model_id!r} of this API key")
        last: dict[str, Checkpoint] = {}
        for path in record["checkpoints"]:
            try:
                ck = self.checkpoint(owner, path)
            except TinkerError:
                continue  # deleted meanwhile
            last[ck.kind] = ck
        with self._lock:
            m = self.models.get(model_id)
            last_request = record.get("last_request", record["created"])
            if m is not None and m.last_call:
                last_request = max(last_request, time.time() - (time.monotonic() - m.last_call))
        meta = record.get("user_metadata")
        return {
            "training_run_id": model_id,
            "base_model": self.base_name,
            "model_owner": owner,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": record["rank"],
            "last_request_time": _iso(last_request),
            "last_checkpoint": last["weights"].to_wire() if "weights" in last else None,
            "last_sampler_checkpoint": last["sampler_weights"].to_wire()
            if "sampler_weights" in last
            else None,
            "user_metadata": {str(k): str(v) for k, v in meta.items()} if meta else None,
        }

    # ---- samplers ---------------------------------------------------------------------------------------

    def new_sampler(self, owner: str, session: Session, adapter: str | None, model_path: str | None) -> str:
        with self._lock:
            session.samplers += 1
            sid = f"{session.id}:sample:{session.samplers}"
            self.samplers[sid] = Sampler(sid, owner, adapter, model_path, session.id)
            return sid

    def create_sampler(
        self, owner: str, session_id: str, model_path: str | None, base_model: str | None
    ) -> str:
        session = self.session(owner, session_id)
        if model_path:
            ck = self.checkpoint(owner, model_path)
            if ck.kind != "sampler_weights":
                raise TinkerError(
                    400, f"{model_path} is a training checkpoint; sample from a save_weights_for_sampler path"
                )
            if self.engine.working_set.get(model_path) is None:  # e.g. after a restart: load it again
                self.engine.load_adapter(model_path, self.store.local_dir(ck.digest))
            return self.new_sampler(owner, session, model_path, model_path)
        if base_model != self.base_name:
            raise TinkerError(
                400, f"base_model {base_model!r} is not served here; this server's base is {self.base_name!r}"
            )
        return self.new_sampler(owner, session, None, None)

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        with self._lock:
            self._maybe_sweep()
            s = self.samplers.get(sampler_id)
            if s is None or s.owner != owner:
                gone = self._gone.get(sampler_id)
                if gone is not None and gone[0] == owner:
                    raise TinkerError(410, gone[1])
                raise not_found(f"no sampling session {sampler_id!r} of this API key")
            return s


def fused_adamw_step(optimizers: list[torch.optim.AdamW]) -> None:
    """`opt.step()` of each of `optimizers` (fused AdamW, no amsgrad, no maximize), in one fused AdamW call per
    distinct set of hyper-parameters across all their param groups rather than one per group: the kernel updates
    each tensor on its own, so the result is the same, bit for bit. Parameters without a `.grad` are skipped, and a
    parameter's state is created on its first step as `torch.optim.AdamW` creates it."""
    calls: dict[tuple[float, float, float, float, float], tuple[list[torch.Tensor], ...]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            if not group["fused"] or group["amsgrad"] or group["maximize"]:
                raise ValueError("fused_adamw_step takes fused AdamW without amsgrad or maximize")
            beta1, beta2 = group["betas"]
            key = (
                float(group["lr"]),
                float(beta1),
                float(beta2),
                float(group["weight_decay"]),
                float(group["eps"]),
            )
            lists = calls.setdefault(key, ([], [], [], [], []))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = opt.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                for lst, t in zip(
                    lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]), strict=True
                ):
                    lst.append(t)
    for (lr, beta1, beta2, weight_decay, eps), (params, grads, exp_avgs, exp_avg_sqs, steps) in calls.items():
        if params:
            adamw(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=weight_decay,
                eps=eps,
                maximize=False,
            )


HISTORY = 4096
"""Most round sizes `TinkerService.batches` and `.optim_rounds` keep: a server runs for days."""


def _record(history: list[int], n: int) -> None:
    """Append a round's size, dropping the oldest half once `HISTORY` are kept."""
    history.append(n)
    if len(history) > HISTORY:
        del history[: HISTORY // 2]


def _settle_one(fut: Future[Any], value: Any = None, error: BaseException | None = None) -> None:
    """Give a future its result or error, once: a future already settled (its model closed while it ran) keeps
    what it has."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except InvalidStateError:
        logger.debug("a tinker call finished after its future was settled; dropped")


def _started(heads: list[tuple[TrainModel, _Op]]) -> list[tuple[TrainModel, _Op]]:
    """Mark a round's calls as taken by the worker (under the lock): closing their model leaves them be."""
    for _, op in heads:
        op.started = True
    return heads


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _policy_name(session_id: str, seq: int) -> str:
    return f"tinker-{session_id.split('-')[0]}-{seq}"
