"""A real explorer on a real Sokoban room with a scripted policy, and the fold of what it published:
the fixture of the tests that pin a sample kind token for token against the requests the engine
received (``tests/unit/learner/test_counterfactual_path.py``, ``test_reflect_materializer.py``).

A scripted policy is a ``(kind, prompt) -> answer`` callable
(``leafe.actors.fakes.ScriptedEngine``); the rooms come from the ``sokoban`` env at 5x5, one box,
solutions of at most 3 pushes, 12 steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leafe.actors.config import ExplorerConfig
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ScriptedEngine
from leafe.envs.registry import make_env
from leafe.envs.sokoban.env import SokobanEnv
from leafe.envs.sokoban.expert import optimal_distance
from leafe.envs.sokoban.solver import apply_move, solve
from leafe.learner.materializers import make_materializer
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import Sample

__all__ = ["MOVES", "explore", "fold", "plan", "sokoban_env", "worse_move"]

MOVES = ("up", "down", "left", "right")


def sokoban_env() -> SokobanEnv:
    """The small rooms these tests play."""
    env = make_env("sokoban", height=5, width=5, num_boxes=1, max_solution_len=3, max_steps=12)
    assert isinstance(env, SokobanEnv)
    return env


def plan(room: Any, player: int, boxes: frozenset[int]) -> list[str]:
    """The solver's moves from a state the scripted policies only ever leave solvable."""
    moves = solve(room.with_state(player, boxes))
    assert moves is not None, "the policy only ever leaves solvable states"
    return moves


def worse_move(room: Any, player: int, boxes: frozenset[int]) -> str:
    """A move after which the room is still solvable but needs more moves ("" when there is none):
    the mistake an oracle must blame."""
    dist = optimal_distance(room, player, boxes)
    for move in MOVES:
        nxt_player, nxt_boxes, _ = apply_move(room, player, boxes, move)
        if dist < optimal_distance(room, nxt_player, nxt_boxes) < 10**6:
            return move
    return ""


async def explore(
    tok: ChatTokenizer,
    env: SokobanEnv,
    policy: Callable[[str, str], str],
    *,
    task_id: str,
    name: str,
    config: ExplorerConfig,
) -> tuple[list[EpisodeEvent], ScriptedEngine]:
    """One episode of the real explorer on ``task_id`` with ``policy``: its events and the engine
    (whose ``calls`` are the exact requests)."""
    engine = ScriptedEngine(script=policy, tokenizer=tok)
    sink = ListSink()
    spec = EpisodeSpec(
        run_id="r1",
        episode_id=f"{name}.a1",
        actor_id="actor-0",
        task_key=name,
        env="sokoban",
        task_id=task_id,
        seed=0,
    )
    await Explorer(engine=engine, tokenizer=tok, env=env, config=config, sink=sink, spec=spec).run()
    return sink.events, engine


def fold(
    tok: ChatTokenizer, name: str, events: list[EpisodeEvent], **options: Any
) -> tuple[list[Sample], Any]:
    """Every sample the ``name`` materializer gives for ``events`` (closing what is left open), and
    it."""
    m = make_materializer(name, tok, **options)
    samples = [s for e in events for s in m.apply(e)]
    return samples + m.close_all(), m
