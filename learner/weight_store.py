"""The weight store: a directory of exported versions ``<store>/v000001/``, ``<store>/v000002/`` ...

Version names are ``v<index:06d>`` where the index counts the learner's pushes; the base model is
``default`` (index 0, SGLang's initial ``weight_version``). The index is what staleness is measured
in: a sample produced by ``v000003`` is 2 versions behind a learner that has pushed ``v000005``.

Weight-sync marks what each inference server loaded in ``<store>/.in_use/<marker>`` (one line: the
version), so pruning never deletes a version an engine is still reading; it rewrites its markers on
every reconcile, and a marker older than ``MARKER_TTL_S`` belongs to a weight-sync that is gone (a
deleted pod) and no longer protects anything. The marker name carries the weight-sync's host as well
as the server URL, because every sidecar of a Deployment calls its own engine
``http://127.0.0.1:30000``. Only ``.in_use/`` needs to be writable by weight-sync (deploy/ mounts it
read-write, the store read-only). Pruning keeps the newest ``keep`` versions and every version in
use. An export is written to ``.v<index>.<random>`` beside its version and renamed when complete; a
learner killed meanwhile leaves it (as large as an export), and :func:`remove_partial_exports`
deletes those on the next start.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path

__all__ = [
    "BASE_VERSION",
    "IN_USE_DIR",
    "MARKER_TTL_S",
    "in_use_versions",
    "mark_in_use",
    "prune_versions",
    "remove_partial_exports",
    "version_index",
    "version_name",
]

BASE_VERSION = "default"
"""Version of the weights an engine starts with."""
IN_USE_DIR = ".in_use"
MARKER_TTL_S = 600.0
"""A marker not rewritten for this long no longer protects its version (weight-sync rewrites every
``reconcile_interval_s``, 10 s by default)."""
_VERSION = re.compile(r"^v(\d{1,12})$")
_PARTIAL_EXPORT = re.compile(r"^\.v\d{1,12}\..+$")
"""``model_io.export_weights``'s temporary directory of a version (``tempfile.mkdtemp`` prefix
``.v000003.``)."""


def version_name(index: int) -> str:
    """``v000012`` for index 12."""
    if index < 1:
        raise ValueError(f"weight version index must be >= 1 (0 is {BASE_VERSION!r}), got {index}")
    return f"v{index:06d}"


def version_index(name: str) -> int | None:
    """Index of a version name (``default`` -> 0); ``None`` for a name this learner did not
    produce."""
    if name == BASE_VERSION:
        return 0
    m = _VERSION.match(name)
    return int(m.group(1)) if m else None


def _slug(server: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", server)[:80]
    return f"{safe}-{hashlib.sha256(server.encode()).hexdigest()[:8]}"


def mark_in_use(store: Path, server: str, version: str) -> Path:
    """Record that ``server`` (a name unique to the engine: host + URL) serves ``version`` (atomic
    rename, so the marker's mtime says when it was last confirmed); returns the marker path."""
    d = Path(store) / IN_USE_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / _slug(server)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(version + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def in_use_versions(
    store: Path, *, max_age_s: float = MARKER_TTL_S, now: float | None = None
) -> set[str]:
    """Versions named by the in-use markers under ``store`` that were rewritten within
    ``max_age_s``."""
    d = Path(store) / IN_USE_DIR
    if not d.is_dir():
        return set()
    now = time.time() if now is None else now
    out = set()
    for p in d.iterdir():
        if not p.is_file() or p.suffix == ".tmp":
            continue
        try:
            if now - p.stat().st_mtime <= max_age_s:
                out.add(p.read_text(encoding="utf-8").strip())
        except FileNotFoundError:  # rewritten (renamed over) while we looked: it is fresh anyway
            continue
    return out


def prune_versions(store: Path, keep: int, protect: set[str] | None = None) -> list[str]:
    """Delete version directories beyond the newest ``keep`` (>= 1), sparing ``protect`` and in-use
    ones.

    Returns the names deleted, oldest first. Directories that are not ``v<digits>`` are never
    touched.
    """
    store = Path(store)
    if not store.is_dir():
        return []
    versions = sorted(
        (idx, p)
        for p in store.iterdir()
        if p.is_dir() and (idx := version_index(p.name)) is not None and idx > 0
    )
    spared = (protect or set()) | in_use_versions(store)
    doomed = [p for _, p in versions[: -max(1, keep)] if p.name not in spared]
    for p in doomed:
        shutil.rmtree(p)
    return [p.name for p in doomed]


def remove_partial_exports(store: Path) -> list[str]:
    """Delete the temporary directories of exports that never finished (``.v<index>.<suffix>``);
    returns the paths removed. Only for the learner's start (it is the store's one writer): it
    would delete an export being written."""
    store = Path(store)
    if not store.is_dir():
        return []
    doomed = sorted(p for p in store.iterdir() if p.is_dir() and _PARTIAL_EXPORT.match(p.name))
    for p in doomed:
        shutil.rmtree(p)
    return [str(p) for p in doomed]
