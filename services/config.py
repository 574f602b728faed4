"""The one configuration loader: a preset, then TOML files, then command-line overrides, into one
Struct.

Every verb's settings are a msgspec Struct defined next to what they configure
(``leafe.actors.config``, ``leafe.learner.config``,
``leafe.services.replayer.config.ReplayerConfig``, ``leafe.services.run.presets.RunConfig`` ...),
and every verb builds it the same way::

    cfg = load_config(LearnerConfig, preset=learner_preset("cpu"), files=[args.config],
                      overrides={"kinds": args.kinds, "trainer.optim.lr": args.lr})

Layers merge table by table (``leafe.protocol.config.merge_tables``); overrides use dotted keys and
a ``None`` value means "flag not given". Unknown fields and bad values are a :class:`ConfigError`
that names the field and the file, raised before anything starts. Environment variables only carry
URLs and the paths of secret files (``services/bus/connection.py``), never behaviour.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from leafe.protocol.config import (
    ConfigError,
    config_digest,
    convert_config,
    dotted,
    dump_config,
    merge_tables,
)

__all__ = [
    "ConfigError",
    "config_digest",
    "dump_config",
    "load_config",
    "parse_key_value",
    "read_toml",
    "tomlable",
]

T = TypeVar("T")


def read_toml(path: Path | str) -> dict[str, Any]:
    """The table in a TOML file; a missing file or bad TOML is a :class:`ConfigError` naming the
    file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None


def load_config(
    type_: type[T],
    *,
    preset: Any = None,
    files: Sequence[Path | str | None] = (),
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """``preset`` (a ``type_`` instance or a table; ``None`` = the type's defaults), then each TOML
    file in order (``None`` entries are skipped), then dotted ``overrides``, decoded into
    ``type_``."""
    data: dict[str, Any] = {}
    if preset is not None:
        data = dict(preset) if isinstance(preset, Mapping) else dump_config(preset)
    sources = [str(f) for f in files if f is not None]
    for path in sources:
        data = merge_tables(data, read_toml(path))
    data = merge_tables(data, dotted(overrides or {}))
    return convert_config(data, type_, where=", ".join(sources))


def parse_key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line; VALUE is read as a TOML value when it parses (numbers,
    booleans, arrays), else kept as a string. Meant as an argparse ``type=``: a bad one is an
    ``ArgumentTypeError``, which argparse prints as is."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    try:
        return key.strip(), tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), raw


def tomlable(value: Any) -> Any:
    """A dumped config without ``None`` values (TOML has no null), ready for ``tomli_w``."""
    if isinstance(value, Mapping):
        return {k: tomlable(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [tomlable(v) for v in value]
    return value
