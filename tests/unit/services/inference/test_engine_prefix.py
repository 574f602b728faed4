"""The generation engine with its radix prefix cache gives the outputs of an engine without one: the
same greedy tokens and logprobs (within float rounding of batched matmuls) whether a prompt's prefix
comes from the cache (whole edges or part of one), was evicted under a small budget, is shared by
requests admitted together, or was computed by other weights before a swap."""

from __future__ import annotations

import random
import time

import pytest

from leafe.learner.model_io import load_model, tiny_model_dir
from tests.unit.services.inference.conftest import (
    EngineFactory,
    Result,
    alone,
    generate,
    perturbed_state,
    submit,
)

TOL = 1e-4


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 4000) for _ in range(n)]


def assert_same(got: list[Result], want: list[Result]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=TOL)


def test_cached_prefixes_change_nothing(make_engine: EngineFactory) -> None:
    """Prompts extending a cached one, leaving it inside an edge, or extending a longer one reuse
    exactly the shared tokens (``cached_tokens``) and produce the cold engine's tokens and
    logprobs."""
    base = tokens(40, seed=1)
    prompts = [
        base,
        base + tokens(10, seed=2),  # extends a cached prompt: 40 cached
        base[:25] + tokens(12, seed=3),  # parts inside the cached edge: 25 cached
        base + tokens(10, seed=2) + tokens(7, seed=4),  # extends the second prompt: 50 cached
        base[:3] + tokens(30, seed=5),  # shares only 3 tokens
    ]
    cold = alone(make_engine(cache_tokens=None), prompts, 12)
    warm = alone(make_engine(cache_tokens=10_000), prompts, 12)
    assert [r.cached_tokens for r in warm] == [0, 40, 25, 50, 3]
    assert all(r.cached_tokens == 0 for r in cold)
    assert_same(warm, cold)


def test_eviction_under_a_small_budget_keeps_outputs_exact(make_engine: EngineFactory) -> None:
    """With a budget smaller than two prompts the tree evicts after every admission; it never holds
    more than its budget afterwards, what it still holds is reused, and outputs stay exact."""
    shared = tokens(20, seed=10)
    prompts = [shared + tokens(15 + i, seed=20 + i) for i in range(5)]
    order = [0, 1, 0, 2, 3, 1, 4, 0]
    engine = make_engine(cache_tokens=60)
    cold = alone(make_engine(cache_tokens=None), prompts, 8)
    assert engine.prefix is not None
    warm = []
    for i in order:
        warm.append(generate(engine, [prompts[i]], 8)[0])
        assert engine.prefix.tokens <= 60
    assert engine.prefix.stats.evicted_tokens > 0
    assert all(
        r.cached_tokens >= 20 for r in warm[1:]
    )  # the shared prefix survives: used every time
    assert_same(warm, [cold[i] for i in order])


def test_concurrent_requests_sharing_prefixes(make_engine: EngineFactory) -> None:
    """Requests admitted together (identical prompts; prompts whose cached prefixes differ in
    length, prefilled in one pass next to uncached ones) each get what they would get alone;
    identical prompts are prefilled once."""
    shared = tokens(30, seed=30)
    same = shared + tokens(9, seed=31)
    partial = [
        shared[:12] + tokens(27, seed=32),
        shared + tokens(25, seed=33),
        shared[:20] + tokens(24, seed=34),
    ]
    prompts = [
        *([same] * 4),
        *partial,
        *(shared + tokens(n, seed=40 + n) for n in (1, 5)),
        *(tokens(n, seed=50 + n) for n in (7, 26, 61)),
    ]
    cold = alone(make_engine(cache_tokens=None), prompts, 10)
    # A wide admission window: the 12 requests are submitted one by one, and on a loaded machine the
    # test thread can take longer than the default 5 ms to submit them (the 4 identical ones then
    # split).
    engine = make_engine(cache_tokens=10_000, batch_wait_s=0.5)
    generate(engine, [[*shared, 7]], 2)  # caches the shared prefix
    before = engine.stats.shared_tokens
    warm = generate(engine, prompts, 10)
    assert_same(warm, cold)
    assert engine.stats.shared_tokens - before == 3 * len(same)
    assert [r.cached_tokens for r in warm[:9]] == [30] * 4 + [12, 30, 20, 30, 30]
    assert engine.stats.prefill_calls - 1 < len(prompts) - 3  # distinct prompts share passes


def test_long_prompts_join_running_rows_and_long_generations_regrow(
    make_engine: EngineFactory,
) -> None:
    """A prompt longer than the running rows joins them mid-generation (their KV gets a masked gap),
    generations longer than the spare columns make the arena regrow, and every row's output is the
    one it gets alone."""
    short = [tokens(8 + i, seed=60 + i) for i in range(3)]
    long = tokens(150, seed=70)
    cold = alone(make_engine(cache_tokens=None), [*short, long], 100)
    engine = make_engine(cache_tokens=10_000)
    futures = [submit(engine, p, 100) for p in short]
    deadline = time.monotonic() + 60
    while engine.stats.decode_steps < 5 and time.monotonic() < deadline:  # join once they decode
        time.sleep(0.005)
    assert engine.stats.decode_steps >= 5 and not any(f.done() for f in futures)
    futures.append(submit(engine, long, 100))
    warm = [
        Result(list(s.output_ids), list(s.logprobs), s.cached_tokens)
        for f in futures
        for s in f.result(60)
    ]
    assert_same(warm, cold)


def test_a_weight_swap_empties_the_prefix_cache(make_engine: EngineFactory) -> None:
    """After a swap no KV of the old weights is reused: the tree is empty, the next request is
    computed from scratch with the new weights (equal to a cold engine serving them)."""
    prompt = tokens(30, seed=80)
    engine = make_engine(cache_tokens=10_000)
    generate(engine, [prompt], 4)
    assert engine.prefix is not None and engine.prefix.tokens == len(prompt)
    new = perturbed_state(load_model(tiny_model_dir()), seed=1)
    engine.swap_weights(new, "v1").result(timeout=60)
    assert engine.prefix.tokens == 0
    [after] = generate(engine, [prompt], 4)
    assert after.cached_tokens == 0
    reference = make_engine(cache_tokens=None)
    reference.swap_weights({k: v.clone() for k, v in new.items()}, "v1").result(timeout=60)
    assert_same([after], alone(reference, [prompt], 4))
