"""Unit tests of learner/batching.py: left-padded and packed layouts, label alignment, micro-batch
plans."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leafe.learner.batching import (
    collate,
    collate_packed,
    kind_tokens,
    out_of_vocab,
    pack_rows,
    plan_micro_batches,
    shared_prefix_len,
    to_items,
)
from leafe.learner.config import BatchConfig
from leafe.learner.losses import IGNORE, token_logprobs
from tests.support.learner import make_sample, make_samples

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 0


def test_labels_are_exactly_the_completion_tokens_at_the_right_edge() -> None:
    """Every non-IGNORE label is a completion token, in order; prompt tokens never become labels."""
    samples = [
        make_sample(1, prompt_len=5, completion_len=3),
        make_sample(2, prompt_len=9, completion_len=1),
    ]
    items, _ = to_items(samples, 4096)
    mb = collate(items, PAD)
    assert mb.input_ids.shape == (2, 10)
    assert mb.labels.shape == (2, 3)
    for row, s in enumerate(samples):
        got = [int(x) for x in mb.labels[row] if x != IGNORE]
        assert got == s.completion_ids
        assert mb.input_ids[row, -len(s.prompt_ids) - len(s.completion_ids) :].tolist() == [
            *s.prompt_ids,
            *s.completion_ids,
        ]
    assert mb.position_ids[0].tolist() == [0, 0, *range(8)]  # left pad, positions restart at 0
    assert mb.attention_mask.sum().item() == 8 + 10


def test_prompt_content_never_reaches_the_labels() -> None:
    """Changing any prompt token changes the inputs but not the labels."""
    a = make_sample(3, prompt_len=7, completion_len=2)
    b = msgspec.structs.replace(a, prompt_ids=[5] * 7)
    ma, mb = collate(to_items([a], 4096)[0], PAD), collate(to_items([b], 4096)[0], PAD)
    assert torch.equal(ma.labels, mb.labels)
    assert not torch.equal(ma.input_ids, mb.input_ids)


def test_too_long_and_empty_samples_are_skipped_with_their_ids() -> None:
    """Unusable samples (too long, empty, GRPO without advantage, logprobs of the wrong length) are
    reported with a reason, never truncated and never raised on (one bad sample must not stop a
    learner)."""
    long = make_sample(4, prompt_len=50, completion_len=2)
    empty = make_sample(5, prompt_len=3, completion_len=0)
    ok = make_sample(6, prompt_len=3, completion_len=2)
    bad_grpo = make_sample(7, kind="grpo", prompt_len=3, completion_len=2)
    bad_grpo = msgspec.structs.replace(bad_grpo, advantage=None)
    bad_logprobs = make_sample(8, prompt_len=3, completion_len=2, behaviour_logprobs=[-1.0])
    items, skipped = to_items([long, empty, ok, bad_grpo, bad_logprobs], 20)
    assert [i.sample_id for i in items] == [ok.sample_id]
    assert [sid for sid, _ in skipped] == [
        long.sample_id,
        empty.sample_id,
        bad_grpo.sample_id,
        bad_logprobs.sample_id,
    ]
    assert skipped[0][1] == "52 tokens > max_seq_len 20"


@pytest.mark.parametrize(
    ("where", "bad"), [("prompt", -1), ("completion", 2**40), ("completion", 100)]
)
def test_samples_with_a_token_id_outside_the_vocabulary_are_skipped_with_the_id(
    where: str, bad: int
) -> None:
    """An id the model has no embedding row for (negative, huge, or the vocabulary size itself)
    would raise in the forward pass: the batch check skips the sample naming the id; the others
    train."""
    ok = make_sample(1, prompt_len=3, completion_len=2, vocab=100)
    ids = list(getattr(ok, f"{where}_ids"))
    ids[-1] = bad
    evil = msgspec.structs.replace(
        make_sample(2, prompt_len=3, completion_len=2, vocab=100), **{f"{where}_ids": ids}
    )
    items, skipped = to_items([ok, evil], 4096, vocab_size=100)
    reason = f"{where} token id {bad} is outside the model's vocabulary (0..99)"
    assert [i.sample_id for i in items] == [ok.sample_id]
    assert skipped == [(evil.sample_id, reason)]
    assert out_of_vocab(evil, 100) == reason and out_of_vocab(ok, 100) is None


def test_kind_tokens_counts_target_tokens_per_kind() -> None:
    """The loss denominators are target-token counts per kind."""
    s = [make_sample(1, kind="cf", completion_len=3), make_sample(2, kind="reh", completion_len=2)]
    s.append(make_sample(3, kind="cf", completion_len=4))
    t = kind_tokens(to_items(s, 4096)[0])
    assert (t.cf, t.reh, t.rft, t.grpo) == (7.0, 2.0, 0.0, 0.0)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 4),
    budget=st.integers(16, 200),
    mode=st.sampled_from(["length", "none", "pack"]),
)
def test_plan_deals_every_item_once_and_ranks_run_equal_micro_batches(
    n: int, world: int, budget: int, mode: str
) -> None:
    """Each item lands in exactly one (micro-batch, rank); every rank has the same number of
    micro-batches; bucketed micro-batches (padded tokens) and packed rows (tokens) respect the token
    budget unless a single sample exceeds it."""
    items, _ = to_items(make_samples(n), 4096)
    cfg = BatchConfig(micro_batch_tokens=budget, micro_batch_size=3, bucketing=mode)  # type: ignore[arg-type]
    plan = plan_micro_batches(items, world, cfg)
    seen = sorted(i for mb in plan for share in mb for i in share)
    assert seen == list(range(n))
    assert all(len(mb) == world for mb in plan)
    if mode == "length":
        for mb in plan:
            for share in mb:
                if len(share) > 1:
                    assert len(share) * max(items[i].length for i in share) <= budget
    if mode == "pack":
        shares = [share for mb in plan for share in mb]
        assert all(sum(items[i].length for i in s) <= budget for s in shares if len(s) > 1)
        assert all(
            shares[: len(shares) - world + 1]
        )  # only the last micro-batch may have empty shares


def test_bucketing_pads_less_than_arrival_order() -> None:
    """On variable-length samples, length bucketing processes fewer padded tokens than fixed
    batches."""
    samples = [
        make_sample(i, prompt_len=5 + (i * 37) % 90, completion_len=1 + i % 5) for i in range(48)
    ]
    items, _ = to_items(samples, 4096)

    def padded(mode: str) -> int:
        cfg = BatchConfig(micro_batch_tokens=400, micro_batch_size=4, bucketing=mode)  # type: ignore[arg-type]
        plan = plan_micro_batches(items, 1, cfg)
        return sum(collate([items[i] for i in mb[0]], PAD).padded_tokens for mb in plan)

    real = sum(i.length for i in items)
    assert padded("length") < padded("none")
    assert padded("length") <= real * 1.15


def test_empty_share_is_a_dummy_row_without_loss() -> None:
    """A rank without rows gets one zero-weight row whose labels are all IGNORE."""
    mb = collate([], PAD)
    assert mb.input_ids.shape[0] == 1
    assert torch.all(mb.labels == IGNORE)
    assert mb.weights.tolist() == [0.0]
    assert mb.real_tokens == 0


def test_left_padded_batch_scores_like_single_rows(tiny_dir: Path) -> None:
    """Logprobs of each completion in a left-padded batch equal those of the sample alone (SDPA,
    fp32)."""
    from leafe.learner.model_io import load_model

    model = load_model(tiny_dir)
    samples = [make_sample(i, prompt_len=3 + 7 * i, completion_len=1 + i) for i in range(4)]
    items, _ = to_items(samples, 4096)

    def score(rows: list) -> torch.Tensor:
        mb = collate(rows, PAD)
        out = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            logits_to_keep=mb.keep,
        )
        return token_logprobs(out.logits[:, :-1], mb.labels)

    with torch.no_grad():
        batched = score(items)
        for row, it in enumerate(items):
            alone = score([it])[0, -it.completion_len :]
            assert torch.allclose(batched[row, -it.completion_len :], alone, atol=1e-4)
            assert torch.all(batched[row, : -it.completion_len] == 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_is_deterministic(world: int) -> None:
    """The same batch gives the same plan on every call (ranks compute it independently)."""
    items, _ = to_items(make_samples(30), 4096)
    cfg = BatchConfig(micro_batch_tokens=64)
    assert plan_micro_batches(items, world, cfg) == plan_micro_batches(items, world, cfg)


def test_packed_row_restarts_positions_and_targets_exactly_the_completions() -> None:
    """One row holds the samples back to back: positions restart at 0 per sample, ``cu_seq_lens``
    are the boundaries, the kept positions predict exactly each completion's tokens in order, and
    they map onto the same right-aligned label layout as left padding; no padding, no attention
    mask."""
    samples = [
        make_sample(1, prompt_len=5, completion_len=3),
        make_sample(2, prompt_len=9, completion_len=1),
    ]
    samples.append(make_sample(3, prompt_len=2, completion_len=2))
    items, _ = to_items(samples, 4096)
    mb = collate_packed(items, PAD)
    assert mb.packing is not None and mb.attention_mask is None
    assert mb.input_ids[0].tolist() == [
        t for s in samples for t in (*s.prompt_ids, *s.completion_ids)
    ]
    assert mb.position_ids[0].tolist() == [*range(8), *range(10), *range(4)]
    assert mb.packing.cu_seq_lens.tolist() == [0, 8, 18, 22]
    assert mb.packing.keep.tolist() == [4, 5, 6, 16, 19, 20]
    assert mb.packing.targets[0].tolist() == [t for s in samples for t in s.completion_ids]
    assert torch.equal(mb.labels, collate(items, PAD).labels)
    assert torch.equal(mb.labels[mb.packing.sample, mb.packing.slot], mb.packing.targets[0])
    assert mb.real_tokens == mb.padded_tokens == 22


def test_packing_fills_rows_without_padding() -> None:
    """First-fit decreasing: every sample in one row, rows within the budget, no padded token, and
    no more rows than one beyond the tokens / budget bound on these agent-like lengths."""
    samples = [
        make_sample(i, prompt_len=5 + (i * 37) % 90, completion_len=1 + i % 5) for i in range(48)
    ]
    items, _ = to_items(samples, 4096)
    rows = pack_rows(items, 400)
    assert sorted(i for r in rows for i in r) == list(range(48))
    assert all(sum(items[i].length for i in r) <= 400 for r in rows)
    real = sum(i.length for i in items)
    assert len(rows) <= -(-real // 400) + 1
    assert sum(collate_packed([items[i] for i in r], PAD).padded_tokens for r in rows) == real


def test_empty_packed_share_is_a_dummy_row_without_loss() -> None:
    """A rank without samples in a packed micro-batch gets a zero-weight row whose targets are
    IGNORE."""
    mb = collate_packed([], PAD)
    assert mb.packing is not None and torch.all(mb.packing.targets == IGNORE)
    assert torch.all(mb.labels == IGNORE) and mb.weights.tolist() == [0.0] and mb.real_tokens == 0


def _with_prefix(samples: list, prefix: list[int]) -> list:
    return [msgspec.structs.replace(s, prompt_ids=[*prefix, *s.prompt_ids]) for s in samples]


def test_a_shared_prefix_heads_the_row_once_and_each_sample_continues_it() -> None:
    """``share_prefix``: the prompt prefix all samples share is the row's first segment, once; each
    sample keeps the rest of its tokens with positions continuing after the prefix; the kept
    positions predict exactly each completion, on the same label layout as without sharing."""
    prefix = list(range(7, 47))  # 40 tokens: at least MIN_SHARED_PREFIX
    samples = _with_prefix(
        [
            make_sample(1, prompt_len=5, completion_len=3),
            make_sample(2, prompt_len=9, completion_len=1),
        ],
        prefix,
    )
    items, _ = to_items(samples, 4096)
    mb = collate_packed(items, PAD, share_prefix=True)
    assert mb.packing is not None and mb.packing.prefix == 40
    own = [(*s.prompt_ids[40:], *s.completion_ids) for s in samples]
    assert mb.input_ids[0].tolist() == [*prefix, *own[0], *own[1]]
    assert mb.position_ids[0].tolist() == [*range(40), *range(40, 48), *range(40, 50)]
    assert mb.packing.cu_seq_lens.tolist() == [0, 40, 48, 58]
    assert mb.packing.targets[0].tolist() == [t for s in samples for t in s.completion_ids]
    assert torch.equal(mb.labels, collate_packed(items, PAD).labels)
    assert torch.equal(mb.labels[mb.packing.sample, mb.packing.slot], mb.packing.targets[0])
    assert mb.padded_tokens == 58 and mb.real_tokens == 98  # the samples in full: 48 + 50
    assert mb.model_inputs()["shared_prefix_len"] == 40
    assert "shared_prefix_len" not in collate_packed(items, PAD).model_inputs()


def test_the_shared_prefix_stops_before_any_prompt_ends() -> None:
    """A prompt that is a prefix of another's keeps its last token (it predicts the first completion
    token): the shared prefix is at most the shortest prompt - 1; one sample, none in common, or
    fewer tokens in common than the minimum (SDPA's causal fast path is worth more than a chat
    header) share nothing."""
    a = make_sample(1, prompt_len=40, completion_len=2)
    b = msgspec.structs.replace(a, sample_id="b", prompt_ids=[*a.prompt_ids, 5, 6])
    items, _ = to_items([a, b], 4096)
    assert shared_prefix_len(items) == 39
    assert shared_prefix_len(items[:1]) == 0
    c = msgspec.structs.replace(
        a, sample_id="c", prompt_ids=[*a.prompt_ids[:10], 999, *a.prompt_ids[11:]]
    )
    near, _ = to_items([a, c], 4096)
    assert shared_prefix_len(near) == 0 and shared_prefix_len(near, minimum=10) == 10
    other, _ = to_items(
        [make_sample(2, prompt_len=6), msgspec.structs.replace(a, prompt_ids=[999, *a.prompt_ids])],
        4096,
    )
    assert shared_prefix_len(other) == 0
    assert collate_packed(items[:1], PAD, share_prefix=True).packing.prefix == 0  # type: ignore[union-attr]


def test_packing_with_a_shared_prefix_fits_more_samples_per_row() -> None:
    """The plan counts a row as the prefix once plus each sample's rest: every row within the
    budget."""
    samples = _with_prefix(
        [make_sample(i, prompt_len=5 + i % 9, completion_len=2) for i in range(40)],
        list(range(1, 61)),
    )
    items, _ = to_items(samples, 4096)
    plain = plan_micro_batches(items, 1, BatchConfig(micro_batch_tokens=300, bucketing="pack"))
    shared = plan_micro_batches(
        items, 1, BatchConfig(micro_batch_tokens=300, bucketing="pack", share_prefix=True)
    )
    assert sorted(i for m in shared for r in m for i in r) == list(range(40))
    rows = [collate_packed([items[i] for i in m[0]], PAD, share_prefix=True) for m in shared]
    assert all(mb.padded_tokens <= 300 for mb in rows)
    assert len(shared) * 3 <= len(plain)
