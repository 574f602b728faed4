"""Dataset shards: samples as JSONL files plus a manifest, byte-identical when rebuilt from the same
log.

Layout of a dataset directory (written by ``leafe replay``, read by ``leafe train``)::

    samples-00000.jsonl   one msgspec-JSON ``leafe.protocol.samples.Sample`` per line,
                          sorted by sample_id
    samples-00001.jsonl   ... ``shard_size`` samples per shard
    manifest.json         counts per kind and env, materializer name/version/options, fold stats,
                          each shard's sha256 and ``content_sha256`` (sha256 of all shard bytes
                          in order)

Nothing time- or host-dependent is written, so rebuilding the same log gives the same bytes and the
same manifest. The shards load with ``datasets.load_dataset("json", data_files=shard_paths(dir))``;
pass ``features=hf_features()`` when optional columns (e.g. ``behaviour_logprobs``) are null in the
first shard but set in a later one, since ``datasets`` infers the schema from the first file.

Samples are sorted in memory (as encoded lines), which is fine for the ~10^5 samples a run distils.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from leafe.protocol.samples import Sample

if TYPE_CHECKING:
    import datasets

__all__ = [
    "DATASET_FORMAT",
    "MANIFEST",
    "DatasetError",
    "DatasetManifest",
    "ShardInfo",
    "hf_features",
    "iter_samples",
    "read_manifest",
    "shard_paths",
    "write_dataset",
]

DATASET_FORMAT = "leafe-samples/1"
MANIFEST = "manifest.json"
_SHARD = "samples-{:05d}.jsonl"
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Sample)


class DatasetError(ValueError):
    """A dataset directory that is missing, inconsistent with its manifest, or conflicting input."""


class ShardInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One shard file."""

    file: str
    """File name inside the dataset directory."""
    samples: int
    """Lines (samples) in the file."""
    sha256: str
    """sha256 of the file's bytes."""


class DatasetManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``manifest.json`` of a dataset directory."""

    format: str = DATASET_FORMAT
    """Layout version."""
    materializer: dict[str, Any]
    """Name, version and resolved options of the materializer that produced the samples."""
    source: dict[str, str] = msgspec.field(default_factory=dict)
    """What was replayed (e.g. ``run_id``); never paths or URLs, so rebuilds compare equal."""
    samples: int
    """Total samples."""
    counts_by_kind: dict[str, int]
    """Samples per kind (``cf``, ``reh``, ``grpo``, ``rft``)."""
    counts_by_env: dict[str, int]
    """Samples per environment."""
    shards: list[ShardInfo]
    """Shard files, in order."""
    content_sha256: str
    """sha256 over the bytes of every shard, in order: the dataset's identity."""
    stats: dict[str, Any] = msgspec.field(default_factory=dict)
    """Counters of the fold that produced the samples (rejected events, prompt mismatches...)."""


