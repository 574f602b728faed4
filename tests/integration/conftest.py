"""Fixtures shared by the integration tests that fold real logs (a file may still define its
own)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from leafe.learner.model_io import HFChatTokenizer, tiny_model_dir
from leafe.services.bus import connect, ensure_streams


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path) -> HFChatTokenizer:
    """The tiny model's tokenizer (SmolLM2's, 49,152 ids), shared by the log builders and the
    folds."""
    return HFChatTokenizer.from_dir(tiny_model_dir(cache_dir))


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[Any]:
    """A JetStream context on its own connection, streams ensured."""
    nc = await connect(nats_url)
    await ensure_streams(nc.jetstream())
    yield nc.jetstream()
    await nc.close()
