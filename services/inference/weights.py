"""Loading a weight directory for ``/update_weights_from_disk``: only under the server's weights
root and only with a sha256 manifest, read exactly the files the manifest lists into memory, and
validate names, shapes and dtypes against the serving model, so the swap itself
(``load_state_dict(assign=True)`` between batches) cannot fail half-way. Whoever can call the route
can therefore only make the server load an export that sits under the root and is whole.

Each file is opened once and what is hashed is what is parsed: the directory is opened component by
component from the root without following a symlink (a directory fd taken at check time), each file
is opened relative to it with ``O_NOFOLLOW`` (a symlinked file is refused, even one whose bytes hash
right), read into memory, and that one buffer is both hashed and parsed. A writer that renames other
bytes over a file while it loads gets either a manifest mismatch or the hashed bytes, never
something in between.

Failure messages follow SGLang's wording ("Failed to get weights iterator: ..." when the path cannot
be read, "Failed to update weights: ... Rolling back to original weights." otherwise); the old
weights stay.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load

from leafe.learner.model_io import MANIFEST, ManifestError, manifest_table

__all__ = [
    "ExportIndex",
    "WeightLoadError",
    "check_announced",
    "check_under_root",
    "export_index",
    "fit_state",
    "load_weight_dir",
    "received_digest",
]

_SHOWN = 3
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = (
    os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
)  # NONBLOCK: a FIFO never hangs us


class WeightLoadError(RuntimeError):
    """A weight directory that cannot be served; the message is SGLang-shaped and names the
    cause."""


def _failed(reason: str) -> WeightLoadError:
    return WeightLoadError(f"Failed to update weights: {reason}. Rolling back to original weights.")


def check_under_root(path: Path, root: Path | None) -> Path:
    """``path`` resolved (symlinks, ``..``); a path outside ``root`` (or no root at all) is
    refused."""
    if root is None:
        raise WeightLoadError(
            "Failed to get weights iterator: this server loads no weights from disk (start it with "
            "--weights-root DIR to allow exports under DIR)."
        )
    resolved, base = path.resolve(), root.resolve()
    if not resolved.is_relative_to(base):
        raise WeightLoadError(
            f"Failed to get weights iterator: {path} is outside the weights root {base}."
        )
    return resolved


def _open_dir(resolved: Path, base: Path) -> int:
    """A directory fd of ``resolved`` (inside ``base``, symlinks already resolved), opened one
    component at a time without following a symlink: one that appeared since the check is refused,
    not followed."""
    fd = os.open(
        base, _DIR_FLAGS & ~os.O_NOFOLLOW
    )  # the root itself may be a symlink its operator chose
    try:
        for part in resolved.relative_to(base).parts:
            fd, parent = os.open(part, _DIR_FLAGS, dir_fd=fd), fd
            os.close(parent)
    except OSError as e:
        os.close(fd)
        if e.errno == errno.ELOOP:
            raise WeightLoadError(
                f"Failed to get weights iterator: {resolved} turned into a symlink while it was "
                "opened."
            ) from None
        raise WeightLoadError(
            f"Failed to get weights iterator: {resolved} (repository not found)."
        ) from None
    return fd


def _read_file(dir_fd: int, name: str, where: Path) -> bytes:
    """The whole of regular file ``name`` in the directory ``dir_fd``, read through one open."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _failed(
            f"{where}: {name} listed in manifest.json is missing (half-written export?)"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _failed(
                f"{where / name} is a symlink (only files of the export itself are read)"
            ) from None
        raise _failed(f"cannot open {where / name}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _failed(f"{where / name} is not a regular file")
        return f.read()


def _listed_files(dir_fd: int, path: Path) -> dict[str, str]:
    """The manifest's ``files`` table; an unlisted ``*.safetensors`` file in the directory is
    refused."""
    if MANIFEST not in os.listdir(dir_fd):
        raise _failed(
            f"{path} has no manifest.json (only exports with a sha256 manifest are loaded)"
        )
    try:
        listed = manifest_table(_read_file(dir_fd, MANIFEST, path), path / MANIFEST)
    except ManifestError as e:
        raise _failed(str(e)) from e
    present = {n for n in os.listdir(dir_fd) if n.endswith(".safetensors")}
    if present - listed.keys():
        raise _failed(
            f"{path} holds *.safetensors files its manifest does not list: "
            f"{sorted(present - listed.keys())}"
        )
    if not any(n.endswith(".safetensors") for n in listed):
        raise WeightLoadError(f"Failed to get weights iterator: {path} (no *.safetensors files).")
    return listed


def _sha256s(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def _read_checked(dir_fd: int, path: Path) -> dict[str, torch.Tensor]:
    """Every listed file read once; the buffers hashed (in a thread: hashlib releases the GIL) while
    the same buffers are parsed. A mismatch is reported before a parse error: it explains a damaged
    file better."""
    listed = _listed_files(dir_fd, path)
    files = {name: _read_file(dir_fd, name, path) for name in sorted(listed)}
    state: dict[str, torch.Tensor] = {}
    parse_error: tuple[str, Exception] | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="leafe-manifest") as pool:
        hashed = pool.submit(_sha256s, files)
        for name, data in files.items():
            if name.endswith(".safetensors") and parse_error is None:
                try:
                    state.update(load(data))
                except (
                    Exception
                ) as e:  # safetensors raises its own error types for truncated/corrupt files
                    parse_error = name, e
        digests = hashed.result()
    for name, digest in listed.items():
        if digests[name] != digest:
            raise _failed(f"{path}: {name} does not match its sha256 in manifest.json")
    if parse_error is not None:
        bad, error = parse_error
        raise _failed(f"cannot read {path / bad}: {error}") from error
    return state


def _fill_tied(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Tied parameters (lm_head = embeddings) are saved once; give the missing name its twin's
    tensor."""
    by_storage: dict[int, list[str]] = {}
    for name, t in reference.items():
        by_storage.setdefault(t.data_ptr(), []).append(name)
    for names in by_storage.values():
        present = [n for n in names if n in state]
        if present and len(present) < len(names):
            for n in names:
                state.setdefault(n, state[present[0]])


def load_weight_dir(
    path: Path, model: torch.nn.Module, *, root: Path | None
) -> dict[str, torch.Tensor]:
    """State dict of ``path`` ready for ``model.load_state_dict(state, strict=True, assign=True)``.

    Raises :class:`WeightLoadError` (outside ``root``, path missing, no or a mismatching manifest, a
    symlinked or unreadable file, missing/unexpected tensor, shape mismatch)."""
    path = check_under_root(Path(path), root)
    assert root is not None  # check_under_root refuses None
    dir_fd = _open_dir(path, Path(root).resolve())
    try:
        state = _read_checked(dir_fd, path)
    finally:
        os.close(dir_fd)
    return fit_state(state, model, where=path)


def fit_state(
    state: dict[str, torch.Tensor], model: torch.nn.Module, *, where: object
) -> dict[str, torch.Tensor]:
    """``state`` checked against ``model`` and made ready for ``load_state_dict(strict=True,
    assign=True)``: tied twins filled in, every name present and known, every shape the serving
    model's, each storage cast once to the model's dtype. ``where`` names the source in errors."""
    reference = model.state_dict()
    _fill_tied(state, reference)
    missing = sorted(reference.keys() - state.keys())
    unexpected = sorted(state.keys() - reference.keys())
    if missing:
        raise _failed(
            f"{where} lacks {len(missing)} tensors of the serving model, e.g. {missing[:_SHOWN]}"
        )
    if unexpected:
        raise _failed(
            f"{where} has {len(unexpected)} tensors the serving model lacks, e.g. "
            f"{unexpected[:_SHOWN]}"
        )
    # Convert each storage once: tied weights (embed_tokens / lm_head) must stay one tensor, or the
    # assign-load unties them and the next reload of a file without lm_head fails.
    converted: dict[int, torch.Tensor] = {}
    for name, ref in reference.items():
        t = state[name]
        if t.shape != ref.shape:
            raise _failed(
                f"{name} has shape {tuple(t.shape)} in {where}, the serving model "
                f"{tuple(ref.shape)}"
            )
        if t.dtype != ref.dtype:
            state[name] = converted.setdefault(id(t), t.to(ref.dtype))
    return state


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20
"""safetensors' own bound on a header."""


class ExportIndex(msgspec.Struct, frozen=True, kw_only=True):
    """What a broadcast of one export must match: the header of its one safetensors file (as
    bytes), each tensor's dtype, shape and byte range in it, and the file's sha256 in the
    manifest."""

    path: str
    """The export directory."""
    file: str
    """The safetensors file's name (``model.safetensors``)."""
    header: bytes
    """The file's first bytes: the 8-byte length and the JSON header."""
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]
    """Name -> (dtype, shape, start, end) with offsets into the data after the header."""
    data_bytes: int
    """Bytes after the header."""
    sha256: str
    """The file's sha256 in ``manifest.json``."""


def _read_header(dir_fd: int, name: str, where: Path) -> tuple[bytes, int]:
    """The length prefix and JSON header of safetensors file ``name``, and the file's size."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise _failed(f"cannot open {where / name}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _failed(f"{where / name} is not a regular file")
        prefix = f.read(8)
        size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < size <= min(_MAX_HEADER, st.st_size - 8):
            raise _failed(f"{where / name} is not a safetensors file (header length {size})")
        return prefix + f.read(size), st.st_size


def export_index(path: Path, *, root: Path | None) -> ExportIndex:
    """The :class:`ExportIndex` of export ``path`` (under ``root``, opened as
    :func:`load_weight_dir` opens it): only its manifest and its safetensors header are read, not
    the weights. An export of several safetensors files is refused (one file's sha256 cannot cover
    a subset of the tensors)."""
    path = check_under_root(Path(path), root)
    assert root is not None
    dir_fd = _open_dir(path, Path(root).resolve())
    try:
        listed = _listed_files(dir_fd, path)
        files = sorted(n for n in listed if n.endswith(".safetensors"))
        if len(files) != 1:
            raise _failed(
                f"{path} holds {len(files)} safetensors files; a broadcast is checked against "
                "an export of exactly one"
            )
        header, size = _read_header(dir_fd, files[0], path)
    finally:
        os.close(dir_fd)
    try:
        meta = msgspec.json.decode(header[8:])
    except msgspec.DecodeError as e:
        raise _failed(f"{path / files[0]}: unreadable safetensors header ({e})") from None
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, info in meta.items() if isinstance(meta, dict) else ():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            start, end = (int(x) for x in info["data_offsets"])
            tensors[name] = (dtype, tuple(int(d) for d in info["shape"]), start, end)
        except (KeyError, TypeError, ValueError):
            raise _failed(f"{path / files[0]}: bad header entry for {name!r}") from None
    return ExportIndex(
        path=str(path),
        file=files[0],
        header=header,
        tensors=tensors,
        data_bytes=size - len(header),
        sha256=listed[files[0]],
    )


def check_announced(
    index: ExportIndex, announced: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> None:
    """The announced tensors are exactly the export's: the same names, each with the export's dtype
    and shape (a clear error naming the first that differs)."""
    missing = sorted(index.tensors.keys() - announced.keys())
    extra = sorted(announced.keys() - index.tensors.keys())
    if missing or extra:
        raise _failed(
            f"the announced tensors differ from the export {index.path}: missing "
            f"{missing[:_SHOWN]} ({len(missing)}), not in it {extra[:_SHOWN]} ({len(extra)})"
        )
    for name, (dtype, shape) in announced.items():
        want_dtype, want_shape, _, _ = index.tensors[name]
        if dtype != want_dtype:
            raise _failed(
                f"{name} was announced as {str(dtype).removeprefix('torch.')}, the export "
                f"{index.path} holds {str(want_dtype).removeprefix('torch.')}"
            )
        if shape != want_shape:
            raise _failed(
                f"{name} was announced with shape {shape}, the export {index.path} holds "
                f"{want_shape}"
            )


def received_digest(index: ExportIndex, state: dict[str, torch.Tensor]) -> str:
    """The sha256 the export's file would have if it held ``state``: its header, then each
    tensor's bytes in the file's order. Equal to the manifest's only when every byte matches
    (``state`` must hold exactly the file's names, with its dtypes and shapes: check that first
    with :func:`check_announced`)."""
    h = hashlib.sha256(index.header)
    at = 0
    for name, (_, _, start, end) in sorted(index.tensors.items(), key=lambda kv: kv[1][2]):
        if start != at:
            raise _failed(f"{index.path}/{index.file}: a gap before {name} in the file")
        t = state[name].detach().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != end - start:
            raise _failed(f"{name}: {data.nbytes} bytes received, the export holds {end - start}")
        h.update(data.data)
        at = end
    if at != index.data_bytes:
        raise _failed(f"{index.path}/{index.file}: {index.data_bytes - at} bytes after the tensors")
    return h.hexdigest()
