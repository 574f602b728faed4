"""A pull cancelled at the moment its wake-up arrives stays cancelled.

Python 3.11's ``asyncio.wait_for`` returns the inner result when a cancellation lands in the same
loop iteration as the inner future completes, and the cancel is lost. The replayer's fetch loop then
never saw its crash-test cancel (``tests/integration/test_replayer.py`` hung in CI, 1 run in ~5); a
service being shut down would keep pulling the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from leafe.services.bus.pull import Puller, _Request

pytestmark = pytest.mark.anyio


class _Conn:
    def new_inbox(self) -> str:
        return "_INBOX.test"


class _JS:
    _nc = _Conn()
    _prefix = "$JS.API"


async def test_a_cancel_that_meets_the_wake_up_is_not_lost() -> None:
    puller = Puller(_JS(), "S", "c")  # type: ignore[arg-type]
    req = _Request("1", batch=4)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(puller._wait(req, loop.time() + 1.0))
    await asyncio.sleep(0)  # parked on the wake event
    puller._wake.set()  # a delivery arrives (the request stays open: 0 of 4 received) ...
    await asyncio.sleep(0)  # ... the event's waiter completes ...
    task.cancel()  # ... and the cancel lands in the same iteration
    outcome: Any
    try:
        outcome = await asyncio.wait_for(task, 3.0)
    except asyncio.CancelledError:
        outcome = "cancelled"
    assert outcome == "cancelled", (
        f"the cancel was swallowed: the pull went on and returned {outcome!r}"
    )


class _RecordingConn(_Conn):
    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        self.published.append(subject)


async def test_a_cancel_swallowed_elsewhere_stops_the_next_pull() -> None:
    """nats-py's request (under every JetStream publish) still awaits 3.11's wait_for, so a cancel
    can be lost there; the task stays marked as cancelling, and its next pull raises instead of
    pulling on."""
    js = _JS()
    js._nc = _RecordingConn()  # type: ignore[assignment]
    puller = Puller(js, "S", "c")  # type: ignore[arg-type]
    answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def loop() -> str:
        await asyncio.wait_for(answer, 5)  # the swallowing call, as nats-py makes it
        await puller.pull(4, 0.05)
        return "pulled on"

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    answer.set_result(1)  # the reply arrives ...
    await asyncio.sleep(0)
    task.cancel()  # ... as the cancel does
    outcome: Any
    try:
        outcome = await asyncio.wait_for(task, 3.0)
    except asyncio.CancelledError:
        outcome = "cancelled"
    assert outcome == "cancelled" and js._nc.published == []
