"""The experience-following samples (``follow`` materializer), pinned against the real explorer.

The real explorer plays a real Sokoban room with SmolLM2's tokenizer and chat template. A scripted
policy makes a checkable mistake (a solvable move that makes the room longer) and then ignores any
experience it is given, so the target (the move the oracle's e names) is never what the policy did.
Pinned: the sample's prompt is, token for token, the request the branch opened by that verdict sent
at its first step (e in context); its completion is the named move in the answer format, ending in
the stop string; a verdict beside a model reflection gives the same kind of sample from the oracle's
tau and e; nothing comes from test-split episodes or verdicts that name no move.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from leafe.actors.config import ExplorerConfig
from leafe.actors.fakes import ScriptedEngine
from leafe.learner.materializers import MaterializerConfigError, make_materializer
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.events import Branch, EpisodeEvent, EpisodeStarted, Reflection, Step
from leafe.protocol.prompt import HistoryEntry, render_messages
from tests.support.sokoban_episodes import explore, fold, sokoban_env, worse_move

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

NAMED = re.compile(r"move (up|down|left|right) instead")


class StubbornPolicy:
    """A detour first, then always the same detour move again: e in context changes nothing."""

    def __init__(self, env: Any) -> None:
        self.env, self.move = env, ""

    def __call__(self, kind: str, prompt: str) -> str:
        if kind == "reflection":
            return "<step>0</step><experience>I should think more.</experience>"
        snap = self.env.snapshot()
        if not self.move:
            self.move = worse_move(snap.room, snap.player, snap.boxes)
        return f"<action>{self.move}</action>"


def _room(env: Any) -> str:
    for task_id in env.tasks("train")[:200]:
        room = env.room(task_id).room
        if worse_move(room, room.player, room.boxes):
            return task_id
    raise AssertionError("no room with a solvable detour among the first 200")


async def _explore(tok: HFChatTokenizer, **cfg: Any) -> tuple[list[EpisodeEvent], ScriptedEngine]:
    env = sokoban_env()
    config = ExplorerConfig.for_env(
        "sokoban", {"k": 0, "max_depth": 1, "horizon": 6, "experience_scope": "first_step", **cfg}
    )
    return await explore(
        tok, env, StubbornPolicy(env), task_id=_room(env), name="follow", config=config
    )


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_dir(tiny_dir)


async def test_prompt_is_the_branch_request_with_e_and_target_the_named_move(
    tok: HFChatTokenizer,
) -> None:
    """Oracle reflections: each sample's prompt equals the first request of the branch the verdict
    opened (checked by its digest too), and the completion is the move e names, never the policy's
    own move."""
    events, engine = await _explore(tok, reflection_source="oracle")
    branches = [e for e in events if isinstance(e, Branch)]
    assert branches, "the stubborn policy fails, so the oracle opens a branch"
    samples, m = fold(tok, "follow", events)
    assert len(samples) == len(branches) and m.stats.prompts_verified == len(branches)
    assert m.stats.prompt_mismatches == 0
    requests = [c.input_ids for c in engine.calls]
    for sample, branch in zip(samples, branches, strict=True):
        move = NAMED.search(branch.experience)
        assert move is not None
        assert sample.prompt_ids in requests and branch.experience in sample.messages[1].content
        assert tok.decode(sample.completion_ids) == f"{move.group(1)}</action>"
        assert (
            sample.messages[-1].content == f"<action>{move.group(1)}"
        )  # as an engine returns text
        assert move.group(1) != engine.calls[0].text.removesuffix("</action>")
        assert sample.kind == "sft" and sample.materializer == "follow/1"


async def test_labels_beside_model_reflections_give_the_oracles_prompt_and_move(
    tok: HFChatTokenizer,
) -> None:
    """With ``oracle_labels`` the branch follows the model's noise, and the sample is built from the
    oracle's verdict: its tau's history, its e in context, its named move as the target."""
    events, _ = await _explore(tok, oracle_labels=True)
    (refl,) = [e for e in events if isinstance(e, Reflection)]
    assert refl.oracle_action and refl.oracle_tau is not None
    (sample,), m = fold(tok, "follow", events)
    assert m.stats.follow["samples"] == 1
    assert refl.oracle_experience in sample.messages[1].content
    assert "I should think more." not in sample.messages[1].content
    assert tok.decode(sample.completion_ids) == f"{refl.oracle_action}</action>"
    started = events[0]
    assert isinstance(started, EpisodeStarted)
    path = [e for e in events if isinstance(e, Step) and e.branch_id == "b0"][: refl.oracle_tau]
    assert sample.messages[:2] == render_messages(
        instructions=started.instructions,
        task=started.task,
        history=[HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in path],
        observation=path[-1].observation if path else started.observation,
        experience=refl.oracle_experience,
        history_window=started.history_window,
    )


async def test_model_reflections_without_a_verdict_give_nothing(tok: HFChatTokenizer) -> None:
    """No oracle asked: no sample, counted as ``no_named_action``."""
    events, _ = await _explore(tok)
    samples, m = fold(tok, "follow", events)
    assert samples == [] and m.stats.follow["no_named_action"] >= 1


def test_test_split_and_other_modes_are_refused(tiny_dir: Path) -> None:
    """The warm start never trains on the test split; verdicts live in explore episodes only."""
    tok = HFChatTokenizer.from_dir(tiny_dir)
    with pytest.raises(MaterializerConfigError, match="test"):
        make_materializer("follow", tok, splits=["train", "test"])
    with pytest.raises(MaterializerConfigError, match="explore"):
        make_materializer("follow", tok, modes=["rollout"])
