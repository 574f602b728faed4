"""TextWorld cooking games (the household-task stand-in for ALFWorld) as a LEAFE
:class:`~leafe.envs.base.Env`.

Task ``textworld-cooking/<split>/<index>`` is a game generated offline by
``leafe.envs.textworld.generator`` from a seed derived from (config seed, split, index). Only
admissible commands are executed (others are invalid actions with the admissible list as feedback,
and change nothing); reward is the change of the game's points, success is ``won``, the episode ends
on won, lost or ``max_steps``. The z-machine is deterministic and a reset costs ~10 ms, so rollback
is by replay (``supports_snapshot = False``). Demonstrations are the generator's walkthroughs
(``demonstration``, train games only).

Run ``python -m leafe.envs.textworld.env`` to play the first test game.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from leafe.envs.base import EnvError, Reset, Transition, play, require_train_split
from leafe.envs.textworld.generator import CookingSpec, ensure_game

__all__ = ["TextWorldConfig", "TextWorldEnv", "clean_observation"]

SPLITS = ("train", "test")
_PROMPT_LINE = re.compile(r"\n>[^\n]*$")
_BLANK_LINES = re.compile(r"\n{3,}")

INSTRUCTIONS = """You are in a house and must cook a meal: find the cookbook in the kitchen, \
read it with
"examine cookbook", gather and prepare the ingredients it lists, then "prepare meal" and "eat meal".
Type one text command per turn, chosen from the admissible commands, for example: \
go east, open fridge,
take carrot from fridge, slice carrot with knife, cook carrot with stove, inventory, look.
Answer with exactly one command in this format: <action>examine cookbook</action>"""


class TextWorldConfig(CookingSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``make_env("textworld-cooking", ...)``: the generator's knobs (``CookingSpec``:
    recipe, take, go, open, cook, cut, drop, as ``tw-make tw-cooking`` names them) and the
    catalogue's. Defaults: the easiest cooking games."""

    max_steps: int = 20
    """Horizon: env steps per episode (invalid commands count)."""
    seed: int = 0
    """Seed of the catalogue; train and test game seeds are different hash streams of it."""
    num_train: int = 200
    """Games in the ``train`` split (each is generated on first use, ~4 s)."""
    num_test: int = 50
    """Games in the ``test`` split."""
    cache_dir: str = ""
    """Where games are cached; empty = ``$LEAFE_CACHE/textworld``."""

    def __post_init__(self) -> None:
        if self.go not in (1, 6, 9, 12):
            raise ValueError(f"go must be 1, 6, 9 or 12, got {self.go}")
        if not 1 <= self.take <= self.recipe:
            raise ValueError(f"take must be in 1..recipe={self.recipe}, got {self.take}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")

    def spec(self) -> CookingSpec:
        """The generator's knobs."""
        return CookingSpec(**{name: getattr(self, name) for name in CookingSpec.__struct_fields__})


def clean_observation(text: str) -> str:
    """Drop the banner, the trailing ``>`` prompt / status line and runs of blank lines."""
    text = _PROMPT_LINE.sub("", text.rstrip())
    return _BLANK_LINES.sub("\n\n", text).strip()


