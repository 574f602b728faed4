"""Where a decode step of the CPU inference server goes, and how far it is from the machine's floors
(``bench/inference.py``'s ``decode_floor`` section; ``--floor`` runs only it).

One decode step of ``rows`` sequences over a KV arena of ``width`` columns, exactly as the engine
runs it (``DecodeBatch.step``: one token per row, the arena cache, per-row positions), timed with
the server's kernels (``services/inference/kernels.py``) and without them (aten), in the same
process. For the kernels' step:
- **breakdown** from torch's profiler: linear layers, attention (SDPA, or the grouped matmuls with
  their softmax, mask and float32 casts), other ops (norms, RoPE, activations, adds) and what is
  left of the wall time (Python and dispatch overhead: the HF module code between ops); sampling
  (``choose_tokens`` for the rows, seeded, temperature 1) is timed apart, as the engine runs it
  after the step;
- **compute floor**: the step's FLOPs (2 x linear parameters x rows, plus attention's 4 x rows x
  heads x width x head_dim per layer) over the matmul rate measured here for the model's own largest
  linear shape at ``rows`` rows through the same oneDNN path;
- **memory floor**: bytes the step must read (every linear weight once, the KV of every row's
  columns) over the read bandwidth measured here (a sum over a 256 MB tensor).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from leafe.services.inference.decode import GenSequence, GenSpec
from leafe.services.inference.kernels import accelerate
from leafe.services.inference.kv import ArenaCache, KVLayout
from leafe.services.inference.sampling import choose_tokens

__all__ = ["decode_floor", "floor_section"]

_ATTENTION_OPS = ("scaled_dot_product", "bmm", "_softmax", "masked_fill", "_to_copy", "copy_")
_LINEAR_OPS = ("_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm")


def _read_bandwidth(mb: int) -> float:
    """Bytes/s of a sum over ``mb`` MB (best of 5)."""
    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def _matmul_rate(model: Any, rows: int, dtype: torch.dtype) -> float:
    """FLOP/s of the model's largest non-head linear layer at ``rows`` rows, on the path it serves
    with."""
    layer = max(
        (
            m
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and "lm_head" not in n
        ),
        key=lambda m: m.weight.numel(),
    )
    x = torch.randn(rows, layer.in_features, dtype=dtype)
    with torch.inference_mode():
        for _ in range(5):
            layer(x)
        n, t0 = 50, time.perf_counter()
        for _ in range(n):
            layer(x)
        wall = time.perf_counter() - t0
    return 2 * rows * layer.weight.numel() * n / wall


def _arena_step(model: Any, rows: int, width: int) -> Any:
    """A closure running one engine-style decode step at the arena's next column."""
    layout = KVLayout.of(model)
    arena = layout.arena(rows, width + 64)
    mask = torch.zeros(rows, width + 64, dtype=torch.bool)
    mask[:, :width] = True
    gen = torch.Generator().manual_seed(0)
    last = torch.randint(10, 1000, (rows, 1), generator=gen)
    state = {"col": width}

    def step() -> torch.Tensor:
        col = state["col"] = width + (state["col"] - width + 1) % 64
        mask[:, col] = True
        out = model(
            input_ids=last,
            attention_mask=mask,
            position_ids=torch.full((rows, 1), col),
            cache=ArenaCache(arena, rows, col),
            use_cache=True,
        )
        return out.logits[:, -1, :]

    return step


