"""The engine loop: one thread that owns the batcher, admitting queued requests between decode steps.

Callers (HTTP handlers) submit requests from any thread; each gets a Sequence whose `on_event` is called from
this thread after every token and at the end. A request whose adapter cannot get a slot right now (all slots
held by running requests) waits in the queue, in order, until a slot frees.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from mint_core.engine.batcher import Batcher
from mint_core.engine.engine import Engine
from mint_core.engine.sequence import Request, Sequence
from mint_core.errors import MintError, UnknownAdapter, WorkingSetFull

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, max_num_seqs: int = 64):
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.batcher = Batcher(engine)
        self._waiting: deque[Sequence] = deque()
        self._admitting: list[Sequence] = []  # out of the queue, being prefilled into the batch
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mint-engine-loop", daemon=True)
        self.steps = 0

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish what is queued and running, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- requests -----------------------------------------------------------------------------------------

    def submit(
        self, request: Request, on_event: Callable[[Sequence], None] | None = None, held: str | None = None
    ) -> Sequence:
        """Queue a request; raises RequestError / UnknownAdapter at once for what can never be served. `held`:
        an adapter name the caller holds for this request, given back at admission (or cancel)."""
        seq = self.engine.new_sequence(request, on_event)
        seq.held = held
        with self._cv:
            if self._stopping:
                raise MintError("the server is shutting down")
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        with self._cv:
            if seq in self._waiting:
                self._waiting.remove(seq)
                self._unhold(seq)
                seq.finish_reason = "abort"
                if seq.on_event is not None:
                    seq.on_event(seq)

    def in_flight(self) -> tuple[list[Sequence], list[Sequence]]:
        """(running, waiting) sequences, for metrics. A sequence that finished in the step under way no longer
        counts as running, though the batcher drops it only at the end of that step (its client may already have
        its answer). Safe from any thread: each list is copied whole, so a step cannot tear it."""
        with self._cv:
            seqs, waiting = [*self._admitting, *self.batcher.seqs], list(self._waiting)
        running = {s.id: s for s in seqs if not s.finished}  # once each: admission ends in both lists
        return list(running.values()), waiting

    # ---- the loop -----------------------------------------------------------------------------------------

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        with self._cv:
            while self._waiting and len(self.batcher) + len(admitted) < self.max_num_seqs:
                seq = self._waiting[0]
                try:
                    try:
                        self.engine.acquire_slot(seq)
                    finally:
                        self._unhold(seq)
                except WorkingSetFull as e:
                    if len(self.batcher) or admitted:
                        break  # a running request will release a slot
                    self._waiting.popleft()  # nothing running: every slot is pinned, waiting would be forever
                    self._fail(seq, e)
                    continue
                except UnknownAdapter as e:  # unloaded while it waited
                    self._waiting.popleft()
                    self._fail(seq, e)
                    continue
                self._waiting.popleft()
                admitted.append(seq)
            self._admitting = admitted
        return admitted

    def _unhold(self, seq: Sequence) -> None:
        if seq.held is not None:
            self.engine.working_set.unhold(seq.held)
            seq.held = None

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        seq.error, seq.finish_reason = error, "abort"
        if seq.on_event is not None:
            seq.on_event(seq)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not len(self.batcher) and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._waiting and not len(self.batcher):
                    return
            new = self._admit()
            if new:
                try:
                    self.batcher.admit(new)
                except Exception as e:  # a bad batch must not take the server down
                    logger.exception("prefill failed")
                    for s in new:
                        if s.slot >= 0:
                            self.engine.working_set.release(s.slot)
                            s.slot = -2
                        self._fail(s, e)
                finally:
                    with self._cv:
                        self._admitting = []
            if len(self.batcher):
                try:
                    self.batcher.step()
                    self.steps += 1
                except Exception as e:
                    logger.exception("decode step failed; aborting the running batch")
                    self.batcher.abort_all(e)
