"""The one config loader (services/config.py): layering, errors that name field and file,
KEY=VALUE."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from leafe.services.config import ConfigError, load_config, parse_key_value, read_toml, tomlable


class Inner(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lr: float = 1.0
    steps: int = 10


class Outer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "x"
    tags: list[str] = msgspec.field(default_factory=list)
    inner: Inner = msgspec.field(default_factory=Inner)


def test_layers_apply_in_order_preset_files_overrides(tmp_path: Path) -> None:
    """Each layer replaces only what it names: tables merge, lists and scalars replace; a None
    override (a flag that was not given) changes nothing."""
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('name = "a"\ntags = ["one"]\n[inner]\nlr = 0.5\n')
    b.write_text('tags = ["two", "three"]\n[inner]\nsteps = 3\n')
    preset = Outer(name="p", inner=Inner(lr=0.1, steps=1))
    cfg = load_config(
        Outer, preset=preset, files=[a, None, b], overrides={"inner.lr": 0.25, "name": None}
    )
    assert cfg == Outer(name="a", tags=["two", "three"], inner=Inner(lr=0.25, steps=3))
    assert load_config(Outer) == Outer()


def test_errors_name_the_field_and_the_file(tmp_path: Path) -> None:
    """An unknown field, a wrong type, bad TOML and a missing file are ConfigErrors naming what and
    where."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[inner]\nlrr = 1\n")
    with pytest.raises(ConfigError, match=r"lrr.*bad\.toml|bad\.toml.*lrr"):
        load_config(Outer, files=[bad])
    with pytest.raises(ConfigError, match=r"inner\.steps"):
        load_config(Outer, overrides={"inner.steps": "many"})
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ConfigError, match=r"invalid TOML in .*broken\.toml"):
        read_toml(broken)
    with pytest.raises(ConfigError, match=r"not found: .*nope\.toml"):
        load_config(Outer, files=[tmp_path / "nope.toml"])


def test_key_value_reads_toml_values_or_keeps_strings() -> None:
    """``K=V``: numbers, booleans and arrays are typed, anything else stays a string; no '=' is an
    argparse error with the text."""
    assert parse_key_value("max_steps=6") == ("max_steps", 6)
    assert parse_key_value("flag=true") == ("flag", True)
    assert parse_key_value("ks=[1, 2]") == ("ks", [1, 2])
    assert parse_key_value("name=hello world") == ("name", "hello world")
    with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
        parse_key_value("novalue")


def test_tomlable_drops_nulls_at_every_depth() -> None:
    """TOML has no null: None values vanish, nested ones too, the rest is kept."""
    assert tomlable({"a": None, "b": {"c": None, "d": 1}, "e": [{"f": None}]}) == {
        "b": {"d": 1},
        "e": [{}],
    }