def _time(step: Any, n: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
    return (time.perf_counter() - t0) / n


def _breakdown(step: Any, n: int) -> dict[str, float]:
    """Milliseconds per step by kind of op, and the wall time no op accounts for."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        wall = (time.perf_counter() - t0) / n
    kinds = {"linear": 0.0, "attention": 0.0, "other_ops": 0.0}
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total / n
        if any(k in ev.key for k in _LINEAR_OPS):
            kinds["linear"] += us
        elif any(k in ev.key for k in _ATTENTION_OPS):
            kinds["attention"] += us
        else:
            kinds["other_ops"] += us
    out = {k: round(v / 1000, 2) for k, v in kinds.items()}
    out["python_and_dispatch"] = round(max(0.0, wall * 1000 - sum(kinds.values()) / 1000), 2)
    out["profiled_wall"] = round(wall * 1000, 2)
    return out


def _fused_attention_ms(model: Any, rows: int, width: int, dtype: torch.dtype) -> float:
    """Milliseconds of the compiled decode attention for one step (every layer) at the step's
    shapes."""
    from leafe.services.inference.kernels import fused_decode

    layout = KVLayout.of(model)
    heads = int(model.config.num_attention_heads)
    q = torch.randn(rows, heads, 1, layout.head_dim).to(dtype)
    k, v = (torch.randn(rows, layout.kv_heads, width, layout.head_dim).to(dtype) for _ in range(2))
    mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)
    n = 20
    t0 = time.perf_counter()
    for _ in range(n * layout.layers):
        fused_decode(q, k, v, mask, layout.head_dim**-0.5)
    return (time.perf_counter() - t0) / n * 1000


def _sampling_ms(vocab: int, rows: int, n: int) -> float:
    logits = torch.randn(rows, vocab)
    seqs = [
        GenSequence(prompt=[1], spec=GenSpec(temperature=1.0, seed=i), output_ids=[1])
        for i in range(rows)
    ]
    t0 = time.perf_counter()
    for _ in range(n):
        choose_tokens(logits, seqs)
    return (time.perf_counter() - t0) / n * 1000


def decode_floor(
    model_dir: Path, dtype: str, *, rows: int = 16, width: int = 300, steps: int = 20
) -> dict[str, Any]:
    """The decode step's cost, breakdown and floors for ``model_dir`` served in ``dtype``."""
    from leafe.learner.model_io import load_model

    torch_dtype = getattr(torch, dtype)
    plain = load_model(model_dir, dtype=torch_dtype).eval()
    unfused = load_model(model_dir, dtype=torch_dtype).eval()
    fast = load_model(model_dir, dtype=torch_dtype).eval()
    accelerate(unfused, fused=False)
    kernels = accelerate(fast)
    plain_step, unfused_step = _arena_step(plain, rows, width), _arena_step(unfused, rows, width)
    fast_step = _arena_step(fast, rows, width)
    # interleaved rounds, best of each: the three variants see the same machine state
    times: dict[str, list[float]] = {"aten": [], "unfused": [], "ours": []}
    for _ in range(3):
        for name, step in (("aten", plain_step), ("unfused", unfused_step), ("ours", fast_step)):
            times[name].append(_time(step, max(1, steps // 3)) * 1000)
    aten_ms, unfused_ms, ours_ms = (min(times[k]) for k in ("aten", "unfused", "ours"))
    breakdown = _breakdown(fast_step, max(2, steps // 2))
    if kernels.get("attention", "").startswith("fused"):
        # the compiled kernel is not a torch op: the profiler counts it in the residual, so time
        # it apart
        breakdown["fused_attention"] = round(_fused_attention_ms(fast, rows, width, torch_dtype), 2)
        breakdown["python_and_dispatch"] = round(
            max(0.0, breakdown["python_and_dispatch"] - breakdown["fused_attention"]), 2
        )
    config = fast.config
    layout = KVLayout.of(fast)
    linear_params = sum(m.weight.numel() for m in fast.modules() if isinstance(m, torch.nn.Linear))
    heads = int(config.num_attention_heads)
    flops = 2 * linear_params * rows + 4 * rows * heads * width * layout.head_dim * layout.layers
    weight_bytes = linear_params * torch_dtype.itemsize
    kv_bytes = rows * width * layout.token_bytes()
    rate, bandwidth = _matmul_rate(fast, rows, torch_dtype), _read_bandwidth(256)
    compute_ms, memory_ms = flops / rate * 1000, (weight_bytes + kv_bytes) / bandwidth * 1000
    return {
        "dtype": dtype,
        "rows": rows,
        "width": width,
        "threads": torch.get_num_threads(),
        "kernels": kernels,
        "step_ms_aten": round(aten_ms, 2),
        "step_ms_unfused_attention": round(unfused_ms, 2),
        "step_ms": round(ours_ms, 2),
        "speedup_over_aten": round(aten_ms / ours_ms, 2),
        "breakdown_ms": breakdown,
        "sampling_ms": round(_sampling_ms(int(config.vocab_size), rows, max(2, steps // 2)), 2),
        "step_gflop": round(flops / 1e9, 3),
        "matmul_gflops": round(rate / 1e9, 1),
        "compute_floor_ms": round(compute_ms, 2),
        "read_gb_per_s": round(bandwidth / 1e9, 1),
        "step_read_mb": round((weight_bytes + kv_bytes) / 2**20, 1),
        "memory_floor_ms": round(memory_ms, 2),
        "step_over_floor": round(ours_ms / max(compute_ms, memory_ms), 2),
    }


def floor_section(model_dir: Path, steps: int, width: int) -> dict[str, Any]:
    """:func:`decode_floor` in float32 and bfloat16 (``bench/inference.py``'s ``decode_floor``)."""
    section: dict[str, Any] = {"loadavg_before": os.getloadavg()[0]}
    for dtype in ("float32", "bfloat16"):
        section[dtype] = decode_floor(model_dir, dtype, steps=steps, width=width)
    return section
