"""Synthetic request streams for ``bench/inference.py`` (not a benchmark area): chat prompts, 16
clients' agent-shaped requests (unrelated, or episodes whose prompts grow by a step), and the ideal
prefix share."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["WORDS", "agent_requests", "chat_prompt", "ideal_prefix_share"]

WORDS = "the box is left of the target and the player stands below it near a wall".split()


def chat_prompt(tok: Any, i: int, words: int) -> list[int]:
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    msgs = [{"role": "user", "content": f"Room {i}: {text}. Which move next?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def _words(rng: random.Random, n: int) -> str:
    """``n`` words drawn by ``rng`` (one generator per text: a fresh ``Random(seed)`` per word would
    repeat one word, and texts of different seeds would often coincide)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def agent_requests(tok: Any, count: int, *, episodes: bool) -> list[list[tuple[list[int], int]]]:
    """16 clients' request lists, prompts of 200-600 tokens and 5-20 new tokens each. ``episodes``:
    each client is one actor episode whose prompt grows by a step line per request (shared prefixes,
    as render_messages produces); otherwise every prompt is unrelated."""
    rng = random.Random(0)
    clients: list[list[tuple[list[int], int]]] = [[] for _ in range(16)]
    for i in range(count):
        c = i % 16
        if episodes:
            step = len(clients[c])
            task = _words(random.Random(c), 140)
            history = "\n".join(
                f"{t}. {rng.choice(['up', 'down', 'left', 'right'])} -> "
                + _words(random.Random(c * 100 + t), 45)
                for t in range(step * 3)
            )
            msgs = [
                {
                    "role": "user",
                    "content": f"Task: {task}\nPrevious steps:\n{history}\nYour next action?",
                }
            ]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)][:600]
        else:
            ids = chat_prompt(tok, 1000 + i, 400)[: rng.randint(200, 600)]
        clients[c].append((ids, rng.randint(5, 20)))
    return clients


def ideal_prefix_share(prompts: list[list[int]], counted: list[bool] | None = None) -> float:
    """Share of prompt tokens a cache holding every earlier prompt could serve (each prompt's last
    token excluded, as the engine must run it): the ceiling of ``prefix_cache_share``. A plain token
    trie, so the figure does not depend on the engine's code. ``counted``: the share over the marked
    prompts only, every earlier prompt (marked or not) still in the cache."""
    root: dict[int, Any] = {}
    served = total = 0
    for i, ids in enumerate(prompts):
        node, depth = root, 0
        while depth < len(ids) - 1 and ids[depth] in node:
            node, depth = node[ids[depth]], depth + 1
        if counted is None or counted[i]:
            served, total = served + depth, total + len(ids)
        node = root
        for t in ids:
            node = node.setdefault(t, {})
    return round(served / total, 3) if total else 0.0
