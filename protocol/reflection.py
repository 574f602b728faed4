"""The reflection prompt and answer format: the policy sees its history and names the faulty step
tau and a fix e.

Action prompts are ``leafe.protocol.prompt.render_messages`` (shared with the materializers, so the
replayer can rebuild them). The reflection prompt reuses that rendering of the task and history
(same step numbers, so tau means the same thing in both) and replaces the closing question with the
reflection request and its answer format, :func:`format_reflection`, which
:func:`leafe.actors.parsing.parse_reflection` reads back.

It lives in ``protocol`` because both sides use it: the explorer sends it (``actors/explorer.py``)
and the ``reflect`` materializer (``learner/materializers/reflect.py``, the reflection warm start)
rebuilds it to train oracle-labelled reflections; ``Reflection.prompt_sha256`` lets the replay prove
the rebuild. Changing the text changes those training prompts: bump :data:`REFLECTION_FORMAT` when
it does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from leafe.protocol.events import ReflectionTrigger
from leafe.protocol.prompt import HistoryEntry, render_messages
from leafe.protocol.samples import ChatMessage

__all__ = [
    "ANSWER_TAG",
    "REFLECTION_FORMAT",
    "REFLECTION_QUESTION",
    "format_reflection",
    "render_reflection_messages",
]

REFLECTION_FORMAT = "leafe-reflect-v1"
ANSWER_TAG = re.compile(r"</?\s*(?:step|experience|action)\s*>", re.IGNORECASE)
"""A tag of the answer formats; the reflection parser removes them from e, so e may hold none."""
_ACTION_QUESTION = "Your next action?"
REFLECTION_QUESTION = (
    "Which step's action was the mistake, and what should have been done instead at that step?"
)
"""A line every reflection prompt contains (scripted test engines tell reflection requests by
it)."""

_SITUATION: dict[str, str] = {
    "failure": "The attempt above failed: the episode ended without solving the task.",
    "horizon": "The attempt above used up its step limit without solving the task.",
    "periodic": "Pause and review the attempt above before going on.",
}


def _question(trigger: ReflectionTrigger, at_t: int) -> str:
    return "\n".join(
        [
            _SITUATION[trigger],
            REFLECTION_QUESTION,
            "Answer in exactly this format and nothing else:",
            "<step>N</step><experience>what went wrong and what to do instead, in one or two "
            "sentences"
            "</experience>",
            f"where N is the number of the faulty step, from 0 to {at_t - 1}.",
        ]
    )


def render_reflection_messages(
    *,
    instructions: str,
    task: str,
    history: Sequence[HistoryEntry],
    observation: str,
    trigger: ReflectionTrigger,
    history_window: int = 0,
) -> list[ChatMessage]:
    """Messages asking the policy to reflect on ``history`` (>= 1 step), ending in
    ``observation``."""
    if not history:
        raise ValueError("a reflection needs a history of at least one step")
    messages = render_messages(
        instructions=instructions,
        task=task,
        history=history,
        observation=observation,
        experience=None,
        history_window=history_window,
    )
    user = messages[-1].content
    if user.endswith(_ACTION_QUESTION):
        user = user[: -len(_ACTION_QUESTION)].rstrip()
    user = f"{user}\n\n{_question(trigger, len(history))}"
    return [*messages[:-1], ChatMessage(role="user", content=user)]


def format_reflection(tau: int, experience: str) -> str:
    """The answer the reflection prompt asks for:
    ``<step>{tau}</step><experience>{e}</experience>``.

    ``leafe.actors.parsing.parse_reflection`` reads it back to the same tau (for ``0 <= tau <
    at_t``) and e (for an e that is already whitespace-normalised, tag-free and within
    ``max_experience_chars``, as the explorer records it); anything else is a ``ValueError`` naming
    it, never a silently different label.
    """
    if tau < 0:
        raise ValueError(f"tau = {tau}: a step number is >= 0")
    if experience != " ".join(experience.split()) or not experience:
        raise ValueError(
            f"experience {experience[:60]!r}: must be non-empty, whitespace-normalised text"
        )
    if ANSWER_TAG.search(experience):
        raise ValueError(
            f"experience {experience[:60]!r}: must hold no tags (the parser strips them)"
        )
    return f"<step>{tau}</step><experience>{experience}</experience>"
