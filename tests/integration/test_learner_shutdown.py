"""torchrun as deploy/'s learner runs it: SIGTERM to torchrun (the kubelet stopping the pod)
reaches the rank, and with the manifest's TORCH_ELASTIC_SHUTDOWN_TIMEOUT the rank gets longer than
torchrun's 30 s default to write its stop-time checkpoint before torchrun would SIGKILL it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leafe.services.bus.nats_server import free_port
from tests.support.manifests import DEPLOY, container_named, env_value, render

pytestmark = pytest.mark.integration

WRITE_S = 36
"""How long the rank's stop-time write takes here: past torchrun's default (30 s)."""

RANK = """
import signal, sys, time
from pathlib import Path

out = Path(sys.argv[1])
stopped = []
signal.signal(signal.SIGTERM, lambda *_: stopped.append(time.monotonic()))
(out / "ready").write_text("")
while not stopped:
    time.sleep(0.1)
time.sleep(float(sys.argv[2]))  # the checkpoint and export a stopping learner writes
(out / "written").write_text(str(time.monotonic() - stopped[0]))
"""


def test_a_stopping_rank_gets_more_than_thirty_seconds(tmp_path: Path) -> None:
    """With the base learner's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, a rank whose stop takes 36 s after
    torchrun got SIGTERM finishes its write and exits; torchrun exits once it has."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render deploy/base")
    learner = container_named(render(DEPLOY / "base", kubectl), "learner", "learner")
    timeout = env_value(learner, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert int(timeout) > WRITE_S + 5
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": timeout, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    cmd += [f"--master-port={free_port()}", str(script), str(tmp_path), str(WRITE_S)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=WRITE_S + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "written").is_file(), f"the rank was killed before its write:\n{output}"
    assert float((tmp_path / "written").read_text()) >= WRITE_S
