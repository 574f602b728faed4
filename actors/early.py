"""Early Experience (Zhang et al. 2025) on a demonstration: the policy's own alternatives at expert
states.

At expert state s_t (after the expert's step t is logged), the policy proposes K actions from the
very prompt of that step (``DemoConfig.alternatives``, temperature 1); each distinct parseable one
that is not the expert action is executed from s_t (rollback: a snapshot where the env has one, else
reset + replay) and logged as a one-step branch off the expert path ``b0``::

    Reflection(b0, at_t=t+1, tau=t, trigger="alternative", source="model" | "none")
    Rollback(b0, tau=t)  ->  Branch(b_n, parent b0, tau=t, depth 1, experience "")
    Step(b_n, t, the alternative: raw completion, exact output ids, the observation it led to)
    Outcome(b_n, steps=t+1, reason "budget" | "success" | "env_done")

The tree fold (``learner/materializers/tree.py``) requires every Branch to follow a Reflection,
which is also where self-reflection lives: with ``DemoConfig.self_reflection`` the policy is shown
both outcomes and asked why the expert action is better (:func:`render_self_reflection_messages`,
answer prefilled with ``<think>`` and stopped at ``</think>``); the text is the Reflection's
``raw_text`` (and, whitespace normalised, its ``experience``), ``source = "model"``. Without it the
Reflection is an empty marker, ``source = "none"``. The branch's Step never has e in context: its
prompt is the expert step's prompt (same ``prompt_sha256``). Unparseable proposals, the expert
action itself and repeats are not executed (counted in the ``actor.demo.finished`` log line).
Afterwards the env is put back at s_{t+1}, logged as ``Rollback(b0, tau=t+1)`` (so
``EpisodeFinished.replay_steps`` is the sum over Rollbacks, as for explore episodes;
``EpisodeFinished.reflections`` counts the Reflection events, markers included).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from leafe.actors.config import RolloutConfig
from leafe.actors.demo_config import DemoConfig
from leafe.actors.engine import Completion, Engine, EngineError, SamplingParams
from leafe.actors.episode import EpisodeRecorder, EpisodeSpec
from leafe.actors.parsing import parse_action
from leafe.envs.base import Env, RollbackResult, Transition, rollback_to
from leafe.protocol.answers import THINK_CLOSE, THINK_OPEN
from leafe.protocol.events import (
    EXPERT_VERSION,
    ROOT_BRANCH,
    Branch,
    Outcome,
    OutcomeReason,
    Reflection,
    Rollback,
    Step,
)
from leafe.protocol.prompt import ChatTokenizer, HistoryEntry, prompt_sha256, render_messages
from leafe.protocol.samples import ChatMessage

__all__ = [
    "SELF_REFLECTION_QUESTION",
    "AlternativeCounts",
    "AlternativeExplorer",
    "ExpertState",
    "render_self_reflection_messages",
]

_ACTION_QUESTION = "Your next action?"
SELF_REFLECTION_QUESTION = (
    "Explain in one or two sentences why the expert's action is better here than the other action."
)
"""A line every self-reflection prompt contains (scripted test engines tell these requests by
it)."""

RunEnv = Callable[..., Awaitable[Any]]


@dataclass(slots=True, frozen=True)
class ExpertState:
    """Expert state s_t of a demonstration and what the expert did there."""

    t: int
    task: str
    history: list[HistoryEntry]
    """h_t: the expert's steps before t, as the agent sees them."""
    observation: str
    """o_t."""
    prompt_ids: list[int]
    """The ids of the expert step's prompt (the alternatives are sampled from the same prompt)."""
    valid_actions: list[str] | None
    action: str
    """The expert action a_t as executed."""
    transition: Transition
    """What a_t did."""
    prefix_actions: list[str]
    """a_0 .. a_{t-1} (rollback by replay)."""
    before: Any
    """Snapshot of s_t (``None`` when the env has no snapshots)."""
    after: Any
    """Snapshot of s_{t+1}."""


