"""``services/inference/fleet.py``: real ``leafe inference`` children with the tiny model, one per
core, each behind the fleet's API key; a server that cannot start fails with its log, and stop
leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from leafe.actors.client import SGLangClient
from leafe.actors.engine import SamplingParams
from leafe.services.inference.fleet import FleetConfig, FleetError, ServerFleet

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def test_two_servers_answer_behind_the_key_on_their_own_cores_and_stop_cleanly() -> None:
    fleet = ServerFleet(FleetConfig(model="tiny", servers=2, max_batch=2, cores=(0, 0)))
    async with fleet:
        key_file = Path(fleet.api_key_file)
        assert len(set(fleet.urls)) == 2
        assert _mode(key_file) == 0o600
        pids = [p.pid for p in fleet._procs]
        assert all(os.sched_getaffinity(pid) == {0} for pid in pids), (
            "each child is pinned to its core"
        )
        bearer = {"Authorization": f"Bearer {_read(key_file)}"}
        async with aiohttp.ClientSession() as s:
            for url in fleet.urls:
                async with s.get(f"{url}/get_server_info") as r:
                    assert r.status == 401, "a fleet server answers only with the key"
                async with s.get(f"{url}/get_server_info", headers=bearer) as r:
                    assert r.status == 200
                    assert (await r.json())["internal_states"][0]["threads"] == 1
        for url in fleet.urls:  # every server generates
            async with SGLangClient(url, api_key_file=fleet.api_key_file) as client:
                [out] = await client.generate(
                    [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0)
                )
                assert out.output_ids
    assert not _exists(key_file), "stop removes the key and the logs"
    assert all(_gone(pid) for pid in pids), "no server outlives stop"


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _read(path: Path) -> str:
    return path.read_text().strip()


def _exists(path: Path) -> bool:
    return path.exists()


def _gone(pid: int) -> bool:
    """Exited (reaped, or a zombie awaiting its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


async def test_a_server_that_cannot_start_fails_the_fleet_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="exited with code") as e:
        async with ServerFleet(FleetConfig(model=str(tmp_path / "no-such-model"), servers=1)):
            pass
    assert "no-such-model" in str(e.value)


_PARENT = """
import asyncio, sys
from leafe.services.inference.fleet import FleetConfig, ServerFleet

async def main():
    async with ServerFleet(FleetConfig(model="tiny", servers=1, max_batch=1)) as fleet:
        print("PID", fleet._procs[0].pid, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_sigkilled_parent_leaves_no_server_behind() -> None:
    """The kernel sends each server SIGTERM when the process that started the fleet dies (SIGKILL
    leaves it no chance to stop them), so a killed ``leafe eval`` does not leak servers."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = next(int(line.split()[1]) for line in parent.stdout if line.startswith("PID "))
        assert not _gone(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 60
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(child), f"server {child} outlived its killed parent"
    finally:
        parent.kill()
