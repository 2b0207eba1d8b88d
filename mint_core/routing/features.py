"""What the router sees of a request: a fixed-size vector computed from the prompt alone.

Why hashed n-grams: they need no model (the router decides before any adapter or the base runs, in well under
a millisecond), no vocabulary to fit and ship (a router revision stays a few arrays), and they carry what
separates tasks in practice: the words, the digits and operators, the formatting of a prompt. A wording the
router never saw still shares most of its character n-grams with the task's other prompts, which word
features do not (the benchmark measures both: `kind="char"` and `kind="word"`). Single characters and pairs
count too, weighed down (GRAM_WEIGHTS): they say what kind of text a prompt is (digits, operators, letters,
punctuation) whatever its words, but at full weight they would make any two prompts alike.

Deterministic across machines and processes: every n-gram is hashed with CRC-32 of its UTF-8 bytes, never with
Python's `hash()` (salted per process), so a router fitted on one machine scores the same prompt the same way
on another. The top bit of the hash signs the count (the "hashing trick" of Weinberger et al.), so collisions
cancel in expectation instead of piling up. The vector is L2-normalized: a long prompt and a short one of the
same task point the same way, and the linear models above see inputs of one scale.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import zlib
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

FEATURE_DIM = 256
"""Hashed feature dimensions: small enough that a per-arm covariance (dim x dim) is cheap to keep and invert,
large enough that the built-in tasks' prompts land far apart."""
NGRAMS: tuple[int, int] = (1, 5)
"""Character n-gram lengths, inclusive, of a new featurizer (a saved router keeps the lengths and weights it was
fitted with: they are in its config; routers saved before these defaults have (3, 5) and no weights)."""
GRAM_WEIGHTS: tuple[tuple[int, float], ...] = ((1, 0.3), (2, 0.6))
"""(length, weight) of character n-grams that count less than 1 in a new featurizer; lengths not listed count 1.
Measured on the routing benchmark's table (docs/routing.md): (1, 5) with these weights in place of (3, 5)
raised the offline router's share of the task oracle on each of 11 seeds (worst seed of 0-2 90.1% -> 91.5%),
online within the seeds' spread; at full weight, 1-grams made unrelated prompts' vectors about 0.3 alike (cosine)
where 3-5 grams give about 0.03, these weights about 0.06."""
MAX_CHARS = 4000
"""Only the first this many characters of a prompt are featurized: bounds the time a huge prompt costs."""
COUNTED_CHARS = 256
"""A prompt this long or longer has its 1- and 2-grams counted in numpy, not hashed one by one (same vector, up
to float rounding of the weighted counts' sums: the choice depends on the prompt alone, so it is the same on
every machine); a shorter one is faster hashed one by one."""
FEATURIZER_VERSION = 1
"""Bumped whenever the same config would map a prompt to a different vector; a saved router records it."""

