"""Shared helpers of the learner tests: synthetic samples and shards, publishing, weight comparison
(the fixtures ``tiny_dir``, ``one_thread`` and ``dist_env`` are in ``tests/conftest.py``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from leafe.protocol.samples import ChatMessage, Sample, SampleKind
from leafe.services.bus import NatsOptions

__all__ = [
    "assert_same_weights",
    "make_sample",
    "make_samples",
    "publish_samples",
    "write_shards",
]


def make_sample(
    i: int,
    *,
    kind: SampleKind = "cf",
    prompt_len: int | None = None,
    completion_len: int | None = None,
    vocab: int = 1000,
    policy_version: str = "default",
    weight: float = 1.0,
    advantage: float | None = None,
    behaviour_logprobs: list[float] | None = None,
    run_id: str = "r1",
) -> Sample:
    """A deterministic sample with random token ids (seeded by ``i``)."""
    r = random.Random(i)
    p = prompt_len if prompt_len is not None else r.randrange(4, 24)
    c = completion_len if completion_len is not None else r.randrange(1, 6)
    return Sample(
        sample_id=f"{run_id}.s{i:05d}",  # message ids are deduplicated stream-wide: unique per run
        run_id=run_id,
        kind=kind,
        materializer="test/1",
        env="toy",
        task_id=f"toy/{i % 7}",
        episode_id=f"ep{i}",
        messages=[
            ChatMessage(role="user", content=f"q{i}"),
            ChatMessage(role="assistant", content="a"),
        ],
        target_turn=1,
        prompt_ids=[r.randrange(2, vocab) for _ in range(p)],
        completion_ids=[r.randrange(2, vocab) for _ in range(c)],
        policy_version=policy_version,
        weight=weight,
        advantage=advantage if advantage is not None else (0.0 if kind == "grpo" else None),
        behaviour_logprobs=behaviour_logprobs,
    )


def make_samples(
    n: int, *, start: int = 0, kinds: Sequence[SampleKind] = ("cf", "reh")
) -> list[Sample]:
    """``n`` samples cycling through ``kinds``."""
    return [make_sample(start + i, kind=kinds[i % len(kinds)]) for i in range(n)]


def write_shards(
    data_dir: Path, samples: Sequence[Sample], per_shard: int = 16, *, bare: bool = False
) -> Path:
    """Write ``samples`` as a dataset (``leafe.learner.dataset.write_dataset``: shards + manifest,
    sorted by id) or, with ``bare``, as plain ``shard-*.jsonl`` files without a manifest; returns
    ``data_dir``."""
    if not bare:
        from leafe.learner.dataset import write_dataset

        write_dataset(samples, data_dir, materializer={"name": "test"}, shard_size=per_shard)
        return data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    enc = msgspec.json.Encoder()
    for k in range(0, len(samples), per_shard):
        with (data_dir / f"shard-{k // per_shard:05d}.jsonl").open("wb") as f:
            for s in samples[k : k + per_shard]:
                f.write(enc.encode(s) + b"\n")
    return data_dir


def assert_same_weights(
    a: dict[str, Any], b: dict[str, Any], *, max_lr: float, atol: float = 1e-5
) -> None:
    """Same keys and values up to float rounding. AdamW's first steps move every weight by about lr
    * sign(grad), so a weight whose gradient is ~0 may flip direction on rounding noise alone: allow
    at most 1 in 10^4 elements to differ, and by no more than 2 * lr per step taken (``max_lr`` =
    sum)."""
    assert a.keys() == b.keys()
    total = off = 0
    for k in a:
        d = (a[k].float() - b[k].float()).abs()
        total += d.numel()
        off += int((d > atol).sum())
        assert float(d.max()) <= 2 * max_lr + atol, (k, float(d.max()))
    assert off <= max(1, total // 10_000), f"{off} of {total} weights differ by more than {atol}"


async def publish_samples(nats: NatsOptions | str, samples: Sequence[Sample]) -> None:
    """Publish samples on ``leafe.<run>.samples.<kind>`` and wait for every ack (the streams exist:
    the session fixture made them)."""
    from leafe.protocol import sample_subject
    from leafe.services.bus import Publisher, connect

    nc = await connect(nats)
    js = nc.jetstream()
    async with Publisher(js) as pub:
        for s in samples:
            await pub.publish(sample_subject(s.run_id, s.kind), s)
    await nc.close()
