"""Unit tests of learner/online.py: the ordered sample buffer and the staleness rule."""

from __future__ import annotations

from dataclasses import dataclass

from leafe.learner.config import LearnerConfig
from leafe.learner.online import SampleBuffer, policy_lag
from leafe.protocol.samples import Sample
from tests.support.learner import make_sample


@dataclass
class FakeDelivery:
    """Stands in for leafe.services.bus.Delivery: only value and stream_seq are read."""

    value: Sample
    stream_seq: int


def _d(seq: int, **kw: object) -> FakeDelivery:
    return FakeDelivery(make_sample(seq, **kw), seq)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_policy_lag_counts_versions_behind() -> None:
    """Lag = learner's version index - sample's; base 'default' is 0; foreign names are unknown."""
    assert policy_lag("v000003", 5) == 2
    assert policy_lag("default", 2) == 2
    assert policy_lag("v000009", 5) == 0
    assert policy_lag("other", 5) is None


def test_take_returns_lowest_sequences_first_and_advances_the_floor() -> None:
    """Batches are cut in stream order whatever the arrival order; later redeliveries are
    duplicates."""
    buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf", "reh"], max_policy_lag=None)
    buf.add([_d(7), _d(3), _d(5), _d(9)])
    b = buf.take(2, current_index=0)
    assert [d.stream_seq for d in b.consumed] == [3, 5]
    assert b.max_seq == 5 and buf.floor == 5
    buf.add([_d(5), _d(9), _d(11)])
    assert [d.stream_seq for d in buf.pop_duplicates()] == [5, 9]
    assert [d.stream_seq for d in buf.take(10, 0).consumed] == [7, 9, 11]


def test_stale_and_foreign_kind_samples_are_consumed_but_not_trained() -> None:
    """Samples too many versions behind, or of an untrained kind, are dropped, counted and still
    consumed."""
    buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf"], max_policy_lag=2)
    buf.add(
        [
            _d(1, policy_version="v000001"),
            _d(2, policy_version="v000004"),
            _d(3, kind="grpo"),
            _d(4, policy_version="odd"),
            _d(5, policy_version="v000003"),
        ]
    )
    b = buf.take(10, current_index=5)
    assert [s.sample_id for s in b.samples] == [
        make_sample(2).sample_id,
        make_sample(4).sample_id,
        make_sample(5).sample_id,
    ]
    assert (b.stale, b.ignored, b.unknown_version, b.max_seq) == (1, 1, 1, 5)


def test_take_fills_the_batch_past_dropped_samples() -> None:
    """A batch holds global_batch trainable samples when enough are buffered, skipping stale
    ones."""
    buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf"], max_policy_lag=0)
    buf.add(
        [
            _d(1, policy_version="default"),
            _d(2, policy_version="v000001"),
            _d(3, policy_version="v000001"),
        ]
    )
    b = buf.take(2, current_index=1)
    assert len(b.samples) == 2 and b.stale == 1 and b.max_seq == 3


def test_ready_on_full_batch_or_after_waiting() -> None:
    """Train when a global batch is buffered, or a partial one >= min_batch waited max_wait_s."""
    clock = Clock()
    buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf"], max_policy_lag=None, clock=clock)
    assert not buf.ready(4, 10.0, 1)
    buf.add([_d(1), _d(2)])
    assert not buf.ready(4, 10.0, 1)
    clock.t = 10.5
    assert buf.ready(4, 10.0, 1)
    assert not buf.ready(4, 10.0, 3)
    buf.add([_d(3), _d(4)])
    assert buf.ready(4, 100.0, 1)


