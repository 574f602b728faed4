"""How typed configuration is merged, decoded and fingerprinted: the rules every config in LEAFE
obeys.

A config is a frozen msgspec Struct with ``forbid_unknown_fields=True`` (``leafe.actors.config``,
``leafe.learner.config``, the services' own). Layers are plain tables merged in order (a preset,
then each TOML file, then command-line overrides), and the result is decoded once into the Struct,
so an unknown field or a bad value is an error naming the field before anything starts.
``services/config.py`` reads the TOML files and is the one loader the verbs use; this module holds
the pure parts every layer shares (it is in ``protocol/`` because the digest is stamped into events:
``EpisodeStarted.config_digest``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

__all__ = [
    "ConfigError",
    "config_digest",
    "convert_config",
    "dotted",
    "dump_config",
    "merge_tables",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the field and the
    value."""


def merge_tables(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``: tables merge key by key, any other value replaces (lists too)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_tables(out[key], value)
        else:
            out[key] = value
    return out


def dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"trainer.optim.lr": 1e-5}`` -> ``{"trainer": {"optim": {"lr": 1e-5}}}``; ``None`` values
    are left out (a flag that was not given)."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {key!r} conflicts with a value already set for {part!r}"
                )
            node = child
        node[parts[-1]] = value
    return out


def convert_config(data: Mapping[str, Any], type_: type[T], *, where: str = "") -> T:
    """Decode a merged table into ``type_``; errors name the field path and the bad value."""
    try:
        return msgspec.convert(dict(data), type_, strict=False)
    except msgspec.ValidationError as e:
        origin = f" (from {where})" if where else ""
        raise ConfigError(f"invalid {type_.__name__}{origin}: {e}") from None
    except (ValueError, TypeError) as e:  # a __post_init__ check: it names the field itself
        origin = f" (from {where})" if where else ""
        raise ConfigError(f"invalid {type_.__name__}{origin}: {e}") from None


def dump_config(config: Any) -> dict[str, Any]:
    """Plain-table form of a config (for printing, saving to the run directory, and merging)."""
    return msgspec.to_builtins(config)  # type: ignore[no-any-return]


def config_digest(config: Any) -> str:
    """sha256 of the canonical JSON of a config (stamped into events for provenance)."""
    return hashlib.sha256(msgspec.json.encode(dump_config(config), order="sorted")).hexdigest()