Kind = Literal["char", "word"]
_SPACES = re.compile(r"\s+")
_WORDS = re.compile(r"\w+")


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    """What is featurized: a completion prompt as is, a chat's messages' contents joined by newlines (roles and
    a system prompt are part of the content a caller sends, so they count too)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict))
    raise TypeError(f"a prompt is a string or a list of chat messages, not {type(prompt).__name__}")


def _normalized(text: str) -> str:
    """What a featurizer reads of a prompt's text: its first MAX_CHARS characters, lower-cased, runs of white space
    made one space, trimmed."""
    return _SPACES.sub(" ", text[:MAX_CHARS].lower()).strip()


class Featurizer:
    """prompt -> dense float32 vector of `dim` values, L2-normalized (all zeros for an empty prompt).

    `gram_weights`: (length, weight) pairs, each character n-gram of that length counting `weight` (> 0) instead
    of 1; only lengths inside `ngrams` and weights other than 1 are kept (a word featurizer keeps none), so a
    featurizer whose weights change nothing has the config it had before weights existed."""

    def __init__(
        self,
        dim: int = FEATURE_DIM,
        ngrams: tuple[int, int] = NGRAMS,
        kind: Kind = "char",
        gram_weights: Iterable[tuple[int, float]] = GRAM_WEIGHTS,
    ) -> None:
        if dim < 8:
            raise ValueError(f"feature dim must be at least 8, got {dim}")
        lo, hi = int(ngrams[0]), int(ngrams[1])
        if not 1 <= lo <= hi <= 16:
            raise ValueError(f"ngrams must be (lo, hi) with 1 <= lo <= hi <= 16, got {ngrams}")
        if kind not in ("char", "word"):
            raise ValueError(f"featurizer kind must be 'char' or 'word', got {kind!r}")
        self.dim = int(dim)
        self.ngrams = (lo, hi)
        self.kind: Kind = kind
        weights: dict[int, float] = {}
        for n, w in gram_weights:
            if not (np.isfinite(w) and w > 0):
                raise ValueError(f"gram weight of length {n} must be finite and > 0, got {w}")
            if kind == "char" and lo <= int(n) <= hi and float(w) != 1.0:
                weights[int(n)] = float(w)
        self.gram_weights: tuple[tuple[int, float], ...] = tuple(sorted(weights.items()))
        self._length_weight = np.ones(hi + 1)
        for n, w in self.gram_weights:
            self._length_weight[n] = w

    def config(self) -> dict[str, Any]:
        """Everything that decides the mapping; saved with a router, and a load refuses a mismatch."""
        config: dict[str, Any] = {
            "kind": self.kind,
            "dim": self.dim,
            "ngrams": list(self.ngrams),
            "version": FEATURIZER_VERSION,
        }
        if self.gram_weights:  # absent when every gram counts 1: the config of a router saved before weights
            config["gram_weights"] = [[n, w] for n, w in self.gram_weights]
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Featurizer:
        """The featurizer a saved config names; ValueError when it is not one this code computes."""
        if config.get("version") != FEATURIZER_VERSION:
            raise ValueError(
                f"featurizer version {config.get('version')!r} (this code computes {FEATURIZER_VERSION})"
            )
        ngrams = config.get("ngrams")
        if not isinstance(ngrams, list) or len(ngrams) != 2:
            raise ValueError(f"featurizer ngrams {ngrams!r} is not a pair")
        weights = config.get("gram_weights", [])  # none saved: every gram counts 1, as before weights existed
        if not isinstance(weights, list) or not all(isinstance(p, list) and len(p) == 2 for p in weights):
            raise ValueError(f"featurizer gram_weights {weights!r} is not a list of (length, weight) pairs")
        return cls(
            dim=int(config["dim"]),
            ngrams=(int(ngrams[0]), int(ngrams[1])),
            kind=config.get("kind", "char"),
            gram_weights=[(int(n), float(w)) for n, w in weights],
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Featurizer) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash((self.kind, self.dim, self.ngrams, self.gram_weights))

    def __repr__(self) -> str:
        return (
            f"Featurizer(dim={self.dim}, ngrams={self.ngrams}, kind={self.kind!r}, "
            f"gram_weights={self.gram_weights})"
        )

    def _grams(self, text: str) -> list[bytes]:
        """The hashed units of a normalized text (`_normalized`): character n-grams of the padded text (bytes of
        its UTF-8), or words and word pairs."""
        if self.kind == "word":
            words = [w.encode() for w in _WORDS.findall(text)]
            return words + [a + b" " + b for a, b in itertools.pairwise(words)]
        if not text:
            return []  # an empty prompt has no features, whatever the n-gram lengths (not the padding's spaces)
        data = f" {text} ".encode()
        lo, hi = self.ngrams
        start = lo if len(text) < COUNTED_CHARS else max(lo, 3)  # else `_short_grams` has the 1- and 2-grams
        return [data[i : i + n] for n in range(start, hi + 1) for i in range(len(data) - n + 1)]

    def _short_grams(self, text: str) -> tuple[list[bytes], np.ndarray]:
        """A normalized text of COUNTED_CHARS or more: its character 1- and 2-grams, each distinct one once with its count
        (`_grams` leaves them out). There are few distinct ones, so counting them in numpy keeps a long prompt's
        cost near that of its 3-5 grams alone."""
        lo = self.ngrams[0]
        if self.kind == "word" or lo > 2 or len(text) < COUNTED_CHARS:
            return [], np.zeros(0)
        data = np.frombuffer(f" {text} ".encode(), dtype=np.uint8).astype(np.uint64)
        grams: list[bytes] = []
        counts: list[np.ndarray] = []
        for n in range(lo, min(self.ngrams[1], 2) + 1):
            keys = data if n == 1 else data[:-1] << np.uint64(8) | data[1:]
            uniq, count = np.unique(keys, return_counts=True)
            grams += [int(k).to_bytes(n, "big") for k in uniq]
            counts.append(count)
        return grams, np.concatenate(counts).astype(np.float64)

    def transform(self, prompt: str | list[dict[str, str]]) -> np.ndarray:
        """The prompt's feature vector, shape (dim,), float32."""
        text = _normalized(prompt_text(prompt))
        short, count = self._short_grams(text)
        grams = short + self._grams(text)
        out = np.zeros(self.dim, dtype=np.float32)
        if not grams:
            return out
        h = np.fromiter(map(zlib.crc32, grams), dtype=np.uint64, count=len(grams))
        sign = np.where(h >> np.uint64(31) & np.uint64(1), 1.0, -1.0)
        sign[: len(short)] *= count
        if self.gram_weights:
            sign *= self._length_weight[np.fromiter(map(len, grams), dtype=np.int64, count=len(grams))]
        counts = np.bincount((h % np.uint64(self.dim)).astype(np.int64), weights=sign, minlength=self.dim)
        norm = float(np.linalg.norm(counts))
        if norm > 0:
            out[:] = counts / norm
        return out

    def transform_many(self, prompts: list[str | list[dict[str, str]]] | tuple) -> np.ndarray:
        """Feature vectors of several prompts, shape (n, dim)."""
        out = np.zeros((len(prompts), self.dim), dtype=np.float32)
        for i, p in enumerate(prompts):
            out[i] = self.transform(p)
        return out

    def digest(self, x: np.ndarray) -> str:
        """A short hex digest of a feature vector (its float32 bytes), for the log: equal vectors, equal digests."""
        return hashlib.sha256(np.ascontiguousarray(x, dtype=np.float32).tobytes()).hexdigest()[:16]
