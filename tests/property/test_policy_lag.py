"""The staleness bound of the online learner, as properties (learner/online.py)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from leafe.learner.online import SampleBuffer, policy_lag
from leafe.protocol.samples import Sample
from tests.support.learner import make_sample


@dataclass
class _Delivery:
    value: Sample
    stream_seq: int


_versions = st.one_of(
    st.integers(0, 12).map(lambda k: f"v{k}"), st.sampled_from(["default", "base", "x"])
)


@settings(max_examples=200, deadline=None)
@given(
    versions=st.lists(_versions, min_size=1, max_size=40),
    current=st.integers(0, 12),
    max_lag=st.one_of(st.none(), st.integers(0, 6)),
    batch=st.integers(1, 16),
)
def test_samples_older_than_max_policy_lag_are_never_trained_and_the_histogram_counts_the_rest(
    versions: list[str], current: int, max_lag: int | None, batch: int
) -> None:
    """Whatever the versions and batch sizes: no trained sample is more than ``max_policy_lag``
    versions behind; every consumed sample is trained or counted stale; the lag histogram's input
    has one entry per trained sample of a known version, equal to its lag."""
    buf: SampleBuffer[_Delivery] = SampleBuffer(kinds=["cf", "reh"], max_policy_lag=max_lag)
    buf.add(
        _Delivery(msgspec.structs.replace(make_sample(i + 1), policy_version=v), i + 1)
        for i, v in enumerate(versions)
    )
    trained, stale, lags, consumed = [], 0, [], 0
    while len(buf):
        out = buf.take(batch, current)
        trained += out.samples
        stale += out.stale
        lags += out.lags
        consumed += len(out.consumed)
    assert consumed == len(versions) == len(trained) + stale
    known = [policy_lag(s.policy_version, current) for s in trained]
    assert lags == [lag for lag in known if lag is not None]
    if max_lag is not None:
        assert all(lag <= max_lag for lag in lags)
        assert stale == sum(
            1 for v in versions if (lag := policy_lag(v, current)) is not None and lag > max_lag
        )
