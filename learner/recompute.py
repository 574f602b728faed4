"""Selective recompute: keep less of the forward for the backward by recomputing one part of every
decoder layer (its MLP or its attention block) there, instead of the whole layer
(``activation_checkpointing``).

A decoder layer of a Llama-shaped model keeps, per token, the inputs and outputs of its norms,
projections and activation function for the backward. The MLP's part is the larger one (its gate,
up, activation and product tensors are ``intermediate_size`` wide, 2.7x the hidden size for
SmolLM2) and costs about three quarters of the layer's matmul work to recompute; the attention
block's part is the smaller one and cheaper to recompute. Each wrapped part keeps only its input,
and its forward runs again, under the same autocast state, when the backward reaches it
(``torch.utils.checkpoint`` without reentrancy, as transformers' own checkpointing uses). The
arithmetic is the same, so losses and gradients are too.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from torch import nn
from torch.utils.checkpoint import checkpoint

from leafe.learner.fsdp import decoder_layers

__all__ = ["PARTS", "Part", "recompute_in_backward"]

Part = Literal["mlp", "self_attn"]
PARTS: tuple[Part, ...] = ("mlp", "self_attn")


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recompute_in_backward(model: nn.Module, part: Part) -> int:
    """Recompute ``part`` (``"mlp"`` or ``"self_attn"``) of every decoder layer of ``model`` in
    the backward; returns how many were wrapped. Raises where a layer has no such part."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    layers = list(decoder_layers(model))
    for i, layer in enumerate(layers):
        sub = getattr(layer, part, None)
        if not isinstance(sub, nn.Module):
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no {part!r} module")
        sub.forward = functools.partial(_checkpointed, sub.forward)  # type: ignore[method-assign]
    return len(layers)
