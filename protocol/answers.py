"""How an answer written by someone other than the engine becomes exact completion token ids.

Demonstrations (``actors/demo.py``) and the Early Experience samples
(``learner/materializers/early.py``) train on answers that no engine generated: an expert action, a
predicted observation, a reflection followed by the expert action. Their token ids must be the ids
the served model would produce after the prompt, so both sides tokenize the same way, through the
:class:`~leafe.protocol.prompt.ChatTokenizer` alone:

- :func:`answer_ids`: the ids of ``text`` after ``messages`` and ``response_prefix``: the tail of
  ``encode_chat(messages, response_prefix + text)`` after ``encode_chat(messages, response_prefix)``
  (the prefix's tokens end the prompt, exactly as an actor sends it); an error if the text's tokens
  would merge into the prompt's.
- :func:`expert_answer`: an action (a demonstration's, the move an oracle names) as that completion,
  in the ``tag`` or ``fence`` :data:`AnswerFormat`.
- :func:`end_of_turn_id`: the token the chat template ends an assistant turn with (SmolLM2:
  ``<|im_end|>``, its EOS). A real engine's completion that ends without a stop string ends with the
  EOS it sampled (SGLang keeps it in ``output_ids``), so answers that end that way get this id
  appended.

The self-reflection answer format is ``<think>why</think>`` then the action answer
(:data:`THINK_OPEN`, :data:`THINK_CLOSE`); ``leafe.actors.parsing.parse_action`` ignores what is
inside the think block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import ChatMessage

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "AnswerFormat",
    "AnswerTokenError",
    "ExpertAnswer",
    "answer_ids",
    "end_of_turn_id",
    "expert_answer",
]

AnswerFormat = Literal["tag", "fence"]
"""How an action is written as the policy's answer: ``tag`` = ``<action>A</action>``, ``fence`` = a
fenced ``python`` block (code environments)."""

THINK_OPEN = "<think>"
"""Opens the reasoning part of a self-reflection answer (prefilled as the response prefix)."""
THINK_CLOSE = "</think>"
"""Closes it; the action answer follows."""


class AnswerTokenError(ValueError):
    """The answer cannot be tokenized as a continuation of its prompt; the message names both."""


def answer_ids(
    tokenizer: ChatTokenizer, messages: Sequence[ChatMessage], response_prefix: str, text: str
) -> list[int]:
    """Token ids of ``text`` as the continuation of ``messages`` + ``response_prefix``."""
    prompt = tokenizer.encode_chat(messages, response_prefix)
    full = tokenizer.encode_chat(messages, response_prefix + text)
    if full[: len(prompt)] != prompt:
        raise AnswerTokenError(
            f"the tokens of answer {text[:60]!r} merge with the response prefix {response_prefix!r}"
        )
    return full[len(prompt) :]


def end_of_turn_id(tokenizer: ChatTokenizer) -> int:
    """The token id that ends an assistant turn in ``tokenizer``'s chat template."""
    probe = [ChatMessage(role="user", content="hi")]
    turn = "ok"
    open_turn = tokenizer.encode_chat(probe, turn)
    closed = tokenizer.encode_chat([*probe, ChatMessage(role="assistant", content=turn)])
    if len(closed) <= len(open_turn) or closed[: len(open_turn)] != open_turn:
        raise AnswerTokenError(
            "the chat template does not render an assistant turn as prompt + answer"
        )
    return closed[len(open_turn)]


class ExpertAnswer(NamedTuple):
    """An expert action written as the policy's completion, in the engine's shape."""

    text: str
    """Completion text as an engine returns it (a matched stop string cut off)."""
    token_ids: list[int]
    """Exact completion ids (stop string included; end-of-turn appended when no stop string ends
    it)."""


def expert_answer(
    action: str,
    *,
    answer_format: AnswerFormat,
    response_prefix: str,
    stop: Sequence[str],
    tokenizer: ChatTokenizer,
    messages: Sequence[ChatMessage],
    eot: int,
) -> ExpertAnswer:
    """``action`` as the completion of ``messages`` + ``response_prefix``, as an engine would return
    it: the text up to the first stop string, the ids through it (or ending in ``eot`` when none
    matched)."""
    full = (
        f"<action>{action}</action>"
        if answer_format == "tag"
        else f"```python\n{action.rstrip()}\n```"
    )
    if not full.startswith(response_prefix):
        raise ValueError(
            f"answer {full[:40]!r} does not start with the response prefix {response_prefix!r}"
        )
    completion = full[len(response_prefix) :]
    hits = sorted((completion.find(s), s) for s in stop if s and s in completion)
    if hits:
        at, matched = hits[0]
        ids = answer_ids(tokenizer, messages, response_prefix, completion[: at + len(matched)])
        return ExpertAnswer(text=completion[:at], token_ids=ids)
    ids = answer_ids(tokenizer, messages, response_prefix, completion)
    return ExpertAnswer(text=completion, token_ids=[*ids, eot])
