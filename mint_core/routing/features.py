"""What the router sees of a request: a fixed-size vector computed from the prompt alone.

Why hashed n-grams: they need no model (the router decides before any adapter or the base runs, in well under
a millisecond), no vocabulary to fit and ship (a router revision stays a few arrays), and they carry what
separates tasks in practice: the words, the digits and operators, the formatting of a prompt. A wording the
router never saw still shares most of its character 3-5 grams with the task's other prompts, which word
features do not (the benchmark measures both: `kind="char"` and `kind="word"`).

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
from typing import Any, Literal

import numpy as np

FEATURE_DIM = 256
"""Hashed feature dimensions: small enough that a per-arm covariance (dim x dim) is cheap to keep and invert,
large enough that the built-in tasks' prompts land far apart."""
NGRAMS: tuple[int, int] = (3, 5)
"""Character n-gram lengths, inclusive."""
MAX_CHARS = 4000
"""Only the first this many characters of a prompt are featurized: bounds the time a huge prompt costs."""
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


class Featurizer:
    """prompt -> dense float32 vector of `dim` values, L2-normalized (all zeros for an empty prompt)."""

    def __init__(self, dim: int = FEATURE_DIM, ngrams: tuple[int, int] = NGRAMS, kind: Kind = "char") -> None:
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

    def config(self) -> dict[str, Any]:
        """Everything that decides the mapping; saved with a router, and a load refuses a mismatch."""
        return {
            "kind": self.kind,
            "dim": self.dim,
            "ngrams": list(self.ngrams),
            "version": FEATURIZER_VERSION,
        }

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
        return cls(
            dim=int(config["dim"]), ngrams=(int(ngrams[0]), int(ngrams[1])), kind=config.get("kind", "char")
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Featurizer) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash((self.kind, self.dim, self.ngrams))

    def __repr__(self) -> str:
        return f"Featurizer(dim={self.dim}, ngrams={self.ngrams}, kind={self.kind!r})"

    def _grams(self, text: str) -> list[bytes]:
        """The hashed units: character n-grams of the padded text (bytes of its UTF-8), or words and word pairs."""
        text = _SPACES.sub(" ", text[:MAX_CHARS].lower()).strip()
        if self.kind == "word":
            words = [w.encode() for w in _WORDS.findall(text)]
            return words + [a + b" " + b for a, b in itertools.pairwise(words)]
        data = f" {text} ".encode()
        lo, hi = self.ngrams
        return [data[i : i + n] for n in range(lo, hi + 1) for i in range(len(data) - n + 1)]

    def transform(self, prompt: str | list[dict[str, str]]) -> np.ndarray:
        """The prompt's feature vector, shape (dim,), float32."""
        grams = self._grams(prompt_text(prompt))
        out = np.zeros(self.dim, dtype=np.float32)
        if not grams:
            return out
        h = np.fromiter((zlib.crc32(g) for g in grams), dtype=np.uint64, count=len(grams))
        sign = np.where(h >> np.uint64(31) & np.uint64(1), 1.0, -1.0)
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
