"""Request parsing and response shaping of SGLang's ``/generate`` (the subset in
docs/sglang-api.md), shared by the CPU inference server's handlers. Pure functions: JSON in,
validated jobs out; finished sequences in, SGLang response bodies out. Every rejection is a
:class:`RequestError` whose message names the value.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from leafe.services.inference.decode import GenSequence, GenSpec

__all__ = [
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_SEQUENCES",
    "MAX_TEXT_CONTEXTS",
    "PromptJob",
    "RequestError",
    "copy_seed",
    "decode_json",
    "error_body",
    "output_body",
    "parse_generate",
    "parse_sampling",
]

_SEED_STRIDE = 0x9E3779B97F4A7C15
MAX_N = 64
"""Most samples of one prompt (``n``); SGLang has no bound, so one request could queue millions."""
MAX_PROMPTS = 256
"""Most prompts in one batched ``/generate`` call."""
MAX_SEQUENCES = 1024
"""Most sequences one call may start (prompts x n): each holds KV memory while it decodes."""
MAX_TEXT_CONTEXTS = 4
"""A request's texts together may hold at most this many prompts' bound of bytes
(``max_text_bytes``)."""


class RequestError(ValueError):
    """A request SGLang would answer with HTTP 400; the message says what is wrong."""


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang ``sampling_params`` keys (names and defaults as SGLang 0.5's ``SamplingParams``)."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    # SGLang keys this server does not implement: accepted only at their neutral value.
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    spaces_between_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None


_NEUTRAL = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "spaces_between_special_tokens": True,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
}
_KNOWN = frozenset(_Sampling.__struct_fields__)


@dataclass(frozen=True, kw_only=True)
class PromptJob:
    """One prompt of a ``/generate`` call and how to sample it."""

    input_ids: list[int]
    spec: GenSpec
    n: int
    rid: str | None
    return_logprob: bool


def _check_ranges(s: _Sampling) -> None:
    if s.max_new_tokens is not None and s.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
    if s.temperature < 0.0:
        raise RequestError(f"temperature must be non-negative, got {s.temperature}.")
    if not 0.0 < s.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {s.top_p}.")
    if s.top_k < 1 and s.top_k != -1:
        raise RequestError(f"top_k must be -1 (disable), or at least 1, got {s.top_k}.")
    if s.n < 1:
        raise RequestError(f"n must be at least 1, got {s.n}.")
    if s.n > MAX_N:
        raise RequestError(f"n must be at most {MAX_N}, got {s.n}.")
    for key, neutral in _NEUTRAL.items():
        if getattr(s, key) != neutral:
            raise RequestError(
                f"sampling parameter {key!r}={getattr(s, key)!r} is not supported by the LEAFE CPU "
                "server "
                f"(only its default {neutral!r})."
            )


def parse_sampling(params: Any, *, context_left: int) -> tuple[GenSpec, int]:
    """Validate one ``sampling_params`` object; returns the spec and ``n``.

    ``context_left`` (context length minus prompt length) caps ``max_new_tokens`` as SGLang does."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError(f"sampling_params must be an object, got {type(params).__name__}.")
    for key in params:
        if key not in _KNOWN:
            raise RequestError(
                f"Unknown sampling parameter {key!r}: SamplingParams.__init__() got an unexpected "
                f"keyword argument '{key}'"
            )
    try:
        s = msgspec.convert(params, _Sampling)
    except msgspec.ValidationError as e:
        raise RequestError(f"Invalid sampling_params: {e}") from None
    _check_ranges(s)
    stop = (s.stop,) if isinstance(s.stop, str) else tuple(s.stop or ())
    max_new = context_left if s.max_new_tokens is None else min(s.max_new_tokens, context_left)
    spec = GenSpec(
        max_new_tokens=max_new,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=stop,
        stop_token_ids=frozenset(s.stop_token_ids or ()),
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        no_stop_trim=s.no_stop_trim,
        seed=s.sampling_seed,
    )
    return spec, s.n


