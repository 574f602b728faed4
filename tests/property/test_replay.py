"""Property suite of the materializer folds over realistic event logs (explore trees + GRPO groups).

Pins: the sample set does not depend on how episodes interleave; duplicate deliveries add nothing;
rebuilds are byte-identical; branches without an Outcome produce nothing; counterfactual inputs
never contain the experience; counterfactual targets are exactly the branches' first actions; every
rebuilt prompt matches the digest the actor recorded.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.actors.fake_episodes import EXPERIENCE_MARKER, interleave
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.dataset import shard_paths, write_dataset
from leafe.learner.materializers import fold_events, make_materializer
from leafe.protocol.events import (
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Step,
)
from leafe.protocol.samples import Sample
from tests.support.episodes import event_logs

TOK = ByteChatTokenizer()
MATERIALIZERS = {
    "leafe": {"rehearsal_fraction": 0.5},
    "leafe-all": {"rehearsal_fraction": 1.0, "cf_only_successful": False},
    "grpo": {},
    "rft": {},
}
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def materialize(events: list[EpisodeEvent], name: str) -> tuple[dict[str, Sample], object]:
    fold = make_materializer(name.split("-")[0], TOK, **MATERIALIZERS[name])
    result = fold_events(events, fold)
    by_id = {s.sample_id: s for s in result.samples}
    assert len(by_id) == len(result.samples), "the fold emitted one sample id twice"
    assert result.rejected == 0
    return by_id, fold


names = st.sampled_from(sorted(MATERIALIZERS))


@SETTINGS
@given(streams=event_logs(tokenizer=TOK), name=names, seeds=st.tuples(st.integers(), st.integers()))
def test_sample_set_is_independent_of_interleaving(
    streams: list, name: str, seeds: tuple[int, int]
) -> None:
    """Any two interleavings of the same per-episode streams give the same samples, field for
    field."""
    a, fold = materialize(interleave(streams, random.Random(seeds[0])), name)
    b, _ = materialize(interleave(streams, random.Random(seeds[1])), name)
    assert a == b
    assert fold.stats.prompt_mismatches == 0  # type: ignore[attr-defined]


@SETTINGS
@given(streams=event_logs(tokenizer=TOK), name=names, data=st.data())
def test_duplicate_deliveries_add_nothing(streams: list, name: str, data: st.DataObject) -> None:
    """Redelivering events (each copy after its original) produces exactly the same sample set."""
    rng = random.Random(data.draw(st.integers()))
    events = interleave(streams, rng)
    noisy = list(events)
    for _ in range(data.draw(st.integers(1, 40))):
        i = rng.randrange(len(events))
        noisy.insert(rng.randrange(noisy.index(events[i]) + 1, len(noisy) + 1), events[i])
    a, clean = materialize(events, name)
    b, fold = materialize(noisy, name)
    assert a == b
    # copies of events of episodes the materializer ignores (eval, other modes) are dropped with
    # them
    ignored = fold.stats.ignored_events - clean.stats.ignored_events  # type: ignore[attr-defined]
    # ... and copies of a superseded attempt's events after a later attempt of its task started
    # count as stragglers (after_close), as its own late events already do in the clean fold
    late = fold.stats.after_close - clean.stats.after_close  # type: ignore[attr-defined]
    assert fold.stats.duplicates + late + ignored == len(noisy) - len(events)  # type: ignore[attr-defined]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    streams=event_logs(tokenizer=TOK),
    seeds=st.tuples(st.integers(), st.integers()),
    shard=st.integers(1, 9),
)
def test_rebuilds_are_byte_identical(streams: list, seeds: tuple[int, int], shard: int) -> None:
    """Two rebuilds of the same log (in different interleavings) write the same bytes and content
    hash."""
    with tempfile.TemporaryDirectory() as tmp:
        manifests = []
        for i, seed in enumerate(seeds):
            fold = make_materializer("leafe", TOK, rehearsal_fraction=0.5)
            result = fold_events(interleave(streams, random.Random(seed)), fold)
            out = Path(tmp) / str(i)
            manifests.append(
                write_dataset(result.samples, out, materializer=fold.describe(), shard_size=shard)
            )
        assert manifests[0] == manifests[1]
        pairs = zip(shard_paths(Path(tmp) / "0"), shard_paths(Path(tmp) / "1"), strict=True)
        assert all(x.read_bytes() == y.read_bytes() for x, y in pairs)


def _branch_outcomes(events: list[EpisodeEvent]) -> dict[tuple[str, str], Outcome]:
    return {(e.episode_id, e.branch_id): e for e in events if isinstance(e, Outcome)}


def _paths(events: list[EpisodeEvent]) -> dict[tuple[str, str], list[str]]:
    """Oracle: the step event ids on every branch's full path, from the events alone."""
    own: dict[tuple[str, str], list[str]] = {}
    fork: dict[tuple[str, str], tuple[str, int]] = {}
    for e in events:
        if isinstance(e, Step):
            own.setdefault((e.episode_id, e.branch_id), []).append(e.event_id)
        elif isinstance(e, Branch):
            fork[(e.episode_id, e.branch_id)] = (e.parent_branch_id, e.tau)

    def path(key: tuple[str, str]) -> list[str]:
        if key not in fork:
            return own.get(key, [])
        parent, tau = fork[key]
        return path((key[0], parent))[:tau] + own.get(key, [])

    return {key: path(key) for key in set(own) | set(fork)}


