"""From a global batch of :class:`protocol.Sample` to per-rank micro-batches of tensors.

Two layouts, one label layout. Either way the loss sees ``labels [S, K]``: sample i's completion
tokens right-aligned in its row of K slots (IGNORE elsewhere), with per-sample kinds, weights,
advantages and behaviour logprobs; :meth:`MicroBatch.sample_logprobs` maps the model's logits onto
that layout. So the losses (``learner/losses.py``) are the same functions of the same per-sample
tensors in every mode.

- **Left-padded rows** (``bucketing = "length" | "none"``): each row is ``prompt_ids +
  completion_ids``, left-padded to the micro-batch's longest row, ``position_ids`` restarting at 0
  on the first real token. Left padding puts every completion at the right edge, so the model only
  needs logits for the last ``K + 1`` positions (``logits_to_keep``): the [B, T, V] logits (V = 49k
  for SmolLM2) are never built.
- **Packed rows** (``bucketing = "pack"``): a rank's micro-batch is ONE row holding several whole
  samples back to back (first-fit decreasing up to ``micro_batch_tokens``), positions restarting at
  0 for each, attention causal within each sample only (``cu_seq_lens``, ``learner/attention.py``).
  No padding at all; ``logits_to_keep`` is the tensor of the row's positions that predict a
  completion token. With ``share_prefix``, the prompt prefix common to the whole step
  (:func:`shared_prefix_len`) heads each row once and every sample keeps only its rest, positions
  continuing after the prefix, its tokens attending to the prefix and to its own earlier tokens:
  what each sample computes is unchanged, the prefix is computed once per row instead of once per
  sample.

Length bucketing (``bucketing = "length"``): the global batch is sorted by length and cut into
*global* micro-batches that fit ``micro_batch_tokens`` padded tokens per rank; each global
micro-batch is dealt round-robin to the ranks. Packing deals its rows the same way, one row per rank
per micro-batch. Every rank therefore runs the same number of micro-batches (FSDP's collectives need
that; an empty share becomes a zero-weight dummy row), and since gradients accumulate over the whole
global batch, the order inside it does not change the step. ``bucketing = "none"`` is the naive
baseline: fixed ``micro_batch_size`` rows per rank in arrival order. Speed of each:
``bench/learner.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from leafe.learner.config import BatchConfig
from leafe.learner.losses import IGNORE, KIND_INDEX, KINDS, LOSS_TERM, KindTokens, token_logprobs
from leafe.protocol.samples import Sample

__all__ = [
    "MIN_SHARED_PREFIX",
    "MicroBatch",
    "Packing",
    "TrainItem",
    "collate",
    "collate_packed",
    "kind_tokens",
    "out_of_vocab",
    "pack_rows",
    "plan_micro_batches",
    "shared_prefix_len",
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
    """Index into :data:`leafe.learner.losses.KINDS`."""
    weight: float
    advantage: float
    behaviour_logprobs: tuple[float, ...] | None

    @property
    def length(self) -> int:
        """Tokens in the row."""
        return len(self.input_ids)


def out_of_vocab(sample: Sample, vocab_size: int) -> str | None:
    """Why ``sample`` holds an id outside ``0..vocab_size-1`` (the model's embedding would raise on
    it), or ``None``. The learner's consumer dead-letters such a sample; :func:`unusable` skips
    it."""
    for part, ids in (("prompt", sample.prompt_ids), ("completion", sample.completion_ids)):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(i for i in ids if not 0 <= i < vocab_size)
            return f"{part} token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})"
    return None


def unusable(sample: Sample, max_seq_len: int, vocab_size: int | None = None) -> str | None:
    """Why ``sample`` cannot be trained (``None`` if it can): never truncated, never half-used,
    never an id the model has no embedding for (``vocab_size``: its embedding rows; ``None`` skips
    that check)."""
    n = len(sample.prompt_ids) + len(sample.completion_ids)
    bl = sample.behaviour_logprobs
    if not sample.completion_ids or not sample.prompt_ids:
        return "empty prompt or completion"
    if n > max_seq_len:
        return f"{n} tokens > max_seq_len {max_seq_len}"
    if vocab_size is not None and (why := out_of_vocab(sample, vocab_size)) is not None:
        return why
    if bl is not None and len(bl) != len(sample.completion_ids):
        return f"{len(bl)} behaviour logprobs for {len(sample.completion_ids)} completion tokens"
    if sample.kind == "grpo" and sample.advantage is None:
        return "grpo sample without an advantage"
    return None


def to_items(
    samples: Sequence[Sample], max_seq_len: int, vocab_size: int | None = None
) -> tuple[list[TrainItem], list[tuple[str, str]]]:
    """Encode samples; returns ``(items, skipped)`` with ``(sample_id, reason)`` per unusable
    sample."""
    items: list[TrainItem] = []
    skipped: list[tuple[str, str]] = []
    for s in samples:
        reason = unusable(s, max_seq_len, vocab_size)
        if reason is not None:
            skipped.append((s.sample_id, reason))
            continue
        bl = s.behaviour_logprobs
        items.append(
            TrainItem(
                sample_id=s.sample_id,
                input_ids=(*s.prompt_ids, *s.completion_ids),
                completion_len=len(s.completion_ids),
                kind=KIND_INDEX[LOSS_TERM[s.kind]],
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


def _longest_first(items: Sequence[TrainItem]) -> list[int]:
    # Longest first: a micro-batch that does not fit memory fails on the first step, not the last.
    return sorted(range(len(items)), key=lambda i: (-items[i].length, i))


def _bucket(items: Sequence[TrainItem], world_size: int, budget: int) -> list[list[list[int]]]:
    plan: list[list[list[int]]] = []
    group: list[int] = []
    for i in _longest_first(items):
        longest = items[group[0]].length if group else items[i].length
        rows_per_rank = math.ceil((len(group) + 1) / world_size)
        if group and rows_per_rank * longest > budget:
            plan.append(_deal(group, world_size))
            group = []
        group.append(i)
    plan.append(_deal(group, world_size))
    return plan


MIN_SHARED_PREFIX = 32
"""A common prefix shorter than this is not shared: each sample's segment then needs an explicit
mask instead of SDPA's causal fast path, which a few saved tokens (a chat template's header) do not
repay."""


def shared_prefix_len(items: Sequence[TrainItem], minimum: int = MIN_SHARED_PREFIX) -> int:
    """Tokens of the longest prefix every item's prompt starts with, at most each prompt's length -
    1 (the last prompt token, which predicts the first completion token, stays the item's own); 0
    for < 2 items or a common prefix shorter than ``minimum``."""
    if len(items) < 2:
        return 0
    first = items[0].input_ids
    cap = min(it.length - it.completion_len for it in items) - 1
    n = 0
    while n < cap and all(it.input_ids[n] == first[n] for it in items):
        n += 1
    return n if n >= minimum else 0


def pack_rows(items: Sequence[TrainItem], budget: int, prefix: int = 0) -> list[list[int]]:
    """First-fit decreasing: rows of item indices, each row's tokens <= ``budget`` (a longer item
    gets a row of its own). With a shared ``prefix``, a row holds the prefix once and each item's
    remaining ``length - prefix`` tokens. Deterministic; rows come out fullest-first."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in _longest_first(items):
        n = items[i].length - prefix
        fit = next((r for r, free in enumerate(room) if n <= free), None)
        if fit is None:
            rows.append([i])
            room.append(budget - prefix - n)
        else:
            rows[fit].append(i)
            room[fit] -= n
    return rows