def _as_batch(
    body: dict[str, Any], encode: Callable[[str], list[int]], max_text_bytes: int
) -> tuple[list[Any], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None and text is not None:
        raise RequestError("Either text or input_ids should be provided, not both.")
    if ids is None and text is None:
        raise RequestError("Either text or input_ids should be provided.")
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a list of strings.")
        _check_count(len(texts))
        _check_text_bytes(texts, max_text_bytes)
        return [encode(t) for t in texts], isinstance(text, list)
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        _check_count(len(ids))
        return list(ids), True
    return [ids], False


def _check_text_bytes(texts: list[str], max_text_bytes: int) -> None:
    """Before any tokenizing (about 1.7 s of CPU per MB): each text and all of them together are
    bounded by their UTF-8 size, which takes ~1 ms per MB to measure."""
    total = 0
    for t in texts:
        size = len(t.encode("utf-8", "surrogatepass"))
        if size > max_text_bytes:
            raise RequestError(
                f"A text of {size} bytes is longer than the model's context can hold (at most "
                f"{max_text_bytes} bytes: the context length times the longest token's bytes)."
            )
        total += size
    if total > MAX_TEXT_CONTEXTS * max_text_bytes:
        raise RequestError(
            f"The request's texts of {total} bytes together are more than one request may tokenize "
            "(at most "
            f"{MAX_TEXT_CONTEXTS * max_text_bytes} bytes: {MAX_TEXT_CONTEXTS} prompts at their "
            "bound)."
        )


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body; malformed, or nested deeper than Python's decoder recurses,
    is a :class:`RequestError` (a 400), never an exception that becomes a 500."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"invalid JSON: {e}") from None
    except RecursionError:
        raise RequestError("invalid JSON: nested too deeply to decode") from None


def _check_count(prompts: int) -> None:
    if prompts > MAX_PROMPTS:
        raise RequestError(
            f"The request has {prompts} prompts; a batch may hold at most {MAX_PROMPTS}."
        )


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for {count} prompts.")
        return value
    return [value] * count


def _check_ids(ids: Any, vocab_size: int, context_len: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids must be a non-empty list of token ids.")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RequestError(
                f"Token id {t!r} at position {i} is outside the vocabulary (size {vocab_size})."
            )
    if len(ids) >= context_len:
        raise RequestError(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    return [int(t) for t in ids]


def parse_generate(
    body: Any,
    *,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_len: int,
    max_text_bytes: int,
) -> tuple[list[PromptJob], bool]:
    """Validate a ``/generate`` body; returns its prompts and whether it was a batch (list
    response).

    Bounded before any work: ``n`` by :data:`MAX_N`, prompts by :data:`MAX_PROMPTS`, prompts x n by
    :data:`MAX_SEQUENCES`, and each text by ``max_text_bytes`` before it is tokenized (a text longer
    than the context length times the longest token's bytes cannot fit the context anyway), all
    texts together by :data:`MAX_TEXT_CONTEXTS` times that. ``encode`` may take seconds within those
    bounds: the server calls this off its event loop."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the LEAFE CPU server.")
    prompts, batched = _as_batch(body, encode, max_text_bytes)
    params = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params")
    logprob = _per_prompt(body.get("return_logprob", False), len(prompts), "return_logprob")
    rids = _per_prompt(body.get("rid"), len(prompts), "rid")
    jobs = []
    for ids, p, lp, rid in zip(prompts, params, logprob, rids, strict=True):
        ids = _check_ids(ids, vocab_size, context_len)
        spec, n = parse_sampling(p, context_left=context_len - len(ids))
        rid = None if rid is None else str(rid)
        jobs.append(PromptJob(input_ids=ids, spec=spec, n=n, rid=rid, return_logprob=bool(lp)))
    sequences = sum(j.n for j in jobs)
    if sequences > MAX_SEQUENCES:
        raise RequestError(
            f"The request asks for {sequences} sequences (prompts x n); one request may start at "
            "most "
            f"{MAX_SEQUENCES}."
        )
    return jobs, batched or any(j.n > 1 for j in jobs)


def copy_seed(seed: int | None, copy: int) -> int | None:
    """Seed of the ``copy``-th of ``n`` samples: copy 0 uses ``seed`` itself, so ``n=1`` and the
    first of ``n>1`` agree; the others get distinct derived seeds (identical copies would defeat
    ``n``)."""
    if seed is None or copy == 0:
        return seed
    return (seed + copy * _SEED_STRIDE) % (1 << 63)


def output_body(seq: GenSequence, *, rid: str | None, return_logprob: bool) -> dict[str, Any]:
    """SGLang's response object for one finished sequence."""
    meta: dict[str, Any] = {
        "id": rid or uuid.uuid4().hex,
        "finish_reason": seq.finish,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": seq.cached_tokens,
        "weight_version": seq.weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(seq.logprobs, seq.output_ids, strict=True)
        ]
    return {"text": seq.text, "output_ids": list(seq.output_ids), "meta_info": meta}


def error_body(message: str) -> dict[str, Any]:
    """SGLang's ``/generate`` error body (``create_error_response``)."""
    return {"error": {"message": message}}
