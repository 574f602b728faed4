"""Variable-length causal attention for packed rows, as a transformers attention implementation.

A packed row (``bucketing = "pack"``, ``learner/batching.py``) holds several samples back to back,
with ``position_ids`` restarting at 0 for each; every token may attend only to earlier tokens of its
own sample. What transformers 5.x offers for Llama on CPU: with ``attn_implementation="sdpa"`` and
no attention mask it derives a dense block-diagonal mask from restarting ``position_ids``; SDPA then
computes all T x T scores of the row and loses its causal fast path. Measured once (SmolLM2-135M, 1
thread, one 1818-token row of 4 samples, forward + backward): that ran at 1.05x (fp32) and 0.9x
(bf16) the speed of left-padded rows of the same samples, against 1.6x and 1.9x for this module. Its
varlen path (``cu_seq_lens_q``) needs flash-attention kernels, which do not exist on CPU;
``flex_attention`` needs ``torch.compile``.

:data:`VARLEN` runs causal SDPA once per sample of the row, at the boundaries ``cu_seq_lens_q`` (the
name and meaning flash-attention's varlen API uses) passed as a model keyword argument, so no
cross-sample score is ever computed. A row may start with a prefix its samples share
(``shared_prefix_len``, the learner's ``share_prefix``): each sample's segment then attends to the
prefix's keys and its own. Without ``cu_seq_lens_q`` it *is* transformers' SDPA attention, with the
same masks, so a model switched to it behaves exactly as before on left-padded batches.

    use_varlen_attention(model)
    model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, logits_to_keep=keep)
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["VARLEN", "use_varlen_attention", "varlen_sdpa_attention"]

VARLEN = "leafe_varlen_sdpa"
"""Name of the attention implementation registered with transformers."""


def varlen_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: Tensor | None = None,
    shared_prefix_len: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal SDPA per segment ``[cu[i], cu[i+1])`` of a single packed row; plain SDPA without
    ``cu``. With ``shared_prefix_len`` P, the first segment is a prefix every other segment
    continues: their queries see its P keys and their own earlier ones, as if each were the prefix
    followed by the segment.

    ``query [1, H, T, D]``, ``key``/``value [1, H_kv, T, D]``; returns ``[1, T, H, D]`` like
    transformers' attention functions. The dense packed mask transformers builds alongside is
    ignored (the segments say the same thing).
    """
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got a batch of {query.shape[0]}")
    bounds = [int(b) for b in cu_seq_lens_q.tolist()]
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q {bounds} does not cover the row's {query.shape[2]} tokens")
    gqa = key.shape[1] != query.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    p = int(shared_prefix_len or 0)
    if p and (len(bounds) < 2 or bounds[1] != p):
        raise ValueError(f"shared_prefix_len {p} is not the row's first segment {bounds[:2]}")
    # One split per tensor, not a slice per segment: a slice's backward writes a zero-filled
    # gradient of the whole row, so n segments cost n row-sized fills and adds per tensor; a split's
    # backward is one cat.
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    qs, ks, vs = (t.split(lengths, dim=2) for t in (query, key, value))
    parts = []
    for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        if not p or i == 0:  # a whole sample, or the shared prefix itself
            parts.append(
                sdpa(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
            )
            continue
        # A sample's own tokens after the prefix: every prefix key, then its own keys causally.
        n = q.shape[2]
        mask = torch.ones(n, p + n, dtype=torch.bool, device=query.device)
        mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        k = torch.cat((ks[0], k), dim=2)
        v = torch.cat((vs[0], v), dim=2)
        parts.append(
            sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        )
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def use_varlen_attention(model: nn.Module) -> None:
    """Register :data:`VARLEN` with transformers (idempotent) and switch ``model`` to it."""
    AttentionInterface.register(VARLEN, varlen_sdpa_attention)
    # The SDPA mask builder keeps unpacked batches' padding masks exactly as under "sdpa".
    AttentionMaskInterface.register(VARLEN, sdpa_mask)
    set_impl = getattr(model, "set_attn_implementation", None)
    if set_impl is None:
        raise ValueError(
            f"{type(model).__name__} is not a transformers model; cannot set its attention"
        )
    set_impl(VARLEN)
