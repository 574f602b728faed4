"""Keep the learner's resident memory near what its live tensors need.

glibc serves a large ``malloc`` from ``mmap`` and returns it to the OS on ``free``, but it raises that
threshold (up to 32 MB) each time such a block is freed, after which blocks below it come from the heap,
which is returned only from its top. A training step allocates and frees gigabytes of activation and
gradient blocks of every size, so the heap fills with free holes that still count as resident: measured
on SmolLM2-135M (1 rank, packed 2048-token rows, activation checkpointing), the process held 4.2 GB between
steps for 2.1 GB of weights and AdamW state, and peaked at 4.56 GB; with the threshold pinned at 64 KiB
it peaked at 3.47 GB and rested at 2.13 GB. Pinning it (``mallopt(M_MMAP_THRESHOLD, ...)``, the same as
``MALLOC_MMAP_THRESHOLD_`` in the environment) stops the raising; blocks of 64 KiB and more then cost an
``mmap``/``munmap`` each and, worse, a page fault for each of their 4 KiB pages when first touched: on
SmolLM2-135M without checkpointing (cpu preset, 2 threads, 2026-12-03, Sapphire Rapids) 9.5 M faults and
~25 s of kernel time a step, 1.63x the step time (means of 8 steps: 39.2 s against 24.0 s; peak RSS 5.4 GB
against 7.2 GB).
glibc's ``hugetlb`` tunable (transparent huge pages for those blocks) took the faults to 5.6 M and the step
time nowhere. So the trainer pins it only when asked (``trainer.release_freed_memory``), where memory binds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["MMAP_THRESHOLD", "pin_mmap_threshold"]

MMAP_THRESHOLD = 64 * 1024
"""Bytes from which glibc allocates with ``mmap`` (freed blocks go back to the OS at once)."""
_M_MMAP_THRESHOLD = -3  # <malloc.h>


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold for this process; False where the C library is not glibc (nothing set)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {threshold}) failed")
    return True
