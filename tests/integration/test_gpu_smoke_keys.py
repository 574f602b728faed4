"""``bench/gpu_smoke.py``'s keyed start on CPU, so the GPU check does not rot between GPU runs:
``leafe inference`` (keys from files, as it takes them) in SGLang's place, started with deploy's
environment, probed through its load, and its keys checked."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from bench.gpu_smoke_keys import KeyedStart, keyed_start, sglang_env
from leafe.services.bus.nats_server import free_port
from leafe.services.inference.auth import write_api_key
from tests.support.weights import scaled_export

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_the_keyed_start_passes_against_the_cpu_server(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Every check passes: ``/ready`` answers 200 without a key and the server then serves, a
    keyless ``/generate`` is 401, the API key cannot reload weights (403) and the admin key can; the
    figures record the uid and what ``/ready`` answered while the model loaded. A server whose
    keys are swapped (the actors' key loads weights) fails the reload checks."""
    api, admin = write_api_key(tmp_path / "api-key"), write_api_key(tmp_path / "admin-key")
    export = tmp_path / "store" / "v000001"
    await asyncio.to_thread(scaled_export, tiny_dir, export, "v000001")

    async def start(api_file: Path, admin_file: Path) -> KeyedStart:
        port = free_port()
        cmd = [sys.executable, "-m", "leafe.services.cli", "inference", "--model", str(tiny_dir)]
        cmd += ["--port", str(port), "--threads", "1", "--api-key-file", str(api_file)]
        cmd += ["--admin-key-file", str(admin_file), "--weights-root", str(tmp_path / "store")]
        return await keyed_start(
            cmd,
            f"http://127.0.0.1:{port}",
            api_key=api.read_text().strip(),
            admin_key=admin.read_text().strip(),
            update_path=str(export),
            log_path=tmp_path / f"server-{port}.log",
            timeout_s=120,
            env=sglang_env(tmp_path / "home"),
        )

    seen = await start(api, admin)
    assert seen.checks == {
        "ready_means_serving": True,
        "generate_without_key_refused": True,
        "update_with_api_key_refused": True,
        "update_with_admin_key_accepted": True,
        **({"served_as_non_root": True} if os.getuid() else {}),
    }, seen
    assert seen.figures["uid"] == os.getuid() and seen.figures["ready_after_s"] > 0
    swapped = await start(admin, api)  # the server holds the keys the other way round
    assert not swapped.checks["update_with_api_key_refused"]
    assert not swapped.checks["update_with_admin_key_accepted"]
