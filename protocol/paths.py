"""Where processes agree to keep shared artefacts, and how they publish a directory there
atomically.

``$LEAFE_CACHE`` (default ``~/.cache/leafe``) holds the converted default model, generated TextWorld
games and ScienceWorld's variation lists. Several processes (actors, the learner, the inference
server) may create the same entry at once, so each builds it in a temp directory beside the final
one and renames it into place: a reader sees the whole directory or none. Stdlib only, like the rest
of ``protocol/``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["cache_root", "publish_dir"]


def cache_root() -> Path:
    """``$LEAFE_CACHE`` or ``~/.cache/leafe``."""
    return Path(os.environ.get("LEAFE_CACHE") or Path.home() / ".cache" / "leafe")


def publish_dir(tmp_dir: Path, final_dir: Path) -> bool:
    """Rename the finished ``tmp_dir`` to ``final_dir``; if another process got there first, drop
    ours.

    Returns True when ours was published. Both must be on the same filesystem.
    """
    try:
        os.rename(tmp_dir, final_dir)
        return True
    except OSError:
        if not final_dir.is_dir():
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False
