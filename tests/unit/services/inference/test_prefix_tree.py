"""The radix-tree prefix cache: token-granular longest-prefix matches (inside an edge too),
insertion of only the missing tokens, LRU eviction down to the token budget, and KV that follows the
tokens."""

from __future__ import annotations

import torch

from leafe.services.inference.prefix import PrefixCache


def kv_of(prompt: list[int]):
    """KV whose every entry is the token id at that position: a match's segments must read back the
    ids."""

    def kv(start: int, end: int) -> torch.Tensor:
        ids = torch.tensor(prompt[start:end], dtype=torch.float32)
        return ids.reshape(1, 1, 1, -1, 1).expand(2, 2, 1, -1, 3)

    return kv


def tokens_of(cache: PrefixCache, prompt: list[int]) -> tuple[int, list[int]]:
    """Matched length and the token ids its KV segments carry, in order."""
    m = cache.match(prompt)
    got = [int(x) for seg in m.segments for x in seg[0, 0, 0, :, 0].tolist()]
    return m.length, got


def test_match_is_token_granular_and_keeps_the_last_token_for_the_model() -> None:
    """A prompt sharing any prefix with a cached one reuses exactly that prefix, wherever it ends
    (also inside an edge), never its own last token; the segments hold the KV of those very
    tokens."""
    cache = PrefixCache(1000)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert cache.insert(a, kv_of(a)) == 8
    assert tokens_of(cache, a) == (7, a[:7])
    assert tokens_of(cache, [1, 2, 3, 9, 9]) == (3, [1, 2, 3])
    assert tokens_of(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == (8, a)
    assert tokens_of(cache, [5, 1, 2]) == (0, [])
    assert tokens_of(cache, [1]) == (0, [])
    s = cache.stats
    assert (s.hits, s.misses, s.cached_tokens) == (3, 2, 18)


def test_insert_adds_only_missing_tokens_and_splits_edges() -> None:
    """Prompts that part inside an edge split it; shared tokens are stored once; re-inserting a
    cached prompt or a prefix of one adds nothing; a later match walks both branches to the right
    KV."""
    cache = PrefixCache(1000)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]
    cache.insert(a, kv_of(a))
    assert cache.insert(b, kv_of(b)) == 2
    assert cache.tokens == 8 and cache.nodes == 3
    assert cache.insert(a[:4], kv_of(a)) == 0 and cache.insert(b, kv_of(b)) == 0
    assert tokens_of(cache, [*b, 0]) == (5, b)
    assert tokens_of(cache, [*a, 0]) == (6, a)
    c = [1, 2, 3, 4, 5, 6, 10, 11]
    assert cache.insert(c, kv_of(c)) == 2
    assert tokens_of(cache, [*c, 0]) == (8, c)
    assert cache.stats.inserted_tokens == 10


def test_lru_eviction_respects_the_budget_and_drops_leaves_first() -> None:
    """Over budget, least recently used leaves go first; a shared prefix stays while a branch under
    it is in use; a used prompt survives others inserted after it."""
    cache = PrefixCache(12)
    shared = [1, 2, 3, 4]
    a, b, c = [*shared, 10, 11, 12], [*shared, 20, 21, 22], [*shared, 30, 31, 32]
    for p in (a, b):
        cache.insert(p, kv_of(p))
    assert cache.evict() == 0 and cache.tokens == 10
    cache.match([*a, 0])  # a is now more recent than b
    cache.insert(c, kv_of(c))
    assert cache.tokens == 13
    assert cache.evict() == 3 and cache.tokens == 10
    assert cache.match([*b, 0]).length == 4  # b's branch went, the shared prefix stayed
    assert cache.match([*a, 0]).length == 7 and cache.match([*c, 0]).length == 7
    small = PrefixCache(3)
    small.insert(a, kv_of(a))
    assert small.evict() == 7 and small.tokens == 0 and small.nodes == 0
    assert small.stats.evicted_tokens == 7


def test_clear_empties_the_tree() -> None:
    """``clear`` (weight swap, /flush_cache) drops every token and reports how many it held."""
    cache = PrefixCache(100)
    a = [1, 2, 3]
    cache.insert(a, kv_of(a))
    assert cache.clear() == 3 and cache.tokens == 0 and cache.match([1, 2, 3, 4]).length == 0


def test_clear_frees_every_edge_kv_at_once() -> None:
    """A node points at its parent and its parent at it, so dropping the root alone leaves the old
    tree to Python's cyclic garbage collector, which runs on object counts, not bytes, and rarely in
    a server: each weight update then kept up to a full cache of KV (~0.4 GB for SmolLM2-135M)
    alive, and the servers of an online run grew by ~5.5 GB over 15 pushes. ``clear`` must free the
    KV itself, without the collector."""
    import gc
    import weakref

    cache = PrefixCache(1000)
    for prompt in ([1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 7], [8, 8, 8]):  # splits: inner nodes too
        cache.insert(prompt, kv_of(prompt))
    held = [weakref.ref(n.kv) for n in cache._walk() if n.kv is not None]
    assert len(held) >= 6
    gc.disable()
    try:
        cache.clear()
        alive = sum(r() is not None for r in held)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of {len(held)} edges' KV outlived clear()"
