"""Synthetic training samples shaped like agent steps, for ``bench/learner.py`` (not a benchmark
area)."""

from __future__ import annotations

import random

from leafe.protocol.samples import ChatMessage, Sample

__all__ = ["MAX_COMPLETION", "MAX_PROMPT", "SHARED_PREFIX", "agent_samples"]

MAX_PROMPT, MAX_COMPLETION = 600, 40
"""Longest prompt and completion (tokens) of a generated sample."""


SHARED_PREFIX = 144
"""Prompt tokens every sample starts with: the system prompt and task header of the effect-hard GRPO
round 1 samples (23,880 one-action samples of a 244-token mean prompt)."""


def agent_samples(
    n: int,
    vocab: int,
    seed: int = 0,
    *,
    prompt: tuple[int, int] = (150, MAX_PROMPT),
    shared: int = 0,
) -> list[Sample]:
    """Variable-length samples shaped like agent steps (long history prompt, short action); prompts
    of ``prompt`` tokens (inclusive range; ``--smoke`` uses short ones), the first ``shared`` of
    them the same in every sample (an agent's system prompt; at most the shortest prompt - 1)."""
    r = random.Random(seed)
    if shared >= prompt[0]:
        raise ValueError(
            f"shared prefix {shared} must be shorter than the shortest prompt {prompt[0]}"
        )
    head = [r.randrange(2, vocab) for _ in range(shared)]
    out = []
    for i in range(n):
        p, c = r.randint(*prompt), r.randint(5, MAX_COMPLETION)
        out.append(
            Sample(
                sample_id=f"bench.{i}",
                run_id="bench",
                kind="cf" if i % 3 else "reh",
                materializer="bench/1",
                env="bench",
                task_id="t",
                episode_id=f"e{i}",
                messages=[
                    ChatMessage(role="user", content="."),
                    ChatMessage(role="assistant", content="."),
                ],
                target_turn=1,
                prompt_ids=[*head, *(r.randrange(2, vocab) for _ in range(p - shared))],
                completion_ids=[r.randrange(2, vocab) for _ in range(c)],
                policy_version="default",
            )
        )
    return out
