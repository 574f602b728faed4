"""Realistic event streams for tests and benchmarks: explore trees (LEAFE) and GRPO rollout groups.

The builders simulate what an actor publishes, following the contract in ``protocol.events`` and
``protocol.prompt``: a breadth-first tree of branches (reflection -> rollback -> branch -> steps ->
outcome), periodic and failure reflections, unparsable completions, experience in context for a branch's
first step or all of its steps, and each Step's ``prompt_sha256`` computed from the exact prompt the
actor would have sent (when a tokenizer is given). Every experience text contains the marker
:data:`EXPERIENCE_MARKER`, which appears nowhere else, so a test can prove it never leaks into inputs.

- plain functions (``build_explore_episode``, ``build_rollout_group``) take a ``random.Random`` and are
  used by ``bench/replay.py`` to make million-event logs;
- Hypothesis strategies (``explore_episodes``, ``rollout_groups``, ``event_logs``, ``interleaved``)
  wrap them for the property suites.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from actors.fakes import ByteChatTokenizer  # re-exported: the suites share one fake tokenizer
from protocol.events import (
    ROOT_BRANCH,
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Rollback,
    Step,
    event_id_for,
)
from protocol.prompt import ChatTokenizer, HistoryEntry, prompt_sha256, render_messages

__all__ = [
    "EXPERIENCE_MARKER",
    "ByteChatTokenizer",
    "EventWriter",
    "ExploreSpec",
    "build_explore_episode",
    "build_rollout_group",
    "event_logs",
    "explore_episodes",
    "interleave",
    "interleaved",
    "rollout_groups",
]

EXPERIENCE_MARKER = "EXPERIENCE#"
INSTRUCTIONS = "You are a Sokoban agent. Answer with <action>up|down|left|right</action>."
ACTIONS = ("up", "down", "left", "right")


@dataclass(frozen=True)
class ExploreSpec:
    """Shape of one simulated explore episode."""

    seed: int = 0
    max_depth: int = 2
    budget: int = 24
    horizon: int = 6
    reflect_every: int = 0
    p_success: float = 0.3
    p_parse_fail: float = 0.1
    experience_scope: str = "all"  # "all" steps of a branch, its "first" step only, or "none"
    history_window: int = 0
    stop_on_success: bool = True
    truncate: float | None = None  # keep only this fraction of the events (abandoned episode)
    env: str = "sokoban"
    mode: str = "explore"
    split: str = "train"


@dataclass
class EventWriter:
    """Stamps events with ids, seq, run and actor like an actor's publisher (``emit(Step, ...)``)."""

    run_id: str
    episode_id: str
    actor_id: str = "actor-0"
    policy_version: str = "v000001"
    events: list[EpisodeEvent] = field(default_factory=list)

    def emit(self, cls: type[Any], **fields: Any) -> Any:
        seq = len(self.events)
        event = cls(
            event_id=event_id_for(self.episode_id, seq),
            run_id=self.run_id,
            episode_id=self.episode_id,
            actor_id=self.actor_id,
            seq=seq,
            policy_version=self.policy_version,
            ts=1.7e9 + seq,
            **fields,
        )
        self.events.append(event)
        return event


