"""The working set: which adapter revisions sit in device slots, which in the host cache, and who is using them.

Names map to revisions (by digest); a slot holds a revision, not a name, so loading a new revision under a
name in place leaves requests already running on the old slot untouched, and the old slot is freed when its
last request releases it. A slot with a nonzero reference count is never overwritten; pinned names never lose
their slot. Everything here is idempotent and guarded by one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mint_core.errors import MintError, UnknownAdapter, WorkingSetFull
from mint_core.lora.adapter import AdapterWeights
from mint_core.lora.layers import LoRAModel

logger = logging.getLogger(__name__)


class AdapterExists(MintError, ValueError):
    """A name already serves another revision and the load did not ask to replace it."""


@dataclass
class WorkingSetStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    host_evictions: int = 0
    cold_loads: int = 0


Prepared = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Revision:
    digest: str
    # the revision in slot layout (LoRAModel.prepare): a slot write is then one plain copy per factor, which
    # matters most for MoE experts; None once dropped from the host cache (reloadable from `source`)
    weights: Prepared | None
    source: Path | None
    names: set[str] = field(default_factory=set)


class WorkingSet:
    """`max_loras` device slots backed by a host cache of `max_cpu_loras` revisions, LRU at both levels."""

    def __init__(
        self,
        lora: LoRAModel,
        max_cpu_loras: int,
        reload: Callable[[str, Path], AdapterWeights] | None = None,
    ):
        if max_cpu_loras < lora.num_slots:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({lora.num_slots})")
        self.lora = lora
        self.max_cpu_loras = max_cpu_loras
        self._reload = reload
        self._lock = threading.RLock()
        self._names: dict[str, str] = {}  # name -> digest of its current revision
        self._revs: dict[str, _Revision] = {}
        self._host: OrderedDict[str, None] = (
            OrderedDict()
        )  # digests whose weights are in host memory, LRU first
        self._slot_of: dict[str, int] = {}
        self._owner: list[str | None] = [None] * lora.num_slots
        self._refs: list[int] = [0] * lora.num_slots
        self._slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(lora.num_slots))
        self._pinned: set[str] = set()
        # names loaded on demand from the catalog: forgotten once their revision leaves the host cache (the
        # catalog can name them again), so a sweep through a million addresses keeps memory bounded
        self._ephemeral: set[str] = set()
        self._held: Counter[str] = Counter()  # ephemeral names a caller is about to use: not forgotten yet
        self.stats = WorkingSetStats()

    # ---- names and revisions ------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        weights: AdapterWeights,
        source: Path | None = None,
        replace: bool = False,
        ephemeral: bool = False,
        hold: bool = False,
    ) -> bool:
        """Register `weights` under `name`. Returns False if `name` already is this revision.

        With `replace`, an existing name moves to the new revision (in-place load); without, it is AdapterExists,
        raised before anything changes.
        An `ephemeral` name (a catalog address loaded on demand) is forgotten when its revision leaves the host
        cache; `hold` keeps it until `unhold` (taken atomically with the add, so it cannot vanish in between).
        """
        if weights.digest is None:
            raise ValueError(f"adapter {name!r} has no digest")
        with self._lock:
            current = self._names.get(name)
            if current is not None and current != weights.digest and not replace:
                raise AdapterExists(
                    f"adapter {name!r} is already loaded (revision {current[:12]}); use replace"
                )
            if hold:
                self._held[name] += 1
            if ephemeral and name not in self._names:
                self._ephemeral.add(name)
            elif not ephemeral:
                self._ephemeral.discard(name)
            if current == weights.digest:
                self._touch_host(current)
                return False
            rev = self._revs.get(weights.digest)
            if rev is None:
                rev = self._revs[weights.digest] = _Revision(weights.digest, self._prepared(weights), source)
            elif rev.weights is None:
                rev.weights = self._prepared(weights)
            rev.names.add(name)
            self._touch_host(weights.digest)
            self._names[name] = weights.digest
            if current is not None:
                self._detach(name, current)
            self._shrink_host()
            return True

    def _prepared(self, weights: AdapterWeights) -> Prepared:
        """The revision in slot layout: as the read prepared it (`Engine.read_adapter`, for these banks), or
        prepared now."""
        banks, prepared = self.lora.banks, weights.prepared
        if prepared is not None and all(
            n in banks and A.dtype == banks[n].A.dtype for n, (A, _) in prepared.items()
        ):
            return prepared
        return self.lora.prepare(weights.tensors, weights.scale)

    def remove(self, name: str) -> bool:
        """Forget `name`; its slot is freed now, or when the last request using it ends. False if unknown."""
        with self._lock:
            digest = self._names.pop(name, None)
            if digest is None:
                return False
            self._pinned.discard(name)
            self._ephemeral.discard(name)
            self._detach(name, digest)
            return True

    def _detach(self, name: str, digest: str) -> None:
        rev = self._revs[digest]
        rev.names.discard(name)
        if rev.names:
            return
        slot = self._slot_of.get(digest)
        if slot is not None and self._refs[slot] > 0:
            return  # still running: the last release frees the slot and forgets the revision
        if slot is not None:
            self._free(slot)
        self._revs.pop(digest)
        self._host.pop(digest, None)

    def names(self) -> dict[str, str]:
        with self._lock:
            return dict(self._names)

    def get(self, name: str) -> str | None:
        """The digest `name` serves now, or None (cheaper than `names()` when there are many)."""
        with self._lock:
            return self._names.get(name)

    def is_ephemeral(self, name: str) -> bool:
        with self._lock:
            return name in self._ephemeral

    def digest_of(self, name: str) -> str:
        with self._lock:
            if name not in self._names:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded")
            return self._names[name]

    def revision_in(self, slot: int) -> str | None:
        """Digest of the revision a slot holds (what a request holding that slot is served by)."""
        with self._lock:
            return self._owner[slot]

    def hold(self, name: str) -> bool:
        """Keep an ephemeral `name` from being forgotten until `unhold`; False if it is not loaded."""
        with self._lock:
            if name not in self._names:
                return False
            self._held[name] += 1
            return True

    def unhold(self, name: str) -> None:
        with self._lock:
            if self._held[name] <= 1:
                self._held.pop(name, None)
            else:
                self._held[name] -= 1

    def pin(self, name: str) -> int:
        """Keep `name` in a device slot until unpinned (champions stay resident)."""
        with self._lock:
            slot = self.acquire(name)
            self._pinned.add(name)
            self.release(slot)
            return slot

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pinned.discard(name)

    # ---- slots --------------------------------------------------------------------------------------------

    def acquire(self, name: str) -> int:
        """The slot holding `name`'s current revision, loading it if needed; counts a reference."""
        with self._lock:
            if name not in self._names:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded")
            digest = self._names[name]
            slot = self._slot_of.get(digest)
            if slot is not None:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                weights = self._host_weights(digest, name)
                slot = self._take_slot(name)
                self.lora.write_prepared(slot, weights)
                self._slot_of[digest] = slot
                self._owner[slot] = digest
            self._refs[slot] += 1
            self._slot_lru.move_to_end(slot)
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            if self._refs[slot] <= 0:
                raise RuntimeError(f"slot {slot} released more often than acquired")
            self._refs[slot] -= 1
            owner = self._owner[slot]
            if self._refs[slot] == 0 and owner is not None and not self._revs[owner].names:
                self._free(slot)
                self._revs.pop(owner, None)
                self._host.pop(owner, None)

    def _take_slot(self, for_name: str) -> int:
        for slot in self._slot_lru:  # LRU first; empty slots are never touched, so they come first too
            if self._owner[slot] is None:
                return slot
        for slot in self._slot_lru:
            owner = self._owner[slot]
            assert owner is not None
            if self._refs[slot] == 0 and not (self._revs[owner].names & self._pinned):
                logger.debug("evicting %s from slot %d for %s", owner[:12], slot, for_name)
                self.stats.evictions += 1
                self._free(slot, clear=False)  # the caller writes every bank of it next
                self._shrink_host()  # an on-demand revision kept only for its slot may go now
                return slot
        raise WorkingSetFull(
            f"cannot place {for_name!r}: all {self.lora.num_slots} device slots are pinned or in use by running requests"
        )

    def _free(self, slot: int, clear: bool = True) -> None:
        owner = self._owner[slot]
        if owner is not None:
            self._slot_of.pop(owner, None)
        self._owner[slot] = None
        if clear:
            self.lora.clear_slot(slot)

    # ---- host cache ---------------------------------------------------------------------------------------

    def _touch_host(self, digest: str) -> None:
        self._host[digest] = None
        self._host.move_to_end(digest)

    def _host_weights(self, digest: str, name: str) -> Prepared:
        rev = self._revs[digest]
        weights = rev.weights
        if weights is None:
            if rev.source is None or self._reload is None:
                raise UnknownAdapter(f"adapter {name!r} left the host cache and has no source to reload from")
            self.stats.cold_loads += 1
            read = self._reload(name, rev.source)
            if read.digest != digest:
                raise ValueError(
                    f"adapter {name!r} at {rev.source} changed on disk: digest {read.digest} != {digest}"
                )
            weights = rev.weights = self._prepared(read)
        self._touch_host(digest)
        # may drop this very revision again (when the rest of the cache cannot leave), so return the local
        self._shrink_host()
        return weights

    def _shrink_host(self) -> None:
        # Only revisions that can be reloaded from a source leave host memory; the rest stay (trainer handoffs).
        excess = len(self._host) - self.max_cpu_loras
        if excess <= 0:
            return
        victims: list[tuple[str, bool]] = []  # (digest, forget it entirely)
        for digest in self._host:  # LRU first; stops as soon as enough are found
            if len(victims) == excess:
                break
            rev = self._revs[digest]
            if rev.names & self._pinned or any(self._held[n] for n in rev.names):
                continue
            if rev.names and rev.names <= self._ephemeral:
                if digest not in self._slot_of:  # in a device slot: forgotten when the slot is evicted
                    victims.append((digest, True))
            elif rev.source is not None:
                victims.append((digest, False))
        for digest, forget in victims:
            rev = self._revs[digest]
            if forget:
                for n in rev.names:
                    self._names.pop(n, None)
                    self._ephemeral.discard(n)
                self._revs.pop(digest)
            else:
                rev.weights = None
            del self._host[digest]
            self.stats.host_evictions += 1

    # ---- introspection ------------------------------------------------------------------------------------

    def slot_table(self) -> list[tuple[int, str | None, int]]:
        """(slot, digest or None, reference count) for every slot."""
        with self._lock:
            return [(i, self._owner[i], self._refs[i]) for i in range(self.lora.num_slots)]

    def slots_in_use(self) -> int:
        with self._lock:
            return sum(o is not None for o in self._owner)

    def host_size(self) -> int:
        with self._lock:
            return len(self._host)
