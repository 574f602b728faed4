"""Property suite of the folds under hostile input mixed into realistic logs.

Hostile episodes are real explore trees and GRPO groups, mutated field by field (branch ids, step
indices, tau, seq, token ids, modes...), reordered, copied with changes, salted with arbitrary
events of the protocol strategies, and sometimes a chain of 4,000 nested branches. Pins: the fold
never raises anything but ``ReplayError`` (``EpisodeFailed`` included); the valid episodes' samples
are exactly those of the valid log alone; the same log is always decided the same way, even when the
hostile events aim at valid episodes.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.actors.fake_episodes import EventWriter, interleave
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.materializers import OpenLimits, ReplayError, make_materializer
from leafe.protocol.events import EpisodeEvent, EpisodeFinished, EpisodeStarted, Outcome, Step
from leafe.protocol.samples import Sample
from tests.support.episodes import event_logs, explore_episodes, rollout_groups
from tests.support.hostile import branch_chain, started_fields, step_fields
from tests.support.strategies import episode_events

TOK = ByteChatTokenizer()
MATERIALIZERS: dict[str, dict[str, Any]] = {
    "leafe": {"rehearsal_fraction": 1.0, "cf_only_successful": False},
    "grpo": {},
    "rft": {"modes": ["rollout", "explore"]},
    "reflect": {"only_failed_branches": False},
    "dagger": {"per_rollout": "all"},
    "reh-own": {"rehearsal_fraction": 1.0},
    "self-taught": {"keep_ties": True, "baseline": "root"},
}
MAX_TOKEN_ID = 2**31 - 1
"""int32: no id past it can be embedded (what the fold's default vocabulary bound is)."""
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_branch_ids = st.sampled_from(["b0", "b1", "b2", "b3", "bX", ""])
_small = st.integers(-2, 12)
MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "branch_id": _branch_ids,
    "parent_branch_id": _branch_ids,
    "from_branch": _branch_ids,
    "t": _small,
    "tau": _small,
    "at_t": _small,
    "seq": st.integers(0, 80),
    "token_ids": st.lists(st.integers(-(2**63), 2**64 - 1), max_size=8),
    "reflection_event_id": st.text(max_size=24),
    "success": st.booleans(),
    "mode": st.sampled_from(["explore", "rollout", "eval"]),
    "split": st.sampled_from(["train", "test"]),
    "group_size": st.integers(-1, 10**9),
    "history_window": st.integers(-5, 5),
    "observation": st.text(max_size=40),
    "experience_in_context": st.booleans(),
    "parse_ok": st.booleans(),
    "response_prefix": st.text(max_size=8),
    "run_id": st.sampled_from(["r1", "r2"]),
    "oracle_tau": st.none() | _small,
    "oracle_experience": st.sampled_from(["", "Move up.", " untrimmed ", "a </step> b"]),
    "trigger": st.sampled_from(["periodic", "failure", "horizon", "alternative"]),
}
"""Fields a hostile copy may change, and their values (every type-valid, many out of range)."""


@st.composite
def mutated(draw: st.DrawFn, event: EpisodeEvent, targets: list[str]) -> EpisodeEvent:
    """``event`` with up to two fields changed (and, with ``targets``, maybe moved to one of
    them)."""
    fields = [f for f in MUTATIONS if f in event.__struct_fields__]
    changes = {f: draw(MUTATIONS[f]) for f in draw(st.lists(st.sampled_from(fields), max_size=2))}
    if targets and draw(st.integers(0, 9)) == 0:
        changes["episode_id"] = draw(st.sampled_from(targets))
    return msgspec.structs.replace(event, **changes)


@st.composite
def hostile_stream(draw: st.DrawFn, targets: list[str]) -> list[EpisodeEvent]:
    """Events of mutated episodes named ``evil*`` (copies, drops, reorders, stray events included);
    with ``targets``, some are moved into those (valid) episodes."""
    base = draw(explore_episodes(tokenizer=TOK, prefix="evil"))
    base += [e for s in draw(rollout_groups(tokenizer=TOK, group_id="evilg")) for e in s]
    out: list[EpisodeEvent] = []
    for e in base:
        action = draw(st.sampled_from(["keep"] * 5 + ["mutate", "mutate", "copy", "drop"]))
        if action != "drop":
            out.append(e if action == "keep" else draw(mutated(e, targets)))
        if action == "copy":
            out.append(e)
    if (
        draw(st.integers(0, 3)) == 0
    ):  # deeper than the recursion limit, even Hypothesis's raised one
        out += branch_chain("r1", "evil-deep", depth=4000)
    episodes = sorted({e.episode_id for e in base})
    for stray in draw(st.lists(episode_events, max_size=6)):
        out.append(
            msgspec.structs.replace(stray, episode_id=draw(st.sampled_from(episodes)), run_id="r1")
        )
    rng = random.Random(draw(st.integers(0, 2**31)))
    for _ in range(draw(st.integers(0, 6))):  # a few swaps: out-of-order delivery
        i, j = rng.randrange(len(out)), rng.randrange(len(out))
        out[i], out[j] = out[j], out[i]
    return out


