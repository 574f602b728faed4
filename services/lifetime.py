"""Child processes that do not outlive their parent.

``die_with_parent`` runs in a child between ``fork`` and ``exec`` (``preexec_fn``) and asks Linux to
send it SIGTERM when the thread that started it dies (``PR_SET_PDEATHSIG``), however that happens:
SIGKILL, a crash, an unhandled SIGTERM. Start such children from a thread that lives as long as they
do (the event loop's thread, or a worker blocked waiting on the child). Elsewhere than Linux it does
nothing, and the caller's own stop path is the only one.
"""

from __future__ import annotations

import ctypes
import signal
from typing import Any

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1
try:
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def die_with_parent() -> None:
    """In the child before ``exec``: SIGTERM when the parent dies. Only a call resolved before the
    fork runs here (no imports, no allocation that could take a lock)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
