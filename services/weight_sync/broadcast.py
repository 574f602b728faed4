"""Rank 0 of a weight-update group: weight sync's sender for ``transport = "distributed"``.

```
 WeightSender.form(urls)   child process: TCPStore master :port, ProcessGroupGloo rank 0
                           POST /init_weights_update_group {rank_offset: i+1, ...} to each engine
 WeightSender.push(s, v)   POST /update_weights_from_distributed {names, dtypes, shapes, v}
                           child: broadcast(t) for each tensor (bucket_bytes in flight at once)
                           ──► one result per engine; any failure kills the child (group gone)
```

Rank 0 lives in a child process (tensors reach it through shared memory), because nothing else
lets a failed group go: neither ``shutdown()`` nor ``abort()`` wakes a member blocked in a
receive, and our end cannot be dropped while the failed broadcast's queued work holds it. Killing
the child closes its sockets, and every member still waiting fails at once ("Connection closed by
peer") instead of at its timeout; the old weights keep serving there. Each formation gets a fresh
group name, so an engine holding a dead group from an earlier formation never mixes the two.

The group is built on its own store, never the default process group, so it cannot collide with
anything else in either process. The wire is SGLang's (one broadcast per announced tensor, in the
announced order), so the same sender pushes to SGLang engines and to ``leafe inference``.
"""

from __future__ import annotations

import asyncio
import datetime
import multiprocessing
import secrets
import socket
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from leafe.actors.client import SGLangClient, UpdateResult

if TYPE_CHECKING:
    import torch

__all__ = ["GroupError", "WeightSender", "free_port"]

log = structlog.get_logger(__name__)


class GroupError(RuntimeError):
    """The group could not be formed or a push failed; the message says which engine and why."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Spec(msgspec.Struct, frozen=True, kw_only=True):
    """What the child needs to become rank 0."""

    name: str
    port: int
    world: int
    backend: str
    timeout_s: float
    bucket_bytes: int


def _rank0(conn: Connection, spec: _Spec) -> None:
    """The child: rendezvous as rank 0, then broadcast each state it is sent until the pipe
    closes. Any failure is reported and ends the process (its sockets close with it)."""
    import torch
    from torch.distributed import BroadcastOptions, PrefixStore, TCPStore

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        store = TCPStore(
            "0.0.0.0", spec.port, spec.world, True, timeout=timeout, wait_for_workers=False
        )
        prefixed = PrefixStore(f"leafe/{spec.name}", store)
        if spec.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg: Any = ProcessGroupNCCL(prefixed, 0, spec.world, options)
        else:
            from torch.distributed import ProcessGroupGloo

            pg = ProcessGroupGloo(prefixed, 0, spec.world, timeout)
        conn.send(("formed", ""))
    except Exception as e:
        conn.send(("error", f"rendezvous: {type(e).__name__}: {str(e)[:300]}"))
        return
    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = timeout
    device = torch.device("cuda" if spec.backend == "nccl" else "cpu")
    while True:
        try:
            tensors = conn.recv()
        except EOFError:
            return
        try:
            works, in_flight = [], 0
            for t in tensors:
                t = t.to(device).contiguous()
                works.append(pg.broadcast([t], opts))
                in_flight += t.numel() * t.element_size()
                if in_flight >= spec.bucket_bytes:
                    for w in works:
                        w.wait()
                    works, in_flight = [], 0
            for w in works:
                w.wait()
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {str(e)[:300]}"))
            return
        conn.send(("sent", ""))


class _Child:
    """The rank-0 process and our end of its pipe."""

    def __init__(self, spec: _Spec) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc: multiprocessing.process.BaseProcess = ctx.Process(
            target=_rank0, args=(child_conn, spec), daemon=True, name=f"leafe-{spec.name}"
        )
        self.proc.start()
        child_conn.close()

    async def answer(self, timeout_s: float) -> tuple[str, str]:
        """The child's next message (``("error", why)`` if it died or said nothing in time)."""

        def wait() -> tuple[str, str]:
            if not self.conn.poll(timeout_s):
                return "error", f"no answer from rank 0 in {timeout_s:.0f} s"
            try:
                return tuple(self.conn.recv())  # type: ignore[return-value]
            except (EOFError, OSError):
                return "error", f"rank 0 exited (code {self.proc.exitcode})"

        return await asyncio.to_thread(wait)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


