"""The counterfactual path end to end, checked for defects before any null result is believed.

The real explorer plays real Sokoban rooms with oracle reflections (the solver names tau and e), a
scripted policy (a fixed, checkable mistake; the oracle's fix when e is in context; the solver's
move after that) and SmolLM2's real tokenizer and chat template. The events go through the ``leafe``
materializer and the learner's own batch builder and loss, and every link of the chain is pinned:

- the cf prompt equals, token for token, what the actor sent for the parent's step at tau (the
  history at tau without e), and the branch's first request equals that prompt rendered *with* e;
- the target is the corrected action's exact completion ids, and only those tokens carry loss;
- L = L_cf + beta * L_reh with each term a token mean over its kind (``PAPER.md``);
- a cf sample from a branch that did not succeed, or whose "correction" repeats the action it
  corrects, is dropped or kept exactly as the options say.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from leafe.actors.config import ExplorerConfig
from leafe.actors.fakes import ScriptedEngine
from leafe.envs.sokoban.env import SokobanEnv
from leafe.envs.sokoban.solver import apply_move
from leafe.learner.batching import collate, kind_tokens, to_items
from leafe.learner.losses import IGNORE, KIND_INDEX, distill_loss, token_logprobs
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.events import Branch, EpisodeEvent, Outcome, Step
from leafe.protocol.prompt import prompt_sha256
from leafe.protocol.samples import Sample
from tests.support.sokoban_episodes import explore, fold, plan, sokoban_env, worse_move

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

_FIX = re.compile(r"move (up|down|left|right) instead")


class SolverPolicy:
    """Root: the solver's move at the start, then one move that makes the room longer (still
    solvable: the mistake the oracle must blame), then answers that name no move until the horizon.
    With e in context: the move e names, or the blamed move again (``repeat_mistake``: a
    "correction" that corrects nothing). After that: the solver's moves, or no move at all
    (``fail_branch``)."""

    def __init__(
        self, env: SokobanEnv, *, repeat_mistake: bool = False, fail_branch: bool = False
    ) -> None:
        self.env = env
        self.repeat_mistake = repeat_mistake
        self.fail_branch = fail_branch
        self.mistakes: list[str] = []
        self.corrected = False

    def __call__(self, kind: str, prompt: str) -> str:
        assert kind == "action", "oracle reflections never reach the engine"
        snap = self.env.snapshot()
        fix = _FIX.search(prompt)
        if fix is not None and not self.corrected:
            self.corrected = True
            move = self.mistakes[-1] if self.repeat_mistake else fix.group(1)
        elif (self.corrected and self.fail_branch) or (self.mistakes and not self.corrected):
            return "I am not sure."
        elif self.corrected or (snap.player, snap.boxes) == (snap.room.player, snap.room.boxes):
            move = plan(snap.room, snap.player, snap.boxes)[0]
        else:
            move = worse_move(snap.room, snap.player, snap.boxes)
            self.mistakes.append(move)
        return f"<action>{move}</action>"


def _room_with_a_mistake(env: SokobanEnv) -> str:
    """A train room of >= 3 moves (the fix alone does not solve it) with a solvable but longer move
    after the solver's first move."""
    for task_id in env.tasks("train")[:200]:
        room = env.room(task_id).room
        moves = plan(room, room.player, room.boxes)
        if len(moves) < 3:
            continue
        player, boxes, _ = apply_move(room, room.player, room.boxes, moves[0])
        if worse_move(room, player, boxes):
            return task_id
    raise AssertionError("no suitable room among the first 200")


async def _explore(
    tok: HFChatTokenizer, **policy: Any
) -> tuple[list[EpisodeEvent], ScriptedEngine]:
    env = sokoban_env()
    config = ExplorerConfig(
        k=0,
        max_depth=1,
        horizon=10,
        reflection_source="oracle",
        experience_scope="first_step",
        history_window=2,
    )
    task_id = _room_with_a_mistake(env)
    return await explore(
        tok, env, SolverPolicy(env, **policy), task_id=task_id, name="cf-path", config=config
    )


def _fold(
    tok: HFChatTokenizer, events: list[EpisodeEvent], **options: Any
) -> tuple[list[Sample], Any]:
    return fold(tok, "leafe", events, **options)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_dir(tiny_dir)


