"""Demonstration episodes (mode ``demo``): an expert plays a train task and the log records it as if
the policy had, optionally with the policy's alternative actions off the expert path (Early
Experience).

```
 demonstrator(env).demonstration(task_id) ─► a_0 .. a_T      (train split only, else EnvError)
 reset ─► EpisodeStarted(mode demo) ─► for each t:  prompt_t = render(q, h_t, o_t) + response_prefix
            Step(b0, t, a_t: the answer written as the policy must write it, its exact token ids)
            [alternatives: K samples at prompt_t ─► one-step branches off b0 at tau = t
             (actors/early.py)]
         ─► Outcome(b0) ─► EpisodeFinished
```

Each expert step is what a plain rollout (``RolloutConfig`` of the env) would have logged had the
policy answered with the expert action: the same prompt (``leafe.protocol.prompt.render_messages``,
the rollout's ``history_window`` and ``response_prefix``; ``Step.prompt_sha256`` of those ids), and
a completion in the engine's shape (``leafe.protocol.answers``):

- format ``tag``: the answer is ``<action>A</action>``; with ``<action>`` prefilled the completion
  is ``A</action>``. A matched stop string is cut from the text but kept in the ids, as SGLang does,
  so ``raw_text`` is ``A`` and ``token_ids`` are the tokens of ``A</action>``.
- format ``fence`` (HumanEval): the completion is the code in a fenced ``python`` block; no stop
  string ends it, so the ids end with the chat template's end-of-turn token (SmolLM2's EOS), as an
  engine's would.

``Step.action`` is the action executed: the expert's action in the env's own spelling, checked
against ``leafe.actors.parsing.parse_action`` of the answer with the state's valid actions. Where
the parser would read another action from it (ScienceWorld's valid-action list misses some gold
commands), the step is still executed (it is the demonstration) but logged with ``parse_ok =
False``: materializers skip such targets, so the policy is never trained on an answer its own parser
would misread; they are counted in ``EpisodeFinished.parse_failures``. Expert events carry
``policy_version = "expert"`` (``leafe.protocol.events.EXPERT_VERSION``); alternatives carry the
engine's version.

An expert that cannot demonstrate the task (e.g. a ScienceWorld gold path longer than ``max_steps``)
and env failures end the episode with an ``error`` Outcome; engine errors propagate (the task is
retried).

Run one in-process: ``await DemoRunner(tokenizer=tok, env=make_env("sokoban"), spec=EpisodeSpec(...,
mode="demo"), rollout=RolloutConfig.for_env("sokoban"), demo=DemoConfig(), sink=ListSink()).run()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from leafe.actors.config import RolloutConfig
from leafe.actors.demo_config import DemoConfig
from leafe.actors.early import AlternativeExplorer, ExpertState
from leafe.actors.engine import Engine
from leafe.actors.episode import EpisodeRecorder, EpisodeSpec, EpisodeSummary, EventSink
from leafe.actors.parsing import parse_action
from leafe.envs.base import Env, EnvError, Transition, require_train_split
from leafe.envs.registry import demonstrator
from leafe.protocol.answers import ExpertAnswer, end_of_turn_id, expert_answer
from leafe.protocol.events import (
    EXPERT_VERSION,
    ROOT_BRANCH,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    OutcomeReason,
    Step,
)
from leafe.protocol.prompt import (
    PROMPT_FORMAT,
    ChatTokenizer,
    HistoryEntry,
    prompt_sha256,
    render_messages,
)

__all__ = [
    "DemoRunner",
    "ExpertAnswer",
    "expert_answer",
]  # the last two from leafe.protocol.answers

log = structlog.get_logger(__name__)
R = TypeVar("R")


def _same(a: str | None, b: str) -> bool:
    return a is not None and " ".join(a.split()).lower() == " ".join(b.split()).lower()


class DemoRunner:
    """Plays one demonstration episode (see the module docstring)."""

    def __init__(
        self,
        *,
        tokenizer: ChatTokenizer,
        env: Env,
        spec: EpisodeSpec,
        rollout: RolloutConfig,
        demo: DemoConfig,
        sink: EventSink,
        engine: Engine | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if demo.uses_engine and engine is None:
            raise ValueError(f"alternatives = {demo.alternatives} need an engine")
        self.tokenizer = tokenizer
        self.env = env
        self.spec = spec
        self.rollout = rollout
        self.demo = demo
        self.engine = engine
        kwargs = {"clock": clock} if clock is not None else {}
        self.rec = EpisodeRecorder(
            sink, run_id=spec.run_id, episode_id=spec.episode_id, actor_id=spec.actor_id, **kwargs
        )
        self.eot = end_of_turn_id(tokenizer)
        self.task = ""
        self.history: list[HistoryEntry] = []
        self.executed: list[str] = []
        self.parse_failures = 0
        self.log = log.bind(episode_id=spec.episode_id, task_id=spec.task_id, mode=spec.mode)

    async def _env(self, fn: Callable[..., R], *args: Any) -> R:
        if self.rollout.env_in_thread:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def run(self) -> EpisodeSummary:
        """Play the demonstration (and its alternatives); returns the figures of
        ``EpisodeFinished``."""
        require_train_split(self.spec.task_id, self.spec.split)
        error = ""
        try:
            actions = await self._env(demonstrator(self.env).demonstration, self.spec.task_id)
        except EnvError as e:
            actions, error = [], f"{type(e).__name__}: {e}"
        observation = await self._start()
        early = self._early()
        last: Transition | None = None
        for t, action in enumerate(actions):
            before = await self._snapshot()
            try:
                state = await self._expert_step(t, action, observation, before)
            except EnvError as e:
                error = f"{type(e).__name__}: {e}"
                break
            last, observation = state.transition, state.transition.observation
            if early is not None and (not self.demo.max_states or t < self.demo.max_states):
                try:
                    await early.explore(state)
                except EnvError as e:
                    error = f"{type(e).__name__}: {e}"
                    break
            if last.done:
                break
        return await self._finish(last, error, early)

    async def _start(self) -> str:
        reset = await self._env(self.env.reset, self.spec.task_id)
        self.task = reset.task
        self.rec.policy_version = EXPERT_VERSION
        r = self.rollout
        await self.rec.emit(
            EpisodeStarted,
            **self.spec.started_fields(),
            task=reset.task,
            observation=reset.observation,
            instructions=self.env.instructions,
            prompt_format=PROMPT_FORMAT,
            history_window=r.history_window,
            response_prefix=r.response_prefix,
        )
        return reset.observation

    def _early(self) -> AlternativeExplorer | None:
        if not self.demo.uses_engine:
            return None
        assert self.engine is not None
        return AlternativeExplorer(
            engine=self.engine,
            tokenizer=self.tokenizer,
            env=self.env,
            spec=self.spec,
            rollout=self.rollout,
            demo=self.demo,
            rec=self.rec,
            run_env=self._env,
        )

    async def _snapshot(self) -> Any:
        return await self._env(self.env.snapshot) if self.env.supports_snapshot else None

    def _answer(self, action: str, observation: str) -> tuple[list[int], ExpertAnswer]:
        """The prompt ids of the current state and ``action`` written as the policy's completion."""
        messages = render_messages(
            instructions=self.env.instructions,
            task=self.task,
            history=self.history,
            observation=observation,
            experience=None,
            history_window=self.rollout.history_window,
        )
        prefix = self.rollout.response_prefix
        answer = expert_answer(
            action,
            answer_format=self.demo.answer_format,
            response_prefix=prefix,
            stop=self.rollout.action_stop,
            tokenizer=self.tokenizer,
            messages=messages,
            eot=self.eot,
        )
        return self.tokenizer.encode_chat(messages, prefix), answer

    async def _expert_step(self, t: int, action: str, observation: str, before: Any) -> ExpertState:
        ids, answer = self._answer(action, observation)
        prefix = self.rollout.response_prefix
        valid = await self._env(self.env.valid_actions)
        parsed = parse_action(prefix + answer.text, valid)
        agrees = _same(parsed.action, action)
        executed = parsed.action if agrees and parsed.action is not None else action
        if not agrees:
            self.parse_failures += 1
            self.log.warning(
                "actor.demo.parser_disagrees", t=t, expert=action[:80], parsed=parsed.action
            )
        tr = await self._env(self.env.step, executed)
        self.rec.policy_version = EXPERT_VERSION
        await self.rec.emit(
            Step,
            branch_id=ROOT_BRANCH,
            t=t,
            action=executed,
            raw_text=answer.text,
            token_ids=answer.token_ids,
            observation=tr.observation,
            reward=tr.reward,
            done=tr.done,
            success=tr.success,
            feedback=tr.feedback,
            parse_ok=agrees,
            prompt_tokens=len(ids),
            prompt_sha256=prompt_sha256(ids),
            finish_reason="stop",
        )
        state = ExpertState(
            t=t,
            task=self.task,
            history=list(self.history),
            observation=observation,
            prompt_ids=ids,
            valid_actions=valid,
            action=executed,
            transition=tr,
            prefix_actions=list(self.executed),
            before=before,
            after=await self._snapshot(),
        )
        self.history.append(HistoryEntry(executed, answer.text, tr.observation, tr.feedback))
        self.executed.append(executed)
        return state

    async def _finish(
        self, last: Transition | None, error: str, early: AlternativeExplorer | None
    ) -> EpisodeSummary:
        success = last is not None and last.success and not error
        reason: OutcomeReason = (
            "budget"  # the demonstration ran out before the env ended the episode
        )
        if error:
            reason = "error"
        elif success:
            reason = "success"
        elif last is not None and last.done:
            reason = "env_done"
        self.rec.policy_version = EXPERT_VERSION
        await self.rec.emit(
            Outcome,
            branch_id=ROOT_BRANCH,
            success=success,
            score=last.score if last is not None else 0.0,
            steps=len(self.history),
            reason=reason,
            error=error,
        )
        counts = early.counts if early is not None else None
        figures: dict[str, Any] = dict(
            success=success,
            branches=1 + (counts.branches if counts else 0),
            actions=len(self.history) + (counts.branches if counts else 0),
            reflections=counts.reflections if counts else 0,
            replay_steps=counts.replay_steps if counts else 0,
            parse_failures=self.parse_failures,
        )
        await self.rec.emit(EpisodeFinished, **figures)
        summary = EpisodeSummary(
            episode_id=self.spec.episode_id, events=self.rec.seq, error=error, **figures
        )
        self.log.info(
            "actor.demo.finished", steps=len(self.history), **(counts.as_log() if counts else {})
        )
        return summary
