"""CPU kernels the inference server puts into its HF decoder: linear layers through oneDNN with
weights reordered once, and attention through compiled C kernels
(``services/inference/compiled.py``), or as two grouped matmuls at decode where those cannot be
built.

Both replace a slow default of torch 2.13's CPU build on this machine (one Zen 5 core;
``bench/inference.py`` ``decode_floor`` section):
- **Linear layers.** aten's float32 ``linear`` calls MKL, which on AMD CPUs runs at ~90 GFLOP/s;
  oneDNN's ``mkldnn::_linear_pointwise`` with a weight reordered into its blocked layout once
  reaches ~200-235 GFLOP/s on the same shapes (2.1-3.0x at 16-256 rows). A layer keeps its
  ``weight`` parameter (state dicts, weight updates and validation see the same keys and tensors)
  and holds the reordered copy in a non-persistent buffer, which :func:`repack` rebuilds after every
  weight swap (a stale copy would serve the old weights: the engine repacks before it resumes, and a
  test checks it).
- **Decode attention.** torch's CPU SDPA at one query token costs ~4.7 ms per layer in bfloat16 (16
  rows, 340 columns, in cache), more than the whole layer's matmuls. As two grouped-query matmuls
  with float32 scores, softmax and value sum (``grouped_decode_attention``) it is ~0.8 ms, and
  closer to a float64 reference than SDPA's (mean error 6.1e-4 vs 7.0e-4): in the model's decode
  step (16 rows, 300 columns) 52-57 ms against SDPA's 60-65 in bfloat16. That is still bound by
  reading the KV, ~10 GB/s through 48 small matmuls per layer and a float32 copy of the keys and
  values (keeping a bfloat16 model's KV in float32 measured no faster). ``csrc/decode_attention.c``
  fuses it: one pass over the key rows and one over the value rows, each converted in registers and
  used by every head of its group, masked columns skipped (built and called by
  ``services/inference/compiled.py``). Without a compiler, or if its output differs from the exact
  attention at start, the grouped matmuls serve and the reason is reported.
- **Prefill attention** (several query tokens, transformers' boolean causal and padding mask) is in
  the same file: per row and KV head, the group's queries are transposed so that 4 key rows x 64
  queries accumulate in registers (no horizontal sums), softmax runs down each query's column, and
  the values are summed the same way. On 6 rows x 60 new tokens over 280 columns it takes 2.2-2.3 ms
  per layer against SDPA's 3.3-3.6 (flash kernel, ~55 GFLOP/s here), in float32 arithmetic whatever
  the model's dtype.

The kernels are checked against the plain forward when installed (:func:`accelerate`): a layer whose
reordered output differs from ``F.linear`` beyond float rounding, or a build without oneDNN, keeps
aten's path and the reason is logged and returned.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from leafe.services.inference.compiled import (
    FUSED_DTYPES,
    fused_decode,
    fused_library,
    fused_prefill,
)

__all__ = [
    "ATTENTION",
    "FUSED_ATTENTION",
    "PackedLinear",
    "accelerate",
    "exact_attention",
    "fused_decode",
    "fused_library",
    "fused_prefill",
    "repack",
]

log = structlog.get_logger(__name__)

ATTENTION = "leafe_cpu"
"""Attention registered with transformers (masks as for ``sdpa``): grouped matmuls at decode, SDPA
else."""

FUSED_ATTENTION = "leafe_cpu_fused"
"""The same with decode through the compiled kernel (``csrc/decode_attention.c``)."""

_BATCH_HINT = 16
"""Rows oneDNN is told to expect when it picks the weight layout (the server's default
``max_batch``; the layout serves any row count: a 8 x 256-token float32 prefill ran 1.9x aten with
this hint)."""


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward multiplies by a oneDNN-reordered copy of its weight
    (``packed``)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def _onednn_unavailable(dtype: torch.dtype) -> str | None:
    """Why oneDNN linear cannot serve ``dtype`` here (None when it can)."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return "this torch has no mkldnn::_linear_pointwise"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 support in oneDNN"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} is not served by the oneDNN path"
    return None


def _agrees(layer: torch.nn.Linear) -> bool:
    """Whether the reordered path gives ``F.linear``'s output on a random input (float rounding
    aside)."""
    w = layer.weight.detach()
    x = torch.randn(3, layer.in_features, dtype=w.dtype, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = F.linear(x, w, layer.bias).float()
        got = torch.ops.mkldnn._linear_pointwise(x, _reorder(w), layer.bias, "none", [], "").float()
    tol = 1e-4 if w.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())))