async def test_cf_prompt_is_the_parents_request_at_tau_without_e_and_target_the_correction(
    tok: HFChatTokenizer,
) -> None:
    """Token for token: cf input == the actor's request for the parent's step at tau (no e); the
    branch's first request == the same history with e; cf target == the corrected action's exact
    ids."""
    events, engine = await _explore(tok)
    (branch,) = [e for e in events if isinstance(e, Branch)]
    steps = {(e.branch_id, e.t): e for e in events if isinstance(e, Step)}
    outcome = {e.branch_id: e for e in events if isinstance(e, Outcome)}
    assert outcome[branch.branch_id].success and not outcome["b0"].success
    tau = branch.tau
    assert tau >= 1, "the mistake comes after a correct move, so the cf history is not empty"
    mistake, correction = steps[("b0", tau)], steps[(branch.branch_id, tau)]
    assert correction.experience_in_context and not mistake.experience_in_context
    assert (
        correction.action != mistake.action
        and f"move {correction.action} instead" in branch.experience
    )

    samples, m = _fold(tok, events, rehearsal_fraction=0.0)
    (cf,) = [s for s in samples if s.kind == "cf"]
    requests = [c.input_ids for c in engine.calls]
    assert cf.prompt_ids == requests[mistake.t], "cf input is the parent's own request at tau"
    assert prompt_sha256(cf.prompt_ids) == mistake.prompt_sha256
    with_e = requests[len([k for k in steps if k[0] == "b0"])]  # the branch's first request
    assert prompt_sha256(with_e) == correction.prompt_sha256 and with_e != cf.prompt_ids
    assert branch.experience in tok.decode(with_e) and branch.experience not in tok.decode(
        cf.prompt_ids
    )
    assert "instead" not in tok.decode(cf.prompt_ids)
    assert (
        cf.completion_ids
        == correction.token_ids
        == list(f"<action>{correction.action}</action>".encode())
    )
    assert m.stats.prompt_mismatches == 0 and m.stats.prompts_verified >= 1

    # Only the correction's tokens carry loss in the learner's own batch.
    items, skipped = to_items([cf], 4096)
    assert not skipped
    mb = collate(items, 0)
    labels = [int(x) for x in mb.labels[0] if x != IGNORE]
    assert labels == cf.completion_ids
    row = mb.input_ids[0].tolist()
    assert row[-len(cf.prompt_ids) - len(cf.completion_ids) :] == [
        *cf.prompt_ids,
        *cf.completion_ids,
    ]


async def test_loss_mixes_cf_and_rehearsal_token_means_with_beta(tok: HFChatTokenizer) -> None:
    """On the explored episode's own samples: L = mean NLL over cf tokens + beta * mean NLL over reh
    tokens."""
    events, _ = await _explore(tok)
    samples, _ = _fold(tok, events, rehearsal_fraction=1.0)
    assert {s.kind for s in samples} == {"cf", "reh"}
    items, _ = to_items(samples, 4096)
    mb = collate(items, 0)
    torch.manual_seed(0)
    logits = torch.randn(*mb.labels.shape, 49152)
    logp = token_logprobs(logits, mb.labels)
    tokens = kind_tokens(items)
    beta = 0.3
    out = distill_loss(logp, mb.labels, mb.kinds, mb.weights, tokens, beta)
    nll = -(logp * (mb.labels != IGNORE)).sum(dim=-1)
    is_cf = torch.tensor([i.kind == KIND_INDEX["cf"] for i in items])
    want = nll[is_cf].sum() / tokens.cf + beta * nll[~is_cf].sum() / tokens.reh
    assert tokens.cf == sum(len(s.completion_ids) for s in samples if s.kind == "cf")
    assert torch.allclose(out.loss, want)


async def test_a_correction_that_repeats_the_blamed_action_is_kept_or_dropped_as_configured(
    tok: HFChatTokenizer,
) -> None:
    """A branch that succeeds with the very action the reflection blamed corrects nothing: by
    default it is still a cf sample (the paper keeps every successful branch);
    ``cf_drop_repeated_action`` drops it, counted."""
    events, _ = await _explore(tok, repeat_mistake=True)
    (branch,) = [e for e in events if isinstance(e, Branch)]
    steps = {(e.branch_id, e.t): e for e in events if isinstance(e, Step)}
    assert steps[(branch.branch_id, branch.tau)].action == steps[("b0", branch.tau)].action
    outcome = {e.branch_id: e for e in events if isinstance(e, Outcome)}
    assert outcome[branch.branch_id].success, (
        "the blamed move was solvable, so the branch still succeeds"
    )
    kept, _ = _fold(tok, events, rehearsal_fraction=0.0)
    assert [s.kind for s in kept] == ["cf"]
    dropped, m = _fold(tok, events, rehearsal_fraction=0.0, cf_drop_repeated_action=True)
    assert dropped == [] and m.stats.skipped_repeated_action == 1


async def test_cf_from_a_failed_branch_follows_cf_only_successful(tok: HFChatTokenizer) -> None:
    """A branch that ends without success gives no cf sample by default, exactly one when
    configured."""
    events, _ = await _explore(tok, fail_branch=True)
    (branch,) = [e for e in events if isinstance(e, Branch)]
    outcome = {e.branch_id: e for e in events if isinstance(e, Outcome)}
    assert not outcome[branch.branch_id].success
    default, _ = _fold(tok, events, rehearsal_fraction=0.0)
    assert default == []
    kept, _ = _fold(tok, events, rehearsal_fraction=0.0, cf_only_successful=False)
    assert [s.kind for s in kept] == ["cf"]