class TextWorldEnv:
    """One loaded game at a time; switching games restarts the interpreter (~0.3 s)."""

    name = "textworld-cooking"
    instructions = INSTRUCTIONS
    supports_snapshot = False

    def __init__(self, config: TextWorldConfig | None = None) -> None:
        self.config = config or TextWorldConfig()
        self._spec = self.config.spec()
        self._env: Any = None
        self._game: Path | None = None
        self._admissible: list[str] = []
        self._last_obs = ""
        self._points = 0
        self._steps = 0
        self._done = True
        self._started = False

    def tasks(self, split: str) -> list[str]:
        """``textworld-cooking/<split>/<index>``."""
        count = {"train": self.config.num_train, "test": self.config.num_test}.get(split)
        if count is None:
            raise EnvError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [f"textworld-cooking/{split}/{i}" for i in range(count)]

    def game_path(self, task_id: str) -> Path:
        """The compiled game of ``task_id`` (generated on first use)."""
        split, index = self._parse(task_id)
        cache = Path(self.config.cache_dir) if self.config.cache_dir else None
        return ensure_game(self._spec, self.config.seed, split, index, cache)

    def _parse(self, task_id: str) -> tuple[str, int]:
        parts = task_id.split("/")
        if (
            len(parts) != 3
            or parts[0] != self.name
            or parts[1] not in SPLITS
            or not parts[2].isdigit()
        ):
            raise EnvError(
                f"bad task id {task_id!r}; expected textworld-cooking/<train|test>/<index>"
            )
        split, index = parts[1], int(parts[2])
        count = self.config.num_train if split == "train" else self.config.num_test
        if index >= count:
            raise EnvError(f"task {task_id!r} is outside the {split} split ({count} tasks)")
        return split, index

    def reset(self, task_id: str) -> Reset:
        """Start (or restart) the game of ``task_id``."""
        import textworld

        path = self.game_path(task_id)
        if self._env is None or self._game != path:
            self._close_game()
            infos = textworld.EnvInfos(
                admissible_commands=True,
                won=True,
                lost=True,
                objective=True,
                score=True,
                max_score=True,
                extras=["walkthrough"],
            )
            with warnings.catch_warnings():
                # jericho does not know generated games; TextWorld tracks score and moves itself
                warnings.filterwarnings("ignore", message=".*is not fully supported.*")
                self._env = textworld.start(str(path), request_infos=infos)
            self._game = path
        state = self._env.reset()
        objective = str(state["objective"])
        observation = clean_observation(str(state.feedback))
        if objective in observation:  # the banner (ASCII art) comes before the objective
            observation = observation[observation.index(objective) + len(objective) :].strip()
        self._admissible = sorted(state["admissible_commands"])
        self._points, self._steps, self._done = int(state["score"]), 0, False
        self._last_obs = observation
        return Reset(task=objective, observation=observation)

    def step(self, action: str) -> Transition:
        """Run one admissible command; anything else is invalid and changes nothing."""
        if self._env is None:
            raise EnvError("step() before reset(): call reset(task_id) first")
        if self._done:
            return Transition(
                observation=self._last_obs,
                done=True,
                valid=False,
                feedback="the episode is over",
                score=float(self._points),
            )
        self._steps += 1
        command = _match(action, self._admissible)
        if command is None:
            feedback = (
                f"invalid action: {' '.join(action.split())[:80]!r}; "
                f"valid actions: {', '.join(self._admissible)}"
            )
            done = self._steps >= self.config.max_steps
            self._done = done
            return Transition(
                observation=self._last_obs,
                done=done,
                valid=False,
                feedback=feedback,
                score=float(self._points),
            )
        state, points, _ = self._env.step(command)
        return self._transition(state, int(points))

    def _transition(self, state: Any, points: int) -> Transition:
        won, lost = bool(state["won"]), bool(state["lost"])
        horizon = self._steps >= self.config.max_steps
        done = won or lost or horizon
        reward, self._points = float(points - self._points), points
        self._done = done
        self._admissible = sorted(state["admissible_commands"] or [])
        self._last_obs = clean_observation(str(state.feedback))
        feedback = ""
        if lost:
            feedback = "You lost the game: this cannot be undone."
        elif horizon and not won:
            feedback = f"Step limit reached ({self.config.max_steps} steps)."
        return Transition(
            observation=self._last_obs,
            reward=reward,
            done=done,
            success=won,
            feedback=feedback,
            valid=True,
            score=float(points),
        )

    def valid_actions(self) -> list[str]:
        """The admissible commands of the current state."""
        if self._env is None:
            raise EnvError("valid_actions() before reset(): call reset(task_id) first")
        return list(self._admissible)

    def walkthrough(self, task_id: str) -> list[str]:
        """The generator's winning command sequence (for tests and probes)."""
        import textworld

        game = textworld.Game.load(str(self.game_path(task_id).with_suffix(".json")))
        return list(game.metadata["walkthrough"])

    def demonstration(self, task_id: str) -> list[str]:
        """The walkthrough of train game ``task_id`` (:class:`EnvError` for a test game)."""
        require_train_split(task_id, self._parse(task_id)[0])
        return self.walkthrough(task_id)

    def snapshot(self) -> None:
        """Not supported: rollback is by replay."""
        raise EnvError("TextWorld has no snapshot here; use replay (leafe.envs.base.rollback_to)")

    def restore(self, snapshot: object) -> str:
        """Not supported: rollback is by replay."""
        raise EnvError("TextWorld has no snapshot here; use replay (leafe.envs.base.rollback_to)")

    def close(self) -> None:
        """Stop the interpreter."""
        self._close_game()

    def _close_game(self) -> None:
        if self._env is not None:
            self._env.close()
        self._env, self._game = None, None


def _match(action: str, admissible: list[str]) -> str | None:
    wanted = " ".join(action.lower().split()).strip(" .!\"'`")
    for command in admissible:
        if " ".join(command.lower().split()) == wanted:
            return command
    return None


def _play() -> None:
    env = TextWorldEnv()
    play(env, env.tasks("test")[0])


if __name__ == "__main__":
    _play()
