"""Shared Hypothesis strategies for every wire type of ``protocol/`` (import these, don't redefine
them).

Field-level strategies draw every field, defaults included, over its whole legal range (any unicode
text, 64-bit ints, infinities, ``None`` where allowed), so codec round-trips cover what a real log
can hold. For *coherent* episodes (branch geometry, prompts) see ``tests/support/episodes.py``;
:func:`make_episode` here is a small deterministic episode with one event of every kind, for bus and
log tests that need realistic traffic without Hypothesis.

    from tests.support.strategies import episode_events, tasks, samples, weights, wire_messages
"""

from __future__ import annotations

import string
from typing import Any

import msgspec
from hypothesis import strategies as st

from leafe.actors.fake_episodes import fake_episode_id
from leafe.protocol.codec import decode_event, decode_sample, decode_task, decode_weights
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
    WeightsPublished,
    event_id_for,
)
from leafe.protocol.samples import ChatMessage, Sample
from leafe.protocol.tasks import TaskAssignment

__all__ = [
    "DECODERS",
    "branches",
    "episode_events",
    "episode_finished",
    "episode_started",
    "floats",
    "ids",
    "invalid_run_ids",
    "make_episode",
    "msgpack_values",
    "outcomes",
    "reflections",
    "rollbacks",
    "run_ids",
    "samples",
    "steps",
    "tasks",
    "texts",
    "token_ids",
    "weights",
    "wire_messages",
]

_ID_CHARS = string.ascii_letters + string.digits + "-_."
run_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
"""Valid run ids (what ``leafe.protocol.subjects.validate_run_id`` accepts)."""
_RUN_CHARS = set(string.ascii_letters + string.digits + "_-")
_bad_char = st.sampled_from(list(". *>\t\n/$"))
invalid_run_ids = st.one_of(
    st.just(""),
    st.text(min_size=65, max_size=80, alphabet=string.ascii_letters),
    st.from_regex(r"\A[_-][A-Za-z0-9_-]{0,10}\Z"),
    st.builds(
        lambda a, c, b: a + c + b,
        st.text(_ID_CHARS, max_size=5),
        _bad_char,
        st.text(_ID_CHARS, max_size=5),
    ),
    st.text(min_size=1, max_size=20).filter(lambda s: not set(s) <= _RUN_CHARS),
)
"""Run ids that must be rejected: empty, too long, leading ``_``/``-``, dots, spaces, wildcards,
unicode."""
ids = st.text(_ID_CHARS, min_size=1, max_size=40)
actor_ids = run_ids.filter(lambda a: a != "legacy")
"""Actor ids: what may be an event subject's actor token (a run id's rules, not the reserved
``legacy``)."""
texts = st.text(max_size=200)
small = st.integers(0, 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
floats = st.floats(allow_nan=False)
"""Any float but NaN (NaN != NaN would make equality round-trips meaningless)."""
token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=64)
logprobs = st.none() | st.lists(st.floats(max_value=0.0, allow_nan=False), max_size=64)
_strs = st.lists(texts, max_size=4)


def _base() -> dict[str, st.SearchStrategy[Any]]:
    return {
        "event_id": ids,
        "run_id": run_ids,
        "episode_id": ids,
        "actor_id": actor_ids,
        "seq": small,
        "policy_version": texts,
        "ts": floats,
    }


episode_started = st.builds(
    EpisodeStarted,
    **_base(),
    task_key=ids,
    env=texts,
    task_id=texts,
    split=st.sampled_from(["train", "test"]),
    seed=i64,
    mode=st.sampled_from(["explore", "rollout", "eval"]),
    task=texts,
    observation=texts,
    instructions=texts,
    prompt_format=texts,
    history_window=small,
    group_id=st.none() | ids,
    group_size=small,
    config_digest=texts,
    attempt=small,
)
steps = st.builds(
    Step,
    **_base(),
    branch_id=ids,
    t=small,
    action=st.none() | texts,
    raw_text=texts,
    token_ids=token_ids,
    logprobs=logprobs,
    observation=texts,
    reward=floats,
    done=st.booleans(),
    success=st.booleans(),
    feedback=texts,
    parse_ok=st.booleans(),
    experience_in_context=st.booleans(),
    prompt_tokens=small,
    prompt_sha256=texts,
    finish_reason=st.sampled_from(["", "stop", "length", "abort"]),
)
reflections = st.builds(
    Reflection,
    **_base(),
    branch_id=ids,
    at_t=small,
    trigger=st.sampled_from(["periodic", "failure", "horizon"]),
    tau=small,
    experience=texts,
    raw_text=texts,
    token_ids=token_ids,
    parse_ok=st.booleans(),
    flags=_strs,
    oracle_tau=st.none() | small,
    oracle_experience=texts,
    prompt_sha256=texts,
)
rollbacks = st.builds(
    Rollback,
    **_base(),
    from_branch=ids,
    tau=small,
    method=st.sampled_from(["snapshot", "replay"]),
    replay_steps=small,
)
branches = st.builds(
    Branch,
    **_base(),
    branch_id=ids,
    parent_branch_id=ids,
    tau=small,
    reflection_event_id=ids,
    experience=texts,
    depth=small,
)
outcomes = st.builds(
    Outcome,
    **_base(),
    branch_id=ids,
    success=st.booleans(),
    score=floats,
    steps=small,
    reason=st.sampled_from(["success", "env_done", "horizon", "budget", "error"]),
    error=texts,
)
episode_finished = st.builds(
    EpisodeFinished,
    **_base(),
    success=st.booleans(),
    branches=small,
    actions=small,
    reflections=small,
    replay_steps=small,
    parse_failures=small,
)
episode_events: st.SearchStrategy[EpisodeEvent] = st.one_of(
    episode_started, steps, reflections, rollbacks, branches, outcomes, episode_finished
)
"""Any event of the ``LEAFE_EVENTS`` stream."""

