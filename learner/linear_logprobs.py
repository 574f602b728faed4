"""Token log-probs from the final hidden states without the full-vocabulary logits of a micro-batch.

The loss needs log p(label) at the N positions that predict a target
(``MicroBatch.sample_logprobs``); the plain path builds their [N, V] logits (V = 49,152 for SmolLM2,
150k for larger vocabularies), an fp32 copy and the log-softmax's temporaries, and autograd keeps
the logits for the backward. Here the LM head's projection and the fp32 log-softmax run over
``chunk_tokens`` positions at a time, each chunk under ``torch.utils.checkpoint`` (non-reentrant):
the forward keeps only each chunk's [chunk] log-probs and the backward recomputes one chunk's logits
at a time, so at most one chunk's [chunk, V] block is alive.

Each chunk runs exactly the ops of the plain path on its rows (``F.linear`` under the ambient
autocast, then :func:`leafe.learner.losses.token_logprobs`), so the values are the plain path's, and
the gradient only differs in the order the chunks' weight gradients are summed.
``torch.nn.functional.linear_cross_entropy`` (torch 2.13, chunked with ``reduction="none"``) does
the same job but is not autocast-aware: under CPU bf16 autocast it projects in fp32, which is
neither the plain path's numbers nor its speed.

The projection runs *inside* the model's forward (:func:`logprob_head` swaps the head's ``forward``
for one call), so under FSDP2 the root's parameters are gathered exactly as for the plain head.

    logp = sample_logprobs(model, mb)        # [S, K] like mb.sample_logprobs(model(...).logits)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from leafe.learner.batching import MicroBatch
from leafe.learner.losses import IGNORE, token_logprobs

__all__ = [
    "CHUNK_TOKENS",
    "chunked_token_logprobs",
    "full_logits_sample_logprobs",
    "kept_targets",
    "logprob_head",
    "sample_logprobs",
]

CHUNK_TOKENS = 256
"""Positions per chunk: a [256, 49152] block is 25 MB in bf16, 50 MB in fp32."""


def _chunk_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor) -> Tensor:
    return token_logprobs(F.linear(hidden, weight, bias), targets)


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> Tensor:
    """log p(target) in fp32 for ``hidden [..., N, H]`` projected by ``weight [V, H]`` (+ ``bias``),
    shaped like ``targets [..., N]``; exactly 0.0 (and no gradient) where ``targets == IGNORE``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} does not match targets {tuple(targets.shape)}"
        )
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    # Every chunk is computed, even one without a target: its zero log-probs still tie the head and
    # the layers into the graph, so that a rank's dummy micro-batch (no targets) runs the backward
    # (and FSDP's collectives) like the others, as it does on the plain path.
    parts = []
    for start in range(0, max(1, flat_t.shape[0]), chunk_tokens):
        h, t = flat_h[start : start + chunk_tokens], flat_t[start : start + chunk_tokens]
        if grad:
            parts.append(checkpoint(_chunk_logprobs, h, weight, bias, t, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h, weight, bias, t))
    # A fresh tensor, not a view: FSDP2 hooks the root's outputs, and a view's hook could be lost in
    # place.
    return torch.cat(parts).reshape(targets.shape).clone()


@contextmanager
def logprob_head(
    model: nn.Module, targets: Tensor, *, chunk_tokens: int = CHUNK_TOKENS
) -> Iterator[None]:
    """For calls inside the block, the model's output head returns :func:`chunked_token_logprobs` of
    ``targets`` (shaped like the kept positions) instead of logits: ``model(...).logits`` is then
    [..., N] fp32 log-probs."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no nn.Linear output head")

    def forward(hidden: Tensor) -> Tensor:
        # head.weight is read at call time: under FSDP2 that is the gathered parameter.
        return chunked_token_logprobs(
            hidden, head.weight, targets, bias=head.bias, chunk_tokens=chunk_tokens
        )

    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del head.forward


def kept_targets(mb: MicroBatch) -> Tensor:
    """The token each position of ``mb.model_inputs()``'s ``logits_to_keep`` predicts (IGNORE:
    none)."""
    if mb.packing is not None:
        return mb.packing.targets
    # Left-padded rows keep K + 1 positions; the last one predicts past the row.
    return F.pad(mb.labels, (0, 1), value=IGNORE)


def sample_logprobs(
    model: nn.Module, mb: MicroBatch, *, chunk_tokens: int = CHUNK_TOKENS
) -> Tensor:
    """[S, K] log p(label) per sample and slot (0 where IGNORE), as ``mb.sample_logprobs`` of the
    model's logits, without building those logits."""
    with logprob_head(model, kept_targets(mb), chunk_tokens=chunk_tokens):
        logp: Tensor = model(**mb.model_inputs(), use_cache=False).logits
    if mb.packing is None:
        return logp[:, :-1]
    out = logp.new_zeros(mb.labels.shape)
    return out.index_put((mb.packing.sample, mb.packing.slot), logp[0])


def full_logits_sample_logprobs(model: nn.Module, mb: MicroBatch) -> Tensor:
    """The plain path (the learner's until the chunked head): the [N, V] logits of every kept
    position, then their log-softmax. The reference the chunked path is checked against (tests,
    ``bench/learner.py``)."""
    return mb.sample_logprobs(model(**mb.model_inputs(), use_cache=False).logits)
