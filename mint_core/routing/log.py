"""The route log: one JSON line per routed request, and one per reward when it comes, joined by request id.

Why a log and not only the router's state: off-policy evaluation (ope.py) and fitting (fit.py) need what the
serving router did, with the probability it gave its choice, and what came of it. A router's state cannot be
replayed; the log can, against any candidate router.

Format: JSON Lines, append-only, two kinds of line: `{"kind": "decision", ...RouteRecord}` and
`{"kind": "reward", "rid", "reward", "source", "t"}`. A reward arrives later than its decision (the task's
scoring after the answer, or a user's `POST /v1/feedback`), so it is a line of its own rather than an edit:
appends never rewrite what a reader may be reading. `records()` joins them (the latest reward for a rid wins).

Safety: appends from the threads of one process go through a lock, each line written with one `write` on a file
opened in append mode (so a second process appending too does not interleave within a line on a local
filesystem). When the file passes `max_bytes` it is rotated (`log.jsonl` -> `log.jsonl.1` -> ... up to `keep`
files); `records()` reads the rotated files oldest first. A line that does not parse (a torn write after a
crash, a hand edit) is skipped and counted (`skipped`), with one warning per read, never an exception: one bad
line must not lose a night's fit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError

logger = logging.getLogger(__name__)

LOG_NAME = "routing/log.jsonl"
"""Where the route log lives under a state dir."""
ROTATE_BYTES = 64 * 1024 * 1024
"""Size past which the log rotates."""
ROTATE_KEEP = 8
"""Rotated files kept (the oldest is dropped)."""

RewardSource = Literal["task", "feedback"]


class RouteRecord(BaseModel):
    """One routed request: what the router saw and chose, with what probability, and the reward when it came."""

    rid: str = Field(min_length=1, description="the request's id (the response id callers send feedback for)")
    t: float = Field(description="unix time of the decision")
    router_revision: str = Field(description="revision of the router that decided ('' for an unsaved one)")
    features_digest: str = Field(description="Featurizer.digest of the features")
    features: dict[str, Any] | list[float] = Field(
        description='the features: sparse {"i": [indices], "v": [values], "n": dim} or a dense list'
    )
    candidates: list[str] = Field(min_length=1, description="the served names the router could choose from")
    choice: str = Field(description="the served name chosen")
    prob: float = Field(gt=0, le=1, description="the probability the router gave its choice (propensity)")
    explored: bool = Field(description="True when the choice was not the router's greedy one")
    revision: str = Field(default="", description="the adapter revision that answered")
    reward: float | None = Field(
        default=None, ge=0, le=1, description="the reward in [0, 1], None until one came"
    )
    reward_source: RewardSource | None = Field(
        default=None, description="who scored it: the task, or feedback"
    )

    def vector(self, dim: int) -> np.ndarray:
        """The features as a dense float32 vector of `dim`; ValueError when they were logged for another dim."""
        if isinstance(self.features, list):
            if len(self.features) != dim:
                raise ValueError(
                    f"record {self.rid}: {len(self.features)} features logged, router takes {dim}"
                )
            return np.asarray(self.features, dtype=np.float32)
        n = int(self.features.get("n", dim))
        if n != dim:
            raise ValueError(f"record {self.rid}: features logged with dim {n}, router takes {dim}")
        i = np.asarray(self.features.get("i", []), dtype=np.int64)
        v = np.asarray(self.features.get("v", []), dtype=np.float32)
        if i.shape != v.shape or (len(i) and (i.min() < 0 or i.max() >= dim)):
            raise ValueError(f"record {self.rid}: sparse features do not fit dim {dim}")
        out = np.zeros(dim, dtype=np.float32)
        out[i] = v
        return out


def sparse_features(x: np.ndarray) -> dict[str, Any]:
    """A feature vector as the log keeps it: its nonzero indices and values, and its dim (hashed n-gram vectors
    of short prompts are mostly zeros, so this is a fraction of the dense list)."""
    x = np.asarray(x, dtype=np.float32)
    i = np.flatnonzero(x)
    return {"i": i.tolist(), "v": [float(v) for v in x[i]], "n": int(x.shape[0])}


class RouteLog:
    """Append-only JSONL of decisions and rewards at `path` (default `<state dir>/routing/log.jsonl`)."""

    def __init__(self, path: Path, *, max_bytes: int = ROTATE_BYTES, keep: int = ROTATE_KEEP) -> None:
        if max_bytes < 1 or keep < 1:
            raise ValueError(f"max_bytes ({max_bytes}) and keep ({keep}) must be >= 1")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.skipped = 0
        self._lock = threading.Lock()

    def decided(self, rec: RouteRecord) -> None:
        """Append one decision (its reward, if the record already holds one, is kept with it)."""
        self._append({"kind": "decision", **rec.model_dump()})

    def rewarded(self, rid: str, reward: float, source: str) -> None:
        """Append the reward for request `rid`; ValueError (nothing written) for a reward outside [0, 1] or an
        unknown source."""
        reward = float(reward)
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"reward {reward} for {rid} is outside [0, 1]")
        if source not in ("task", "feedback"):
            raise ValueError(f"reward source {source!r} is not 'task' or 'feedback'")
        self._append({"kind": "reward", "rid": rid, "reward": reward, "source": source, "t": time.time()})

    def _append(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)

    def _rotate(self) -> None:
        """log -> log.1 -> log.2 ...; the one past `keep` is dropped."""
        self._numbered(self.keep).unlink(missing_ok=True)
        for k in range(self.keep - 1, 0, -1):
            if self._numbered(k).exists():
                self._numbered(k).rename(self._numbered(k + 1))
        self.path.rename(self._numbered(1))

    def _numbered(self, k: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{k}")

    def files(self) -> list[Path]:
        """The log's files, oldest first."""
        older = [self._numbered(k) for k in range(self.keep, 0, -1) if self._numbered(k).exists()]
        return older + ([self.path] if self.path.exists() else [])

    def records(self) -> list[RouteRecord]:
        """Every decision in order, each joined with its latest reward (None if none came). Malformed lines and
        rewards for unknown requests are skipped and counted in `skipped`."""
        decisions: dict[str, RouteRecord] = {}
        rewards: dict[str, tuple[float, str]] = {}
        bad = 0
        for file in self.files():
            with open(file, encoding="utf-8", errors="replace") as f:
                for line in f:
                    bad += not self._read_line(line, decisions, rewards)
        orphans = sorted(set(rewards) - set(decisions))
        for rid, (reward, source) in rewards.items():
            if rid in decisions:
                decisions[rid] = decisions[rid].model_copy(update={"reward": reward, "reward_source": source})
        self.skipped = bad + len(orphans)
        if self.skipped:
            logger.warning(
                "route log %s: skipped %d malformed line(s) and %d reward(s) for unknown requests",
                self.path, bad, len(orphans),
            )  # fmt: skip
        return list(decisions.values())

    @staticmethod
    def _read_line(
        line: str, decisions: dict[str, RouteRecord], rewards: dict[str, tuple[float, str]]
    ) -> bool:
        if not line.strip():
            return True
        try:
            obj = json.loads(line)
            kind = obj.pop("kind")
            if kind == "decision":
                rec = RouteRecord.model_validate(obj)
                decisions[rec.rid] = rec
                return True
            if (
                kind == "reward"
                and 0.0 <= float(obj["reward"]) <= 1.0
                and obj["source"] in ("task", "feedback")
            ):
                rewards[str(obj["rid"])] = (float(obj["reward"]), obj["source"])
                return True
        except (json.JSONDecodeError, ValidationError, KeyError, TypeError, ValueError, AttributeError):
            pass
        return False
