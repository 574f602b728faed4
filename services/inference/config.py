"""Configuration of the CPU inference server (``leafe inference``); light to import (no torch)."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["InferenceConfig"]


class InferenceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Configuration of the CPU inference server."""

    model: str = "smollm2-135m-instruct"
    """``"smollm2-135m-instruct"``, ``"tiny"`` (random test model) or an HF model directory."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 30000
    """TCP port (SGLang's default); 0 picks a free one (read it from ``InferenceServer.url``)."""
    max_batch: int = 16
    """Most sequences decoded together."""
    batch_wait_ms: float = 5.0
    """How long an idle server collects requests before starting a batch."""
    max_prefill_tokens: int = 8192
    """Padded prompt tokens per prefill forward (longer groups are split)."""
    threads: int = 0
    """torch intra-op threads (process-wide; restored on stop); 0 keeps torch's default (one per
    core). On a CPU shared with other busy processes, 1 avoids OpenMP spin-waiting (10x slower seen
    at 2)."""
    served_model_name: str | None = None
    """Name reported by /model_info (default: the model argument)."""
    weight_version: str = "default"
    """Version reported until the first weight update (SGLang starts at "default")."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations of the served model (SGLang's ``--dtype``). ``bfloat16`` about
    doubles CPU prefill where the CPU has AVX512-BF16/AMX (measured 282 -> 599 tokens/s on one Zen 4
    core); sampling and logprobs are computed in float32 either way, and weight updates are cast to
    this dtype."""
    cpu_kernels: bool = True
    """Serve through ``services/inference/kernels.py``: linear layers on oneDNN with weights
    reordered once (2.1-3x aten's float32 MKL path on AMD CPUs) and bfloat16 decode attention as
    grouped matmuls; each is checked against the plain forward at start and left out, with the
    reason logged, where it cannot serve. ``/get_server_info`` reports what was installed."""
    prefix_cache_tokens: int = 16384
    """Token budget of the prefix cache: prompt KV kept for reuse by later prompts with the same
    prefix, least recently used first out (0 = off). SmolLM2 needs ~46 KB per token in float32 (~23
    KB in bfloat16), so the default holds ~0.75 GB at most."""
    trim_idle_s: float = 1.0
    """Give the free pages inside glibc's heaps back to the OS (``malloc_trim``) once the engine has
    been idle this long after work; 0 = never. The prefix cache's KV blocks and prefill activations
    come in every size, and glibc keeps the holes they leave resident: without trimming the server
    grew past 8 GB in a 35-minute online run (``learner/memory.py``, ``bench/inference_memory.py``).
    An idle server is what a training learner runs beside, so that is when the pages matter."""
    trim_growth_mb: int = 256
    """While busy, trim between two steps only once the resident set has grown by more than this
    many MB (10^6 bytes) since the last trim; 0 = never while busy. A trim returns pages the next
    steps fault in again, so trimming on a clock cost CPU with nothing to return; this bounds the
    resident set at the trimmed size plus this margin instead."""
    trim_every_s: float = 0.0
    """Also trim at most this often, between steps or once idle after work (the periodic policy
    before ``trim_idle_s``/``trim_growth_mb``, kept for side-by-side measurement); 0 = never."""
    api_key_file: str = ""
    """File holding the API key every route but ``/health`` and ``/ready`` requires (SGLang's
    ``--api-key``, sent as ``Authorization: Bearer``); empty = no key (a warning at start)."""
    admin_key_file: str = ""
    """File holding the admin key that ``/set_threads`` requires instead of the API key (SGLang's
    ``--admin-api-key``); empty = that route is refused."""
    weight_group_timeout_s: float = 600.0
    """How long a distributed weight update's rendezvous or broadcast may wait for the other
    members before it fails (the old weights keep serving, the group is left)."""
    weights_root: str = ""
    """``/update_weights_from_disk`` loads only directories under this one (symlinks and ``..``
    resolved), and only with a ``manifest.json`` whose sha256s match; a distributed update installs
    only what hashes to the manifest of ``<this>/<weight_version>/``; empty = weight updates are
    refused."""
