"""GRPO and RFT materializers, and the materializer registry (split from test_materializers.py)."""

from __future__ import annotations

import pytest

from leafe.learner.materializers import (
    LeafeMaterializer,
    MaterializerConfigError,
    make_materializer,
)
from leafe.protocol.samples import Sample
from tests.support.materializers import TOK, Tree, fold


def rollout(
    group: str, i: int, success: bool, *, n: int = 3, attempt: int = 1, logprobs: bool = True
) -> Tree:
    tree = Tree(
        f"{group}-{i}.a{attempt}",
        mode="rollout",
        group_id=group,
        group_size=n,
        task_key=f"{group}-{i}",
        attempt=attempt,
    )
    tree.step("b0", "up", logprobs=[-0.5, -0.25] if logprobs else None)
    tree.step("b0", None, success=success)
    tree.outcome("b0", success)
    tree.finish()
    return tree


def test_grpo_group_normalised_advantages() -> None:
    """Once all n rollouts finished: advantage (r - mean)/(std + eps) per trajectory, one sample per
    step."""
    events = [e for i, ok in enumerate([True, False, False]) for e in rollout("g1", i, ok).events]
    m = make_materializer("grpo", TOK)
    out: list[Sample] = []
    for e in events[:-1]:
        out += m.apply(e)
    assert out == []
    out += m.apply(events[-1])
    assert len(out) == 6 and m.stats.groups_emitted == 1
    adv = {s.episode_id: s.advantage for s in out}
    assert adv["g1-0.a1"] == pytest.approx(2**0.5, rel=1e-4)
    assert adv["g1-1.a1"] == pytest.approx(-(2**0.5) / 2, rel=1e-4)
    assert {s.reward for s in out if s.episode_id == "g1-0.a1"} == {1.0}
    assert all(s.group_id == "g1" and s.kind == "grpo" for s in out)
    first = [s for s in out if s.episode_id == "g1-0.a1" and s.behaviour_logprobs is not None]
    assert first and first[0].behaviour_logprobs == [-0.5, -0.25]
    assert sorted(m.drain_released()) == ["g1-0.a1", "g1-1.a1", "g1-2.a1"]


def test_grpo_zero_variance_group_and_release_timing() -> None:
    """Equal returns give no samples (counted); members are released only when their group is
    done."""
    m = make_materializer("grpo", TOK)
    trees = [rollout("g2", i, False) for i in range(3)]
    for e in trees[0].events + trees[1].events:
        assert m.apply(e) == []
    assert m.drain_released() == []
    for e in trees[2].events:
        assert m.apply(e) == []
    assert m.stats.groups_zero_variance == 1 and len(m.drain_released()) == 3


def test_grpo_retried_task_uses_one_attempt() -> None:
    """A redelivered task whose two attempts both finish counts once (the smaller episode id
    wins)."""
    a1, a2 = rollout("g3", 0, True, n=2, attempt=1), rollout("g3", 0, False, n=2, attempt=2)
    other = rollout("g3", 1, False, n=2)
    m = make_materializer("grpo", TOK)
    out: list[Sample] = []
    for e in a2.events + a1.events + other.events:
        out += m.apply(e)
    assert {s.episode_id for s in out} == {"g3-0.a1", "g3-1.a1"} and m.stats.late_attempts == 1


def test_grpo_rollouts_that_cannot_join_their_group_are_counted_not_mixed_in() -> None:
    """Members past an emitted group, or declaring another group_size (a batch resubmitted with
    another n under the same run), give no samples and are counted; the group keeps its own members
    only."""
    pair = [rollout("g5", i, ok, n=2) for i, ok in enumerate([True, False])]
    late = [rollout("g5", i, ok, n=4) for i, ok in ((2, True), (3, False))]
    m = make_materializer("grpo", TOK)
    out: list[Sample] = []
    for tree in pair + late:
        for e in tree.events:
            out += m.apply(e)
    assert {s.episode_id for s in out} == {"g5-0.a1", "g5-1.a1"} and m.stats.group_outsiders == 2
    assert sorted(m.drain_released()) == ["g5-0.a1", "g5-1.a1", "g5-2.a1", "g5-3.a1"]
    mixed = [
        rollout("g6", 0, True, n=2),
        rollout("g6", 1, False, n=3),
        rollout("g6", 2, False, n=2),
    ]
    m = make_materializer("grpo", TOK)
    out = [s for e in [e for t in mixed for e in t.events] for s in m.apply(e)]
    assert {s.episode_id for s in out} == {"g6-0.a1", "g6-2.a1"} and m.stats.group_outsiders == 1


def test_rft_keeps_parsed_steps_of_successful_rollouts() -> None:
    """RFT: every parsed step of a successful rollout, nothing from failures."""
    ok, bad = rollout("g4", 0, True), rollout("g4", 1, False)
    samples, m = fold(ok.events + bad.events, "rft")
    assert [s.completion_ids for s in samples] == [ok.paths["b0"][0].token_ids]
    assert samples[0].reward == 1.0 and m.stats.skipped_unparsed == 1


def test_registry_rejects_unknown_names_and_options() -> None:
    """make_materializer names the unknown materializer or option."""
    with pytest.raises(MaterializerConfigError, match="unknown materializer 'nope'"):
        make_materializer("nope", TOK)
    with pytest.raises(MaterializerConfigError, match="rehearsal_fractio"):
        make_materializer("leafe", TOK, rehearsal_fractio=0.3)
    assert isinstance(make_materializer("leafe", TOK), LeafeMaterializer)
