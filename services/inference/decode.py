"""Batched decoding with a KV cache for the CPU inference server: prefill (also from a cached prompt
prefix), decode steps, merging and trimming of the running batch, and SGLang's stop rules. Pure torch, no
I/O and no threads (``services/inference/engine.py`` runs it).

A :class:`DecodeBatch` holds the running sequences right-aligned: every row's real tokens end at the
last cache column and padding sits on the left, masked out. New sequences are prefilled in their own
left-padded batch and merged in between decode steps (continuous batching); finished ones are dropped
and all-padding columns trimmed. Positions are tracked per row, so a row's keys are exactly those of the
same prompt run alone (RoPE is applied before caching; padding only adds masked columns).

Token choice (greedy, seeded sampling, top-p/top-k) is in ``services/inference/sampling.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = [
    "DecodeBatch",
    "GenSequence",
    "GenSpec",
    "StopChecker",
    "merge_batches",
    "prefill",
    "prefill_cached",
    "prompt_kv",
]


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, kw_only=True)
class GenSpec:
    """Validated sampling parameters of one sequence (SGLang names and meanings)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None


@dataclass(eq=False)
class GenSequence:
    """Mutable state of one generated sequence (one of the ``n`` of a prompt)."""

    prompt: list[int]
    spec: GenSpec
    group: Any = None
    """Opaque owner (the engine's request record)."""
    generator: torch.Generator = field(default_factory=torch.Generator)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    """SGLang ``finish_reason`` once finished."""
    text: str = ""
    weight_version: str = "default"
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""

    def __post_init__(self) -> None:
        self.generator.manual_seed(self.spec.seed if self.spec.seed is not None else secrets.randbits(63))


class StopChecker:
    """Applies SGLang's stop rules to a sequence after each new token and renders the final text."""

    def __init__(self, tokenizer: _Decoder, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def accept(self, seq: GenSequence, token: int, logprob: float) -> bool:
        """Append ``token``; set ``seq.finish`` and return True when the sequence is done."""
        seq.output_ids.append(token)
        seq.logprobs.append(logprob)
        spec = seq.spec
        # SGLang's order: the length cap wins over a stop token or string arriving on the last step
        if len(seq.output_ids) >= spec.max_new_tokens:
            seq.finish = {"type": "length", "length": spec.max_new_tokens}
        elif not spec.ignore_eos and (token in self.eos_ids or token in spec.stop_token_ids):
            seq.finish = {"type": "stop", "matched": token}
        elif spec.stop and (matched := self._stop_string(seq)) is not None:
            seq.finish = {"type": "stop", "matched": matched}
        return seq.finish is not None

    def _stop_string(self, seq: GenSequence) -> str | None:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.spec.skip_special_tokens)
        found = [(text.find(s), s) for s in seq.spec.stop if s and s in text]
        return min(found)[1] if found else None

    def finalize(self, seq: GenSequence) -> None:
        """Set ``seq.text``: matched stop token left out, text cut before a matched stop string."""
        spec, finish = seq.spec, seq.finish or {}
        ids = seq.output_ids
        matched = finish.get("matched")
        if isinstance(matched, int) and not spec.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=spec.skip_special_tokens)
        if isinstance(matched, str) and not spec.no_stop_trim and matched in text:
            text = text[: text.find(matched)]
        seq.text = text


