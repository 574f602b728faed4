"""``leafe nats`` (services/admin/nats.py) stops its nats-server child on SIGTERM as on Ctrl-C: a
supervisor or a pod's termination never leaves a server running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leafe.services.bus.nats_server import free_port

ROOT = Path(__file__).resolve().parents[4]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_leafe_nats_stops_its_server_on_sigterm_and_ctrl_c(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """After the signal, ``leafe nats`` exits 0 and its nats-server child is gone."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "leafe.services.cli",
        "nats",
        "--store",
        str(tmp_path),
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, (
                    "leafe nats never started"
                )
                time.sleep(0.1)
        servers = _children(proc.pid)
        assert servers, "no nats-server child found"
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=30)
        assert code == 0, (
            code,
            proc.stdout.read().decode(errors="replace")[-3000:] if proc.stdout else "",
        )
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in servers), "the nats-server child survived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
