"""Hostile input for the replayer's tests: episodes built to break a fold, and raw publishes that
bypass the ``Publisher`` (what any authenticated publisher can send).

    # each Branch the child of the previous one
    events = branch_chain(run_id, "deep", depth=1200)
    # stored as given; returns its stream seq
    seq = await publish_raw(js, subject, data, headers)
    # encoded so that headers + body == total
    data = pad_to(step, total=max_payload, headers=headers)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from leafe.actors.fake_episodes import INSTRUCTIONS, EventWriter
from leafe.protocol.codec import CODEC_HEADER, CODEC_VERSION, MSG_ID_HEADER, encode
from leafe.protocol.events import (
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Step,
)
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import ChatMessage
from leafe.protocol.subjects import event_subject

__all__ = [
    "PoisonTokenizer",
    "branch_chain",
    "child_pids",
    "flood_starts",
    "headers_of",
    "is_running",
    "pad_to",
    "publish_each",
    "publish_raw",
    "started_fields",
    "step_fields",
    "wire_size",
]


def started_fields(episode_id: str, **over: Any) -> dict[str, Any]:
    """Fields of an explore ``EpisodeStarted`` (train split), ``over`` on top."""
    fields: dict[str, Any] = dict(
        task_key=f"{episode_id}-task",
        env="sokoban",
        task_id="sokoban/train/00001",
        split="train",
        seed=0,
        mode="explore",
        task="Push the box onto the target.",
        observation="#####\n#@$.#\n#####",
        instructions=INSTRUCTIONS,
    )
    fields.update(over)
    return fields


def step_fields(branch_id: str, t: int, **over: Any) -> dict[str, Any]:
    """Fields of a parsed ``Step`` on ``branch_id`` at ``t``, ``over`` on top."""
    fields: dict[str, Any] = dict(
        branch_id=branch_id,
        t=t,
        action="up",
        raw_text="<action>up</action>",
        token_ids=[27, 1842, 29, 1312],
        observation=f"obs {branch_id}:{t}",
    )
    fields.update(over)
    return fields


def branch_chain(
    run_id: str,
    episode_id: str,
    *,
    depth: int,
    tau: int = 1,
    actor_id: str = "actor-0",
    **started: Any,
) -> list[EpisodeEvent]:
    """One episode: a root step, then ``depth`` Branch events each the child of the previous one
    (each after its Reflection), then a successful step and Outcome on the deepest branch,
    EpisodeFinished.

    Every event is valid on its own; the deepest branch's counterfactual needs its whole ancestry.
    """
    w = EventWriter(run_id, episode_id, actor_id=actor_id)
    w.emit(EpisodeStarted, **started_fields(episode_id, **started))
    w.emit(Step, **step_fields("b0", 0, observation="after up"))
    parent = "b0"
    for i in range(1, depth + 1):
        refl = w.emit(
            Reflection,
            branch_id=parent,
            at_t=1,
            trigger="failure",
            tau=0,
            experience=f"lesson {i}",
            raw_text="<tau>0</tau>",
        )
        branch = f"b{i}"
        w.emit(
            Branch,
            branch_id=branch,
            parent_branch_id=parent,
            tau=tau,
            reflection_event_id=refl.event_id,
            experience=f"lesson {i}",
            depth=i,
        )
        parent = branch
    w.emit(
        Step,
        **step_fields(parent, tau, action="down", raw_text="<action>down</action>", success=True),
    )
    w.emit(Outcome, branch_id=parent, success=True, score=1.0, steps=tau + 1, reason="success")
    w.emit(EpisodeFinished, success=True, branches=depth + 1, actions=2, reflections=depth)
    return w.events


def flood_starts(
    run_id: str, n: int, *, actor_id: str, mode: str = "explore", name: str | None = None
) -> list[EpisodeEvent]:
    """``n`` EpisodeStarted of ``actor_id`` (episodes ``<run>-<name>-<i>``, ``name`` the actor's by
    default, each id naming the actor) that never finish."""
    out: list[EpisodeEvent] = []
    for i in range(n):
        eid = f"{run_id}-{name or actor_id}-{i}"
        w = EventWriter(run_id, eid, actor_id=actor_id)
        out.append(w.emit(EpisodeStarted, **started_fields(eid, mode=mode)))
    return out


def headers_of(event: EpisodeEvent, **extra: str) -> dict[str, str]:
    """The headers the ``Publisher`` would send with ``event``, ``extra`` on top."""
    return {MSG_ID_HEADER: event.event_id, CODEC_HEADER: CODEC_VERSION, **extra}


def wire_size(data: bytes, headers: dict[str, str]) -> int:
    """Bytes the server counts against ``max_payload`` for a message: its header block plus its
    body."""
    block = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return len(block.encode()) + len(data)


def pad_to(event: msgspec.Struct, field: str, *, total: int, headers: dict[str, str]) -> bytes:
    """``event`` encoded with its string ``field`` padded so that headers + body are exactly
    ``total``."""
    size = total - wire_size(b"", headers)
    n = size - len(encode(msgspec.structs.replace(event, **{field: ""})))
    for _ in range(4):  # the string's length prefix grows with it
        data = encode(msgspec.structs.replace(event, **{field: "x" * n}))
        if len(data) == size:
            return data
        n -= len(data) - size
    raise AssertionError(f"cannot pad {type(event).__name__} to {total} bytes")


async def publish_raw(js: Any, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
    """Publish bytes as given (no size or header checks); returns the stream sequence it was stored
    at."""
    ack = await js.publish(subject, data, headers=headers)
    return int(ack.seq)


async def publish_each(js: Any, events: list[EpisodeEvent]) -> list[int]:
    """Publish ``events`` one by one with the Publisher's headers, bypassing its checks; their
    seqs."""
    out = []
    for e in events:
        subject = event_subject(e.run_id, str(type(e).__struct_config__.tag), e.actor_id)
        out.append(await publish_raw(js, subject, encode(e), headers_of(e)))
    return out


def child_pids(pid: int) -> list[int]:
    """Child processes of ``pid`` (Linux ``/proc``)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def is_running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


class PoisonTokenizer:
    """A tokenizer that raises on any prompt containing ``marker``: a stand-in for any bug a hostile
    event could trigger while its episode is folded (the fold must contain it to that episode)."""

    def __init__(self, inner: ChatTokenizer, marker: str = "POISON") -> None:
        self.inner = inner
        self.marker = marker

    def encode_chat(self, messages: Sequence[ChatMessage], response_prefix: str = "") -> list[int]:
        """The inner tokenizer's ids, or ``ValueError`` when ``marker`` is in a message."""
        if any(self.marker in m.content for m in messages):
            raise ValueError(f"tokenizer choked on {self.marker}")
        return self.inner.encode_chat(messages, response_prefix)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The inner tokenizer's text."""
        return self.inner.decode(token_ids)
