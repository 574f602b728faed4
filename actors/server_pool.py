"""The servers behind an :class:`~leafe.actors.client.SGLangClient`: which one gets a request, and
how a transient failure is retried.

Each request goes to the server with the fewest requests in flight from this client (or the one its
episode's affinity key prefers). Connection errors (refused, reset, connect timeout), 502/503/504
answers and the sglang router's 500 for a worker it could not reach are retried on the next server
with exponential backoff; a server that failed is avoided for a short cooldown. HTTP 400 (bad
request) and a request that times out after connecting are not retried (a slow generation would be
run twice). When every attempt fails, :class:`EngineUnavailable` names each server and why.
Timeouts, retries and backoff are :class:`SGLangClientConfig` fields.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import aiohttp
import msgspec
import structlog

from leafe.actors.engine import ENGINE_AFFINITY, EngineError
from leafe.actors.sglang_wire import error_message

__all__ = ["AFFINITY_SLACK", "EngineUnavailable", "NotFound", "SGLangClientConfig", "ServerPool"]

log = structlog.get_logger(__name__)

_RETRY_STATUS = frozenset({502, 503, 504})
_ROUTER_UNREACHED = frozenset({"call_upstream_request_error", "call_upstream_connection_failed"})
"""sglang-router 0.3.2's ``x-smg-error-code`` when the worker it chose could not be reached (a pod
gone or restarting, until its health checks drop it): HTTP 500, yet the request never ran; retried
like a refused connection."""

AFFINITY_SLACK = 8
"""Requests in flight a server may have beyond the least loaded one and still get its affinity
keys."""


class SGLangClientConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the client talks to its servers (a service config can embed it, e.g. as
    ``[actor.engine]``)."""

    timeout_s: float = 300.0
    """Whole-request timeout of one ``/generate`` once connected; not retried when exceeded (the
    generation may still be running). Long CPU generations or big batches on a busy GPU want
    more."""
    connect_timeout_s: float = 5.0
    """TCP connect timeout; a connect timeout is retried on another server."""
    health_timeout_s: float = 30.0
    """Timeout of ``/health`` and ``/model_info`` (SGLang's ``/health`` runs a generation:
    seconds)."""
    retries: int = 3
    """Extra attempts after a transient failure (connection error, 502/503/504); at least one
    attempt per server is always made."""
    abort_retries: int = 2
    """Times an aborted generation is sent again before it is raised as an ``EngineError``."""
    backoff_s: float = 0.2
    """First wait between attempts; doubles each time."""
    max_backoff_s: float = 5.0
    """Longest wait between attempts."""
    cooldown_s: float = 2.0
    """How long a server that failed is avoided when another is up."""
    ready_poll_s: float = 2.0
    """How often an actor waiting for a ready engine asks :meth:`SGLangClient.ready` again."""
    api_key_file: str = ""
    """File holding the servers' API key (sent as ``Authorization: Bearer``); empty =
    ``$LEAFE_ENGINE_API_KEY_FILE`` when set, else no key. The key itself never sits in a config."""
    context_length: int = 0
    """The engines' context length in tokens: a prompt this long or longer raises
    :class:`~leafe.actors.engine.PromptTooLong` before it is sent (an engine would refuse it with
    400, which the sglang router counts against the engine). 0: the actor service fills in its
    model's ``max_position_embeddings`` (SGLang's default context length); a client built with 0
    does not check."""
    admin_key_file: str = ""
    """File holding the servers' admin key, sent instead of the API key on the weight routes
    (``/update_weights_from_disk``): the one client that reloads (weight sync) has it, actors never
    do. Empty = ``$LEAFE_ENGINE_ADMIN_KEY_FILE`` when set, else the API key (a keyless server, or
    SGLang without ``--admin-api-key``)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.ready_poll_s > 0:
            raise ValueError(f"ready_poll_s must be > 0, got {self.ready_poll_s!r}")
        for name in (
            "retries",
            "abort_retries",
            "backoff_s",
            "max_backoff_s",
            "cooldown_s",
            "context_length",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


_DEFAULTS = SGLangClientConfig()


class EngineUnavailable(EngineError):
    """No server could be reached or every one answered 502/503/504 (loading, reloading,
    restarting): the request never ran, so it says nothing about the task; the actor waits for a
    ready engine and does not count it against the task's delivery attempts."""


class NotFound(EngineError):
    """HTTP 404: the route does not exist on that server."""


@dataclass
class Server:
    url: str
    in_flight: int = 0
    down_until: float = 0.0


class Transient(Exception):
    """A failure worth retrying on another server."""


def auth_headers(key_file: str, what: str = "API") -> dict[str, str]:
    """``Authorization: Bearer <key>`` from ``key_file``; none without a file. A named file that
    cannot be read, or is empty, is an error (a client silently without its key would only meet
    401s)."""
    if not key_file:
        return {}
    try:
        key = Path(key_file).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(
            f"cannot read the engine {what} key file {key_file!r}: {e.strerror}"
        ) from None
    if not key:
        raise ValueError(f"the engine {what} key file {key_file!r} is empty")
    return {"Authorization": f"Bearer {key}"}


