"""The reflection prompt: the same policy sees its history and names the faulty step tau and a fix e.

Action prompts are ``protocol.prompt.render_messages`` (shared with the materializers, so the replayer can
rebuild them). The reflection prompt reuses that rendering of the task and history (same step numbers, so
tau means the same thing in both) and replaces the closing question with the reflection request and its
answer format, which :func:`actors.parsing.parse_reflection` reads. Reflections never enter training
targets, so this text may change freely; bump :data:`REFLECTION_FORMAT` when it does.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.events import ReflectionTrigger
from protocol.prompt import HistoryEntry, render_messages
from protocol.samples import ChatMessage

__all__ = ["REFLECTION_FORMAT", "REFLECTION_QUESTION", "render_reflection_messages"]

REFLECTION_FORMAT = "leafe-reflect-v1"
_ACTION_QUESTION = "Your next action?"
REFLECTION_QUESTION = (
    "Which step's action was the mistake, and what should have been done instead at that step?"
)
"""A line every reflection prompt contains (scripted test engines tell reflection requests by it)."""

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
            "<step>N</step><experience>what went wrong and what to do instead, in one or two sentences"
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
    """Messages asking the policy to reflect on ``history`` (>= 1 step), ending in ``observation``."""
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
