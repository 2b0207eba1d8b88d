"""What a process of mint's own (the `mint` command, a flow run) does at exit.

A process that imported torch and transformers holds hundreds of thousands of objects in its modules. At exit,
after the atexit handlers have run (flushes, saves, logging's), the interpreter tears the modules down and the
garbage collector passes over all of them: over a second of every such process's exit (`mint serve` took 2 s to
stop, 0.2 s of it its own shutdown), which the process is about to drop anyway. Frozen, the collector skips them.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def freeze_at_exit() -> None:
    """Freeze every object once the atexit handlers registered after this call have run; registered once per
    process, by entry points only (a library that imports mint keeps its own exit as it was)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
