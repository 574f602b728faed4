"""Fixtures of the event-log unit tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """A CLI ``main()`` configures logging onto the (captured) stderr of the moment; undo it
    afterwards."""
    saved, handlers, level = structlog.get_config(), logging.root.handlers[:], logging.root.level
    yield
    structlog.configure(**saved)
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)
