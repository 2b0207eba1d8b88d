"""Help text that states a default read from the settings model that holds it, so the help cannot drift from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel


def default_of(model: type[BaseModel], field: str) -> Any:
    """The default of `model`'s `field` (a default factory is called)."""
    return model.model_fields[field].get_default(call_default_factory=True)


def shown(value: Any) -> str:
    """A default as a flag would be written: a list comma-separated, a path as written."""
    if isinstance(value, list | tuple):
        return ",".join(shown(v) for v in value)
    if isinstance(value, Path):
        return str(value)
    return f"{value}"


def with_default(text: str, model: type[BaseModel], field: str) -> str:
    """`text` followed by `[default: X]`, X `model`'s default for `field` (the bracket escaped for rich)."""
    stated = f"\\[default: {shown(default_of(model, field))}]"
    return f"{text} {stated}." if text else stated
