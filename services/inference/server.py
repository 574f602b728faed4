"""CPU inference server speaking SGLang's native HTTP API (the subset in docs/sglang-api.md), so
actors use the same client against it and against real SGLang servers.

Run it:
    leafe inference --model tiny|smollm2-135m-instruct|DIR --port 30000 --max-batch 16 \\
        --batch-wait-ms 5

In-process (``leafe run``, tests, benchmarks)::

    async with InferenceServer(InferenceConfig(model="tiny", port=0)) as server:
        url = server.url                      # http://127.0.0.1:<bound port>
    # or, from synchronous code (tests, benchmarks, notebooks): services/inference/local.py
    handle = start_in_thread(InferenceConfig(model="tiny", port=0)); handle.url; handle.stop()

Routes: POST /generate, POST /update_weights_from_disk, POST /update_weight_version, POST
/init_weights_update_group, /update_weights_from_distributed and /destroy_weights_update_group
(``services/inference/weight_group.py``), GET /model_info
(+ /get_model_info), GET /get_server_info, GET /health, GET /ready, GET|POST /flush_cache; anything
else is 404 ``{"detail": "Not Found"}``. The weight routes and ``/flush_cache`` need the admin key
(``services/inference/auth.py``). Generation runs in
:class:`leafe.services.inference.engine.GenerationEngine`'s worker thread with dynamic (continuous)
batching; a weight reload is read and checked in another thread and swapped in between batches.
Prompt prefixes are reused from a radix tree of KV (``services/inference/prefix.py``;
``meta_info.cached_tokens`` says how many). Simplified against SGLang: no streaming, no input
logprobs, no paged attention (each batch keeps its KV in one arena, ``services/inference/kv.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiohttp import web

from leafe.services.inference.api import (
    PromptJob,
    RequestError,
    copy_seed,
    decode_json,
    error_body,
    output_body,
    parse_generate,
)
from leafe.services.inference.auth import key_middleware, read_api_key
from leafe.services.inference.config import InferenceConfig
from leafe.services.inference.decode import GenSequence, StopChecker
from leafe.services.inference.engine import EngineClosed, GenerationEngine
from leafe.services.inference.prefix import PrefixCache
from leafe.services.inference.weight_group import WeightGroups
from leafe.services.inference.weights import WeightLoadError, load_weight_dir

__all__ = ["InferenceConfig", "InferenceServer", "serve"]

log = structlog.get_logger(__name__)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else (value or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _longest_token_bytes(tokenizer: Any) -> int:
    """UTF-8 bytes of the longest text one token stands for (81 for SmolLM2's vocabulary, a newline
    and 80 spaces; a partial UTF-8 sequence counts as the 3 bytes of its replacement char, so this
    never undercounts): a text longer than context length x this cannot fit the context and is
    refused untokenized."""
    return max(
        len(tokenizer.convert_tokens_to_string([token]).encode("utf-8"))
        for token in tokenizer.get_vocab()
    )


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def _json_body(request: web.Request) -> Any:
    """The request's JSON value (:func:`decode_json`: a :class:`RequestError` when it is none); a
    large body is decoded off the event loop."""
    raw = await request.read()
    return decode_json(raw) if len(raw) <= 1 << 20 else await asyncio.to_thread(decode_json, raw)


@web.middleware
async def _sglang_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
):
    """FastAPI-shaped bodies for unknown routes and methods, as SGLang's server answers them."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _json({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return _json({"detail": "Method Not Allowed"}, status=405)


