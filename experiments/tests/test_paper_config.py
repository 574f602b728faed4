"""The paper table's configs: every committed scale validates, the full scale has the required
power, and mistakes (overlapping validation slice, typos, unknown rows, bad ks) fail naming
the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.paper.config import CONFIGS, FULL_POWER, load_paper_config, scale_path

SCALES = sorted(p.stem.removeprefix("paper_") for p in CONFIGS.glob("paper_*.toml"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    return path


BASE = 'name = "x"\n[warm.variants]\na = { max_solution_len = 2 }\n'


@pytest.mark.parametrize("scale", SCALES)
def test_every_committed_scale_is_a_valid_config(scale: str) -> None:
    """Each ``experiments/configs/paper_<scale>.toml`` decodes, and its k values fit its samples."""
    cfg = load_paper_config(scale_path(scale))
    assert cfg.name == scale
    assert cfg.ks[-1] <= cfg.eval_samples
    assert {"small", "full", "humaneval"} <= set(SCALES)


def test_full_scale_has_the_power_the_issue_asks_for() -> None:
    """>= 64 test tasks x 16 samples, and a config named full with fewer is refused."""
    cfg = load_paper_config(scale_path("full"))
    assert cfg.test_tasks >= FULL_POWER[0] and cfg.eval_samples >= FULL_POWER[1]
    with pytest.raises(ValueError, match="full scale needs >= 64 test tasks"):
        load_paper_config(scale_path("full"), {"test_tasks": 16})


def test_validation_slice_must_not_overlap_the_training_tasks(tmp_path: Path) -> None:
    """Choices are made on train tasks no training sees: an overlap names both ranges."""
    path = _write(tmp_path, BASE)
    assert load_paper_config(path).val_offset == 2000
    with pytest.raises(ValueError, match=r"val_offset.*overlaps the RL tasks 1000\.\.1007"):
        load_paper_config(path, {"val_offset": 1005})
    with pytest.raises(ValueError, match=r"overlaps the demonstration tasks 0\.\.63"):
        load_paper_config(path, {"val_offset": 10, "warm.demo_counts": [8, 64]})


def test_mistakes_fail_naming_the_field(tmp_path: Path) -> None:
    """Unknown fields, rows, a k above n, a bad Pass@1 range and an empty variant table are
    errors."""
    path = _write(tmp_path, BASE)
    with pytest.raises(Exception, match="tset_tasks"):
        load_paper_config(path, {"tset_tasks": 3})
    with pytest.raises(ValueError, match=r"rows = \['leafe-form-base'\].*known: base"):
        load_paper_config(path, {"rows": ["base", "leafe-form-base"]})
    with pytest.raises(ValueError, match="ks"):
        load_paper_config(path, {"ks": [1, 8], "eval_samples": 4})
    with pytest.raises(ValueError, match="pass1_range"):
        load_paper_config(path, {"warm.pass1_range": [0.5, 0.1]})
    with pytest.raises(ValueError, match=r"warm\.variants"):
        load_paper_config(_write(tmp_path, 'name = "x"\n'))
    with pytest.raises(ValueError, match=r"unknown scale 'huge'.*known: .*small"):
        scale_path("huge")
