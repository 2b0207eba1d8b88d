"""The catalog's champions, as `GET /v1/models` lists them on both backends from the server's first second.

A request naming a policy is served its `champion` on demand (the catalog resolves it), whether or not anything
loaded it first, so the listing names every such policy too: the names a server holds (with the `revision` each
serves now) and beside them each policy whose champion resolves and that the server does not hold yet (its `root`
the champion's `sha256:<hex>`, and no `revision`: nothing is held under that name until a request or a load puts
it there; reconcile and promote read a missing `revision` as "not served here" and load the champion).

The listing may be polled, so the catalog is read at most once per `CHAMPIONS_TTL_S`, and at once after an admin
load or unload (`invalidate`): promote, rollback and reconcile all end with one. Each champion's card is rendered to
JSON once per read, off the event loop, so a listing joins bytes (`model_list`). OpenAI's list has no paging, so at
most `CHAMPIONS_LISTED_MAX` champions are listed (by policy name); past that a warning says so, and every champion
is still served on demand by its name.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Generic, TypeVar

from fastapi.responses import Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from mint_core.errors import MintError
from mint_core.registry.catalog import Catalog

logger = logging.getLogger(__name__)
T = TypeVar("T")

CHAMPIONS_TTL_S = 5.0
"""How long a read of the catalog's champions is listed (an alias moved with no load reaching this server, say in
another process's catalog write); the on-demand loader re-resolves a policy's champion as often."""

CHAMPIONS_LISTED_MAX = 10_000
"""The most champions one listing names (about 1.5 MB of JSON); a larger catalog is still served, name by name."""


class ChampionListing(Generic[T]):
    """Policy -> `render(policy, hex digest)` of its champion, by policy name, for at most `limit` policies; read
    off the catalog again after `ttl_s` or an `invalidate`, one read at a time however many listings ask."""

    def __init__(
        self,
        catalog: Catalog | None,
        render: Callable[[str, str], T],
        ttl_s: float = CHAMPIONS_TTL_S,
        limit: int = CHAMPIONS_LISTED_MAX,
    ):
        self.catalog = catalog
        self.render = render
        self.ttl_s = ttl_s
        self.limit = limit
        self._champions: dict[str, T] = {}
        self._read_at = -math.inf
        self._generation = 0  # bumped by invalidate; a read is current while it matches the one it started at
        self._read_generation = -1
        self._truncated = False
        self._reading = asyncio.Lock()

    def invalidate(self) -> None:
        """The served names or the catalog's aliases changed: the next listing reads the catalog again."""
        self._generation += 1

    def _current(self) -> bool:
        return self._read_generation == self._generation and time.monotonic() - self._read_at < self.ttl_s

    async def get(self) -> dict[str, T]:
        if self.catalog is None:
            return {}
        if self._current():
            return self._champions
        async with self._reading:
            if not self._current():  # else another listing read it while this one waited
                await self._read(self.catalog)
        return self._champions

    async def _read(self, catalog: Catalog) -> None:
        generation, t0 = self._generation, time.monotonic()
        try:
            rows = await run_in_threadpool(catalog.champions, self.limit + 1)
        except (SQLAlchemyError, MintError, OSError) as e:
            # the names the server holds are listed still; the last champions read stand until the next try
            logger.warning("listing the catalog's champions failed (%s: %s)", type(e).__name__, e)
            self._read_at, self._read_generation = t0, generation
            return
        truncated = len(rows) > self.limit
        if truncated and not self._truncated:
            logger.warning(
                "the catalog has more than %d champions: /v1/models lists the first %d by name (every one is "
                "still served on demand)",
                self.limit,
                self.limit,
            )
        self._truncated = truncated
        render = self.render
        self._champions = await run_in_threadpool(
            lambda: {policy: render(policy, str(digest)) for policy, digest in sorted(rows[: self.limit])}
        )
        self._read_at, self._read_generation = t0, generation


def by_name(held: dict[str, T], champions: dict[str, T], hidden: Collection[str] = ()) -> Iterator[T]:
    """The cards of both, by name (`champions` is in name order already); a name held is listed as held, and a
    champion named as one of `hidden` (the base's own names) not at all."""
    rest = (c for c in champions if c not in held and c not in hidden)
    for name in heapq.merge(sorted(held), rest):
        yield held[name] if name in held else champions[name]


def model_list(cards: Iterable[bytes]) -> Response:
    """OpenAI's model list of cards already in JSON."""
    return Response(b'{"object":"list","data":[' + b",".join(cards) + b"]}", media_type="application/json")