def test_by_default_a_partial_batch_waits_for_the_flush() -> None:
    """Issue 62: ``min_batch`` 0 (the default) is the global batch, so 1-4 samples are never a step
    however long they waited (an online LEAFE run took 38 of its 53 steps on 1-4 samples); only
    ``flush`` (``leafe run`` waiting for the stream's tail) trains them, after the same wait."""
    clock = Clock()
    buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf"], max_policy_lag=None, clock=clock)
    buf.add([_d(i) for i in range(1, 5)])
    clock.t = 1000.0
    assert not buf.ready(16, 10.0, LearnerConfig().min_batch)
    assert buf.ready(16, 10.0, LearnerConfig().min_batch, flush=True)
    clock.t = 0.0
    buf.add([_d(5)])
    assert not buf.ready(16, 10.0, 0, flush=True)  # the flush waits max_batch_wait_s too
    buf.add([_d(i) for i in range(6, 17)])
    assert buf.ready(16, 10.0, 0)


def test_a_release_trains_the_same_batches_whatever_the_arrival_order() -> None:
    """A phased release is cut into batches in sample-id order, so two interleavings of one phase's
    samples in the stream give the same batches; only the last batch claims the released sequence (a
    checkpoint in between would claim samples not yet trained); later sequences stay buffered."""
    samples = [make_sample(i, kind="cf" if i % 3 else "reh") for i in range(7)]
    cuts = []
    for order in ([0, 1, 2, 3, 4, 5, 6], [5, 2, 6, 0, 3, 1, 4]):
        buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf", "reh"], max_policy_lag=None)
        buf.add([FakeDelivery(samples[i], 10 + seq) for seq, i in enumerate(order)])
        buf.add([_d(99)])  # the next phase's first sample
        assert buf.holds_through(16) and not buf.holds_through(100)
        batches = buf.take_release(16, 3, current_index=0)
        cuts.append([[s.sample_id for s in b.samples] for b in batches])
        assert [b.max_seq for b in batches] == [0, 0, 16] and buf.floor == 16
        assert [d.stream_seq for d in buf.pending()] == [99]
    assert cuts[0] == cuts[1]
    assert [len(c) for c in cuts[0]] == [3, 3, 1]
    assert [i for c in cuts[0] for i in c] == sorted(s.sample_id for s in samples)


def test_an_empty_release_still_moves_the_floor() -> None:
    """A phase that made no sample (or none this learner trains) is one empty batch claiming the
    release, so the learner's consumed sequence reaches it and the run goes on."""
    buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf"], max_policy_lag=None)
    buf.add([_d(4, kind="grpo")])
    (batch,) = buf.take_release(6, 4, current_index=0)
    assert batch.samples == [] and batch.ignored == 1 and batch.max_seq == 6 and buf.floor == 6
    assert buf.holds_through(6)


def test_stale_deliveries_never_make_a_step_partial() -> None:
    """Issue 62: the floor counts samples that would be trained. 16 deliveries of which 12 are
    stale are no batch of 16 (before, ``ready`` counted deliveries and the step trained 4); the
    stale head is consumed without a step (no samples), so it never holds the pending window, and
    the 4 fresh ones wait for 12 more."""
    clock = Clock()
    buf: SampleBuffer[FakeDelivery] = SampleBuffer(kinds=["cf"], max_policy_lag=1, clock=clock)
    buf.add([_d(i, policy_version="v000001") for i in range(1, 13)])
    buf.add([_d(i, policy_version="v000005") for i in range(13, 17)])
    clock.t = 100.0
    head = buf.next_batch(16, 5, max_wait_s=10.0, min_batch=0)
    assert head is not None and head.samples == [] and head.stale == 12 and head.max_seq == 12
    assert buf.next_batch(16, 5, max_wait_s=10.0, min_batch=0) is None
    buf.add([_d(i, policy_version="v000005") for i in range(17, 29)])
    full = buf.next_batch(16, 5, max_wait_s=10.0, min_batch=0)
    assert full is not None and len(full.samples) == 16 and full.max_seq == 28
    buf.add([_d(29, policy_version="v000005")])
    assert buf.next_batch(16, 5, max_wait_s=10.0, min_batch=0) is None
    clock.t = 200.0
    tail = buf.next_batch(16, 5, max_wait_s=10.0, min_batch=0, flush=True)
    assert tail is not None and len(tail.samples) == 1
