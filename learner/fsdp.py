"""Build the trainable model: load an HF directory, shard it with FSDP2, gather it back for export.

FSDP2 (``torch.distributed.fsdp.fully_shard``) is applied to every decoder layer, then to the root (which
then owns the embeddings, final norm and the tied LM head). On GPU a :class:`MixedPrecisionPolicy` computes
in bf16 with fp32 master weights and fp32 gradient reduction; on CPU everything is fp32. The full model
is loaded on every rank before sharding (fine for <= a few B parameters; larger models would initialise on
the meta device and broadcast from rank 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from learner.distributed import DistEnv
from learner.model_io import load_model

__all__ = ["build_model", "decoder_layers", "full_state_dict", "resolve_precision"]


def resolve_precision(precision: str, env: DistEnv) -> str:
    """``auto`` -> ``bf16`` on GPU, ``fp32`` on CPU; bf16 on CPU is allowed but slow."""
    if precision == "auto":
        return "bf16" if env.device.type == "cuda" else "fp32"
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"unknown precision {precision!r}; use auto, bf16 or fp32")
    return precision


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers`` for Llama-style models)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers; cannot apply FSDP per decoder layer")
    return list(layers)


def build_model(
    model_dir: Path,
    env: DistEnv,
    *,
    precision: str,
    reshard_after_forward: bool = True,
    trainable: bool = True,
) -> nn.Module:
    """Load ``model_dir`` in fp32, move it to ``env.device`` and apply ``fully_shard`` per layer + root."""
    model = load_model(Path(model_dir), dtype=torch.float32, device=str(env.device))
    model.config.use_cache = False
    mp = resolve_precision(precision, env)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mp == "bf16"
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if trainable:
        model.train()
    else:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def full_state_dict(model: nn.Module, *, tied: bool) -> dict[str, Any]:
    """Full (unsharded) state dict on CPU on rank 0, ``{}`` on other ranks. Every rank must call it.

    With tied embeddings the LM head is dropped (HF re-ties it on load; safetensors rejects duplicates).
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if tied and "lm_head.weight" in sd and "model.embed_tokens.weight" in sd:
        del sd["lm_head.weight"]
    return sd
