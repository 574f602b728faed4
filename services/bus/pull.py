"""The JetStream pull protocol, spoken directly: the fast path under
``leafe.services.bus.Consumer``.

nats-py's ``PullSubscription.fetch`` spends most of its time in ``next_msg`` (a task, a ``wait_for``
and a uuid per message); on 1 KB events it tops out near 20k msg/s on two cores. :class:`Puller`
instead subscribes once with a callback that appends deliveries to a list, and gives every pull
request its own reply inbox, so the server's status replies (404 no messages, 408 expired, 409 ...)
close exactly the request they belong to. A pull first asks for ``batch`` messages with ``no_wait``
(answered at once with what is there); only when nothing is available does it park a one-message
request until the timeout, then sweep up the burst behind it with another ``no_wait`` request. Each
request is over before ``pull`` returns, so no message sits unseen in a buffer while its ack_wait
runs, except the rare straggler of a request the server answered after our deadline; it is returned
by the next pull.

:mod:`leafe.services.bus.reader` uses the same machinery to read a subject range once, in order (log
export).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

__all__ = ["ConsumerError", "Puller"]

log = structlog.get_logger(__name__)

_STATUS = "Status"
_IDLE_GAP_S = 0.2
"""A burst that pauses this long mid-request is over (the server held the rest, e.g.
max_ack_pending)."""


class ConsumerError(RuntimeError):
    """The consumer cannot go on: it was deleted, JetStream is unavailable, or a dead-letter
    failed."""


class _Request:
    __slots__ = ("batch", "closed", "received", "token")

    def __init__(self, token: str, batch: int) -> None:
        self.token = token
        self.batch = batch
        self.received = 0
        self.closed = False


class Puller:
    """Pull requests against one consumer; see the module docstring for the protocol."""

    def __init__(self, js: JetStreamContext, stream: str, consumer: str) -> None:
        # nats-py exposes neither the connection nor the API prefix of a JetStreamContext publicly.
        self._nc = js._nc
        self._next_subject = f"{js._prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._where = f"{stream}/{consumer}"
        self._inbox = self._nc.new_inbox()
        self._buffer: list[Msg] = []
        self._open: _Request | None = None
        self._wake = asyncio.Event()
        self._seq = 0
        self._fatal: str | None = None
        self._unavailable = False
        self._sub: Any = None

    async def start(self) -> None:
        """Subscribe to the reply inboxes (idempotent)."""
        if self._sub is None:
            self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)

    async def close(self) -> None:
        """Unsubscribe; a later request's deliveries are then redelivered after ack_wait."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(_STATUS) if msg.headers and not msg.reply else None
        req = self._open
        if status is None:
            self._buffer.append(msg)
            if req is not None:
                req.received += 1
                req.closed = req.received >= req.batch
        elif req is not None and msg.subject.endswith("." + req.token):
            req.closed = True
            if status not in ("404", "408", "100"):
                self._on_status(status, str(msg.headers.get("Description", "")))  # type: ignore[union-attr]
        self._wake.set()

    def _on_status(self, status: str, description: str) -> None:
        text = f"{status} {description}".strip()
        if status == "503":
            self._unavailable = (
                True  # no JetStream responder: a server restarting, or the stream is gone
            )
        elif "Deleted" in description or "push based" in description:
            self._fatal = text
        else:
            log.warning("bus.pull.status", consumer=self._where, status=text)

    async def pull(self, batch: int, timeout: float) -> list[Msg]:  # noqa: ASYNC109
        """Up to ``batch`` messages; waits up to ``timeout`` s only when none are available.

        Raises CancelledError when this task was cancelled and the cancel got lost on its way
        (Python 3.11's ``asyncio.wait_for``, which nats-py's request still uses, returns the result
        of a call whose reply met the cancel): every consumer loop pulls, so no loop outlives its
        cancel."""
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError(f"{self._where}: cancelled while a bus call completed")
        if not self._buffer:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            await self._request(batch, None, deadline)
            remaining = deadline - loop.time()
            if (
                not self._buffer
                and not self._unavailable
                and self._fatal is None
                and remaining > 0.01
            ):
                await self._request(1, remaining, deadline + 1.0)
                if self._buffer and batch > 1:
                    await self._request(batch - 1, None, loop.time() + 1.0)
            if self._unavailable:
                self._unavailable = False
                log.warning(
                    "bus.pull.unavailable", consumer=self._where, status="503 no responders"
                )
                await asyncio.sleep(
                    max(0.0, deadline - loop.time())
                )  # like an empty wait, not a busy loop
        if self._fatal is not None:
            raise ConsumerError(f"consumer {self._where} failed: {self._fatal}")
        msgs, self._buffer = self._buffer[:batch], self._buffer[batch:]
        return msgs

    async def _request(self, batch: int, expires_s: float | None, until: float) -> None:
        self._seq += 1
        req = _Request(str(self._seq), batch)
        body: dict[str, Any] = {"batch": batch}
        if expires_s is None:
            body["no_wait"] = True
        else:
            body["expires"] = max(1_000_000, int(expires_s * 1e9) - 100_000)
        self._open = req
        try:
            await self._nc.publish(
                self._next_subject, json.dumps(body).encode(), reply=f"{self._inbox}.{req.token}"
            )
            await self._wait(req, until)
        finally:
            self._open = None

    async def _wait(self, req: _Request, until: float) -> None:
        loop = asyncio.get_running_loop()
        while not req.closed:
            wait = until - loop.time()
            if wait <= 0:
                return
            if req.received:
                wait = min(wait, _IDLE_GAP_S)
            self._wake.clear()
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that meets the
                # wake-up
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                if req.received:
                    return
