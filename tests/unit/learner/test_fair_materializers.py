"""The fair rows' builders (``learner/materializers/fair.py``): ``dagger`` on the real explorer's
events (SmolLM2's tokenizer, a real room, the oracle's labels), ``reh-own`` and ``self-taught`` on
hand-built trees whose outcomes decide what each keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from leafe.actors.config import ExplorerConfig
from leafe.learner.materializers import SAMPLE_KINDS, MaterializerConfigError, make_materializer
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.events import (
    Branch,
    EpisodeEvent,
    EpisodeStarted,
    Reflection,
    Rollback,
    Step,
)
from leafe.protocol.prompt import HistoryEntry, render_messages
from tests.support.materializers import TOK, Tree
from tests.support.materializers import fold as fold_bytes
from tests.support.sokoban_episodes import explore, fold, sokoban_env, worse_move

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]


class DetourPolicy:
    """A detour (a solvable move that lengthens the solution), then the same move again; its
    reflections are noise."""

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


async def _explore(tok: HFChatTokenizer, name: str = "dg", **cfg: Any) -> list[EpisodeEvent]:
    env = sokoban_env()
    config = ExplorerConfig.for_env(
        "sokoban", {"k": 0, "max_depth": 1, "horizon": 6, "experience_scope": "first_step", **cfg}
    )
    events, _ = await explore(
        tok, env, DetourPolicy(env), task_id=_room(env), name=name, config=config
    )
    return events


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_dir(tiny_dir)


async def test_dagger_labels_the_root_rollouts_first_mistake_without_e(
    tok: HFChatTokenizer,
) -> None:
    """The oracle's label beside a model reflection on the root: the root's history at the
    oracle's tau, no e, -> the oracle's move (kind cf); the prompt is the one the root's own step
    sent there (its digest checks it)."""
    events = await _explore(tok, oracle_labels=True)
    labels = [e for e in events if isinstance(e, Reflection) and e.branch_id == "b0"]
    assert labels and labels[0].oracle_action and labels[0].oracle_tau is not None
    (sample,), m = fold(tok, "dagger", events)
    first = min(labels, key=lambda r: r.oracle_tau or 0)
    assert sample.kind == "cf"
    assert tok.decode(sample.completion_ids) == f"{first.oracle_action}</action>"
    started = events[0]
    assert isinstance(started, EpisodeStarted)
    path = [e for e in events if isinstance(e, Step) and e.branch_id == "b0"]
    tau = first.oracle_tau
    assert tau is not None
    assert sample.messages[:2] == render_messages(
        instructions=started.instructions,
        task=started.task,
        history=[HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in path[:tau]],
        observation=path[tau - 1].observation if tau else started.observation,
        experience=None,
        history_window=started.history_window,
    )
    assert m.stats.prompts_verified == 1 and m.stats.prompt_mismatches == 0
    assert m.stats.builders["dagger.samples"] == 1
    assert path[tau].action != first.oracle_action  # the label corrects the policy's move


async def test_dagger_counts_one_state_once_and_caps_in_log_order(tok: HFChatTokenizer) -> None:
    """Two episodes of one task with the same actions reach the same state: one sample;
    ``max_samples`` caps; without a verdict nothing comes."""
    a = await _explore(tok, "dg-a", oracle_labels=True)
    b = await _explore(tok, "dg-b", oracle_labels=True)
    samples, m = fold(tok, "dagger", a + b)
    assert len(samples) == 1 and m.stats.builders["dagger.same_state_again"] == 1
    samples, m = fold(tok, "dagger", a + b, per_rollout="all", max_samples=1)
    assert len(samples) == 1
    samples, m = fold(tok, "dagger", await _explore(tok, "dg-c"))
    assert samples == [] and m.stats.builders["dagger.no_named_move"] >= 1


def test_builders_refuse_the_test_split_and_other_modes() -> None:
    for name in ("dagger", "self-taught"):
        with pytest.raises(MaterializerConfigError, match="test"):
            make_materializer(name, TOK, splits=["train", "test"])
        with pytest.raises(MaterializerConfigError, match="explore"):
            make_materializer(name, TOK, modes=["rollout"])
    assert SAMPLE_KINDS["dagger"] == ("cf",) and SAMPLE_KINDS["self-taught"] == ("sft",)


def _guided_tree() -> Tree:
    """Root fails after two steps; b1 (tau 1) takes its first step with e, one more without, and
    succeeds."""
    tree = Tree()
    tree.step("b0", "up")
    tree.step("b0", "left")
    tree.outcome("b0", False)
    tree.branch("b0", 1, "b1")
    tree.step("b1", "down", with_e=True)
    tree.step("b1", "right")
    tree.outcome("b1", True)
    tree.finish()
    return tree


def test_reh_own_drops_the_guided_step_that_is_also_the_cf_target() -> None:
    events = _guided_tree().events
    leafe, _ = fold_bytes(events, "leafe", rehearsal_fraction=1.0)
    assert sorted(s.kind for s in leafe) == ["cf", "reh", "reh", "reh"]
    cf = next(s for s in leafe if s.kind == "cf")
    own, m = fold_bytes(events, "reh-own", rehearsal_fraction=1.0)
    assert [s.kind for s in own] == ["reh", "reh"]
    assert all(s.completion_ids != cf.completion_ids for s in own)
    targets = {s.messages[-1].content for s in own}
    assert targets == {"<action>up</action>", "<action>right</action>"}
    assert m.stats.builders == {
        "reh-own.guided_dropped": 1,
        "reh-own.identical_to_cf": 1,
        "reh-own.samples": 2,
    }
    assert m.stats.samples == {"reh": 2}


def _reflect(
    tree: Tree, parent: str, tau: int, new: str, *, source: str = "model"
) -> tuple[Reflection, Branch]:
    """As ``Tree.branch``, with the reflection's own answer ids (what a self-taught sample
    trains on)."""
    e = f"At step {tau}, move down instead."
    refl = tree.w.emit(
        Reflection,
        branch_id=parent,
        at_t=len(tree.paths[parent]),
        trigger="failure",
        tau=tau,
        experience=e,
        # the engine keeps the matched stop string in the ids, not in the text
        raw_text=f"<step>{tau}</step><experience>{e}",
        token_ids=list(f"<step>{tau}</step><experience>{e}</experience>".encode()),
        source=source,
    )
    tree.w.emit(Rollback, from_branch=parent, tau=tau, method="snapshot")
    br = tree.w.emit(
        Branch,
        branch_id=new,
        parent_branch_id=parent,
        tau=tau,
        reflection_event_id=refl.event_id,
        experience=e,
        depth=1,
    )
    tree.paths[new] = list(tree.paths[parent][:tau])
    tree.experience[new] = e
    return refl, br


def _outcome_tree(root_success: bool, branch_success: bool, source: str = "model") -> Tree:
    tree = Tree()
    tree.step("b0", "up")
    tree.step("b0", "left")
    tree.outcome("b0", root_success)
    _reflect(tree, "b0", 1, "b1", source=source)
    tree.step("b1", "down", with_e=True)
    tree.outcome("b1", branch_success)
    tree.finish()
    return tree


@pytest.mark.parametrize(
    ("root", "branch", "keep_ties", "kept", "reward"),
    [
        (False, True, False, 1, "+1"),
        (False, False, False, 0, "+0"),
        (True, False, False, 0, "-1"),
        (True, True, False, 0, "+0"),
        (True, True, True, 1, "+0"),
        (False, False, True, 0, "+0"),
    ],
)
def test_self_taught_keeps_a_reflection_whose_branch_beats_the_no_e_path(
    root: bool, branch: bool, keep_ties: bool, kept: int, reward: str
) -> None:
    samples, m = fold_bytes(_outcome_tree(root, branch).events, "self-taught", keep_ties=keep_ties)
    assert len(samples) == kept and m.stats.builders[f"self-taught.reward_{reward}"] == 1
    if kept:
        (s,) = samples
        answer = "<step>1</step><experience>At step 1, move down instead.</experience>"
        assert s.kind == "sft" and s.completion_ids == list(answer.encode())
        assert s.messages[-1].content == answer


def test_self_taught_reads_no_oracle_and_needs_a_no_e_baseline() -> None:
    samples, m = fold_bytes(_outcome_tree(False, True, source="oracle").events, "self-taught")
    assert samples == [] and "self-taught.seen" not in m.stats.builders
    # b2 branches from b1 at b1's own tau: b1's step there carried e, so it is no baseline
    tree = Tree()
    tree.step("b0", "up")
    tree.step("b0", "left")
    tree.outcome("b0", False)
    _reflect(tree, "b0", 1, "b1")
    tree.step("b1", "down", with_e=True)
    tree.step("b1", "down")
    tree.outcome("b1", False)
    _reflect(tree, "b1", 1, "b2")
    tree.step("b2", "right", with_e=True)
    tree.outcome("b2", True)
    tree.finish()
    samples, m = fold_bytes(tree.events, "self-taught")
    assert samples == [] and m.stats.builders["self-taught.no_baseline"] == 1
    # against the root's outcome instead, it is a win
    samples, m = fold_bytes(tree.events, "self-taught", baseline="root")
    assert len(samples) == 1
