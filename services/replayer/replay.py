"""``leafe replay``: rebuild a dataset (JSONL shards + manifest) from an event log, offline.

    leafe replay --from nats://127.0.0.1:4222 --run RUN --materializer leafe --model tiny --out DIR
    leafe replay --from runs/r1/events.leafelog --materializer grpo --out DIR [--config replay.toml]

``--from`` is a NATS URL (then ``--run`` is required and ``LEAFE_EVENTS`` is read for that run) or a
log file written by ``leafe log export`` (``--run`` then filters). Events are folded in log order by
the same materializer the online replayer runs (``leafe.learner.materializers``), after the same
admission checks (``leafe.protocol.codec.admit_event``: size, ``Leafe-Codec`` header, subject, event
id, an episode id that names its publisher), so it rebuilds what the replayer published; at the
end of the log every still-open episode is closed as abandoned (no samples from branches without an
Outcome). Records that fail admission and
events the fold rejects are counted and logged, never fatal. The online replayer's open-episode caps
apply here too (``max_open_episodes``, ``max_open_per_actor``, ``max_open_bytes``,
``max_open_bytes_per_actor``: the fold's memory is bounded by them, whatever the log holds); what
they refuse is counted, and named on stderr in one line that says which cap to raise. The dataset is
written with ``leafe.learner.dataset.write_dataset``: rebuilding the same log gives byte-identical
shards. A damaged or truncated log file (``leafe.services.eventlog.fileformat.LogFileError``,
checked to its trailer) or one that cannot be opened fails the command with one line on stderr and
no dataset written (``--debug``: the traceback); a partial dataset is never written from a damaged
file. So does every other failure a user can cause: a model that is not there, an ``--out`` that
cannot be written, a NATS server that does not answer.

Episode ids name their actor (``leafe.protocol.tasks``); ids that name none are admitted only from
logs recorded before (a file whose header predates them is read so by itself; tokenless subjects
need nothing) or with ``--legacy-ids`` (``legacy_episode_ids = true``: a stream or a newer file
holding such events); otherwise those events are refused, counted, and one stderr line says so.

``--config`` is a TOML file decoded into :class:`ReplayConfig`; flags override it. A rich progress
bar shows events and samples on a terminal (``--no-progress`` hides it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors as nats_errors
import structlog

from leafe.learner.materializers import (
    Folder,
    FoldResult,
    OpenLimits,
    make_materializer,
    write_folded,
)
from leafe.protocol.codec import Admission, ProtocolError, admit_event
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import EVENTS, events_filter
from leafe.services.bus import (
    NatsOptions,
    add_nats_arguments,
    connect,
    nats_options,
    read_stream,
    redact,
)
from leafe.services.config import load_config
from leafe.services.eventlog.fileformat import LogFileError, iter_log_file, read_log_header
from leafe.services.eventlog.transfer import for_header
from leafe.services.logsetup import configure_logging
from leafe.services.replayer.config import DEFAULT_MAX_OPEN_BYTES, DEFAULT_MAX_OPEN_BYTES_PER_ACTOR

__all__ = [
    "ReplayConfig",
    "file_events",
    "main",
    "resolve_config",
    "stream_event_count",
    "stream_events",
]

log = structlog.get_logger(__name__)


class ReplayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Configuration of ``leafe replay`` (TOML via ``--config``; flags override)."""

    materializer: str = "leafe"
    """Materializer name (``leafe``, ``grpo``, ``rft``)."""
    model: str = "default"
    """Tokenizer source: ``default`` (SmolLM2), ``tiny`` or an HF model directory."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Materializer options (see ``leafe.learner.materializers``), e.g. ``rehearsal_fraction =
    0.2``."""
    shard_size: int = 10_000
    """Samples per shard file."""
    max_event_bytes: int = EVENTS.max_msg_bytes
    """Records larger than this (headers included) are skipped, as the online replayer skips
    them."""
    require_codec_header: bool = True
    """Skip records without ``Leafe-Codec``; ``false`` to replay logs written before the header."""
    legacy_episode_ids: bool = False
    """Admit episode ids that name no owner (``true`` for a log recorded before ids named their
    actor; ``--legacy-ids``); the online replayer never does."""
    max_open_episodes: int = 16_384
    """Episodes held at once (as the online replayer's); an EpisodeStarted past it is refused,
    counted."""
    max_open_per_actor: int = 1024
    """Episodes one ``actor_id`` may hold at once; past it, refused."""
    max_open_bytes: int = DEFAULT_MAX_OPEN_BYTES
    """Bytes the held episodes' events may take
    (``leafe.learner.materializers.lifecycle.event_bytes``); an event past it is refused. Bounds
    memory whatever the log holds (a 2.6 MB file of unfinished episodes with 1 MB observations took
    2.3 GB without it)."""
    max_open_bytes_per_actor: int = DEFAULT_MAX_OPEN_BYTES_PER_ACTOR
    """Bytes one ``actor_id``'s events may take in held episodes (as the online replayer's)."""

    def __post_init__(self) -> None:
        for name in (
            "max_open_episodes",
            "max_open_per_actor",
            "max_open_bytes",
            "max_open_bytes_per_actor",
            "shard_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be at least 1")

    @property
    def limits(self) -> OpenLimits:
        """The open-episode caps of the fold."""
        return OpenLimits(
            max_open=self.max_open_episodes,
            max_per_actor=self.max_open_per_actor,
            max_bytes=self.max_open_bytes,
            max_bytes_per_actor=self.max_open_bytes_per_actor,
        )

    @property
    def admission(self) -> Admission:
        """The admission checks these settings ask for."""
        return Admission(
            max_event_bytes=self.max_event_bytes,
            require_codec_header=self.require_codec_header,
            legacy_episode_ids=self.legacy_episode_ids,
        )


