"""The fold under hostile input: deep trees, exceptions, conflicting copies, floods, ignored
episodes.

Each test pins one guarantee of ``leafe.learner.materializers`` (see ``base``, ``lifecycle``,
``tree``): nothing recurses on input depth, an exception is contained to its episode, a conflict is
rejected, held episodes are capped, episodes that give no samples hold nothing, and per-episode caps
reject past them.
"""

from __future__ import annotations

import msgspec
import pytest

from leafe.actors.fake_episodes import EventWriter
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.materializers import (
    EpisodeFailed,
    OpenLimits,
    ReplayError,
    fold_events,
    make_materializer,
)
from leafe.protocol.codec import decode_event, encode
from leafe.protocol.events import EpisodeEvent, EpisodeStarted, Step
from tests.support.hostile import (
    PoisonTokenizer,
    branch_chain,
    flood_starts,
    started_fields,
    step_fields,
)
from tests.support.materializers import Tree

TOK = ByteChatTokenizer()


def corrected_tree() -> tuple[Tree, None]:
    """b0 fails; a reflection blames t=1; b1 redoes t=1 with e and succeeds (a cf and reh
    samples)."""
    tree = Tree()
    for action in ("up", "left", "left"):
        tree.step("b0", action)
    tree.outcome("b0", False)
    tree.branch("b0", 1, "b1")
    tree.step("b1", "down", with_e=True)
    tree.step("b1", "right", with_e=True, success=True)
    tree.outcome("b1", True)
    tree.finish()
    return tree, None


def test_a_chain_of_2000_nested_branches_is_folded_without_recursion() -> None:
    """Each Branch the child of the previous one, 2,000 deep (twice Python's recursion limit, under
    the default max_branches): folded, with the deepest branch's counterfactual, whose target is
    that branch's first step."""
    events = branch_chain("r1", "deep", depth=2000)
    fold = make_materializer("leafe", TOK, rehearsal_fraction=0.0)
    result = fold_events(events, fold)
    (cf,) = result.samples
    last_step = [e for e in events if isinstance(e, Step)][-1]
    assert result.rejected == 0 and cf.kind == "cf" and cf.completion_ids == last_step.token_ids
    assert f"{last_step.event_id}" in cf.source_event_ids


def test_branches_and_events_past_the_per_episode_caps_are_rejected() -> None:
    """max_branches and max_episode_events bound one episode's state: the event past a cap is
    rejected with the cap's name, the episode goes on."""
    fold = make_materializer("leafe", TOK, max_branches=3)
    result = fold_events(branch_chain("r1", "wide", depth=5), fold)
    assert result.rejected > 0 and fold.stats.rejected == result.rejected
    fold = make_materializer("leafe", TOK, max_episode_events=4)
    tree = Tree()
    for _ in range(5):
        tree.step("b0")
    with pytest.raises(ReplayError, match="max_episode_events"):
        for e in tree.events:
            fold.apply(e)


def test_an_exception_while_folding_drops_only_its_episode_with_the_cause() -> None:
    """A poisoned prompt makes the tokenizer raise at the Outcome: EpisodeFailed (cause chained),
    the episode released and its later events rejected with the reason; the other episode's samples
    are the ones it gives alone, and a second fold of the same log decides the same."""
    poison = branch_chain("r1", "poison", depth=1, tau=0, observation="POISON")
    good, _ = corrected_tree()
    fold = make_materializer("leafe", PoisonTokenizer(TOK), rehearsal_fraction=1.0)
    samples = []
    failures = []
    for e in [*poison[:4], *good.events, *poison[4:]]:
        try:
            samples += fold.apply(e)
        except ReplayError as err:
            failures.append(err)
    assert isinstance(failures[0], EpisodeFailed) and isinstance(failures[0].__cause__, ValueError)
    assert "choked on POISON" in failures[0].reason
    assert [type(f) for f in failures[1:]] == [ReplayError] and "was failed" in failures[1].reason
    eid = poison[0].episode_id
    assert eid in fold.drain_released() and not fold.is_open(eid)
    alone = fold_events(good.events, make_materializer("leafe", TOK, rehearsal_fraction=1.0))
    assert samples == alone.samples and fold.stats.episodes_failed == 1
    again = fold_events(
        [*poison[:4], *good.events, *poison[4:]], make_materializer("leafe", PoisonTokenizer(TOK))
    )
    assert again.rejected == 2


