"""SGLang's distributed weight update for the CPU inference server: ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group`` (request and response
shapes as SGLang 0.5.23's, docs/sglang-api.md).

```
 sender (rank 0: weight sync)                    this server (rank = rank_offset)
 TCPStore master :port ◄──── /init_weights_update_group {master_address, master_port, ...}
   ProcessGroupGloo ◄────────── rendezvous ────────► ProcessGroupGloo (its own store prefix)
 POST /update_weights_from_distributed {names, dtypes, shapes, weight_version} ─► empty tensors
   broadcast(t_0), broadcast(t_1), ... ─────────────────────────────────────────► received
                       digest of what arrived == manifest sha256 of <root>/<version>? ─► swap
```

Each group is its own ``ProcessGroupGloo`` on its own ``TCPStore`` (the sender's), prefixed by the
group name: no default process group is created, so nothing else in the process (the learner's
FSDP group in a test, another group) can collide with it. One broadcast per announced tensor, in
the announced order, from rank 0, as SGLang's receiver does: a sender written for SGLang pushes to
this server unchanged, and ours pushes to SGLang.

While the tensors arrive the old weights keep serving (they land in new buffers, as a disk load
does). Then, as SGLang: ``abort_all_requests`` aborts every request; otherwise running requests
finish on the old weights and new ones wait for the swap; the prefix cache is emptied with the old
weights (``flush_cache=false`` cannot keep KV computed by weights that are gone).

The announcement is checked before a byte is received: well formed, within the size bound, and
exactly the tensors of the version's export ``<weights root>/<weight_version>/`` (names, dtypes,
shapes from its safetensors header). A refused announcement leaves the group out of step, so this
side leaves it (the sender's broadcast fails and it forms a new group); every member judges the
same announcement alike, so none is still receiving when another's refusal stops the sender. What
arrives is checked before it serves: the sha256 of the export's header followed by the received
bytes must equal the file's sha256 in the export's ``manifest.json``. So the disk record stays the
truth and a broadcast can only install a version that is on disk; a mismatch is refused (HTTP 400)
and the old weights keep serving.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch
from aiohttp import web

from leafe.services.inference.api import RequestError, decode_json
from leafe.services.inference.weights import (
    ExportIndex,
    WeightLoadError,
    check_announced,
    export_index,
    fit_state,
    received_digest,
)

__all__ = [
    "DEFAULT_GROUP",
    "DestroyGroupRequest",
    "DistributedUpdateRequest",
    "InitGroupRequest",
    "WeightGroups",
    "parse_dtype",
]

log = structlog.get_logger(__name__)

DEFAULT_GROUP = "weight_update_group"
"""SGLang's default ``group_name``."""
MAX_GROUPS = 4
"""Most groups one server belongs to at once (each holds sockets to every other member)."""
MAX_WORLD = 4096
"""Largest group accepted (ranks)."""
ANNOUNCED_SLACK = 2.0
"""An announcement may name at most this many times the serving model's bytes in float32."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InitGroupRequest(msgspec.Struct, kw_only=True):
    """SGLang's ``InitWeightsUpdateGroupReqInput``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class DistributedUpdateRequest(msgspec.Struct, kw_only=True):
    """SGLang's ``UpdateWeightsFromDistributedReqInput`` (``torch_empty_cache`` and
    ``load_format`` are accepted and have nothing to do on CPU)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class DestroyGroupRequest(msgspec.Struct, kw_only=True):
    """SGLang's ``DestroyWeightsUpdateGroupReqInput``."""

    group_name: str = DEFAULT_GROUP


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` (SGLang takes both) as a torch dtype; only the
    floating dtypes a model is served in."""
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise RequestError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return dtype


@dataclass
class _Group:
    name: str
    rank: int
    world_size: int
    pg: Any
    timeout_s: float
    busy: threading.Lock = field(default_factory=threading.Lock)


def _join(req: InitGroupRequest, timeout_s: float) -> Any:
    """This server's end of the group: a client of the sender's store, a gloo group on it."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(
        req.master_address,
        req.master_port,
        req.world_size,
        False,
        timeout=timeout,
        wait_for_workers=False,
    )
    return ProcessGroupGloo(
        PrefixStore(f"leafe/{req.group_name}", store), req.rank_offset, req.world_size, timeout
    )


def _receive(group: _Group, names: list[str], specs: list[tuple[torch.dtype, tuple[int, ...]]]):
    """Every announced tensor, broadcast from rank 0 in the announced order."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = datetime.timedelta(seconds=group.timeout_s)
    out = {
        name: torch.empty(shape, dtype=dtype)
        for name, (dtype, shape) in zip(names, specs, strict=True)
    }
    works = [group.pg.broadcast([out[name]], opts) for name in names]
    for w in works:
        w.wait()
    return out


def _body(success: bool, message: str) -> dict[str, Any]:
    return {"success": success, "message": message}


class WeightGroups:
    """The server's weight-update groups and the three routes that drive them.

    ``engine`` returns the running :class:`GenerationEngine`; ``reload_lock`` is the server's (one
    weight update at a time, disk or distributed); ``on_loaded`` is told the export a swap came
    from."""

    def __init__(
        self,
        *,
        engine: Callable[[], Any],
        weights_root: Path | None,
        reload_lock: asyncio.Lock,
        timeout_s: float,
        on_loaded: Callable[[Path], None],
    ) -> None:
        self._engine = engine
        self._root = weights_root
        self._reload_lock = reload_lock
        self._timeout_s = timeout_s
        self._on_loaded = on_loaded
        self._groups: dict[str, _Group] = {}

    def routes(self, app: web.Application) -> None:
        """Add the three POST routes to ``app`` (admin routes: ``auth.ADMIN_PREFIXES``)."""
        app.router.add_post("/init_weights_update_group", self.init_group)
        app.router.add_post("/update_weights_from_distributed", self.update)
        app.router.add_post("/destroy_weights_update_group", self.destroy)
        app.router.add_route("GET", "/get_weights_by_name", self.weights_by_name)
        app.router.add_route("POST", "/get_weights_by_name", self.weights_by_name)

    def describe(self) -> dict[str, Any]:
        """Groups joined: name -> rank and world size."""
        return {g.name: {"rank": g.rank, "world_size": g.world_size} for g in self._groups.values()}

    async def close(self) -> None:
        """Leave every group."""
        for name in list(self._groups):
            self._leave(name)

    # ---- routes
    async def init_group(self, request: web.Request) -> web.Response:
        try:
            req = await _decode(request, InitGroupRequest)
            self._check_init(req)
        except RequestError as e:
            return web.json_response(_body(False, str(e)), status=400)
        t0 = time.perf_counter()
        try:
            pg = await _in_daemon(_join, req, self._timeout_s)
        except Exception as e:  # rendezvous refused, timed out or reset: say why, join nothing
            message = f"Failed to init group: {type(e).__name__}: {e}"
            log.warning("inference.group.init_failed", group=req.group_name, error=message)
            return web.json_response(_body(False, message), status=400)
        self._groups[req.group_name] = _Group(
            name=req.group_name,
            rank=req.rank_offset,
            world_size=req.world_size,
            pg=pg,
            timeout_s=self._timeout_s,
        )
        log.info(
            "inference.group.joined",
            group=req.group_name,
            rank=req.rank_offset,
            world_size=req.world_size,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return web.json_response(_body(True, "Succeeded to initialize custom process group."))

    async def destroy(self, request: web.Request) -> web.Response:
        try:
            req = await _decode(request, DestroyGroupRequest)
        except RequestError as e:
            return web.json_response(_body(False, str(e)), status=400)
        if req.group_name not in self._groups:
            message = f"Group {req.group_name!r} not in the update groups."
            return web.json_response(_body(False, message), status=400)
        self._leave(req.group_name)
        return web.json_response(_body(True, "Succeeded to destroy custom process group."))

    async def update(self, request: web.Request) -> web.Response:
        engine = self._engine()
        assert engine is not None
        try:
            req = await _decode(request, DistributedUpdateRequest)
        except RequestError as e:
            return web.json_response(_body(False, str(e)), status=400)
        group = self._groups.get(req.group_name)
        if group is None:
            message = (
                f"Group {req.group_name!r} not in the update groups: call "
                "/init_weights_update_group first."
            )
            return web.json_response(_body(False, message), status=400)
        try:
            specs = self._check_announced(req, engine.model)
        except RequestError as e:  # the sender broadcasts regardless: out of step, so leave
            self._leave(req.group_name)
            message = f"{e}. Left the group (the sender must form a new one)."
            log.warning("inference.group.update_refused", group=req.group_name, reason=message)
            return web.json_response(_body(False, message), status=400)
        try:  # judged before a byte is received: every member refuses alike, none mid-broadcast
            index = await asyncio.to_thread(self._export_of, req, specs)
        except WeightLoadError as e:
            self._leave(req.group_name)
            message = f"{e} Left the group (the sender must form a new one)."
            log.warning("inference.group.update_refused", group=req.group_name, reason=message)
            return web.json_response(_body(False, message), status=400)
        if not group.busy.acquire(blocking=False):
            message = f"Group {req.group_name!r} is already receiving an update."
            return web.json_response(_body(False, message), status=400)
        t0 = time.perf_counter()
        try:
            try:
                state = await _in_daemon(_receive, group, req.names, specs)
            except Exception as e:  # a member died or the sender timed out: the group is unusable
                self._leave(req.group_name)
                message = (
                    f"Failed to update weights: broadcast failed ({type(e).__name__}: "
                    f"{str(e)[:300]}). Left the group; the old weights keep serving."
                )
                log.warning("inference.group.broadcast_failed", group=req.group_name, error=message)
                return web.json_response(_body(False, message), status=400)
        finally:
            group.busy.release()
        receive_s = time.perf_counter() - t0
        async with self._reload_lock:
            try:
                state, export = await asyncio.to_thread(self._checked, index, state, engine.model)
            except WeightLoadError as e:
                log.warning(
                    "inference.weights.rejected",
                    version=req.weight_version,
                    reason=str(e),
                    serving=engine.version,
                )
                return web.json_response(_body(False, str(e)), status=400)
            aborted = await asyncio.wrap_future(
                engine.swap_weights(state, req.weight_version, abort_all=req.abort_all_requests)
            )
            self._on_loaded(export)
        log.info(
            "inference.weights.updated",
            transport="distributed",
            version=engine.version,
            receive_s=round(receive_s, 3),
            total_s=round(time.perf_counter() - t0, 3),
            aborted=aborted,
        )
        message = "Succeeded to update parameter online from distributed."
        message += f" Weight version updated to {req.weight_version}."
        return web.json_response(_body(True, message))

    async def weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name {"name", "truncate_size": 100}``: the first
        ``truncate_size`` rows of a served parameter as nested lists of floats (exact for float32,
        bfloat16 and float16 values: JSON carries them as doubles)."""
        engine = self._engine()
        assert engine is not None
        try:
            body = decode_json(await request.read()) if request.can_read_body else {}
            if not isinstance(body, dict):
                raise RequestError("The request body must be a JSON object.")
            name, rows = body.get("name"), body.get("truncate_size", 100)
            if type(rows) is not int or rows < 1:
                raise RequestError(f"truncate_size must be an int >= 1, got {rows!r}")
            tensor = engine.model.state_dict().get(name) if isinstance(name, str) else None
            if tensor is None:
                raise RequestError(f"Get parameter by name failed: no parameter {name!r}")
        except RequestError as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        values = await asyncio.to_thread(lambda: tensor[:rows].float().tolist())
        return web.json_response(values)

    # ---- checks
    def _check_init(self, req: InitGroupRequest) -> None:
        if req.backend not in ("gloo", "nccl"):
            raise RequestError(f"backend must be 'gloo' or 'nccl', got {req.backend!r}")
        if req.backend == "nccl":
            raise RequestError(
                "backend 'nccl' needs CUDA; the LEAFE CPU server joins weight groups over 'gloo'"
            )
        if not 2 <= req.world_size <= MAX_WORLD:
            raise RequestError(f"world_size must be in 2..{MAX_WORLD}, got {req.world_size}")
        if not 1 <= req.rank_offset < req.world_size:
            raise RequestError(
                f"rank_offset must be in 1..world_size-1 (rank 0 sends), got {req.rank_offset}"
            )
        if not 0 < req.master_port < 65536 or not req.master_address:
            raise RequestError(
                f"master_address:master_port must name the sender's store, got "
                f"{req.master_address!r}:{req.master_port}"
            )
        if not req.group_name or len(req.group_name) > 200:
            raise RequestError("group_name must be a non-empty string of at most 200 characters")
        if req.group_name in self._groups:
            raise RequestError(f"Group {req.group_name!r} already exists: destroy it first.")
        if len(self._groups) >= MAX_GROUPS:
            raise RequestError(
                f"this server is in {len(self._groups)} groups already (at most {MAX_GROUPS})"
            )

    def _check_announced(
        self, req: DistributedUpdateRequest, model: torch.nn.Module
    ) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """The announcement is well formed and of bounded size (what receiving it would allocate),
        before a byte is received."""
        n = len(req.names)
        if not n or len(req.dtypes) != n or len(req.shapes) != n:
            raise RequestError(
                f"names, dtypes and shapes must be non-empty and of one length, got {n}, "
                f"{len(req.dtypes)}, {len(req.shapes)}"
            )
        if len(set(req.names)) != n:
            raise RequestError("names must be distinct")
        if not req.weight_version:
            raise RequestError(
                "weight_version is required: what arrives is checked against that version's "
                "export under the weights root"
            )
        specs = []
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes, strict=True):
            if any(type(d) is not int or d < 0 for d in shape) or len(shape) > 8:
                raise RequestError(f"{name}: shape {shape!r} is not a list of sizes >= 0")
            specs.append((parse_dtype(dtype), tuple(shape)))
        limit = ANNOUNCED_SLACK * 4 * sum(p.numel() for p in model.state_dict().values())
        announced = sum(math.prod(s) * d.itemsize for d, s in specs)
        if announced > limit:
            raise RequestError(
                f"the announcement names {announced} bytes, more than {int(limit)} (twice the "
                "serving model in float32)"
            )
        return specs

    def _export_of(
        self, req: DistributedUpdateRequest, specs: list[tuple[torch.dtype, tuple[int, ...]]]
    ) -> ExportIndex:
        """The version's export (its manifest and safetensors header only), which the announcement
        must match name for name, dtype and shape."""
        version = req.weight_version or ""
        if "/" in version or version in (".", ".."):
            raise WeightLoadError(f"Failed to update weights: bad weight_version {version!r}.")
        if self._root is None:
            raise WeightLoadError(
                "Failed to update weights: this server has no weights root, so a broadcast "
                "cannot be checked against its export (start it with --weights-root DIR)."
            )
        index = export_index(Path(self._root) / version, root=self._root)
        check_announced(index, dict(zip(req.names, specs, strict=True)))
        return index

    def _checked(
        self,
        index: ExportIndex,
        state: dict[str, torch.Tensor],
        model: torch.nn.Module,
    ) -> tuple[dict[str, torch.Tensor], Path]:
        """What arrived is the version's export, byte for byte, and fits the serving model."""
        check_announced(index, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
        digest = received_digest(index, state)
        if digest != index.sha256:
            raise WeightLoadError(
                f"Failed to update weights: the received tensors hash to {digest}, "
                f"{index.path}/{index.file} is {index.sha256} in its manifest. "
                "Rolling back to original weights."
            )
        return fit_state(state, model, where="the broadcast"), Path(index.path)

    def _leave(self, name: str) -> None:
        group = self._groups.pop(name, None)
        if group is None:
            return
        try:
            group.pg.shutdown()
        except Exception as e:  # already broken: nothing more to release
            log.debug("inference.group.shutdown_error", group=name, error=str(e))
        log.info("inference.group.left", group=name)


async def _in_daemon(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own: a rendezvous or receive blocked on a member that
    never comes cannot be woken, and must not hold the process's exit (the default executor's
    threads are joined at exit) for the group's timeout."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as e:  # handed to the awaiting handler, which reports it
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(_settle, done, *outcome)
        except RuntimeError:  # the server stopped meanwhile: nobody waits any more
            pass

    threading.Thread(target=run, name="leafe-weight-group", daemon=True).start()
    return await done


def _settle(done: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if done.done():  # the handler was cancelled meanwhile
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


async def _decode(request: web.Request, kind: type[Any]) -> Any:
    body = decode_json(await request.read())
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as e:
        raise RequestError(f"Invalid request: {e}") from None
