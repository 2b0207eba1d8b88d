"""A readers-writer lock for the front of a vLLM server: requests under a name read, an in-place swap of it writes
(serving/gateway.py); the golden probe takes the same locks (serving/golden.py).

The front holds two kinds: one for vLLM's batch (`Gateway.batch`: requests read, a golden probe that must run
alone writes) and one per served name. Whoever needs both takes the batch's first: a load that held a name and then
waited for the batch behind a probe that runs alone, while that probe waited for the name, would wait forever
(`Gateway.load`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class SwapLock:
    """Requests under one name read; an in-place swap of that name writes. A waiting swap goes first, so a busy
    name cannot starve it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writing = True

    async def release_write(self) -> None:
        async with self._cond:
            self._writing = False
            self._cond.notify_all()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        await self.acquire_read()
        try:
            yield
        finally:
            await self.release_read()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        await self.acquire_write()
        try:
            yield
        finally:
            await self.release_write()
