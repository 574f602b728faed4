"""Build the trainable model: load an HF directory, shard it with FSDP2, gather it back for export.

FSDP2 (``torch.distributed.fsdp.fully_shard``) is applied to every decoder layer, then to the root
(which then owns the embeddings, final norm and the tied LM head). The full model is loaded on every
rank before sharding (fine for <= a few B parameters; larger models would initialise on the meta
device and broadcast from rank 0). Attention is :data:`leafe.learner.attention.VARLEN` (SDPA, plus
per-sample attention in packed rows).

Precision ``bf16`` always keeps fp32 master weights, fp32 gradients and fp32 AdamW state, so
checkpoints and exports are exactly what fp32 training would write. How the compute gets to bf16
differs:
- GPU: a :class:`MixedPrecisionPolicy` all-gathers parameters in bf16 (half the traffic) and reduces
  gradients in fp32.
- CPU: ``torch.autocast("cpu", torch.bfloat16)`` around the forward (:func:`autocast`): matmuls and
  attention in bf16; norms, elementwise ops and the residual stream stay fp32. Measured on
  SmolLM2-135M (1 thread, a packed 971-token row, forward + backward, interleaved, best of 3):
  autocast ran at 3.3x fp32 and the MixedPrecisionPolicy path at 3.6x, within this shared machine's
  noise, but autocast's token log-probs are closer to fp32 (mean |error| 0.030 vs 0.040 nats on 700
  tokens of text), so the CPU uses autocast. Whole optimizer steps: 2.25x fp32
  (``bench/learner.py``).
``auto`` picks bf16 where the hardware has bf16 dot products: any GPU, and CPUs with AVX512-BF16 or
AMX (:func:`cpu_has_native_bf16`); elsewhere bf16 is emulated and slower, so fp32.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from leafe.learner.attention import use_varlen_attention
from leafe.learner.distributed import DistEnv
from leafe.learner.model_io import load_model

__all__ = [
    "autocast",
    "build_model",
    "cpu_has_native_bf16",
    "decoder_layers",
    "full_state_dict",
    "resolve_precision",
]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16, e.g. Zen 4+ or Cooper Lake+,
    or AMX tiles, Sapphire Rapids+), as torch's CPU dispatch sees them, and oneDNN may use them:
    with ``ONEDNN_MAX_CPU_ISA`` below them (an AVX-512 host approximating an AVX2-only one) its bf16
    matmuls run emulated, ~100x slower, as on a CPU without them."""
    flags = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(flags and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_precision(precision: str, env: DistEnv) -> str:
    """``auto`` -> ``bf16`` on GPU and on CPUs with native bf16 (:func:`cpu_has_native_bf16`), else
    fp32."""
    if precision == "auto":
        return "bf16" if env.device.type == "cuda" or cpu_has_native_bf16() else "fp32"
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"unknown precision {precision!r}; use auto, bf16 or fp32")
    return precision


def autocast(precision: str, env: DistEnv, *, cache: bool = True) -> AbstractContextManager[Any]:
    """Context for the forward pass: bf16 autocast on CPU when ``precision`` resolves to bf16, else
    none (fp32, or GPU where the MixedPrecisionPolicy of :func:`build_model` casts). Backward runs
    outside it. ``cache=False`` casts each weight where it is used instead of keeping every layer's
    bf16 copy until the forward ends (with activation checkpointing nothing else holds them: 270 MB
    less for SmolLM2)."""
    if env.device.type == "cpu" and resolve_precision(precision, env) == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)
    return nullcontext()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers`` for Llama-style models)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers; cannot apply FSDP per decoder layer"
        )
    return list(layers)


def build_model(
    model_dir: Path,
    env: DistEnv,
    *,
    precision: str,
    reshard_after_forward: bool = True,
    trainable: bool = True,
) -> nn.Module:
    """Load ``model_dir`` in fp32, move it to ``env.device`` and apply ``fully_shard`` per layer +
    root."""
    model = load_model(Path(model_dir), dtype=torch.float32, device=str(env.device))
    model.config.use_cache = False
    use_varlen_attention(model)
    gpu_bf16 = env.device.type == "cuda" and resolve_precision(precision, env) == "bf16"
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if gpu_bf16
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

    With tied embeddings the LM head is dropped (HF re-ties it on load; safetensors rejects
    duplicates).
    """
    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if tied and "lm_head.weight" in sd and "model.embed_tokens.weight" in sd:
        del sd["lm_head.weight"]
    return sd
