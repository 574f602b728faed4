"""The reflection warm start's samples (``reflect`` materializer), pinned against the real explorer.

The real explorer plays a real Sokoban room with SmolLM2's real tokenizer and chat template; a
scripted policy makes one checkable mistake (a solvable move that makes the room longer), then names
no move, and reflects with noise; with e in context it plays the solver's moves. The explorer labels
each model reflection with the oracle's verdict (``oracle_labels``). Pinned: the sample's prompt is,
token for token, the reflection request the engine received; its completion parses back to the
oracle's tau and e; only the completion carries loss; reflections without a verdict, or on branches
that succeeded, give nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from leafe.actors.config import ExplorerConfig
from leafe.actors.fakes import ScriptedEngine
from leafe.actors.parsing import parse_reflection
from leafe.envs.sokoban.env import SokobanEnv
from leafe.learner.batching import collate, to_items
from leafe.learner.losses import IGNORE
from leafe.learner.materializers import SAMPLE_KINDS, MaterializerConfigError, make_materializer
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.answers import end_of_turn_id
from leafe.protocol.events import EpisodeEvent, Outcome, Reflection
from leafe.protocol.samples import Sample
from tests.support.sokoban_episodes import explore, fold, plan, sokoban_env, worse_move

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

NOISE = "<step>0</step><experience>This is not a step.</experience>"


class MistakePolicy:
    """Root: a solvable move that makes the room longer, then (``recover``) the solver's moves or
    nothing at all; reflections are noise; with e in context: the solver's moves."""

    def __init__(self, env: SokobanEnv, *, recover: bool = False) -> None:
        self.env, self.recover, self.mistakes = env, recover, 0

    def __call__(self, kind: str, prompt: str) -> str:
        if kind == "reflection":
            return NOISE
        snap = self.env.snapshot()
        room, player, boxes = snap.room, snap.player, snap.boxes
        at_start = (player, boxes) == (room.player, room.boxes)
        if "Lesson from an earlier attempt" not in prompt and at_start and not self.mistakes:
            self.mistakes += 1
            return f"<action>{worse_move(room, player, boxes)}</action>"
        if "Lesson from an earlier attempt" in prompt or self.recover:
            return f"<action>{plan(room, player, boxes)[0]}</action>"
        return "I am not sure."


def _room(env: SokobanEnv) -> str:
    for task_id in env.tasks("train")[:200]:
        room = env.room(task_id).room
        if worse_move(room, room.player, room.boxes):
            return task_id
    raise AssertionError("no room with a solvable detour among the first 200")


async def _explore(
    tok: HFChatTokenizer, *, recover: bool = False, **cfg: Any
) -> tuple[list[EpisodeEvent], ScriptedEngine]:
    env = sokoban_env()
    config = ExplorerConfig(**{"k": 0, "max_depth": 1, "horizon": 6, **cfg})
    policy = MistakePolicy(env, recover=recover)
    return await explore(tok, env, policy, task_id=_room(env), name="reflect", config=config)


def _fold(
    tok: HFChatTokenizer, events: list[EpisodeEvent], **options: Any
) -> tuple[list[Sample], Any]:
    return fold(tok, "reflect", events, **options)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_dir(tiny_dir)


async def test_prompt_is_the_explorers_reflection_request_and_completion_the_oracles_verdict(
    tok: HFChatTokenizer,
) -> None:
    """Token for token: the sample's prompt == the reflection request the engine got; the completion
    decodes to ``<step>tau</step><experience>e</experience>`` that parses back to the oracle's
    label; the branch followed the model's noisy tau and e; only the completion's tokens carry
    loss."""
    events, engine = await _explore(tok, oracle_labels=True)
    (refl,) = [e for e in events if isinstance(e, Reflection)]
    assert refl.source == "model" and refl.experience == "This is not a step."
    assert refl.oracle_tau is not None and refl.oracle_experience and refl.oracle_tau == 0
    (request,) = [c for c in engine.calls if c.kind == "reflection"]
    outcome = {e.branch_id: e for e in events if isinstance(e, Outcome)}
    assert not outcome["b0"].success and outcome["b1"].success

    samples, m = _fold(tok, events)
    (sample,) = samples
    assert sample.kind == "sft" and sample.materializer == "reflect/1"
    assert sample.prompt_ids == request.input_ids, "the explorer's own reflection request"
    assert m.stats.prompts_verified == 1 and m.stats.prompt_mismatches == 0
    text = tok.decode(sample.completion_ids)
    assert (
        text == f"<step>{refl.oracle_tau}</step><experience>{refl.oracle_experience}</experience>"
    )
    assert sample.messages[-1].content == text and sample.target_turn == len(sample.messages) - 1
    back = parse_reflection(text, refl.at_t)
    assert (back.tau, back.experience, back.parse_ok) == (
        refl.oracle_tau,
        refl.oracle_experience,
        True,
    )
    assert sample.completion_ids[-1] != end_of_turn_id(tok), (
        "ends in the stop string, as an engine's would"
    )
    assert refl.event_id in sample.source_event_ids
    assert m.stats.reflections == {"samples": 1, "seen": 1}

    (no_stop,), _ = _fold(tok, events, reflect_stop=[])
    assert no_stop.completion_ids == [*sample.completion_ids, end_of_turn_id(tok)], (
        "else the turn ends"
    )

    items, skipped = to_items([sample], 4096)
    assert not skipped
    mb = collate(items, 0)
    assert [int(x) for x in mb.labels[0] if x != IGNORE] == sample.completion_ids
    assert SAMPLE_KINDS["reflect"] == ("sft",)


