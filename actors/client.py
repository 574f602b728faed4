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

In-flight counts are this client's own (share one client among an actor's episodes; across machines,
put the sglang router in front). The aiohttp session belongs to the event loop that first used it: use
one client per loop, and close it (``async with``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec
import structlog

from actors.engine import Completion, EngineError, SamplingParams

__all__ = ["SGLangClient", "UpdateResult", "error_message", "parse_completions"]

log = structlog.get_logger(__name__)

_RETRY_STATUS = frozenset({502, 503, 504})
_MAX_SHOWN_BODY = 500


class _FinishReason(msgspec.Struct):
    type: str = "stop"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class _MetaInfo(msgspec.Struct):
    id: str = ""
    finish_reason: _FinishReason | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str = "default"
    output_token_logprobs: list[list[Any]] | None = None


class _Output(msgspec.Struct):
    output_ids: list[int]
    meta_info: _MetaInfo
    text: str = ""


_FINISH: dict[str, Literal["stop", "length", "abort"]] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
}


class UpdateResult(msgspec.Struct, frozen=True, kw_only=True):
    """One server's answer to ``/update_weights_from_disk``."""

    url: str
    success: bool
    message: str
    num_paused_requests: int = 0


def error_message(body: bytes | str) -> str:
    """The error text of an SGLang error body: ``{"error": str}``, ``{"error": {"message": str}}``,
    ``{"object": "error", "message": str}`` (or FastAPI's ``{"detail": ...}``); raw text otherwise."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text.strip()[:_MAX_SHOWN_BODY] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message") is not None:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if data.get(key) is not None:
                return str(data[key])
    return text.strip()[:_MAX_SHOWN_BODY]


def _completion(out: _Output) -> Completion:
    meta = out.meta_info
    fr = meta.finish_reason
    kind = fr.type if isinstance(fr, _FinishReason) else (fr or "stop")
    logprobs = None
    if meta.output_token_logprobs is not None:
        logprobs = [math.nan if e[0] is None else float(e[0]) for e in meta.output_token_logprobs]
    return Completion(
        text=out.text,
        output_ids=out.output_ids,
        logprobs=logprobs,
        finish_reason=_FINISH.get(kind, "abort"),
        weight_version=meta.weight_version,
        prompt_tokens=meta.prompt_tokens,
        cached_tokens=meta.cached_tokens,
    )


def parse_completions(body: bytes) -> list[Completion]:
    """Completions of a ``/generate`` response body (one object, or a list for a batch or ``n > 1``)."""
    try:
        data = msgspec.json.decode(body)
        outs = msgspec.convert(data if isinstance(data, list) else [data], list[_Output])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise EngineError(f"unexpected /generate response ({e}): {body[:_MAX_SHOWN_BODY]!r}") from None
    for out in outs:
        fr = out.meta_info.finish_reason
        if isinstance(fr, _FinishReason) and fr.type == "abort":
            log.warning("engine.generate.aborted", message=fr.message, rid=out.meta_info.id)
    return [_completion(o) for o in outs]


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    down_until: float = 0.0


class _Transient(Exception):
    """A failure worth retrying on another server."""


class SGLangClient:
    """:class:`~actors.engine.Engine` over one or more SGLang-compatible servers (async context manager)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        health_timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        cooldown_s: float = 2.0,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("SGLangClient needs at least one server URL")
        self.servers = [_Server(u.rstrip("/")) for u in url_list]
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_timeout_s = health_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cooldown_s = cooldown_s
        self._session: aiohttp.ClientSession | None = None
        self._turn = 0

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
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def _pick(self) -> _Server:
        """Least in-flight among servers not cooling down (ties rotate); all cooling: soonest back."""
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now]
        self._turn += 1
        if not up:
            return min(self.servers, key=lambda s: s.down_until)
        n = len(up)
        rotated = [up[(self._turn + i) % n] for i in range(n)]
        return min(rotated, key=lambda s: s.in_flight)

    async def _once(self, server: _Server, method: str, path: str, payload: Any, timeout_s: float) -> bytes:
        t = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        url = server.url + path
        server.in_flight += 1
        try:
            async with self._http().request(method, url, json=payload, timeout=t) as resp:
                body = await resp.read()
                status = resp.status
        except aiohttp.ConnectionTimeoutError as e:
            raise _Transient(f"connect timeout after {self.connect_timeout_s} s ({e})") from e
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
        raise EngineError(f"{url} answered HTTP {status}: {error_message(body)}")

    async def _request(
        self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None
    ) -> bytes:
        """Send to the least-loaded server, retrying transient failures on others with backoff."""
        attempts = max(self.retries + 1, len(self.servers))
        failures: list[str] = []
        for attempt in range(attempts):
            server = self._pick()
            try:
                return await self._once(server, method, path, payload, timeout_s or self.timeout_s)
            except _Transient as e:
                server.down_until = time.monotonic() + self.cooldown_s
                failures.append(f"{server.url} ({e})")
                log.warning(
                    "engine.request.retry", url=server.url, path=path, attempt=attempt + 1, error=str(e)
                )
            if attempt + 1 < attempts:
                await asyncio.sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))
        raise EngineError(
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
        """``n`` completions of ``input_ids`` (raises :class:`EngineError`); ``timeout_s`` overrides the
        client's per-request timeout."""
        if not input_ids:
            raise EngineError("generate needs a non-empty prompt (input_ids=[])")
        if n < 1:
            raise EngineError(f"n must be >= 1, got {n}")
        sampling = params.to_sglang()
        if n > 1:
            sampling["n"] = n
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": sampling,
            "return_logprob": return_logprob,
        }
        completions = parse_completions(await self.generate_raw(payload, timeout_s=timeout_s))
        if len(completions) != n:
            raise EngineError(f"asked for n={n} completions, the server returned {len(completions)}")
        return completions

    async def model_info(self) -> dict[str, Any]:
        """``/model_info`` of the least-loaded reachable server."""
        info = msgspec.json.decode(await self._request("GET", "/model_info", timeout_s=self.health_timeout_s))
        if not isinstance(info, dict):
            raise EngineError(f"unexpected /model_info response: {info!r}")
        return info

    async def weight_version(self) -> str:
        """The weight version a server currently serves (from ``/model_info``)."""
        return str((await self.model_info()).get("weight_version", "default"))

    async def _each(
        self, method: str, path: str, payload: Any, timeout_s: float
    ) -> list[tuple[str, int, bytes]]:
        async def one(server: _Server) -> tuple[str, int, bytes]:
            t = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
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
        answers = await self._each("GET", "/health", None, self.health_timeout_s)
        return {url: status == 200 for url, status, _ in answers}
