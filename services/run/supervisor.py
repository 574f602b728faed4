"""Child service processes for ``leafe run``: start with logs to the run directory, watch, stop,
kill.

Each service runs as its own ``leafe <verb>`` process (as in deploy/), in its own session so a
terminal Ctrl-C reaches only the supervisor, which then drains them in order with SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import aiohttp
import structlog

from leafe.services.run.orphans import record_child

__all__ = ["ServiceError", "ServiceProcess", "restart_crashed", "wait_http_ok"]

log = structlog.get_logger(__name__)


class ServiceError(RuntimeError):
    """A child service failed to start or died; the message names it and its log file."""


class ServiceProcess:
    """One ``leafe <verb> ...`` child process."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        run_dir: Path | None = None,
    ):
        self.name = name
        self.run_dir = run_dir
        """Where the pid is recorded (``services/run/orphans.py``); ``None``: not recorded."""
        self.argv = [sys.executable, "-m", "leafe.services.cli", *argv]
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.wanted = False
        """True from ``start`` until ``stop``: a process that exits while wanted has crashed."""

    @property
    def alive(self) -> bool:
        """The process is running."""
        return self.proc is not None and self.proc.returncode is None

    @property
    def crashed(self) -> bool:
        """It exited although nobody asked it to stop."""
        return self.wanted and self.proc is not None and self.proc.returncode is not None

    async def start(self) -> ServiceProcess:
        """Spawn the process, appending its output to ``log_path``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.wanted = True
        with self.log_path.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        if self.run_dir is not None:
            record_child(self.run_dir, self.name, self.proc.pid)
        log.info(
            "run.service.started", service=self.name, pid=self.proc.pid, log=str(self.log_path)
        )
        return self

    def check(self) -> None:
        """Raise :class:`ServiceError` if the process exited."""
        if self.proc is not None and self.proc.returncode is not None:
            tail = self.tail()
            raise ServiceError(
                f"service {self.name} exited with code {self.proc.returncode}; see "
                f"{self.log_path}:\n{tail}"
            )

    def tail(self, lines: int = 15) -> str:
        """Last lines of the service's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM (the service drains), SIGKILL after ``grace_s``; returns the exit code."""
        self.wanted = False
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await proc.wait()
            except TimeoutError:
                log.warning("run.service.kill", service=self.name, after_s=grace_s)
                proc.kill()
                await proc.wait()
        log.info("run.service.stopped", service=self.name, code=proc.returncode)
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL (crash tests): the process stays wanted, so a watcher restarts it."""
        if self.alive and self.proc is not None:
            self.proc.kill()


async def wait_http_ok(url: str, service: ServiceProcess | None, timeout_s: float = 300.0) -> None:
    """Poll ``url`` until it answers 200; fail early, with the log tail, if ``service`` dies."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while asyncio.get_running_loop().time() < deadline:
            if service is not None:
                service.check()
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise ServiceError(f"{url} did not answer 200 within {timeout_s:.0f}s")


async def restart_crashed(services: Iterable[ServiceProcess], *, max_restarts: int) -> list[str]:
    """Restart every service that crashed (exited while wanted), up to ``max_restarts`` times each;
    one that crashes again after that raises :class:`ServiceError` with its log tail. A service
    stopped on purpose is left alone. Returns the names restarted."""
    restarted = []
    for proc in services:
        if not proc.crashed:
            continue
        if proc.restarts >= max_restarts:
            proc.check()
        proc.restarts += 1
        code = proc.proc.returncode if proc.proc else None
        log.warning("run.service.restart", service=proc.name, code=code, restarts=proc.restarts)
        await proc.start()
        restarted.append(proc.name)
    return restarted
