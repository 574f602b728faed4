"""The explorer's reflection step: on a branch's history, name (tau, e), by the policy or the
oracle.

With ``reflection_source = "policy"`` the same policy is prompted with
``render_reflection_messages`` (the history, the trigger) and its answer is parsed by
``parse_reflection``; with ``"oracle"`` the environment's oracle names them (``actors/oracle.py``).
With ``oracle_labels`` the policy reflects and the oracle's verdict on the same history comes back
beside it as a label (``Reflection.oracle_tau``, ``oracle_experience``). The explorer
(``actors/explorer.py``) decides when to reflect, emits the ``Reflection`` event and queues the
branch request; this module only produces the verdict.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from leafe.actors.config import ExplorerConfig
from leafe.actors.engine import Completion, SamplingParams
from leafe.actors.oracle import oracle_parsed
from leafe.actors.parsing import ParsedReflection, parse_reflection
from leafe.envs.base import Env
from leafe.envs.registry import reflection_oracle
from leafe.protocol.events import ReflectionTrigger
from leafe.protocol.prompt import ChatTokenizer, HistoryEntry, prompt_sha256
from leafe.protocol.reflection import render_reflection_messages

__all__ = ["Reflector", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """One reflection's result, as the ``Reflection`` event records it."""

    parsed: ParsedReflection
    """tau and e (clamped, cut), parse_ok and flags."""
    raw_text: str
    """The policy's completion text, or the oracle's e as it wrote it."""
    token_ids: list[int]
    """The completion's exact token ids (empty for an oracle reflection)."""
    prompt_sha256: str
    """The reflection prompt's hash (empty for an oracle reflection)."""
    label: ParsedReflection | None
    """The oracle's verdict beside a policy reflection (``oracle_labels``), else None."""
    oracle_action: str = ""
    """The action the oracle's verdict names as the fix (either source), empty when it names
    none."""
    prompt_tokens: int = 0
    """The reflection prompt's length (0 for an oracle reflection)."""
    cached_tokens: int | None = None
    """Prompt tokens the engine served from its prefix cache (``None`` for an oracle reflection)."""


class Reflector:
    """Names (tau, e) on a history: the policy through ``generate``, or the environment's oracle."""

    def __init__(
        self,
        *,
        env: Env,
        tokenizer: ChatTokenizer,
        config: ExplorerConfig,
        task_id: str,
        generate: Callable[[list[int], SamplingParams, bool], Awaitable[Completion]],
        params: Callable[[], SamplingParams],
        run_env: Callable[..., Awaitable[Any]],
    ) -> None:
        """``generate`` and ``params`` are the explorer's (its seeds count every call), ``run_env``
        runs an environment call the way the explorer does (in a thread or not)."""
        self.env = env
        self.tokenizer = tokenizer
        self.cfg = config
        self.task_id = task_id
        self._generate = generate
        self._params = params
        self._run_env = run_env
        wants_oracle = config.reflection_source == "oracle" or config.oracle_labels
        self.oracle = reflection_oracle(env) if wants_oracle else None

    async def reflect(
        self, task: str, history: list[HistoryEntry], trigger: ReflectionTrigger
    ) -> Verdict:
        """The verdict on ``history`` (at least one step)."""
        at_t = len(history)
        label, oracle_raw, fix = (
            await self._oracle_verdict(history) if self.oracle else (None, "", "")
        )
        if self.cfg.reflection_source == "oracle":
            assert label is not None
            # The verdict is the reflection itself, not a label beside it.
            return Verdict(
                parsed=label,
                raw_text=oracle_raw,
                token_ids=[],
                prompt_sha256="",
                label=None,
                oracle_action=fix,
            )
        messages = render_reflection_messages(
            instructions=self.env.instructions,
            task=task,
            history=history,
            observation=history[-1].observation,
            trigger=trigger,
            history_window=self.cfg.reflect_history_window,
        )
        ids = self.tokenizer.encode_chat(messages)
        completion = await self._generate(ids, self._params(), False)
        parsed = parse_reflection(
            completion.text, at_t, max_experience_chars=self.cfg.max_experience_chars
        )
        return Verdict(
            parsed=parsed,
            raw_text=completion.text,
            token_ids=list(completion.output_ids),
            prompt_sha256=prompt_sha256(ids),
            label=label,
            oracle_action=fix,
            prompt_tokens=len(ids),
            cached_tokens=completion.cached_tokens,
        )

    async def _oracle_verdict(
        self, history: list[HistoryEntry]
    ) -> tuple[ParsedReflection, str, str]:
        """The environment oracle's tau and e on ``history`` in the explorer's terms (clamped, cut),
        its e as the oracle wrote it (an oracle-source Reflection's ``raw_text``), and the action it
        names."""
        assert self.oracle is not None
        verdict = await self._run_env(self.oracle.oracle_reflection, self.task_id, history)
        parsed = oracle_parsed(verdict, len(history), self.cfg.max_experience_chars)
        return parsed, verdict.experience, verdict.action if parsed.experience else ""
