"""Real ``leafe inference`` processes for the weight-transport tests: each on the tiny model (or
any model directory), one thread, its own port, loading exports only under one weights root and
taking weight routes only with one admin key. Start, kill, restart, read weights back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from leafe.services.weight_sync.broadcast import free_port

__all__ = ["EngineProc", "EngineSet", "served_weights"]


@dataclass
class EngineProc:
    """One ``leafe inference`` child."""

    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class EngineSet:
    """``n`` engines sharing a weights root and an admin key (``admin_key_file``)."""

    model: Path
    root: Path
    workdir: Path
    n: int
    engines: list[EngineProc] = field(default_factory=list)

    @property
    def admin_key_file(self) -> str:
        return str(self.workdir / "admin-key")

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def headers(self) -> dict[str, str]:
        key = Path(self.admin_key_file).read_text().strip()
        return {"Authorization": f"Bearer {key}"}

    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        Path(self.admin_key_file).write_text("test-admin-key\n")
        os.chmod(self.admin_key_file, 0o600)

    async def __aenter__(self) -> EngineSet:
        self._prepare()
        self.engines = [
            EngineProc(port=free_port(), log=self.workdir / f"engine-{i}.log")
            for i in range(self.n)
        ]
        for e in self.engines:
            self._spawn(e)
        await asyncio.gather(*(self.wait_ready(e) for e in self.engines))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for e in self.engines:
            self.kill(e, signal.SIGTERM)

    def _spawn(self, e: EngineProc) -> None:
        cmd = [
            sys.executable,
            "-m",
            "leafe.services.cli",
            "inference",
            *("--model", str(self.model), "--port", str(e.port), "--threads", "1"),
            *("--weights-root", str(self.root), "--admin-key-file", self.admin_key_file),
            *("--max-batch", "4"),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with e.log.open("ab") as log:
            e.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    async def wait_ready(self, e: EngineProc, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                assert e.proc is not None
                if e.proc.poll() is not None:
                    raise RuntimeError(f"engine exited: {e.log.read_text()[-2000:]}")
                try:
                    async with s.get(f"{e.url}/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"engine {e.url} not ready: {e.log.read_text()[-2000:]}")

    def kill(self, e: EngineProc, sig: int = signal.SIGKILL) -> None:
        if e.proc is not None and e.proc.poll() is None:
            e.proc.send_signal(sig)
            try:
                e.proc.wait(30)
            except subprocess.TimeoutExpired:
                e.proc.kill()
                e.proc.wait(10)

    async def restart(self, e: EngineProc) -> None:
        self.kill(e)
        self._spawn(e)
        await self.wait_ready(e)

    async def version(self, e: EngineProc) -> str:
        async with aiohttp.ClientSession() as s, s.get(f"{e.url}/model_info") as r:
            return str((await r.json())["weight_version"])

    async def post(self, e: EngineProc, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{e.url}{route}", json=body, headers=self.headers()) as r,
        ):
            return r.status, await r.json()


async def served_weights(engines: EngineSet, e: EngineProc, names: list[str]) -> dict[str, Any]:
    """Every row of each named parameter as ``e`` serves it (``/get_weights_by_name``)."""
    out = {}
    for name in names:
        status, body = await engines.post(
            e, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 30}
        )
        assert status == 200, body
        out[name] = body
    return out
