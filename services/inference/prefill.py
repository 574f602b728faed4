"""Prefill of the CPU inference server: one forward pass over a group of new prompts, each starting
from the KV of its cached prefix (``services/inference/prefix.py``), so only the tokens after it are
computed.

```
 arena columns:  0 ........ cached_width ................ cached_width + suffix_width
 row i:          [pad][cached KV of m_i tokens] [pad ......][suffix: s_i new tokens]
                       copied from the tree      left-padded input block, computed now
```
Row ``i``'s cached KV ends at column ``cached_width`` and its suffix ends at the last column; the
columns between are masked. Positions are explicit (``m_i .. m_i + s_i - 1``) and RoPE is applied
before caching, so a row's keys are those of the prompt run alone, whatever shares its pass (up to
float rounding of batched matmuls). Prompts with nothing cached are rows with ``m_i = 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leafe.services.inference.decode import GenSequence
from leafe.services.inference.kv import ArenaCache, KVLayout
from leafe.services.inference.prefix import PrefixMatch

__all__ = ["PrefillRow", "Prefilled", "plan_chunks", "prefill"]


@dataclass(eq=False)
class PrefillRow:
    """One distinct prompt of an admission: the sequences that share it and its cached prefix."""

    prompt: list[int]
    seqs: list[GenSequence]
    cached: PrefixMatch

    @property
    def suffix(self) -> int:
        """Tokens this pass computes."""
        return len(self.prompt) - self.cached.length


@dataclass(eq=False)
class Prefilled:
    """The KV of a prefilled group: ``arena`` ``[layers, 2, rows, kv_heads, width, dim]``."""

    rows: list[PrefillRow]
    arena: torch.Tensor
    cached_width: int
    suffix_width: int

    @property
    def width(self) -> int:
        """Arena columns."""
        return self.cached_width + self.suffix_width

    def spans(self, row: int) -> list[tuple[int, int]]:
        """Column ranges holding ``row``'s prompt tokens, in token order (one, or two around the
        gap)."""
        r = self.rows[row]
        m = r.cached.length
        suffix = (self.width - r.suffix, self.width)
        return [(self.cached_width - m, self.cached_width), suffix] if m else [suffix]

    def kv(self, row: int, start: int, end: int) -> torch.Tensor:
        """KV of ``row``'s prompt tokens ``start..end-1``: ``[layers, 2, kv_heads, n, dim]``."""
        parts, pos = [], 0
        for a, b in self.spans(row):
            lo, hi = max(start, pos), min(end, pos + b - a)
            if lo < hi:
                parts.append(self.arena[:, :, row, :, a + lo - pos : a + hi - pos])
            pos += b - a
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)


def _inputs(
    rows: Sequence[PrefillRow], cached_width: int, suffix_width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids ``[R, S]`` (suffixes left-padded), attention mask ``[R, Wc + S]`` and positions
    ``[R, S]``."""
    count = len(rows)
    ids = torch.full((count, suffix_width), pad_id, dtype=torch.long)
    mask = torch.zeros((count, cached_width + suffix_width), dtype=torch.bool)
    positions = torch.zeros((count, suffix_width), dtype=torch.long)
    for i, r in enumerate(rows):
        m, s = r.cached.length, r.suffix
        ids[i, suffix_width - s :] = torch.tensor(r.prompt[m:], dtype=torch.long)
        positions[i, suffix_width - s :] = torch.arange(m, m + s, dtype=torch.long)
        mask[i, cached_width - m : cached_width] = True
        mask[i, cached_width + suffix_width - s :] = True
    return ids, mask, positions


def prefill(
    model: Any, layout: KVLayout, rows: Sequence[PrefillRow], pad_id: int
) -> tuple[Prefilled, torch.Tensor]:
    """Run the suffixes of ``rows`` over their cached prefixes; returns the group's KV and each
    row's next-token logits ``[R, V]``."""
    if not rows or any(r.suffix < 1 for r in rows):
        raise ValueError(
            f"prefill needs rows with >= 1 new token, got suffixes {[r.suffix for r in rows]}"
        )
    cached_width = max(r.cached.length for r in rows)
    suffix_width = max(r.suffix for r in rows)
    arena = layout.arena(len(rows), cached_width + suffix_width)
    for i, r in enumerate(rows):
        col = cached_width - r.cached.length
        for seg in r.cached.segments:
            n = seg.shape[3]
            arena[:, :, i, :, col : col + n] = seg
            col += n
    ids, mask, positions = _inputs(rows, cached_width, suffix_width, pad_id)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        cache=ArenaCache(arena, len(rows), cached_width),
        use_cache=True,
        logits_to_keep=1,
    )
    group = Prefilled(
        rows=list(rows), arena=arena, cached_width=cached_width, suffix_width=suffix_width
    )
    return group, out.logits[:, -1, :]


def plan_chunks(rows: Sequence[PrefillRow], max_tokens: int) -> list[list[PrefillRow]]:
    """Group rows by similar suffix length, so a pass pads its input block by at most ~25% and stays
    under ``max_tokens`` padded input tokens (a longer row runs alone)."""
    chunks: list[list[PrefillRow]] = []
    cur: list[PrefillRow] = []
    real = 0
    for r in sorted(rows, key=lambda r: r.suffix):
        width = r.suffix  # the widest so far: rows are sorted
        count = len(cur) + 1
        if cur and (count * width > max_tokens or count * width > 1.25 * (real + width)):
            chunks.append(cur)
            cur, real = [], 0
        cur.append(r)
        real += width
    return [*chunks, cur] if cur else chunks
