"""The compute floor of a replay against our server: how long its linear layers alone would take on
this machine, from the run's own engine counters.

A run's counters say what work the engine did: ``prefill_calls`` passes over ``prefilled_tokens``
new prompt tokens (the rest came from the prefix cache), and ``decode_steps`` steps whose row counts
``batch_sizes`` records. The floor times exactly that work through a stack of linear layers of the
model's shapes (every decoder layer's q, k, v, o, gate, up and down, each with its own weights, so
they stream from memory as a forward's do, plus the LM head for one row per request in prefill and
every row in decode), one thread, on the path the server multiplies with
(``services/inference/kernels.py``: oneDNN's reordered weights where this CPU serves the dtype),
with random weights of the model's dtype. Prefill passes are timed at the run's mean new tokens per
pass (the rate is nearly flat above ~64 rows); decode steps at each recorded row count.

Attention, norms, activations, rotary, sampling and Python are left out: the floor is a lower bound,
and ``over_floor`` (the engine's CPU seconds over it) says how much of the rest any engine could
still take away. Measured here, in the same process, right after the run, so the ratio carries this
machine's rates.

    floor = engine_floor(model_dir, "bfloat16", counters, requests=3619)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["LinearStack", "engine_floor"]


class LinearStack:
    """Random-weight linear layers of ``model_dir``'s shapes on the server's path (see the module
    doc)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from leafe.services.inference.kernels import accelerate

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        heads, kv_heads = (
            int(cfg["num_attention_heads"]),
            int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        )
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        shapes = [
            (hidden, heads * head_dim),  # q
            (hidden, kv_heads * head_dim),  # k
            (hidden, kv_heads * head_dim),  # v
            (heads * head_dim, hidden),  # o
            (hidden, inter),  # gate
            (hidden, inter),  # up
            (inter, hidden),  # down
        ] * int(cfg["num_hidden_layers"])
        gen = torch.Generator().manual_seed(0)
        layers = []
        with torch.no_grad():
            for fan_in, fan_out in [*shapes, (hidden, int(cfg["vocab_size"]))]:
                layer = torch.nn.Linear(fan_in, fan_out, bias=False)
                layer.weight.copy_(torch.randn(fan_out, fan_in, generator=gen) * fan_in**-0.5)
                layers.append(layer.to(dtype).requires_grad_(False))
        stack = torch.nn.Sequential(*layers)
        self.kernels = accelerate(stack)
        self.layers, self.head = list(stack)[:-1], list(stack)[-1]
        self.dtype = dtype
        self.flops_per_row = 2 * sum(m.weight.numel() for m in self.layers)
        """FLOPs of one row through the decoder layers' linear layers (the head apart)."""
        self.head_flops_per_row = 2 * self.head.weight.numel()
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._seconds: dict[tuple[int, int], float] = {}

    def _x(self, rows: int, width: int) -> torch.Tensor:
        key = (rows, width)
        if key not in self._inputs:
            self._inputs[key] = torch.randn(rows, width).to(self.dtype)
        return self._inputs[key]

    def _pass(self, rows: int, head_rows: int) -> None:
        for layer in self.layers:
            layer(self._x(rows, layer.in_features))
        if head_rows:
            self.head(self._x(head_rows, self.head.in_features))

    def seconds(self, rows: int, head_rows: int, min_seconds: float) -> float:
        """One pass's seconds (``rows`` through every layer, ``head_rows`` through the head), on one
        thread: the best of 3 means, each over enough passes to fill ``min_seconds / 3``; measured
        once per shape, so every run floored with this stack is timed at the same rates."""
        if (rows, head_rows) in self._seconds:
            return self._seconds[rows, head_rows]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                self._pass(rows, head_rows)
                t0 = time.perf_counter()
                self._pass(rows, head_rows)
                n = max(1, int(min_seconds / 3 / max(time.perf_counter() - t0, 1e-6)))
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        self._pass(rows, head_rows)
                    best = min(best, (time.perf_counter() - t0) / n)
        finally:
            torch.set_num_threads(threads)
        self._seconds[rows, head_rows] = best
        return best


def engine_floor(
    model_dir: Path,
    dtype: str,
    counters: Mapping[str, Any],
    *,
    requests: int,
    min_seconds: float = 1.0,
    stack: LinearStack | None = None,
) -> dict[str, Any]:
    """The linear-layer floor of the work ``counters`` (a replay's ``engine_counters``) record, for
    ``requests`` requests (each ends its prefill with one row through the head), against the
    engine's CPU seconds. ``min_seconds``: measuring time per row count; ``stack``: one already
    built (several runs floored with one stack share its timings)."""
    passes, tokens = int(counters["prefill_calls"]), int(counters["prefilled_tokens"])
    steps = {int(k): int(v) for k, v in (counters.get("batch_sizes") or {}).items() if int(v)}
    if not steps and counters.get("decode_steps"):
        raise ValueError(
            "engine counters without batch_sizes: the decode floor needs each step's row count"
        )
    stack = stack or LinearStack(model_dir, getattr(torch, dtype))
    rows = max(1, round(tokens / passes)) if passes else 0
    prefill_floor = (
        passes * stack.seconds(rows, round(requests / passes), min_seconds) if passes else 0.0
    )
    decode_floor = sum(
        n * stack.seconds(size, size, min_seconds) for size, n in sorted(steps.items())
    )
    prefill_cpu, decode_cpu = float(counters["prefill_cpu_s"]), float(counters["decode_cpu_s"])
    flops = tokens * stack.flops_per_row + requests * stack.head_flops_per_row
    flops += sum(size * n for size, n in steps.items()) * (
        stack.flops_per_row + stack.head_flops_per_row
    )
    floor = prefill_floor + decode_floor
    return {
        "what": "linear layers only (q, k, v, o, gate, up, down, head), one thread, "
        "this machine's rates",
        "dtype": dtype,
        "linear": stack.kernels.get("linear"),
        "prefill": {
            "passes": passes,
            "rows_per_pass": rows,
            "floor_s": round(prefill_floor, 6),
            "cpu_s": round(prefill_cpu, 3),
            "over_floor": round(prefill_cpu / prefill_floor, 3) if prefill_floor else None,
        },
        "decode": {
            "steps": sum(steps.values()),
            "rows_per_step": round(
                sum(s * n for s, n in steps.items()) / max(1, sum(steps.values())), 2
            ),
            "floor_s": round(decode_floor, 6),
            "cpu_s": round(decode_cpu, 3),
            "over_floor": round(decode_cpu / decode_floor, 3) if decode_floor else None,
        },
        "tflop": round(flops / 1e12, 3),
        "floor_s": round(floor, 6),
        "floor_gflops": round(flops / floor / 1e9, 1) if floor else None,
        "cpu_s": round(prefill_cpu + decode_cpu, 3),
        "over_floor": round((prefill_cpu + decode_cpu) / floor, 3) if floor else None,
    }
