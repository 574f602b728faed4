"""Where environments keep generated files, and how they write them safely under concurrency.

``$LEAFE_CACHE`` (default ``~/.cache/leafe``) holds generated TextWorld games and ScienceWorld's variation
lists. Several actor processes may create the same file at once, so every write goes to a unique temp
name in the same directory and is renamed into place: readers see the whole file or none.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text", "cache_root", "publish_dir"]


def cache_root() -> Path:
    """``$LEAFE_CACHE`` or ``~/.cache/leafe``."""
    return Path(os.environ.get("LEAFE_CACHE") or Path.home() / ".cache" / "leafe")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file + rename (last writer wins, never a torn file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_dir(tmp_dir: Path, final_dir: Path) -> bool:
    """Rename the finished ``tmp_dir`` to ``final_dir``; if another process got there first, drop ours.

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
