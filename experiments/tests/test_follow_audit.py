"""The follow audit (``experiments/paper/follow_audit.py``) on a real explore log of scripted
policies.

The real explorer plays real Sokoban rooms with oracle reflections; the log goes to a ``.leafelog``
file. Audited with a scripted engine: a policy that does what e says must pass the gate (the named
move in every answer with e, rarely without, and the placebo's move with the placebo), a policy that
ignores e must not; the prompts of each condition are exactly the cf rendering with, without or with
another e.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from experiments.paper.follow_audit import audit_items, run_audit, summarize, write_report
from leafe.actors.config import ExplorerConfig
from leafe.actors.engine import SamplingParams
from leafe.actors.fakes import ByteChatTokenizer, ScriptedEngine
from leafe.protocol.events import Branch, Step
from leafe.services.eventlog.fileformat import write_events
from tests.support.sokoban_episodes import MOVES, explore, sokoban_env, worse_move

pytestmark = pytest.mark.anyio
TOK = ByteChatTokenizer()
NAMED = re.compile(r"move (up|down|left|right) instead")


def _detour(kind: str, prompt: str, env) -> str:  # type: ignore[no-untyped-def]
    snap = env.snapshot()
    return f"<action>{worse_move(snap.room, snap.player, snap.boxes) or 'up'}</action>"


async def _log(tmp_path: Path) -> Path:
    """Oracle-reflection trees of a policy that always takes a detour, on the first rooms that have
    one."""
    env = sokoban_env()
    rooms = [
        t
        for t in env.tasks("train")[:60]
        if worse_move(env.room(t).room, env.room(t).room.player, env.room(t).room.boxes)
    ][:4]
    config = ExplorerConfig.for_env(
        "sokoban", {"k": 0, "max_depth": 1, "horizon": 4, "reflection_source": "oracle"}
    )
    events = []
    for i, task in enumerate(rooms):
        got, _ = await explore(
            TOK, env, lambda k, p: _detour(k, p, env), task_id=task, name=f"t{i}", config=config
        )
        events += got
    path = tmp_path / "explore.leafelog"
    write_events(path, events, run_id="r1")
    return path


def _follower(kind: str, prompt: str) -> str:
    """Takes the move the lesson names; without a lesson always "up"."""
    named = NAMED.findall(prompt)
    return f"<action>{named[-1] if named else 'up'}</action>"


async def test_a_policy_that_follows_e_passes_and_one_that_ignores_it_fails(tmp_path: Path) -> None:
    """Follow rate 100% with e (the gate passes) and the placebo's move with the placebo for the
    follower; the e-blind policy picks the same move whatever the prompt says, so the gate fails."""
    log = await _log(tmp_path)
    params = SamplingParams(max_new_tokens=16, stop=["</action>"])
    items = audit_items(log, TOK, MOVES)
    assert items and all({"oracle", "none", "placebo"} <= set(it.prompts) for it in items)
    await run_audit(
        ScriptedEngine(script=_follower),
        items,
        samples=4,
        params=params,
        response_prefix="<action>",
        actions=MOVES,
    )
    good = summarize(items, gate=0.7)
    assert (
        good["named_with_oracle_e"]["share"] == 1.0
        and good["placebo_move_with_placebo_e"]["share"] == 1.0
    )
    assert good["gate"]["passed"] and good["named_with_placebo_e"]["share"] == 0.0
    write_report(good, tmp_path / "audit", title="follower")
    assert (
        "PASSED" in (tmp_path / "audit.md").read_text()
        and (tmp_path / "audit.png").stat().st_size > 0
    )

    blind = audit_items(log, TOK, MOVES)
    await run_audit(
        ScriptedEngine(default_action="<action>up</action>"),
        blind,
        samples=4,
        params=params,
        response_prefix="<action>",
        actions=MOVES,
    )
    bad = summarize(blind, gate=0.7)
    assert not bad["gate"]["passed"]
    assert bad["named_with_oracle_e"]["share"] == bad["named_without_e"]["share"]


async def test_prompts_are_the_cf_rendering_with_without_and_with_another_e(tmp_path: Path) -> None:
    """``none`` is exactly the branch's first prompt minus e, ``oracle`` is that first prompt, and
    the placebo differs from it only in the named move."""
    log = await _log(tmp_path)
    items = audit_items(log, TOK, MOVES)
    from leafe.services.eventlog.fileformat import read_events

    events = list(read_events(log))
    firsts = {
        (b.episode_id, b.experience): next(
            s
            for s in events
            if isinstance(s, Step) and s.episode_id == b.episode_id and s.branch_id == b.branch_id
        )
        for b in events
        if isinstance(b, Branch)
    }
    assert firsts
    for it in items:
        text = TOK.decode(it.prompts["oracle"])
        match = [k for k in firsts if k[0] == it.episode_id and k[1] in text]
        assert match, "the oracle condition is the prompt a branch got"
        assert NAMED.findall(text)[-1] == it.named
        assert NAMED.findall(TOK.decode(it.prompts["placebo"]))[-1] == it.placebo != it.named
        assert not NAMED.findall(TOK.decode(it.prompts["none"]))