@dataclass(eq=False)
class DecodeBatch:
    """Running sequences with their KV cache, right-aligned; ``mask`` is ``[B, T]`` (1 = real token)."""

    seqs: list[GenSequence]
    cache: DynamicCache
    mask: torch.Tensor
    next_pos: torch.Tensor
    """``[B]`` position id of each row's next token (= real tokens so far)."""

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        """Cache length in columns (padding included)."""
        return int(self.mask.shape[1])

    def step(self, model: Any) -> torch.Tensor:
        """Feed each row's last token; returns next-token logits ``[B, V]``."""
        last = torch.tensor([[s.output_ids[-1]] for s in self.seqs], dtype=torch.long)
        self.mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=self.mask.dtype)], dim=1)
        out = model(
            input_ids=last,
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None],
            cache=self.cache,
            use_cache=True,
        )
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and trim columns that became padding in every row."""
        index = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[r] for r in rows]
        self.mask = self.mask.index_select(0, index)
        self.next_pos = self.next_pos.index_select(0, index)
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else self.width
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[..., first:, :]
            layer.values = layer.values.index_select(0, index)[..., first:, :]
        self.mask = self.mask[:, first:]


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers; merging and trimming assume plain full-attention layers ``[B, H, T, D]``."""
    layers = list(cache.layers)
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"the CPU server only batches full-attention models, got a {type(layer).__name__}"
            )
    return layers


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge_batches(a: DecodeBatch, b: DecodeBatch) -> DecodeBatch:
    """One batch with ``a``'s rows then ``b``'s, the narrower left-padded to the wider's width."""
    width = max(a.width, b.width)
    for la, lb in zip(_layers(a.cache), _layers(b.cache), strict=True):
        la.keys = torch.cat([_pad_left(la.keys, width, -2), _pad_left(lb.keys, width, -2)], dim=0)
        la.values = torch.cat([_pad_left(la.values, width, -2), _pad_left(lb.values, width, -2)], dim=0)
    mask = torch.cat([_pad_left(a.mask, width, 1), _pad_left(b.mask, width, 1)], dim=0)
    return DecodeBatch(
        seqs=a.seqs + b.seqs, cache=a.cache, mask=mask, next_pos=torch.cat([a.next_pos, b.next_pos])
    )


def prefill(model: Any, seqs: list[GenSequence], pad_id: int) -> tuple[DecodeBatch, torch.Tensor]:
    """Run the prompts of ``seqs``, left-padded; returns the batch (one row per sequence) and the first
    next-token logits ``[B, V]``. The ``n`` copies of a prompt share one list object, hence one row."""
    firsts: dict[int, int] = {}
    prompts: list[list[int]] = []
    rows: list[int] = []
    for s in seqs:
        key = id(s.prompt)
        if key not in firsts:
            firsts[key] = len(prompts)
            prompts.append(s.prompt)
        rows.append(firsts[key])
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    _layers(cache)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1, :]
    if rows != list(range(len(prompts))):
        mask, logits = _expand_rows(cache, mask, logits, rows)
    next_pos = mask.sum(dim=1)
    return DecodeBatch(seqs=list(seqs), cache=cache, mask=mask, next_pos=next_pos), logits


def _expand_rows(
    cache: DynamicCache, mask: torch.Tensor, logits: torch.Tensor, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(rows, dtype=torch.long)
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
    return mask.index_select(0, index), logits.index_select(0, index)


def prefill_cached(
    model: Any, seqs: list[GenSequence], kv: Seq[tuple[torch.Tensor, torch.Tensor]], cached: int
) -> tuple[DecodeBatch, torch.Tensor]:
    """Prefill copies of one prompt whose first ``cached`` tokens' KV is ``kv`` (from the prefix cache):
    only the suffix runs through the model. Returns the batch and next-token logits as :func:`prefill`."""
    prompt = seqs[0].prompt
    if any(s.prompt is not prompt for s in seqs) or not 0 < cached < len(prompt):
        raise ValueError(
            f"prefill_cached needs copies of one prompt and 0 < cached < {len(prompt)}, got {cached}"
        )
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in zip(_layers(cache), kv, strict=True):
        layer.update(k[..., :cached, :], v[..., :cached, :])
    width = len(prompt)
    out = model(
        input_ids=torch.tensor([prompt[cached:]], dtype=torch.long),
        attention_mask=torch.ones((1, width), dtype=torch.long),
        position_ids=torch.arange(cached, width, dtype=torch.long)[None],
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    mask, logits = _expand_rows(
        cache, torch.ones((1, width), dtype=torch.long), out.logits[:, -1, :], [0] * len(seqs)
    )
    for s in seqs:
        s.cached_tokens = cached
    return DecodeBatch(seqs=list(seqs), cache=cache, mask=mask, next_pos=mask.sum(dim=1)), logits


def prompt_kv(batch: DecodeBatch, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of ``row``'s prompt KV, ``[1, H, len(prompt), D]`` per layer; call right after prefill
    (before decode steps add columns)."""
    length = len(batch.seqs[row].prompt)
    return [
        (
            layer.keys[row : row + 1, :, -length:, :].clone(),
            layer.values[row : row + 1, :, -length:, :].clone(),
        )
        for layer in _layers(batch.cache)
    ]
