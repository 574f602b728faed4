"""Dataset shards written from materialized samples: determinism, manifest, reading back, HF
loading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from leafe.actors.fake_episodes import (
    ExploreSpec,
    build_explore_episode,
    build_rollout_group,
    interleave,
)
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.dataset import (
    DatasetError,
    hf_features,
    iter_samples,
    read_manifest,
    shard_paths,
    write_dataset,
)
from leafe.learner.materializers import Materializer, fold_events, make_materializer
from leafe.protocol.samples import Sample

TOK = ByteChatTokenizer()


def _log(seed: int = 0) -> list[list]:
    rng = random.Random(seed)
    streams = [
        build_explore_episode(
            ExploreSpec(seed=i, max_depth=3, p_success=0.3),
            run_id="r1",
            episode_id=f"e{i}",
            tokenizer=TOK,
        )
        for i in range(12)
    ]
    for g in range(3):
        streams += build_rollout_group(
            rng, run_id="r1", group_id=f"g{g}", n=4, tokenizer=TOK, p_success=0.5
        )
    return streams


def _samples(name: str, seed: int, **options: object) -> tuple[list[Sample], Materializer]:
    fold = make_materializer(name, TOK, **options)
    result = fold_events(interleave(_log(), random.Random(seed)), fold)
    return result.samples, fold


def test_rebuild_is_byte_identical_and_order_independent(tmp_path: Path) -> None:
    """Two rebuilds from different interleavings write identical shard bytes and manifests."""
    a, fa = _samples("leafe", 1, rehearsal_fraction=0.5)
    b, _ = _samples("leafe", 2, rehearsal_fraction=0.5)
    ma = write_dataset(
        a, tmp_path / "a", materializer=fa.describe(), shard_size=7, source={"run_id": "r1"}
    )
    mb = write_dataset(
        b, tmp_path / "b", materializer=fa.describe(), shard_size=7, source={"run_id": "r1"}
    )
    assert ma.content_sha256 == mb.content_sha256 and len(ma.shards) > 1
    for x, y in zip(shard_paths(tmp_path / "a"), shard_paths(tmp_path / "b"), strict=True):
        assert x.read_bytes() == y.read_bytes()
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (
        tmp_path / "b" / "manifest.json"
    ).read_bytes()


def test_manifest_counts_and_round_trip(tmp_path: Path) -> None:
    """The manifest counts kinds and envs; iter_samples returns the samples sorted by id,
    unchanged."""
    samples, fold = _samples("leafe", 0, rehearsal_fraction=1.0)
    manifest = write_dataset(samples, tmp_path, materializer=fold.describe(), shard_size=5)
    assert manifest.samples == len(samples) == sum(manifest.counts_by_kind.values())
    assert manifest.counts_by_kind == {k: sum(s.kind == k for s in samples) for k in ("cf", "reh")}
    assert manifest.counts_by_env == {"sokoban": len(samples)}
    assert (
        manifest.materializer["name"] == "leafe"
        and manifest.materializer["options"]["rehearsal_fraction"] == 1.0
    )
    back = list(iter_samples(tmp_path))
    assert back == sorted(samples, key=lambda s: s.sample_id)
    assert read_manifest(tmp_path) == manifest
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["content_sha256"] == manifest.content_sha256


def test_rewrite_removes_old_shards_and_detects_tampering(tmp_path: Path) -> None:
    """Rewriting a directory drops stale shards; a modified shard fails verification."""
    samples, fold = _samples("leafe", 0, rehearsal_fraction=1.0)
    write_dataset(samples, tmp_path, materializer=fold.describe(), shard_size=2)
    write_dataset(samples[:3], tmp_path, materializer=fold.describe(), shard_size=2)
    assert sorted(p.name for p in tmp_path.glob("samples-*.jsonl")) == [
        "samples-00000.jsonl",
        "samples-00001.jsonl",
    ]
    shard = tmp_path / "samples-00000.jsonl"
    shard.write_bytes(shard.read_bytes().replace(b'"weight":1.0', b'"weight":2.0', 1))
    with pytest.raises(DatasetError, match="sha256"):
        list(iter_samples(tmp_path))
    with pytest.raises(DatasetError, match=r"no manifest\.json"):
        read_manifest(tmp_path / "nothing")


def test_conflicting_samples_with_one_id_are_refused(tmp_path: Path) -> None:
    """Two different samples under one id mean a bug upstream: write_dataset refuses them."""
    samples, fold = _samples("leafe", 0, rehearsal_fraction=1.0)
    twin = msgspec.structs.replace(samples[0], weight=9.0)
    with pytest.raises(DatasetError, match=samples[0].sample_id):
        write_dataset([samples[0], twin], tmp_path, materializer=fold.describe())
    assert (
        write_dataset([samples[0], samples[0]], tmp_path, materializer=fold.describe()).samples == 1
    )


def test_shards_load_with_hf_datasets(tmp_path: Path) -> None:
    """datasets.load_dataset("json") reads leafe shards as is, and grpo shards with
    hf_features()."""
    datasets = pytest.importorskip("datasets")
    samples, fold = _samples("leafe", 0, rehearsal_fraction=1.0)
    write_dataset(samples, tmp_path / "leafe", materializer=fold.describe(), shard_size=4)
    files = [str(p) for p in shard_paths(tmp_path / "leafe")]
    ds = datasets.load_dataset(
        "json", data_files=files, split="train", cache_dir=str(tmp_path / "hf")
    )
    assert len(ds) == len(samples)
    first = min(samples, key=lambda s: s.sample_id)
    assert ds[0]["sample_id"] == first.sample_id and ds[0]["completion_ids"] == first.completion_ids
    assert ds[0]["messages"][first.target_turn]["role"] == "assistant"
    g, gfold = _samples("grpo", 0)
    write_dataset(g, tmp_path / "grpo", materializer=gfold.describe(), shard_size=3)
    files = [str(p) for p in shard_paths(tmp_path / "grpo")]
    gds = datasets.load_dataset(
        "json",
        data_files=files,
        split="train",
        features=hf_features(),
        cache_dir=str(tmp_path / "hf"),
    )
    assert len(gds) == len(g) > 0
    assert sorted(gds["advantage"]) == sorted(s.advantage or 0.0 for s in g)
