"""KV storage of the CPU inference server's batches: one preallocated tensor per batch (an arena)
that the model writes into in place.

An arena is ``[layers, 2 (keys, values), rows, kv_heads, columns, head_dim]``. Row ``r``'s tokens
sit in columns marked in the batch's ``[rows, columns]`` mask; every row writes its next token at
the same column ``write``, so a decode step appends one column without copying the cache
(transformers' ``DynamicLayer`` concatenates, copying every layer's KV on every step). Columns past
``write`` are spare capacity, masked for every row; the model sees the full width, so keys and
values reach attention as contiguous tensors (the bf16 matmul of a strided view is ~4x slower on
CPU). Attention over it is the model's (SDPA), or with the server's kernels
(``services/inference/kernels.py``) grouped matmuls at decode.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["ArenaCache", "KVLayout"]


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's KV cache."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: Any) -> KVLayout:
        """The layout of an HF decoder whose layers all use full attention (else ``TypeError``)."""
        config = model.config.get_text_config(decoder=True)
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise TypeError(
                f"the CPU server only batches full-attention models, got layer types {kinds}"
            )
        heads = int(config.num_attention_heads)
        return cls(
            layers=int(config.num_hidden_layers),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            dtype=next(model.parameters()).dtype,
        )

    def arena(self, rows: int, columns: int) -> torch.Tensor:
        """A zeroed arena (zeros: spare columns must hold finite values, masked or not)."""
        shape = (self.layers, 2, rows, self.kv_heads, columns, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype)

    def token_bytes(self) -> int:
        """Bytes of KV per token."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize


class _ArenaLayer(DynamicLayer):
    """One layer's view of an :class:`ArenaCache`: writes new tokens at the cache's write column."""

    def __init__(self, cache: ArenaCache, index: int) -> None:
        super().__init__()
        # A weak reference: cache -> layers -> cache would be a cycle, and each forward's ArenaCache
        # (with the arena it pins) would then live until the cyclic collector ran. In a long
        # evaluation that held GBs of dead arenas and got the server OOM-killed at 24 GiB.
        self.cache = weakref.proxy(cache)
        self.index = index
        self.is_initialized = True
        self.device = cache.arena.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        rows, n = key_states.shape[0], key_states.shape[-2]
        if rows != c.rows or c.write + n > c.arena.shape[4]:
            raise ValueError(f"{rows} rows x {n} tokens do not fit the arena at column {c.write}")
        keys, values = c.arena[self.index, 0, :rows], c.arena[self.index, 1, :rows]
        keys[:, :, c.write : c.write + n] = key_states
        values[:, :, c.write : c.write + n] = value_states
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self.cache.write

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.cache.arena.shape[4]), 0

    def get_max_length(self) -> int:
        return int(self.cache.arena.shape[4])


class ArenaCache(Cache):
    """A transformers ``Cache`` over the first ``rows`` rows of ``arena``; a forward writes its
    tokens at columns ``write..write+q-1`` (the caller advances ``write`` afterwards)."""

    def __init__(self, arena: torch.Tensor, rows: int, write: int) -> None:
        self.arena = arena
        self.rows = rows
        self.write = write
        super().__init__(layers=[_ArenaLayer(self, i) for i in range(arena.shape[0])])