@dataclass(slots=True)
class AlternativeCounts:
    """What the alternatives of one demonstration came to."""

    proposals: int = 0
    unparsed: int = 0
    same_as_expert: int = 0
    duplicates: int = 0
    branches: int = 0
    reflections: int = 0
    """Reflection events (one per branch: a self-reflection or an empty marker)."""
    self_reflections: int = 0
    """Self-reflection requests to the engine."""
    replay_steps: int = 0

    def as_log(self) -> dict[str, int]:
        """Plain dict for the log line."""
        return asdict(self)


def _result(tr: Transition) -> str:
    parts = [tr.feedback.strip(), tr.observation.strip()]
    return "\n".join(p for p in parts if p)


def render_self_reflection_messages(
    *,
    instructions: str,
    task: str,
    history: Sequence[HistoryEntry],
    observation: str,
    history_window: int,
    expert_action: str,
    expert_result: Transition,
    alternative: str,
    alternative_result: Transition,
) -> list[ChatMessage]:
    """The state's prompt with the closing question replaced by both actions, their outcomes and the
    ask."""
    messages = render_messages(
        instructions=instructions,
        task=task,
        history=history,
        observation=observation,
        experience=None,
        history_window=history_window,
    )
    user = messages[-1].content.removesuffix(_ACTION_QUESTION).rstrip()
    ask = [
        "Two actions were tried from this state.",
        f"The expert's action: {expert_action}",
        f"What happened:\n{_result(expert_result)}",
        f"Another action: {alternative}",
        f"What happened:\n{_result(alternative_result)}",
        SELF_REFLECTION_QUESTION,
        f"Write your explanation between {THINK_OPEN} and {THINK_CLOSE}.",
    ]
    return [*messages[:-1], ChatMessage(role="user", content=user + "\n\n" + "\n".join(ask))]


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


