"""What a broadcast delivers is checked against the export on disk without reading its weights:
the safetensors header gives names, dtypes and shapes, and the header followed by the received
bytes must hash to the file's sha256 in the manifest (``services/inference/weights.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leafe.learner.model_io import export_weights, load_model, tiny_model_dir
from leafe.services.inference.weights import (
    WeightLoadError,
    check_announced,
    export_index,
    received_digest,
)

from .conftest import perturbed_state


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_model(tiny_model_dir())


def _export(model: torch.nn.Module, root: Path) -> Path:
    out = root / "v000001"
    export_weights(perturbed_state(model, 1), out, config_dir=tiny_model_dir(), version="v1")
    return out


def test_the_exports_own_tensors_hash_to_its_manifest(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    out = _export(model, tmp_path)
    index = export_index(out, root=tmp_path)
    state = load_file(str(out / index.file))
    check_announced(index, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
    assert received_digest(index, state) == index.sha256


def test_one_flipped_value_does_not(model: torch.nn.Module, tmp_path: Path) -> None:
    out = _export(model, tmp_path)
    index = export_index(out, root=tmp_path)
    state = load_file(str(out / index.file))
    name = sorted(state)[3]
    state[name] = state[name].clone()
    state[name].view(-1)[7] += 1.0
    assert received_digest(index, state) != index.sha256


@pytest.mark.parametrize("change", ["dtype", "shape", "name"])
def test_an_announcement_unlike_the_export_is_refused_by_name(
    model: torch.nn.Module, tmp_path: Path, change: str
) -> None:
    out = _export(model, tmp_path)
    index = export_index(out, root=tmp_path)
    announced = {n: (dtype, shape) for n, (dtype, shape, _, _) in index.tensors.items()}
    name = "model.norm.weight"
    dtype, shape = announced[name]
    if change == "dtype":
        announced[name] = (torch.bfloat16, shape)
    elif change == "shape":
        announced[name] = (dtype, (shape[0] + 1,))
    else:
        announced["model.extra.weight"] = announced.pop(name)
    with pytest.raises(WeightLoadError) as e:
        check_announced(index, announced)
    assert "model.extra.weight" in str(e.value) if change == "name" else name in str(e.value)


def test_an_export_outside_the_root_is_refused(model: torch.nn.Module, tmp_path: Path) -> None:
    out = _export(model, tmp_path / "elsewhere")
    with pytest.raises(WeightLoadError, match="outside the weights root"):
        export_index(out, root=tmp_path / "root")
