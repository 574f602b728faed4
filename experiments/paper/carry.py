"""A staged experiment across working periods: what is carried in the repository, and the weights
rebuilt from it.

A stage ends with its finished phases' records committed, never their weights: every record
(``<work>/<phase>/done.json``), the registered protocol and the invocations go to
``<results>/paper_logs/<name>/state/`` after each phase (:func:`save_state`), beside the exported
logs every dataset is rebuilt from. A later invocation in a fresh checkout (no work dir) restores
them (:func:`restore_state`) with their paths moved to the new work and results dirs, and a restored
training whose weights a pending phase reads is trained again from the committed logs
(``experiments.paper.runner.Runner``), its losses compared with the recorded ones: the rebuilt
weights are checked to be the ones the recorded results were measured with, as far as a loss curve
can tell.

```
 stage k: phases ─► done.json ─► state/<phase>.json ($WORK, $RESULTS in place of the paths)
     ─► commit
 stage k+1 (fresh clone): state/ ─► done.json (restored) ─► a pending phase needs train:X's weights
     ─► train X again from paper_logs/ ─► losses equal the recorded ones? (recorded in X's result)
```
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "WEIGHT_KEYS",
    "describe",
    "loss_agreement",
    "moved_weights",
    "restore_state",
    "save_state",
    "state_dir",
    "weight_paths",
]

WEIGHT_KEYS = ("final", "weights", "epoch_weights")
"""Keys of a phase result that name weights directories (``epoch_weights``: epoch -> directory)."""

_FILES = ("protocol.json", "invocations.json")
"""Files of the work dir carried besides the phase records."""


def state_dir(results: Path, name: str) -> Path:
    """Where a run's carried state lives in the repository."""
    return results / "paper_logs" / name / "state"


def _under(text: str, root: Path, token: str) -> str:
    """``text`` with every path under ``root`` (written absolute or as given) starting with
    ``token``."""
    for form in dict.fromkeys((str(root.resolve()), str(root))):
        if form not in (".", ""):
            text = re.sub(r"(?<![\w/.$-])" + re.escape(form) + r'(?=[/"]|$)', lambda _: token, text)
    return text


def _rooted(text: str, work: Path, results: Path) -> str:
    return _under(_under(text, work, "$WORK"), results, "$RESULTS")


def _rerooted(text: str, work: Path, results: Path) -> str:
    return text.replace("$WORK", str(work.resolve())).replace("$RESULTS", str(results.resolve()))


def save_state(work: Path, results: Path, name: str) -> int:
    """Copy every phase record and the protocol of ``work`` into the repository's state dir, with
    the work and results dirs as ``$WORK`` and ``$RESULTS``; returns the number of phase records."""
    out = state_dir(results, name)
    out.mkdir(parents=True, exist_ok=True)
    for f in _FILES:
        if (work / f).is_file():
            (out / f).write_text(
                _rooted((work / f).read_text(encoding="utf-8"), work, results), "utf-8"
            )
    n = 0
    for done in sorted(work.glob("*/done.json")):
        text = _rooted(done.read_text(encoding="utf-8"), work, results)
        (out / f"{done.parent.name}.json").write_text(text, encoding="utf-8")
        n += 1
    return n


def restore_state(
    work: Path,
    results: Path,
    name: str,
    phases: Collection[str] | None = None,
    files: bool = True,
    source_work: Path | None = None,
) -> list[str]:
    """Write the carried records of ``name`` (only ``phases``, when given) whose phase has no record
    in ``work`` (a fresh checkout) with their paths in this work and results dir; with ``files``,
    the protocol and invocations too when ``work`` has none. Returns the restored phases (their
    weights are not on disk: :class:`~experiments.paper.runner.Runner` rebuilds them when needed).
    Another experiment's records (``effect.inherit``) keep naming its logs, and their weights move
    into this work dir: paths under ``source_work`` (that experiment's work dir, in records written
    before they were rooted) too."""
    src = state_dir(results, name)
    if not src.is_dir():
        return []
    work.mkdir(parents=True, exist_ok=True)
    for f in _FILES if files else ():
        if (src / f).is_file() and not (work / f).is_file():
            (work / f).write_text(
                _rerooted((src / f).read_text(encoding="utf-8"), work, results), "utf-8"
            )
    restored = []
    for record in sorted(src.glob("*.json")):
        if record.name in _FILES:
            continue
        phase = record.stem
        if phases is not None and phase not in phases:
            continue
        done = work / phase / "done.json"
        if done.is_file():
            continue
        done.parent.mkdir(parents=True, exist_ok=True)
        text = record.read_text(encoding="utf-8")
        text = _under(text, source_work, "$WORK") if source_work is not None else text
        done.write_text(_rerooted(text, work, results), encoding="utf-8")
        restored.append(phase)
    return restored


def weight_paths(result: Mapping[str, Any]) -> list[Path]:
    """The weights directories a phase result names, resolved (a restored record names them
    absolute, a training in a work dir given relative names them relative: the same directories)."""
    out: list[Path] = []
    for key in WEIGHT_KEYS:
        value = result.get(key)
        if isinstance(value, str) and value:
            out.append(Path(value).resolve())
        elif isinstance(value, dict):
            out += [Path(v).resolve() for v in value.values() if isinstance(v, str) and v]
    return out


def moved_weights(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The :data:`WEIGHT_KEYS` whose directories differ between two results of one training."""
    return [
        k for k in WEIGHT_KEYS if weight_paths({k: old.get(k)}) != weight_paths({k: new.get(k)})
    ]


def loss_agreement(
    recorded: Mapping[str, Any], rebuilt: Mapping[str, Any], tol: float = 1e-4
) -> dict[str, Any]:
    """How a rebuilt training's loss curve compares with the recorded one: the same number of steps
    and every loss within ``tol`` (``agrees``), with the largest difference."""
    old, new = list(recorded.get("losses") or []), list(rebuilt.get("losses") or [])
    diff = max((abs(float(a) - float(b)) for a, b in zip(old, new, strict=False)), default=0.0)
    return {
        "steps": [len(old), len(new)],
        "max_loss_diff": diff,
        "agrees": len(old) == len(new) and diff <= tol,
        "tol": tol,
    }


def describe(agreement: Mapping[str, Any]) -> str:
    """One line for the console."""
    steps = agreement["steps"]
    verdict = "agrees" if agreement["agrees"] else "DIFFERS"
    diff = agreement["max_loss_diff"]
    return f"{verdict}: {steps[1]} steps (recorded {steps[0]}), largest loss difference {diff:.2e}"
