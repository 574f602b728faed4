"""Loading a weight directory for ``/update_weights_from_disk``: only under the server's weights root and
only with a sha256 manifest (checked in parallel with reading), read exactly the ``*.safetensors`` files
the manifest lists into memory, and validate names, shapes and dtypes against the serving model, so the
swap itself (``load_state_dict(assign=True)`` between batches) cannot fail half-way. Whoever can call the
route can therefore only make the server load an export that sits under the root and is whole.

Failure messages follow SGLang's wording ("Failed to get weights iterator: ..." when the path cannot be
read, "Failed to update weights: ... Rolling back to original weights." otherwise); the old weights stay.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load

from learner.model_io import ManifestError, manifest_files, verify_manifest

__all__ = ["WeightLoadError", "check_under_root", "load_weight_dir"]

_SHOWN = 3


class WeightLoadError(RuntimeError):
    """A weight directory that cannot be served; the message is SGLang-shaped and names the cause."""


def _failed(reason: str) -> WeightLoadError:
    return WeightLoadError(f"Failed to update weights: {reason}. Rolling back to original weights.")


def check_under_root(path: Path, root: Path | None) -> Path:
    """``path`` resolved (symlinks, ``..``); a path outside ``root`` (or no root at all) is refused."""
    if root is None:
        raise WeightLoadError(
            "Failed to get weights iterator: this server loads no weights from disk (start it with "
            "--weights-root DIR to allow exports under DIR)."
        )
    resolved, base = path.resolve(), root.resolve()
    if not resolved.is_relative_to(base):
        raise WeightLoadError(f"Failed to get weights iterator: {path} is outside the weights root {base}.")
    return resolved


def _listed_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files the manifest lists; an unlisted one in the directory is refused."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise _failed(f"{path} has no manifest.json (only exports with a sha256 manifest are loaded)")
    try:
        listed = set(manifest_files(manifest))
    except ManifestError as e:
        raise _failed(str(e)) from e
    present = {f.name for f in path.glob("*.safetensors")}
    if present - listed:
        raise _failed(
            f"{path} holds *.safetensors files its manifest does not list: {sorted(present - listed)}"
        )
    return sorted(path / n for n in listed if n.endswith(".safetensors"))


def _read_files(path: Path, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    if not path.is_dir():
        raise WeightLoadError(f"Failed to get weights iterator: {path} (repository not found).")
    files = sorted(path.glob("*.safetensors")) if files is None else files
    if not files:
        raise WeightLoadError(f"Failed to get weights iterator: {path} (no *.safetensors files).")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            # Read into memory (not the lazy mmap of load_file): served tensors must not change, or fault,
            # if the file is later rewritten in place.
            state.update(load(f.read_bytes()))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise _failed(f"cannot read {f}: {e}") from e
    return state


def _fill_tied(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Tied parameters (lm_head = embeddings) are saved once; give the missing name its twin's tensor."""
    by_storage: dict[int, list[str]] = {}
    for name, t in reference.items():
        by_storage.setdefault(t.data_ptr(), []).append(name)
    for names in by_storage.values():
        present = [n for n in names if n in state]
        if present and len(present) < len(names):
            for n in names:
                state.setdefault(n, state[present[0]])


def load_weight_dir(path: Path, model: torch.nn.Module, *, root: Path | None) -> dict[str, torch.Tensor]:
    """State dict of ``path`` ready for ``model.load_state_dict(state, strict=True, assign=True)``.

    Raises :class:`WeightLoadError` (outside ``root``, path missing, no or a mismatching manifest,
    unreadable file, missing/unexpected tensor, shape mismatch)."""
    path = check_under_root(Path(path), root)
    files = _listed_files(path) if path.is_dir() else None
    # Hash (manifest check) and read in parallel: both release the GIL, and the swap waits for both.
    # A manifest mismatch explains a failed read better than the read error itself: report it first.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="leafe-manifest") as pool:
        checked = pool.submit(verify_manifest, path) if path.is_dir() else None
        try:
            state, read_error = _read_files(path, files), None
        except WeightLoadError as e:
            state, read_error = {}, e
        try:
            if checked is not None:
                checked.result()
        except ManifestError as e:
            raise _failed(str(e)) from e
    if read_error is not None:
        raise read_error
    reference = model.state_dict()
    _fill_tied(state, reference)
    missing = sorted(reference.keys() - state.keys())
    unexpected = sorted(state.keys() - reference.keys())
    if missing:
        raise _failed(f"{path} lacks {len(missing)} tensors of the serving model, e.g. {missing[:_SHOWN]}")
    if unexpected:
        raise _failed(
            f"{path} has {len(unexpected)} tensors the serving model lacks, e.g. {unexpected[:_SHOWN]}"
        )
    # Convert each storage once: tied weights (embed_tokens / lm_head) must stay one tensor, or the
    # assign-load unties them and the next reload of a file without lm_head fails.
    converted: dict[int, torch.Tensor] = {}
    for name, ref in reference.items():
        t = state[name]
        if t.shape != ref.shape:
            raise _failed(
                f"{name} has shape {tuple(t.shape)} in {path}, the serving model {tuple(ref.shape)}"
            )
        if t.dtype != ref.dtype:
            state[name] = converted.setdefault(id(t), t.to(ref.dtype))
    return state
