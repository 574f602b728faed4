"""The supervisor restarts services that crashed, never one it stopped on purpose
(services/run/supervisor.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from leafe.services.bus.nats_server import free_port
from leafe.services.run.supervisor import ServiceError, ServiceProcess, restart_crashed

pytestmark = pytest.mark.anyio


def _nats(tmp_path: Path) -> ServiceProcess:
    """A cheap long-running child: ``leafe nats`` on a free port."""
    argv = ["nats", "--store", str(tmp_path / "store"), "--port", str(free_port())]
    return ServiceProcess("nats", argv, tmp_path / "nats.log")


async def test_a_service_stopped_on_purpose_is_not_restarted(tmp_path: Path) -> None:
    """After stop() the watcher leaves the service down (the drain stops the learner on purpose)."""
    proc = await _nats(tmp_path).start()
    await proc.stop(grace_s=10)
    assert await restart_crashed([proc], max_restarts=3) == []
    assert not proc.alive and proc.restarts == 0


async def test_a_crashed_service_is_restarted_up_to_the_limit(tmp_path: Path) -> None:
    """A SIGKILLed service is restarted; once it used up its restarts, the next crash is a
    ServiceError."""
    proc = await _nats(tmp_path).start()
    try:
        proc.kill()
        assert proc.proc is not None
        await proc.proc.wait()
        assert await restart_crashed([proc], max_restarts=1) == ["nats"]
        assert proc.alive and proc.restarts == 1
        proc.kill()
        await proc.proc.wait()
        with pytest.raises(ServiceError, match="service nats exited"):
            await restart_crashed([proc], max_restarts=1)
    finally:
        await proc.stop(grace_s=10)


def test_the_drain_counts_held_anchors_of_open_episodes_as_folded() -> None:
    """Everything delivered and nothing unacked but the anchors the replayer holds: folded. An
    unacked event beyond the anchors, or undelivered events, are not; without the replayer's count
    only 0 is."""
    from leafe.services.run.waits import folded_all

    assert folded_all(0, 4, 4) and folded_all(0, 0, 0) and folded_all(0, 0, None)
    assert not folded_all(0, 5, 4) and not folded_all(3, 4, 4) and not folded_all(0, 4, None)
