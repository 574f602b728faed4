"""A recorded agent workload and its replay against any engine (for ``bench/inference.py``; not an
area).

The workload is what the project's own actors sent: Sokoban evaluation rollouts (the paper table's
settings) through our CPU server, one entry per ``/generate`` request with its prompt token ids,
sampling parameters, seed, completion length, episode and arrival order (``record_workload``; the
committed file is ``bench/workloads/sokoban_agent.json``). ``replay`` sends exactly those token ids,
asks for exactly the recorded completion lengths (EOS ignored) with the same seeds and logprobs on,
keeps ``in_flight`` episodes going at once and each episode's turns in order (turn t+1 leaves after
turn t returned, as the actor's loop does), so the multi-turn shared-prefix structure is the one the
actors produced. Three targets: our server's SGLang ``/generate`` with ``input_ids``
(``SGLangTarget``), an OpenAI-compatible peer's ``/v1/completions`` with the prompt as a list of
token ids (``OpenAITarget``; vLLM), and llama-cpp-python's server, whose ``/v1/completions`` takes
text only (``LlamaCppTarget``: the ids decoded, and the server's own prompt token count checked
against them).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.inference_workload import ideal_prefix_share
from leafe.actors.client import SGLangClient
from leafe.actors.engine import Completion, SamplingParams

__all__ = [
    "WORKLOAD",
    "LlamaCppTarget",
    "OpenAITarget",
    "RecordingClient",
    "SGLangTarget",
    "WorkloadRequest",
    "episodes_of",
    "ideal_share",
    "load_workload",
    "replay",
    "save_workload",
]

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "sokoban_agent.json"
FORMAT = 1


@dataclass(frozen=True)
class WorkloadRequest:
    """One recorded ``/generate`` request."""

    order: int
    """Arrival order over the whole recording (0, 1, ...)."""
    episode: int
    """Episode (numbered by first arrival); its requests in ``turn`` order."""
    turn: int
    input_ids: list[int]
    completion_tokens: int
    """What the model generated when recorded: the replay asks for exactly this many."""
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_new_tokens: int
    """The actor's cap when recorded (the replay uses ``completion_tokens`` instead)."""


