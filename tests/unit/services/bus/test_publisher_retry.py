"""Publisher retries (services/bus/publisher.py): a message without an ack is sent again by
``flush``, a refusal by the server is not, and what is still unacked after the last retry is
reported by id.

A fake JetStream context makes the acks' fate exact; the real server killed mid-publish is in
tests/integration/test_nats_crash.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import nats.js.errors
import pytest
from nats.js.api import PubAck

from leafe.protocol.codec import MSG_ID_HEADER
from leafe.services.bus import Publisher, PublishError

pytestmark = pytest.mark.anyio

SUBJECT = "leafe.r.tasks.explore"


class FakeJetStream:
    """``publish_async`` whose ack per send is scripted: ``fates[msg_id]`` lists, per send, "ack",
    "dup", "lost" (never answered) or an exception to fail the future with."""

    def __init__(self, fates: dict[str, list[Any]]) -> None:
        self.fates = fates
        self.sends: list[str] = []
        self._nc = SimpleNamespace(max_payload=1 << 20, is_connected=True)

    async def publish_async(
        self, subject: str, data: bytes, headers: dict[str, str]
    ) -> asyncio.Future[PubAck]:
        msg_id = headers[MSG_ID_HEADER]
        self.sends.append(msg_id)
        fate = self.fates.get(msg_id, ["ack"]).pop(0) if self.fates.get(msg_id) else "ack"
        future: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        if fate in ("ack", "dup"):
            future.set_result(PubAck(stream="S", seq=len(self.sends), duplicate=fate == "dup"))
        elif isinstance(fate, BaseException):
            future.set_exception(fate)
        return future


async def _publish(pub: Publisher, ids: list[str]) -> None:
    for msg_id in ids:
        await pub.publish_raw(SUBJECT, b"{}", {MSG_ID_HEADER: msg_id})


async def test_a_lost_ack_is_republished_and_a_stored_one_comes_back_as_a_duplicate() -> None:
    js = FakeJetStream({"b": ["lost", "dup"], "c": ["lost", "lost", "ack"]})
    pub = Publisher(js, ack_timeout_s=0.05, retries=2)  # type: ignore[arg-type]
    await _publish(pub, ["a", "b", "c"])
    assert await pub.flush() == 3
    assert js.sends == ["a", "b", "c", "b", "c", "c"]
    assert (pub.acked, pub.republished, pub.duplicates) == (3, 3, 1)


async def test_what_is_unacked_after_the_last_retry_is_reported_by_id() -> None:
    js = FakeJetStream({"b": ["lost", "lost", "lost"]})
    pub = Publisher(js, ack_timeout_s=0.05, retries=2)  # type: ignore[arg-type]
    await _publish(pub, ["a", "b"])
    with pytest.raises(PublishError) as e:
        await pub.flush()
    assert e.value.unacked == ["b"]
    assert "no ack within" in e.value.reasons["b"]
    assert js.sends == ["a", "b", "b", "b"]
    assert await pub.flush() == 0, "a reported message is not retried by a later flush"


async def test_a_refusal_by_the_server_is_reported_without_a_retry() -> None:
    refusal = nats.js.errors.BadRequestError(
        code=400, err_code=10058, description="stream name mismatch"
    )
    js = FakeJetStream(
        {"b": [refusal], "c": [nats.js.errors.ServiceUnavailableError(code=503), "ack"]}
    )
    pub = Publisher(js, ack_timeout_s=0.05, retries=2)  # type: ignore[arg-type]
    await _publish(pub, ["a", "b", "c"])
    with pytest.raises(PublishError) as e:
        await pub.flush()
    assert e.value.unacked == ["b"]
    assert js.sends == ["a", "b", "c", "c"], (
        "the refusal is final; the unavailable server is retried"
    )


async def test_retries_zero_reports_at_once() -> None:
    js = FakeJetStream({"a": ["lost", "ack"]})
    pub = Publisher(js, ack_timeout_s=0.05, retries=0)  # type: ignore[arg-type]
    await _publish(pub, ["a"])
    with pytest.raises(PublishError):
        await pub.flush()
    assert js.sends == ["a"]
