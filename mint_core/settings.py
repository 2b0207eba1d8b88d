"""Settings of a command from a YAML/JSON file, then environment variables, then explicit values (its flags).

The layering is pydantic-settings': `Settings.load` reads three sources, highest precedence first: the explicit
values, the `<env_prefix><FIELD>` environment variables (the prefix in each class's `model_config`), the file.
A settings object built in code (`ServingConfig(port=0)`) holds what it is given, and reads neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

YAML_SUFFIXES = (".yaml", ".yml")


def read_mapping(path: Path, what: str = "settings") -> dict[str, Any]:
    """A YAML (.yaml/.yml) or JSON file holding one mapping; ValueError naming the file otherwise (missing,
    unreadable, not YAML/JSON, or not a mapping)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what} file: {e.strerror or e}") from None
    try:
        loaded = yaml.safe_load(text) if path.suffix in YAML_SUFFIXES else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        kind = "YAML" if path.suffix in YAML_SUFFIXES else "JSON"
        raise ValueError(f"{path}: not valid {kind}: {' '.join(str(e).split())}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of {what}")
    return loaded


class SettingsFile(InitSettingsSource):
    """The values of a YAML or JSON settings file. pydantic-settings' own file sources skip a missing file and read
    whatever YAML parses; here a file that was named must exist and hold a mapping (`read_mapping`)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        super().__init__(settings_cls, read_mapping(path))


class Settings(BaseSettings):
    """A command's settings: subclasses set `env_prefix` in their `model_config` and declare typed fields."""

    model_config = SettingsConfigDict(extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # built in code: only the values given (a test or a caller is not changed by the shell it runs in)
        return (init_settings,)

    @classmethod
    def load(cls, path: Path | None = None, **overrides: Any) -> Self:
        """File values, then `<env_prefix><FIELD>` environment variables, then explicit (non-None) overrides.

        ValueError naming the file when it cannot be used; pydantic's ValidationError (a ValueError) naming the
        field when a value is bad."""
        flags = {k: v for k, v in overrides.items() if v is not None}
        sources: list[PydanticBaseSettingsSource] = [InitSettingsSource(cls, flags), EnvSettingsSource(cls)]
        if path is not None:
            sources.append(SettingsFile(cls, path))
        return cls(_build_sources=(tuple(sources), flags))
