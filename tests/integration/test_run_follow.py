"""The supervisor's progress follower (``RunProgress.follow``) as the admin role of
permissions.json."""

from __future__ import annotations

import pytest

from leafe.protocol.subjects import events_filter
from tests.support.nats_auth import RoleClient

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def test_an_ordered_follower_reads_a_long_log_as_the_admin(
    admin_client: RoleClient, run_id: str
) -> None:
    """``leafe run``'s follower is an ordered push consumer, which answers JetStream's flow-control
    requests on ``$JS.FC.>``: the admin must be allowed to, or the server stops delivering after a
    few MB and the run's rounds never see their episodes finish (a continual run stalled so, its
    actors still working)."""
    subject = f"leafe.{run_id}.events.step"
    payload = b"x" * 4096
    n = 3000  # 12 MB: well past the point where the server asks for flow control
    acks = [await admin_client.js.publish(subject, payload) for _ in range(n)]
    assert len(acks) == n
    sub = await admin_client.js.subscribe(events_filter(run_id), ordered_consumer=True)
    got = 0
    try:
        while got < n:
            await sub.next_msg(timeout=10.0)
            got += 1
    except TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    assert got == n, (
        f"delivery stopped after {got} of {n} messages; violations: {admin_client.violations[:2]}"
    )
    assert not admin_client.violations
