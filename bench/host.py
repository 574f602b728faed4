"""Where a benchmark ran: the record every ``bench/results/*.json`` written by a bench script
carries.

These machines come in two CPU classes (AVX-512 with bf16, and AVX2 only) whose timings differ by up
to ~8x for bf16 matmuls, and share their cores with other work, so a figure without its CPU, its ISA
flags and the cores that were free when it was measured cannot be compared with anything. Every
bench script (``bench/<area>.py``) puts :func:`host_record`, taken when it starts, under the key
``"host"`` of what it writes; ``tests/unit/bench/test_bench_smoke.py`` checks that each one's
``--smoke`` output has it.

    from bench.host import host_record
    result = {"host": host_record(), ...}

Fields: ``cpu_model``, ``flags`` (``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``,
``amx_tile``: what the CPU reports), ``torch_cpu_capability`` (the kernel set torch dispatches to,
which ``ATEN_CPU_CAPABILITY=avx2`` lowers on an AVX-512 host) with ``isa_overrides`` (such variables
when set: an AVX2 figure taken on an AVX-512 host is an approximation), ``cpus`` (logical CPUs this
process may use), ``loadavg_1m`` and ``cores_free`` (``cpus`` minus the 1-minute load average,
floored at 0, at the start), ``torch_threads``, ``torch``, ``python``, ``commit`` (``HEAD``,
``+dirty`` when tracked files differ) and ``date`` (UTC, ISO 8601).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from leafe.services.threads import usable_cores

__all__ = [
    "FIELDS",
    "ISA_FLAGS",
    "commit",
    "cpu_info",
    "host_record",
    "keep_sections",
    "peak_rss_kib",
]

ROOT = Path(__file__).resolve().parents[1]
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""CPU flags that change which kernels run and how fast (the two classes: avx512_bf16 vs avx2
only)."""
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
"""Environment variables that make torch / oneDNN use fewer instructions than the CPU has."""
FIELDS = (
    "cpu_model",
    "flags",
    "torch_cpu_capability",
    "isa_overrides",
    "cpus",
    "loadavg_1m",
    "cores_free",
    "torch_threads",
    "torch",
    "python",
    "commit",
    "date",
)
"""The keys of :func:`host_record`."""


def cpu_info(cpuinfo: str | None = None) -> tuple[str, dict[str, bool]]:
    """CPU model name and :data:`ISA_FLAGS` from ``/proc/cpuinfo`` (or its given text); off Linux,
    the platform's processor string and no flags known (all False)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    model, flags = platform.processor() or platform.machine(), set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key == "flags":
            flags = set(value.split())
        if key == "" and flags:  # end of the first processor's block: the others are the same CPU
            break
    return model, {f: f in flags for f in ISA_FLAGS}


def commit() -> str:
    """``git rev-parse HEAD`` of the repository, ``+dirty`` appended when tracked files are
    modified; ``"unknown"`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def peak_rss_kib() -> int:
    """This process's peak resident set in KiB: ``VmHWM``, the high-water mark of its own memory
    map.

    Not ``ru_maxrss``: Linux keeps the old map's high-water mark across ``execve``, so a bench child
    forked from a large parent would report the parent's size
    (``tests/unit/bench/test_peak_rss.py``). Refuses where ``/proc/self/status`` has no ``VmHWM``
    rather than report a figure that could be the parent's."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError as exc:
        raise RuntimeError(
            f"cannot read /proc/self/status ({exc}): no peak RSS on this OS"
        ) from exc
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmHWM: no peak RSS on this OS")


def host_record() -> dict[str, Any]:
    """Where and when this process is measuring (see the module docstring for the fields)."""
    import torch

    model, flags = cpu_info()
    cpus = usable_cores()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return {
        "cpu_model": model,
        "flags": flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_overrides": {v: os.environ[v] for v in ISA_VARIABLES if v in os.environ},
        "cpus": cpus,
        "loadavg_1m": round(load, 2),
        "cores_free": round(max(0.0, cpus - load), 2),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def keep_sections(out: Path, results: dict[str, Any], sections: tuple[str, ...]) -> dict[str, Any]:
    """``results`` plus those of ``sections`` that ``out`` holds and this run did not measure, each
    as it was (with its own ``host`` where it recorded one): a bench's full run rewrites its file
    without dropping the sections another mode of it measures and merges separately."""
    if not out.is_file():
        return results
    old = json.loads(out.read_text())
    return {**results, **{k: old[k] for k in sections if k in old and k not in results}}