class _Formed(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    members: tuple[str, ...]


class WeightSender:
    """Forms a group of a rank-0 child and engines, and pushes state dicts to it."""

    def __init__(
        self,
        clients: dict[str, SGLangClient],
        *,
        master_address: str,
        port: int,
        backend: str,
        timeout_s: float,
        bucket_bytes: int,
        run_id: str,
    ) -> None:
        self.clients = clients
        self.master_address = master_address
        self.port = port
        self.backend = backend
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.run_id = run_id
        self._formed: _Formed | None = None
        self._child: _Child | None = None

    @property
    def members(self) -> tuple[str, ...]:
        """Engines in the current group (empty when none is formed)."""
        return self._formed.members if self._formed else ()

    async def form(self, urls: list[str]) -> None:
        """A new group of a rank-0 child and ``urls`` (ranks 1..N in that order); the old one is
        disbanded first. Raises :class:`GroupError` naming the engines that failed to join."""
        import torch

        await self.disband()
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise GroupError("group_backend 'nccl' needs a GPU in the weight-sync process")
        spec = _Spec(
            name=f"leafe-{self.run_id}-{secrets.token_hex(6)}",
            port=self.port or free_port(),
            world=len(urls) + 1,
            backend=self.backend,
            timeout_s=self.timeout_s,
            bucket_bytes=self.bucket_bytes,
        )
        t0 = time.perf_counter()
        child = self._child = _Child(spec)
        joins = [
            self.clients[url].weight_route(
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": spec.port,
                    "rank_offset": rank,
                    "world_size": spec.world,
                    "group_name": spec.name,
                    "backend": self.backend,
                },
                timeout_s=self.timeout_s + 30.0,
            )
            for rank, url in enumerate(urls, start=1)
        ]
        answers = [r for [r] in await asyncio.gather(*joins)]
        failed = [r for r in answers if not r.success]
        status, why = ("error", "") if failed else await child.answer(self.timeout_s + 30.0)
        if failed or status != "formed":
            self._kill()
            await self._destroy_on([r.url for r in answers if r.success], spec.name)
            detail = "; ".join(f"{r.url}: {r.message}" for r in failed) or why
            raise GroupError(f"the weight group did not form: {detail}")
        self._formed = _Formed(name=spec.name, members=tuple(urls))
        log.info(
            "weight_sync.group.formed",
            group=spec.name,
            members=list(urls),
            port=spec.port,
            backend=self.backend,
            seconds=round(time.perf_counter() - t0, 3),
        )

    async def push(self, state: dict[str, torch.Tensor], version: str) -> list[UpdateResult]:
        """Broadcast ``state`` as ``version`` to every member; one result per member. Any failure
        (an engine refusing, the broadcast breaking, a timeout) disbands the group: the next push
        forms a new one."""
        formed, child = self._formed, self._child
        if formed is None or child is None:
            raise GroupError("no weight group is formed")
        names = list(state)
        payload = {
            "names": names,
            "dtypes": [str(state[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(state[n].shape) for n in names],
            "group_name": formed.name,
            "weight_version": version,
            "flush_cache": True,
            "abort_all_requests": False,
        }
        t0 = time.perf_counter()
        calls = [
            asyncio.ensure_future(
                self.clients[url].weight_route(
                    "/update_weights_from_distributed", payload, timeout_s=self.timeout_s + 60.0
                )
            )
            for url in formed.members
        ]
        tensors = [state[n].detach() for n in names]
        await asyncio.to_thread(child.conn.send, tensors)
        sent = asyncio.ensure_future(child.answer(self.timeout_s + 60.0))
        send_error = await self._settle(sent, calls)
        results = [
            UpdateResult(url=url, success=False, message=f"no answer: {send_error}")
            if c.cancelled()
            else c.result()[0]
            for url, c in zip(formed.members, calls, strict=True)
        ]
        if send_error or not all(r.success for r in results):
            await self.disband()
            results = [
                r
                if r.success or not send_error
                else msgspec.structs.replace(r, message=f"{r.message} (sender: {send_error})")
                for r in results
            ]
        log.info(
            "weight_sync.group.pushed",
            version=version,
            ok=sum(r.success for r in results),
            members=len(results),
            sender_error=send_error or None,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return results

    async def _settle(
        self, sent: asyncio.Future[tuple[str, str]], calls: Sequence[asyncio.Future[Any]]
    ) -> str:
        """Wait for the broadcast and every engine's answer. The first failure (rank 0's broadcast
        raising, an engine refusing or leaving) kills rank 0, so the members still waiting for
        tensors fail at once. Returns rank 0's error, empty when it sent everything."""
        pending: set[asyncio.Future[Any]] = {sent, *calls}
        deadline = time.monotonic() + self.timeout_s + 60.0
        send_error = ""
        while pending:
            done, pending = await asyncio.wait(
                pending,
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:  # a member neither receives nor dies: give up on this group
                send_error = send_error or f"no progress in {self.timeout_s + 60.0:.0f} s"
                for c in pending:
                    c.cancel()
                break
            if sent in done and sent.result()[0] != "sent":
                send_error = sent.result()[1]
            refused = any(c in done and not all(r.success for r in c.result()) for c in calls)
            if send_error or refused:
                self._kill()  # the members still waiting fail now, not at their timeout
        return send_error

    def _kill(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    async def disband(self) -> None:
        """Leave the current group: rank 0 ends, engines are asked to destroy theirs."""
        formed, self._formed = self._formed, None
        self._kill()
        if formed is None:
            return
        await self._destroy_on(list(formed.members), formed.name)
        log.info("weight_sync.group.disbanded", group=formed.name)

    async def _destroy_on(self, urls: list[str], name: str) -> None:
        """Best effort: an engine that already left (or died) has nothing to destroy."""
        await asyncio.gather(
            *(
                self.clients[u].weight_route(
                    "/destroy_weights_update_group", {"group_name": name}, timeout_s=10.0
                )
                for u in urls
            )
        )
