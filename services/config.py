"""Typed configuration: msgspec Structs decoded from TOML, unknown fields rejected.

Each service has one config Struct (defined next to its core: ``actors/config.py``,
``learner/config.py``...); :func:`load_config` decodes a TOML file (or a dict) into it and names the
offending field and value on error. Environment variables are only used for URLs and secrets.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

__all__ = ["ConfigError", "config_digest", "dump_config", "load_config"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the field."""


def load_config(source: Path | str | dict[str, Any] | None, type_: type[T]) -> T:
    """Decode ``source`` (a TOML path, TOML text, a dict or ``None`` for defaults) into ``type_``."""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if isinstance(source, Path) or (len(str(source)) < 4096 and path.suffix == ".toml"):
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            text = path.read_text(encoding="utf-8")
        else:
            text = str(source)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML in {source}: {e}") from None
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid {type_.__name__}: {e}") from None


def dump_config(config: Any) -> dict[str, Any]:
    """Plain-dict form of a config (for printing and saving to the run directory)."""
    return msgspec.to_builtins(config)  # type: ignore[no-any-return]


def config_digest(config: Any) -> str:
    """sha256 of the canonical JSON of a config (stamped into events for provenance)."""
    return hashlib.sha256(msgspec.json.encode(dump_config(config), order="sorted")).hexdigest()
