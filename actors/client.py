"""Async client for SGLang's native HTTP API (real SGLang servers or ``leafe inference``): the
actors' :class:`~leafe.actors.engine.Engine`.

    async with SGLangClient(["http://127.0.0.1:30000", "http://gpu-2:30000"]) as engine:
        [c] = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=32, temperature=0))
        c.output_ids, c.logprobs, c.weight_version

Which server gets a request and how transient failures are retried is
:class:`~leafe.actors.server_pool. ServerPool`'s part (``actors/server_pool.py``); this module
speaks the routes. Error bodies are read in any of SGLang's three shapes; unknown response keys are
ignored (docs/sglang-api.md).

An aborted generation (``meta_info.finish_reason.type == "abort"``: a weight update with
``abort_all_requests``, a scheduler abort) is never returned as a completion, since it would become
a Step with no action: it is sent again up to ``abort_retries`` times, then raised as an
``EngineError``; an abort carrying status 400 (the request itself is bad) is raised at once.
A prompt of ``context_length`` tokens or more (:class:`SGLangClientConfig`) raises
``PromptTooLong`` without being sent: the engine would refuse it with 400, and the sglang router
counts refusals against the engine (five in a row open its circuit). ``/model_info`` falls back to
its deprecated alias ``/get_model_info`` on a 404 (the sglang router shipped with SGLang 0.5.23 may
serve only the old route). Timeouts, retries and backoff are
:class:`SGLangClientConfig` fields, so a service config can carry them
(``SGLangClient.from_config``).

In-flight counts are this client's own (share one client among an actor's episodes; across machines,
put the sglang router in front). The aiohttp session belongs to the event loop that first used it:
use one client per loop, and close it (``async with``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog

from leafe.actors.engine import Completion, EngineError, PromptTooLong, SamplingParams
from leafe.actors.server_pool import (
    EngineUnavailable,
    NotFound,
    ServerPool,
    SGLangClientConfig,
)
from leafe.actors.sglang_wire import (
    Aborted,
    GenerateOutput,
    UpdateResult,
    decode_outputs,
    error_message,
    generate_payloads,
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

_MODEL_INFO_ROUTES = ("/model_info", "/get_model_info")
_READY_ROUTES = ("/ready", "/readiness")
"""Cheap readiness routes: SGLang's and our CPU server's ``/ready`` (200 only once the model is
loaded and warmed up), then the sglang router's ``/readiness`` (200 only while it has a healthy
worker)."""

_DEFAULTS = SGLangClientConfig()


class SGLangClient(ServerPool):
    """:class:`~leafe.actors.engine.Engine` over one or more SGLang-compatible servers (async
    context manager)."""

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
        context_length: int = _DEFAULTS.context_length,
        api_key_file: str = _DEFAULTS.api_key_file,
        admin_key_file: str = _DEFAULTS.admin_key_file,
    ) -> None:
        """Keyword arguments are :class:`SGLangClientConfig`'s fields (validated the same way)."""
        config = SGLangClientConfig(
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            health_timeout_s=health_timeout_s,
            retries=retries,
            abort_retries=abort_retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            cooldown_s=cooldown_s,
            ready_poll_s=ready_poll_s,
            context_length=context_length,
            api_key_file=api_key_file,
            admin_key_file=admin_key_file,
        )
        super().__init__(urls, config)
        self._model_info_route = _MODEL_INFO_ROUTES[0]
        self._ready_route = _READY_ROUTES[0]

    @classmethod
    def from_config(cls, urls: str | Sequence[str], config: SGLangClientConfig) -> SGLangClient:
        """A client over ``urls`` with ``config``'s timeouts and retries."""
        return cls(urls, **msgspec.structs.asdict(config))

    async def generate_raw(
        self, payload: dict[str, Any], *, timeout_s: float | None = None
    ) -> bytes:
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
        """``n`` completions of ``input_ids`` (raises :class:`EngineError`, also for a generation
        the server aborted ``abort_retries + 1`` times); ``timeout_s`` overrides the per-request
        timeout."""
        if not input_ids:
            raise EngineError("generate needs a non-empty prompt (input_ids=[])")
        if n < 1:
            raise EngineError(f"n must be >= 1, got {n}")
        limit = self.config.context_length
        if limit and len(input_ids) >= limit:
            raise PromptTooLong(
                f"the prompt has {len(input_ids)} tokens, the engines' context length is {limit}: "
                "not sent"
            )
        payloads = generate_payloads(input_ids, params, n, return_logprob)
        tasks = [asyncio.ensure_future(self._generate_one(p, timeout_s)) for p in payloads]
        try:
            outs = [out for part in await asyncio.gather(*tasks) for out in part]
        except BaseException:  # one request failed: the others' samples would be of no use
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        completions = [to_completion(o) for o in outs]
        if len(completions) != n:
            raise EngineError(
                f"asked for n={n} completions, the server returned {len(completions)}"
            )
        return completions

    async def _generate_one(
        self, payload: dict[str, Any], timeout_s: float | None
    ) -> list[GenerateOutput]:
        """One ``/generate`` request's results, sent again while the server aborts it
        (``abort_retries``)."""
        attempt = 0
        while True:
            outs = decode_outputs(await self.generate_raw(payload, timeout_s=timeout_s))
            try:
                raise_if_aborted(outs)
                return outs
            except Aborted as e:
                attempt += 1
                log.warning("engine.generate.aborted", attempt=attempt, error=str(e))
                if not e.retryable or attempt > self.config.abort_retries:
                    raise EngineError(f"{e} (after {attempt} attempt(s))") from None
            await asyncio.sleep(
                min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
            )

    async def model_info(self) -> dict[str, Any]:
        """``/model_info`` of the least-loaded reachable server (``/get_model_info`` where the first
        is 404, as behind the sglang router of SGLang 0.5.23; the route that answered is
        remembered)."""
        routes = [
            self._model_info_route,
            *(r for r in _MODEL_INFO_ROUTES if r != self._model_info_route),
        ]
        missing: list[str] = []
        for route in routes:
            try:
                body = await self._request("GET", route, timeout_s=self.config.health_timeout_s)
            except NotFound as e:
                missing.append(str(e))
                continue
            self._model_info_route = route
            info = msgspec.json.decode(body)
            if not isinstance(info, dict):
                raise EngineError(f"unexpected {route} response: {info!r}")
            return info
        raise EngineError("no model info route: " + "; ".join(missing))

    async def weight_version(self) -> str:
        """The weight version a server currently serves (from ``/model_info``): weight sync and
        drains ask one server directly. Never for episodes: through a router this is the first
        healthy worker's, not the generating one's; episodes read ``Completion.weight_version``
        (``meta_info.weight_version``)."""
        return str((await self.model_info()).get("weight_version", "default"))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, *, timeout_s: float = 600.0
    ) -> list[UpdateResult]:
        """Ask every server to load ``model_path`` (an admin route: sent with the admin key,
        ``admin_key_file``); one result per server (never raises for a server)."""
        payload: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self.weight_route("/update_weights_from_disk", payload, timeout_s=timeout_s)

    async def weight_route(
        self, route: str, payload: dict[str, Any], *, timeout_s: float = 600.0
    ) -> list[UpdateResult]:
        """POST ``payload`` to an SGLang weight route answering ``{"success", "message"}``
        (``/update_weights_from_disk``, ``/init_weights_update_group``,
        ``/update_weights_from_distributed``, ...) on every server, with the admin key; one result
        per server (never raises for a server)."""
        results = []
        for url, status, body in await self._each("POST", route, payload, timeout_s, admin=True):
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
                    body.decode("utf-8", "replace")
                    if not status
                    else f"HTTP {status}: {error_message(body)}"
                )
                results.append(UpdateResult(url=url, success=False, message=msg))
        return results

    async def health(self) -> dict[str, bool]:
        """``GET /health`` on every server (SGLang's can take seconds: ``health_timeout_s``)."""
        answers = await self._each("GET", "/health", None, self.config.health_timeout_s)
        return {url: status == 200 for url, status, _ in answers}

    async def ready(self) -> bool:
        """Whether some server is ready to generate: ``/ready`` (SGLang, ``leafe inference``), else
        the router's ``/readiness`` where ``/ready`` is 404 (the route that answered is remembered).
        Never raises: an unreachable or loading server is simply not ready."""
        routes = [self._ready_route, *(r for r in _READY_ROUTES if r != self._ready_route)]
        for route in routes:
            answers = await self._each("GET", route, None, self.config.connect_timeout_s)
            if any(status == 200 for _, status, _ in answers):
                self._ready_route = route
                return True
            if not all(status == 404 for _, status, _ in answers):
                return False
        return False
