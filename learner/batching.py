"""From a global batch of :class:`protocol.Sample` to per-rank micro-batches of tensors.

Layout: each row is ``prompt_ids + completion_ids``, **left-padded** to the micro-batch's longest row,
with ``position_ids`` restarting at 0 on the first real token. Left padding puts every completion at the
right edge, so the model only needs logits for the last ``Cmax + 1`` positions (``logits_to_keep``): the
[B, T, V] logits of a full sequence (V = 49k for SmolLM2) are never built, which matters more than the
padding itself when prompts are 10x longer than actions.

Length bucketing (``bucketing = "length"``): the global batch is sorted by length and cut into *global*
micro-batches that fit ``micro_batch_tokens`` padded tokens per rank; each global micro-batch is dealt
round-robin to the ranks. Every rank therefore runs the same number of micro-batches (FSDP's collectives
need that; an empty share becomes a zero-weight dummy row), and since gradients accumulate over the
whole global batch, the order inside it does not change the step. True packing (several samples in one
row with a block-diagonal mask) needs varlen attention kernels that HF's CPU SDPA path lacks; bucketing
gets most of the gain (see ``bench/learner.py``). ``bucketing = "none"`` is the naive baseline: fixed
``micro_batch_size`` rows per rank in arrival order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.config import BatchConfig
from learner.losses import IGNORE, KIND_INDEX, KINDS, KindTokens
from protocol.samples import Sample

__all__ = [
    "MicroBatch",
    "TrainItem",
    "collate",
    "kind_tokens",
    "plan_micro_batches",
    "to_items",
    "unusable",
]


@dataclass(frozen=True)
class TrainItem:
    """One sample as token ids plus the scalars the loss needs."""

    sample_id: str
    input_ids: tuple[int, ...]
    """``prompt_ids + completion_ids``."""
    completion_len: int
    """Number of target tokens (the last ``completion_len`` of ``input_ids``)."""
    kind: int
    """Index into :data:`learner.losses.KINDS`."""
    weight: float
    advantage: float
    behaviour_logprobs: tuple[float, ...] | None

    @property
    def length(self) -> int:
        """Tokens in the row."""
        return len(self.input_ids)


def unusable(sample: Sample, max_seq_len: int) -> str | None:
    """Why ``sample`` cannot be trained (``None`` if it can): never truncated, never half-used."""
    n = len(sample.prompt_ids) + len(sample.completion_ids)
    bl = sample.behaviour_logprobs
    if not sample.completion_ids or not sample.prompt_ids:
        return "empty prompt or completion"
    if n > max_seq_len:
        return f"{n} tokens > max_seq_len {max_seq_len}"
    if bl is not None and len(bl) != len(sample.completion_ids):
        return f"{len(bl)} behaviour logprobs for {len(sample.completion_ids)} completion tokens"
    if sample.kind == "grpo" and sample.advantage is None:
        return "grpo sample without an advantage"
    return None


def to_items(samples: Sequence[Sample], max_seq_len: int) -> tuple[list[TrainItem], list[tuple[str, str]]]:
    """Encode samples; returns ``(items, skipped)`` with ``(sample_id, reason)`` per unusable sample."""
    items: list[TrainItem] = []
    skipped: list[tuple[str, str]] = []
    for s in samples:
        reason = unusable(s, max_seq_len)
        if reason is not None:
            skipped.append((s.sample_id, reason))
            continue
        bl = s.behaviour_logprobs
        items.append(
            TrainItem(
                sample_id=s.sample_id,
                input_ids=(*s.prompt_ids, *s.completion_ids),
                completion_len=len(s.completion_ids),
                kind=KIND_INDEX[s.kind],
                weight=float(s.weight),
                advantage=float(s.advantage or 0.0),
                behaviour_logprobs=tuple(bl) if bl is not None else None,
            )
        )
    return items, skipped


def kind_tokens(items: Sequence[TrainItem]) -> KindTokens:
    """Target tokens per kind: the loss denominators of the global batch."""
    counts = [0.0] * len(KINDS)
    for it in items:
        counts[it.kind] += it.completion_len
    return KindTokens(*counts)


def _deal(group: list[int], world_size: int) -> list[list[int]]:
    return [group[r::world_size] for r in range(world_size)]


def plan_micro_batches(
    items: Sequence[TrainItem], world_size: int, cfg: BatchConfig
) -> list[list[list[int]]]:
    """``plan[m][rank]`` = indices into ``items`` of rank's rows in micro-batch m (may be empty)."""
    if not items:
        return []
    order = list(range(len(items)))
    if cfg.bucketing == "none":
        step = cfg.micro_batch_size * world_size
        return [_deal(order[i : i + step], world_size) for i in range(0, len(order), step)]
    # Longest first: a micro-batch that does not fit memory fails on the first step, not the last.
    order.sort(key=lambda i: (-items[i].length, i))
    plan: list[list[list[int]]] = []
    group: list[int] = []
    for i in order:
        longest = items[group[0]].length if group else items[i].length
        rows_per_rank = math.ceil((len(group) + 1) / world_size)
        if group and rows_per_rank * longest > cfg.micro_batch_tokens:
            plan.append(_deal(group, world_size))
            group = []
        group.append(i)
    plan.append(_deal(group, world_size))
    return plan


