"""Large host buffers for the adapter load path, handed out again once nothing refers to them.

An adapter load needs two buffers the size of the revision: the weights file read into memory, and the revision
in slot layout for the host cache. Fresh memory of that size is mapped anew by malloc every time, and the
kernel faults in and zeroes every page on first touch: ~8,000 faults for a 33 MB revision (Qwen3-4B, rank 8,
bf16), 5-15 ms of one core, more than the copies into the buffer. So the most recent few buffers are remembered,
and a request of about the same size takes one back when nothing else refers to it any more: no tensor, view,
memoryview or slice of it is alive (each holds a reference to the numpy array that owns the memory, so the
array's reference count says so exactly). A buffer still in use is never handed out twice.

What it costs: up to `KEEP` buffers no longer in use stay allocated until they are taken again or pushed out by
newer ones.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

MIN_BYTES = 1 << 20
"""Smaller requests are plain allocations: malloc reuses small blocks on its own."""
KEEP = 4
"""Buffers remembered: a load's read buffer and host copy, twice over (two loads in flight, or a read buffer
that its caller's AdapterWeights still holds)."""
SLACK = 8
"""A buffer is taken for a request of at least 1 - 1/SLACK of its size (7/8): revisions of one shape and rank
differ only in their header's few bytes, and a much larger buffer would pin memory the request does not use."""

_lock = threading.Lock()
_recent: list[np.ndarray] = []  # least recently taken first
# references to an array held only by `_recent`, seen from inside `take`: the list, `buf` and getrefcount's
# own argument
_UNUSED_REFS = 3


def take(nbytes: int) -> np.ndarray:
    """`nbytes` of writable host memory (uint8, contents undefined): a remembered buffer that nothing refers
    to any more when one fits, else a new one."""
    if nbytes < MIN_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    with _lock:
        for i in range(len(_recent)):
            buf = _recent[i]
            if (
                nbytes <= buf.nbytes <= nbytes + nbytes // (SLACK - 1)
                and sys.getrefcount(buf) == _UNUSED_REFS
            ):
                _recent.append(_recent.pop(i))
                return buf[:nbytes]
        buf = np.empty(nbytes, dtype=np.uint8)
        _recent.append(buf)
        if len(_recent) > KEEP:
            _recent.pop(0)
        return buf[:nbytes]