def _decode(
    subject: str,
    data: bytes,
    headers: dict[str, str] | None,
    where: str,
    admission: Admission,
    refusals: Counter[str] | None,
) -> EpisodeEvent | None:
    try:
        return admit_event(subject, headers, data, admission)
    except ProtocolError as e:
        log.warning("replay.event.undecodable", where=where, reason=e.reason)
        if refusals is not None:
            refusals[e.category] += 1
        return None


def file_events(
    path: Path, admission: Admission = Admission(), refusals: Counter[str] | None = None
) -> Iterator[EpisodeEvent | None]:
    """Events of a ``leafe log export`` file in log order (``None`` for a record that fails
    admission, counted in ``refusals`` by category when given).

    A file written before episode ids named their actor (its header says so) is read with
    ``legacy_episode_ids``. Raises ``LogFileError`` (after the records before it) when the file is
    damaged or truncated, so the iteration ending without an error is what proves the log was whole.
    """
    admission = for_header(admission, read_log_header(path))
    for i, (subject, headers, data) in enumerate(iter_log_file(path)):
        where = f"{path} record {i} ({subject})"
        yield _decode(subject, data, headers, where, admission, refusals)


async def stream_events(
    js: Any, run_id: str, admission: Admission = Admission(), refusals: Counter[str] | None = None
) -> AsyncIterator[EpisodeEvent | None]:
    """Events of ``run_id`` on ``LEAFE_EVENTS`` at call time, in stream order (``None`` if
    refused, counted in ``refusals`` by category when given)."""
    async for msg in read_stream(js, stream=EVENTS.name, filter_subject=events_filter(run_id)):
        where = f"{msg.subject} seq {msg.metadata.sequence.stream}"
        yield _decode(msg.subject, msg.data, msg.headers, where, admission, refusals)


async def stream_event_count(js: Any, run_id: str) -> int:
    """Events of ``run_id`` stored now (for the progress bar's total)."""
    info = await js.stream_info(EVENTS.name, subjects_filter=events_filter(run_id))
    return int(sum((info.state.subjects or {}).values()))


