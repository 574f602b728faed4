"""``leafe log inspect``: counts per kind and per episode, sequence range, engine requests and their
prefix cache share by kind, and a readable episode dump.

A fold over :class:`leafe.services.eventlog.fileformat.LogRecord` (from a file or the stream),
rendered with rich (plain text when not on a terminal) or as JSON (``--json``). See
``services/eventlog/cli.py`` for the CLI.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterable

import msgspec
from rich.console import Console
from rich.table import Table

from leafe.protocol.codec import CODEC_HEADER, ProtocolError, decode_event
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
from leafe.services.eventlog.fileformat import LogRecord

__all__ = [
    "REQUEST_KINDS",
    "EngineUsage",
    "EpisodeSummary",
    "LogSummary",
    "Summarizer",
    "describe",
    "render",
    "request_kind",
    "summarize",
    "summarize_stream",
]

UNDECODABLE = "<undecodable>"
_TEXT = 70


class EpisodeSummary(msgspec.Struct, kw_only=True):
    """What the log holds about one episode."""

    episode_id: str
    env: str = ""
    task_id: str = ""
    mode: str = ""
    events: int = 0
    steps: int = 0
    branches: int = 0
    reflections: int = 0
    success: bool | None = None
    """From ``EpisodeFinished``; ``None`` when the episode never finished (abandoned or in
    progress)."""
    first_seq: int = 0
    last_seq: int = 0


REQUEST_KINDS = ("root_step", "branch_step", "reflection")
"""Engine requests by what they were for: an action on a tree's root branch (every step of a rollout
or an evaluation), an action on a rolled-back branch, a reflection written by the policy."""


def request_kind(event: EpisodeEvent, mode: str) -> str | None:
    """Which of :data:`REQUEST_KINDS` the engine answered for ``event`` (an episode of ``mode``);
    ``None`` when no engine did: the expert's steps of a demonstration, an oracle's reflection,
    other events."""
    match event:
        case Step(branch_id=branch):
            if branch == ROOT_BRANCH:
                return None if mode == "demo" else "root_step"
            return "branch_step"
        case Reflection(source="model"):
            return "reflection" if event.prompt_tokens or event.prompt_sha256 else None
    return None


class EngineUsage(msgspec.Struct, kw_only=True):
    """Engine requests of one kind and their tokens, as the events record them
    (``Step.prompt_tokens``, ``cached_tokens``, ``token_ids``; the same on ``Reflection``). Logs
    written before the events carried ``cached_tokens`` (and, for reflections, ``prompt_tokens``)
    count as ``unrecorded`` (and 0 prompt tokens): the cache share is then unknown, not 0."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache."""
    output_tokens: int = 0
    unrecorded: int = 0
    """Requests whose event does not say how much of the prompt was cached."""

    def add(self, event: Step | Reflection) -> None:
        self.requests += 1
        self.prompt_tokens += event.prompt_tokens
        self.output_tokens += len(event.token_ids)
        if event.cached_tokens is None:
            self.unrecorded += 1
        else:
            self.cached_tokens += event.cached_tokens

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the engine had to compute (all of them where the cached count is
        unrecorded)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def cache_share(self) -> float | None:
        """Share of the prompt tokens served from the prefix cache; ``None`` without prompt tokens
        or when some request did not record it."""
        return (
            self.cached_tokens / self.prompt_tokens
            if self.prompt_tokens and not self.unrecorded
            else None
        )

    def as_dict(self) -> dict[str, int | float | None]:
        """The counts with ``prefilled_tokens`` and ``cache_share``."""
        counts: dict[str, int | float | None] = dict(msgspec.structs.asdict(self))
        return {
            **counts,
            "prefilled_tokens": self.prefilled_tokens,
            "cache_share": self.cache_share,
        }


class LogSummary(msgspec.Struct, kw_only=True):
    """Counts over a whole log."""

    records: int = 0
    undecodable: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    kinds: dict[str, int] = msgspec.field(default_factory=dict)
    episodes: dict[str, EpisodeSummary] = msgspec.field(default_factory=dict)
    engine: dict[str, EngineUsage] = msgspec.field(default_factory=dict)
    """Engine requests by :func:`request_kind` (kinds with none are absent)."""


def _kind(event: EpisodeEvent) -> str:
    return str(type(event).__struct_config__.tag)


class Summarizer:
    """Fold records into a :class:`LogSummary`, keeping the events of one episode for a dump."""

    def __init__(self, episode: str | None = None) -> None:
        self.summary = LogSummary()
        self.episode = episode
        self.dump: list[tuple[int, EpisodeEvent]] = []

    def add(self, record: LogRecord) -> None:
        s = self.summary
        s.records += 1
        seq = record.stream_seq
        s.first_seq = seq if s.first_seq is None else min(s.first_seq, seq)
        s.last_seq = seq if s.last_seq is None else max(s.last_seq, seq)
        try:
            event = decode_event(record.data, record.headers.get(CODEC_HEADER))
        except ProtocolError:
            s.undecodable += 1
            s.kinds[UNDECODABLE] = s.kinds.get(UNDECODABLE, 0) + 1
            return
        kind = _kind(event)
        s.kinds[kind] = s.kinds.get(kind, 0) + 1
        ep = s.episodes.get(event.episode_id)
        if ep is None:
            ep = s.episodes[event.episode_id] = EpisodeSummary(
                episode_id=event.episode_id, first_seq=seq
            )
        ep.events += 1
        ep.last_seq = seq
        request = request_kind(event, ep.mode)
        if request is not None:
            assert isinstance(event, Step | Reflection)
            s.engine.setdefault(request, EngineUsage()).add(event)
        match event:
            case EpisodeStarted():
                ep.env, ep.task_id, ep.mode, ep.branches = event.env, event.task_id, event.mode, 1
            case Step():
                ep.steps += 1
            case Branch():
                ep.branches += 1
            case Reflection():
                ep.reflections += 1
            case EpisodeFinished():
                ep.success = event.success
        if event.episode_id == self.episode:
            self.dump.append((seq, event))


