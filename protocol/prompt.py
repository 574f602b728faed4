"""The agent's prompt format, shared by actors (who send it) and materializers (who rebuild it).

A prompt is ``[system: instructions, user: task + recent history + current observation (+
experience)]``; the assistant's completion is the action. The same function renders the prompt an
actor sent and the counterfactual input a materializer builds (the same history,
``experience=None``), so the only difference between them is e. An episode may prefill the start of
every answer (``EpisodeStarted.response_prefix``, e.g. ``<action>``): its tokens end the prompt and
the completion continues it. Each ``Step`` records ``prompt_sha256`` of the token ids the actor
sent, so a replay can prove it rebuilt exactly that prompt. Changing the rendering needs a new
``PROMPT_FORMAT``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from leafe.protocol.samples import ChatMessage

__all__ = ["PROMPT_FORMAT", "ChatTokenizer", "HistoryEntry", "prompt_sha256", "render_messages"]

PROMPT_FORMAT = "leafe-chat-v1"
_INVALID_SHOWN_CHARS = 60
_SUMMARY_CHARS = 300


class HistoryEntry(NamedTuple):
    """One past step as the agent sees it."""

    action: str | None
    """Parsed action, or ``None`` when the completion held no valid action."""
    raw_text: str
    """The completion text (shown, shortened, when the action was invalid)."""
    observation: str
    """Observation after the action."""
    feedback: str
    """Environment feedback after the action (preferred over the observation when present)."""


def _summary(entry: HistoryEntry) -> str:
    text = entry.feedback.strip() or entry.observation.strip()
    text = " ".join(text.split())
    return text if len(text) <= _SUMMARY_CHARS else text[: _SUMMARY_CHARS - 3] + "..."


def _action_repr(entry: HistoryEntry) -> str:
    if entry.action is not None:
        return entry.action
    raw = " ".join(entry.raw_text.split())[:_INVALID_SHOWN_CHARS]
    return f"(invalid: {raw!r})"


def render_messages(
    *,
    instructions: str,
    task: str,
    history: Sequence[HistoryEntry],
    observation: str,
    experience: str | None = None,
    history_window: int = 0,
) -> list[ChatMessage]:
    """Messages for the next action given the task, the history h_t and (inside a branch) experience
    e.

    ``history`` is every step before the current one; only the last ``history_window`` are shown
    (0 = all), numbered by their true step index so tau stays meaningful to the reflecting policy.
    """
    start = max(0, len(history) - history_window) if history_window > 0 else 0
    lines = [f"Task: {task.strip()}"]
    if history:
        lines.append("")
        lines.append(
            "Previous steps:" if start == 0 else f"Previous steps (last {len(history) - start}):"
        )
        for t in range(start, len(history)):
            entry = history[t]
            lines.append(f"{t}. {_action_repr(entry)} -> {_summary(entry)}")
    lines.append("")
    lines.append(f"Current observation (step {len(history)}):")
    lines.append(observation.rstrip())
    if experience:
        lines.append("")
        lines.append(f"Lesson from an earlier attempt: {experience.strip()}")
    lines.append("")
    lines.append("Your next action?")
    return [
        ChatMessage(role="system", content=instructions.strip()),
        ChatMessage(role="user", content="\n".join(lines)),
    ]


def prompt_sha256(token_ids: Sequence[int]) -> str:
    """Digest of prompt token ids, recorded in ``Step.prompt_sha256``."""
    h = hashlib.sha256()
    for tok in token_ids:
        h.update(int(tok).to_bytes(4, "little", signed=False))
    return h.hexdigest()


class ChatTokenizer(Protocol):
    """How prompts become token ids: the chat template of the served model
    (``leafe.learner.model_io``)."""

    def encode_chat(self, messages: Sequence[ChatMessage], response_prefix: str = "") -> list[int]:
        """Token ids of ``messages`` with the chat template and the generation prompt applied, then
        the tokens of ``response_prefix`` (the start of the assistant's answer, prefilled; no
        special tokens)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped)."""
        ...
