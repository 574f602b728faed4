"""A CPU inference server in a background thread with its own event loop, for synchronous callers:
tests, benchmarks, notebooks. Async code (``leafe run``) uses :class:`InferenceServer` directly.

    handle = start_in_thread(InferenceConfig(model="tiny", port=0))
    ... SGLangClient(handle.url) ...
    handle.stop()
"""

from __future__ import annotations

import asyncio
import threading

from leafe.services.inference.server import InferenceConfig, InferenceServer

__all__ = ["ServerThread", "start_in_thread"]


class ServerThread:
    """A server running in its own thread and event loop (tests, benchmarks, notebooks)."""

    def __init__(self, config: InferenceConfig) -> None:
        self.config = config
        self.url = ""
        self.server: InferenceServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="leafe-inference-http", daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            try:
                async with InferenceServer(self.config) as server:
                    self.server, self.url = server, server.url
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as e:
                self._error = e
                self._ready.set()
                raise

        asyncio.run(run())

    def start(self, timeout: float = 300.0) -> ServerThread:
        """Start and wait until the server answers; raises what the server raised on start-up."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(
                f"inference server for {self.config.model!r} not ready after {timeout} s"
            )
        if self._error is not None:
            raise RuntimeError(f"inference server failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the server and join its thread."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def start_in_thread(config: InferenceConfig, timeout: float = 300.0) -> ServerThread:
    """Start a :class:`ServerThread`; read ``.url``, call ``.stop()`` when done."""
    return ServerThread(config).start(timeout)