class AlternativeExplorer:
    """Samples, executes and logs the alternatives of each expert state (see the module
    docstring)."""

    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: ChatTokenizer,
        env: Env,
        spec: EpisodeSpec,
        rollout: RolloutConfig,
        demo: DemoConfig,
        rec: EpisodeRecorder,
        run_env: RunEnv,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.spec = spec
        self.rollout = rollout
        self.demo = demo
        self.rec = rec
        self.run_env = run_env
        self.counts = AlternativeCounts()
        self.calls = 0

    def _seed(self) -> int | None:
        self.calls += 1
        if not self.rollout.seeded_sampling:
            return None
        return (self.spec.seed * 1_000_003 + 7919 * self.calls) % (2**31)

    async def explore(self, state: ExpertState) -> None:
        """Propose, execute and log the alternatives at ``state``; then put the env back at
        s_{t+1}."""
        params = SamplingParams(
            max_new_tokens=self.rollout.max_new_tokens,
            temperature=self.demo.temperature,
            top_p=self.demo.top_p,
            stop=list(self.rollout.action_stop),
            sampling_seed=self._seed(),
        )
        completions = await self.engine.generate(
            state.prompt_ids,
            params,
            n=self.demo.alternatives,
            return_logprob=self.rollout.return_logprob,
        )
        chosen = self._distinct(completions, state)
        for completion, action in chosen:
            back = await self.run_env(
                rollback_to, self.env, self.spec.task_id, state.prefix_actions, state.before
            )
            tr = await self.run_env(self.env.step, action)
            await self._log_branch(state, completion, action, tr, back)
        if chosen:  # back on the expert path, logged so the replay cost is in the log too
            prefix = [*state.prefix_actions, state.action]
            back = await self.run_env(rollback_to, self.env, self.spec.task_id, prefix, state.after)
            self.counts.replay_steps += back.replay_steps
            self.rec.policy_version = EXPERT_VERSION
            await self.rec.emit(
                Rollback,
                from_branch=ROOT_BRANCH,
                tau=state.t + 1,
                method=back.method,
                replay_steps=back.replay_steps,
            )

    def _distinct(
        self, completions: list[Completion], state: ExpertState
    ) -> list[tuple[Completion, str]]:
        seen = {_norm(state.action)}
        out: list[tuple[Completion, str]] = []
        for completion in completions:
            self.counts.proposals += 1
            parsed = parse_action(
                self.rollout.response_prefix + completion.text, state.valid_actions
            )
            if parsed.action is None:
                self.counts.unparsed += 1
            elif _norm(parsed.action) == _norm(state.action):
                self.counts.same_as_expert += 1
            elif _norm(parsed.action) in seen:
                self.counts.duplicates += 1
            else:
                seen.add(_norm(parsed.action))
                out.append((completion, parsed.action))
        return out

    async def _self_reflection(self, state: ExpertState, action: str, tr: Transition) -> Completion:
        messages = render_self_reflection_messages(
            instructions=self.env.instructions,
            task=state.task,
            history=state.history,
            observation=state.observation,
            history_window=self.rollout.history_window,
            expert_action=state.action,
            expert_result=state.transition,
            alternative=action,
            alternative_result=tr,
        )
        params = SamplingParams(
            max_new_tokens=self.demo.reflect_max_new_tokens,
            temperature=self.demo.reflect_temperature,
            stop=[THINK_CLOSE],
            sampling_seed=self._seed(),
        )
        ids = self.tokenizer.encode_chat(messages, THINK_OPEN)
        completions = await self.engine.generate(ids, params, n=1)
        if len(completions) != 1:
            raise EngineError(f"engine returned {len(completions)} completions for n=1")
        self.counts.self_reflections += 1
        return completions[0]

    async def _log_reflection(self, state: ExpertState, action: str, tr: Transition) -> Reflection:
        fields: dict[str, Any] = {"experience": "", "raw_text": "", "source": "none"}
        if self.demo.self_reflection:
            c = await self._self_reflection(state, action, tr)
            self.rec.policy_version = c.weight_version
            text, flags = " ".join(c.text.split()), []
            if len(text) > self.demo.max_reflection_chars:
                text, flags = (
                    text[: self.demo.max_reflection_chars - 3].rstrip() + "...",
                    ["experience_truncated"],
                )
            if not text:
                flags = ["experience_missing"]
            fields = {
                "experience": text,
                "raw_text": c.text,
                "token_ids": list(c.output_ids),
                "parse_ok": bool(text),
                "flags": flags,
                "source": "model",
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
            }
        self.counts.reflections += 1
        return await self.rec.emit(
            Reflection,
            branch_id=ROOT_BRANCH,
            at_t=state.t + 1,
            trigger="alternative",
            tau=state.t,
            **fields,
        )

    async def _log_branch(
        self, state: ExpertState, c: Completion, action: str, tr: Transition, back: RollbackResult
    ) -> None:
        self.rec.policy_version = c.weight_version
        reflection = await self._log_reflection(state, action, tr)
        self.rec.policy_version = c.weight_version
        self.counts.replay_steps += back.replay_steps
        self.counts.branches += 1
        branch_id = f"b{self.counts.branches}"
        await self.rec.emit(
            Rollback,
            from_branch=ROOT_BRANCH,
            tau=state.t,
            method=back.method,
            replay_steps=back.replay_steps,
        )
        await self.rec.emit(
            Branch,
            branch_id=branch_id,
            parent_branch_id=ROOT_BRANCH,
            tau=state.t,
            reflection_event_id=reflection.event_id,
            experience="",
            depth=1,
        )
        await self.rec.emit(
            Step,
            branch_id=branch_id,
            t=state.t,
            action=action,
            raw_text=c.text,
            token_ids=list(c.output_ids),
            logprobs=c.logprobs,
            observation=tr.observation,
            reward=tr.reward,
            done=tr.done,
            success=tr.success,
            feedback=tr.feedback,
            parse_ok=True,
            prompt_tokens=len(state.prompt_ids),
            prompt_sha256=prompt_sha256(state.prompt_ids),
            cached_tokens=c.cached_tokens,
            finish_reason=c.finish_reason,
        )
        reason: OutcomeReason = "success" if tr.success else "env_done" if tr.done else "budget"
        await self.rec.emit(
            Outcome,
            branch_id=branch_id,
            success=tr.success,
            score=tr.score,
            steps=state.t + 1,
            reason=reason,
        )
