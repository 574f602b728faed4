"""Property suite of the folds under hostile input mixed into realistic logs.

Hostile episodes are real explore trees and GRPO groups, mutated field by field (branch ids, step
indices, tau, seq, token ids, modes...), reordered, copied with changes, salted with arbitrary events of
the protocol strategies, and sometimes a chain of 4,000 nested branches. Pins: the fold never raises
anything but ``ReplayError`` (``EpisodeFailed`` included); the valid episodes' samples are exactly those
of the valid log alone; the same log is always decided the same way, even when the hostile events aim
at valid episodes.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.fake_episodes import interleave
from actors.fakes import ByteChatTokenizer
from learner.materializers import ReplayError, make_materializer
from protocol.events import EpisodeEvent
from protocol.samples import Sample
from tests.support.episodes import event_logs, explore_episodes, rollout_groups
from tests.support.hostile import branch_chain
from tests.support.strategies import episode_events

TOK = ByteChatTokenizer()
MATERIALIZERS: dict[str, dict[str, Any]] = {
    "leafe": {"rehearsal_fraction": 1.0, "cf_only_successful": False},
    "grpo": {},
    "rft": {"modes": ["rollout", "explore"]},
}
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
}
"""Fields a hostile copy may change, and their values (every type-valid, many out of range)."""


@st.composite
def mutated(draw: st.DrawFn, event: EpisodeEvent, targets: list[str]) -> EpisodeEvent:
    """``event`` with up to two fields changed (and, with ``targets``, maybe moved to one of them)."""
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
    if draw(st.integers(0, 3)) == 0:  # deeper than the recursion limit, even Hypothesis's raised one
        out += branch_chain("r1", "evil-deep", depth=4000)
    episodes = sorted({e.episode_id for e in base})
    for stray in draw(st.lists(episode_events, max_size=6)):
        out.append(msgspec.structs.replace(stray, episode_id=draw(st.sampled_from(episodes)), run_id="r1"))
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
    forge within its run), but never crash the fold, and two folds of one log agree field for field."""
    targets = sorted({e.episode_id for s in streams for e in s})
    events = interleave([*streams, data.draw(hostile_stream(targets=targets))], random.Random(0))
    first = fold_strictly(events, name)
    assert fold_strictly(events, name) == first