tasks = st.builds(
    TaskAssignment,
    task_key=ids,
    run_id=run_ids,
    env=texts,
    task_id=texts,
    split=st.sampled_from(["train", "test"]),
    mode=st.sampled_from(["explore", "rollout", "eval"]),
    seed=i64,
    group_id=st.none() | ids,
    group_size=small,
    env_options=st.dictionaries(texts, st.one_of(texts, i64, floats, st.booleans()), max_size=4),
)
_messages = st.lists(
    st.builds(ChatMessage, role=st.sampled_from(["system", "user", "assistant"]), content=texts),
    max_size=4,
)
samples = st.builds(
    Sample,
    sample_id=ids,
    run_id=run_ids,
    kind=st.sampled_from(["cf", "reh", "rft", "grpo"]),
    materializer=texts,
    env=texts,
    task_id=texts,
    episode_id=ids,
    messages=_messages,
    target_turn=small,
    prompt_ids=token_ids,
    completion_ids=token_ids,
    policy_version=texts,
    weight=floats,
    source_event_ids=st.lists(ids, max_size=4),
    advantage=st.none() | floats,
    reward=st.none() | floats,
    behaviour_logprobs=logprobs,
    group_id=st.none() | ids,
)
weights = st.builds(
    WeightsPublished,
    event_id=ids,
    run_id=run_ids,
    version=texts,
    uri=texts,
    manifest_sha256=texts,
    learner_step=small,
    base_model=texts,
    samples_seq=small,
    ts=floats,
)

DECODERS: dict[type, Any] = {
    **dict.fromkeys(
        (EpisodeStarted, Step, Reflection, Rollback, Branch, Outcome, EpisodeFinished), decode_event
    ),
    TaskAssignment: decode_task,
    Sample: decode_sample,
    WeightsPublished: decode_weights,
}
"""The decoder of each wire type."""
wire_messages: st.SearchStrategy[msgspec.Struct] = st.one_of(
    episode_events, tasks, samples, weights
)
"""Any message that crosses a process boundary; decode it with ``DECODERS[type(msg)]``."""

msgpack_values = st.recursive(
    st.none() | st.booleans() | i64 | floats | texts | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts | small, inner, max_size=5),
    max_leaves=20,
)
"""Arbitrary msgpack-encodable values (well-formed msgpack of the wrong shape)."""


def make_episode(
    run_id: str,
    episode_id: str,
    *,
    steps: int = 6,
    obs_chars: int = 120,
    actor_id: str = "actor-0",
    legacy: bool = False,
) -> list[EpisodeEvent]:
    """A deterministic episode of ``actor_id`` with every event kind: start, steps, reflection,
    rollback, branch, outcomes. Its id is ``episode_id`` made to name the actor, as an actor's does
    (``leafe.actors.fake_episodes.fake_episode_id``), or kept as given with ``legacy`` (a log
    recorded before ids named their actor)."""
    if not legacy:
        episode_id = fake_episode_id(episode_id, actor_id)
    common = {
        "run_id": run_id,
        "episode_id": episode_id,
        "actor_id": actor_id,
        "policy_version": "v1",
    }
    events: list[EpisodeEvent] = []

    def emit(cls: type[Any], **fields: Any) -> None:
        seq = len(events)
        events.append(
            cls(event_id=event_id_for(episode_id, seq), seq=seq, ts=1e9 + seq, **common, **fields)
        )

    board = ("#@ $ .#\n" * (obs_chars // 8 + 1))[:obs_chars]
    emit(
        EpisodeStarted,
        task_key=f"{episode_id}-task",
        env="sokoban",
        task_id="sokoban/train/00001",
        split="train",
        seed=7,
        mode="explore",
        task="Push the box onto the target.",
        observation=board,
        instructions="Answer with <action>up|down|left|right</action>.",
    )
    for t in range(steps):
        emit(
            Step,
            branch_id=ROOT_BRANCH,
            t=t,
            action="up",
            raw_text=f"<action>up</action> {t}",
            token_ids=list(range(t, t + 12)),
            observation=board,
            reward=0.0,
        )
    emit(Outcome, branch_id=ROOT_BRANCH, success=False, steps=steps, reason="horizon")
    emit(
        Reflection,
        branch_id=ROOT_BRANCH,
        at_t=steps,
        trigger="failure",
        tau=1,
        experience="Go left first.",
        raw_text="<tau>1</tau>",
    )
    refl = events[-1].event_id
    emit(Rollback, from_branch=ROOT_BRANCH, tau=1, method="replay", replay_steps=1)
    emit(
        Branch,
        branch_id="b1",
        parent_branch_id=ROOT_BRANCH,
        tau=1,
        reflection_event_id=refl,
        experience="Go left first.",
        depth=1,
    )
    emit(
        Step,
        branch_id="b1",
        t=1,
        action="left",
        raw_text="<action>left</action>",
        token_ids=[5, 6],
        observation=board,
        reward=1.0,
        done=True,
        success=True,
    )
    emit(Outcome, branch_id="b1", success=True, score=1.0, steps=2, reason="success")
    emit(
        EpisodeFinished, success=True, branches=2, actions=steps + 1, reflections=1, replay_steps=1
    )
    return events
