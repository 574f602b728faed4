"""The compiled CPU attention kernels of the inference server (``csrc/decode_attention.c``): built
once per machine with the system C compiler, loaded with ctypes (which releases the GIL during a
call), and called on torch tensors. ``services/inference/kernels.py`` decides where they serve and
checks them against exact attention first.

The library lands in ``$LEAFE_CACHE/kernels`` (default ``~/.cache/leafe``) under a hash of the
source, the flags, the compiler's version and the CPU's flags (``-march=native`` code must not move
to another CPU); it is built in a temporary directory and renamed, so processes starting together do
not see half a file. Where it cannot be had (no compiler, a read-only cache), :func:`fused_library`
returns the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["FUSED_DTYPES", "fused_decode", "fused_library", "fused_prefill"]

_CSRC = Path(__file__).parent / "csrc" / "decode_attention.c"
_CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-fno-math-errno",
    # reassociation, so dot products reduce as a tree (~1.5-2x); not -ffast-math: the kernel tests
    # for -inf
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-std=gnu11",  # GCC's vector extension (the prefill kernel's register accumulators)
    "-shared",
    "-fPIC",
)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _kernel_dir() -> Path:
    return Path(os.environ.get("LEAFE_CACHE") or "~/.cache/leafe").expanduser() / "kernels"


@functools.cache
def fused_library() -> ctypes.CDLL | str:
    """The compiled decode-attention kernel, built on first use; or why it cannot be had here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return "no C compiler (cc or gcc) on PATH"
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        source = _CSRC.read_bytes()
        key = hashlib.sha256(
            b"\0".join(
                [source, " ".join(_CFLAGS).encode(), version.encode(), _cpu_flags().encode()]
            )
        ).hexdigest()[:16]
        target = _kernel_dir() / f"decode_attention-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                proc = subprocess.run(
                    [cc, *_CFLAGS, str(_CSRC), "-o", str(built), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                if proc.returncode != 0:
                    return f"{cc} failed to compile {_CSRC.name}: {proc.stderr.strip()[-500:]}"
                built.replace(target)  # atomic: another process may build the same file at once
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not build or load {_CSRC.name}: {e}"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr] * 5 + [i64] * 13 + [ctypes.c_float, ptr]
    for name in ("prefill_attention_f32", "prefill_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr] * 5 + [i64] * 15 + [ctypes.c_float, ptr]
    return lib


FUSED_DTYPES = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}


def _loaded() -> ctypes.CDLL:
    lib = fused_library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its rows are contiguous (the kernels take any other strides), else a
    copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """One query token's attention through the compiled kernel: ``query [B, H, 1, D]``, ``key, value
    [B, KV, W, D]``, boolean ``attention_mask`` broadcastable to ``[B, 1, 1, W]``; returns ``[B, 1,
    H, D]``."""
    lib = _loaded()
    bsz, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    q = query.reshape(bsz, heads, dim).contiguous()
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    out = torch.empty((bsz, 1, heads, dim), dtype=query.dtype)
    scratch = torch.empty((heads // kv_heads) * width, dtype=torch.float32)
    if attention_mask is None:
        mask_ptr, msb, msw = None, 0, 0
    else:
        m = attention_mask.expand(bsz, 1, 1, width)[:, 0, 0, :]
        mask_ptr, msb, msw = m.data_ptr(), m.stride(0), m.stride(1)
    rc = getattr(lib, FUSED_DTYPES[query.dtype])(
        q.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        mask_ptr,
        out.data_ptr(),
        bsz,
        heads,
        kv_heads,
        width,
        dim,
        *key.stride()[:3],
        *value.stride()[:3],
        msb,
        msw,
        scaling,
        scratch.data_ptr(),
    )
    if rc != 0:
        raise ValueError(f"decode kernel refused heads={heads} kv_heads={kv_heads} head_dim={dim}")
    return out


def fused_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Several query tokens' attention through the compiled kernel: ``query [B, H, S, D]`` (any
    strides with the last one 1), ``key, value [B, KV, W, D]``, boolean ``attention_mask [B, 1, S,
    W]`` (causal and padding, as transformers builds it); returns ``[B, S, H, D]``, zeros for a
    query with nothing to attend to (a left-padding token)."""
    lib = _loaded()
    bsz, heads, q_len, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
    mask_t = (
        attention_mask.expand(bsz, 1, q_len, width)[:, 0].transpose(1, 2).contiguous()
    )  # [B, W, S]
    cols = -(-(heads // kv_heads) * q_len // 64) * 64
    scratch = torch.empty(
        dim * cols + width * cols + 2 * cols + 2 * width * dim, dtype=torch.float32
    )
    out = torch.empty((bsz, q_len, heads, dim), dtype=query.dtype)
    rc = getattr(lib, FUSED_DTYPES[query.dtype].replace("decode_", "prefill_"))(
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        mask_t.data_ptr(),
        out.data_ptr(),
        bsz,
        heads,
        kv_heads,
        q_len,
        width,
        dim,
        *query.stride()[:3],
        *key.stride()[:3],
        *value.stride()[:3],
        scaling,
        scratch.data_ptr(),
    )
    if rc != 0:
        raise ValueError(f"prefill kernel refused heads={heads} kv_heads={kv_heads} head_dim={dim}")
    return out
