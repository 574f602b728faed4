"""Hypothesis: a packed row scores every sample exactly as the sample alone (learner/batching.py
packing + learner/attention.py per-sample attention), for any sample lengths and loss masks
(completion spans)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leafe.learner.attention import use_varlen_attention
from leafe.learner.batching import collate, collate_packed, to_items
from leafe.learner.losses import IGNORE
from leafe.learner.model_io import load_model
from tests.support.learner import make_sample


@pytest.fixture(scope="module")
def models(tiny_dir: Path) -> Iterator[tuple[Any, Any]]:
    """(reference with transformers' own SDPA attention, the same weights with per-sample
    attention)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    packed = load_model(tiny_dir)
    use_varlen_attention(packed)
    yield load_model(tiny_dir), packed
    torch.set_num_threads(saved)


samples_spec = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 8), st.sampled_from(["cf", "reh", "rft"])),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(spec=samples_spec, seed=st.integers(0, 10_000))
def test_packed_row_scores_each_sample_like_the_sample_alone(
    models: tuple[Any, Any], spec: list[tuple[int, int, str]], seed: int
) -> None:
    """Per-token log-probs of every completion, hence every sample's masked NLL, are the same in a
    packed row as for the sample alone (fp32, atol 1e-4: float rounding of different matmul shapes);
    slots outside a sample's completion stay exactly 0."""
    reference, packed_model = models
    samples = [
        make_sample(seed + 97 * i, kind=kind, prompt_len=p, completion_len=c)  # type: ignore[arg-type]
        for i, (p, c, kind) in enumerate(spec)
    ]
    items, skipped = to_items(samples, 4096)
    assert not skipped
    with torch.no_grad():
        mb = collate_packed(items, 0)
        packed = mb.sample_logprobs(packed_model(**mb.model_inputs(), use_cache=False).logits)
        for i, item in enumerate(items):
            alone_mb = collate([item], 0)
            alone = alone_mb.sample_logprobs(
                reference(**alone_mb.model_inputs(), use_cache=False).logits
            )[0]
            c = item.completion_len
            assert torch.allclose(packed[i, -c:], alone, atol=1e-4), (i, packed[i, -c:], alone)
            assert float(-packed[i].sum()) == pytest.approx(float(-alone.sum()), abs=1e-4 * c)
            assert torch.all(packed[i, :-c] == 0) and torch.all(mb.labels[i, :-c] == IGNORE)
