"""The state behind Tinker's training API: sessions, training models on pinned engine slots, futures, batching.

A training model (a Tinker `TrainingClient`) is a LoRA adapter in one device slot of the serving engine, pinned
there while it lives, with its own AdamW over views of that slot (as the multi-policy trainer's `SlotAdamW`).
Its gradient accumulates in the banks' `.grad` at its slot row until `optim_step` applies it, so many models
train over one base and each one's gradient stays in its own slot.

Calls queue per model and one worker thread runs them. When a forward_backward arrives while other models are
training (they called in the last second) but have nothing queued, the worker waits `window_ms` for theirs, then
works in rounds: each round takes the oldest call of every model; the forward/forward_backward calls among them
run as ONE batched forward/backward over the base (each datum's row routed to its model's slot), the rest
(optim_step, saves, loads) one by one. A model's calls therefore run in the
order it sent them, whatever else is batched.

Saving for the sampler writes a content-addressed revision to the adapter store, loads it into the engine under
the Tinker path the SDK returns (so `/v1/completions` serves it by that name at once), and, with a registry,
makes it an MLflow version of the model's policy (alias `candidate`, `mint.parent` = the model's previous
version or the checkpoint it was loaded from, `tinker.session` = its session), from where the lifecycle's
evaluation, gate and promotion take it like any other revision.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mint_core.engine.engine import Engine
from mint_core.engine.logprobs import selected_logprobs
from mint_core.errors import AdapterError, MintError
from mint_core.lora.adapter import AdapterWeights
from mint_core.registry.store import AdapterStore
from mint_core.serving.tinker import losses
from mint_core.serving.tinker.wire import Datum, write_forward_backward_output
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
# A model that queued a call this recently counts as training now: a forward_backward waits the batching window
# for its next call only while another model does.
ACTIVE_S = 1.0


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
    models: set[str] = field(default_factory=set)
    samplers: int = 0


@dataclass
class Sampler:
    id: str
    owner: str
    adapter: str | None  # engine adapter name; None: the bare base
    model_path: str | None


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
    last_call: float = 0.0  # time.monotonic() of its last queued call
    queue: deque[_Op] = field(default_factory=deque)
    closed: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class _Op:
    kind: Literal["forward", "forward_backward", "other"]
    future: Future[Any]
    data: list[Datum] = field(default_factory=list)
    loss_fn: str = ""
    config: dict[str, float | str] = field(default_factory=dict)
    run: Callable[[], Any] | None = None


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

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Futures:
    """request id -> (owner, future); a finished future is kept until retrieved, then for `keep_s` more."""

    def __init__(self, keep_s: float = 600.0):
        self._lock = threading.Lock()
        self._items: dict[str, tuple[str, Future[Any], float]] = {}
        self.keep_s = keep_s

    def track(self, owner: str, fut: Future[Any]) -> str:
        """A new request id for `fut`, retrievable by `owner` only."""
        rid = uuid.uuid4().hex
        with self._lock:
            self._sweep()
            self._items[rid] = (owner, fut, math.inf)
        return rid

    def get(self, owner: str, request_id: str) -> Future[Any]:
        with self._lock:
            item = self._items.get(request_id)
            if item is None or item[0] != owner:
                raise not_found(f"no request {request_id!r} of this API key (unknown, or retrieved long ago)")
            if item[1].done() and item[2] == math.inf:
                self._items[request_id] = (item[0], item[1], time.monotonic() + self.keep_s)
            return item[1]

    def _sweep(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, _, t) in self._items.items() if t < now]:
            del self._items[rid]


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
    ):
        """`register(model, checkpoint, name)` makes a saved sampler revision an MLflow version and returns its
        address (None: saves go to the store and the engine only)."""
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
        self.vocab = int(engine.base.config.vocab_size)
        self.futures = Futures()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._stopping = False
        self.batches: list[int] = []  # models per batched forward_backward round (for tests and benchmarks)
        self._tokenizer: str | None = None
        self._thread: threading.Thread | None = None  # started by the first call queued

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
            self._expire()
            self.sessions[sid] = Session(sid, owner, time.monotonic())
        logger.info("tinker session %s for %s", sid, owner)
        return sid

    def session(self, owner: str, session_id: str) -> Session:
        with self._lock:
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
            s.finished = True
            for mid in list(s.models):
                self._drop_model(mid)

    def _expire(self) -> None:
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if not s.finished and now - s.last_seen > self.session_ttl_s:
                logger.info("tinker session %s expired (no heartbeat for %.0f s)", s.id, now - s.last_seen)
                s.finished = True
                for mid in list(s.models):
                    self._drop_model(mid)

    def _drop_model(self, model_id: str) -> None:
        """Stop a model: its queued calls fail, its slot is unpinned and freed (its saved revisions stay)."""
        m = self.models.pop(model_id, None)
        if m is None:
            return
        m.closed = True
        while m.queue:
            op = m.queue.popleft()
            op.future.set_exception(TinkerError(410, f"model {model_id} was closed with its session"))
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
            self.models[model_id] = m
            session.models.add(model_id)
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
        """Queue `fn` in the model's order (optim_step, save, load); the future gets what it returns."""
        fut: Future[Any] = Future()
        self.submit(m, _Op("other", fut, run=fn))
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not any(m.queue for m in self.models.values()):
                    self._cv.wait()
                if self._stopping:
                    return
            with self._cv:
                first = [m.queue[0].kind for m in self.models.values() if m.queue]
                recent = time.monotonic() - ACTIVE_S
                others = any(not m.queue and m.last_call > recent for m in self.models.values())
            if others and self.window_s > 0 and "other" not in first:
                # a forward_backward is waiting and models that are training now could send theirs in this step
                time.sleep(self.window_s)
            while True:
                with self._cv:
                    heads = [(m, m.queue[0]) for m in self.models.values() if m.queue]
                if not heads:
                    break
                fb = [(m, op) for m, op in heads if op.kind != "other"]
                if fb:
                    self._batch(fb)
                for _, op in heads:
                    if op.kind == "other":
                        self._one(op)
                with self._cv:
                    for m, op in heads:
                        if m.queue and m.queue[0] is op:
                            m.queue.popleft()

    def _one(self, op: _Op) -> None:
        assert op.run is not None
        try:
            op.future.set_result(op.run())
        except BaseException as e:  # the caller's future carries it
            if not isinstance(e, TinkerError | MintError | ValueError):
                logger.exception("tinker call failed")
            op.future.set_exception(e)

    def _batch(self, calls: list[tuple[TrainModel, _Op]]) -> None:
        try:
            results = self.run_batch(calls)
        except BaseException as e:
            logger.exception("batched forward_backward failed")
            for _, op in calls:
                op.future.set_exception(e)
            return
        for (_, op), res in zip(calls, results, strict=True):
            op.future.set_result(res)

    # ---- the batched step ------------------------------------------------------------------------------

    def run_batch(self, calls: list[tuple[TrainModel, _Op]]) -> list[Result]:
        """One forward (and one backward, if any call wants gradients) over every datum of `calls`, each row under
        its model's slot; each call's loss over its own rows. Gradients accumulate in the banks' slot rows."""
        eng = self.engine
        rows: list[tuple[int, Datum]] = []  # (call index, datum)
        for c, (_, op) in enumerate(calls):
            rows += [(c, d) for d in op.data]
        width = max(len(d.tokens) for _, d in rows)
        dev = eng.base.device
        ids = torch.full((len(rows), width), eng.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, (_, d) in enumerate(rows):
            ids[i, : len(d.tokens)] = torch.from_numpy(d.tokens)
            attn[i, : len(d.tokens)] = 1
        slots = [calls[c][0].slot for c, _ in rows]
        train = any(op.kind == "forward_backward" for _, op in calls)
        sites = sorted({s for m, op in calls if op.kind == "forward_backward" for s in m.sites})
        banks = [eng.lora.banks[s] for s in sites]
        self.batches.append(len(calls))
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
                    at = [(i, t) for i, (_, d) in enumerate(rows) for t in range(len(d.tokens))]
                    r = torch.tensor([i * T + t for i, t in at], device=dev)
                    tgt = torch.tensor(
                        np.concatenate([d.inputs["target_tokens"] for _, d in rows]),
                        dtype=torch.long,
                        device=dev,
                    )
                    lp_all = selected_logprobs(logits.reshape(B * T, V), r, tgt)
                    total = lp_all.new_zeros(())
                    outputs: list[list[dict[str, np.ndarray]]] = [[] for _ in calls]
                    call_loss = [0.0] * len(calls)
                    start = 0
                    for c, d in rows:
                        n = len(d.tokens)
                        lp = lp_all[start : start + n]
                        start += n
                        _, op = calls[c]
                        ins = {
                            k: torch.as_tensor(v, dtype=torch.float32, device=dev)
                            for k, v in d.inputs.items()
                            if k != "target_tokens"
                        }
                        loss = losses.datum_loss(op.loss_fn, op.config, lp, ins)
                        call_loss[c] += float(loss.detach())
                        if op.kind == "forward_backward":
                            total = total + loss
                        outputs[c].append({"logprobs": lp.detach().cpu().numpy()})
                    if train and total.requires_grad:
                        total.backward()
            finally:
                for b in banks:
                    b.A.requires_grad_(False)
                    b.B.requires_grad_(False)
        return [
            Result(proto=write_forward_backward_output(outputs[c], {"loss:sum": call_loss[c]}))
            for c in range(len(calls))
        ]

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
        banks = self.engine.lora.banks
        with self.engine._forward_lock, torch.no_grad():
            grads = []
            for s, (A, Bv) in m.views.items():
                bank = banks[s]
                gA = bank.A.grad[m.slot].clone() if bank.A.grad is not None else torch.zeros_like(A)
                gB = bank.B.grad[m.slot].clone() if bank.B.grad is not None else torch.zeros_like(Bv)
                A.grad, Bv.grad = gA, gB
                grads += [gA, gB]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            if grad_clip_norm > 0 and norm > grad_clip_norm:
                for g in grads:
                    g.mul_(grad_clip_norm / (norm + 1e-6))
            for group in m.optimizer.param_groups:
                mult = group["lr_mult"]
                group["lr"] = lr * mult
                group["betas"] = (beta1, beta2)
                group["eps"] = eps
                # decoupled decay of the bank's B (scale folded in) at lr * scale: divide to decay as PEFT's B
                group["weight_decay"] = weight_decay / mult
            m.optimizer.step()
            for s, (A, Bv) in m.views.items():
                A.grad = Bv.grad = None
                for acc in (banks[s].A.grad, banks[s].B.grad):
                    if acc is not None:
                        acc[m.slot].zero_()
            m.steps += 1
        return {"metrics": {"grad_norm:mean": norm, "step:max": float(m.steps)}}

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
            path, m.owner, m.id, "weights", str(digest), m.rank, m.alpha, m.sites, str(opt_file), m.steps
        )
        self._write_meta(ck)
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
            path, m.owner, m.id, "sampler_weights", str(digest), m.rank, m.alpha, m.sites, None, m.steps
        )
        if self.register is not None and not ephemeral:
            ck.address = self.register(m, ck, name)
            m.parent = ck.address
        self._write_meta(ck)
        if ephemeral:
            sid = self.new_sampler(m.owner, self.session(m.owner, m.session_id), path, path)
            return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}
        logger.info(
            "tinker %s saved %s (%s)%s", m.id, path, digest[:12], f" as {ck.address}" if ck.address else ""
        )
        return {"path": path, "type": "save_weights_for_sampler"}

    # ---- samplers ---------------------------------------------------------------------------------------

    def new_sampler(self, owner: str, session: Session, adapter: str | None, model_path: str | None) -> str:
        with self._lock:
            session.samplers += 1
            sid = f"{session.id}:sample:{session.samplers}"
            self.samplers[sid] = Sampler(sid, owner, adapter, model_path)
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
            s = self.samplers.get(sampler_id)
            if s is None or s.owner != owner:
                raise not_found(f"no sampling session {sampler_id!r} of this API key")
            return s


def _policy_name(session_id: str, seq: int) -> str:
    return f"tinker-{session_id.split('-')[0]}-{seq}"