def test_a_second_copy_of_an_event_id_with_other_content_is_a_conflict() -> None:
    """The first copy wins; an identical copy is a duplicate; a different one is rejected as a
    conflict."""
    tree, _ = corrected_tree()
    step = next(e for e in tree.events if isinstance(e, Step))
    at = tree.events.index(step)
    forged = msgspec.structs.replace(step, raw_text="<action>left</action>", token_ids=[1, 2, 3])
    fold = make_materializer("leafe", TOK, rehearsal_fraction=1.0)
    for e in tree.events[: at + 1]:
        fold.apply(e)
    assert fold.apply(step) == [] and fold.stats.duplicates == 1
    with pytest.raises(ReplayError, match="conflict"):
        fold.apply(forged)
    samples = [s for e in tree.events[at + 1 :] for s in fold.apply(e)]
    clean = fold_events(tree.events, make_materializer("leafe", TOK, rehearsal_fraction=1.0))
    assert samples == clean.samples and fold.stats.conflicts == 1
    nan = Tree("nan")
    step = nan.step(
        "b0", reward=float("nan")
    )  # unequal to itself, yet the same bytes: a redelivery
    fold.apply(nan.events[0])
    fold.apply(step)
    assert fold.apply(decode_event(encode(step))) == [] and fold.stats.conflicts == 1


def test_held_episodes_are_capped_per_actor_and_per_run_and_released_slots_reopen() -> None:
    """Past max_per_actor (then max_open) an EpisodeStarted is refused with the cap's name and the
    rest of its episode is rejected with that reason; a released episode frees its slot."""
    fold = make_materializer("leafe", TOK)
    fold.limits = OpenLimits(max_open=5, max_per_actor=3)
    flood = flood_starts("r1", 4, actor_id="mallory")
    for e in flood[:3]:
        fold.apply(e)
    with pytest.raises(
        ReplayError, match=r"actor 'mallory' already holds 3 .*max_open_per_actor = 3"
    ):
        fold.apply(flood[3])
    late = EventWriter("r1", flood[3].episode_id, actor_id="mallory")
    late.events.append(flood[3])
    with pytest.raises(ReplayError, match="was refused: actor 'mallory'"):
        fold.apply(late.emit(Step, **step_fields("b0", 0)))
    others = flood_starts("r1", 3, actor_id="a")
    fold.apply(others[0])
    fold.apply(others[1])
    with pytest.raises(ReplayError, match="max_open_episodes = 5"):
        fold.apply(others[2])
    fold.close_stale(now=10.0, timeout=1.0)  # every open episode is idle: all released
    assert fold.held_episodes == 0 and len(fold.drain_released()) == 5
    fold.apply(flood_starts("r2", 1, actor_id="mallory")[0])  # another episode id
    assert fold.stats.episodes_refused == 2 and fold.held_episodes == 1


def test_episodes_the_materializer_cannot_use_hold_nothing() -> None:
    """Eval episodes (and for leafe, rollouts) never open: no state, nothing to release, their
    events dropped and counted, never rejected."""
    fold = make_materializer("leafe", TOK)
    events: list[EpisodeEvent] = []
    for mode in ("eval", "rollout"):
        w = EventWriter("r1", f"{mode}-ep")
        events += [w.emit(EpisodeStarted, **started_fields(w.episode_id, mode=mode))]
        events += [w.emit(Step, **step_fields("b0", t)) for t in range(3)]
    result = fold_events(events, fold)
    assert result.samples == [] and result.rejected == 0
    assert fold.open_episodes == 0 and fold.held_episodes == 0 and fold.drain_released() == []
    assert fold.stats.episodes_ignored == 2 and fold.stats.ignored_events == 6
