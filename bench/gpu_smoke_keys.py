"""The *keyed start* stage of ``bench/gpu_smoke.py``: SGLang started as deploy/ starts it (an API
key, an admin key, caches under a temporary ``HOME``, this process's uid), checked for what the CPU
suite could only take from SGLang's source (docs/trust.md, "Verified on CPU only"):

- ``/ready`` during the model load: it answers 200 without a key once loaded (what it answered
  before is recorded), and a ``/generate`` sent at its first 200 succeeds (deploy's startup and
  readiness probes and the router's worker checks rely on this);
- the keys: ``/generate`` without a key is refused (401), ``/update_weights_from_disk`` with the
  API key is refused and with the admin key accepted (so an actor's key cannot reload weights);
- a non-root uid: SGLang loads and serves with its caches under ``HOME``, as the pod runs it as
  uid 10001 (the image's own user is root; when this process is root, a note says the check did not
  run).

No GPU in this code: tests/integration/test_gpu_smoke_keys.py runs it against ``leafe inference``
(which takes its keys from files) on CPU.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["KeyedStart", "keyed_start", "sglang_env", "sglang_key_flags"]


def sglang_key_flags(api_key: str, admin_key: str) -> list[str]:
    """deploy/components/sglang/sglang.yaml's key flags (there from environment variables)."""
    return ["--api-key", api_key, "--admin-api-key", admin_key]


def sglang_env(home: Path) -> dict[str, str]:
    """The sglang container's environment: caches under a writable ``HOME``, no hub access."""
    return {
        **os.environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TRITON_CACHE_DIR": str(home / ".triton"),
        "HF_HUB_OFFLINE": "1",
    }


@dataclass
class KeyedStart:
    """What the keyed start saw."""

    checks: dict[str, bool] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


async def _status(
    http: aiohttp.ClientSession, method: str, url: str, key: str | None, body: Any = None
) -> tuple[int | None, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with http.request(method, url, json=body, headers=headers) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else None
            return resp.status, data
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None, None


async def keyed_start(
    cmd: list[str],
    url: str,
    *,
    api_key: str,
    admin_key: str,
    update_path: str,
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> KeyedStart:
    """Start the keyed server ``cmd`` (answering at ``url``), probe ``/ready`` every 0.5 s through
    its load, then check the keys (``update_path``: a model directory the admin key may load, e.g.
    the served one); stops the server before returning."""
    seen = KeyedStart()
    uid = os.getuid()
    seen.figures["uid"] = uid
    with log_path.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    started = time.monotonic()
    statuses: dict[str, int] = {}
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: {log_path}")
                if time.monotonic() - started > timeout_s:
                    raise RuntimeError(f"/ready was not 200 within {timeout_s:.0f}s: {log_path}")
                status, _ = await _status(http, "GET", f"{url}/ready", None)
                key = "no answer" if status is None else str(status)
                statuses[key] = statuses.get(key, 0) + 1
                if status == 200:
                    break
                await asyncio.sleep(0.5)
            seen.figures["ready_after_s"] = round(time.monotonic() - started, 1)
            seen.figures["ready_statuses_before"] = dict(statuses)
            first, _ = await _status(http, "POST", f"{url}/generate", api_key, generate)
            seen.checks["ready_means_serving"] = first == 200
            unkeyed, _ = await _status(http, "POST", f"{url}/generate", None, generate)
            seen.checks["generate_without_key_refused"] = unkeyed == 401
            update = {"model_path": update_path, "weight_version": "keyed-start"}
            route = f"{url}/update_weights_from_disk"
            by_api_key, _ = await _status(http, "POST", route, api_key, update)
            seen.checks["update_with_api_key_refused"] = by_api_key in (401, 403)
            by_admin, body = await _status(http, "POST", route, admin_key, update)
            seen.checks["update_with_admin_key_accepted"] = by_admin == 200 and bool(
                isinstance(body, dict) and body.get("success")
            )
            seen.figures["update_statuses"] = {"api_key": by_api_key, "admin_key": by_admin}
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    if uid == 0:
        seen.notes.append(
            "ran as root: whether SGLang serves as a non-root uid (the pod's 10001) was not "
            "checked; rerun as a non-root user"
        )
    else:
        seen.checks["served_as_non_root"] = True
    return seen