class ServerPool:
    """The servers behind one client: which one gets a request, and how transient failures are
    retried (an async context manager; it owns the aiohttp session)."""

    def __init__(self, urls: str | Sequence[str], config: SGLangClientConfig) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("SGLangClient needs at least one server URL")
        self.config = config
        key_file = config.api_key_file or os.environ.get("LEAFE_ENGINE_API_KEY_FILE", "")
        self._headers = auth_headers(key_file)
        admin_file = config.admin_key_file or os.environ.get("LEAFE_ENGINE_ADMIN_KEY_FILE", "")
        self._admin_headers = auth_headers(admin_file, "admin") or self._headers
        """Sent on the admin routes instead of the API key (``admin_key_file``)."""
        self.servers = [Server(u.rstrip("/")) for u in url_list]
        self._session: aiohttp.ClientSession | None = None
        self._turn = 0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=self._headers
            )
        return self._session

    def _pick(self) -> Server:
        """Among servers not cooling down: the one the task's affinity key prefers (rendezvous
        hashing, so a key keeps its server when others come and go) unless it has ``AFFINITY_SLACK``
        more requests in flight than the least loaded; else the least loaded (ties rotate). All
        cooling: soonest back."""
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now]
        self._turn += 1
        if not up:
            return min(self.servers, key=lambda s: s.down_until)
        n = len(up)
        rotated = [up[(self._turn + i) % n] for i in range(n)]
        least = min(rotated, key=lambda s: s.in_flight)
        key = ENGINE_AFFINITY.get()
        if key is None or n == 1:
            return least
        preferred = max(
            up, key=lambda s: hashlib.blake2b(f"{key}|{s.url}".encode(), digest_size=8).digest()
        )
        return preferred if preferred.in_flight <= least.in_flight + AFFINITY_SLACK else least

    async def _once(
        self, server: Server, method: str, path: str, payload: Any, timeout_s: float
    ) -> bytes:
        t = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.connect_timeout_s)
        url = server.url + path
        server.in_flight += 1
        try:
            async with self._http().request(method, url, json=payload, timeout=t) as resp:
                body = await resp.read()
                status = resp.status
                router_error = resp.headers.get("x-smg-error-code", "")
        except aiohttp.ConnectionTimeoutError as e:
            raise Transient(f"connect timeout after {self.config.connect_timeout_s} s ({e})") from e
        except TimeoutError as e:
            raise EngineError(f"{url} timed out after {timeout_s} s (not retried)") from e
        except aiohttp.ClientError as e:  # refused, reset, disconnected, truncated body
            raise Transient(f"{type(e).__name__}: {e}") from e
        finally:
            server.in_flight -= 1
        if status == 200:
            return body
        if status in _RETRY_STATUS or router_error in _ROUTER_UNREACHED:
            raise Transient(f"HTTP {status}: {error_message(body)}")
        if status == 404:
            raise NotFound(f"{url} answered HTTP 404: {error_message(body)}")
        raise EngineError(f"{url} answered HTTP {status}: {error_message(body)}")

    async def _request(
        self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None
    ) -> bytes:
        """Send to the least-loaded server, retrying transient failures on others with backoff."""
        attempts = max(self.config.retries + 1, len(self.servers))
        failures: list[str] = []
        for attempt in range(attempts):
            server = self._pick()
            try:
                return await self._once(
                    server, method, path, payload, timeout_s or self.config.timeout_s
                )
            except Transient as e:
                server.down_until = time.monotonic() + self.config.cooldown_s
                failures.append(f"{server.url} ({e})")
                log.warning(
                    "engine.request.retry",
                    url=server.url,
                    path=path,
                    attempt=attempt + 1,
                    error=str(e),
                )
            if attempt + 1 < attempts:
                await asyncio.sleep(
                    min(self.config.max_backoff_s, self.config.backoff_s * 2**attempt)
                )
        raise EngineUnavailable(
            f"{path} failed on every inference server after {attempts} attempts: "
            + "; ".join(failures)
        )

    async def _each(
        self, method: str, path: str, payload: Any, timeout_s: float, *, admin: bool = False
    ) -> list[tuple[str, int, bytes]]:
        """``method path`` on every server at once; ``admin``: with the admin key."""
        headers = self._admin_headers if admin else None

        async def one(server: Server) -> tuple[str, int, bytes]:
            t = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.connect_timeout_s)
            try:
                async with self._http().request(
                    method, server.url + path, json=payload, timeout=t, headers=headers
                ) as resp:
                    return server.url, resp.status, await resp.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                return server.url, 0, f"unreachable: {type(e).__name__}: {e}".encode()

        return list(await asyncio.gather(*(one(s) for s in self.servers)))
