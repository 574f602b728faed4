"""Async client for SGLang's native HTTP API (real SGLang servers or ``leafe inference``): the actors'
:class:`~actors.engine.Engine`.

    async with SGLangClient(["http://127.0.0.1:30000", "http://gpu-2:30000"]) as engine:
        [c] = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=32, temperature=0))
        c.output_ids, c.logprobs, c.weight_version

Each request goes to the server with the fewest requests in flight from this client. Connection errors
(refused, reset, connect timeout) and 502/503/504 answers are retried on the next server with
exponential backoff; a server that failed is avoided for a short cooldown. HTTP 400 (bad request) and a
request that times out after connecting are not retried (a slow generation would be run twice). When
every attempt fails, :class:`~actors.engine.EngineError` names each server and why. Error bodies are read
in any of SGLang's three shapes; unknown response keys are ignored (docs/sglang-api.md).

An aborted generation (``meta_info.finish_reason.type == "abort"``: a weight update with
``abort_all_requests``, a scheduler abort) is never returned as a completion, since it would become a
Step with no action: it is sent again up to ``abort_retries`` times, then raised as an ``EngineError``;
an abort carrying status 400 (the request itself is bad) is raised at once. ``/model_info`` falls back
to its deprecated alias ``/get_model_info`` on a 404 (the sglang router shipped with SGLang 0.5.23 may
serve only the old route). Timeouts, retries and backoff are :class:`SGLangClientConfig` fields, so a
service config can carry them (``SGLangClient.from_config``).

In-flight counts are this client's own (share one client among an actor's episodes; across machines,
put the sglang router in front). The aiohttp session belongs to the event loop that first used it: use
one client per loop, and close it (``async with``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from actors.engine import ENGINE_AFFINITY, Completion, EngineError, SamplingParams
from actors.sglang_wire import (
    Aborted,
    UpdateResult,
    decode_outputs,
    error_message,
    generate_payload,
    parse_completions,
    raise_if_aborted,
    split_seeds,
    to_completion,
)

__all__ = [
    "EngineUnavailable",
    "SGLangClient",
    "SGLangClientConfig",
    "UpdateResult",
    "error_message",
    "parse_completions",
    "split_seeds",
]

log = structlog.get_logger(__name__)

_RETRY_STATUS = frozenset({502, 503, 504})
_MODEL_INFO_ROUTES = ("/model_info", "/get_model_info")
_READY_ROUTES = ("/ready", "/readiness")
"""Cheap readiness routes: SGLang's and our CPU server's ``/ready`` (200 only once the model is loaded and
warmed up), then the sglang router's ``/readiness`` (200 only while it has a healthy worker)."""


AFFINITY_SLACK = 8
"""Requests in flight a server may have beyond the least loaded one and still get its affinity keys."""


class SGLangClientConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the client talks to its servers (a service config can embed it, e.g. as ``[actor.engine]``)."""

    timeout_s: float = 300.0
    """Whole-request timeout of one ``/generate`` once connected; not retried when exceeded (the
    generation may still be running). Long CPU generations or big batches on a busy GPU want more."""
    connect_timeout_s: float = 5.0
    """TCP connect timeout; a connect timeout is retried on another server."""
    health_timeout_s: float = 30.0
    """Timeout of ``/health`` and ``/model_info`` (SGLang's ``/health`` runs a generation: seconds)."""
    retries: int = 3
    """Extra attempts after a transient failure (connection error, 502/503/504); at least one attempt
    per server is always made."""
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

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.ready_poll_s > 0:
            raise ValueError(f"ready_poll_s must be > 0, got {self.ready_poll_s!r}")
        for name in ("retries", "abort_retries", "backoff_s", "max_backoff_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


_DEFAULTS = SGLangClientConfig()


class EngineUnavailable(EngineError):
    """No server could be reached or every one answered 502/503/504 (loading, reloading, restarting): the
    request never ran, so it says nothing about the task; the actor waits for a ready engine and does not
    count it against the task's delivery attempts."""


class _NotFound(EngineError):
    """HTTP 404: the route does not exist on that server."""


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    down_until: float = 0.0


class _Transient(Exception):
    """A failure worth retrying on another server."""


def _auth_headers(key_file: str) -> dict[str, str]:
    """``Authorization: Bearer <key>`` from ``key_file``; none without a file. A named file that cannot be
    read, or is empty, is an error (a client silently without its key would only meet 401s)."""
    if not key_file:
        return {}
    try:
        key = Path(key_file).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"cannot read the engine API key file {key_file!r}: {e.strerror}") from None
    if not key:
        raise ValueError(f"the engine API key file {key_file!r} is empty")
    return {"Authorization": f"Bearer {key}"}


class SGLangClient:
    """:class:`~actors.engine.Engine` over one or more SGLang-compatible servers (async context manager)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = _DEFAULTS.timeout_s,
        connect_timeout_s: float = _DEFAULTS.connect_timeout_s,
        health_timeout_s: float = _DEFAULTS.health_timeout_s,
        retries: int = _DEFAULTS.retries,
        abort_retries: int = _DEFAULTS.abort_retries,
        backoff_s: float = _DEFAULTS.backoff_s,
        max_backoff_s: float = _DEFAULTS.max_backoff_s,
        cooldown_s: float = _DEFAULTS.cooldown_s,
        ready_poll_s: float = _DEFAULTS.ready_poll_s,
        api_key_file: str = _DEFAULTS.api_key_file,
    ) -> None:
        """Keyword arguments are :class:`SGLangClientConfig`'s fields (validated the same way)."""
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("SGLangClient needs at least one server URL")
        self.config = SGLangClientConfig(
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            health_timeout_s=health_timeout_s,
            retries=retries,
            abort_retries=abort_retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            cooldown_s=cooldown_s,
            ready_poll_s=ready_poll_s,
            api_key_file=api_key_file,
        )
        self._headers = _auth_headers(api_key_file or os.environ.get("LEAFE_ENGINE_API_KEY_FILE", ""))
        self.servers = [_Server(u.rstrip("/")) for u in url_list]
        self._session: aiohttp.ClientSession | None = None
        self._turn = 0
        self._model_info_route = _MODEL_INFO_ROUTES[0]
        self._ready_route = _READY_ROUTES[0]

    @classmethod
    def from_config(cls, urls: str | Sequence[str], config: SGLangClientConfig) -> SGLangClient:
        """A client over ``urls`` with ``config``'s timeouts and retries."""
        return cls(urls, **msgspec.structs.asdict(config))

    async def __aenter__(self) -> SGLangClient:
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

    def _pick(self) -> _Server:
        """Among servers not cooling down: the one the task's affinity key prefers (rendezvous hashing,
        so a key keeps its server when others come and go) unless it has ``AFFINITY_SLACK`` more requests
        in flight than the least loaded; else the least loaded (ties rotate). All cooling: soonest back."""
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
        preferred = max(up, key=lambda s: hashlib.blake2b(f"{key}|{s.url}".encode(), digest_size=8).digest())
        return preferred if preferred.in_flight <= least.in_flight + AFFINITY_SLACK else least

    async def _once(self, server: _Server, method: str, path: str, payload: Any, timeout_s: float) -> bytes:
        t = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.connect_timeout_s)
        url = server.url + path
        server.in_flight += 1
        try:
            async with self._http().request(method, url, json=payload, timeout=t) as resp:
                body = await resp.read()
                status = resp.status
        except aiohttp.ConnectionTimeoutError as e:
            raise _Transient(f"connect timeout after {self.config.connect_timeout_s} s ({e})") from e
        except TimeoutError as e:
            raise EngineError(f"{url} timed out after {timeout_s} s (not retried)") from e
        except aiohttp.ClientError as e:  # refused, reset, disconnected, truncated body
            raise _Transient(f"{type(e).__name__}: {e}") from e
        finally:
            server.in_flight -= 1
        if status == 200:
            return body
        if status in _RETRY_STATUS:
            raise _Transient(f"HTTP {status}: {error_message(body)}")
        if status == 404:
            raise _NotFound(f"{url} answered HTTP 404: {error_message(body)}")
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
                return await self._once(server, method, path, payload, timeout_s or self.config.timeout_s)
            except _Transient as e:
                server.down_until = time.monotonic() + self.config.cooldown_s
                failures.append(f"{server.url} ({e})")
                log.warning(
                    "engine.request.retry", url=server.url, path=path, attempt=attempt + 1, error=str(e)
                )
            if attempt + 1 < attempts:
                await asyncio.sleep(min(self.config.max_backoff_s, self.config.backoff_s * 2**attempt))
        raise EngineUnavailable(
            f"{path} failed on every inference server after {attempts} attempts: " + "; ".join(failures)
        )

    async def generate_raw(self, payload: dict[str, Any], *, timeout_s: float | None = None) -> bytes:
        """POST a raw ``/generate`` body (for tools and tests); returns the response body."""
        return await self._request("POST", "/generate", payload, timeout_s=timeout_s)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
        timeout_s: float | None = None,
    ) -> list[Completion]:
        """``n`` completions of ``input_ids`` (raises :class:`EngineError`, also for a generation the
        server aborted ``abort_retries + 1`` times); ``timeout_s`` overrides the per-request timeout."""
        if not input_ids:
            raise EngineError("generate needs a non-empty prompt (input_ids=[])")
        if n < 1:
            raise EngineError(f"n must be >= 1, got {n}")
        payload = generate_payload(input_ids, params, n, return_logprob)
        for attempt in range(self.config.abort_retries + 1):
            outs = decode_outputs(await self.generate_raw(payload, timeout_s=timeout_s))
            try:
                raise_if_aborted(outs)
                break
            except Aborted as e:
                log.warning("engine.generate.aborted", attempt=attempt + 1, error=str(e))
                if not e.retryable or attempt == self.config.abort_retries:
                    raise EngineError(f"{e} (after {attempt + 1} attempt(s))") from None
                await asyncio.sleep(min(self.config.max_backoff_s, self.config.backoff_s * 2**attempt))
        completions = [to_completion(o) for o in outs]
        if len(completions) != n:
            raise EngineError(f"asked for n={n} completions, the server returned {len(completions)}")
        return completions

    async def model_info(self) -> dict[str, Any]:
        """``/model_info`` of the least-loaded reachable server (``/get_model_info`` where the first is
        404, as behind the sglang router of SGLang 0.5.23; the route that answered is remembered)."""
        routes = [self._model_info_route, *(r for r in _MODEL_INFO_ROUTES if r != self._model_info_route)]
        missing: list[str] = []
        for route in routes:
            try:
                body = await self._request("GET", route, timeout_s=self.config.health_timeout_s)
            except _NotFound as e:
                missing.append(str(e))
                continue
            self._model_info_route = route
            info = msgspec.json.decode(body)
            if not isinstance(info, dict):
                raise EngineError(f"unexpected {route} response: {info!r}")
            return info
        raise EngineError("no model info route: " + "; ".join(missing))

    async def weight_version(self) -> str:
        """The weight version a server currently serves (from ``/model_info``): weight sync and drains ask
        one server directly. Never for episodes: through a router this is the first healthy worker's, not
        the generating one's; episodes read ``Completion.weight_version`` (``meta_info.weight_version``)."""
        return str((await self.model_info()).get("weight_version", "default"))

    async def _each(
        self, method: str, path: str, payload: Any, timeout_s: float
    ) -> list[tuple[str, int, bytes]]:
        async def one(server: _Server) -> tuple[str, int, bytes]:
            t = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.connect_timeout_s)
            try:
                async with self._http().request(method, server.url + path, json=payload, timeout=t) as resp:
                    return server.url, resp.status, await resp.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                return server.url, 0, f"unreachable: {type(e).__name__}: {e}".encode()

        return list(await asyncio.gather(*(one(s) for s in self.servers)))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, *, timeout_s: float = 600.0
    ) -> list[UpdateResult]:
        """Ask every server to load ``model_path``; one result per server (never raises for a server)."""
        payload: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        results = []
        for url, status, body in await self._each("POST", "/update_weights_from_disk", payload, timeout_s):
            try:
                data = msgspec.json.decode(body) if status else None
            except msgspec.DecodeError:
                data = None
            if isinstance(data, dict) and "success" in data:
                results.append(
                    UpdateResult(
                        url=url,
                        success=bool(data["success"]) and status == 200,
                        message=str(data.get("message", "")),
                        num_paused_requests=int(data.get("num_paused_requests") or 0),
                    )
                )
            else:
                msg = (
                    body.decode("utf-8", "replace") if not status else f"HTTP {status}: {error_message(body)}"
                )
                results.append(UpdateResult(url=url, success=False, message=msg))
        return results

    async def health(self) -> dict[str, bool]:
        """``GET /health`` on every server (SGLang's can take seconds: ``health_timeout_s``)."""
        answers = await self._each("GET", "/health", None, self.config.health_timeout_s)
        return {url: status == 200 for url, status, _ in answers}

    async def ready(self) -> bool:
        """Whether some server is ready to generate: ``/ready`` (SGLang, ``leafe inference``), else the
        router's ``/readiness`` where ``/ready`` is 404 (the route that answered is remembered). Never
        raises: an unreachable or loading server is simply not ready."""
        routes = [self._ready_route, *(r for r in _READY_ROUTES if r != self._ready_route)]
        for route in routes:
            answers = await self._each("GET", route, None, self.config.connect_timeout_s)
            if any(status == 200 for _, status, _ in answers):
                self._ready_route = route
                return True
            if not all(status == 404 for _, status, _ in answers):
                return False
        return False