@dataclass
class MicroBatch:
    """Tensors of one rank's micro-batch (left-padded)."""

    input_ids: Tensor
    """[B, T] token ids, pad on the left."""
    attention_mask: Tensor
    """[B, T] 1 for real tokens."""
    position_ids: Tensor
    """[B, T] 0.. from the first real token."""
    labels: Tensor
    """[B, K] targets for the logits of the last K+1 positions minus the final one; IGNORE elsewhere."""
    kinds: Tensor
    """[B] kind index."""
    weights: Tensor
    """[B] sample weight (0 for a dummy row)."""
    advantages: Tensor
    """[B] GRPO advantage."""
    behaviour_logp: Tensor
    """[B, K] behaviour logprobs aligned with ``labels`` (0 where absent)."""
    has_behaviour: Tensor
    """[B] whether the row has behaviour logprobs."""
    real_tokens: int
    """Non-pad tokens."""
    padded_tokens: int
    """B * T."""

    @property
    def keep(self) -> int:
        """``logits_to_keep`` for the model: K + 1."""
        return int(self.labels.shape[1]) + 1


def _dummy_item(pad_id: int) -> TrainItem:
    # A rank with no rows still runs forward/backward so FSDP's collectives line up; weight 0, no labels.
    return TrainItem("", (pad_id, pad_id), 1, KIND_INDEX["cf"], 0.0, 0.0, None)


def collate(items: Sequence[TrainItem], pad_id: int, device: torch.device | str = "cpu") -> MicroBatch:
    """Left-pad ``items`` into a :class:`MicroBatch` (an empty list gives one dummy row with no loss)."""
    dummy = not items
    rows = [_dummy_item(pad_id)] if dummy else list(items)
    b, t = len(rows), max(r.length for r in rows)
    k = max(r.completion_len for r in rows)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.long)
    labels = torch.full((b, k), IGNORE, dtype=torch.long)
    behaviour = torch.zeros((b, k), dtype=torch.float32)
    for i, r in enumerate(rows):
        ids[i, t - r.length :] = torch.tensor(r.input_ids, dtype=torch.long)
        mask[i, t - r.length :] = 1
        if not dummy:
            labels[i, k - r.completion_len :] = torch.tensor(r.input_ids[-r.completion_len :])
        if r.behaviour_logprobs is not None:
            behaviour[i, k - r.completion_len :] = torch.tensor(r.behaviour_logprobs)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return MicroBatch(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        labels=labels.to(device),
        kinds=torch.tensor([r.kind for r in rows], dtype=torch.long, device=device),
        weights=torch.tensor([r.weight for r in rows], dtype=torch.float32, device=device),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        behaviour_logp=behaviour.to(device),
        has_behaviour=torch.tensor([r.behaviour_logprobs is not None for r in rows], device=device),
        real_tokens=0 if dummy else sum(r.length for r in rows),
        padded_tokens=b * t,
    )
