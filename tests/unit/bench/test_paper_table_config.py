"""Config parsing of ``bench/paper_table.py``: every scale preset validates, overrides apply, typos fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.paper_table import SCALES, scale_config


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_every_scale_preset_is_a_valid_config(scale: str) -> None:
    """Each ``--scale`` preset decodes into PaperConfig and its k values fit n samples."""
    cfg = scale_config(scale)
    assert cfg.name == scale
    assert max(cfg.ks) <= cfg.eval_samples


def test_override_wins_and_unknown_field_is_rejected() -> None:
    """A TOML override replaces a preset field; a misspelt field is an error naming it."""
    assert scale_config("small", {"test_tasks": 3}).test_tasks == 3
    with pytest.raises(Exception, match="tset_tasks"):
        scale_config("small", {"tset_tasks": 3})
    with pytest.raises(ValueError, match="huge"):
        scale_config("huge")


def test_phases_must_be_known_names() -> None:
    """``phases`` restricts the run to named phases; a misspelt one is an error listing the known names."""
    assert scale_config("full", {"phases": ["eval-base", "explore-base"]}).phases == [
        "eval-base",
        "explore-base",
    ]
    with pytest.raises(ValueError, match=r"eval-leafe.*known: eval-base"):
        scale_config("full", {"phases": ["eval-leafe"]})
