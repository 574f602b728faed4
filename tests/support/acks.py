"""Reading a durable's counts after plain acks.

A plain ack (``msg.ack()``, what the services send) is fire-and-forget: the server applies it to the
consumer after reading it, so ``consumer_info`` right after the last ack (even after a flush or a
closed connection) may still count the message as pending. CI saw ``num_ack_pending == 1`` that way.
A test that checks "everything was acked" waits, boundedly, for the counts to settle; a wrong count
still fails, after the timeout, with the last counts in the message.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


async def settled_counts(
    js: Any, stream: str, durable: str, want: tuple[int, int] = (0, 0), timeout_s: float = 5.0
) -> tuple[int, int]:
    """``(num_pending, num_ack_pending)`` of ``durable`` once they equal ``want``, or the last ones
    read after ``timeout_s`` (for the caller's assertion to show)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await js.consumer_info(stream, durable)
        counts = (int(info.num_pending), int(info.num_ack_pending))
        if counts == want or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.05)
