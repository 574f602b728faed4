"""Connecting to NATS: one place that turns a URL (and credentials) into a reconnecting client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nats
import structlog
from nats.aio.client import Client

__all__ = ["connect"]

log = structlog.get_logger(__name__)


def _check_creds(creds: str | None) -> None:
    if creds is not None and not Path(creds).is_file():
        raise FileNotFoundError(f"NATS credentials file {creds!r} does not exist")


async def connect(
    url: str,
    *,
    creds: str | None = None,
    name: str = "leafe",
    connect_attempts: int = 3,
    **options: Any,
) -> Client:
    """Connect to ``url`` (comma-separated for a cluster), optionally with a ``.creds`` file.

    The first connection is tried ``connect_attempts`` times, then raises; once connected the client
    reconnects forever (a restarted server or cluster node is waited for, with events logged).
    ``options`` go to ``nats.connect`` unchanged.
    """
    _check_creds(creds)

    async def on_error(e: Exception) -> None:
        log.warning("bus.nats.error", url=url, error=f"{type(e).__name__}: {e}")

    client: list[Client] = []

    async def on_disconnect() -> None:
        if not (client and client[0].is_closed):  # a close() we asked for is not news
            log.warning("bus.nats.disconnected", url=url)

    async def on_reconnect() -> None:
        log.info("bus.nats.reconnected", url=url)

    kwargs: dict[str, Any] = {
        "servers": [u.strip() for u in url.split(",") if u.strip()],
        "name": name,
        "user_credentials": creds,
        "reconnect_time_wait": 0.5,
        "max_reconnect_attempts": connect_attempts,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
    }
    kwargs.update(options)
    nc = await nats.connect(**kwargs)
    client.append(nc)
    if "max_reconnect_attempts" not in options:
        nc.options["max_reconnect_attempts"] = -1  # after the first connection: reconnect forever
    return nc
