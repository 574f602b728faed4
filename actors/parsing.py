"""Parsing the policy's completions: actions (lenient, but exact about what was accepted) and
reflections.

Small models rarely follow a format (measured: SmolLM2-135M mostly answers in prose that names a
move), so an action is looked for in this order, and :class:`ParsedAction` says which rule found it:

1. ``tag``: the content of the first ``<action>...</action>`` (a missing closing tag is fine: it is
   a stop string), when it is a valid action up to case, spacing and trailing punctuation, or when
   the valid actions are unknown;
2. ``tag_mention``: the first valid action mentioned inside that tag;
3. ``mention``: the first valid action mentioned anywhere (whole words; at one position the
   longest);
4. with the valid actions unknown: ``fence`` (the first fenced code block) or ``raw`` (the whole
   text).

A reasoning block ``<think>...</think>`` (the self-reflection answer format of the Early Experience
baseline, ``leafe.protocol.answers``: ``<think>why</think><action>up</action>``) is removed before
these rules, so nothing mentioned while reasoning is taken for the action; an unclosed one runs to
the end of the text.

A reflection answers ``<step>N</step><experience>...</experience>``; fallbacks (``step N``, an
untagged experience) are accepted and flagged, tau out of range is clamped and flagged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import msgspec

from leafe.protocol.reflection import ANSWER_TAG, format_reflection

__all__ = [
    "ActionMethod",
    "ParsedAction",
    "ParsedReflection",
    "format_reflection",
    "invalid_action_feedback",
    "parse_action",
    "parse_reflection",
]

ActionMethod = Literal["tag", "tag_mention", "mention", "fence", "raw", "none"]

_TAG = re.compile(r"<action>(.*?)(?:</action>|$)", re.IGNORECASE | re.DOTALL)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.IGNORECASE | re.DOTALL)
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|$)", re.DOTALL)
_STEP_TAG = re.compile(r"<step>\s*(-?\d+)\s*(?:</step>|$)", re.IGNORECASE)
_STEP_WORD = re.compile(r"\bstep\s*(?:#|no\.?|number)?\s*:?\s*(-?\d+)", re.IGNORECASE)
_INT = re.compile(r"(?<![\w.])-?\d+(?![\w.])")
_EXP_TAG = re.compile(r"<experience>(.*?)(?:</experience>|$)", re.IGNORECASE | re.DOTALL)
_ANY_TAG = ANSWER_TAG
_EXP_PREFIX = re.compile(r"^\s*(?:experience|lesson)\s*:\s*", re.IGNORECASE)
_TRAILING = " \t\n.!,;:'\"`"


class ParsedAction(msgspec.Struct, frozen=True, kw_only=True):
    """What was accepted from a completion."""

    action: str | None
    """Canonical action (the env's own spelling when valid actions are known); ``None``: nothing."""
    method: ActionMethod
    """Which rule found it (``none`` when nothing was found)."""
    reason: str = ""
    """Why nothing was accepted (empty when ``action`` is set)."""


class ParsedReflection(msgspec.Struct, frozen=True, kw_only=True):
    """A reflection's tau and experience e, with notes on how they were obtained."""

    tau: int
    """Faulty step, clamped to ``0..at_t-1`` (``at_t-1`` when missing)."""
    experience: str
    """Experience e, whitespace-normalised; empty when none was found."""
    parse_ok: bool
    """Both parts came tagged and tau was in range."""
    flags: list[str]
    """``tau_untagged``, ``tau_guessed``, ``tau_missing``, ``tau_clamped``, ``experience_untagged``,
    ``experience_missing``, ``experience_truncated``."""


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).strip(_TRAILING)


def _first_mention(text: str, valid: Sequence[str]) -> str | None:
    hay = " ".join(text.lower().split())
    best: tuple[int, int, str] | None = None
    for action in valid:
        needle = _norm(action)
        if not needle:
            continue
        start = hay.find(needle)
        while start != -1:
            end = start + len(needle)
            left_ok = start == 0 or not hay[start - 1].isalnum()
            right_ok = end == len(hay) or not hay[end].isalnum()
            if left_ok and right_ok:
                key = (start, -len(needle), action)
                if best is None or key[:2] < best[:2]:
                    best = key
                break
            start = hay.find(needle, start + 1)
    return None if best is None else best[2]