def summarize(
    records: Iterable[LogRecord], episode: str | None = None
) -> tuple[LogSummary, list[tuple[int, EpisodeEvent]]]:
    """Summary of ``records`` and the ``(stream_seq, event)`` list of ``episode`` (empty if not
    given)."""
    folder = Summarizer(episode)
    for record in records:
        folder.add(record)
    return folder.summary, folder.dump


async def summarize_stream(
    records: AsyncIterator[LogRecord], episode: str | None = None
) -> tuple[LogSummary, list[tuple[int, EpisodeEvent]]]:
    """:func:`summarize` over an async iterator (``transfer.iter_stream_records``)."""
    folder = Summarizer(episode)
    async for record in records:
        folder.add(record)
    return folder.summary, folder.dump


def _short(text: str, n: int = _TEXT) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 3] + "..."


def describe(event: EpisodeEvent) -> str:
    """One readable line about an event."""
    match event:
        case EpisodeStarted(env=env, task_id=task_id, split=split, mode=mode, seed=seed):
            return f"{env} {task_id} ({split}, {mode}, seed {seed}): {_short(event.task)}"
        case Step(branch_id=b, t=t, action=action, reward=reward):
            flags = (" done" if event.done else "") + (" SUCCESS" if event.success else "")
            return (
                f"{b} t={t} {action!r} r={reward:g}{flags} -> "
                f"{_short(event.feedback or event.observation)}"
            )
        case Reflection(branch_id=b, at_t=at_t, trigger=trigger, tau=tau):
            return f"{b} at_t={at_t} {trigger} tau={tau}: {_short(event.experience)}"
        case Rollback(from_branch=b, tau=tau, method=method):
            return f"{b} -> tau={tau} by {method} ({event.replay_steps} replay steps)"
        case Branch(branch_id=b, parent_branch_id=parent, tau=tau, depth=depth):
            return f"{b} from {parent}@{tau} depth {depth}: {_short(event.experience)}"
        case Outcome(branch_id=b, success=success, score=score, steps=steps):
            return f"{b} success={success} score={score:g} steps={steps} ({event.reason})"
        case EpisodeFinished(success=success, branches=branches, actions=actions):
            return (
                f"success={success} branches={branches} actions={actions} "
                f"reflections={event.reflections}"
            )
    return repr(event)


def render(
    summary: LogSummary,
    dump: list[tuple[int, EpisodeEvent]],
    *,
    as_json: bool = False,
    limit: int = 50,
    console: Console | None = None,
) -> None:
    """Print the summary tables, or the one-line summary and the episode dump, or one JSON
    document."""
    if as_json:
        doc = msgspec.to_builtins(summary)
        doc["engine"] = {kind: usage.as_dict() for kind, usage in summary.engine.items()}
        doc["dump"] = [
            {"stream_seq": seq, "kind": _kind(e), **msgspec.to_builtins(e)} for seq, e in dump
        ]
        print(json.dumps(doc, indent=2))
        return
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    console.print(
        f"[bold]{summary.records}[/bold] records, sequences "
        f"{summary.first_seq}..{summary.last_seq}, "
        f"{len(summary.episodes)} episodes, {summary.undecodable} undecodable"
    )
    if dump:
        _render_dump(console, dump)
        return
    kinds = Table("kind", "count", title="events per kind")
    for kind, count in sorted(summary.kinds.items()):
        kinds.add_row(kind, str(count))
    console.print(kinds)
    if summary.engine:
        engine = Table(
            "request", "requests", "prompt tokens", "from the prefix cache", "output tokens",
            title="engine requests",
        )  # fmt: skip
        for kind in REQUEST_KINDS:
            if (u := summary.engine.get(kind)) is not None:
                share = "-" if u.cache_share is None else f"{u.cache_share:.1%}"
                engine.add_row(
                    kind, str(u.requests), str(u.prompt_tokens), share, str(u.output_tokens)
                )
        console.print(engine)
    episodes = Table(
        "episode", "env", "task", "mode", "events", "steps", "branches", "success", "seqs"
    )
    for ep in list(summary.episodes.values())[:limit]:
        success = "-" if ep.success is None else str(ep.success)
        counts = (str(ep.events), str(ep.steps), str(ep.branches))
        episodes.add_row(
            ep.episode_id,
            ep.env,
            ep.task_id,
            ep.mode,
            *counts,
            success,
            f"{ep.first_seq}..{ep.last_seq}",
        )
    if len(summary.episodes) > limit:
        episodes.caption = f"{len(summary.episodes) - limit} more episodes not shown (--limit)"
    console.print(episodes)


def _render_dump(console: Console, dump: list[tuple[int, EpisodeEvent]]) -> None:
    table = Table("seq", "#", "kind", "details", title=f"episode {dump[0][1].episode_id}")
    for seq, event in dump:
        table.add_row(str(seq), str(event.seq), _kind(event), describe(event))
    console.print(table)
