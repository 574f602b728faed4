"""Unit tests of the materializer folds on small hand-built episode trees (fake byte tokenizer)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from leafe.actors.fake_episodes import INSTRUCTIONS
from leafe.learner.materializers import (
    ReplayError,
    make_materializer,
)
from leafe.protocol.events import (
    Branch,
    EpisodeStarted,
    Outcome,
    Step,
    event_id_for,
)
from leafe.protocol.prompt import HistoryEntry, prompt_sha256, render_messages
from leafe.protocol.samples import Sample
from tests.support.materializers import TOK, E, Tree, fold


def corrected_tree() -> tuple[Tree, dict[str, Any]]:
    """b0: 3 failing steps; reflection blames t=1; b1 redoes t=1 with e and succeeds at t=2."""
    tree = Tree()
    s0 = tree.step("b0", "up")
    tree.step("b0", "left")
    tree.step("b0", "left")
    tree.outcome("b0", False)
    refl, br = tree.branch("b0", 1, "b1")
    a1 = tree.step("b1", "down", with_e=True)
    a2 = tree.step("b1", "right", with_e=True)
    tree.outcome("b1", True)
    tree.finish()
    return tree, {"s0": s0, "refl": refl, "branch": br, "a1": a1, "a2": a2}


def test_counterfactual_input_is_parent_history_without_experience() -> None:
    """D_cf: q + the parent's history up to tau, rendered without e; target = the branch's first
    step ids."""
    tree, ev = corrected_tree()
    samples, m = fold(tree.events, rehearsal_fraction=0.0)
    (cf,) = [s for s in samples if s.kind == "cf"]
    expected = render_messages(
        instructions=INSTRUCTIONS,
        task="Push the box.",
        history=[HistoryEntry("up", "<action>up</action>", "o1-b0", "")],
        observation="o1-b0",
    )
    assert cf.messages[:2] == expected
    assert cf.messages[2].role == "assistant" and cf.messages[2].content == ev["a1"].raw_text
    assert cf.target_turn == 2
    assert cf.completion_ids == ev["a1"].token_ids
    assert cf.prompt_ids == TOK.encode_chat(expected)
    assert E not in TOK.decode(cf.prompt_ids) and all(E not in msg.content for msg in cf.messages)
    assert set(cf.source_event_ids) == {
        tree.started.event_id,
        ev["s0"].event_id,
        ev["a1"].event_id,
        ev["branch"].event_id,
        ev["refl"].event_id,
    }
    assert cf.source_event_ids == sorted(cf.source_event_ids)
    assert (
        cf.materializer == "leafe/1"
        and cf.policy_version == ev["a1"].policy_version
        and cf.weight == 1.0
    )
    assert m.stats.prompt_mismatches == 0 and m.stats.prompts_verified == 1


def test_rehearsal_covers_the_successful_path_and_is_deduplicated() -> None:
    """D_reh with fraction 1: one sample per step of the successful path (inherited prefix + own
    steps)."""
    tree, ev = corrected_tree()
    samples, m = fold(tree.events, rehearsal_fraction=1.0, rehearsal_weight=0.5)
    reh = sorted((s for s in samples if s.kind == "reh"), key=lambda s: len(s.source_event_ids))
    assert [s.completion_ids for s in reh] == [
        ev["s0"].token_ids,
        ev["a1"].token_ids,
        ev["a2"].token_ids,
    ]
    assert all(s.weight == 0.5 for s in reh)
    assert all(E not in msg.content for s in reh for msg in s.messages)
    assert len({s.sample_id for s in samples}) == len(samples) == 4
    assert m.stats.prompt_mismatches == 0 and m.stats.prompts_verified == 3


def test_rehearsal_fraction_is_seeded_and_per_step() -> None:
    """The kept fraction is decided by hashing (seed, step id): same seed same choice, 0 keeps
    none."""
    tree, _ = corrected_tree()
    ids = lambda s: {x.sample_id for x in s if x.kind == "reh"}  # noqa: E731
    a, _ = fold(tree.events, rehearsal_fraction=0.5, rehearsal_seed=7)
    b, _ = fold(tree.events, rehearsal_fraction=0.5, rehearsal_seed=7)
    assert ids(a) == ids(b)
    none, _ = fold(tree.events, rehearsal_fraction=0.0)
    assert ids(none) == set()


def test_rehearsal_by_path_keeps_whole_successful_paths() -> None:
    """``rehearsal_unit = "path"`` (the paper's "20% of successful rollouts"): a seed keeps every
    step of the successful path or none of them, and over many seeds about the configured fraction
    of paths."""
    tree, ev = corrected_tree()
    whole = [ev["s0"].token_ids, ev["a1"].token_ids, ev["a2"].token_ids]
    kept = 0
    for seed in range(200):
        samples, _ = fold(
            tree.events, rehearsal_fraction=0.25, rehearsal_seed=seed, rehearsal_unit="path"
        )
        reh = sorted((s for s in samples if s.kind == "reh"), key=lambda s: len(s.source_event_ids))
        assert [s.completion_ids for s in reh] in ([], whole), seed
        kept += bool(reh)
    assert 25 <= kept <= 75  # Binomial(200, 0.25): mean 50, sd ~6


def test_failed_branch_gives_no_counterfactual_unless_configured() -> None:
    """By default only successful branches give D_cf; cf_only_successful=False keeps failed ones
    too."""
    tree = Tree()
    tree.step("b0")
    tree.outcome("b0", False)
    tree.branch("b0", 0, "b1")
    tree.step("b1", "down", with_e=True)
    tree.outcome("b1", False)
    tree.finish()
    samples, _ = fold(tree.events)
    assert samples == []
    samples, _ = fold(tree.events, cf_only_successful=False)
    assert [s.kind for s in samples] == ["cf"]


def test_unparsed_targets_are_skipped() -> None:
    """A branch whose first completion has no valid action yields no cf sample (counted)."""
    tree = Tree()
    tree.step("b0")
    tree.outcome("b0", False)
    tree.branch("b0", 0, "b1")
    tree.step("b1", None, with_e=True)
    tree.step("b1", "up", with_e=True, success=True)
    tree.outcome("b1", True)
    samples, m = fold(tree.events, rehearsal_fraction=0.0)
    assert samples == [] and m.stats.skipped_unparsed == 1


def test_abandoned_episode_yields_nothing_from_unfinished_branches() -> None:
    """Without an Outcome, a branch produces nothing, even after close_all/close_stale."""
    tree, _ = corrected_tree()
    events = tree.events[:-2]  # drop b1's Outcome and EpisodeFinished
    samples, m = fold(events, rehearsal_fraction=1.0)
    assert samples == [] and m.stats.episodes_abandoned == 1 and m.open_episodes == 0


def test_close_stale_closes_only_idle_episodes_and_ignores_late_events() -> None:
    """close_stale(now, timeout) closes episodes idle longer than timeout; their late events are
    ignored."""
    m = make_materializer("leafe", TOK)
    a, b = Tree("a"), Tree("b")
    m.apply(a.events[0], now=0.0)
    m.apply(b.events[0], now=50.0)
    m.close_stale(100.0, 60.0)
    assert not m.is_open("a") and m.is_open("b") and m.knows("a")
    assert m.drain_released() == ["a"]
    assert m.apply(a.step("b0"), now=101.0) == [] and m.stats.after_close == 1


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (
            lambda t: t.w.emit(
                Step, branch_id="b9", t=0, action="up", raw_text="", token_ids=[1], observation="o"
            ),
            "unknown branch",
        ),
        (
            lambda t: t.w.emit(
                Branch,
                branch_id="b1",
                parent_branch_id="b0",
                tau=0,
                reflection_event_id="ep1.999999",
                experience=E,
                depth=1,
            ),
            "Branch before its Reflection",
        ),
        (lambda t: t.w.emit(Outcome, branch_id="b7", success=True), "unknown branch"),
        (
            lambda t: t.w.emit(
                Step, branch_id="b0", t=5, action="up", raw_text="", token_ids=[1], observation="o"
            ),
            "out of order",
        ),
        (
            lambda t: t.w.emit(
                EpisodeStarted,
                **{
                    k: getattr(t.started, k)
                    for k in (
                        "task_key",
                        "env",
                        "task_id",
                        "split",
                        "seed",
                        "mode",
                        "task",
                        "observation",
                        "instructions",
                    )
                },
            ),
            "already started",
        ),
    ],
)
def test_bad_events_raise_replay_error_and_leave_state_unchanged(mutate: Any, reason: str) -> None:
    """Malformed or out-of-order events raise ReplayError naming the reason; the fold keeps
    going."""
    m = make_materializer("leafe", TOK, rehearsal_fraction=1.0)
    tree = Tree()
    for e in tree.events:
        m.apply(e)
    bad = mutate(tree)
    with pytest.raises(ReplayError, match=reason) as info:
        m.apply(bad)
    assert info.value.event is bad and m.stats.rejected == 1
    tree.w.events.pop()
    tree.step("b0", success=True)
    assert len(m.apply(tree.w.events[-1])) == 0
    assert len(m.apply(tree.outcome("b0", True))) == 1


def test_event_of_unknown_episode_and_second_outcome_are_rejected() -> None:
    """A Step before any EpisodeStarted and a second Outcome for a branch raise ReplayError."""
    m = make_materializer("leafe", TOK)
    tree = Tree()
    step = tree.step("b0")
    with pytest.raises(ReplayError, match="unknown episode"):
        m.apply(step)
    m.apply(tree.events[0])
    m.apply(step)
    m.apply(tree.outcome("b0", False))
    with pytest.raises(ReplayError, match="already ended"):
        m.apply(tree.outcome("b0", True))


def test_duplicate_deliveries_are_ignored() -> None:
    """Re-applying any event (same event id) changes nothing and yields no samples."""
    tree, _ = corrected_tree()
    m = make_materializer("leafe", TOK, rehearsal_fraction=1.0)
    out: list[Sample] = []
    for e in tree.events[:-1]:
        out += m.apply(e)
        assert m.apply(e) == []
    out += m.apply(tree.events[-1])
    assert m.apply(tree.events[-1]) == []  # after EpisodeFinished: remembered as closed
    assert len(out) == 4 and m.stats.duplicates == len(tree.events) - 1 and m.stats.after_close == 1


def test_prompt_mismatch_is_counted_not_fatal() -> None:
    """A Step whose prompt_sha256 differs from the rebuilt prompt is counted; the sample is still
    built."""
    tree = Tree()
    tree.step("b0", success=True, prompt_sha256="0" * 64)
    tree.outcome("b0", True)
    samples, m = fold(tree.events, rehearsal_fraction=1.0)
    assert len(samples) == 1 and m.stats.prompt_mismatches == 1
    tree2 = Tree()
    tree2.step("b0", success=True, prompt_sha256="")
    tree2.outcome("b0", True)
    _, m2 = fold(tree2.events, rehearsal_fraction=1.0)
    assert m2.stats.prompts_unverifiable == 1


def test_eval_and_test_split_episodes_produce_nothing() -> None:
    """Evaluation episodes and test-split tasks are never turned into training samples by
    default."""
    for started in ({"mode": "eval"}, {"split": "test"}):
        tree = Tree(**started)
        tree.step("b0", success=True)
        tree.outcome("b0", True)
        tree.finish()
        assert fold(tree.events, rehearsal_fraction=1.0)[0] == []


def test_fast_prompt_digest_equals_the_protocol_digest() -> None:
    """The fold's packed digest is byte-for-byte leafe.protocol.prompt.prompt_sha256."""
    from leafe.learner.materializers.base import fast_prompt_sha256

    for ids in ([], [0], [1, 49151, 2**32 - 1], list(range(0, 70000, 7))):
        assert fast_prompt_sha256(ids) == prompt_sha256(ids)


def test_real_tokenizer_rebuilds_every_prompt_the_actor_sent(cache_dir: Any) -> None:
    """With SmolLM2's chat template (tiny model), every target's rebuilt prompt matches
    Step.prompt_sha256 and cf prompt ids decode to text without the experience."""
    from leafe.actors.fake_episodes import EXPERIENCE_MARKER, ExploreSpec, build_explore_episode
    from leafe.learner.model_io import HFChatTokenizer, tiny_model_dir

    tok = HFChatTokenizer.from_dir(tiny_model_dir(cache_dir))
    events = [
        e
        for i in range(12)
        for e in build_explore_episode(
            ExploreSpec(
                seed=i,
                max_depth=2,
                p_success=0.2,
                history_window=2 * (i % 2),
                stop_on_success=False,
            ),
            run_id="r1",
            episode_id=f"ep{i}",
            tokenizer=tok,
        )
    ]
    m = make_materializer("leafe", tok, rehearsal_fraction=1.0)
    out = [s for e in events for s in m.apply(e)]
    assert m.stats.prompts_verified > 5 and m.stats.prompt_mismatches == 0
    assert any(s.kind == "cf" for s in out)
    assert all(EXPERIENCE_MARKER not in tok.decode(s.prompt_ids) for s in out)


def test_episodes_in_an_unknown_prompt_format_are_not_materialized() -> None:
    """Prompts of another PROMPT_FORMAT cannot be rebuilt: such episodes are tracked but give no
    samples."""
    tree = Tree(prompt_format="some-other-format")
    tree.step("b0", success=True)
    tree.outcome("b0", True)
    tree.finish()
    samples, m = fold(tree.events, rehearsal_fraction=1.0)
    assert samples == [] and m.stats.unsupported_prompt_format == 1 and m.stats.rejected == 0


def test_a_new_event_after_episode_finished_is_rejected_but_a_redelivery_is_ignored() -> None:
    """Past the end marker only redeliveries are expected: a higher seq is malformed input, not a
    late copy."""
    tree, _ = corrected_tree()
    m = make_materializer("leafe", TOK, rehearsal_fraction=1.0)
    for e in tree.events:
        m.apply(e)
    assert m.apply(tree.events[1]) == [] and m.stats.after_close == 1
    last = tree.events[-1]
    seq = last.seq + 1
    straggler = msgspec.structs.replace(
        tree.events[1], seq=seq, event_id=event_id_for(last.episode_id, seq)
    )
    with pytest.raises(ReplayError, match="after the episode's EpisodeFinished"):
        m.apply(straggler)
    assert m.stats.rejected == 1


def test_a_later_attempt_of_the_same_task_closes_the_earlier_one_as_abandoned() -> None:
    """An actor killed mid-episode leaves attempt 1 open; when the task's redelivery starts attempt
    2, the fold closes attempt 1 at once (released, its stragglers ignored) instead of holding it,
    and the replayer's anchor, until the idle timeout (an hour by default). An older attempt never
    closes a newer."""
    m = make_materializer("leafe", TOK)
    first = Tree("k.a1", task_key="k", attempt=1)
    m.apply(first.events[0], now=0.0)
    m.apply(first.step("b0"), now=1.0)
    second = Tree("k.a2", task_key="k", attempt=2)
    m.apply(second.events[0], now=2.0)
    assert not m.is_open("k.a1") and m.is_open("k.a2") and m.open_episodes == 1
    assert m.stats.episodes_abandoned == m.stats.episodes_superseded == 1
    assert m.drain_released() == ["k.a1"]
    assert m.apply(first.step("b0"), now=3.0) == [] and m.stats.after_close == 1
    late = Tree("k.a0", task_key="k", attempt=0)  # an older attempt's start arriving late
    m.apply(late.events[0], now=4.0)
    assert m.is_open("k.a2") and m.is_open("k.a0") and m.stats.episodes_superseded == 1
    other = Tree("j.a2", task_key="j", attempt=2)
    m.apply(other.events[0], now=5.0)
    assert m.is_open("k.a2") and m.is_open("j.a2")
    newest = Tree(
        "k.a3", task_key="k", attempt=3
    )  # still supersedes attempt 2, not the late attempt 0
    m.apply(newest.events[0], now=6.0)
    assert not m.is_open("k.a2") and m.is_open("k.a0") and m.is_open("k.a3")