@dataclass
class _Episode:
    """An actor's view of one episode while it is being simulated."""

    w: EventWriter
    rng: random.Random
    spec: ExploreSpec
    started: EpisodeStarted
    tokenizer: ChatTokenizer | None
    actions: int = 0
    reflections: int = 0
    parse_failures: int = 0

    def digest(self, path: list[Step], experience: str | None) -> tuple[str, int]:
        if self.tokenizer is None:
            return "", 0
        obs = self.started.observation if not path else path[-1].observation
        messages = render_messages(
            instructions=self.started.instructions,
            task=self.started.task,
            history=[HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in path],
            observation=obs,
            experience=experience,
            history_window=self.started.history_window,
        )
        ids = self.tokenizer.encode_chat(messages)
        return prompt_sha256(ids), len(ids)

    def step(self, branch_id: str, path: list[Step], experience: str | None, p_success: float) -> Step:
        rng, t = self.rng, len(path)
        parsed = rng.random() >= self.spec.p_parse_fail
        action = rng.choice(ACTIONS) if parsed else None
        raw = (
            f"I will move. <action>{action}</action>" if parsed else rng.choice(["hmm", "Let me think.", ""])
        )
        n_tokens = rng.randint(0 if not raw else 1, 12)
        success = parsed and rng.random() < p_success
        sha, n_prompt = self.digest(path, experience)
        self.actions += 1
        self.parse_failures += not parsed
        return self.w.emit(
            Step,
            branch_id=branch_id,
            t=t,
            action=action,
            raw_text=raw,
            token_ids=[rng.randrange(49152) for _ in range(n_tokens)],
            logprobs=[-rng.random() for _ in range(n_tokens)] if rng.random() < 0.8 else None,
            observation=f"#####\n#@ $.#  {branch_id}:{t}:{rng.randrange(1000)}\n#####",
            reward=1.0 if success else rng.choice([0.0, -0.1]),
            done=success,
            success=success,
            feedback="" if parsed else "invalid action: no <action> tag",
            parse_ok=parsed,
            experience_in_context=experience is not None,
            prompt_tokens=n_prompt,
            prompt_sha256=sha,
        )


def _run_branch(
    ep: _Episode, branch_id: str, prefix: list[Step], experience: str, depth: int, queue: deque
) -> bool:
    """Steps of one branch until success, horizon or budget; queues branch requests from reflections."""
    spec, path = ep.spec, list(prefix)
    first = len(path)
    success = False
    while len(path) - first < spec.horizon and ep.actions < spec.budget and not success:
        in_ctx = experience and (
            spec.experience_scope == "all" or (spec.experience_scope == "first" and len(path) == first)
        )
        # A lesson in context helps: corrected branches succeed more often, as the method intends.
        p_success = min(0.9, 2 * spec.p_success + 0.1) if experience else spec.p_success
        step = ep.step(branch_id, path, experience if in_ctx else None, p_success)
        path.append(step)
        success = step.success
        periodic = spec.reflect_every and len(path) % spec.reflect_every == 0
        if periodic and not success and depth < spec.max_depth:
            queue.append(_reflect(ep, branch_id, path, "periodic", depth))
    if not success and depth < spec.max_depth and path:
        queue.append(_reflect(ep, branch_id, path, "failure", depth))
    reason = "success" if success else ("budget" if ep.actions >= spec.budget else "horizon")
    ep.w.emit(
        Outcome, branch_id=branch_id, success=success, score=float(success), steps=len(path), reason=reason
    )
    return success


def _reflect(ep: _Episode, branch_id: str, path: list[Step], trigger: str, depth: int) -> tuple:
    ep.reflections += 1
    tau = ep.rng.randrange(len(path))
    experience = f"{EXPERIENCE_MARKER}{ep.w.episode_id}/{ep.reflections}: do not push the box into a corner"
    refl = ep.w.emit(
        Reflection,
        branch_id=branch_id,
        at_t=len(path),
        trigger=trigger,
        tau=tau,
        experience=experience,
        raw_text=f"<tau>{tau}</tau><experience>{experience}</experience>",
        token_ids=[1, 2, 3],
    )
    return (branch_id, list(path[:tau]), tau, refl, depth + 1)


