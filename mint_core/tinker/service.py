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
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mint_core.engine.engine import Engine
from mint_core.engine.logprobs import selected_logprobs
from mint_core.errors import MintError
from mint_core.lora.adapter import AdapterWeights
from mint_core.registry.store import AdapterStore
from mint_core.tinker import losses
from mint_core.tinker.checkpoints import Checkpoints
from mint_core.tinker.optim import AdamStep, fused_adamw_step
from mint_core.tinker.records import (
    ATTN,
    Checkpoint,
    Futures,
    Op,
    Result,
    Sampler,
    Session,
    TinkerError,
    TrainModel,
    not_found,
    record,
    settle_one,
    started,
)
from mint_core.tinker.wire import Datum, write_forward_backward_output
from mint_core.types import Digest

logger = logging.getLogger(__name__)

BATCHED = frozenset({"forward", "forward_backward"})
# A model that queued a call this recently counts as training now: a forward_backward waits the batching window
# for its next call only while another model does.
ACTIVE_S = 1.0


# the service


class TinkerService(Checkpoints):
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
                settle_one(op.future, error=TinkerError(410, f"model {model_id} was closed with its session"))
        ws = self.engine.working_set
        ws.unpin(model_id)
        ws.remove(model_id)
        self._zero_grad(m.slot)

    def _zero_grad(self, slot: int) -> None:
        """Forget gradient left at a slot (a dropped model's), so the next model there starts from none."""
        with self.engine.exclusive(), torch.no_grad():
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
        with self.engine.exclusive():
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

    def submit(self, m: TrainModel, op: Op) -> None:
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
        self.submit(m, Op("forward" if forward_only else "forward_backward", fut, data, loss_fn, config))
        return fut

    def call(self, m: TrainModel, fn: Callable[[], Any]) -> Future[Any]:
        """Queue `fn` in the model's order (save, load); the future gets what it returns."""
        fut: Future[Any] = Future()
        self.submit(m, Op("other", fut, run=fn))
        return fut

    def optim(self, m: TrainModel, adam: AdamStep) -> Future[Any]:
        """Queue an optim_step in the model's order; the future gets a `Result` with its metrics. Steps of many
        models that come up in the same round run as one fused AdamW (`optim_steps`)."""
        fut: Future[Any] = Future()
        self.submit(m, Op("optim", fut, adam=adam))
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
                    settle_one(op.future, error=e)
            with self._cv:
                for m, op in heads:
                    if m.queue and m.queue[0] is op:
                        m.queue.popleft()
                self._free_since = time.monotonic()

    def _next_round(self) -> list[tuple[TrainModel, Op]] | None:
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
                return started(rest)
            now = time.monotonic()
            left = max(min(op.queued for _, op in heads), self._free_since) + self.window_s - now
            recent = now - ACTIVE_S
            if left <= 0 or not any(not m.queue and m.last_call > recent for m in self.models.values()):
                return started(heads)
            self._cv.wait(left)

    def _one(self, op: Op) -> None:
        assert op.run is not None
        try:
            value = op.run()
        except BaseException as e:  # the caller's future carries it
            if not isinstance(e, TinkerError | MintError | ValueError):
                logger.exception("tinker call failed")
            settle_one(op.future, error=e)
            return
        settle_one(op.future, value)

    def _batch(self, calls: list[tuple[TrainModel, Op]]) -> None:
        self._settle(calls, "batched forward_backward", lambda: self.run_batch(calls))

    def _optim(self, calls: list[tuple[TrainModel, Op]]) -> None:
        def run() -> list[Result]:
            steps = []
            for m, op in calls:
                assert op.adam is not None
                steps.append((m, op.adam))
            metrics = self.optim_steps(steps)
            record(self.optim_rounds, len(calls))
            return [Result(json=res) for res in metrics]

        self._settle(calls, "optim_step", run)

    @staticmethod
    def _settle(calls: list[tuple[TrainModel, Op]], what: str, run: Callable[[], list[Result]]) -> None:
        """Run one round for `calls` and give each call's future its result, or the round's error to all."""
        try:
            results = run()
        except BaseException as e:  # the callers' futures carry it
            logger.exception("%s failed", what)
            for _, op in calls:
                settle_one(op.future, error=e)
            return
        for (_, op), res in zip(calls, results, strict=True):
            settle_one(op.future, res)

    # ---- the batched step ------------------------------------------------------------------------------

    def run_batch(self, calls: list[tuple[TrainModel, Op]]) -> list[Result]:
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
        record(self.batches, len(calls))
        # each call's tokens are one run of the real tokens in row order (rows are in call order)
        token_ends = np.concatenate([[0], np.cumsum(lengths)])
        bounds = token_ends[np.cumsum([0] + [len(op.data) for _, op in calls])]
        with eng.exclusive():
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
    def _call_loss(op: Op, lp: torch.Tensor, dev: torch.device) -> torch.Tensor:
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
        with self.engine.exclusive(), torch.no_grad():
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


def _policy_name(session_id: str, seq: int) -> str:
    return f"tinker-{session_id.split('-')[0]}-{seq}"
