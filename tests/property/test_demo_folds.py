"""Property suite of the demonstration materializers (``sft``, ``iwm``, ``sr``) and the Sokoban
oracle.

Pins: folds are deterministic and do not depend on how episodes interleave (an interleaved log folds
to the union of per-episode folds); no sample ever comes from a non-demo or test-split episode;
every sample's prompt is the one the actor recorded and its targets are exact (demonstration ids,
executed observations); the oracle's tau is the first step after which the room's optimal distance
grew.
"""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.actors.fake_episodes import interleave
from leafe.actors.fakes import ByteChatTokenizer
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.envs.sokoban.expert import optimal_distance
from leafe.envs.sokoban.solver import ACTIONS, apply_move
from leafe.learner.materializers import fold_events, make_materializer
from leafe.protocol.events import Branch, EpisodeEvent, EpisodeStarted, Step
from leafe.protocol.prompt import HistoryEntry
from leafe.protocol.samples import Sample
from tests.support.demos import check_demo_episode, demo_episodes
from tests.support.episodes import event_logs

TOK = ByteChatTokenizer()
NAMES = ("sft", "iwm", "sr")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fold(events: list[EpisodeEvent], name: str) -> tuple[list[Sample], object]:
    m = make_materializer(name, TOK)
    result = fold_events(events, m)
    assert result.rejected == 0
    return result.samples, m


def encoded(samples: list[Sample]) -> list[bytes]:
    return sorted(msgspec.msgpack.encode(s) for s in samples)


@SETTINGS
@given(
    demos=demo_episodes(), others=event_logs(max_episodes=3), rng=st.randoms(use_true_random=False)
)
def test_folds_are_deterministic_and_order_independent(
    demos: list[list[EpisodeEvent]], others: list[list[EpisodeEvent]], rng: object
) -> None:
    """Same log, same samples (byte for byte); any interleaving folds to the union of per-episode
    folds."""
    streams = demos + others
    log = interleave(streams, rng)  # type: ignore[arg-type]
    for name in NAMES:
        once, _ = fold(log, name)
        assert encoded(once) == encoded(fold(log, name)[0])
        assert encoded(once) == encoded([s for stream in streams for s in fold(stream, name)[0]])


@SETTINGS
@given(demos=demo_episodes(), others=event_logs(max_episodes=3), forge=st.integers(0, 5))
def test_no_sample_from_a_non_demo_or_test_split_episode(
    demos: list[list[EpisodeEvent]], others: list[list[EpisodeEvent]], forge: int
) -> None:
    """Samples come only from demo episodes of the train split; a demo whose log says ``test`` gives
    none."""
    forged = demos[forge % len(demos)]
    forged = [
        msgspec.structs.replace(e, split="test") if isinstance(e, EpisodeStarted) else e
        for e in forged
    ]
    kept = {d[0].episode_id for d in demos} - {forged[0].episode_id}
    log = [
        e for stream in [*demos, *others] for e in stream if e.episode_id != forged[0].episode_id
    ] + forged
    for name in NAMES:
        samples, _ = fold(log, name)
        assert {s.episode_id for s in samples} <= kept


@SETTINGS
@given(demos=demo_episodes())
def test_targets_are_exact_and_prompts_verified(demos: list[list[EpisodeEvent]]) -> None:
    """sft targets are the logged expert ids; iwm targets are the executed observations (+ end of
    turn); sr targets end with the expert's ids; every prompt matched its recorded digest."""
    for episode in demos:
        check_demo_episode(episode)
    steps = {e.event_id: e for ep in demos for e in ep if isinstance(e, Step)}
    alts = {e.event_id for ep in demos for e in ep if isinstance(e, Step) and e.branch_id != "b0"}
    for name in NAMES:
        samples, m = fold([e for ep in demos for e in ep], name)
        assert m.stats.prompt_mismatches == 0  # type: ignore[attr-defined]
        for s in samples:
            sources = [steps[x] for x in s.source_event_ids if x in steps]
            if s.kind == "sft":
                assert s.completion_ids == sources[-1].token_ids and sources[-1].branch_id == "b0"
            elif s.kind == "iwm":
                (alt,) = [x for x in sources if x.event_id in alts]
                assert TOK.decode(s.completion_ids[:-1]) == alt.observation
            else:
                (alt,) = [x for x in sources if x.event_id in alts]
                expert = next(x for x in sources if x.branch_id == "b0" and x.t == alt.t)
                assert s.completion_ids[-len(expert.token_ids) :] == expert.token_ids
    n_branches = sum(isinstance(e, Branch) for ep in demos for e in ep)
    assert len(fold([e for ep in demos for e in ep], "iwm")[0]) >= n_branches


ROOMS = SokobanEnv(SokobanConfig(height=6, width=6, min_solution_len=2, max_solution_len=6))


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, 400), walk=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=6))
def test_oracle_tau_is_the_first_step_that_made_things_worse(index: int, walk: list[str]) -> None:
    """Along any walk (cut where it solves the room, as the episode ends there): every state before
    tau kept a finite optimal distance that never grew, and the step at tau made it grow; when no
    step did, tau is the first step that made no progress; with neither, there is no mistake. e
    names the step."""
    task_id = f"sokoban/train/{index}"
    room = ROOMS.room(task_id).room
    player, boxes = room.player, room.boxes
    dists = [optimal_distance(room, player, boxes)]
    for i, a in enumerate(walk):
        player, boxes, _ = apply_move(room, player, boxes, a)
        dists.append(optimal_distance(room, player, boxes))
        if dists[-1] == 0:
            walk = walk[: i + 1]
            break
    verdict = ROOMS.oracle_reflection(task_id, [HistoryEntry(a, a, "", "") for a in walk])
    grew = [t for t in range(len(walk)) if dists[t + 1] > dists[t]]
    idle = [t for t in range(len(walk)) if dists[t + 1] == dists[t]]
    if grew or idle:
        tau = grew[0] if grew else idle[0]
        assert verdict.tau == tau and verdict.experience.startswith(f"At step {tau}, ")
        assert all(dists[t] < 10**9 for t in range(tau + 1))
    else:
        assert verdict.experience == ""