class InferenceServer:
    """The HTTP server and its engine; ``await start()`` returns the URL, ``await stop()``
    drains."""

    def __init__(self, config: InferenceConfig) -> None:
        self.config = config
        self.api_key = read_api_key(config.api_key_file) if config.api_key_file else ""
        self.admin_key = read_api_key(config.admin_key_file) if config.admin_key_file else ""
        self.weights_root = Path(config.weights_root) if config.weights_root else None
        self.engine: GenerationEngine | None = None
        self.url = ""
        self.model_path = Path()
        self.tokenizer_path = Path()
        self._tokenizer: Any = None
        self._context_len = 0
        self._vocab_size = 0
        self._max_text_bytes = 0
        self._reload_lock = asyncio.Lock()
        self.groups = WeightGroups(
            engine=lambda: self.engine,
            weights_root=self.weights_root,
            reload_lock=self._reload_lock,
            timeout_s=config.weight_group_timeout_s,
            on_loaded=self._loaded_from,
        )
        """SGLang's distributed weight update (services/inference/weight_group.py)."""
        self._runner: web.AppRunner | None = None
        self._saved_threads = 0
        self.kernels: dict[str, Any] = {"linear": "aten", "attention": "sdpa"}
        """What ``services/inference/kernels.py`` installed (``/get_server_info``'s ``kernels``)."""

    async def __aenter__(self) -> InferenceServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _load(self) -> GenerationEngine:
        import torch

        from leafe.learner.model_io import load_model, load_tokenizer, resolve_model

        if self.config.threads > 0:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self.config.threads)
        path = resolve_model(self.config.model)
        self.model_path = self.tokenizer_path = path
        model = load_model(path, dtype=getattr(torch, self.config.dtype))
        if self.config.cpu_kernels:
            from leafe.services.inference.kernels import accelerate

            self.kernels = accelerate(model)
        self._tokenizer = load_tokenizer(path)
        self._context_len = int(getattr(model.config, "max_position_embeddings", 2048))
        self._vocab_size = int(getattr(model.config, "vocab_size", 0) or len(self._tokenizer))
        self._max_text_bytes = self._context_len * _longest_token_bytes(self._tokenizer)
        pad = self._tokenizer.pad_token_id
        eos = _eos_ids(model, self._tokenizer)
        return GenerationEngine(
            model,
            StopChecker(self._tokenizer, eos),
            pad_id=int(pad if pad is not None else min(eos)),
            max_batch=self.config.max_batch,
            batch_wait_s=self.config.batch_wait_ms / 1000.0,
            max_prefill_tokens=self.config.max_prefill_tokens,
            version=self.config.weight_version,
            prefix_cache=PrefixCache(self.config.prefix_cache_tokens)
            if self.config.prefix_cache_tokens
            else None,
            trim_idle_s=self.config.trim_idle_s,
            trim_growth_bytes=self.config.trim_growth_mb * 10**6,
            trim_every_s=self.config.trim_every_s,
        )

    def app(self) -> web.Application:
        """The aiohttp application (routes bound to this server)."""
        auth = key_middleware(self.api_key, self.admin_key)
        app = web.Application(middlewares=[auth, _sglang_errors], client_max_size=64 << 20)
        r = app.router
        r.add_route("POST", "/generate", self._generate)
        r.add_route("PUT", "/generate", self._generate)
        r.add_post("/update_weights_from_disk", self._update_weights)
        r.add_post("/update_weight_version", self._update_weight_version)
        r.add_get("/model_info", self._model_info)
        r.add_get("/get_model_info", self._model_info)
        r.add_get("/get_server_info", self._server_info)
        r.add_get("/health", self._health)
        r.add_get("/ready", self._health)
        r.add_route("GET", "/flush_cache", self._flush_cache)
        r.add_route("POST", "/flush_cache", self._flush_cache)
        r.add_post("/set_threads", self._set_threads)  # not SGLang's: the CPU server's thread plan
        self.groups.routes(app)
        return app

    def _loaded_from(self, path: Path) -> None:
        self.model_path = path

    async def start(self) -> str:
        """Load the model, start the engine and bind; returns the server's URL."""
        t0 = time.perf_counter()
        self.engine = await asyncio.to_thread(self._load)
        if self.config.threads > 0:
            self.engine.set_threads(self.config.threads)
        self.engine.start()
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1] if self._runner.addresses else self.config.port
        self.url = f"http://{self.config.host}:{port}"
        log.info(
            "inference.server.started",
            url=self.url,
            model=str(self.model_path),
            config=msgspec.to_builtins(self.config),
            load_s=round(time.perf_counter() - t0, 2),
        )
        return self.url

    async def stop(self) -> None:
        """Stop accepting requests, then stop the engine (unfinished requests fail)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.groups.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if (
            self._saved_threads
        ):  # the thread count is process-wide: give in-process callers theirs back
            import torch

            torch.set_num_threads(self._saved_threads)
            self._saved_threads = 0
        log.info("inference.server.stopped", url=self.url)

    # ---- handlers
    # ---------------------------------------------------------------------------------
    def _parse_generate(self, raw: bytes) -> tuple[list[PromptJob], bool]:
        return parse_generate(
            decode_json(raw),
            encode=lambda text: [int(t) for t in self._tokenizer.encode(text)],
            vocab_size=self._vocab_size,
            context_len=self._context_len,
            max_text_bytes=self._max_text_bytes,
        )

    async def _generate(self, request: web.Request) -> web.Response:
        engine = self.engine
        assert engine is not None
        raw = await request.read()
        # off the event loop: decoding and tokenizing a bounded request still take up to seconds
        try:
            jobs, batched = await asyncio.to_thread(self._parse_generate, raw)
        except RequestError as e:
            log.info("inference.request.rejected", reason=str(e))
            return _json(error_body(str(e)), status=400)
        seqs: list[list[GenSequence]] = []
        for job in jobs:
            copies = [
                GenSequence(
                    prompt=job.input_ids, spec=replace(job.spec, seed=copy_seed(job.spec.seed, i))
                )
                for i in range(job.n)
            ]
            seqs.append(copies)
        to_run = [s for copies in seqs for s in copies if s.spec.max_new_tokens > 0]
        for s in (s for copies in seqs for s in copies if s.spec.max_new_tokens == 0):
            s.finish, s.weight_version = {"type": "length", "length": 0}, engine.version
        if to_run:
            try:
                req = engine.submit(to_run)
            except EngineClosed as e:
                return _json(error_body(str(e)), status=503)
            try:
                await asyncio.wrap_future(req.future)
            except asyncio.CancelledError:
                engine.cancel(req)
                raise
            except EngineClosed as e:
                return _json(error_body(str(e)), status=503)
            except Exception as e:  # a failed forward: report it, the engine keeps serving
                return _json(error_body(f"Generation failed: {type(e).__name__}: {e}"), status=500)
        out = [
            output_body(s, rid=job.rid if job.n == 1 else None, return_logprob=job.return_logprob)
            for job, copies in zip(jobs, seqs, strict=True)
            for s in copies
        ]
        return _json(out if batched else out[0])

    async def _update_weights(self, request: web.Request) -> web.Response:
        engine = self.engine
        assert engine is not None
        try:
            body = await _json_body(request)
        except RequestError as e:
            return _json({"success": False, "message": str(e), "num_paused_requests": 0}, 400)
        if not isinstance(body, dict):
            return _json(
                {
                    "success": False,
                    "message": "body must be a JSON object",
                    "num_paused_requests": 0,
                },
                400,
            )
        path, version = body.get("model_path"), body.get("weight_version")
        fmt = body.get("load_format")
        if not isinstance(path, str) or not path or fmt not in (None, "auto", "safetensors"):
            msg = (
                "model_path (a directory) is required"
                if not path
                else f"unsupported load_format {fmt!r}"
            )
            return _json({"success": False, "message": msg, "num_paused_requests": 0}, 400)
        async with self._reload_lock:
            t0 = time.perf_counter()
            try:
                state = await asyncio.to_thread(
                    load_weight_dir, Path(path), engine.model, root=self.weights_root
                )
            except WeightLoadError as e:
                log.warning(
                    "inference.weights.rejected", path=path, reason=str(e), version=engine.version
                )
                return _json({"success": False, "message": str(e), "num_paused_requests": 0}, 400)
            load_s = time.perf_counter() - t0
            aborted = await asyncio.wrap_future(
                engine.swap_weights(
                    state,
                    None if version is None else str(version),
                    abort_all=bool(body.get("abort_all_requests", False)),
                )
            )
            self.model_path = Path(path)
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        log.info(
            "inference.weights.updated",
            path=path,
            version=engine.version,
            load_s=round(load_s, 3),
            total_s=round(time.perf_counter() - t0, 3),
            aborted=aborted,
        )
        return _json({"success": True, "message": msg, "num_paused_requests": 0})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        engine = self.engine
        assert engine is not None
        try:
            body = await _json_body(request)
        except RequestError as e:
            return _json({"success": False, "message": str(e)}, 400)
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str) or not version:
            return _json(
                {
                    "success": False,
                    "message": f"new_version must be a non-empty string: {version!r}",
                },
                400,
            )
        abort = bool(body.get("abort_all_requests", True))
        await asyncio.wrap_future(engine.swap_weights(None, version, abort_all=abort))
        return _json({"success": True, "message": f"Weight version updated to {version}."})

    async def _model_info(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        config = self.engine.model.config
        return _json(
            {
                "model_path": str(self.model_path),
                "tokenizer_path": str(self.tokenizer_path),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.version,
                "served_model_name": self.config.served_model_name or self.config.model,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        return _json(
            {
                **msgspec.to_builtins(self.config),
                "context_length": self._context_len,
                "weight_version": self.engine.version,
                "kernels": self.kernels,
                "weight_update_groups": self.groups.describe(),
                "internal_states": [self.engine.describe()],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        ok = self.engine is not None and self.engine.alive
        return web.Response(status=200 if ok else 503)

    async def _set_threads(self, request: web.Request) -> web.Response:
        """``{"threads": n}``: the engine's intra-op threads from its next step on, at most the
        cores this process may use (an admin route: ``auth.ADMIN_ROUTES``)."""
        assert self.engine is not None
        try:
            body = await _json_body(request)
        except RequestError as e:
            return _json({"success": False, "message": str(e)}, 400)
        threads = body.get("threads") if isinstance(body, dict) else None
        usable = len(os.sched_getaffinity(0))
        if type(threads) is not int or not 1 <= threads <= usable:
            message = (
                f"threads must be an int in 1..{usable} "
                f"(the cores this process may use): {threads!r}"
            )
            return _json({"success": False, "message": message}, 400)
        self.engine.set_threads(threads)
        return _json({"success": True, "message": f"threads set to {threads} from the next step"})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        held = self.engine.flush_cache()
        return web.Response(text=f"Cache flushed.\nDropped {held} cached prompt tokens.\n")


async def serve(
    config: InferenceConfig,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Run a server until ``stop`` is set or SIGTERM/SIGINT arrives (main thread only)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    async with InferenceServer(config) as server:
        if on_ready is not None:
            on_ready(server.url)
        await stop.wait()