def build_explore_episode(
    spec: ExploreSpec, *, run_id: str, episode_id: str, tokenizer: ChatTokenizer | None = None
) -> list[EpisodeEvent]:
    """Events of one explore episode (in seq order), simulated breadth-first like an actor."""
    rng = random.Random(f"{spec.seed}:{episode_id}")
    w = EventWriter(run_id, episode_id)
    started = w.emit(
        EpisodeStarted,
        task_key=f"{episode_id}-task",
        env=spec.env,
        task_id=f"{spec.env}/{spec.split}/{rng.randrange(100):05d}",
        split=spec.split,
        seed=spec.seed,
        mode=spec.mode,
        task="Push every box onto a target.",
        observation="#####\n#@ $.#\n#####",
        instructions=INSTRUCTIONS,
        history_window=spec.history_window,
    )
    ep = _Episode(w, rng, spec, started, tokenizer)
    queue: deque = deque()
    any_success = _run_branch(ep, ROOT_BRANCH, [], "", 0, queue)
    branches = 1
    while queue and ep.actions < spec.budget and not (any_success and spec.stop_on_success):
        parent, prefix, tau, refl, depth = queue.popleft()
        w.emit(Rollback, from_branch=parent, tau=tau, method="replay", replay_steps=tau)
        bid = f"b{branches}"
        branches += 1
        w.emit(
            Branch,
            branch_id=bid,
            parent_branch_id=parent,
            tau=tau,
            reflection_event_id=refl.event_id,
            experience=refl.experience,
            depth=depth,
        )
        any_success |= _run_branch(ep, bid, prefix, refl.experience, depth, queue)
    w.emit(
        EpisodeFinished,
        success=any_success,
        branches=branches,
        actions=ep.actions,
        reflections=ep.reflections,
        parse_failures=ep.parse_failures,
    )
    events = w.events
    if spec.truncate is not None:
        events = events[: max(1, int(len(events) * spec.truncate))]
    return events