def repack(model: torch.nn.Module) -> int:
    """Reorder the current weight of every :class:`PackedLinear` of ``model`` (after weights
    changed, e.g. ``load_state_dict(..., assign=True)``); returns how many layers were repacked."""
    count = 0
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, PackedLinear):
                module.register_buffer("packed", _reorder(module.weight), persistent=False)
                count += 1
    return count


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention: grouped matmuls with float32 scores for one query token, SDPA
    otherwise."""
    bsz, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    plain = attention_mask is None or attention_mask.dtype == torch.bool
    if q_len != 1 or dropout or kwargs.get("softcap") or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    # head h reads kv head h // groups (transformers' repeat_kv), so [B, H, 1, D] -> [B, KV, groups,
    # D]
    q = query.reshape(bsz, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(q, key.float().transpose(-1, -2))
    scores.mul_(scaling if scaling is not None else dim**-0.5)
    if attention_mask is not None:  # [B, 1, 1, W], True = attend
        scores.masked_fill_(~attention_mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float()).to(query.dtype)
    return out.reshape(bsz, 1, heads, dim), None


def fused_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention through the compiled kernels: decode (one query token) and prefill
    (several, with transformers' boolean mask); ``grouped_decode_attention`` for what they do not
    take (no mask, dropout, softcap, other dtypes, a head size not a multiple of 4)."""
    plain = attention_mask is not None and attention_mask.dtype == torch.bool
    if (
        dropout
        or kwargs.get("softcap")
        or query.dtype not in FUSED_DTYPES
        or not (query.dtype == key.dtype == value.dtype)
        or (query.shape[2] != 1 and (not plain or query.shape[-1] % 4))
        or (query.shape[2] == 1 and attention_mask is not None and not plain)
    ):
        return grouped_decode_attention(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1:
        return fused_decode(query, key, value, attention_mask, scale), None
    assert attention_mask is not None
    return fused_prefill(query, key, value, attention_mask, scale), None


decode_attention = grouped_decode_attention  # the name tests and the floor bench import

AttentionInterface.register(ATTENTION, grouped_decode_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
AttentionInterface.register(FUSED_ATTENTION, fused_decode_attention)
AttentionMaskInterface.register(FUSED_ATTENTION, sdpa_mask)


def exact_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The reference the kernels are checked against: SDPA in float64 with each KV head repeated for
    its query heads; ``[B, S, H, D]``."""
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query.double(),
        key.double().repeat_interleave(groups, 1),
        value.double().repeat_interleave(groups, 1),
        attn_mask=mask,
    ).transpose(1, 2)


def _fused_agrees() -> str | None:
    """Why the compiled kernel may not serve (None when it matches the exact attention here)."""
    lib = fused_library()
    if isinstance(lib, str):
        return lib
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 1, 32, generator=gen)
    k, v = (torch.randn(3, 2, 20, 32, generator=gen) for _ in range(2))
    mask = torch.rand(3, 1, 1, 20, generator=gen) > 0.3
    mask[..., -1] = True
    got = fused_decode(q, k, v, mask, 32**-0.5)
    if not torch.allclose(got.double(), exact_attention(q, k, v, mask), rtol=1e-4, atol=1e-5):
        return "the compiled decode kernel's output differs from exact attention on this machine"
    q = torch.randn(3, 6, 5, 32, generator=gen)
    causal = torch.ones(5, 20, dtype=torch.bool).tril(15)[None, None].expand(3, 1, 5, 20)
    want = exact_attention(q, k, v, causal)
    if not torch.allclose(
        fused_prefill(q, k, v, causal, 32**-0.5).double(), want, rtol=1e-4, atol=1e-5
    ):
        return "the compiled prefill kernel's output differs from exact attention on this machine"
    return None


def accelerate(model: torch.nn.Module, *, fused: bool = True) -> dict[str, Any]:
    """Install the kernels into ``model`` (in place); returns what was installed and why not
    otherwise. ``fused=False`` keeps decode attention on the grouped matmuls (for comparisons)."""
    dtype = next(model.parameters()).dtype
    applied: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "linear": "aten",
        "attention": "sdpa",
    }
    reason = _onednn_unavailable(dtype)
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if reason is None and layers and not _agrees(layers[0]):
        reason = "oneDNN's output differs from F.linear on this build"
    if reason is None:
        for layer in layers:
            layer.__class__ = PackedLinear
        applied.update(linear="onednn", packed_layers=repack(model))
    else:
        applied["linear_reason"] = reason
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        why_not = _fused_agrees() if fused else "not requested"
        if why_not is None:
            model.set_attn_implementation(FUSED_ATTENTION)  # type: ignore[operator]
            applied["attention"] = "fused decode and prefill (compiled)"
        else:
            model.set_attn_implementation(ATTENTION)  # type: ignore[operator]
            applied.update(attention="grouped decode, sdpa prefill", attention_reason=why_not)
    log.info("inference.kernels", **applied)
    return applied
