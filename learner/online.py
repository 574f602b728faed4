"""Pure bookkeeping of the online learner: the ordered sample buffer and the staleness rule.

The service (``services/learner/main.py``) feeds stream deliveries in; :meth:`SampleBuffer.take`
hands back the next global batch in **stream-sequence order**, together with every delivery it
consumed (trained, stale or of a kind this learner does not train) and the highest sequence
consumed. Because batches are always cut from the lowest sequences, "every sequence <=
``samples_seq`` was consumed" holds at each step, which is what a checkpoint records and where a
restart resumes.

A phased run (``leafe run``'s ``[explore] schedule = "phased"``) trains each phase's samples only
once they are all in: :meth:`SampleBuffer.take_release` hands back every delivery up to a released
sequence as batches cut in **sample-id order**, so a phase trains the same batches however its
episodes interleaved in the stream (sample ids hash their source events; the order is a fixed
shuffle).

Staleness: a sample produced by weight version ``v<k>`` while the learner has pushed ``v<n>`` is ``n
- k`` versions old; it is dropped when that exceeds ``max_policy_lag``. Versions this learner did
not name (``version_index`` is None) cannot be judged and are kept (and counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from leafe.learner.weight_store import version_index
from leafe.protocol.samples import Sample

__all__ = ["Batch", "SampleBuffer", "SequencedSample", "policy_lag"]


class SequencedSample(Protocol):
    """What the buffer needs of a delivery (``leafe.services.bus.Delivery[Sample]`` fits)."""

    @property
    def value(self) -> Sample: ...

    @property
    def stream_seq(self) -> int: ...


D = TypeVar("D", bound=SequencedSample)


def policy_lag(policy_version: str, current_index: int) -> int | None:
    """Versions between the sample's producer and the learner's latest push; None if unknown."""
    k = version_index(policy_version)
    return None if k is None else max(0, current_index - k)


@dataclass
class Batch(Generic[D]):
    """What one :meth:`SampleBuffer.take` consumed."""

    samples: list[Sample] = field(default_factory=list)
    """Samples to train, in sequence order."""
    consumed: list[D] = field(default_factory=list)
    """Every delivery taken out of the buffer (ack them once a checkpoint covers ``max_seq``)."""
    stale: int = 0
    """Dropped for exceeding the policy lag."""
    ignored: int = 0
    """Dropped because their kind is not trained here."""
    unknown_version: int = 0
    """Kept although their policy version could not be compared."""
    lags: list[int] = field(default_factory=list)
    """Policy lag of each trained sample whose version could be compared (the lag histogram's
    input)."""
    max_seq: int = 0
    """Highest stream sequence consumed (0 if nothing)."""


class SampleBuffer(Generic[D]):
    """Deliveries waiting to be trained, ordered by stream sequence, deduplicated."""

    def __init__(
        self,
        *,
        kinds: Iterable[str],
        max_policy_lag: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kinds = frozenset(kinds)
        self.max_policy_lag = max_policy_lag
        self._clock = clock
        self._items: dict[int, D] = {}
        self._arrived: dict[int, float] = {}
        self.floor = 0
        """Every sequence <= floor has been consumed; later deliveries of those are duplicates."""
        self.duplicates: list[D] = []
        """Redeliveries of consumed messages, to be acked with the next checkpoint."""

    def __len__(self) -> int:
        return len(self._items)

    def pending(self) -> list[D]:
        """Buffered deliveries (for in-progress acks)."""
        return list(self._items.values())

    def add(self, deliveries: Iterable[D]) -> None:
        """Buffer new deliveries; redeliveries of buffered or consumed sequences are set aside."""
        now = self._clock()
        for d in deliveries:
            seq = d.stream_seq
            if seq <= self.floor or seq in self._items:
                self.duplicates.append(d)
                continue
            self._items[seq] = d
            self._arrived[seq] = now

    def oldest_wait(self) -> float:
        """Seconds the oldest buffered delivery has waited (0 when empty)."""
        return self._clock() - min(self._arrived.values()) if self._arrived else 0.0

    def ready(
        self, global_batch: int, max_wait_s: float, min_batch: int, *, flush: bool = False
    ) -> bool:
        """A full batch is buffered, or a partial one of >= ``min_batch`` (0: the global batch; 1
        with ``flush``, the stream's tail) waited ``max_wait_s``."""
        n = len(self._items)
        floor = 1 if flush else (min_batch if min_batch > 0 else global_batch)
        return n >= global_batch or (n >= floor and self.oldest_wait() >= max_wait_s)

    def trainable(self, d: D, current_index: int) -> bool:
        """Whether ``d`` would be trained at learner version ``current_index`` (its kind is trained
        here and it is not stale; an unknown version counts as trainable)."""
        sample = d.value
        if sample.kind not in self.kinds:
            return False
        lag = policy_lag(sample.policy_version, current_index)
        return lag is None or self.max_policy_lag is None or lag <= self.max_policy_lag

    def next_batch(
        self,
        global_batch: int,
        current_index: int,
        *,
        max_wait_s: float,
        min_batch: int,
        flush: bool = False,
    ) -> Batch[D] | None:
        """The next batch to train, or None to wait. Counts only samples that would be trained, so
        stale or untrained-kind deliveries never turn a step into a partial one: a full batch of
        ``global_batch`` trainable samples; a partial one of >= ``min_batch`` (0: the global batch;
        1 with ``flush``) once the oldest delivery waited ``max_wait_s``; else the deliveries at the
        head of the sequence that nothing will train, consumed without a step (a batch with no
        samples), so they never hold the stream's pending window."""
        seqs = sorted(self._items)
        n = sum(self.trainable(self._items[s], current_index) for s in seqs)
        floor = 1 if flush else (min_batch if min_batch > 0 else global_batch)
        if n >= global_batch or (n >= floor and self.oldest_wait() >= max_wait_s):
            return self.take(global_batch, current_index)
        out: Batch[D] = Batch()
        for seq in seqs:
            if self.trainable(self._items[seq], current_index):
                break
            self._consume(out, seq, current_index)
            out.max_seq = seq
        if not out.consumed:
            return None
        self.floor = max(self.floor, out.max_seq)
        return out

    def take(self, global_batch: int, current_index: int) -> Batch[D]:
        """Pop deliveries in sequence order until ``global_batch`` trainable samples (or empty)."""
        out: Batch[D] = Batch()
        for seq in sorted(self._items):
            if len(out.samples) >= global_batch:
                break
            self._consume(out, seq, current_index)
            out.max_seq = seq
        self.floor = max(self.floor, out.max_seq)
        return out

    def holds_through(self, seq: int) -> bool:
        """Every delivery up to ``seq`` has arrived (pull consumers deliver new messages in sequence
        order, so having seen ``seq`` or beyond means nothing before it is still on its way)."""
        return self.floor >= seq or any(s >= seq for s in self._items)

    def take_release(
        self, release_seq: int, global_batch: int, current_index: int
    ) -> list[Batch[D]]:
        """Pop every delivery up to ``release_seq`` as batches of ``global_batch`` trainable samples
        (the last one partial) in sample-id order. Only the last batch carries ``max_seq =
        release_seq``: until the whole release is trained, a checkpoint must not claim any of it.
        Call once :meth:`holds_through` is true; a release with nothing trainable is one empty
        batch."""
        seqs = sorted(
            (s for s in self._items if s <= release_seq),
            key=lambda s: (self._items[s].value.sample_id, s),
        )
        batches: list[Batch[D]] = [Batch()]
        for seq in seqs:
            if len(batches[-1].samples) >= global_batch:
                batches.append(Batch())
            self._consume(batches[-1], seq, current_index)
        batches[-1].max_seq = release_seq
        self.floor = max(self.floor, release_seq)
        return batches

    def _consume(self, out: Batch[D], seq: int, current_index: int) -> None:
        """Move delivery ``seq`` into ``out``: trained, or counted as ignored (kind) or stale
        (lag)."""
        d = self._items.pop(seq)
        del self._arrived[seq]
        out.consumed.append(d)
        sample = d.value
        if sample.kind not in self.kinds:
            out.ignored += 1
            return
        lag = policy_lag(sample.policy_version, current_index)
        if lag is None:
            out.unknown_version += 1
        elif self.max_policy_lag is not None and lag > self.max_policy_lag:
            out.stale += 1
            return
        else:
            out.lags.append(lag)
        out.samples.append(sample)

    def pop_duplicates(self) -> list[D]:
        """Take the set-aside redeliveries."""
        dup, self.duplicates = self.duplicates, []
        return dup
