"""structlog configuration, done once by each entry point (never on import).

Services log JSON lines (optionally also to a file in the run directory); the CLI logs readable
console lines. Bind context with ``structlog.contextvars.bind_contextvars(run_id=...,
actor_id=...)``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

import structlog

__all__ = ["configure_logging"]


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is *now* (pytest and rich swap it), not the one at
    configure time."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(*, json: bool = True, level: str = "info", file: Path | None = None) -> None:
    """Configure structlog and stdlib logging; ``file`` (JSON lines) is appended to when given."""
    lvl = getattr(logging, level.upper(), None)
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    stream: TextIO | _CurrentStderr = _CurrentStderr()
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        stream = file.open("a", buffering=1, encoding="utf-8")
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json or file is not None
        else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr, force=True)
