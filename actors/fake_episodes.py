"""Synthetic event streams for tests and benchmarks: explore trees (LEAFE) and GRPO rollout groups.

The builders simulate what an actor publishes, following the contract in ``leafe.protocol.events``
and ``leafe.protocol.prompt``: a breadth-first tree of branches (reflection -> rollback -> branch ->
steps -> outcome), periodic and failure reflections, unparsable completions, experience in context
for a branch's first step or all of its steps, and each Step's ``prompt_sha256`` computed from the
exact prompt the actor would have sent (when a tokenizer is given). Every experience text contains
the marker :data:`EXPERIENCE_MARKER`, which appears nowhere else, so a test can prove it never leaks
into inputs.

The builders (``build_explore_episode``, ``build_rollout_group``, ``interleave``) take a
``random.Random``; ``bench/replay.py`` makes million-event logs with them, and the Hypothesis
strategies of the property suites (``tests/support/episodes.py``) wrap them. A fake like
``actors/fakes.py``: never used by the product itself.

Episode ids name their actor, as a real actor's do (``leafe.protocol.tasks.episode_id_for``): the
``episode_id`` a builder or :class:`EventWriter` is given is the id's stem, and the events carry
``<stem>@<actor>`` (:func:`fake_episode_id`). An id that names an actor already is kept as given;
``EventWriter(..., legacy=True)`` keeps any id (logs written before ids named their owner). Fake
events carry no ``msg_nonce`` (their ``Nats-Msg-Id`` is their id), so a log is the same on every
build; a real actor draws one per event.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from leafe.actors.episode import stamp_event
from leafe.protocol.events import (
    ROOT_BRANCH,
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Rollback,
    Step,
)
from leafe.protocol.prompt import ChatTokenizer, HistoryEntry, prompt_sha256, render_messages
from leafe.protocol.tasks import episode_owner, owned_episode_id

__all__ = [
    "ACTIONS",
    "EXPERIENCE_MARKER",
    "INSTRUCTIONS",
    "EventWriter",
    "ExploreSpec",
    "build_explore_episode",
    "build_rollout_group",
    "fake_episode_id",
    "interleave",
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


def fake_episode_id(stem: str, actor_id: str) -> str:
    """``<stem>@<actor_id>``, or ``stem`` as given if it names an actor already."""
    if episode_owner(stem) is not None:
        return stem
    return owned_episode_id(stem, actor_id)


@dataclass
class EventWriter:
    """Stamps events with ids, seq, run and actor like an actor's publisher (``emit(Step, ...)``);
    ``seq=`` overrides the next sequence number (a forger's events, say). ``episode_id`` becomes
    :func:`fake_episode_id` of it unless ``legacy``."""

    run_id: str
    episode_id: str
    actor_id: str = "actor-0"
    policy_version: str = "v000001"
    events: list[EpisodeEvent] = field(default_factory=list)
    legacy: bool = False

    def __post_init__(self) -> None:
        if not self.legacy:
            self.episode_id = fake_episode_id(self.episode_id, self.actor_id)

    def emit(self, cls: type[Any], **fields: Any) -> Any:
        seq = fields.pop("seq", len(self.events))
        event = stamp_event(cls, self, seq, 1.7e9 + seq, **fields)
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

    def step(
        self, branch_id: str, path: list[Step], experience: str | None, p_success: float
    ) -> Step:
        rng, t = self.rng, len(path)
        parsed = rng.random() >= self.spec.p_parse_fail
        action = rng.choice(ACTIONS) if parsed else None
        raw = (
            f"I will move. <action>{action}</action>"
            if parsed
            else rng.choice(["hmm", "Let me think.", ""])
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
    """Steps of one branch until success, horizon or budget; queues branch requests from
    reflections."""
    spec, path = ep.spec, list(prefix)
    first = len(path)
    success = False
    while len(path) - first < spec.horizon and ep.actions < spec.budget and not success:
        in_ctx = experience and (
            spec.experience_scope == "all"
            or (spec.experience_scope == "first" and len(path) == first)
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
        Outcome,
        branch_id=branch_id,
        success=success,
        score=float(success),
        steps=len(path),
        reason=reason,
    )
    return success


def _reflect(ep: _Episode, branch_id: str, path: list[Step], trigger: str, depth: int) -> tuple:
    ep.reflections += 1
    tau = ep.rng.randrange(len(path))
    experience = (
        f"{EXPERIENCE_MARKER}{ep.w.episode_id}/{ep.reflections}: do not push the box into a corner"
    )
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
    # The content depends on the spec and the episode's name within its run, never on the run id
    # (tests put the run id, which carries a pid, into episode ids to keep runs apart on a shared
    # server).
    rng = random.Random(f"{spec.seed}:{episode_id.removeprefix(f'{run_id}-')}")
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

    With ``retry`` the first member is also run as an abandoned attempt (no EpisodeFinished) before
    its retry, as happens when an actor crashes and the task is redelivered.
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
    # The content depends on the spec and the episode's name within its run, never on the run id
    # (tests put the run id, which carries a pid, into episode ids to keep runs apart on a shared
    # server).
    rng = random.Random(f"{spec.seed}:{episode_id.removeprefix(f'{run_id}-')}")
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
    w.emit(
        EpisodeFinished,
        success=success,
        branches=1,
        actions=ep.actions,
        parse_failures=ep.parse_failures,
    )
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
