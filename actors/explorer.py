"""LEAFE Stage 1: one episode's exploration tree with reflection, rollback and branching.

```
 root b0 ──a0──a1──a2──a3──a4── ... ──(done / horizon)     every K own steps, and when a branch
             │         └─ Reflection(tau=2, e) ─► queue     fails or hits the horizon, the same
             └─ Reflection(tau=1, e') ─► queue              policy names (tau, e); the request waits
 queue (BFS): pop ─► Rollback(env to tau: snapshot | replay)
              ─► Branch(b_n, parent, tau, e) ─► steps ...
```

A branch with parent p and rollback point tau shares p's path steps ``0..tau-1``; its own steps
start at ``t = tau`` and e is in its prompts (only a'_tau's with ``experience_scope =
"first_step"``). Requests are served breadth-first until the queue is empty, the attempt budget
(``max_branches``), the interaction budget (``max_actions``) or, optionally, the first success stops
the episode. ``max_depth`` bounds the tree: a branch at that depth does not reflect. Every branch
ends with exactly one Outcome and the episode with EpisodeFinished; a Reflection comes before its
branch's Outcome, a Branch after its Reflection and Rollback and before its first Step.

The prompt of step t is ``render_messages`` of the path's first t steps and o_t (the recorded
observation of step t-1, or o_0), tokenized by the injected ``ChatTokenizer``;
``Step.prompt_sha256`` lets the replayer prove it rebuilt it. An unparseable completion is a policy
action with no env step (``action=None``, feedback says why); rollback replay skips those. An
``EnvError`` ends the episode with an ``error`` Outcome; an ``EngineError`` propagates (the episode
stays unfinished, i.e. abandoned, and is retried). ``policy_version`` is always the per-completion
``weight_version`` of the latest completion; EpisodeStarted is held back until the first one, so an
episode whose first generation fails leaves no events. With ``reflection_source = "oracle"`` the
environment's oracle names tau and e (``actors/oracle.py``); with ``oracle_labels`` the policy names
them and the oracle's verdict on the same history is recorded beside (``Reflection.oracle_tau``,
``oracle_experience``: labels for the reflection warm start); the verdict itself is
``actors/reflect.py``'s.

Run one in-process: ``await Explorer(engine=..., tokenizer=..., env=...,
config=ExplorerConfig.for_env( "sokoban"), sink=ListSink(), spec=EpisodeSpec(...)).run()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import structlog

from leafe.actors.config import ExplorerConfig
from leafe.actors.engine import ENGINE_AFFINITY, Completion, Engine, EngineError, SamplingParams
from leafe.actors.episode import EpisodeRecorder, EpisodeSpec, EpisodeSummary, EventSink
from leafe.actors.parsing import invalid_action_feedback, parse_action
from leafe.actors.reflect import Reflector
from leafe.actors.tree import PathStep, TreeBranch, TreeCounters, TreeRequest
from leafe.envs.base import Env, EnvError, Transition, rollback_to
from leafe.protocol.events import (
    ROOT_BRANCH,
    Branch,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    OutcomeReason,
    Reflection,
    ReflectionTrigger,
    Rollback,
    Step,
)
from leafe.protocol.prompt import (
    PROMPT_FORMAT,
    ChatTokenizer,
    HistoryEntry,
    prompt_sha256,
    render_messages,
)

__all__ = ["Explorer", "PathStep"]

log = structlog.get_logger(__name__)
R = TypeVar("R")
E = TypeVar("E", bound=msgspec.Struct)


class Explorer:
    """Runs one episode's LEAFE tree (or, with ``ExplorerConfig.from_rollout``, one plain
    rollout)."""

    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: ChatTokenizer,
        env: Env,
        config: ExplorerConfig,
        sink: EventSink,
        spec: EpisodeSpec,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.cfg = config
        self.spec = spec
        kwargs = {"clock": clock} if clock is not None else {}
        self.rec = EpisodeRecorder(
            sink, run_id=spec.run_id, episode_id=spec.episode_id, actor_id=spec.actor_id, **kwargs
        )
        self.reflector = Reflector(
            env=env,
            tokenizer=tokenizer,
            config=config,
            task_id=spec.task_id,
            generate=self._generate,
            params=lambda: self._params(reflect=True),
            run_env=self._env,
        )
        self.n = TreeCounters()
        self.task = ""
        self.o0 = ""
        self._started: dict[str, Any] | None = None  # EpisodeStarted's fields until :meth:`_emit`
        self.log = log.bind(episode_id=spec.episode_id, task_id=spec.task_id, mode=spec.mode)

    async def run(self) -> EpisodeSummary:
        """Play the whole tree; returns the figures that ``EpisodeFinished`` records."""
        root = await self._start()
        await self._run_branch(root)
        while self.n.queue and not self.n.stopped:
            if self.n.actions >= self.cfg.max_actions:
                break
            branch = await self._open(self.n.queue.popleft())
            if branch is not None:
                await self._run_branch(branch)
        if self.n.queue:
            self.log.debug("actor.episode.dropped_requests", dropped=len(self.n.queue))
        return await self._finish()

    async def _env(self, fn: Callable[..., R], *args: Any) -> R:
        if self.cfg.env_in_thread:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _start(self) -> TreeBranch:
        reset = await self._env(self.env.reset, self.spec.task_id)
        self.task, self.o0 = reset.task, reset.observation
        self._started = dict(
            **self.spec.started_fields(),
            task=self.task,
            observation=self.o0,
            instructions=self.env.instructions,
            prompt_format=PROMPT_FORMAT,
            history_window=self.cfg.history_window,
            response_prefix=self.cfg.response_prefix,
        )
        snaps = [await self._env(self.env.snapshot)] if self.env.supports_snapshot else []
        self.n.branches = 1
        return TreeBranch(ROOT_BRANCH, depth=0, tau=0, experience=None, path=[], snapshots=snaps)

    async def _emit(self, cls: type[E], **fields: Any) -> E:
        """Emit through the recorder, EpisodeStarted first: it is held back until the episode's
        first completion (or first other event), so its ``policy_version`` is the version that
        completion reports, never ``/get_model_info``'s (through a router: the first healthy
        worker's, not the one that generates). An episode whose first generation fails leaves no
        events at all."""
        if self._started is not None:
            started, self._started = self._started, None
            await self.rec.emit(EpisodeStarted, **started)
        return await self.rec.emit(cls, **fields)

    async def _generate(self, ids: list[int], params: SamplingParams, logprob: bool) -> Completion:
        # The task's group (or task key): its episodes share the prompt prefix on one server's
        # cache.
        ENGINE_AFFINITY.set(self.spec.group_id or self.spec.task_key)
        completions = await self.engine.generate(ids, params, n=1, return_logprob=logprob)
        if len(completions) != 1:
            raise EngineError(f"engine returned {len(completions)} completions for n=1")
        self.rec.policy_version = completions[0].weight_version
        return completions[0]

    def _params(self, *, reflect: bool) -> SamplingParams:
        self.n.calls += 1
        seed = (
            (self.spec.seed * 1_000_003 + self.n.calls) % (2**31)
            if self.cfg.seeded_sampling
            else None
        )
        return self.cfg.reflection_params(seed) if reflect else self.cfg.action_params(seed)

    async def _run_branch(self, b: TreeBranch) -> None:
        reason: OutcomeReason | None = None
        while reason is None:
            if self.n.actions >= self.cfg.max_actions:
                reason = "budget"
                break
            try:
                step = await self._act(b)
            except EnvError as e:
                self.n.error = f"{type(e).__name__}: {e}"
                self.n.stopped = True
                reason = "error"
                break
            if step.success:
                reason = "success"
            elif step.done:
                reason = "env_done"
            elif len(b.path) >= self.cfg.horizon:
                reason = "horizon"
            elif self.cfg.k and (len(b.path) - b.tau) % self.cfg.k == 0:
                await self._reflect(b, "periodic")
        if reason in ("env_done", "horizon"):
            await self._reflect(b, "failure" if reason == "env_done" else "horizon")
        await self._outcome(b, reason)

    async def _outcome(self, b: TreeBranch, reason: OutcomeReason) -> None:
        last = b.path[-1] if b.path else None
        success = reason == "success"
        if success:
            n, c = self.n, self.cfg
            n.success = True
            n.corrections += b.branch_id != ROOT_BRANCH
            enough = bool(c.max_corrections) and n.corrections >= c.max_corrections
            n.stopped = n.stopped or c.stop_on_first_success or enough
        await self._emit(
            Outcome,
            branch_id=b.branch_id,
            success=success,
            score=last.score if last else 0.0,
            steps=len(b.path),
            reason=reason,
            error=self.n.error if reason == "error" else "",
        )
        self.log.debug(
            "actor.branch.ended", branch_id=b.branch_id, reason=reason, steps=len(b.path)
        )

    def _prompt_ids(self, b: TreeBranch) -> tuple[list[int], bool]:
        t = len(b.path)
        in_ctx = bool(b.experience) and (self.cfg.experience_scope == "branch" or t == b.tau)
        messages = render_messages(
            instructions=self.env.instructions,
            task=self.task,
            history=[s.entry for s in b.path],
            observation=b.path[-1].entry.observation if b.path else self.o0,
            experience=b.experience if in_ctx else None,
            history_window=self.cfg.history_window,
        )
        return self.tokenizer.encode_chat(messages, self.cfg.response_prefix), in_ctx

    async def _act(self, b: TreeBranch) -> PathStep:
        ids, in_ctx = self._prompt_ids(b)
        completion = await self._generate(ids, self._params(reflect=False), self.cfg.return_logprob)
        valid = await self._env(self.env.valid_actions)
        parsed = parse_action(self.cfg.response_prefix + completion.text, valid)
        current = b.path[-1].entry.observation if b.path else self.o0
        if parsed.action is None:
            self.n.parse_failures += 1
            feedback = invalid_action_feedback(parsed, valid)
            tr = Transition(
                observation=current, feedback=feedback, score=b.path[-1].score if b.path else 0.0
            )
        else:
            tr = await self._env(self.env.step, parsed.action)
        self.n.actions += 1
        if self.env.supports_snapshot:
            snap = b.snapshots[-1] if parsed.action is None else await self._env(self.env.snapshot)
            b.snapshots.append(snap)
        entry = HistoryEntry(parsed.action, completion.text, tr.observation, tr.feedback)
        step = PathStep(entry=entry, score=tr.score, done=tr.done, success=tr.success)
        await self._emit(
            Step,
            branch_id=b.branch_id,
            t=len(b.path),
            action=parsed.action,
            raw_text=completion.text,
            token_ids=list(completion.output_ids),
            logprobs=completion.logprobs,
            observation=tr.observation,
            reward=tr.reward,
            done=tr.done,
            success=tr.success,
            feedback=tr.feedback,
            parse_ok=parsed.action is not None,
            experience_in_context=in_ctx,
            prompt_tokens=len(ids),
            prompt_sha256=prompt_sha256(ids),
            cached_tokens=completion.cached_tokens,
            finish_reason=completion.finish_reason,
        )
        b.path.append(step)
        return step

    def _can_branch_from(self, b: TreeBranch) -> bool:
        n, c = self.n, self.cfg
        return (
            not n.stopped
            and b.depth < c.max_depth
            and n.branches + len(n.queue) < c.max_branches
            and n.actions < c.max_actions
        )

    async def _reflect(self, b: TreeBranch, trigger: ReflectionTrigger) -> None:
        if not b.path or not self._can_branch_from(b):
            return
        history = [s.entry for s in b.path]
        v = await self.reflector.reflect(self.task, history, trigger)
        self.n.reflections += 1
        event = await self._emit(
            Reflection,
            branch_id=b.branch_id,
            at_t=len(history),
            trigger=trigger,
            tau=v.parsed.tau,
            experience=v.parsed.experience,
            raw_text=v.raw_text,
            token_ids=v.token_ids,
            parse_ok=v.parsed.parse_ok,
            flags=list(v.parsed.flags),
            source=self.cfg.reflection_source,
            oracle_tau=v.label.tau if v.label is not None else None,
            oracle_experience=v.label.experience if v.label is not None else "",
            oracle_action=v.oracle_action,
            prompt_sha256=v.prompt_sha256,
            prompt_tokens=v.prompt_tokens,
            cached_tokens=v.cached_tokens,
        )
        if v.parsed.experience:
            tau = (
                0 if self.cfg.restart_from == "start" else v.parsed.tau
            )  # IR restarts the whole attempt
            key = (b.branch_id, tau, v.parsed.experience)
            if (
                key in self.n.requested
            ):  # the same correction again (periodic reflections repeat themselves)
                self.n.duplicates += 1
            else:
                self.n.requested.add(key)
                self.n.queue.append(TreeRequest(b, tau, v.parsed.experience, event.event_id))
        self.log.debug("actor.reflection", branch_id=b.branch_id, trigger=trigger, tau=v.parsed.tau)

    async def _open(self, req: TreeRequest) -> TreeBranch | None:
        parent, tau = req.parent, req.tau
        prefix = parent.path[:tau]
        snap = parent.snapshots[tau] if self.env.supports_snapshot else None
        actions = [s.entry.action for s in prefix if s.entry.action is not None]
        try:
            res = await self._env(rollback_to, self.env, self.spec.task_id, actions, snap)
        except EnvError as e:
            self.n.error, self.n.stopped = f"{type(e).__name__}: {e}", True
            self.log.warning(
                "actor.rollback.failed", from_branch=parent.branch_id, tau=tau, error=str(e)
            )
            return None
        self.n.replay_steps += res.replay_steps
        expected = prefix[-1].entry.observation if prefix else self.o0
        if res.observation != expected:
            self.n.diverged += 1
            self.log.warning(
                "actor.rollback.diverged", from_branch=parent.branch_id, tau=tau, via=res.method
            )
        await self._emit(
            Rollback,
            from_branch=parent.branch_id,
            tau=tau,
            method=res.method,
            replay_steps=res.replay_steps,
        )
        branch = TreeBranch(
            f"b{self.n.branches}",
            depth=parent.depth + 1,
            tau=tau,
            experience=req.experience,
            path=list(prefix),
            snapshots=parent.snapshots[: tau + 1],
        )
        self.n.branches += 1
        await self._emit(
            Branch,
            branch_id=branch.branch_id,
            parent_branch_id=parent.branch_id,
            tau=tau,
            reflection_event_id=req.reflection_event_id,
            experience=req.experience,
            depth=branch.depth,
        )
        return branch

    async def _finish(self) -> EpisodeSummary:
        n = self.n
        figures: dict[str, Any] = dict(
            success=n.success,
            branches=n.branches,
            actions=n.actions,
            reflections=n.reflections,
            replay_steps=n.replay_steps,
            parse_failures=n.parse_failures,
        )
        await self._emit(EpisodeFinished, **figures)
        summary = EpisodeSummary(
            episode_id=self.spec.episode_id, events=self.rec.seq, error=n.error, **figures
        )
        extra = {"corrections": n.corrections, "duplicate_requests": n.duplicates}
        self.log.info("actor.episode.finished", **msgspec.structs.asdict(summary), **extra)
        return summary
