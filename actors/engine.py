"""What actors need from an inference engine: ``generate`` over token ids, and the engine's version.

``actors/client.py`` implements :class:`Engine` over SGLang's native HTTP API (a real SGLang server
or our CPU server, ``services/inference/server.py``); tests use scripted fakes with the same
interface.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Literal, Protocol

import msgspec

__all__ = [
    "ENGINE_AFFINITY",
    "Completion",
    "Engine",
    "EngineError",
    "PromptTooLong",
    "SamplingParams",
]


class EngineError(RuntimeError):
    """Generation failed (server error body, every server down, timeout); the message says which."""


class PromptTooLong(EngineError):
    """A prompt of at least the engines' context length: refused by the client before it is sent
    (an engine would answer 400, and the sglang router counts such answers against the engine); the
    message gives both lengths."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """SGLang ``sampling_params`` (the subset we use; names and defaults as SGLang's)."""

    max_new_tokens: int = 64
    """Completion length cap."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """-1 = off."""
    stop: list[str] = msgspec.field(default_factory=list)
    """Stop strings (cut from ``text``, kept in ``output_ids``)."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    """Extra stop token ids besides EOS."""
    sampling_seed: int | None = None
    """Per-request seed for reproducible sampling (``None``: engine's choice)."""

    def to_sglang(self) -> dict[str, object]:
        """JSON ``sampling_params`` for SGLang (omits unset optional keys; SGLang rejects unknown
        ones)."""
        out: dict[str, object] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One generated completion."""

    text: str
    """Decoded text (stop string and EOS excluded, as SGLang returns it)."""
    output_ids: list[int]
    """Exact generated token ids (a matched EOS/stop token included); the training target."""
    logprobs: list[float] | None = None
    """Log-probability of each output id under the serving weights, when requested."""
    finish_reason: Literal["stop", "length", "abort"] = "stop"
    """Why generation ended."""
    weight_version: str = "default"
    """Weight version that served the request (SGLang ``meta_info.weight_version``)."""
    prompt_tokens: int = 0
    """Prompt length in tokens."""
    cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache."""


ENGINE_AFFINITY: ContextVar[str | None] = ContextVar("leafe_engine_affinity", default=None)
"""A key naming what the current asyncio task generates for (an episode's task group): engines with
several servers send the requests of one key to the same server when it is not much busier than the
others, so consecutive turns and sibling samples find their shared prompt prefix in that server's
cache. Set by the explorer for the duration of an episode; each asyncio task has its own value."""


class Engine(Protocol):
    """Anything actors can generate with."""

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
    ) -> list[Completion]:
        """``n`` completions of one prompt (raises :class:`EngineError`)."""
        ...

    async def weight_version(self) -> str:
        """The version the engine currently serves."""
        ...
