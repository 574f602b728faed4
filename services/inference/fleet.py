"""Several CPU inference servers as child processes, one per free core, for a caller that only reads
(``leafe eval``): the client spreads episodes over them by affinity (``actors/client.py``).

One server per core with one torch thread each is what uses a small CPU well: measured on 2 cores
for Base's Sokoban evaluation (8 tasks x 16 samples, float32), one in-process server with 2 threads
took 553 s, two pinned processes with one thread each 238 s. An in-process server shares the GIL
with the client's event loop and its two OpenMP threads spin on decode-sized matmuls; separate
processes share nothing. The children share an API key and an admin key (the weight routes), each a
file (0600, in a private temporary directory, removed at stop); each child is pinned to its core
where the affinity can be set, and is sent SIGTERM by the kernel if this process dies without
stopping it.

    async with ServerFleet(FleetConfig(model=str(path), servers=2, dtype="float32")) as fleet:
        async with SGLangClient(fleet.urls, api_key_file=fleet.api_key_file) as client: ...
    # a caller that reloads weights (experiments/paper) adds admin_key_file=fleet.admin_key_file
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from leafe.services.inference.auth import write_api_key
from leafe.services.lifetime import die_with_parent

__all__ = ["FleetConfig", "FleetError", "ServerFleet"]

log = structlog.get_logger(__name__)

SERVING = "leafe inference: serving on "
"""The line ``leafe inference`` prints on stdout once it accepts requests
(``services/inference/main.py``)."""


class FleetError(RuntimeError):
    """A server of the fleet did not start; the message carries its log tail."""


@dataclass(frozen=True)
class FleetConfig:
    """What each server of the fleet serves and how many there are."""

    model: str
    servers: int
    dtype: str = "float32"
    max_batch: int = 16
    """Per server."""
    served_model_name: str = ""
    weight_version: str = "default"
    threads: int = 1
    """Torch threads per server (1: a core each, no OpenMP pool spinning on decode-sized
    matmuls)."""
    cores: tuple[int, ...] = ()
    """Core of each server (``sched_setaffinity``); empty = this process's usable cores, in
    order."""
    start_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = field(default_factory=tuple)


class ServerFleet:
    """Start ``servers`` ``leafe inference`` children, each with one thread; ``urls`` once
    started."""

    def __init__(self, config: FleetConfig) -> None:
        if config.servers < 1:
            raise ValueError(f"servers must be >= 1, got {config.servers}")
        self.config = config
        self.urls: list[str] = []
        self.api_key_file = ""
        self.admin_key_file = ""
        """The admin key (``/update_weights_from_disk``): only for a caller that reloads."""
        self._dir: Path | None = None
        self._procs: list[asyncio.subprocess.Process] = []
        self._logs: list[Path] = []
        self._drains: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> ServerFleet:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _cores(self) -> list[int | None]:
        cfg = self.config
        if cfg.cores:
            return [cfg.cores[i % len(cfg.cores)] for i in range(cfg.servers)]
        try:
            usable = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return [None] * cfg.servers
        if cfg.threads != 1 or len(usable) < cfg.servers:  # the scheduler places them
            return [None] * cfg.servers
        return [usable[i] for i in range(cfg.servers)]

    def _argv(self) -> list[str]:
        cfg = self.config
        return [
            sys.executable,
            *("-m", "leafe.services.cli", "inference", "--model", cfg.model, "--port", "0"),
            *(
                "--threads",
                str(cfg.threads),
                "--dtype",
                cfg.dtype,
                "--max-batch",
                str(cfg.max_batch),
            ),
            *("--served-model-name", cfg.served_model_name or Path(cfg.model).name),
            *("--weight-version", cfg.weight_version, "--api-key-file", self.api_key_file),
            *("--admin-key-file", self.admin_key_file),
            *("--log-level", "warning"),
            *cfg.extra_args,
        ]

    async def start(self) -> list[str]:
        """Spawn every server and wait until each prints its URL; returns the URLs."""
        self._dir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="leafe-fleet-"))
        self.api_key_file = str(write_api_key(self._dir / "engine-api-key"))
        self.admin_key_file = str(write_api_key(self._dir / "engine-admin-key"))
        threads = str(self.config.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        for i, core in enumerate(self._cores()):
            log_path = self._dir / f"server-{i}.log"
            self._logs.append(log_path)
            with log_path.open("ab") as err:
                proc = await asyncio.create_subprocess_exec(
                    *self._argv(),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=err,
                    env=env,
                    start_new_session=True,  # a Ctrl-C reaches this process, which stops them
                    preexec_fn=die_with_parent,  # a SIGKILLed `leafe eval` leaves no server
                )
            self._procs.append(proc)
            if core is not None:
                with contextlib.suppress(OSError):  # affinity is a speed-up, not a requirement
                    os.sched_setaffinity(proc.pid, {core})
            log.info("fleet.server.started", index=i, pid=proc.pid, core=core)
        self.urls = list(await asyncio.gather(*(self._url(i) for i in range(len(self._procs)))))
        return self.urls

    async def _url(self, i: int) -> str:
        proc = self._procs[i]
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                while line := (await proc.stdout.readline()).decode(errors="replace"):
                    if line.startswith(SERVING):
                        self._drains.append(asyncio.create_task(_drain(proc.stdout)))
                        return line[len(SERVING) :].strip()
        except TimeoutError:
            raise FleetError(
                f"inference server {i} did not start within "
                f"{self.config.start_timeout_s:.0f}s:\n{self._tail(i)}"
            ) from None
        await proc.wait()
        raise FleetError(
            f"inference server {i} exited with code {proc.returncode}:\n{self._tail(i)}"
        )

    def _tail(self, i: int, lines: int = 15) -> str:
        try:
            return "\n".join(self._logs[i].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every server (each drains), SIGKILL after ``grace_s``; remove the key and
        logs."""
        for proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in self._procs:
            try:
                async with asyncio.timeout(grace_s):
                    await proc.wait()
            except TimeoutError:
                log.warning("fleet.server.kill", pid=proc.pid, after_s=grace_s)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._procs.clear()
        for task in self._drains:
            task.cancel()
        self._drains.clear()
        if self._dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._dir, True)
            self._dir = None


async def _drain(stream: asyncio.StreamReader) -> None:
    """Keep reading a child's stdout so it never blocks on a full pipe."""
    while await stream.readline():
        pass
