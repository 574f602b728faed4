"""The staleness gate (actors/staleness.py): AReaL's capacity rule in episodes and pushes."""

from __future__ import annotations

import math

import pytest

from leafe.actors.staleness import StalenessConfig, StalenessGate


def test_an_unset_gate_never_closes() -> None:
    gate = StalenessGate(StalenessConfig())
    for _ in range(1000):
        gate.on_start("rollout", 0)
    assert not gate.enabled and gate.may_start(0) and gate.capacity(0) == math.inf


def test_the_gate_lets_max_policy_lag_plus_one_versions_of_episodes_ahead_of_the_learner() -> None:
    """2 episodes a version, lag 1: 4 episodes before the learner's next push, 2 more after each;
    demonstrations do not count; the versions pushed before the first gated episode (the warm
    start's) give no credit."""
    gate = StalenessGate(StalenessConfig(episodes_per_version=2.0, max_policy_lag=1))
    for _ in range(5):
        gate.on_start("demo", 7)
    started = 0
    while gate.may_start(7):
        gate.on_start("rollout" if started % 2 else "explore", 7)
        started += 1
    assert started == 4 and gate.base == 7
    assert gate.may_start(8) and gate.capacity(8) == 2
    gate.on_start("rollout", 8)
    gate.on_start("rollout", 8)
    assert not gate.may_start(8)
    gate.lend()  # max_wait_s without a push: one version's credit
    assert gate.capacity(8) == 2 and gate.lent == 1


def test_a_fractional_rate_rounds_down_and_bad_settings_are_refused() -> None:
    gate = StalenessGate(StalenessConfig(episodes_per_version=1.5, max_policy_lag=0))
    assert gate.capacity(0) == 1
    gate.on_start("rollout", 0)
    assert not gate.may_start(0) and gate.capacity(1) == 2
    with pytest.raises(ValueError, match="staleness"):
        StalenessConfig(episodes_per_version=-1.0)
    with pytest.raises(ValueError, match="staleness"):
        StalenessConfig(max_wait_s=0.0)
