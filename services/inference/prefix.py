"""Prompt prefix cache of the CPU inference server: the KV of recent prompts, reused when a new prompt
starts with (part of) one, so only the new suffix is prefilled.

Agent prompts repeat: the instructions and task open every step's prompt, an episode's history grows by
one line per step, branches restart from a shared history, and rollouts of one task send the same first
prompt. On CPU, prefill dominates such workloads (bench/inference.py), so this is the cheap part of
SGLang's radix cache: a small LRU of whole prompts (a prompt that extends a cached one replaces it),
matched by longest common prefix. Entries are copies, never views of a running batch, and hold the KV
of the weights that computed them: the engine clears the cache when weights change.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["KV", "PrefixCache", "PrefixStats"]

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each ``[1, H, T, D]``."""


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class PrefixStats:
    """Lookups that reused a prefix, those that did not, and prompt tokens not recomputed."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0


class PrefixCache:
    """LRU of prompt KV caches bounded by ``capacity_tokens``; thread-safe."""

    def __init__(self, capacity_tokens: int, *, min_match: int = 16) -> None:
        self.capacity_tokens = capacity_tokens
        self.min_match = min_match
        self.stats = PrefixStats()
        self._entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Prompt tokens held."""
        return self._tokens

    def lookup(self, prompt: list[int]) -> tuple[int, KV | None]:
        """Longest cached prefix of ``prompt`` (at most ``len(prompt) - 1``: the last prompt token must
        be run to get the next-token logits); ``(0, None)`` below ``min_match``."""
        best, best_key = 0, None
        with self._lock:
            for key in self._entries:
                if key[0] == prompt[0] and (n := _common_prefix(key, prompt)) > best:
                    best, best_key = n, key
            best = min(best, len(prompt) - 1)
            if best_key is None or best < self.min_match:
                self.stats.misses += 1
                return 0, None
            self._entries.move_to_end(best_key)
            self.stats.hits += 1
            self.stats.cached_tokens += best
            return best, self._entries[best_key]

    def insert(self, prompt: list[int], kv: KV) -> None:
        """Remember ``prompt``'s KV (copies of ``[1, H, len(prompt), D]`` tensors)."""
        if len(prompt) < self.min_match or len(prompt) > self.capacity_tokens:
            return
        key = tuple(prompt)
        with self._lock:
            for old in list(self._entries):
                n = _common_prefix(old, prompt)
                if n == len(key) and len(old) >= len(key):  # an entry already covers this prompt
                    self._entries.move_to_end(old)
                    return
                if n == len(old):  # the new prompt extends this entry: it replaces it
                    self._drop(old)
            self._entries[key] = kv
            self._tokens += len(key)
            while self._tokens > self.capacity_tokens:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self._tokens -= len(key)

    def clear(self) -> None:
        """Forget every entry (weights changed, or ``/flush_cache``)."""
        with self._lock:
            self._entries.clear()
            self._tokens = 0