def parse_action(text: str, valid_actions: Sequence[str] | None) -> ParsedAction:
    """Accept one action from ``text`` (see the module docstring for the rules, in order)."""
    text = _THINK.sub(" ", text) if "<think>" in text.lower() else text
    tag = _TAG.search(text)
    tagged = tag.group(1).strip() if tag else ""
    if valid_actions is not None:
        by_norm = {_norm(a): a for a in valid_actions}
        if tagged and _norm(tagged) in by_norm:
            return ParsedAction(action=by_norm[_norm(tagged)], method="tag")
        if tagged:
            found = _first_mention(tagged, valid_actions)
            if found is not None:
                return ParsedAction(action=found, method="tag_mention")
        found = _first_mention(text, valid_actions)
        if found is not None:
            return ParsedAction(action=found, method="mention")
        shown = " ".join(text.split())[:60]
        why = f"no valid action in {shown!r}" if text.strip() else "empty completion"
        return ParsedAction(action=None, method="none", reason=why)
    if tagged:
        return ParsedAction(action=tagged, method="tag")
    fence = _FENCE.search(text)
    if fence and fence.group(1).strip():
        return ParsedAction(action=fence.group(1).rstrip(), method="fence")
    if text.strip():
        return ParsedAction(action=text.strip(), method="raw")
    return ParsedAction(action=None, method="none", reason="empty completion")


def invalid_action_feedback(
    parsed: ParsedAction, valid_actions: Sequence[str] | None, max_shown: int = 20
) -> str:
    """Feedback for an unparseable completion: ``invalid action: <why>; valid actions: ...``."""
    text = f"invalid action: {parsed.reason or 'no action found'}"
    if valid_actions:
        shown = ", ".join(valid_actions[:max_shown])
        more = (
            f" (+{len(valid_actions) - max_shown} more)" if len(valid_actions) > max_shown else ""
        )
        text += f"; valid actions: {shown}{more}"
    return text


def _parse_tau(text: str, at_t: int, flags: list[str]) -> tuple[int, bool]:
    m = _STEP_TAG.search(text)
    if m is None:
        m = _STEP_WORD.search(text)
        if m is not None:
            flags.append("tau_untagged")
    if m is None:
        m = _INT.search(_EXP_TAG.sub(" ", text))
        if m is not None:
            flags.append("tau_guessed")
    if m is None:
        flags.append("tau_missing")
        return at_t - 1, False
    tau = int(m.group(1) if m.groups() else m.group(0))
    if not 0 <= tau < at_t:
        flags.append("tau_clamped")
        return min(max(tau, 0), at_t - 1), True
    return tau, True


def _parse_experience(text: str, max_chars: int, flags: list[str]) -> str:
    m = _EXP_TAG.search(text)
    exp = m.group(1) if m else ""
    if not exp.strip():
        rest = _ANY_TAG.sub(" ", _STEP_TAG.sub(" ", text))
        exp = _EXP_PREFIX.sub("", rest.strip())
        if exp.strip():
            flags.append("experience_untagged")
    exp = " ".join(_ANY_TAG.sub(" ", exp).split())
    if not exp:
        flags.append("experience_missing")
        return ""
    if len(exp) > max_chars:
        flags.append("experience_truncated")
        exp = exp[: max_chars - 3].rstrip() + "..."
    return exp


def parse_reflection(text: str, at_t: int, *, max_experience_chars: int = 400) -> ParsedReflection:
    """Parse ``<step>N</step><experience>...</experience>`` about a history of ``at_t`` >= 1
    steps."""
    if at_t < 1:
        raise ValueError(f"at_t = {at_t}: a reflection needs at least one step to blame")
    flags: list[str] = []
    tau, _ = _parse_tau(text, at_t, flags)
    exp = _parse_experience(text, max_experience_chars, flags)
    bad = {"tau_untagged", "tau_guessed", "tau_missing", "tau_clamped", "experience_untagged"}
    ok = not bad.intersection(flags) and "experience_missing" not in flags
    return ParsedReflection(tau=tau, experience=exp, parse_ok=ok, flags=flags)