async def test_oracle_source_reflections_give_the_same_prompt_with_their_own_tau_and_e(
    tok: HFChatTokenizer,
) -> None:
    """An oracle-written Reflection is its own label: same prompt as the labelled model run's
    request (the same history), completion from its tau and e, counted unverifiable (no prompt was
    sent)."""
    labelled, engine = await _explore(tok, oracle_labels=True)
    (request,) = [c for c in engine.calls if c.kind == "reflection"]
    (want,) = [e for e in labelled if isinstance(e, Reflection)]
    events, _ = await _explore(tok, reflection_source="oracle")
    (refl,) = [e for e in events if isinstance(e, Reflection)]
    assert refl.source == "oracle" and (refl.tau, refl.experience) == (
        want.oracle_tau,
        want.oracle_experience,
    )
    (sample,), m = _fold(tok, events)
    assert sample.prompt_ids == request.input_ids
    assert (
        tok.decode(sample.completion_ids)
        == f"<step>{refl.tau}</step><experience>{refl.experience}</experience>"
    )
    assert m.stats.prompts_unverifiable == 1


async def test_a_reflection_without_an_oracle_verdict_yields_nothing(tok: HFChatTokenizer) -> None:
    """Model reflections of a run without labels: no sample, counted ``unlabelled``."""
    events, _ = await _explore(tok)
    samples, m = _fold(tok, events)
    assert samples == [] and m.stats.reflections == {"seen": 1, "unlabelled": 1}


async def test_only_failed_branches_drops_reflections_on_a_branch_that_went_on_to_succeed(
    tok: HFChatTokenizer,
) -> None:
    """A periodic reflection on the root, which then solves the room: dropped by default (counted),
    kept with ``only_failed_branches = false``."""
    events, _ = await _explore(tok, recover=True, oracle_labels=True, k=2)
    refls = [e for e in events if isinstance(e, Reflection)]
    assert [r.trigger for r in refls] == ["periodic"] and refls[0].oracle_experience
    assert next(e for e in events if isinstance(e, Outcome)).success
    dropped, m = _fold(tok, events)
    assert dropped == [] and m.stats.reflections == {"branch_succeeded": 1, "seen": 1}
    kept, m = _fold(tok, events, only_failed_branches=False)
    assert len(kept) == 1 and m.stats.prompts_verified == 1


async def test_a_wrong_history_window_is_caught_by_the_prompt_digest(tok: HFChatTokenizer) -> None:
    """The explorer showed every step; a materializer told to show one rebuilds another prompt:
    counted."""
    events, _ = await _explore(tok, oracle_labels=True)
    _, m = _fold(tok, events, reflect_history_window=1)
    assert m.stats.prompt_mismatches == 1 and m.stats.prompts_verified == 0


def test_options_refuse_the_test_split_and_other_modes(tiny_dir: Path) -> None:
    """The warm start never reads test tasks, rollouts or evaluations."""
    tok = HFChatTokenizer.from_dir(tiny_dir)
    with pytest.raises(MaterializerConfigError, match="test"):
        make_materializer("reflect", tok, splits=["train", "test"])
    with pytest.raises(MaterializerConfigError, match="explore"):
        make_materializer("reflect", tok, modes=["eval"])
