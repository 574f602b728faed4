"""The arena cache must be freed by reference counting alone: a forward's ``ArenaCache`` pins its
arena (tens of MB per batch), and a reference cycle between the cache and its layers kept every one
of them alive until the cyclic collector ran (the full paper run's SR evaluation grew to 24 GiB and
was OOM-killed)."""

from __future__ import annotations

import gc
import weakref

import torch

from leafe.services.inference.kv import ArenaCache, KVLayout


def test_a_dropped_arena_cache_frees_its_arena_without_the_cycle_collector() -> None:
    layout = KVLayout(layers=3, kv_heads=2, head_dim=4, dtype=torch.float32)
    gc.disable()
    try:
        arena = layout.arena(rows=2, columns=8)
        cache = ArenaCache(arena, rows=2, write=0)
        keys = torch.ones(2, 2, 3, 4)
        cache.layers[1].update(keys, keys)
        assert cache.get_seq_length() == 0 and torch.equal(arena[1, 0, :, :, 0:3], keys)
        cache_ref, arena_ref = weakref.ref(cache), weakref.ref(arena)
        del cache, arena
        assert cache_ref() is None, "ArenaCache survived its last reference (a reference cycle)"
        assert arena_ref() is None, "the arena outlived its cache"
    finally:
        gc.enable()