def build_rollout_group(
    rng: random.Random,
    *,
    run_id: str,
    group_id: str,
    n: int,
    tokenizer: ChatTokenizer | None = None,
    p_success: float = 0.3,
    horizon: int = 6,
    retry: bool = False,
) -> list[list[EpisodeEvent]]:
    """Events of the ``n`` plain rollouts of one GRPO group (one list per episode).

    With ``retry`` the first member is also run as an abandoned attempt (no EpisodeFinished) before its
    retry, as happens when an actor crashes and the task is redelivered.
    """
    episodes: list[list[EpisodeEvent]] = []
    for i in range(n):
        attempts = [1, 2] if retry and i == 0 else [1]
        for attempt in attempts:
            spec = ExploreSpec(
                seed=rng.randrange(1 << 30),
                max_depth=0,
                budget=horizon,
                horizon=horizon,
                p_success=p_success,
                mode="rollout",
            )
            eid = f"{group_id}-{i}.a{attempt}"
            events = _rollout(
                spec,
                run_id=run_id,
                episode_id=eid,
                group_id=group_id,
                n=n,
                task_key=f"{group_id}-{i}",
                tokenizer=tokenizer,
                attempt=attempt,
            )
            if attempt < len(attempts):
                events = events[: max(1, len(events) // 2)]
            episodes.append(events)
    return episodes


def _rollout(
    spec: ExploreSpec,
    *,
    run_id: str,
    episode_id: str,
    group_id: str,
    n: int,
    task_key: str,
    tokenizer: ChatTokenizer | None,
    attempt: int,
) -> list[EpisodeEvent]:
    rng = random.Random(f"{spec.seed}:{episode_id}")
    w = EventWriter(run_id, episode_id)
    started = w.emit(
        EpisodeStarted,
        task_key=task_key,
        env=spec.env,
        task_id=f"{spec.env}/train/{group_id}",
        split="train",
        seed=spec.seed,
        mode="rollout",
        task="Push every box onto a target.",
        observation="#####\n#@ $.#\n#####",
        instructions=INSTRUCTIONS,
        group_id=group_id,
        group_size=n,
        attempt=attempt,
    )
    ep = _Episode(w, rng, spec, started, tokenizer)
    success = _run_branch(ep, ROOT_BRANCH, [], "", 0, deque())
    w.emit(EpisodeFinished, success=success, branches=1, actions=ep.actions, parse_failures=ep.parse_failures)
    return w.events


def interleave(streams: Sequence[Sequence[EpisodeEvent]], rng: random.Random) -> list[EpisodeEvent]:
    """One random interleaving of per-episode streams that keeps each stream's own order."""
    cursors = [0] * len(streams)
    live = [i for i, s in enumerate(streams) if s]
    out: list[EpisodeEvent] = []
    while live:
        k = rng.randrange(len(live))
        i = live[k]
        out.append(streams[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(streams[i]):
            live.pop(k)
    return out


# -- Hypothesis strategies ---------------------------------------------------------------------------
@st.composite
def explore_specs(draw: st.DrawFn, *, abandoned: bool = True) -> ExploreSpec:
    """Shapes of explore episodes, from one-step successes to deep failing trees."""
    return ExploreSpec(
        seed=draw(st.integers(0, 2**31)),
        max_depth=draw(st.sampled_from([1, 2, 2, 3, 0])),
        budget=draw(st.integers(6, 30)),
        horizon=draw(st.integers(2, 8)),
        reflect_every=draw(st.sampled_from([0, 0, 2, 3])),
        p_success=draw(st.sampled_from([0.0, 0.15, 0.35, 0.8])),
        p_parse_fail=draw(st.sampled_from([0.0, 0.1, 0.4])),
        experience_scope=draw(st.sampled_from(["all", "first", "none"])),
        history_window=draw(st.sampled_from([0, 0, 2])),
        stop_on_success=draw(st.booleans()),
        truncate=draw(st.sampled_from([None, None, None, 0.3, 0.7])) if abandoned else None,
        mode=draw(st.sampled_from(["explore"] * 6 + ["eval"])),
    )


def explore_episodes(
    run_id: str = "r1", *, tokenizer: ChatTokenizer | None = None, abandoned: bool = True, prefix: str = "ep"
) -> st.SearchStrategy[list[EpisodeEvent]]:
    """Events of one explore episode (seq order)."""
    return st.builds(
        lambda spec, i: build_explore_episode(
            spec, run_id=run_id, episode_id=f"{prefix}{i}", tokenizer=tokenizer
        ),
        explore_specs(abandoned=abandoned),
        st.integers(0, 10**6),
    )


@st.composite
def rollout_groups(
    draw: st.DrawFn,
    run_id: str = "r1",
    *,
    tokenizer: ChatTokenizer | None = None,
    group_id: str | None = None,
) -> list[list[EpisodeEvent]]:
    """The episodes of one GRPO group (2..5 rollouts, sometimes with an abandoned first attempt)."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    return build_rollout_group(
        rng,
        run_id=run_id,
        group_id=group_id or f"g{draw(st.integers(0, 10**6))}",
        n=draw(st.integers(2, 5)),
        tokenizer=tokenizer,
        p_success=draw(st.sampled_from([0.0, 0.2, 0.5])),
        horizon=draw(st.integers(1, 6)),
        retry=draw(st.booleans()),
    )


@st.composite
def event_logs(
    draw: st.DrawFn,
    run_id: str = "r1",
    *,
    tokenizer: ChatTokenizer | None = None,
    max_episodes: int = 5,
    groups: bool = True,
) -> list[list[EpisodeEvent]]:
    """Per-episode event streams of a small run: explore trees and (optionally) rollout groups."""
    n = draw(st.integers(1, max_episodes))
    streams = [
        build_explore_episode(draw(explore_specs()), run_id=run_id, episode_id=f"ep{i}", tokenizer=tokenizer)
        for i in range(n)
    ]
    if groups:
        for k in range(draw(st.integers(0, 2))):
            streams += draw(rollout_groups(run_id, tokenizer=tokenizer, group_id=f"g{k}"))
    return streams


def interleaved(streams: Sequence[Sequence[EpisodeEvent]]) -> st.SearchStrategy[list[EpisodeEvent]]:
    """Random interleavings of ``streams`` that keep every episode's own order."""
    return st.randoms(use_true_random=False).map(lambda rng: interleave(streams, rng))