def fold_strictly(events: list[EpisodeEvent], name: str) -> tuple[list[Sample], dict[str, object]]:
    """Fold every event; a ReplayError is a rejection, any other exception fails the test."""
    fold = make_materializer(name, TOK, **MATERIALIZERS[name])
    samples: list[Sample] = []
    for e in events:
        try:
            samples += fold.apply(e)
        except ReplayError:
            pass
    samples += fold.close_all()
    ids = [i for s in samples for i in (*s.prompt_ids, *s.completion_ids)]
    assert all(0 <= i <= MAX_TOKEN_ID for i in ids), "a sample holds a token id no model can embed"
    return samples, fold.stats.as_dict()


names = st.sampled_from(sorted(MATERIALIZERS))


@SETTINGS
@given(streams=event_logs(tokenizer=TOK, max_episodes=3), data=st.data(), name=names)
def test_hostile_episodes_never_crash_the_fold_nor_change_valid_samples(
    streams: list, data: st.DataObject, name: str
) -> None:
    """Mutated and stray events of other episodes are rejected or folded as their own episodes; the
    valid episodes' samples are exactly the ones the valid log gives alone."""
    hostile = data.draw(hostile_stream(targets=[]))
    seed = data.draw(st.integers(0, 2**31))
    valid, _ = fold_strictly(interleave(streams, random.Random(seed)), name)
    mixed, _ = fold_strictly(interleave([*streams, hostile], random.Random(seed)), name)
    assert {s.sample_id: s for s in mixed if not s.episode_id.startswith("evil")} == {
        s.sample_id: s for s in valid
    }


@SETTINGS
@given(streams=event_logs(tokenizer=TOK, max_episodes=3), data=st.data(), name=names)
def test_hostile_events_aimed_at_valid_episodes_are_decided_the_same_every_time(
    streams: list, data: st.DataObject, name: str
) -> None:
    """Events forged into valid episodes can change what those give (an authenticated publisher can
    forge within its run), but never crash the fold, and two folds of one log agree field for
    field."""
    targets = sorted({e.episode_id for s in streams for e in s})
    events = interleave([*streams, data.draw(hostile_stream(targets=targets))], random.Random(0))
    first = fold_strictly(events, name)
    assert fold_strictly(events, name) == first


class VocabTokenizer(ByteChatTokenizer):
    """Byte ids, with a vocabulary of 300 declared (as ``HFChatTokenizer.vocab_size`` declares its
    own)."""

    vocab_size = 300


def one_step_episode(episode_id: str, token_ids: list[int]) -> list[EpisodeEvent]:
    """A successful one-step explore episode whose Step carries ``token_ids``."""
    w = EventWriter("r1", episode_id, legacy=True)  # folded in memory: named as given
    w.emit(EpisodeStarted, **started_fields(episode_id))
    w.emit(Step, **step_fields("b0", 0, token_ids=token_ids, success=True, done=True))
    w.emit(Outcome, branch_id="b0", success=True, score=1.0, steps=1, reason="success")
    w.emit(EpisodeFinished, success=True, branches=1, actions=1, reflections=0)
    return w.events


@pytest.mark.parametrize("bad", [-1, 2**40, 300])
def test_a_step_with_a_token_id_outside_the_vocabulary_is_rejected_with_the_reason(
    bad: int,
) -> None:
    """Token ids -1, 2^40 and the vocabulary size itself: the Step is rejected naming the id (the
    replayer dead-letters it), its episode gives no sample, a valid episode beside it gives its
    own."""
    fold = make_materializer("rft", VocabTokenizer(), modes=["explore"], verify_prompts=False)
    samples: list[Sample] = []
    reasons: list[str] = []
    for e in one_step_episode("evil", [5, bad, 6]) + one_step_episode("ok", [0, 1, 299]):
        try:
            samples += fold.apply(e)
        except ReplayError as err:
            reasons.append(err.reason)
    assert reasons == [f"token id {bad} is outside the vocabulary (0..299)"]
    assert [(s.episode_id, s.completion_ids) for s in samples] == [("ok", [0, 1, 299])]


@SETTINGS
@given(streams=event_logs(tokenizer=TOK, max_episodes=3), seed=st.integers(0, 2**31), name=names)
def test_the_bytes_of_held_episodes_are_all_returned_when_they_are_released(
    streams: list, seed: int, name: str
) -> None:
    """``max_open_bytes`` accounting never leaks: with a cap no log reaches, the fold gives the same
    samples as without, and once every episode is closed and released it holds 0 bytes."""
    events = interleave(streams, random.Random(seed))
    fold = make_materializer(name, TOK, **MATERIALIZERS[name])
    fold.limits = OpenLimits(max_bytes=2**40)
    samples = [s for e in events for s in fold.apply(e)] + fold.close_all()
    assert samples == fold_strictly(events, name)[0]
    assert fold.held_episodes == 0 and fold._ledger.held_bytes == 0 and not fold._ledger.bytes
