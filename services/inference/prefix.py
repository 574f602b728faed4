"""Prompt prefix cache of the CPU inference server: a radix tree over token ids whose edges hold the
KV of their tokens, so a prompt that starts like an earlier one prefills only the tokens after the
shared part.

Agent prompts repeat: every step's prompt opens with the same instructions and task, an episode's
next turn extends its last prompt, the n samples of a task send the same first prompt. As in
SGLang's radix cache (page size 1), a lookup walks the tree from the root and matches token by
token, so any shared prefix is reused whatever its length and wherever it ends (inside an edge
included); an insertion adds only the tokens the tree does not hold, splitting an edge where two
prompts part. The tree keeps at most ``capacity_tokens`` tokens after :meth:`PrefixCache.evict`:
least recently used leaves go first (a node is used by every lookup and insertion that passes
through it, so a parent is never older than its children). Edges hold copies, never views of a
running batch, and the KV of the weights that computed them: the engine clears the tree when weights
change.

KV of ``n`` tokens is one tensor ``[layers, 2 (keys, values), kv_heads, n, head_dim]``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PrefixCache", "PrefixMatch", "PrefixStats"]

KVSlice = Callable[[int, int], torch.Tensor]
"""``kv(start, end)``: the KV of a prompt's tokens ``start..end-1``, ``[layers, 2, kv_heads, n,
dim]``."""


@dataclass
class PrefixStats:
    """Cumulative counters of the tree."""

    hits: int = 0
    """Lookups that reused at least one token."""
    misses: int = 0
    """Lookups that reused nothing."""
    cached_tokens: int = 0
    """Prompt tokens served from the tree (not recomputed)."""
    inserted_tokens: int = 0
    """Tokens added to the tree."""
    evicted_tokens: int = 0
    """Tokens dropped by LRU eviction."""


@dataclass(frozen=True)
class PrefixMatch:
    """The cached part of a prompt: its length and the KV of those tokens in order, edge by edge."""

    length: int
    segments: tuple[torch.Tensor, ...] = ()
    """``[layers, 2, kv_heads, n_i, dim]`` each; the ``n_i`` sum to ``length``."""


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    """Token ids on the edge from the parent to this node."""
    kv: torch.Tensor | None
    """KV of ``key``'s tokens (``None`` only at the root)."""
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    """Children by the first token of their edge."""
    used: int = 0
    """Logical time of the last lookup or insertion through this node."""


def _common(key: tuple[int, ...], prompt: Sequence[int], start: int) -> int:
    n = min(len(key), len(prompt) - start)
    for i in range(n):
        if key[i] != prompt[start + i]:
            return i
    return n


class PrefixCache:
    """Radix tree of prompt KV bounded by ``capacity_tokens`` (enforced by :meth:`evict`);
    thread-safe."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.stats = PrefixStats()
        self._root = _Node(key=(), kv=None, parent=None)
        self._tokens = 0
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held."""
        return self._tokens

    @property
    def nodes(self) -> int:
        """Edges held (for stats and tests)."""
        with self._lock:
            return sum(1 for _ in self._walk()) - 1

    def match(self, prompt: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``prompt``, at most ``len(prompt) - 1`` tokens (the last
        prompt token must run through the model to give the next-token logits)."""
        limit = len(prompt) - 1
        segments: list[torch.Tensor] = []
        pos = 0
        with self._lock:
            now = next(self._clock)
            node = self._root
            while pos < limit and (child := node.children.get(prompt[pos])) is not None:
                n = min(_common(child.key, prompt, pos), limit - pos)
                assert child.kv is not None
                segments.append(child.kv if n == len(child.key) else child.kv[:, :, :, :n])
                child.used = now
                pos += n
                if n < len(child.key):
                    break
                node = child
            if pos:
                self.stats.hits += 1
                self.stats.cached_tokens += pos
            else:
                self.stats.misses += 1
        return PrefixMatch(length=pos, segments=tuple(segments))

    def insert(self, prompt: Sequence[int], kv: KVSlice) -> int:
        """Add the tokens of ``prompt`` the tree lacks, their KV read with ``kv(start, end)``
        (copied); returns how many were added. Call :meth:`evict` afterwards to return under the
        capacity."""
        with self._lock:
            now = next(self._clock)
            node, pos = self._root, 0
            while pos < len(prompt):
                child = node.children.get(prompt[pos])
                if child is None:
                    leaf = _Node(
                        key=tuple(prompt[pos:]), kv=kv(pos, len(prompt)).clone(), parent=node
                    )
                    leaf.used = now
                    node.children[prompt[pos]] = leaf
                    added = len(prompt) - pos
                    self._tokens += added
                    self.stats.inserted_tokens += added
                    return added
                n = _common(child.key, prompt, pos)
                if n < len(child.key):
                    child = self._split(child, n)
                child.used = now
                node, pos = child, pos + n
            return 0

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node``'s edge after ``n`` tokens; returns the new upper node (``node`` becomes its
        child). Both halves are copies, so evicting one frees its memory."""
        assert node.kv is not None and node.parent is not None
        upper = _Node(
            key=node.key[:n], kv=node.kv[:, :, :, :n].clone(), parent=node.parent, used=node.used
        )
        node.parent.children[node.key[0]] = upper
        node.key, node.kv, node.parent = node.key[n:], node.kv[:, :, :, n:].clone(), upper
        upper.children[node.key[0]] = node
        return upper

    def evict(self) -> int:
        """Drop least recently used leaves until at most ``capacity_tokens`` are held; returns how
        many tokens went."""
        with self._lock:
            if self._tokens <= self.capacity_tokens:
                return 0
            order = itertools.count()
            heap = [(n.used, next(order), n) for n in self._walk() if not n.children and n.parent]
            heapq.heapify(heap)
            dropped = 0
            while self._tokens > self.capacity_tokens and heap:
                _, _, leaf = heapq.heappop(heap)
                parent = leaf.parent
                assert parent is not None
                del parent.children[leaf.key[0]]
                self._tokens -= len(leaf.key)
                dropped += len(leaf.key)
                if not parent.children and parent.parent is not None:
                    heapq.heappush(heap, (parent.used, next(order), parent))
            self.stats.evicted_tokens += dropped
            return dropped

    def _walk(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def clear(self) -> int:
        """Forget every entry (weights changed, or ``/flush_cache``); returns how many tokens it
        held."""
        with self._lock:
            held = self._tokens
            for (
                node
            ) in self._walk():  # parent <-> children are cycles: free the KV now, not at the next
                node.kv, node.parent, node.children = (
                    None,
                    None,
                    {},
                )  # cyclic GC (a cache's KV per swap)
            self._root = _Node(key=(), kv=None, parent=None)
            self._tokens = 0
            return held