def plan_micro_batches(
    items: Sequence[TrainItem], world_size: int, cfg: BatchConfig
) -> list[list[list[int]]]:
    """``plan[m][rank]`` = indices into ``items`` of rank's samples in micro-batch m (may be empty);
    in ``pack`` mode those samples form one packed row."""
    if not items:
        return []
    if cfg.bucketing == "none":
        order = list(range(len(items)))
        step = cfg.micro_batch_size * world_size
        return [_deal(order[i : i + step], world_size) for i in range(0, len(order), step)]
    if cfg.bucketing == "length":
        return _bucket(items, world_size, cfg.micro_batch_tokens)
    rows = pack_rows(
        items, cfg.micro_batch_tokens, shared_prefix_len(items) if cfg.share_prefix else 0
    )
    rows += [[] for _ in range(-len(rows) % world_size)]
    return [rows[m : m + world_size] for m in range(0, len(rows), world_size)]


@dataclass(frozen=True)
class Packing:
    """Where a packed row's samples and targets are."""

    cu_seq_lens: Tensor
    """[n + 1] int32 sample boundaries in the row (0, len_0, len_0 + len_1, ..., T)."""
    keep: Tensor
    """[N] positions whose logits predict a completion token (``logits_to_keep``)."""
    targets: Tensor
    """[1, N] the token each kept position predicts (IGNORE for the dummy row)."""
    sample: Tensor
    """[N] sample index (row of ``MicroBatch.labels``) of each kept position."""
    slot: Tensor
    """[N] label slot (column of ``MicroBatch.labels``) of each kept position."""
    prefix: int = 0
    """Tokens of the shared prefix heading the row (its first segment); 0: no shared prefix."""


