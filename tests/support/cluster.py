"""Helpers of the cluster tests: find a stream's leader, and tell whether its replicas are
current."""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["replicas_current", "stream_leader"]


async def stream_leader(js: Any, stream: str, timeout_s: float = 30.0) -> str:
    """The server name leading ``stream`` (waits while an election is under way)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader:
                return str(info.cluster.leader)
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"stream {stream} has no leader after {timeout_s}s")
        await asyncio.sleep(0.1)


async def replicas_current(js: Any, stream: str) -> bool:
    """``stream`` has a leader and all its ``num_replicas - 1`` followers online and current."""
    info = await js.stream_info(stream)
    cluster = info.cluster
    if cluster is None or not cluster.leader:
        return False
    peers = [p for p in cluster.replicas or [] if p.name != cluster.leader]
    want = (info.config.num_replicas or 1) - 1
    return len(peers) == want and all(p.current and not p.offline for p in peers)
