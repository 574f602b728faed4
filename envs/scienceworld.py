"""ScienceWorld (the ``scienceworld`` package's bundled simulator) as a LEAFE
:class:`~leafe.envs.base.Env`.

Tasks are ``scienceworld/<split>/<task-name>/<variation>``; the splits are the package's own
``train``/``dev``/``test`` variation lists (cached in ``$LEAFE_CACHE/scienceworld``). Reward is the
change of the 0-100 score, success is a completed task at score 100, and the episode ends on
completion, on failure (score below 0, e.g. focusing on the wrong object) or at ``max_steps``.
Rollback is by replay.

Determinism: stock ScienceWorld is *not* deterministic under replay: it lists objects in Java
identity hash order, which changes at every load, so the same actions give differently ordered
observations (and numbered disambiguation prompts then pick different objects). We start the JVM
with ``-XX:hashCode=2`` (every identity hash is 1, so hash order becomes insertion order); with it
reset + replay reproduced observations, scores and completion exactly for all 30 tasks (random valid
actions and the gold paths). ``EXCLUDED_TASKS`` lists tasks kept out of the catalogue, with the
reason.

Demonstrations (``demonstration``, train variations only) are the simulator's gold action sequences,
cut after the step that completes the task: gold paths often go on after completion (measured: boil
completes at step 36 of 39), and those steps would only answer "the episode is over". A gold path
that does not complete the task within ``max_steps`` is an :class:`EnvError` naming its length.

Run ``python -m leafe.envs.scienceworld`` to play the first train task of ``find-plant``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import structlog

from leafe.envs.base import EnvError, Reset, Transition, play, require_train_split
from leafe.envs.cache import atomic_write_text
from leafe.protocol.paths import cache_root

__all__ = ["EXCLUDED_TASKS", "JAVA_OPTS", "ScienceWorldConfig", "ScienceWorldEnv"]

log = structlog.get_logger(__name__)

JAVA_OPTS = ["-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=2"]
"""JVM options that make object listing order (and so replay) deterministic; see the module
docstring."""

EXCLUDED_TASKS: dict[str, str] = {}
"""Task name -> why it is left out. Empty: with ``JAVA_OPTS`` all 30 tasks replay exactly."""

SPLITS = ("train", "dev", "test")
_BLOCKED = {"reset task"}  # would restart the task behind the episode's back
_INVALID_PREFIXES = ("No known action matches that input.", "Unknown action.")

INSTRUCTIONS = """You are an agent in ScienceWorld, a text-based science lab and household.
Complete the task by typing one text command per turn, for example: look around, \
open door to kitchen,
go to kitchen, pick up thermometer, focus on orange, move seed to flower pot, wait1, inventory.
"focus on X" declares X as the object of the task: focusing on the wrong object fails the task.
If asked to pick a number from a list, answer with that number.
Answer with exactly one command in this format: <action>look around</action>"""


class ScienceWorldConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``make_env("scienceworld", ...)``."""

    task_names: list[str] = []
    """ScienceWorld task names in the catalogue; empty = every task not in ``EXCLUDED_TASKS``."""
    simplifications: str = "easy"
    """Comma-separated simplifications (``easy`` = teleportAction, openDoors, selfWateringFlowerPots
    and, except on electrical tasks, noElectricalAction; also openContainers); empty = none."""
    max_steps: int = 30
    """Horizon: env steps per episode (invalid commands count)."""
    max_variations: int = 0
    """Variations per task and split in the catalogue (the first ones of the package's list); 0 =
    all."""
    max_valid_actions: int = 0
    """Cap on ``valid_actions()`` (sorted list, truncated); 0 = no cap."""
    cache_dir: str = ""
    """Where the variation lists are cached; empty = ``$LEAFE_CACHE/scienceworld``."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")


class _Backend:
    """The simulator's JVM, started once with :data:`JAVA_OPTS`, and its ``PythonInterface``."""

    def __init__(self) -> None:
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
        from scienceworld.constants import BASEPATH, JAR_PATH

        # Same launch as scienceworld.ScienceWorldEnv, plus the JVM options it cannot pass.
        port, proc = launch_gateway(
            classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, return_proc=True, javaopts=JAVA_OPTS
        )
        self.proc = proc
        self.gateway = JavaGateway(
            gateway_parameters=GatewayParameters(auto_field=True, port=port), java_process=proc
        )
        self.server = self.gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()

    def close(self) -> None:
        self.gateway.shutdown()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class ScienceWorldEnv:
    """One JVM per instance, reused across episodes (starting it takes about a second)."""

    name = "scienceworld"
    instructions = INSTRUCTIONS
    supports_snapshot = False

    def __init__(self, config: ScienceWorldConfig | None = None) -> None:
        self.config = config or ScienceWorldConfig()
        logging.getLogger("py4j").setLevel(logging.WARNING)
        self._backend: _Backend | None = None
        self._variations: dict[str, dict[str, list[int]]] = {}
        self._loaded: tuple[str, int] | None = None
        self._steps = 0
        self._score = 0
        self._done = True
        self._valid_cache: list[str] | None = None
        self._templates: list[str] = []
        self._last_observation = ""
        unknown = [t for t in self.config.task_names if t in EXCLUDED_TASKS]
        if unknown:
            raise EnvError(f"tasks {unknown} are excluded: {[EXCLUDED_TASKS[t] for t in unknown]}")

    @property
    def server(self) -> Any:
        """The simulator's py4j ``PythonInterface`` (the JVM starts on first use)."""
        if self._backend is None:
            self._backend = _Backend()
            log.info("envs.scienceworld.started", pid=self._backend.proc.pid)
        return self._backend.server

    # -- catalogue -------------------------------------------------------------------------------
    def task_names(self) -> list[str]:
        """Task names in the catalogue (config order, or the package's order)."""
        from scienceworld.constants import TASKS

        known = [str(t["task_name"]) for t in TASKS]
        names = self.config.task_names or [n for n in known if n not in EXCLUDED_TASKS]
        bad = [n for n in names if n not in known]
        if bad:
            raise EnvError(f"unknown ScienceWorld tasks {bad}; known: {sorted(known)}")
        return names

    def tasks(self, split: str) -> list[str]:
        """``scienceworld/<split>/<task>/<variation>`` over the catalogue's tasks."""
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r}; expected one of {SPLITS}")
        out: list[str] = []
        for name in self.task_names():
            variations = self.variations(name)[split]
            if self.config.max_variations:
                variations = variations[: self.config.max_variations]
            out.extend(f"scienceworld/{split}/{name}/{v}" for v in variations)
        return out

    def variations(self, name: str) -> dict[str, list[int]]:
        """The package's train/dev/test variation lists of task ``name`` (cached on disk)."""
        if name not in self._variations:
            from scienceworld.version import __version__

            path = self._cache_dir() / f"variations-{__version__}" / f"{name}.json"
            if path.is_file():
                self._variations[name] = json.loads(path.read_text())
            else:
                self._variations[name] = self._query_variations(name)
                atomic_write_text(path, json.dumps(self._variations[name]))
        return self._variations[name]

    def _query_variations(self, name: str) -> dict[str, list[int]]:
        server = self.server
        server.load(name, 0, "", False)
        self._loaded = None
        return {
            "train": [int(v) for v in server.getVariationsTrain()],
            "dev": [int(v) for v in server.getVariationsDev()],
            "test": [int(v) for v in server.getVariationsTest()],
        }

    def _cache_dir(self) -> Path:
        return (
            Path(self.config.cache_dir) if self.config.cache_dir else cache_root() / "scienceworld"
        )

    # -- episode ---------------------------------------------------------------------------------
    def reset(self, task_id: str) -> Reset:
        """Load (if needed) and reset the task's variation; the first observation is ``look
        around``."""
        name, variation = self._parse(task_id)
        server = self.server
        if self._loaded != (name, variation):
            server.load(name, variation, self.config.simplifications, False)
            self._loaded = (name, variation)
            self._templates = sorted(
                str(a) for a in server.getPossibleActions() if str(a) not in _BLOCKED
            )
        server.reset()
        observation = str(server.step("look around"))
        self._steps, self._score, self._done = 0, self._read_score(), False
        self._valid_cache = None
        self._last_observation = observation
        task = str(server.freeActionTaskDesc()).strip().removeprefix("Task Description:").strip()
        return Reset(task=task, observation=observation)

    def _parse(self, task_id: str) -> tuple[str, int]:
        parts = task_id.split("/")
        if (
            len(parts) != 4
            or parts[0] != "scienceworld"
            or parts[1] not in SPLITS
            or not parts[3].isdigit()
        ):
            raise EnvError(
                f"bad ScienceWorld task id {task_id!r}; expected scienceworld/<split>/<task>/<n>"
            )
        name, variation = parts[2], int(parts[3])
        if name in EXCLUDED_TASKS:
            raise EnvError(f"task {name!r} is excluded: {EXCLUDED_TASKS[name]}")
        if name not in self.task_names():
            raise EnvError(
                f"{task_id!r}: task {name!r} is not in the catalogue {self.task_names()}"
            )
        if variation not in self.variations(name)[parts[1]]:
            raise EnvError(
                f"{task_id!r}: variation {variation} is not in {name!r}'s {parts[1]} split"
            )
        return name, variation

    def step(self, action: str) -> Transition:
        """Send one command; unknown commands come back as invalid with the action templates."""
        if self._loaded is None:
            raise EnvError("step() before reset(): call reset(task_id) first")
        if self._done:
            return Transition(
                observation=self._last_observation,
                done=True,
                valid=False,
                feedback="the episode is over",
                score=float(self._score),
            )
        command = " ".join(action.split())
        server = self.server
        blocked = not command or command.lower() in _BLOCKED
        observation = _INVALID_PREFIXES[0] if blocked else str(server.step(command))
        self._steps += 1
        self._valid_cache = None
        valid = not observation.startswith(_INVALID_PREFIXES)
        score = self._read_score()
        reward, self._score = float(score - self._score), score
        completed = bool(server.getCompleted())
        success = completed and score >= 100
        failed = score < 0
        done = success or failed or completed or self._steps >= self.config.max_steps
        self._done = done
        self._last_observation = observation
        return Transition(
            observation=observation,
            reward=reward,
            done=done,
            success=success,
            feedback=self._feedback(
                command, valid, failed, done and not (success or failed or completed)
            ),
            valid=valid,
            score=float(score),
        )

    def _feedback(self, command: str, valid: bool, failed: bool, horizon: bool) -> str:
        if not valid:
            return (
                f"invalid action: {command[:80]!r}; valid action templates: "
                f"{', '.join(self._templates)} "
                "(OBJ is an object or location you can see)"
            )
        if failed:
            return "The task failed (score below 0): this cannot be undone."
        if horizon:
            return f"Step limit reached ({self.config.max_steps} steps)."
        return ""

    def _read_score(self) -> int:
        return round(100 * float(self.server.getScore()))

    def valid_actions(self) -> list[str]:
        """Valid action-object combinations of the current state (sorted; capped by
        ``max_valid_actions``)."""
        if self._loaded is None:
            raise EnvError("valid_actions() before reset(): call reset(task_id) first")
        if self._valid_cache is None:
            combos = {str(a) for a in self.server.getValidActionObjectCombinations()}
            self._valid_cache = sorted(combos - _BLOCKED)
        cap = self.config.max_valid_actions
        return list(self._valid_cache[:cap] if cap else self._valid_cache)

    def gold_actions(self, task_id: str) -> list[str]:
        """The simulator's gold action sequence for ``task_id`` (reloads the task; for tests and
        probes)."""
        name, variation = self._parse(task_id)
        self.server.load(name, variation, self.config.simplifications, True)
        self._loaded = None
        return [str(a) for a in self.server.getGoldActionSequence()]

    def demonstration(self, task_id: str) -> list[str]:
        """The gold path of train task ``task_id`` up to its completing step (replays it to find
        that)."""
        self._parse(task_id)  # validates the id
        require_train_split(task_id, task_id.split("/")[1])
        gold = self.gold_actions(task_id)
        self.reset(task_id)
        for i, action in enumerate(gold):
            t = self.step(action)
            if t.success:
                return gold[: i + 1]
            if t.done:
                why = t.feedback or f"score {t.score}"
                raise EnvError(
                    f"the gold path of {task_id!r} ends at step {i} without success: {why}"
                )
        raise EnvError(
            f"the gold path of {task_id!r} ({len(gold)} steps) does not complete the task"
        )

    def snapshot(self) -> None:
        """Not supported: ScienceWorld rolls back by replay."""
        raise EnvError("ScienceWorld has no snapshot; use replay (leafe.envs.base.rollback_to)")

    def restore(self, snapshot: object) -> str:
        """Not supported: ScienceWorld rolls back by replay."""
        raise EnvError("ScienceWorld has no snapshot; use replay (leafe.envs.base.rollback_to)")

    def close(self) -> None:
        """Stop the JVM."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None
            self._loaded = None


def _play() -> None:
    env = ScienceWorldEnv(ScienceWorldConfig(task_names=["find-plant"]))
    play(env, env.tasks("train")[0])


if __name__ == "__main__":
    _play()
