"""The deployment through its first week, on the rendered manifests: learner restarts that keep
their stop-time checkpoint, a router that neither stops for client errors nor waits out a hung
engine at the client's timeout, engines spread over nodes, and a weight volume a non-root namespace
can own.
Run: ``.venv/bin/python -m pytest tests/unit/deploy/test_operations.py -q``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.manifests import container_named, env_value

Docs = list[dict[str, Any]]
EXAMPLE_PARAMS = {"gpu": 7.62e9, "dev": 135e6}
"""Parameters of each overlay's example model (as test_gpu_cluster.py's)."""
STOP_WRITE_BYTES_PER_PARAM = 12 + 2
"""What a learner writes when it stops: a checkpoint (fp32 master weights and AdamW's two fp32
moments, 12 B/param) and an export (bf16, 2 B/param)."""
VOLUME_WRITE_BYTES_PER_S = 250e6
"""The weight volume's sustained write rate the grace is sized for (deploy/README.md)."""
STEP_S = 60
"""The longest step a stop waits for before it writes."""


@pytest.mark.parametrize("overlay", ["dev", "gpu"])
def test_torchrun_gives_the_ranks_the_pods_grace(rendered: dict[str, Docs], overlay: str) -> None:
    """torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s when unset) between the SIGTERM it
    forwards and SIGKILL: it is set 15-60 s under the pod's terminationGracePeriodSeconds, and the
    grace covers the example model's stop-time checkpoint and export at the volume's rate plus a
    step."""
    docs = rendered[overlay]
    learner = container_named(docs, "learner", "learner")
    assert learner.argv[0] == "torchrun"
    grace = learner.pod["spec"]["terminationGracePeriodSeconds"]
    timeout = int(env_value(learner, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
    assert 15 <= grace - timeout <= 60, (grace, timeout)
    write_s = EXAMPLE_PARAMS[overlay] * STOP_WRITE_BYTES_PER_PARAM / VOLUME_WRITE_BYTES_PER_S
    assert timeout >= write_s + STEP_S, f"{overlay}: {timeout} s < {write_s + STEP_S:.0f} s"
