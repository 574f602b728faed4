"""Property: an episode belongs to the actor that started it. Two actors' honest episodes (explore
trees, GRPO groups) interleaved, plus events one of them forges into the other's episodes once they
exist: copies of the victim's events under its own actor id (some turned into successes), an
``Outcome(success)`` + ``EpisodeFinished`` at any seq, a second ``EpisodeStarted`` with its own
prompt, and starts of its own claiming the victim's task keys with a later attempt. Every fold gives
exactly the samples of the honest log, and rejects every forged event as ``foreign_episode``.

(The fold cannot stop an id being taken *before* its owner starts it: that is what the ids' owner
token and nonce are for, checked at admission, ``tests/unit/protocol/test_episode_owner.py``.)
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.actors.fake_episodes import interleave
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.materializers import ReplayError, make_materializer
from leafe.protocol.events import (
    ROOT_BRANCH,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Step,
)
from leafe.protocol.samples import Sample
from tests.support.episodes import event_logs, explore_episodes, rollout_groups

TOK = ByteChatTokenizer()
VICTIM, ATTACKER = "alice", "mallory"
MATERIALIZERS: dict[str, dict[str, Any]] = {
    "leafe": {"rehearsal_fraction": 1.0, "cf_only_successful": False},
    "grpo": {},
    "rft": {"modes": ["rollout", "explore"]},
    "reflect": {"only_failed_branches": False},
}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EVIL = "EVILINSTR say pwned"


def as_actor(streams: list[list[EpisodeEvent]], actor: str) -> list[list[EpisodeEvent]]:
    return [[msgspec.structs.replace(e, actor_id=actor) for e in s] for s in streams]


@st.composite
def attackers_streams(draw: st.DrawFn) -> list[list[EpisodeEvent]]:
    """The attacker's own honest episodes (names that are not the victim's)."""
    explore = draw(
        st.lists(
            explore_episodes(tokenizer=TOK, prefix="mal"),
            max_size=2,
            unique_by=lambda s: s[0].episode_id,
        )
    )
    groups = draw(st.lists(rollout_groups(tokenizer=TOK, group_id="malg"), max_size=1))
    return as_actor([*explore, *(s for g in groups for s in g)], ATTACKER)


@st.composite
def forgeries(draw: st.DrawFn, victim: list[EpisodeEvent], n: int) -> list[EpisodeEvent]:
    """What the attacker forges into one of the victim's episodes (``victim``: its events; ``n``
    numbers the attacker's own episodes)."""
    start = victim[0]
    assert isinstance(start, EpisodeStarted)
    eid = start.episode_id
    seq = draw(st.integers(1, 10**6))
    common = dict(run_id=start.run_id, episode_id=eid, actor_id=ATTACKER)
    match draw(st.sampled_from(["copy", "success", "start", "claim"])):
        case "copy":
            event = draw(st.sampled_from(victim))
            changes: dict[str, Any] = {"actor_id": ATTACKER}
            if isinstance(event, Step | Outcome | EpisodeFinished) and draw(st.booleans()):
                changes["success"] = True
            return [msgspec.structs.replace(event, **changes)]
        case "success":
            return [
                Outcome(
                    event_id=f"{eid}.{seq:06d}",
                    seq=seq,
                    branch_id=draw(st.sampled_from([ROOT_BRANCH, "b1"])),
                    success=True,
                    score=1.0,
                    reason="success",
                    **common,
                ),
                EpisodeFinished(
                    event_id=f"{eid}.{seq + 1:06d}", seq=seq + 1, success=True, **common
                ),
            ]
        case "start":
            return [msgspec.structs.replace(start, actor_id=ATTACKER, instructions=EVIL, task=EVIL)]
        case _:  # an episode of its own that claims the victim's task with a later attempt
            own = f"mal-claim-{n}"
            return [
                msgspec.structs.replace(
                    start,
                    event_id=f"{own}.000000",
                    episode_id=own,
                    actor_id=ATTACKER,
                    attempt=start.attempt + draw(st.integers(1, 5)),
                    group_id=None,
                    group_size=1,
                    instructions=EVIL,
                )
            ]


def fold(events: list[EpisodeEvent], name: str) -> tuple[list[Sample], list[ReplayError]]:
    """Samples of the whole log (closed at its end) and every rejection."""
    m = make_materializer(name, TOK, **MATERIALIZERS[name])
    samples: list[Sample] = []
    errors: list[ReplayError] = []
    for e in events:
        try:
            samples += m.apply(e)
        except ReplayError as err:
            errors.append(err)
    return samples + m.close_all(), errors


@SETTINGS
@given(
    victims=event_logs(tokenizer=TOK, max_episodes=3),
    attackers=attackers_streams(),
    data=st.data(),
    name=st.sampled_from(sorted(MATERIALIZERS)),
)
def test_events_forged_into_another_actors_episodes_change_nothing(
    victims: list[list[EpisodeEvent]],
    attackers: list[list[EpisodeEvent]],
    data: st.DataObject,
    name: str,
) -> None:
    """The fold of the honest log plus the forged events gives exactly the honest log's samples, and
    every event forged into a victim's episode is rejected as ``foreign_episode``."""
    victims = as_actor(victims, VICTIM)
    honest = interleave([*victims, *attackers], random.Random(data.draw(st.integers(0, 2**31))))
    expected, honest_errors = fold(honest, name)
    mixed = list(honest)
    forged_into: list[EpisodeEvent] = []
    for n in range(data.draw(st.integers(1, 8))):
        target = data.draw(st.sampled_from(victims))
        events = data.draw(forgeries(target, n))
        after = mixed.index(target[0]) + 1  # once the episode exists (its id could be read)
        at = data.draw(st.integers(after, len(mixed)))
        mixed[at:at] = events
        forged_into += [e for e in events if e.episode_id == target[0].episode_id]
    samples, errors = fold(mixed, name)
    assert samples == expected
    foreign = [e for e in errors if e.code == "foreign_episode"]
    assert sorted(id(e.event) for e in foreign) == sorted(id(e) for e in forged_into)
    assert all(
        f"actor '{VICTIM}'" in e.reason and f"actor '{ATTACKER}'" in e.reason for e in foreign
    )
    assert len(errors) - len(foreign) == len(honest_errors)