def write_dataset(
    samples: Iterable[Sample],
    out_dir: Path,
    *,
    materializer: dict[str, Any],
    shard_size: int = 10_000,
    source: dict[str, str] | None = None,
    stats: dict[str, Any] | None = None,
) -> DatasetManifest:
    """Write ``samples`` (deduplicated and sorted by id) as shards plus ``manifest.json`` into
    ``out_dir``.

    Old shards in ``out_dir`` are removed first; the manifest is written last (atomically), so a
    reader never trusts a half-written dataset. Two samples with one id but different content raise
    :class:`DatasetError`.
    """
    if shard_size < 1:
        raise DatasetError(f"shard_size must be >= 1, got {shard_size}")
    lines: dict[str, bytes] = {}
    by_kind: dict[str, int] = {}
    by_env: dict[str, int] = {}
    for sample in samples:
        line = _encoder.encode(sample)
        held = lines.get(sample.sample_id)
        if held is not None:
            if held != line:
                raise DatasetError(f"two different samples share the id {sample.sample_id}")
            continue
        lines[sample.sample_id] = line
        by_kind[sample.kind] = by_kind.get(sample.kind, 0) + 1
        by_env[sample.env] = by_env.get(sample.env, 0) + 1
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("samples-*.jsonl"), out_dir / MANIFEST]:
        old.unlink(missing_ok=True)
    ordered = [lines[k] for k in sorted(lines)]
    shards: list[ShardInfo] = []
    content = hashlib.sha256()
    for i in range(0, len(ordered), shard_size):
        data = b"".join(line + b"\n" for line in ordered[i : i + shard_size])
        name = _SHARD.format(len(shards))
        (out_dir / name).write_bytes(data)
        content.update(data)
        shards.append(
            ShardInfo(file=name, samples=len(ordered[i : i + shard_size]), sha256=_sha256(data))
        )
    manifest = DatasetManifest(
        materializer=materializer,
        source=dict(source or {}),
        samples=len(ordered),
        counts_by_kind=dict(sorted(by_kind.items())),
        counts_by_env=dict(sorted(by_env.items())),
        shards=shards,
        content_sha256=content.hexdigest(),
        stats=dict(stats or {}),
    )
    _write_atomic(
        out_dir / MANIFEST,
        msgspec.json.format(msgspec.json.encode(manifest, order="sorted"), indent=1),
    )
    return manifest


def read_manifest(dataset_dir: Path) -> DatasetManifest:
    """The manifest of a dataset directory; raises :class:`DatasetError` when missing or invalid."""
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DatasetError(
            f"{dataset_dir}: no {MANIFEST} (not a dataset, or its rebuild did not finish)"
        )
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=DatasetManifest)
    except msgspec.DecodeError as e:
        raise DatasetError(f"{path}: invalid manifest: {e}") from None
    if manifest.format != DATASET_FORMAT:
        raise DatasetError(
            f"{path}: unknown dataset format {manifest.format!r} (expected {DATASET_FORMAT!r})"
        )
    return manifest


def shard_paths(dataset_dir: Path) -> list[Path]:
    """Paths of the shards listed in the manifest, in order."""
    return [Path(dataset_dir) / s.file for s in read_manifest(dataset_dir).shards]


def iter_samples(dataset_dir: Path, *, verify: bool = True) -> Iterator[Sample]:
    """Every sample of a dataset, in order; with ``verify`` each shard must match its sha256."""
    for shard in read_manifest(dataset_dir).shards:
        path = Path(dataset_dir) / shard.file
        if not path.is_file():
            raise DatasetError(
                f"{dataset_dir}: shard {shard.file} listed in the manifest is missing"
            )
        data = path.read_bytes()
        if verify and _sha256(data) != shard.sha256:
            raise DatasetError(
                f"{path}: sha256 differs from the manifest (modified or half-written)"
            )
        for n, line in enumerate(data.splitlines(), 1):
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError as e:
                raise DatasetError(f"{path}:{n}: not a Sample: {e}") from None


def hf_features() -> datasets.Features:
    """``datasets.Features`` of a shard row, for ``load_dataset("json", ...,
    features=hf_features())``."""
    from datasets import Features, List, Value

    message = {"role": Value("string"), "content": Value("string")}
    return Features(
        {
            "kind_tag": Value("string"),
            "sample_id": Value("string"),
            "run_id": Value("string"),
            "kind": Value("string"),
            "materializer": Value("string"),
            "env": Value("string"),
            "task_id": Value("string"),
            "episode_id": Value("string"),
            "messages": List(message),
            "target_turn": Value("int64"),
            "prompt_ids": List(Value("int64")),
            "completion_ids": List(Value("int64")),
            "policy_version": Value("string"),
            "weight": Value("float64"),
            "source_event_ids": List(Value("string")),
            "advantage": Value("float64"),
            "reward": Value("float64"),
            "behaviour_logprobs": List(Value("float64")),
            "group_id": Value("string"),
        }
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
