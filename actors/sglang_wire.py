"""The response shapes of SGLang's native ``/generate`` API (shared/SGLANG_API.md, SGLang 0.5.23)
and their parsing into :class:`~leafe.actors.engine.Completion`: lenient about keys SGLang adds,
strict about the ones we train on (``output_ids``), and explicit about aborted generations."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from leafe.actors.engine import Completion, EngineError, SamplingParams

__all__ = [
    "Aborted",
    "FinishReason",
    "GenerateOutput",
    "MetaInfo",
    "UpdateResult",
    "decode_outputs",
    "error_message",
    "generate_payloads",
    "parse_completions",
    "raise_if_aborted",
    "split_seeds",
    "to_completion",
]

MAX_SHOWN_BODY = 500
"""Characters of an unexpected body quoted in an error message."""


class FinishReason(msgspec.Struct):
    """``meta_info.finish_reason``."""

    type: str = "stop"
    """``stop``, ``length`` or ``abort``."""
    matched: int | str | None = None
    """Stop: the matched EOS/stop token id or stop string."""
    length: int | None = None
    """Length: tokens generated."""
    message: str | None = None
    """Abort: why."""
    status_code: int | None = None
    """Abort: the HTTP status SGLang attaches (400 = the request is bad; 503/500 = server side)."""


class MetaInfo(msgspec.Struct):
    """``meta_info`` of one result (keys we do not use are ignored)."""

    id: str = ""
    """Request id (``rid``)."""
    finish_reason: FinishReason | str | None = None
    """Why generation ended (an object; older servers send a plain string)."""
    prompt_tokens: int = 0
    """Prompt length in tokens."""
    completion_tokens: int = 0
    """Generated tokens."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    weight_version: str = "default"
    """The server's weight version when the request finished."""
    output_token_logprobs: list[list[Any]] | None = None
    """``[logprob, token_id, null]`` per output token (with ``return_logprob``)."""


class GenerateOutput(msgspec.Struct):
    """One ``/generate`` result."""

    output_ids: list[int]
    """Generated ids, a matched EOS/stop token included (the training target)."""
    meta_info: MetaInfo
    """Finish reason, version, token counts, logprobs."""
    text: str = ""
    """Decoded text, without the matched stop token or string."""


_FINISH: dict[str, Literal["stop", "length", "abort"]] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
}


def error_message(body: bytes | str) -> str:
    """The error text of an SGLang error body: ``{"error": str}``, ``{"error": {"message": str}}``,
    ``{"object": "error", "message": str}`` (or FastAPI's ``{"detail": ...}``); raw text
    otherwise."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text.strip()[:MAX_SHOWN_BODY] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message") is not None:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if data.get(key) is not None:
                return str(data[key])
    return text.strip()[:MAX_SHOWN_BODY]


def to_completion(out: GenerateOutput) -> Completion:
    """The :class:`Completion` of one result."""
    meta = out.meta_info
    fr = meta.finish_reason
    kind = fr.type if isinstance(fr, FinishReason) else (fr or "stop")
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


def decode_outputs(body: bytes) -> list[GenerateOutput]:
    """The results of a ``/generate`` body (an object or a list); :class:`EngineError` quoting it
    else."""
    try:
        data = msgspec.json.decode(body)
        return msgspec.convert(data if isinstance(data, list) else [data], list[GenerateOutput])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise EngineError(
            f"unexpected /generate response ({e}): {body[:MAX_SHOWN_BODY]!r}"
        ) from None


def parse_completions(body: bytes) -> list[Completion]:
    """Completions of a ``/generate`` response body (one object, or a list for a batch or ``n >
    1``), aborted ones included as they are (:meth:`SGLangClient.generate` never returns those)."""
    return [to_completion(o) for o in decode_outputs(body)]


class Aborted(EngineError):
    """The server aborted a generation (``finish_reason.type == "abort"``)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def raise_if_aborted(outs: list[GenerateOutput]) -> None:
    """Raise :class:`Aborted` for the first aborted result (retryable unless its status is 400)."""
    for out in outs:
        fr = out.meta_info.finish_reason
        if isinstance(fr, FinishReason) and fr.type == "abort":
            status = fr.status_code
            raise Aborted(
                f"generation aborted by the server (rid {out.meta_info.id or '?'}, status "
                f"{status}): "
                f"{fr.message or '(no message)'}",
                retryable=status
                != 400,  # 400: the request itself is bad; sent again it aborts again
            )
        if fr == "abort":
            raise Aborted(
                f"generation aborted by the server (rid {out.meta_info.id or '?'})", retryable=True
            )


class UpdateResult(msgspec.Struct, frozen=True, kw_only=True):
    """One server's answer to ``/update_weights_from_disk``."""

    url: str
    success: bool
    message: str
    num_paused_requests: int = 0


def split_seeds(seed: int, n: int) -> list[int]:
    """``n`` distinct seeds derived from ``seed`` (the first is ``seed`` itself)."""
    return [(seed + i * 1_000_033) % 2**31 for i in range(n)]


def generate_payloads(
    input_ids: list[int], params: SamplingParams, n: int, return_logprob: bool
) -> list[dict[str, Any]]:
    """The ``/generate`` bodies for ``n`` samples of one prompt. Without a seed: one request with
    ``n``. With a seed and ``n > 1``: ``n`` requests of one sample, each with its own seed. Not one
    request with ``n`` (SGLang, with ``--enable-deterministic-inference``, gives all ``n`` samples
    of one request the same seed: ``n`` identical completions), and not a batch with a list of
    ``sampling_params`` (one per prompt: SGLang takes it, sglang-router 0.3.2 refuses it with 422,
    "sampling_params[0]: invalid type"). The copies share their prompt, so the engine's prefix cache
    (and the router's cache-aware routing) still computes it once."""
    sampling = params.to_sglang()
    if n == 1 or params.sampling_seed is None:
        if n > 1:
            sampling["n"] = n
        return [
            {
                "input_ids": list(input_ids),
                "sampling_params": sampling,
                "return_logprob": return_logprob,
            }
        ]
    return [
        {
            "input_ids": list(input_ids),
            "sampling_params": {**sampling, "sampling_seed": seed},
            "return_logprob": return_logprob,
        }
        for seed in split_seeds(params.sampling_seed, n)
    ]
