"""Continuous batching for the CPU inference server: the running sequences, their decode steps, and
SGLang's stop rules. Pure torch, no I/O and no threads (``services/inference/engine.py`` runs it).

A :class:`DecodeBatch` keeps its sequences in the rows of one KV arena
(``services/inference/kv.py``): every row's tokens end at the arena's write column, where a decode
step writes the next token of every row in place. A prefilled prompt
(``services/inference/prefill.py``) joins by copying its KV into a free row, right-aligned; one
longer than the batch moves the write column on and leaves the older rows a masked gap. A finished
row is replaced by the last row (one row copied), so the rows in use stay ``0..n-1`` and the model
always sees contiguous KV. Positions are tracked per row, so a row's keys are exactly those of the
same prompt run alone (RoPE is applied before caching; gaps are only masked columns). The arena is
reallocated only when it runs out of rows or columns; that also drops the leading columns no row
uses any more.

Token choice (greedy, seeded sampling, top-p/top-k) is in ``services/inference/sampling.py``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from leafe.services.inference.kv import ArenaCache, KVLayout

__all__ = ["DecodeBatch", "GenSequence", "GenSpec", "StopChecker"]


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class PromptKV(Protocol):
    """What decoding needs of a prefilled group (``prefill.Prefilled``; a protocol keeps the import
    one-way)."""

    arena: torch.Tensor

    def spans(self, row: int) -> list[tuple[int, int]]: ...


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
        self.generator.manual_seed(
            self.spec.seed if self.spec.seed is not None else secrets.randbits(63)
        )


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
        text = self.tokenizer.decode(
            seq.output_ids, skip_special_tokens=seq.spec.skip_special_tokens
        )
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


_SPARE_COLUMNS = 32
"""Columns allocated beyond the need when an arena grows: one reallocation (a copy of the batch's
KV) per ~32 decode steps, against attention over ~16 masked spare columns per step on average."""


@dataclass(eq=False)
class DecodeBatch:
    """Running sequences in rows ``0..n-1`` of a KV arena ``[layers, 2, rows, kv_heads, columns,
    dim]``."""

    layout: KVLayout
    seqs: list[GenSequence] = field(default_factory=list)
    arena: torch.Tensor | None = None
    mask: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 0), dtype=torch.bool))
    """``[rows, columns]``: True where a row has a token; False from ``write`` on, in every row."""
    next_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """``[rows]`` position id of each row's next token (= its tokens so far)."""
    write: int = 0
    """Column the next decode step writes (every row's tokens end just before it)."""

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def columns(self) -> int:
        """Arena width (the model attends over all of it; unused columns are masked)."""
        return int(self.mask.shape[1])

    def add(self, group: PromptKV, row: int, seqs: list[GenSequence]) -> None:
        """Give each of ``seqs`` a row holding the prompt KV of ``group``'s row ``row``."""
        spans = group.spans(row)
        length = sum(b - a for a, b in spans)
        self._reserve(len(self.seqs) + len(seqs), length)
        self.write = max(self.write, length)
        assert self.arena is not None
        for seq in seqs:
            slot = len(self.seqs)
            col = self.write - length
            self.mask[slot] = False
            for a, b in spans:
                self.arena[:, :, slot, :, col : col + b - a] = group.arena[:, :, row, :, a:b]
                col += b - a
            self.mask[slot, self.write - length : self.write] = True
            self.next_pos[slot] = length
            self.seqs.append(seq)

    def step(self, model: Any) -> torch.Tensor:
        """Feed each row's last token; returns next-token logits ``[B, V]``."""
        self._reserve(len(self.seqs), 0)
        assert self.arena is not None
        rows = len(self.seqs)
        last = torch.tensor([[s.output_ids[-1]] for s in self.seqs], dtype=torch.long)
        self.mask[:rows, self.write] = True
        out = model(
            input_ids=last,
            attention_mask=self.mask[:rows],
            position_ids=self.next_pos[:rows, None],
            cache=ArenaCache(self.arena, rows, self.write),
            use_cache=True,
        )
        self.write += 1
        self.next_pos[:rows] += 1
        return out.logits[:, -1, :]

    def remove(self, rows: list[int]) -> None:
        """Drop ``rows``; the last rows move into the freed ones, so the others may change index."""
        assert self.arena is not None or not rows
        for r in sorted(set(rows), reverse=True):
            last = len(self.seqs) - 1
            if r != last:
                assert self.arena is not None
                self.arena[:, :, r, :, : self.write] = self.arena[:, :, last, :, : self.write]
                self.mask[r] = self.mask[last]
                self.next_pos[r] = self.next_pos[last]
                self.seqs[r] = self.seqs[last]
            self.seqs.pop()

    def _reserve(self, rows: int, length: int) -> None:
        """Make room for ``rows`` rows, a row of ``length`` tokens ending at the write column, and
        the token the next step writes; a reallocation also drops leading columns no row uses."""
        have_rows = 0 if self.arena is None else self.arena.shape[2]
        if rows <= have_rows and max(self.write, length) < self.columns:
            return
        used = self.mask[: len(self.seqs), : self.write].any(dim=0).nonzero()
        lead = int(used[0]) if len(used) else self.write
        live = self.write - lead
        width = max(live, length) + _SPARE_COLUMNS
        new_rows = max(rows, have_rows if rows <= have_rows else 2 * have_rows)
        arena = self.layout.arena(new_rows, width)
        mask = torch.zeros((new_rows, width), dtype=torch.bool)
        next_pos = torch.zeros(new_rows, dtype=torch.long)
        n = len(self.seqs)
        if n:
            assert self.arena is not None
            arena[:, :, :n, :, :live] = self.arena[:, :, :n, :, lead : self.write]
            mask[:n, :live] = self.mask[:n, lead : self.write]
            next_pos[:n] = self.next_pos[:n]
        self.arena, self.mask, self.next_pos, self.write = arena, mask, next_pos, live
