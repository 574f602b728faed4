"""The typed configuration of ``leafe run`` (one TOML file) and its presets.

A run config names the model, the environment, how many tasks to explore and evaluate, the services
to start, and carries each service's own config as a typed section (``[actor]`` is
``leafe.actors.config.ActorServiceConfig``, ``[replayer]`` ``ReplayerConfig``, ``[learner]``
``leafe.learner.config.LearnerConfig``), so one file configures the whole pipeline and every field
is validated before anything starts. Presets: ``default`` (``make run``: warm start + one LEAFE
round, Sokoban, SmolLM2, bounded by work), ``leafe`` and ``grpo`` (warm start + continual LEAFE or
GRPO rounds, a learning curve, a 40-minute budget), ``warmstart`` (demonstrations -> ``sft`` only),
``explore-only`` (one LEAFE pass from Base) and ``tiny`` (the tiny random model; the end-to-end
tests). Each preset's run id is its own name, so two presets never share a run directory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
from msgspec.structs import replace

from leafe.actors.config import ActorServiceConfig, Override
from leafe.learner.config import LearnerConfig, learner_preset
from leafe.learner.materializers import SAMPLE_KINDS
from leafe.protocol.config import ConfigError, convert_config, dotted, dump_config, merge_tables
from leafe.protocol.subjects import validate_run_id
from leafe.services.config import read_toml
from leafe.services.replayer.config import ReplayerConfig

__all__ = [
    "PRESETS",
    "EnvSection",
    "EvalSection",
    "ExploreSection",
    "OnlineEvalSection",
    "RunConfig",
    "ServicesSection",
    "default_preset",
    "explore_only_preset",
    "grpo_preset",
    "leafe_preset",
    "resolve_run_config",
    "tiny_preset",
    "warmstart_preset",
]


class EnvSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The environment (``leafe.envs.registry``)."""

    name: str = "sokoban"
    """Registry name."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Options of the environment's config type (``python -m leafe.envs.registry`` lists them)."""


class ExploreSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Training-time episodes submitted to the actors."""

    tasks: int = 12
    """Train-split tasks (the first N)."""
    offset: int = 0
    """First task index."""
    mode: Literal["explore", "rollout", "demo"] = "explore"
    """``explore``: LEAFE trees; ``rollout``: plain samples (GRPO/RFT baselines); ``demo``: the env
    expert's demonstrations (for the ``sft`` materializer: ``leafe run --preset warmstart``)."""
    samples: int = 1
    """Assignments per task (a GRPO group when > 1)."""
    seed: int = 0
    """Base sampling seed."""
    rounds: int = 1
    """Continual rounds: the task pool is submitted again each round (fresh sampling seeds: round r
    uses ``seed + r * seed_stride``) and the learner trains and pushes (while the round runs, or
    after it when phased), so later rounds sample from newer weights. 0 = until ``budget_minutes``
    or ``max_learner_steps`` (one of them must be set). Round r waits for round r-1's tasks."""
    seed_stride: int = 1_000_000
    """Seed offset between rounds (larger than any in-round offset: 1000 per task)."""
    max_learner_steps: int = 0
    """Stop submitting rounds once the learner has taken this many steps (0 = no cap)."""
    demos: int = 0
    """Warm start: the expert's demonstrations of this many train tasks (from ``demo_offset``) go
    through the log before round 0, and round 0 starts once the learner trained them (needs a
    materializer that reads demonstrations: ``warm-leafe``, ``warm-grpo`` or ``sft``)."""
    demo_offset: int = 0
    """First train task of the demonstrations."""
    demo_epochs: int = 1
    """Passes over the demonstrations in the warm start: each pass is submitted again under its own
    keys (``demo-e<k>``), so the learner trains every demonstration this many times (the offline
    warm start's epochs)."""
    backpressure: bool = True
    """A continuous run with a learner gates its actors (``actors/staleness.py``): no new training
    episode while the samples in flight would lag the learner past ``learner.max_policy_lag``, so
    that samples are not made only to be dropped as stale (issue 62). False: actors run ahead
    freely (the behaviour before)."""
    samples_per_episode: float = 0.0
    """Samples an episode gives, for the gate's episodes per learner version (``global_batch x
    push_every / samples_per_episode / actors``); 0 = by mode, as the shipped online records gave:
    :data:`SAMPLES_PER_EPISODE`."""
    schedule: Literal["phased", "continuous"] = "phased"
    """``phased``: each phase (a warm-start pass, a round) runs to its end, then the learner trains
    exactly its samples (every free core, batches in sample-id order) and pushes, and the next phase
    samples from those weights: the same config gives the same tasks, samples, steps and figures on
    a fast or a slow machine (``services/run/phases.py``). ``continuous``: actors and learner
    overlap, actors sample from the newest version their engine serves, so what a round trains on
    depends on the machine's speed (the online mode for long runs)."""

    def __post_init__(self) -> None:
        if self.demo_epochs < 1:
            raise ValueError(f"explore.demo_epochs = {self.demo_epochs}: must be >= 1")
        if self.rounds < 0:
            raise ValueError(f"explore.rounds = {self.rounds}: must be >= 0 (0 = until the budget)")


class OnlineEvalSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The learning curve: Pass@k of pushed versions on a fixed validation slice of the train split.

    It runs between rounds, on the run's engine while the actors wait (the learner keeps training
    its backlog), so it never starves them of the engine; its cost is its wall time, reported per
    point."""

    every_rounds: int = 0
    """Evaluate after every N rounds (and after the last); 0 = off."""
    offset: int = -1
    """First train-split task of the slice; -1 = right after the explore pool (disjoint from it)."""
    tasks: int = 8
    """Tasks in the slice."""
    samples: int = 4
    """Samples per task."""
    ks: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4])
    """k values recorded (each <= samples)."""
    seed: int = 54321
    """Sampling seed (the same at every point: the points are paired)."""


class EvalSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Pass@k on held-out tasks, before and after training (plain rollouts, no reflection)."""

    split: str = "test"
    """Split evaluated."""
    tasks: int = 8
    """Tasks (the first N of the split)."""
    samples: int = 8
    """Samples per task (n of the Pass@k estimator)."""
    ks: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4, 8])
    """k values reported (each <= samples)."""
    before: bool = True
    """Evaluate the starting weights."""
    after_warm_start: bool = True
    """With a warm start (``explore.demos``): evaluate its weights too, before round 0, so the
    report separates what the warm start did from what the rounds did (paired: same tasks and
    seed)."""
    after: bool = True
    """Evaluate the final weights."""
    concurrency: int = 16
    """Rollouts in flight (the inference server batches them)."""
    seed: int = 12345
    """Sampling seed (same for before and after: the comparison is paired)."""


MAX_AUTO_SERVERS = 4
"""Most CPU inference servers ``inference_servers = 0`` starts (each holds the model and its
caches)."""


class ServicesSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which services to start and how big."""

    actors: int = 1
    """Actor processes."""
    actor_concurrency: int = 8
    """Episodes per actor at once."""
    engines: list[str] = msgspec.field(default_factory=list)
    """External SGLang URLs; empty = start the CPU inference server."""
    nats_url: str = ""
    """External NATS URL; empty = embedded nats-server on the run directory (also
    $LEAFE_NATS_URL)."""
    stream_replicas: int = 1
    """Replicas of the streams the run creates (3 on a clustered JetStream given by
    ``nats_url``)."""
    inference_max_batch: int = 16
    """CPU inference server: largest dynamic batch."""
    inference_servers: int = 0
    """CPU inference server processes (the actors and evaluations spread episodes over them by
    affinity, weight sync pushes to each); 0 = one per free core, at most :data:`MAX_AUTO_SERVERS`.
    Processes rather than threads: on 2 cores two one-thread servers evaluated 1.45x faster than one
    with 2 threads."""
    inference_threads: int = 0
    """CPU inference torch threads per server; 0 = from the thread plan (``services/threads.py``):
    the servers share every free core while the learner is idle (the evaluations), the cores the
    learner leaves while both work."""
    inference_dtype: Literal["float32", "bfloat16"] = "float32"
    """CPU inference server dtype: ``float32`` (small weight updates are not rounded away) or
    ``bfloat16`` (~2x faster prefill on CPU; the paper table served in bf16, so a run compared with
    its rows uses it)."""
    learner_threads: int = 0
    """Learner torch threads (``OMP_NUM_THREADS``); 0 = from the thread plan (half the free cores,
    >= 1)."""
    cores: int = 0
    """Cores the thread plan divides among the servers and the learner; 0 = the cores free at the
    start (those other processes keep busy are left out). The learner's arithmetic depends on its
    thread count (the same bf16 step gives another loss at 1 and 2 threads), so two runs agree bit
    for bit only under the same plan (the report's ``threads``): pin this to repeat a run on a
    busier or another machine."""
    learner: bool = True
    """Run the continuous learner (and weight sync)."""
    weight_transport: Literal["disk", "distributed"] = "disk"
    """How weight sync brings new versions to the inference servers: ``disk`` (each loads the export
    with ``/update_weights_from_disk``) or ``distributed`` (weight sync reads the export once and
    broadcasts it over a gloo group of the servers; the exports stay the record, and a server new to
    the group loads the latest from disk first). docs/weight-transport.md says when to choose
    which."""
    router: bool = False
    """Put sglang-router 0.3.2 (the gpu overlay's router, ``pip install sglang-router==0.3.2``) in
    front of the inference servers: actors and evaluations send every request through it, as on the
    cluster; weight sync and the drain still talk to each server (``services/run/router.py``)."""


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything ``leafe run`` needs."""

    run_id: str = "default"
    """Run id (subjects, episode ids); rerunning with the same id resumes. Defaults to the preset's
    name."""
    runs_dir: str = "runs"
    """Parent of the run directory ``<runs_dir>/<run_id>``."""
    model: str = "smollm2-135m-instruct"
    """Starting weights: the default model, ``tiny`` or an HF directory."""
    materializer: str = "leafe"
    """Replayer materializer: ``leafe`` (cf + reh), ``rft`` or ``grpo``."""
    budget_minutes: float = 0.0
    """Wall-clock budget for exploring + learning (0 = none: the config's work bounds the run, so a
    slow machine finishes the same work later). When reached, the run stops submitting and drains;
    the report says what it cut. An option for long online runs."""
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    """Environment."""
    explore: ExploreSection = msgspec.field(default_factory=ExploreSection)
    """Training-time episodes."""
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    """Evaluation."""
    online_eval: OnlineEvalSection = msgspec.field(default_factory=OnlineEvalSection)
    """The learning curve on a validation slice (between rounds)."""
    services: ServicesSection = msgspec.field(default_factory=ServicesSection)
    """Services."""
    actor: ActorServiceConfig = msgspec.field(default_factory=ActorServiceConfig)
    """The actors' config (per-env ``[actor.explorer.<env>]`` and ``[actor.rollout.<env>]`` tables
    too)."""
    replayer: ReplayerConfig = msgspec.field(default_factory=ReplayerConfig)
    """The replayer's config; its ``materializer`` and ``model`` follow the run's."""
    learner: LearnerConfig = msgspec.field(default_factory=lambda: learner_preset("cpu"))
    """The learner's config; its defaults are the ``learner_preset``'s
    (``[leafe.learner.trainer.optim]`` etc.)."""
    learner_preset: str = "cpu"
    """Trainer preset the ``[learner]`` table starts from: ``cpu`` or ``paper``."""

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        kinds = SAMPLE_KINDS.get(self.materializer)
        if kinds is None:
            raise ValueError(
                f"materializer = {self.materializer!r}: known are {sorted(SAMPLE_KINDS)}"
            )
        ov, ex = self.online_eval, self.explore
        if ov.every_rounds:
            start, count = self.validation_slice()
            for what, lo, n in (
                ("explore pool", ex.offset, ex.tasks),
                ("demonstrations", ex.demo_offset, ex.demos),
            ):
                if n and start < lo + n and lo < start + count:
                    raise ValueError(
                        f"online_eval slice {start}..{start + count - 1} overlaps the {what} "
                        f"{lo}..{lo + n - 1} of the train split: choose another offset"
                    )
            if any(k > ov.samples for k in ov.ks):
                raise ValueError(
                    f"online_eval.ks = {ov.ks}: every k must be <= samples = {ov.samples}"
                )
        if ex.rounds == 0 and self.budget_minutes <= 0 and ex.max_learner_steps == 0:
            raise ValueError(
                "explore.rounds = 0 (until a limit) with no budget_minutes and no "
                "explore.max_learner_steps "
                "would never stop: set one of them"
            )
        if self.services.learner and not set(self.learner.kinds) & set(kinds):
            raise ValueError(
                f"learner.kinds = {self.learner.kinds} trains none of the samples materializer "
                f"{self.materializer!r} makes ({', '.join(kinds)}): set [learner] kinds"
            )

    def actor_config(self) -> ActorServiceConfig:
        """``[actor]`` as the actors get it: with the staleness gate filled in for a continuous run
        with a learner (``explore.backpressure``), unless ``[actor.staleness]`` sets it."""
        actor, ex, learner = self.actor, self.explore, self.learner
        per = ex.samples_per_episode or SAMPLES_PER_EPISODE.get(ex.mode, 0.0)
        if (
            actor.staleness.episodes_per_version
            or not ex.backpressure
            or ex.schedule != "continuous"
            or not self.services.learner
            or learner.max_policy_lag is None
            or not per
        ):
            return actor
        tc = learner.trainer
        samples = tc.batch.global_batch * max(1, tc.push_every)
        # at least one GRPO group a version: a group's samples come only once all its members end
        episodes = max(samples / per / max(1, self.services.actors), float(ex.samples))
        gate = replace(
            actor.staleness,
            episodes_per_version=episodes,
            max_policy_lag=learner.max_policy_lag,
        )
        return replace(actor, staleness=gate)

    def validation_slice(self) -> tuple[int, int]:
        """``(offset, count)`` of the online evaluator's train-split slice (checked disjoint from
        the pool)."""
        ex, ov = self.explore, self.online_eval
        start = max(ex.offset + ex.tasks, ex.demo_offset + ex.demos) if ov.offset < 0 else ov.offset
        return start, ov.tasks

    def identity(self) -> dict[str, Any]:
        """What a run directory is bound to: resuming with any of it changed would mix two runs."""
        return {
            "model": self.model,
            "env": dump_config(self.env),
            "materializer": self.materializer,
            "replayer_options": self.replayer.options,
        }


SAMPLES_PER_EPISODE: dict[str, float] = {"rollout": 7.5, "explore": 2.5}
"""Samples an episode of each mode gave in the shipped online records
(experiments/results/online_effect_hard: GRPO 5,718 samples of 758 rollouts, LEAFE 332 of 133
trees): the staleness gate's default estimate (``explore.samples_per_episode``)."""

SMALL_SOKOBAN: dict[str, Any] = {
    "height": 5,
    "width": 5,
    "num_boxes": 1,
    "max_solution_len": 2,
    "max_steps": 6,
}
"""Rooms SmolLM2-135M solves sometimes but not always (Base Pass@8 25% in
experiments/results/paper_table.md)."""
COMPACT: dict[str, Override] = {"sokoban": {"history_window": 2, "horizon": 8}}
"""Prefill bounds CPU speed: the board already holds the state, so prompts show 2 past steps, and a
branch takes at most 8 actions (invalid answers do not advance the env's own 6-step limit)."""
EXPLORE: dict[str, Override] = {"sokoban": {**COMPACT["sokoban"], "max_actions": 32}}
"""The explorer's Sokoban settings: the compact prompts, and at most 32 actions a tree."""

_SOKOBAN = EnvSection(name="sokoban", options=SMALL_SOKOBAN)


def _learner(
    base: LearnerConfig,
    *,
    push_every: int,
    global_batch: int,
    kinds: list[str] | None = None,
    max_batch_wait_s: float | None = None,
    lr: float | None = None,
    scale_partial_batches: bool = False,
) -> LearnerConfig:
    """``base`` (the run's learner preset) with a preset's changes: a push and a checkpoint every
    ``push_every`` steps, ``global_batch`` samples a step, and optionally the kinds, the batch wait
    and the lr."""
    trainer = base.trainer
    optim = trainer.optim
    if lr is not None or scale_partial_batches:
        optim = replace(optim, lr=optim.lr if lr is None else lr)
        optim = replace(
            optim, scale_partial_batches=scale_partial_batches or optim.scale_partial_batches
        )
    trainer = replace(
        trainer,
        optim=optim,
        push_every=push_every,
        checkpoint_every=push_every,
        batch=replace(trainer.batch, global_batch=global_batch),
    )
    learner = replace(base, trainer=trainer)
    if kinds is not None:
        learner = replace(learner, kinds=kinds)
    if max_batch_wait_s is not None:
        learner = replace(learner, max_batch_wait_s=max_batch_wait_s)
    return learner


def _warm_learner(base: LearnerConfig, kinds: list[str]) -> LearnerConfig:
    """The online learner of the warm-start presets (the ``warmstart`` preset's settings). No
    ``scale_partial_batches``: with the learner's batch floor only the stream's tail is a partial
    batch, and ``leafe train`` trains an epoch's last batch at the full lr too (issue 62)."""
    return _learner(
        base, kinds=kinds, max_batch_wait_s=10.0, lr=5e-5, push_every=4, global_batch=16
    )


def _run(name: str, *, materializer: str = "leafe", **sections: Any) -> RunConfig:
    """A preset: ``RunConfig`` named ``name``, whose replayer follows its materializer and model."""
    model = sections.get("model", RunConfig().model)
    replayer = sections.pop("replayer", ReplayerConfig())
    replayer = replace(replayer, materializer=materializer, model=model)
    return RunConfig(run_id=name, materializer=materializer, replayer=replayer, **sections)


def default_preset(learner: LearnerConfig) -> RunConfig:
    """``make run``: the whole method, sized for 2 idle cores and bounded by work, not time
    (phased).

    The expert's demonstrations of 128 train rooms (the warm start, sft; the paper table's warm
    start took 2 epochs of 96), one round of LEAFE trees on 8 train rooms, and Pass@k on 24 held-out
    test rooms x 4 samples before, after the warm start and after the round, with paired intervals
    per k (24 tasks for power: at 16 the intervals were +-25 points). No validation curve: with one
    round its two points would score the same weights as the two later held-out evaluations."""
    return _run(
        "default",
        materializer="warm-leafe",
        env=_SOKOBAN,
        explore=ExploreSection(tasks=8, rounds=1, demos=128),
        eval=EvalSection(tasks=24, samples=4, ks=[1, 2, 4]),
        actor=ActorServiceConfig(explorer=EXPLORE, rollout=COMPACT),
        learner=_warm_learner(learner, ["sft", "cf", "reh"]),
    )


def explore_only_preset(learner: LearnerConfig) -> RunConfig:
    """The one-pass LEAFE run from Base: 8 trees, no warm start."""
    return _run(
        "explore-only",
        env=_SOKOBAN,
        explore=ExploreSection(tasks=8),
        eval=EvalSection(tasks=12, samples=8, ks=[1, 2, 4, 8]),
        actor=ActorServiceConfig(explorer=EXPLORE, rollout=COMPACT),
        learner=_learner(learner, push_every=4, global_batch=16),
    )


def warmstart_preset(learner: LearnerConfig) -> RunConfig:
    """Learning that shows within minutes: expert demonstrations of train rooms (no engine needed),
    the sft materializer, and the online learner fix SmolLM2's answer format; the report compares
    Pass@k and unparseable answers before and after on held-out rooms."""
    return _run(
        "warmstart",
        materializer="sft",
        env=_SOKOBAN,
        explore=ExploreSection(mode="demo", tasks=96),
        eval=EvalSection(tasks=12, samples=8, ks=[1, 2, 4, 8]),
        actor=ActorServiceConfig(rollout=COMPACT),
        learner=_learner(
            learner, kinds=["sft"], max_batch_wait_s=10.0, lr=5e-5, push_every=4, global_batch=16
        ),
    )


def leafe_preset(learner: LearnerConfig) -> RunConfig:
    """The whole method online: the expert's demonstrations (warm start, sft samples) through the
    log, then continual LEAFE rounds on the RL pool with a learning curve on a validation slice."""
    return _run(
        "leafe",
        materializer="warm-leafe",
        budget_minutes=40.0,
        env=_SOKOBAN,
        explore=ExploreSection(tasks=16, rounds=3, demos=96, schedule="continuous"),
        online_eval=OnlineEvalSection(every_rounds=1, tasks=16, samples=4, ks=[1, 2, 4]),
        eval=EvalSection(tasks=16, samples=8, ks=[1, 2, 4, 8]),
        actor=ActorServiceConfig(explorer=EXPLORE, rollout=COMPACT),
        learner=_warm_learner(learner, ["sft", "cf", "reh"]),
    )


def grpo_preset(learner: LearnerConfig) -> RunConfig:
    """The online baseline: the same warm start, then continual GRPO (groups of 4 plain
    rollouts)."""
    return _run(
        "grpo",
        materializer="warm-grpo",
        budget_minutes=40.0,
        env=_SOKOBAN,
        explore=ExploreSection(
            tasks=16, rounds=3, demos=96, mode="rollout", samples=4, schedule="continuous"
        ),
        online_eval=OnlineEvalSection(every_rounds=1, tasks=16, samples=4, ks=[1, 2, 4]),
        eval=EvalSection(tasks=16, samples=8, ks=[1, 2, 4, 8]),
        actor=ActorServiceConfig(rollout=COMPACT),
        learner=_warm_learner(learner, ["sft", "grpo"]),
    )


def tiny_preset(learner: LearnerConfig) -> RunConfig:
    """``make run``'s shape in small, on the tiny random model (the end-to-end tests): a warm start
    from 2 demonstrations, then two phased rounds with a validation point after each."""
    return _run(
        "tiny",
        model="tiny",
        materializer="warm-leafe",
        env=_SOKOBAN,
        explore=ExploreSection(tasks=2, rounds=2, demos=2),
        online_eval=OnlineEvalSection(every_rounds=1, tasks=2, samples=2, ks=[1, 2]),
        eval=EvalSection(tasks=2, samples=2, ks=[1, 2], concurrency=4),
        # Two inference servers whatever the cores: the tests cover pushes to, and waits for, each.
        services=ServicesSection(actor_concurrency=2, inference_max_batch=4, inference_servers=2),
        actor=ActorServiceConfig(
            explorer={"sokoban": {"max_actions": 12, "max_branches": 3, "horizon": 6}}
        ),
        # The random model never solves a room: fold a counterfactual from every branch (parsed or
        # not) so the test still drives samples through the learner, a push and a reload.
        replayer=ReplayerConfig(
            options={"cf_only_successful": False, "skip_unparsed_targets": False}
        ),
        learner=_learner(
            learner, kinds=["sft", "cf", "reh"], max_batch_wait_s=2.0, push_every=1, global_batch=4
        ),
    )


PRESETS: dict[str, Callable[[LearnerConfig], RunConfig]] = {
    "default": default_preset,
    "explore-only": explore_only_preset,
    "warmstart": warmstart_preset,
    "leafe": leafe_preset,
    "grpo": grpo_preset,
    "tiny": tiny_preset,
}
"""Named starting points, each a typed ``RunConfig``; ``--config`` TOML files and ``--set``
overrides are layered over the chosen one."""


def resolve_run_config(
    preset: str,
    *,
    files: Sequence[Path | str | None] = (),
    overrides: Mapping[str, Any] | None = None,
) -> RunConfig:
    """The preset, then each TOML file, then dotted ``overrides``
    (``leafe.services.config.load_config``'s layering), with two run-specific rules: the
    ``[learner]`` table starts from the chosen ``learner_preset``'s settings, with the preset's own
    changes to the cpu learner preset over them; and the replayer follows the run's ``materializer``
    and ``model`` (setting them under ``[replayer]`` to anything else is an error)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    sources = [str(f) for f in files if f is not None]
    user: dict[str, Any] = {}
    for path in sources:
        user = merge_tables(user, read_toml(path))
    user = merge_tables(user, dotted(overrides or {}))
    chosen = PRESETS[preset](learner_preset(str(user.get("learner_preset", "cpu"))))
    table = merge_tables(dump_config(chosen), user)
    replayer = dict(table["replayer"])
    for key in ("materializer", "model"):
        run_value = table[key]
        asked = user.get("replayer", {}).get(key, run_value)
        if asked != run_value:
            raise ConfigError(
                f"replayer.{key} = {asked!r} differs from the run's {key} = {run_value!r}: "
                f"set only the top-level {key}"
            )
        replayer[key] = run_value
    table["replayer"] = replayer
    return convert_config(table, RunConfig, where=", ".join(sources) or f"preset {preset!r}")
