"""Seeded TextWorld cooking games, generated offline with the package's own generator and cached.

``ensure_game(spec, split, index)`` returns the compiled game of that task, generating it on first
use with ``textworld.challenges.tw_cooking`` (the code behind ``tw-make tw-cooking``) into
``$LEAFE_CACHE/textworld/<spec digest>/<split>-<index>/``. Generation writes into a temp directory
next to the final one and renames it into place, so concurrent processes never see half a game (the
loser of a race drops its copy). Train and test draw their game seeds from different streams.

TextWorld's generator is not thread-safe: it parses its logic files and samples the world through
module-level state, and two threads generating at once fail with errors that look like bad seeds
(``pop from empty list``, logic-file parse errors, ``'NoneType' object is not iterable``; measured:
six games at once in threads all failed, each alone succeeds). Envs run in threads
(``env_in_thread``), so generation holds a process-wide lock; separate processes are independent and
race only on the rename.

Run ``python -m leafe.envs.textworld.generator`` to generate the first test game and print its
walkthrough.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import msgspec
import structlog

from leafe.envs.base import EnvError
from leafe.protocol.paths import cache_root, publish_dir

__all__ = ["CookingSpec", "ensure_game", "game_seed", "spec_digest"]

log = structlog.get_logger(__name__)

GAME_FILE = "game.z8"
_GENERATOR_LOCK = threading.Lock()
"""Serializes TextWorld's generator inside a process (it is not thread-safe, see the module doc)."""


class CookingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The tw-cooking difficulty knobs (same names as ``tw-make tw-cooking``)."""

    recipe: int = 1
    """Ingredients in the recipe."""
    take: int = 1
    """Ingredients to find (<= recipe)."""
    go: int = 1
    """Rooms: 1, 6, 9 or 12."""
    open: bool = False
    """Containers and doors must be opened."""
    cook: bool = False
    """Some ingredients must be cooked."""
    cut: bool = False
    """Some ingredients must be cut."""
    drop: bool = False
    """Limited inventory."""


def spec_digest(spec: CookingSpec) -> str:
    """Short digest of the spec and the textworld version (the cache folder name)."""
    import textworld

    blob = json.dumps([msgspec.to_builtins(spec), textworld.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def game_seed(seed: int, split: str, index: int) -> int:
    """The generator seed of a task: a hash of (seed, split, index), below 2**31."""
    digest = hashlib.sha256(f"textworld-cooking/{seed}/{split}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def ensure_game(
    spec: CookingSpec, seed: int, split: str, index: int, cache_dir: Path | None = None
) -> Path:
    """Path of the compiled game for (split, index), generating it first if needed."""
    base = (cache_dir or cache_root() / "textworld") / spec_digest(spec)
    final = base / f"{split}-{index}"
    game = final / GAME_FILE
    if game.is_file():
        return game
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{split}-{index}.", dir=base))
    try:
        _generate(spec, game_seed(seed, split, index), tmp)
        published = publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("envs.textworld.generated", split=split, index=index, path=str(final), ours=published)
    if not game.is_file():
        raise EnvError(f"generated game missing at {game}")
    return game


def _generate(spec: CookingSpec, seed: int, out_dir: Path) -> None:
    import textworld
    from textworld.challenges.tw_cooking import cooking
    from textworld.generator import compile_game

    settings = {**msgspec.to_builtins(spec), "recipe_seed": 0, "split": None}
    options = textworld.GameOptions()
    options.seeds = seed
    options.path = str(out_dir / GAME_FILE)
    options.file_ext = ".z8"
    options.force_recompile = True
    try:
        with _GENERATOR_LOCK:
            game = cooking.make(settings, options)
            compile_game(game, options)
    except Exception as e:  # the generator raises many types; name the game and keep the cause
        raise EnvError(
            f"textworld could not generate a cooking game {spec!r} seed {seed}: {e}"
        ) from e
    os.chmod(out_dir, 0o755)


def _demo() -> None:
    import textworld

    path = ensure_game(CookingSpec(), 0, "test", 0)
    game = textworld.Game.load(str(path.with_suffix(".json")))
    print(path, "\nwalkthrough:", game.metadata.get("walkthrough"))


if __name__ == "__main__":
    _demo()
