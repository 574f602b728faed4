"""Keep a process's resident memory near what its live tensors need (the learner's and the inference
engine's).

glibc serves a large ``malloc`` from ``mmap`` and returns it to the OS on ``free``, but it raises
that threshold (up to 32 MB) each time such a block is freed, after which blocks below it come from
the heap, which is returned only from its top. A training step allocates and frees gigabytes of
activation and gradient blocks of every size, so the heap fills with free holes that still count as
resident: measured on SmolLM2-135M (1 rank, packed 2048-token rows, activation checkpointing), the
process held 4.2 GB between steps for 2.1 GB of weights and AdamW state, and peaked at 4.56 GB; with
the threshold pinned at 64 KiB it peaked at 3.47 GB and rested at 2.13 GB. Pinning it
(``mallopt(M_MMAP_THRESHOLD, ...)``, the same as ``MALLOC_MMAP_THRESHOLD_`` in the environment)
stops the raising; blocks of 64 KiB and more then cost an ``mmap``/``munmap`` each and, worse, a
page fault for each of their 4 KiB pages when first touched, and the kernel time of those faults
makes a training step markedly slower (figures in docs/benchmarks.md, section "The learner's
memory"). glibc's ``hugetlb`` tunable (transparent huge pages for those blocks) cut the faults but
not the step time. So the trainer pins it only when asked (``trainer.release_freed_memory``),
where memory binds.

By default (``trainer.reuse_freed_memory``) the trainer does the opposite:
:func:`reuse_freed_memory` turns glibc's ``mmap`` off (``M_MMAP_MAX = 0``) and raises the trim
threshold, so every block, large ones too, comes from the heap and a freed block is reused by the
next allocation of its size without touching the OS. Without it every block over 32 MB (the
embedding's gradient and AdamW temporaries, 113 MB each for SmolLM2; the LM head's chunks) is still
an ``mmap`` per use, and on these VMs a first-touch fault costs ~7 us per 4 KiB (a 113 MB fill took
191 ms, 0.6 GB/s). Reusing freed blocks removes most of those faults and their kernel time, so
GRPO's steps run faster at the same peak RSS and with identical losses (figures in
docs/benchmarks.md, section "The learner's page faults").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable

__all__ = [
    "KEEP_FREED_BYTES",
    "MMAP_THRESHOLD",
    "pin_mmap_threshold",
    "resident_bytes",
    "return_free_memory",
    "reuse_freed_memory",
]

MMAP_THRESHOLD = 64 * 1024
"""Bytes from which glibc allocates with ``mmap`` (freed blocks go back to the OS at once)."""
KEEP_FREED_BYTES = 2**31 - 1
"""Free bytes at the heap's top that glibc keeps rather than returns (``M_TRIM_THRESHOLD``; an
``int``)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # <malloc.h>


@functools.cache  # find_library runs ldconfig: once per process, not at every trim of the engine
def _libc(symbol: str) -> Callable[..., int] | None:
    """glibc's function ``symbol``, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, symbol, None)


def _mallopt() -> Callable[[int, int], int] | None:
    return _libc("mallopt")


def _set(mallopt: Callable[[int, int], int], param: int, value: int, what: str) -> None:
    if mallopt(param, value) != 1:
        raise OSError(f"mallopt({what}, {value}) failed")


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold for this process; False where the C library is not glibc (nothing
    set)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _set(mallopt, _M_MMAP_THRESHOLD, threshold, "M_MMAP_THRESHOLD")
    return True


def reuse_freed_memory() -> bool:
    """Serve every allocation of this process from glibc's heap and keep freed blocks there for
    reuse (no ``mmap``, trim only past :data:`KEEP_FREED_BYTES`); False where the C library is not
    glibc or refuses (a speed setting: the process then runs as before, and the caller says so)."""
    mallopt = _mallopt()
    if mallopt is None or mallopt(_M_MMAP_MAX, 0) != 1:
        return False
    return mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1


def return_free_memory() -> bool:
    """Give the free pages inside every glibc arena back to the OS (``malloc_trim(0)``; the blocks
    stay glibc's, so the next use of one faults its pages in again); False where the C library is
    not glibc.

    glibc returns a heap's free memory only from its top, and a thread's arena grows by 64 MB heaps,
    so a server that allocates blocks of many sizes (prompt KV in the prefix cache, prefill
    activations) keeps the free holes between live blocks resident; trimming gives a large part of
    the resident set back (figures in docs/benchmarks.md, section "The inference server's
    memory")."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    # returns 1 when memory was released, 0 when there was none to release: both are success
    trim(0)
    return True


def resident_bytes() -> int:
    """This process's resident set in bytes (``/proc/self/statm``: one read, a few microseconds, so
    cheap enough between two decode steps); 0 where there is no ``/proc``."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