class _Progress:
    """A rich progress bar over events (a no-op when disabled)."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        self._bar: Any = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            TextColumn("replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("events  {task.fields[samples]} samples"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._task = self._bar.add_task("events", total=total, samples=0)
        self._bar.start()

    def update(self, folder: Folder, *, force: bool = False) -> None:
        if self._bar is not None and (force or folder.result.events % 2000 == 0):
            self._bar.update(
                self._task, completed=folder.result.events, samples=len(folder.result.samples)
            )

    def close(self, folder: Folder) -> None:
        if self._bar is not None:
            self.update(folder, force=True)
            self._bar.stop()


def _fold_file(
    path: Path, folder: Folder, progress: bool, admission: Admission, refusals: Counter[str]
) -> FoldResult:
    bar = _Progress(progress, None)
    try:
        for event in file_events(path, admission, refusals):
            folder.feed(event)
            bar.update(folder)
    finally:
        bar.close(folder)
    return folder.finish()


async def _fold_stream(
    nats: NatsOptions,
    run_id: str,
    folder: Folder,
    progress: bool,
    admission: Admission,
    refusals: Counter[str],
) -> FoldResult:
    try:
        nc = await connect(nats, name="leafe-replay")
    except (
        OSError,
        nats_errors.Error,
    ) as e:  # said once, naming the server (its retries log at warning)
        raise ConnectionError(
            f"no NATS connection to {redact(nats.url)}: {type(e).__name__}: {e}"
        ) from e
    try:
        js = nc.jetstream()
        bar = _Progress(progress, await stream_event_count(js, run_id))
        try:
            async for event in stream_events(js, run_id, admission, refusals):
                folder.feed(event)
                bar.update(folder)
        finally:
            bar.close(folder)
    finally:
        await nc.close()
    return folder.finish()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leafe replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--from", dest="source", required=True, help="NATS URL (nats://...) or a leafe log file"
    )
    p.add_argument("--run", default=None, help="run id (required with a NATS URL; filters a file)")
    p.add_argument(
        "--materializer", default=None, help="leafe | grpo | rft (default from config: leafe)"
    )
    p.add_argument("--model", default=None, help="tokenizer: default | tiny | HF model dir")
    p.add_argument("--out", type=Path, required=True, help="dataset directory to (re)write")
    p.add_argument("--config", type=Path, default=None, help="TOML file with ReplayConfig fields")
    p.add_argument("--shard-size", type=int, default=None, help="samples per shard (default 10000)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--legacy-ids",
        action="store_true",
        default=None,
        help="admit episode ids that name no actor: a log recorded before ids named their owner",
    )
    p.add_argument(
        "--log-level",
        default="error",
        help="log level (default error: rejections are counted in the summary; "
        "warning logs each one)",
    )
    add_nats_arguments(p)
    p.add_argument(
        "--debug", action="store_true", help="on a log file error, raise it with its traceback"
    )
    return p


def _is_url(source: str) -> bool:
    return "://" in source or source.startswith(("nats:", "tls:"))


def resolve_config(args: argparse.Namespace) -> ReplayConfig:
    """The config file (if any) with flags applied on top."""
    overrides = {
        "materializer": args.materializer,
        "model": args.model,
        "shard_size": args.shard_size,
        "legacy_episode_ids": args.legacy_ids,
    }
    return load_config(ReplayConfig, files=[args.config], overrides=overrides)


_USER_ERRORS = (LogFileError, OSError, ValueError, nats_errors.Error)
"""What a user can cause (a damaged log, a missing model, an unwritable ``--out``, a NATS server
that is down or refuses): one line on stderr, never a traceback (``--debug`` raises it)."""


def main(argv: list[str]) -> int:
    """Entry point of ``leafe replay``."""
    p = _parser()
    args = p.parse_args(argv)
    configure_logging(json=False, level=args.log_level)
    try:
        config = resolve_config(args)
        nats_opts = nats_options(args)
    except ValueError as e:
        p.error(str(e))
    if _is_url(args.source) and not args.run:
        p.error("--run is required when replaying from a NATS URL")
    try:
        return _replay(args, config, nats_opts)
    except _USER_ERRORS as e:
        if args.debug:
            raise
        print(
            f"leafe replay: {_one_line(e)}", file=sys.stderr
        )  # nothing written: it would be partial
        return 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, LogFileError) else f"{type(e).__name__}: {text}"


def _replay(args: argparse.Namespace, config: ReplayConfig, nats_opts: NatsOptions) -> int:
    from leafe.learner.model_io import (  # transformers: only once the flags are good
        HFChatTokenizer,
        resolve_model,
    )

    fold = make_materializer(
        config.materializer, HFChatTokenizer.from_dir(resolve_model(config.model)), **config.options
    )
    fold.limits = config.limits
    folder = Folder(fold, run_id=args.run)
    progress = not args.no_progress and sys.stderr.isatty()
    refusals: Counter[str] = Counter()
    if _is_url(args.source):
        nats_opts = msgspec.structs.replace(nats_opts, url=args.source)
        result = asyncio.run(
            _fold_stream(nats_opts, args.run, folder, progress, config.admission, refusals)
        )
    else:
        result = _fold_file(Path(args.source), folder, progress, config.admission, refusals)
    manifest = write_folded(result, fold, args.out, run_id=args.run, shard_size=config.shard_size)
    counts = ", ".join(f"{k}={v}" for k, v in manifest.counts_by_kind.items()) or "none"
    print(
        f"replayed {result.events} events -> {manifest.samples} samples ({counts}) in "
        f"{len(manifest.shards)} "
        f"shard(s) at {args.out}; rejected {result.rejected}, undecodable {result.undecodable}, "
        f"prompt mismatches {fold.stats.prompt_mismatches}; content sha256 "
        f"{manifest.content_sha256}"
    )
    if refusals["unowned_episode"]:
        print(
            f"leafe replay: {refusals['unowned_episode']} events refused: their episode ids name "
            "no actor (a log recorded before ids named their owner?); replay it with --legacy-ids",
            file=sys.stderr,
        )
    if result.capped:
        print(
            f"leafe replay: {result.capped} events refused over the open-episode caps "
            f"({fold.stats.episodes_refused} episodes; first: {result.first_capped}); raise "
            "max_open_episodes, "
            "max_open_per_actor, max_open_bytes or max_open_bytes_per_actor in --config to fold "
            "them",
            file=sys.stderr,
        )
    return 0
