"""MLflow tag values that fit MLflow's limit: text cut with a mark, JSON shrunk field by field, never cut."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TAG_MAX_CHARS = 5000
"""The smallest tag-value limit among MLflow's stores (its SQL store's column holds 5000 characters): a longer
value is refused, and the whole write with it."""

CUT = " [...]"
"""What ends a text tag that was cut to fit."""


def fit_tag(text: str, limit: int = TAG_MAX_CHARS) -> str:
    """`text` as a tag value: as is when it fits, else its start and `CUT`, `limit` characters in all."""
    return text if len(text) <= limit else text[: limit - len(CUT)] + CUT


def json_tag(doc: Mapping[str, Any], shrink: Sequence[str] = (), limit: int = TAG_MAX_CHARS) -> str:
    """`doc` as compact JSON within `limit` characters, always whole JSON, never a cut string.

    When it is too long, the fields named in `shrink` lose their last items (a list's last element, a mapping's
    last key, a string's end, cut with `CUT`), the first named field first, each down to empty before the next;
    then the other fields are dropped, the longest first. A doc that had to shrink says `"truncated": true`."""
    out: dict[str, Any] = dict(doc)

    def dump() -> str:
        return json.dumps(out, separators=(",", ":"))

    text = dump()
    if len(text) <= limit:
        return text
    out["truncated"] = True
    for key in shrink:
        value = out.get(key)
        if isinstance(value, str):
            # the longest start of the string that fits, found by bisection: JSON escapes make the dump of a
            # string longer than the string, by how much depends on which characters are kept
            lo, hi = 0, len(value)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                out[key] = value[:mid] + CUT
                lo, hi = (mid, hi) if len(dump()) <= limit else (lo, mid - 1)
            out[key] = value[:lo] + CUT if lo else ""
        elif isinstance(value, list | dict):
            out[key] = items = list(value) if isinstance(value, list) else dict(value)
            while len(text := dump()) > limit and items:
                if isinstance(items, list):
                    items.pop()
                else:
                    items.popitem()
        if len(text := dump()) <= limit:
            return text
    others = sorted((k for k in out if k != "truncated"), key=lambda k: -len(json.dumps(out[k])))
    for key in others:
        del out[key]
        if len(text := dump()) <= limit:
            return text
    return dump()