@dataclass
class MicroBatch:
    """Tensors of one rank's micro-batch: R model rows holding S samples (R = S left-padded, R = 1
    packed)."""

    input_ids: Tensor
    """[R, T] token ids (left-padded rows, or one packed row)."""
    attention_mask: Tensor | None
    """[R, T] 1 for real tokens; None for a packed row (``packing`` says where samples are)."""
    position_ids: Tensor
    """[R, T] 0.. from each sample's first token."""
    labels: Tensor
    """[S, K] sample i's completion tokens right-aligned in row i; IGNORE elsewhere."""
    kinds: Tensor
    """[S] kind index."""
    weights: Tensor
    """[S] sample weight (0 for a dummy row)."""
    advantages: Tensor
    """[S] GRPO advantage."""
    behaviour_logp: Tensor
    """[S, K] behaviour logprobs aligned with ``labels`` (0 where absent)."""
    has_behaviour: Tensor
    """[S] whether the sample has behaviour logprobs."""
    real_tokens: int
    """Non-pad tokens."""
    padded_tokens: int
    """R * T."""
    packing: Packing | None = None
    """The packed row's layout; None for left-padded rows."""

    @property
    def keep(self) -> int:
        """Left-padded rows: ``logits_to_keep`` for the model, K + 1."""
        return int(self.labels.shape[1]) + 1

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the causal LM's forward (without ``use_cache``)."""
        inputs: dict[str, Any] = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }
        if self.packing is None:
            return inputs | {"logits_to_keep": self.keep}
        cu = self.packing.cu_seq_lens
        inputs |= {"logits_to_keep": self.packing.keep, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
        return inputs | ({"shared_prefix_len": self.packing.prefix} if self.packing.prefix else {})

    def sample_logprobs(self, logits: Tensor) -> Tensor:
        """[S, K] log p(label) per sample and slot (0 where IGNORE) from the logits of
        :meth:`model_inputs`."""
        if self.packing is None:
            return token_logprobs(logits[:, :-1], self.labels)
        flat = token_logprobs(logits, self.packing.targets)[0]
        out = flat.new_zeros(self.labels.shape)
        return out.index_put((self.packing.sample, self.packing.slot), flat)


def _dummy_item(pad_id: int) -> TrainItem:
    # A rank with no rows still runs forward/backward so FSDP's collectives line up; weight 0, no
    # labels.
    return TrainItem("", (pad_id, pad_id), 1, KIND_INDEX["cf"], 0.0, 0.0, None)


def _micro_batch(
    rows: Sequence[TrainItem], dummy: bool, device: torch.device | str, **model_rows: Any
) -> MicroBatch:
    """Per-sample tensors (labels, kinds, ...) around the model rows given in ``model_rows``."""
    k = max(r.completion_len for r in rows)
    labels = torch.full((len(rows), k), IGNORE, dtype=torch.long)
    behaviour = torch.zeros((len(rows), k), dtype=torch.float32)
    for i, r in enumerate(rows):
        if not dummy:
            labels[i, k - r.completion_len :] = torch.tensor(r.input_ids[-r.completion_len :])
        if r.behaviour_logprobs is not None:
            behaviour[i, k - r.completion_len :] = torch.tensor(r.behaviour_logprobs)
    return MicroBatch(
        labels=labels.to(device),
        kinds=torch.tensor([r.kind for r in rows], dtype=torch.long, device=device),
        weights=torch.tensor([r.weight for r in rows], dtype=torch.float32, device=device),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        behaviour_logp=behaviour.to(device),
        has_behaviour=torch.tensor([r.behaviour_logprobs is not None for r in rows], device=device),
        real_tokens=0 if dummy else sum(r.length for r in rows),
        **model_rows,
    )


def collate(
    items: Sequence[TrainItem], pad_id: int, device: torch.device | str = "cpu"
) -> MicroBatch:
    """Left-pad ``items`` into a :class:`MicroBatch` (an empty list gives one dummy row with no
    loss)."""
    dummy = not items
    rows = [_dummy_item(pad_id)] if dummy else list(items)
    b, t = len(rows), max(r.length for r in rows)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - r.length :] = torch.tensor(r.input_ids, dtype=torch.long)
        mask[i, t - r.length :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return _micro_batch(
        rows,
        dummy,
        device,
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        padded_tokens=b * t,
    )


def collate_packed(
    items: Sequence[TrainItem],
    pad_id: int,
    device: torch.device | str = "cpu",
    *,
    share_prefix: bool = False,
) -> MicroBatch:
    """Pack ``items`` into one row (an empty list gives a dummy row with no loss); with
    ``share_prefix``, their common prompt prefix (:func:`shared_prefix_len`) once, then each item's
    rest."""
    dummy = not items
    rows = [_dummy_item(pad_id)] if dummy else list(items)
    p = shared_prefix_len(rows) if share_prefix else 0
    k = max(r.completion_len for r in rows)
    # Segments: the shared prefix (when there is one), then each item's own tokens after it.
    starts = [0, *itertools.accumulate((r.length - p for r in rows), initial=p)]
    if not p:
        starts = starts[1:]  # no prefix segment: [0, len_0, len_0 + len_1, ...]
    own = starts[1:-1] if p else starts[:-1]
    keep: list[int] = []
    sample: list[int] = []
    slot: list[int] = []
    for i, (r, start) in enumerate(zip(rows, own, strict=True)):
        # The logits at position p predict token p + 1: the completion's predictors end one token
        # early.
        first = start + r.length - p - r.completion_len - 1
        keep += range(first, first + r.completion_len)
        sample += [i] * r.completion_len
        slot += range(k - r.completion_len, k)
    ids = torch.tensor(
        [*rows[0].input_ids[:p], *(t for r in rows for t in r.input_ids[p:])], dtype=torch.long
    )
    keep_t = torch.tensor(keep, dtype=torch.long)
    targets = torch.full_like(keep_t, IGNORE) if dummy else ids[keep_t + 1]
    packing = Packing(
        cu_seq_lens=torch.tensor(starts, dtype=torch.int32, device=device),
        keep=keep_t.to(device),
        targets=targets.unsqueeze(0).to(device),
        sample=torch.tensor(sample, dtype=torch.long, device=device),
        slot=torch.tensor(slot, dtype=torch.long, device=device),
        prefix=p,
    )
    positions = torch.cat([torch.arange(p), *(torch.arange(p, r.length) for r in rows)])
    return _micro_batch(
        rows,
        dummy,
        device,
        input_ids=ids.unsqueeze(0).to(device),
        attention_mask=None,
        position_ids=positions.unsqueeze(0).to(device),
        padded_tokens=len(ids),
        packing=packing,
    )