class RecordingClient(SGLangClient):
    """The actors' client, remembering every request: the episode is the asyncio task that sent it
    (``evaluate`` runs each rollout as one task, its turns one after another)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.recorded: list[WorkloadRequest] = []
        self._episodes: dict[int, int] = {}
        self._turns: dict[int, int] = {}

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
        timeout_s: float | None = None,
    ) -> list[Completion]:
        if n != 1:
            raise ValueError(
                f"the recorder replays one completion per request; the actor asked n={n}"
            )
        task = asyncio.current_task()
        episode = self._episodes.setdefault(id(task), len(self._episodes))
        turn = self._turns.get(episode, 0)
        self._turns[episode] = turn + 1
        order = len(self.recorded)
        self.recorded.append(None)  # type: ignore[arg-type]  # the slot keeps the arrival order
        [c] = await super().generate(
            input_ids, params, n=1, return_logprob=return_logprob, timeout_s=timeout_s
        )
        self.recorded[order] = WorkloadRequest(
            order=order, episode=episode, turn=turn, input_ids=[int(t) for t in input_ids],
            completion_tokens=len(c.output_ids), temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, seed=params.sampling_seed, max_new_tokens=params.max_new_tokens,
        )  # fmt: skip
        return [c]


def save_workload(path: Path, requests: list[WorkloadRequest], meta: dict[str, Any]) -> None:
    """One JSON object: ``meta`` (how it was recorded) and ``requests``, one compact line each."""
    lines = [json.dumps(r.__dict__, separators=(",", ":")) for r in requests]
    head = json.dumps({"format": FORMAT, "meta": meta}, indent=1)[:-2]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + ',\n "requests": [\n' + ",\n".join(lines) + "\n ]\n}\n")


def load_workload(path: Path = WORKLOAD) -> tuple[list[WorkloadRequest], dict[str, Any]]:
    """The requests in arrival order and the recording's meta; raises naming what is
    inconsistent."""
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, this code reads {FORMAT}")
    reqs = [WorkloadRequest(**r) for r in data["requests"]]
    turns: dict[int, int] = {}
    for i, r in enumerate(reqs):
        if (
            r.order != i
            or r.turn != turns.get(r.episode, 0)
            or r.completion_tokens < 1
            or not r.input_ids
        ):
            raise ValueError(f"{path}: request {i} out of order or empty: {r.__dict__!r:.200}")
        turns[r.episode] = r.turn + 1
    return reqs, data["meta"]


def ideal_share(requests: list[WorkloadRequest]) -> float:
    """The prefix-cache ceiling of the workload in arrival order (see ``ideal_prefix_share``)."""
    return ideal_prefix_share([r.input_ids for r in requests])


def episodes_of(
    requests: list[WorkloadRequest], limit: int | None = None
) -> list[list[WorkloadRequest]]:
    """Episodes in order of first arrival, each its turns in order; ``limit``: the first requests
    only."""
    out: dict[int, list[WorkloadRequest]] = {}
    for r in requests[:limit]:
        out.setdefault(r.episode, []).append(r)
    return list(out.values())


@dataclass
class SGLangTarget:
    """Our server (or SGLang): ``/generate`` with ``input_ids``; prefix reuse from
    ``/get_server_info``."""

    url: str
    name: str = "ours"

    def payload(self, r: WorkloadRequest) -> tuple[str, dict[str, Any]]:
        sp: dict[str, Any] = {
            "max_new_tokens": r.completion_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "top_k": r.top_k, "ignore_eos": True, "sampling_seed": r.seed,
        }  # fmt: skip
        return "/generate", {
            "input_ids": r.input_ids,
            "sampling_params": sp,
            "return_logprob": True,
        }

    def parse(self, body: Any, r: WorkloadRequest) -> tuple[int, int | None, int]:
        """(completion tokens, cached prompt tokens, logprobs returned)."""
        meta = body["meta_info"]
        return (
            len(body["output_ids"]),
            meta.get("cached_tokens"),
            len(meta.get("output_token_logprobs") or []),
        )

    async def reset(self, http: aiohttp.ClientSession) -> None:
        async with http.post(self.url + "/flush_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(
                    f"{self.url}/flush_cache answered {resp.status}: {await resp.text()}"
                )

    async def counters(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        async with http.get(self.url + "/get_server_info") as resp:
            state = (await resp.json())["internal_states"][0]
        times = (
            "prefill_s",
            "decode_s",
            "prefill_cpu_s",
            "decode_cpu_s",
            "prefill_calls",
            "decode_steps",
        )
        return {
            "cached_tokens": state["cached_tokens"],
            "prefilled_tokens": state["prefill_tokens"],
            "shared_tokens": state.get("shared_tokens", 0),
            **{k: state[k] for k in times if k in state},  # where our server's time went
            # decode steps by row count: what bench/compute_floor.py times the decode floor at
            **({"batch_sizes": state["batch_sizes"]} if "batch_sizes" in state else {}),
        }


_METRIC = re.compile(
    r"^(vllm:prefix_cache_(?:queries|hits)(?:_total)?)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M
)


@dataclass
class OpenAITarget:
    """An OpenAI-compatible peer (vLLM): ``/v1/completions`` with the prompt as token ids,
    ``ignore_eos`` and ``min_tokens = max_tokens`` (vLLM's extensions) so every completion has the
    recorded length."""

    url: str
    model: str = ""
    """Served model name (read from ``/v1/models`` by ``prepare`` when empty)."""
    name: str = "peer"
    reset_supported: bool = field(default=True)

    async def prepare(self, http: aiohttp.ClientSession) -> None:
        if not self.model:
            async with http.get(self.url + "/v1/models") as resp:
                self.model = (await resp.json())["data"][0]["id"]

    def payload(self, r: WorkloadRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": r.input_ids, "max_tokens": r.completion_tokens,
            "min_tokens": r.completion_tokens, "ignore_eos": True, "temperature": r.temperature,
            "top_p": r.top_p, "seed": r.seed, "logprobs": 1, "return_token_ids": True,
        }  # fmt: skip
        if (
            r.top_k > 0
        ):  # SGLang's -1 = off; vLLM's off is -1 or 0 depending on the version: leave it out
            body["top_k"] = r.top_k
        return "/v1/completions", body

    def parse(self, body: Any, r: WorkloadRequest) -> tuple[int, int | None, int]:
        [choice] = body["choices"]
        tokens = body["usage"]["completion_tokens"]
        ids = choice.get("token_ids")
        if ids is not None and len(ids) != tokens:
            raise ValueError(
                f"{self.url}: usage says {tokens} completion tokens, token_ids has {len(ids)}"
            )
        details = body["usage"].get("prompt_tokens_details") or {}
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        return tokens, details.get("cached_tokens"), len(logprobs)

    async def reset(self, http: aiohttp.ClientSession) -> None:
        """vLLM's ``/reset_prefix_cache`` exists only with ``VLLM_SERVER_DEV_MODE=1``: without it a
        later run would find the earlier run's prompts cached, so a missing route is an error, not a
        skip."""
        async with http.post(self.url + "/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(
                    f"{self.url}/reset_prefix_cache answered {resp.status}: start the peer with "
                    "VLLM_SERVER_DEV_MODE=1 so each run starts with an empty prefix cache"
                )

    async def counters(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        found: dict[str, float] = {}
        for name, value in _METRIC.findall(text):
            key = "hits" if "hits" in name else "queries"
            found[key] = found.get(key, 0.0) + float(value)
        return found


@dataclass
class LlamaCppTarget:
    """llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``,
    ``bench/llama_cpp.sh``). Its ``/v1/completions`` takes the prompt as text only, so the recorded
    ids are decoded (special tokens kept) and the server tokenizes them again: a request whose
    ``usage.prompt_tokens`` differs from the recorded ids fails the replay. Exact lengths come from
    ``min_tokens = max_tokens`` (EOS suppressed until then); its sampler's extra stages are set to
    their no-ops (``min_p`` 0, ``repeat_penalty`` 1, ``top_k`` 0 where the recording had none).
    It has no route to empty its cache (by default it keeps only the last prompt's KV in its one
    context) and no prefix-cache counters."""

    url: str
    decode: Any
    """``ids -> text``, e.g. an HF tokenizer's ``decode`` with ``skip_special_tokens=False``."""
    model: str = ""
    name: str = "peer"

    async def prepare(self, http: aiohttp.ClientSession) -> None:
        if not self.model:
            async with http.get(self.url + "/v1/models") as resp:
                self.model = (await resp.json())["data"][0]["id"]

    def payload(self, r: WorkloadRequest) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", {
            "model": self.model, "prompt": self.decode(r.input_ids),
            "max_tokens": r.completion_tokens, "min_tokens": r.completion_tokens,
            "temperature": r.temperature, "top_p": r.top_p, "top_k": max(r.top_k, 0),
            "min_p": 0.0, "repeat_penalty": 1.0, "seed": r.seed, "logprobs": 1,
        }  # fmt: skip

    def parse(self, body: Any, r: WorkloadRequest) -> tuple[int, int | None, int]:
        [choice] = body["choices"]
        prompt = body["usage"]["prompt_tokens"]
        if prompt != len(r.input_ids):
            raise RuntimeError(
                f"{self.url}: request {r.order}'s text became {prompt} prompt tokens, recorded "
                f"{len(r.input_ids)}: the replay would not be like for like"
            )
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        return body["usage"]["completion_tokens"], None, len(logprobs)

    async def reset(self, http: aiohttp.ClientSession) -> None:
        """Nothing to empty: its one context holds the last prompt's KV, which the next run's first
        request (another prompt) mostly replaces."""

    async def counters(self, http: aiohttp.ClientSession) -> dict[str, float]:
        return {}