@SETTINGS
@given(
    streams=event_logs(tokenizer=TOK, groups=False),
    name=st.sampled_from(["leafe", "leafe-all", "rft"]),
)
def test_nothing_comes_from_branches_without_outcome(streams: list, name: str) -> None:
    """Every sample's target lies on the path of a branch whose Outcome is in the log (a success,
    except for counterfactuals when failures are kept); truncating episodes only ever removes
    samples."""
    events = [e for s in streams for e in s]
    samples, _ = materialize(events, name)
    by_id = {e.event_id: e for e in events}
    outcomes = _branch_outcomes(events)
    paths = _paths(events)
    for s in samples.values():
        sources = [by_id[x] for x in s.source_event_ids]
        target = max((e for e in sources if isinstance(e, Step)), key=lambda e: e.seq)
        assert target.token_ids == s.completion_ids
        branches = [e.branch_id for e in sources if isinstance(e, Branch)] or [
            b for (ep, b), p in paths.items() if ep == s.episode_id and target.event_id in p
        ]
        ended = [outcomes.get((s.episode_id, b)) for b in branches]
        allow_failure = s.kind == "cf" and name == "leafe-all"
        assert any(o is not None and (o.success or allow_failure) for o in ended), s.sample_id
    cut = [e for st_ in streams for e in st_[: max(1, len(st_) // 2)]]
    partial, _ = materialize(cut, name)
    assert partial.keys() <= samples.keys()
    assert all(partial[k] == samples[k] for k in partial)


@SETTINGS
@given(streams=event_logs(tokenizer=TOK, groups=False))
def test_counterfactuals_drop_experience_and_target_first_actions(streams: list) -> None:
    """cf inputs never contain e (messages or token ids); each successful branch's first parsed
    action is exactly one cf target, with its exact token ids; no sample input contains e at all."""
    events = [e for s in streams for e in s]
    samples, fold = materialize(events, "leafe")
    for s in samples.values():
        prompt_text = TOK.decode(s.prompt_ids) + "".join(
            m.content for m in s.messages[: s.target_turn]
        )
        assert EXPERIENCE_MARKER not in prompt_text
    starts = {e.episode_id: e for e in events if isinstance(e, EpisodeStarted)}
    outcomes = _branch_outcomes(events)
    first_steps = {(e.episode_id, e.branch_id, e.t): e for e in events if isinstance(e, Step)}
    expected = {}
    for br in (e for e in events if isinstance(e, Branch)):
        outcome = outcomes.get((br.episode_id, br.branch_id))
        first = first_steps.get((br.episode_id, br.branch_id, br.tau))
        start = starts[br.episode_id]
        if (
            outcome
            and outcome.success
            and first
            and first.parse_ok
            and first.token_ids
            and start.mode == "explore"
        ):
            expected[br.event_id] = first
    cf = [s for s in samples.values() if s.kind == "cf"]
    assert len(cf) == len(expected)
    for s in cf:
        (branch_id,) = [x for x in s.source_event_ids if x in expected]
        assert s.completion_ids == expected[branch_id].token_ids
        assert s.messages[s.target_turn].content == expected[branch_id].raw_text
    assert fold.stats.prompt_mismatches == 0  # type: ignore[attr-defined]


def _expected_advantages(events: list[EpisodeEvent]) -> dict[str, float]:
    """Oracle: group-normalised advantage per finished rollout, from the events alone."""
    starts = {e.episode_id: e for e in events if isinstance(e, EpisodeStarted) and e.group_id}
    finished = {e.episode_id for e in events if isinstance(e, EpisodeFinished)}
    wins = {(e.episode_id): e.success for e in events if isinstance(e, Outcome)}
    groups: dict[str, dict[str, str]] = {}
    for eid in sorted(finished & starts.keys(), reverse=True):  # the smaller attempt id wins
        groups.setdefault(starts[eid].group_id or "", {})[starts[eid].task_key] = eid
    out: dict[str, float] = {}
    for members in groups.values():
        size = next(starts[e].group_size for e in members.values())
        returns = np.array([float(wins[e]) for e in sorted(members.values())])
        if len(members) == size and returns.std() >= 1e-8:
            adv = (returns - returns.mean()) / (returns.std() + 1e-6)
            out.update(zip(sorted(members.values()), adv.tolist(), strict=True))
    return out


@SETTINGS
@given(streams=event_logs(tokenizer=TOK, max_episodes=2))
def test_grpo_advantages_match_an_independent_computation(streams: list) -> None:
    """Every grpo sample carries its trajectory's group-normalised advantage and group id;
    incomplete and zero-variance groups produce nothing; every step of an emitted group is exactly
    one sample (a materializer that emits nothing fails here)."""
    events = [e for s in streams for e in s]
    samples, _ = materialize(events, "grpo")
    expected = _expected_advantages(events)
    for s in samples.values():
        assert s.group_id is not None and s.advantage == pytest.approx(
            expected[s.episode_id], abs=1e-9
        )
    # GRPO keeps unparsable completions (their negative advantage is how the format is learnt).
    trainable = [
        e for e in events if isinstance(e, Step) and e.episode_id in expected and e.token_ids
    ]
    assert len(samples) == len(trainable), "every step of an emitted group is one sample, no more"
