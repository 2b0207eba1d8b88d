"""The checkpoints of Tinker's training models and their training runs: saves to the adapter store (weights, the
optimizer's moments beside the checkpoint index), loads, sampler revisions (into the engine under their Tinker
path, and with a registry an MLflow version), unnamed snapshots and their release, deletion, and each run's
record (`get_training_run`). `TinkerService` holds them; this part needs of it what `Checkpoints` declares."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from mint_core.engine.engine import Engine
from mint_core.errors import AdapterError, MintError
from mint_core.lora.adapter import AdapterWeights
from mint_core.registry.store import AdapterStore
from mint_core.tinker.records import (
    Checkpoint,
    Sampler,
    Session,
    TinkerError,
    TrainModel,
    iso_time,
    not_found,
)

logger = logging.getLogger(__name__)

# Sampling sessions released with their snapshot or checkpoint that are still answered with why (410), newest kept.
GONE_KEEP = 4096
SNAPSHOT = "/sampler_weights/snapshot-"


class Checkpoints:
    """The checkpoint index and the run records of a TinkerService (a part of it: the service's state below)."""

    engine: Engine
    store: AdapterStore
    base_name: str
    state_dir: Path
    register: Callable[[TrainModel, Checkpoint, str], str] | None
    unregister: Callable[[Checkpoint], str | None] | None
    keep_sampler_saves: int | None
    keep_snapshots: int
    sessions: dict[str, Session]
    models: dict[str, TrainModel]
    samplers: dict[str, Sampler]
    _gone: OrderedDict[str, tuple[str, str]]
    _lock: threading.RLock
    _runs_lock: threading.Lock

    if TYPE_CHECKING:

        def weights(self, m: TrainModel) -> AdapterWeights: ...

        def new_sampler(
            self, owner: str, session: Session, adapter: str | None, model_path: str | None
        ) -> str: ...

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
        with self.engine.exclusive(), torch.no_grad():
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
            "last_request_time": iso_time(last_request),
            "last_checkpoint": last["weights"].to_wire() if "weights" in last else None,
            "last_sampler_checkpoint": last["sampler_weights"].to_wire()
            if "sampler_weights" in last
            else None,
            "user_metadata": {str(k): str(v) for k, v in meta.items()} if meta else None,
        }
