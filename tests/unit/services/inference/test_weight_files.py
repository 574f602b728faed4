"""Weight files are read once, hashed and parsed from the same bytes, and never through a symlink.

``load_weight_dir`` is what ``/update_weights_from_disk`` runs; these tests call it directly on
exports of the tiny model. The attacks: a listed file that is a symlink to bytes outside the weights
root (which hash right), and a writer that renames other weights over a checked file while loads run
(a load must never return bytes its manifest check did not hash).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from leafe.learner.model_io import export_weights, load_model, tiny_model_dir
from leafe.services.inference.weights import WeightLoadError, load_weight_dir

from .conftest import perturbed_state


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_model(tiny_model_dir())


def _export(model: torch.nn.Module, out: Path, seed: int) -> Path:
    export_weights(
        perturbed_state(model, seed), out, config_dir=tiny_model_dir(), version=f"s{seed}"
    )
    return out


def _same(state: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> bool:
    return state.keys() == other.keys() and all(torch.equal(state[k], other[k]) for k in state)


def test_a_listed_file_that_is_a_symlink_is_refused(model: torch.nn.Module, tmp_path: Path) -> None:
    """The file's bytes match the manifest, but they live outside the root: the link is not
    followed."""
    root = tmp_path / "weights"
    export = _export(model, root / "v1", seed=1)
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(export / "model.safetensors", outside)
    (export / "model.safetensors").unlink()
    (export / "model.safetensors").symlink_to(outside)
    with pytest.raises(WeightLoadError, match="symlink"):
        load_weight_dir(export, model, root=root)


def test_weights_renamed_over_a_checked_file_are_never_loaded(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    """A thread renames other weights over the export's file (and the right ones back) in a loop
    while loads run: every load either fails its manifest check or returns exactly the hashed
    export."""
    root = tmp_path / "weights"
    export = _export(model, root / "v1", seed=1)
    other = _export(model, tmp_path / "weights" / "other", seed=2)
    good_bytes, evil_bytes = (export / "model.safetensors"), (other / "model.safetensors")
    side = root / "side"
    side.mkdir()
    shutil.copyfile(good_bytes, side / "good")
    shutil.copyfile(evil_bytes, side / "evil")
    expected = load_weight_dir(export, model, root=root)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for name in ("evil", "good"):
                os.link(side / name, side / f"{name}.tmp")
                os.replace(side / f"{name}.tmp", export / "model.safetensors")

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    loaded, refused = 0, 0
    try:
        for _ in range(40):
            try:
                state = load_weight_dir(export, model, root=root)
            except WeightLoadError as e:
                assert "does not match its sha256" in str(e), e
                refused += 1
                continue
            assert _same(state, expected), "a load returned weights its manifest check never hashed"
            loaded += 1
    finally:
        stop.set()
        swapper.join()
    assert loaded + refused == 40
