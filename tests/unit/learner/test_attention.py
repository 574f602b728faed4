"""Unit tests of learner/attention.py: the per-sample attention leaves unpacked batches as they
were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leafe.learner.attention import VARLEN, use_varlen_attention
from leafe.learner.batching import collate, collate_packed, to_items
from leafe.learner.model_io import load_model
from tests.support.learner import make_sample

pytestmark = pytest.mark.usefixtures("one_thread")


def test_left_padded_batches_give_exactly_the_sdpa_logits(tiny_dir: Path) -> None:
    """Without ``cu_seq_lens`` the implementation is transformers' SDPA with the same padding masks:
    a left-padded batch gives bit-identical logits."""
    sdpa, varlen = load_model(tiny_dir), load_model(tiny_dir)
    use_varlen_attention(varlen)
    assert varlen.config._attn_implementation == VARLEN
    items, _ = to_items(
        [make_sample(i, prompt_len=3 + 5 * i, completion_len=2) for i in range(3)], 4096
    )
    inputs = collate(items, 0).model_inputs()
    with torch.no_grad():
        assert torch.equal(sdpa(**inputs).logits, varlen(**inputs).logits)


def test_packed_boundaries_must_cover_one_row(tiny_dir: Path) -> None:
    """Segment boundaries that do not span the row are an error naming them, never a silent
    misattention."""
    model = load_model(tiny_dir)
    use_varlen_attention(model)
    items, _ = to_items([make_sample(1, prompt_len=4, completion_len=2)], 4096)
    inputs = collate_packed(items, 0).model_inputs()
    inputs["cu_seq_lens_q"] = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[0, 3\]"), torch.no_grad():
        model(**inputs)


def test_a_shared_prefix_must_be_the_rows_first_segment(tiny_dir: Path) -> None:
    """A prefix length that is not the first segment's is an error naming both, never a
    misattention."""
    model = load_model(tiny_dir)
    use_varlen_attention(model)
    items, _ = to_items(
        [make_sample(1, prompt_len=4, completion_len=2), make_sample(2, prompt_len=6)], 4096
    )
    inputs = collate_packed(items, 0).model_inputs() | {"shared_prefix_len": 3}
    with pytest.raises(ValueError, match="shared_prefix_len 3"), torch.no_grad():
        model(**inputs)
