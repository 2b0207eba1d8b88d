"""Settings of a command from a YAML/JSON file, then environment variables, then explicit overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def read_mapping(path: Path, what: str = "settings") -> dict[str, Any]:
    """A YAML (.yaml/.yml) or JSON file holding one mapping; ValueError naming the file otherwise (missing,
    unreadable, not YAML/JSON, or not a mapping)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what} file: {e.strerror or e}") from None
    try:
        loaded = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise ValueError(f"{path}: not valid {kind}: {' '.join(str(e).split())}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of {what}")
    return loaded


def load_settings(cls: type[M], env_prefix: str, path: Path | None = None, **overrides: Any) -> M:
    """File values, then `<env_prefix><FIELD>` environment variables, then explicit (non-None) overrides."""
    values: dict[str, Any] = {} if path is None else read_mapping(path)
    for name in cls.model_fields:
        env = os.environ.get(env_prefix + name.upper())
        if env is not None:
            values[name] = env
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls.model_validate(values)