Target = SGLangTarget | OpenAITarget | LlamaCppTarget


async def _send(
    http: aiohttp.ClientSession, target: Target, r: WorkloadRequest
) -> tuple[float, int | None, int]:
    path, body = target.payload(r)
    t0 = time.perf_counter()
    async with http.post(target.url + path, json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(
                f"{target.name} {path} request {r.order} answered {resp.status}: {text[:500]}"
            )
    latency = time.perf_counter() - t0
    tokens, cached, logprobs = target.parse(json.loads(text), r)
    if tokens != r.completion_tokens or logprobs != tokens:
        raise RuntimeError(
            f"{target.name} request {r.order}: {tokens} completion tokens and {logprobs} logprobs, "
            f"asked for exactly {r.completion_tokens} (ignore_eos): the replay would not be "
            "like for like"
        )
    return latency, cached, tokens


def _delta(before: Any, after: Any) -> Any:
    """``after - before`` of a counter, or key by key of a histogram (``batch_sizes``)."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    return round(after - (before or 0), 3)


def _reuse(
    target: Target, before: dict[str, Any], after: dict[str, Any], prompt: int
) -> dict[str, Any]:
    """Prompt tokens served from the engine's prefix cache, by its own counters (None where it has
    none). Ours also prefills an identical prompt once for the requests admitted with it
    (``shared_tokens``): ``not_recomputed_share`` counts those too. vLLM's counters are tokens
    (queries = prompt tokens)."""
    d = {k: _delta(before.get(k), v) for k, v in after.items()}
    if isinstance(target, SGLangTarget):
        return {
            "prefix_cache_share": round(d["cached_tokens"] / prompt, 3),
            "not_recomputed_share": round((d["cached_tokens"] + d["shared_tokens"]) / prompt, 3),
            "engine_counters": d,
        }
    if "hits" in d and d.get("queries"):
        return {"prefix_cache_share": round(d["hits"] / d["queries"], 3), "engine_counters": d}
    return {"prefix_cache_share": None, "engine_counters": d}


async def replay(
    target: Target,
    requests: list[WorkloadRequest],
    *,
    in_flight: int = 16,
    limit: int | None = None,
    per_request: bool = False,
) -> dict[str, Any]:
    """Replay (the first ``limit`` of) ``requests`` against ``target`` from an empty prefix cache:
    ``in_flight`` episodes at once, started in recorded order, each episode's turns one after
    another. ``per_request``: also ``cached_per_request``, the cached prompt tokens the engine
    reported for each request, by order."""
    episodes = episodes_of(requests, limit)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    # idle connections closed by us after 2 s, before uvicorn's 5 s keep-alive closes them under a
    # request (vLLM's server did once: "Server disconnected" mid-run)
    connector = aiohttp.TCPConnector(keepalive_timeout=2.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        if isinstance(target, OpenAITarget | LlamaCppTarget):
            await target.prepare(http)
        await target.reset(http)
        before = await target.counters(http)
        gate = asyncio.Semaphore(in_flight)
        rows: list[tuple[float, int | None, int]] = []
        cached_of: dict[int, int | None] = {}

        async def episode(turns: list[WorkloadRequest]) -> None:
            async with gate:
                for r in turns:
                    rows.append(await _send(http, target, r))
                    cached_of[r.order] = rows[-1][1]

        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                for turns in episodes:
                    tg.create_task(episode(turns))
        except BaseExceptionGroup as eg:  # the first failure itself, not a group of one
            raise eg.exceptions[0] from eg
        wall = time.perf_counter() - t0
        after = await target.counters(http)
    sent = [r for e in episodes for r in e]
    prompt, completion = sum(len(r.input_ids) for r in sent), sum(r.completion_tokens for r in sent)
    latencies = sorted(x for x, _, _ in rows)
    reported = [c for _, c, _ in rows if c is not None]
    return {
        "engine": target.name,
        "requests": len(sent),
        "episodes": len(episodes),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "wall_s": round(wall, 3),
        "completion_tokens_per_s": round(completion / wall, 2),
        "latency_mean_s": round(statistics.mean(latencies), 3),
        "latency_p90_s": round(latencies[int(0.9 * (len(latencies) - 1))], 3),
        "cached_tokens_reported": sum(reported) if len(reported) == len(rows) else None,
        **_reuse(target, before, after, prompt),
        **(
            {"cached_per_request": [cached_of[i] for i in sorted(cached_of)]} if per_request else {}
        ),
    }
