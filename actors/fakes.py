"""Deterministic stand-ins for tests and benchmarks: a scripted engine, a byte tokenizer, a corridor
env.

They implement the real protocols (``leafe.actors.engine.Engine``,
``leafe.protocol.prompt.ChatTokenizer``, ``leafe.envs.base.Env``), so the explorer, rollouts and the
actor service run on them unchanged. Nothing here is used in production; integration tests use the
real engine, tokenizer and environments instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from leafe.actors.engine import Completion, SamplingParams
from leafe.envs.base import EnvError, Reset, Transition
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.reflection import REFLECTION_QUESTION
from leafe.protocol.samples import ChatMessage

__all__ = ["ByteChatTokenizer", "CorridorEnv", "EngineCall", "ScriptedEngine"]

CallKind = Literal["action", "reflection"]


class ByteChatTokenizer:
    """A ``ChatTokenizer`` whose ids are the UTF-8 bytes of a simple chat template."""

    def encode_chat(self, messages: Sequence[ChatMessage], response_prefix: str = "") -> list[int]:
        """Bytes of ``<|role|>content\\n`` per message, then ``<|assistant|>``."""
        text = (
            "".join(f"<|{m.role}|>{m.content}\n" for m in messages)
            + "<|assistant|>"
            + response_prefix
        )
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of byte ids (invalid UTF-8 replaced)."""
        return bytes(token_ids).decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One ``generate`` request the scripted engine answered."""

    kind: CallKind
    input_ids: list[int]
    params: SamplingParams
    text: str


Script = Callable[[CallKind, str], str]


class ScriptedEngine:
    """An ``Engine`` answering from scripts: action and reflection texts in order, then defaults.

    ``script`` (kind, prompt text) -> completion text replaces the lists when given. Every request
    is recorded in ``calls`` (exact input ids). ``latency_s`` sleeps per request (benchmarks).
    Prompts are decoded with ``tokenizer`` (default: bytes) to tell reflection requests; output ids
    are UTF-8 bytes. ``cached_tokens`` is what an unbounded prefix cache of every earlier prompt
    would serve (the longest prefix of the prompt some earlier prompt began with, its last token
    always computed, as SGLang does).
    """

    def __init__(
        self,
        *,
        actions: Iterable[str] = (),
        reflections: Iterable[str] = (),
        default_action: str = "<action>right</action>",
        default_reflection: str = "<step>0</step><experience>go right, not left</experience>",
        script: Script | None = None,
        version: str = "v0",
        latency_s: float = 0.0,
        record: bool = True,
        tokenizer: ChatTokenizer | None = None,
    ) -> None:
        self._actions = iter(list(actions))
        self._reflections = iter(list(reflections))
        self.default_action = default_action
        self.default_reflection = default_reflection
        self.script = script
        self.version = version
        self.latency_s = latency_s
        self.record = record
        self.calls: list[EngineCall] = []
        self._tok: ChatTokenizer = tokenizer or ByteChatTokenizer()
        self._prefixes: set[int] = set()
        """Hashes of every prefix of every prompt seen (chained, so each is one hash per token)."""

    def _cached(self, input_ids: Sequence[int]) -> int:
        cached, h, hit = 0, 0, True
        for i, token in enumerate(input_ids[:-1]):
            h = hash((h, token))
            if hit and h in self._prefixes:
                cached = i + 1
            else:
                hit = False
                self._prefixes.add(h)
        self._prefixes.add(hash((h, input_ids[-1])) if input_ids else h)
        return cached

    def _answer(self, kind: CallKind, prompt: str) -> str:
        if self.script is not None:
            return self.script(kind, prompt)
        if kind == "reflection":
            return next(self._reflections, self.default_reflection)
        return next(self._actions, self.default_action)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
    ) -> list[Completion]:
        """``n`` copies of the scripted answer; the output ids are its UTF-8 bytes."""
        prompt = self._tok.decode(input_ids)
        kind: CallKind = "reflection" if REFLECTION_QUESTION in prompt else "action"
        text = self._answer(kind, prompt)
        if self.record:
            self.calls.append(EngineCall(kind, list(input_ids), params, text))
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ids = list(text.encode("utf-8"))
        logprobs = [-0.5] * len(ids) if return_logprob else None
        completion = Completion(
            text=text,
            output_ids=ids,
            logprobs=logprobs,
            weight_version=self.version,
            prompt_tokens=len(input_ids),
            cached_tokens=self._cached(input_ids),
        )
        return [completion] * n

    async def weight_version(self) -> str:
        """The scripted version."""
        return self.version


class CorridorEnv:
    """A 1-D corridor: start at 1, a pit at 0 (episode over, failed), the goal at the far end.

    Task ``corridor/<split>/<i>`` has length ``4 + i % 3``. Actions ``left``, ``right``, ``wait``;
    anything else is invalid (feedback, nothing changes). ``supports_snapshot`` as constructed;
    ``broken_after`` makes the n-th+1 env step raise ``EnvError`` (a crashing backend).
    """

    name = "corridor"
    instructions = (
        "You walk a corridor. Reach the goal. Answer with <action>left|right|wait</action>."
    )

    def __init__(self, *, supports_snapshot: bool = True, broken_after: int | None = None) -> None:
        self.supports_snapshot = supports_snapshot
        self.broken_after = broken_after
        self.env_steps = 0
        self.resets = 0
        self.closed = False
        self._length = 0
        self._pos = 0
        self._done = False

    def tasks(self, split: str) -> list[str]:
        """Ten tasks per split."""
        return [f"corridor/{split}/{i:05d}" for i in range(10)]

    def reset(self, task_id: str) -> Reset:
        """Start ``task_id``."""
        parts = task_id.split("/")
        if len(parts) != 3 or parts[0] != "corridor" or not parts[2].isdigit():
            raise EnvError(f"unknown corridor task id {task_id!r}")
        self.resets += 1
        self._length, self._pos, self._done = 4 + int(parts[2]) % 3, 1, False
        return Reset(task=f"Walk to position {self._length - 1}.", observation=self._obs())

    def _obs(self) -> str:
        return f"You are at {self._pos}; the goal is at {self._length - 1}."

    def step(self, action: str) -> Transition:
        """Apply one action."""
        if self.broken_after is not None and self.env_steps >= self.broken_after:
            raise EnvError(f"corridor backend crashed after {self.env_steps} steps")
        self.env_steps += 1
        if self._done:
            return Transition(
                observation=self._obs(), done=True, feedback="the episode is over", valid=False
            )
        move = {"left": -1, "right": 1, "wait": 0}.get(action.strip().lower())
        if move is None:
            return Transition(
                observation=self._obs(), feedback=f"invalid action: {action!r}", valid=False
            )
        self._pos += move
        goal = self._length - 1
        if self._pos <= 0:
            self._done = True
            return Transition(observation=self._obs(), done=True, feedback="you fell into the pit")
        success = self._pos >= goal
        self._done = success
        return Transition(
            observation=self._obs(),
            reward=1.0 if success else 0.0,
            done=success,
            success=success,
            score=self._pos / goal,
        )

    def valid_actions(self) -> list[str] | None:
        """``left``, ``right``, ``wait``."""
        return ["left", "right", "wait"]

    def snapshot(self) -> tuple[int, int, bool]:
        """The state as a tuple."""
        if not self.supports_snapshot:
            raise EnvError("this corridor does not support snapshots")
        return (self._length, self._pos, self._done)

    def restore(self, snapshot: tuple[int, int, bool]) -> str:
        """Restore a snapshot; returns its observation."""
        self._length, self._pos, self._done = snapshot
        return self._obs()

    def close(self) -> None:
        """Mark closed."""
        self.closed = True
