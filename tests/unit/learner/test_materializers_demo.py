"""Materializers over demonstrations: ``sft`` (expert steps), ``iwm`` and ``sr`` (Early Experience).

Logs come from real Sokoban demonstrations (``leafe.actors.demo.DemoRunner``) tokenized with
SmolLM2's tokenizer, so the token claims are about the served tokenizer, not a fake."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from leafe.actors.fake_episodes import ExploreSpec, build_explore_episode, build_rollout_group
from leafe.actors.parsing import parse_action
from leafe.learner.materializers import (
    SAMPLE_KINDS,
    MaterializerConfigError,
    fold_events,
    make_materializer,
)
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.events import Branch, EpisodeEvent, EpisodeStarted, Reflection, Step
from leafe.protocol.prompt import prompt_sha256
from leafe.protocol.samples import Sample
from tests.support.demos import play_demo

MOVES = ["up", "down", "left", "right"]


@pytest.fixture(scope="module")
def smol(tiny_dir: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def demos(smol: HFChatTokenizer) -> list[list[EpisodeEvent]]:
    """Six demonstrations with alternatives and self-reflections (SmolLM2 tokens)."""
    return [
        play_demo(i, tokenizer=smol, alternatives=5, self_reflection=True, seed=i) for i in range(6)
    ]


def flat(episodes: list[list[EpisodeEvent]]) -> list[EpisodeEvent]:
    return [e for ep in episodes for e in ep]


def expert_steps(episode: list[EpisodeEvent]) -> list[Step]:
    return [e for e in episode if isinstance(e, Step) and e.branch_id == "b0"]


def test_sft_samples_are_the_expert_steps_exactly(
    smol: HFChatTokenizer, demos: list[list[EpisodeEvent]]
) -> None:
    """One sample per expert step (never an alternative): the step's exact completion ids, and a
    prompt whose digest is the one the step recorded (verified, no mismatch)."""
    fold = make_materializer("sft", smol)
    samples = fold_events(flat(demos), fold).samples
    steps = [s for ep in demos for s in expert_steps(ep)]
    assert len(samples) == len(steps) and all(s.kind == "sft" for s in samples)
    by_step = {s.source_event_ids[-1]: s for s in samples}
    for step in steps:
        sample = by_step[step.event_id]
        assert sample.completion_ids == step.token_ids
        assert prompt_sha256(sample.prompt_ids) == step.prompt_sha256
        assert sample.messages[-1].content == "<action>" + step.raw_text
        assert sample.policy_version == "expert"
    assert fold.stats.prompts_verified == len(steps) and fold.stats.prompt_mismatches == 0


def test_a_tampered_log_fails_prompt_verification(
    smol: HFChatTokenizer, demos: list[list[EpisodeEvent]]
) -> None:
    """Verification is real: change one expert observation and the prompts after it no longer
    match."""
    episode = list(next(ep for ep in demos if len(expert_steps(ep)) > 1))
    i = next(i for i, e in enumerate(episode) if isinstance(e, Step) and e.branch_id == "b0")
    step = episode[i]
    assert isinstance(step, Step)
    episode[i] = msgspec.structs.replace(step, observation=step.observation + "\n#####")
    fold = make_materializer("sft", smol)
    fold_events(episode, fold)
    assert fold.stats.prompt_mismatches >= 1


def test_sft_never_reads_other_modes_or_the_test_split(
    smol: HFChatTokenizer, demos: list[list[EpisodeEvent]]
) -> None:
    """Explore, rollout and eval episodes give nothing, nor does a demonstration whose log says test
    split; options asking for other modes or the test split are refused."""
    rng = random.Random(0)
    others = [
        build_explore_episode(ExploreSpec(seed=i, p_success=0.8), run_id="r1", episode_id=f"x{i}")
        for i in range(5)
    ]
    others += build_rollout_group(rng, run_id="r1", group_id="g", n=3, p_success=1.0)
    forged = [
        msgspec.structs.replace(e, split="test") if isinstance(e, EpisodeStarted) else e
        for e in demos[0]
    ]
    fold = make_materializer("sft", smol)
    assert fold_events([*flat(others), *forged], fold).samples == []
    for bad in ({"modes": ["demo", "explore"]}, {"splits": ["train", "test"]}):
        with pytest.raises(MaterializerConfigError):
            make_materializer("sft", smol, **bad)


def alternatives(episode: list[EpisodeEvent]) -> list[Step]:
    branches = {e.branch_id for e in episode if isinstance(e, Branch)}
    return [e for e in episode if isinstance(e, Step) and e.branch_id in branches]


def test_iwm_targets_are_the_executed_observations_exactly(
    smol: HFChatTokenizer, demos: list[list[EpisodeEvent]]
) -> None:
    """Input: the state's prompt with 'Action: a'' in place of the question; target: the observation
    the alternative produced, character for character, tokenized and ended with the end-of-turn
    token."""
    fold = make_materializer("iwm", smol)
    samples = fold_events(flat(demos), fold).samples
    iwm = [s for s in samples if s.kind == "iwm"]
    alts = [a for ep in demos for a in alternatives(ep)]
    assert alts and len(iwm) == len(alts)
    by_alt = {
        next(x for x in s.source_event_ids if x in {a.event_id for a in alts}): s for s in iwm
    }
    for alt in alts:
        sample = by_alt[alt.event_id]
        assert sample.messages[sample.target_turn].content == alt.observation
        assert (
            sample.completion_ids[-1] == 2
            and smol.decode(sample.completion_ids[:-1]) == alt.observation
        )
        assert f"Action: {alt.action}\n" in sample.messages[-2].content
        assert sample.prompt_ids == smol.encode_chat(sample.messages[: sample.target_turn])
    assert sum(s.kind == "sft" for s in samples) == sum(len(expert_steps(ep)) for ep in demos)
    assert fold.stats.prompt_mismatches == 0 and fold.stats.prompts_verified >= len(alts)
    only = fold_events(flat(demos), make_materializer("iwm", smol, demonstrations=False)).samples
    assert {s.kind for s in only} == {"iwm"}


def test_sr_targets_are_the_reflection_then_the_expert_answer(
    smol: HFChatTokenizer, demos: list[list[EpisodeEvent]]
) -> None:
    """Input: the state's prompt prefilled with <think>; target: the logged reflection, </think>,
    then the expert step's exact ids; the policy's parser reads the expert action from that
    answer."""
    fold = make_materializer("sr", smol)
    samples = fold_events(flat(demos), fold).samples
    sr = [s for s in samples if s.kind == "sr"]
    reflections = {e.event_id: e for ep in demos for e in ep if isinstance(e, Reflection)}
    assert sr and len(sr) == len(reflections)
    steps = {e.event_id: e for ep in demos for e in expert_steps(ep)}
    for sample in sr:
        refl = next(reflections[x] for x in sample.source_event_ids if x in reflections)
        expert = (
            steps[sample.source_event_ids[-1]] if sample.source_event_ids[-1] in steps else None
        )
        expert = expert or next(
            steps[x] for x in sample.source_event_ids if x in steps and steps[x].t == refl.tau
        )
        assert sample.completion_ids[-len(expert.token_ids) :] == expert.token_ids
        answer = smol.decode(sample.completion_ids)
        assert answer == f"{refl.experience}</think><action>{expert.action}</action>"
        assert parse_action("<think>" + answer, MOVES).action == expert.action
        assert sample.messages[-1].content == f"<think>{answer}".replace("</action>", "")
        assert sample.prompt_ids == smol.encode_chat(sample.messages[:-1], "<think>")
    assert fold.stats.prompt_mismatches == 0


def test_sr_needs_the_policys_reflection(smol: HFChatTokenizer) -> None:
    """Alternatives without self-reflection (empty markers) give no sr sample, only
    demonstrations."""
    episode = play_demo(2, tokenizer=smol, alternatives=5, seed=2)
    fold = make_materializer("sr", smol)
    samples = fold_events(episode, fold).samples
    assert {s.kind for s in samples} == {"sft"} and fold.stats.skipped_no_target == len(
        alternatives(episode)
    )


def test_demo_materializers_are_registered_with_their_kinds(smol: HFChatTokenizer) -> None:
    """``sft``, ``iwm`` and ``sr`` are names the replayer and ``leafe replay`` accept."""
    assert SAMPLE_KINDS["sft"] == ("sft",)
    assert set(SAMPLE_KINDS["iwm"]) == {"iwm", "sft"} and set(SAMPLE_KINDS["sr"]) == {"sr", "sft"}
    for name in ("sft", "iwm", "sr"):
        assert make_materializer(name, smol).tag == f"{name}/1"


def test_samples_round_trip_the_wire_format(
    smol: HFChatTokenizer, demos: list[list[EpisodeEvent]]
) -> None:
    """The new kinds encode and decode as Samples (protocol SampleKind)."""
    for name in ("iwm", "sr"):
        for sample in fold_events(flat(demos[:2]), make_materializer(name, smol)).samples:
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(sample), type=Sample) == sample


@pytest.mark.parametrize(
    ("name", "other_kinds"), [("warm-leafe", {"cf", "reh"}), ("warm-grpo", {"grpo"})]
)
def test_warm_materializers_fold_demonstrations_as_sft_and_the_rest_as_their_base(
    smol: HFChatTokenizer, demos: list[list[EpisodeEvent]], name: str, other_kinds: set[str]
) -> None:
    """``warm-leafe``/``warm-grpo`` (one run: warm start, then LEAFE or GRPO): demonstrations give
    exactly ``sft``'s samples; explore trees give exactly ``leafe``'s, grouped rollouts exactly
    ``grpo``'s; a test-split demonstration gives nothing and the test split is refused in the
    options."""
    rng = random.Random(0)
    explore = [
        build_explore_episode(
            ExploreSpec(seed=i, max_depth=2, p_success=0.3, stop_on_success=False),
            run_id="r1",
            episode_id=f"x{i}",
            tokenizer=smol,
        )
        for i in range(12)
    ]
    groups = [
        ep
        for g in range(6)
        for ep in build_rollout_group(
            rng, run_id="r1", group_id=f"g{g}", n=4, p_success=0.5, tokenizer=smol
        )
    ]
    forged = [
        msgspec.structs.replace(e, split="test") if isinstance(e, EpisodeStarted) else e
        for e in demos[0]
    ]
    events = [*flat(demos), *flat(explore), *flat(groups), *forged]
    base = "leafe" if name == "warm-leafe" else "grpo"

    def content(
        samples: list[Sample],
    ) -> set[tuple[object, ...]]:  # ids hash the materializer's name
        return {
            (s.kind, tuple(s.source_event_ids), tuple(s.prompt_ids), tuple(s.completion_ids))
            for s in samples
        }

    want = content(fold_events(flat(demos), make_materializer("sft", smol)).samples)
    want |= content(fold_events(events, make_materializer(base, smol)).samples)
    got = fold_events(events, make_materializer(name, smol)).samples
    assert content(got) == want and len(got) == len(want)
    assert all(s.materializer == f"{name}/1" for s in got)
    assert {s.kind for s in got} == {"sft"} | other_kinds == set(SAMPLE_KINDS[name])
    with pytest.raises(MaterializerConfigError):
        make_materializer(name, smol, splits=["train", "test"])
