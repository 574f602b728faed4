"""Configuration of the actors: LEAFE exploration (Stage 1), plain rollouts, and the actor service.

The paper does not publish K, the tree depth, the attempt budget or sampling settings, so each
environment gets documented defaults here (:data:`ENV_DEFAULTS`); a TOML file overrides any field
per environment::

    concurrency = 8
    [explorer.sokoban]        # fields of ExplorerConfig; "*" applies to every environment
    k = 4
    [rollout."*"]
    temperature = 0.7

Per-environment defaults and why (paper silent on all of them):

| env               | horizon | K  | depth | branches | actions | window | thread |
|-------------------|---------|----|-------|----------|---------|--------|--------|
| sokoban           | 15      | 5  | 3     | 8        | 60      | all    | no     |
| scienceworld      | 30      | 10 | 2     | 6        | 120     | 8      | yes    |
| textworld-cooking | 20      | 5  | 3     | 6        | 80      | 10     | yes    |
| humaneval         | 4       | 0  | 2     | 6        | 16      | all    | yes    |
| anything else     | 20      | 5  | 2     | 6        | 60      | all    | no     |

- sokoban: small rooms solve in well under 15 moves; K = 5 gives two periodic reflections per root
  path plus the failure one; snapshots are cheap, so a deeper, wider tree is affordable; short
  completions (32 tokens: a move word) keep CPU generation fast.
- scienceworld: long tasks with long observations (window 8 keeps prompts bounded); horizon = the
  env's ``max_steps`` (30); a reset costs ~1.4 s and rollback replays, so the tree is shallow; the
  JVM runs in a thread.
- textworld-cooking: the ALFWorld stand-in; horizon = the env's own ``max_steps`` (20); a reset
  costs ~10 ms, so replay rollbacks are cheap and the tree may be deep.
- humaneval: the paper's CodeContests setting, 4 submissions (the env's ``max_turns``) and
  reflection only when they are used up (K = 0); code needs long completions (384 tokens), answers
  in a fenced block (parsed as ``fence``) and no ``</action>`` stop; the sandbox is slow, so it runs
  in a thread.
- sokoban, scienceworld and textworld-cooking prefill ``<action>`` as the start of every answer
  (``response_prefix``): SmolLM2-135M then names a move in most answers instead of ~25% (measured),
  and the prefix is part of the recorded prompt, so training targets are exactly what the model
  generated.
- the explorer's horizon never exceeds the env's own step limit, so "horizon" means ours; where the
  env ends first the branch ends ``env_done`` and the reflection trigger is ``failure``.
- ``reflection_source = "oracle"`` (an ablation, sokoban and humaneval only:
  ``leafe.envs.registry.ORACLE_ENVS``) lets the environment's oracle name tau and e instead of the
  policy; any other env is a config error. ``oracle_labels = true`` (same envs) keeps the policy's
  reflections and records the oracle's verdict beside each one (the labels of the reflection warm
  start, ``learner/materializers/reflect.py``).

Demonstration episodes (mode ``demo``) take their prompt settings from the env's
:class:`RolloutConfig` and the rest from ``leafe.actors.demo_config.DemoConfig`` (the
``[demo.<env>]`` tables).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from leafe.actors.client import SGLangClientConfig
from leafe.actors.demo_config import DemoConfig
from leafe.actors.engine import SamplingParams
from leafe.actors.staleness import StalenessConfig
from leafe.envs.registry import ORACLE_ENVS
from leafe.protocol.config import ConfigError, convert_config, merge_tables

__all__ = [
    "ENV_DEFAULTS",
    "ActionSampling",
    "ActorServiceConfig",
    "ExperienceScope",
    "ExplorerConfig",
    "ReflectionSourceName",
    "RolloutConfig",
]

ExperienceScope = Literal["first_step", "branch"]
ReflectionSourceName = Literal["model", "oracle"]
Override = dict[str, int | float | str | bool | list[str]]


def _check(cond: bool, field: str, value: object, want: str) -> None:
    if not cond:
        raise ValueError(f"{field} = {value!r}: {want}")


class ActionSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an action is sampled: what a plain rollout and an exploration tree share."""

    temperature: float = 1.0
    """Action sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Action nucleus sampling mass."""
    top_k: int = -1
    """Action top-k (-1 = off)."""
    max_new_tokens: int = 48
    """Action completion length cap, tokens."""
    action_stop: list[str] = msgspec.field(default_factory=lambda: ["</action>"])
    """Stop strings for actions (the tagged answer ends there; parsing tolerates the cut tag)."""


class RolloutConfig(ActionSampling, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A plain rollout (evaluation sample or GRPO group member): no reflection, no rollback."""

    horizon: int = 20
    """Maximum policy actions in the episode (invalid actions count)."""
    history_window: int = 0
    """Past steps shown in a prompt; 0 = all (``leafe.protocol.prompt.render_messages``)."""
    response_prefix: str = ""
    """Start of every answer, prefilled in the prompt (``<action>`` makes a small model answer in
    format)."""
    return_logprob: bool = True
    """Ask the engine for behaviour logprobs (GRPO needs them)."""
    env_in_thread: bool = False
    """Run env calls in a worker thread (slow envs: JVM, sandboxes) so the event loop stays free."""
    seeded_sampling: bool = True
    """Send a per-request ``sampling_seed`` derived from the episode seed (reproducible where the
    engine honours it)."""

    def __post_init__(self) -> None:
        _check(self.horizon >= 1, "horizon", self.horizon, "must be >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(self.history_window >= 0, "history_window", self.history_window, "must be >= 0")

    @classmethod
    def for_env(cls, env: str, overrides: Override | None = None) -> RolloutConfig:
        """The documented defaults of ``env`` with ``overrides`` applied (errors name env and
        field)."""
        return _resolve(cls, env, overrides)


class ExplorerConfig(ActionSampling, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The LEAFE exploration tree (Stage 1 of docs/method.md) of one episode."""

    k: int = 5
    """Reflect every ``k`` own steps of a branch (the branch goes on); 0 = only on
    failure/horizon."""
    max_depth: int = 2
    """Deepest branch (root = 0); a branch at this depth never reflects."""
    max_branches: int = 6
    """Attempt budget: branches per episode, root included (queued requests count against it)."""
    max_actions: int = 60
    """Interaction budget: policy actions per episode over all branches (invalid actions count;
    env steps spent replaying are counted separately and not limited)."""
    horizon: int = 20
    """Maximum length of one branch's path (inherited prefix included)."""
    reflect_temperature: float = 0.7
    """Reflection sampling temperature (lower: a reflection should be a considered answer)."""
    reflect_top_p: float = 1.0
    """Reflection nucleus sampling mass."""
    reflect_max_new_tokens: int = 128
    """Reflection completion length cap, tokens."""
    reflect_stop: list[str] = msgspec.field(default_factory=lambda: ["</experience>"])
    """Stop strings for reflections."""
    history_window: int = 0
    """Past steps shown in an action prompt; 0 = all."""
    response_prefix: str = ""
    """Start of every action answer, prefilled in the prompt (recorded in ``EpisodeStarted``)."""
    reflect_history_window: int = 0
    """Past steps shown in the reflection prompt; 0 = all (tau must be nameable)."""
    experience_scope: ExperienceScope = "branch"
    """``branch``: e stays in every prompt of its branch; ``first_step``: only in a'_tau's
    prompt."""
    stop_on_first_success: bool = True
    """End the episode (drop queued branch requests) once any branch succeeds. The paper keeps
    exploring until the attempt budget (``false``), collecting up to ``max_corrections``
    counterfactuals per tree."""
    max_corrections: int = 0
    """End the episode once this many rolled-back branches have succeeded (each one is a
    counterfactual instance; the paper keeps 3 per task); 0 = no limit. Matters with
    ``stop_on_first_success = false``."""
    restart_from: Literal["tau", "start"] = "tau"
    """``tau``: LEAFE, roll back to the step the reflection names; ``start``: iterative refinement
    (the paper's IR baseline), every branch restarts the task from step 0 with e in context."""
    max_experience_chars: int = 400
    """Longer experiences are cut (flag ``experience_truncated``)."""
    reflection_source: ReflectionSourceName = "model"
    """Who names tau and e: the policy (``model``, LEAFE) or the environment's oracle (``oracle``,
    an ablation: the solver or the visible-test feedback; ``leafe.envs.registry.ORACLE_ENVS``
    only)."""
    oracle_labels: bool = False
    """With model reflections, also ask the environment's oracle for its tau and e on the same
    history and record them in the Reflection (``oracle_tau``, ``oracle_experience``): labels for
    the reflection warm start (the ``reflect`` materializer) and the tau-agreement audit. The branch
    still follows the model's tau and e. ``leafe.envs.registry.ORACLE_ENVS`` only; meaningless with
    ``reflection_source = "oracle"``."""
    return_logprob: bool = False
    """Ask the engine for behaviour logprobs of actions."""
    env_in_thread: bool = False
    """Run env calls in a worker thread."""
    seeded_sampling: bool = True
    """Send a per-request ``sampling_seed`` derived from the episode seed."""

    def __post_init__(self) -> None:
        _check(self.k >= 0, "k", self.k, "must be >= 0 (0 = no periodic reflection)")
        _check(self.max_depth >= 0, "max_depth", self.max_depth, "must be >= 0")
        _check(self.max_branches >= 1, "max_branches", self.max_branches, "must be >= 1 (the root)")
        _check(self.max_actions >= 1, "max_actions", self.max_actions, "must be >= 1")
        _check(self.horizon >= 1, "horizon", self.horizon, "must be >= 1")
        _check(
            self.max_corrections >= 0,
            "max_corrections",
            self.max_corrections,
            "must be >= 0 (0 = no limit)",
        )
        for name in ("temperature", "reflect_temperature"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("top_p", "reflect_top_p"):
            _check(0 < getattr(self, name) <= 1, name, getattr(self, name), "must be in (0, 1]")
        for name in ("max_new_tokens", "reflect_max_new_tokens", "max_experience_chars"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("history_window", "reflect_history_window"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        _check(
            not (self.oracle_labels and self.reflection_source == "oracle"),
            "oracle_labels",
            self.oracle_labels,
            "labels model reflections; with reflection_source = 'oracle' the oracle already names "
            "tau and e",
        )

    @classmethod
    def for_env(cls, env: str, overrides: Override | None = None) -> ExplorerConfig:
        """The documented defaults of ``env`` with ``overrides`` applied (errors name env and
        field)."""
        config: ExplorerConfig = _resolve(cls, env, overrides)
        for name, wants in (
            ("reflection_source", config.reflection_source == "oracle"),
            ("oracle_labels", config.oracle_labels),
        ):
            if wants and env != "*" and env not in ORACLE_ENVS:
                value = getattr(config, name)
                raise ConfigError(
                    f"invalid ExplorerConfig (from env {env!r}): {name} = {value!r} but {env!r} "
                    "has no "
                    f"reflection oracle (only {sorted(ORACLE_ENVS)})"
                )
        return config

    def action_params(self, seed: int | None = None) -> SamplingParams:
        """Sampling parameters of an action request."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=list(self.action_stop),
            sampling_seed=seed,
        )

    def reflection_params(self, seed: int | None = None) -> SamplingParams:
        """Sampling parameters of a reflection request."""
        return SamplingParams(
            max_new_tokens=self.reflect_max_new_tokens,
            temperature=self.reflect_temperature,
            top_p=self.reflect_top_p,
            stop=list(self.reflect_stop),
            sampling_seed=seed,
        )

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig) -> ExplorerConfig:
        """An exploration that is one plain rollout: no reflection, one branch, ``horizon``
        actions."""
        return cls(
            k=0,
            max_depth=0,
            max_branches=1,
            max_actions=rollout.horizon,
            horizon=rollout.horizon,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            action_stop=list(rollout.action_stop),
            history_window=rollout.history_window,
            response_prefix=rollout.response_prefix,
            return_logprob=rollout.return_logprob,
            env_in_thread=rollout.env_in_thread,
            seeded_sampling=rollout.seeded_sampling,
        )


ENV_DEFAULTS: dict[str, Override] = {
    "sokoban": {
        "response_prefix": "<action>",
        "horizon": 15,
        "k": 5,
        "max_depth": 3,
        "max_branches": 8,
        "max_actions": 60,
        "max_new_tokens": 32,
        "reflect_max_new_tokens": 96,
    },
    "scienceworld": {
        "response_prefix": "<action>",
        "horizon": 30,
        "k": 10,
        "max_depth": 2,
        "max_branches": 6,
        "max_actions": 120,
        "history_window": 8,
        "env_in_thread": True,
    },
    "textworld-cooking": {
        "response_prefix": "<action>",
        "horizon": 20,
        "k": 5,
        "max_depth": 3,
        "max_branches": 6,
        "max_actions": 80,
        "max_new_tokens": 32,
        "history_window": 10,
        "env_in_thread": True,
    },
    "humaneval": {
        "horizon": 4,
        "k": 0,
        "max_depth": 2,
        "max_branches": 6,
        "max_actions": 16,
        "temperature": 0.8,
        "max_new_tokens": 384,
        "action_stop": [],
        "reflect_max_new_tokens": 160,
        "env_in_thread": True,
    },
}
"""Per-environment defaults (fields of :class:`ExplorerConfig`; rollouts take the fields they
have)."""


def _resolve(type_: type[Any], env: str, overrides: Override | None) -> Any:
    fields = set(type_.__struct_fields__)
    defaults = {k: v for k, v in ENV_DEFAULTS.get(env, {}).items() if k in fields}
    return convert_config(merge_tables(defaults, overrides or {}), type_, where=f"env {env!r}")


class ActorServiceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``leafe actor``: how tasks are pulled and episodes run (the per-env tables override the
    defaults)."""

    concurrency: int = 4
    """Episodes run at once by one actor process."""
    durable: str = "actors"
    """Durable consumer name prefix on the tasks stream; the consumer is ``<durable>-<run_id>``
    (runs share the stream), and every actor of the run binds the same one."""
    fetch_timeout_s: float = 1.0
    """How long one fetch waits for a task."""
    ack_wait_s: float = 60.0
    """Consumer AckWait: a silent actor's task is redelivered after this (crash detection time)."""
    in_progress_interval_s: float = 15.0
    """How often a running episode extends its task's AckWait; must be < ``ack_wait_s``."""
    max_attempts: int = 3
    """Deliveries of one task before it is given up (terminated) after engine or actor errors."""
    retry_delay_s: float = 5.0
    """Delay before a failed task is redelivered."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long running episodes may finish; the rest are abandoned and nak'ed."""
    env_pool_size: int = 4
    """Idle environment instances kept per (env, options) for reuse across episodes."""
    explorer: dict[str, Override] = msgspec.field(default_factory=dict)
    """Per-env overrides of :class:`ExplorerConfig` fields (key ``"*"`` applies to every env)."""
    rollout: dict[str, Override] = msgspec.field(default_factory=dict)
    """Per-env overrides of :class:`RolloutConfig` fields (key ``"*"`` applies to every env)."""
    engine: SGLangClientConfig = msgspec.field(default_factory=SGLangClientConfig)
    """How the actor talks to its inference servers (``[actor.engine]``: request timeout,
    retries)."""
    demo: dict[str, Override] = msgspec.field(default_factory=dict)
    """Per-env overrides of ``leafe.actors.demo_config.DemoConfig`` fields (demonstrations, Early
    Experience; key ``"*"`` applies to every env)."""
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    """The staleness gate (``[actor.staleness]``, ``actors/staleness.py``): no new training episode
    while this actor's samples would lag the learner past ``max_policy_lag``; off unless set
    (``leafe run`` sets it for a continuous run)."""

    def __post_init__(self) -> None:
        _check(self.concurrency >= 1, "concurrency", self.concurrency, "must be >= 1")
        _check(self.max_attempts >= 1, "max_attempts", self.max_attempts, "must be >= 1")
        _check(self.fetch_timeout_s > 0, "fetch_timeout_s", self.fetch_timeout_s, "must be > 0")
        _check(
            0 < self.in_progress_interval_s < self.ack_wait_s,
            "in_progress_interval_s",
            self.in_progress_interval_s,
            f"must be in (0, ack_wait_s={self.ack_wait_s})",
        )
        for env in self.explorer:
            self.explorer_config(env)
        for env in self.rollout:
            self.rollout_config(env)
        for env in self.demo:
            self.demo_config(env)

    def explorer_config(self, env: str) -> ExplorerConfig:
        """Resolved exploration config of ``env``: defaults, then ``"*"``, then the env's
        overrides."""
        return ExplorerConfig.for_env(
            env, {**self.explorer.get("*", {}), **self.explorer.get(env, {})}
        )

    def rollout_config(self, env: str) -> RolloutConfig:
        """Resolved rollout config of ``env``: defaults, then ``"*"``, then the env's overrides."""
        return RolloutConfig.for_env(
            env, {**self.rollout.get("*", {}), **self.rollout.get(env, {})}
        )

    def demo_config(self, env: str) -> DemoConfig:
        """Resolved demonstration config of ``env``: defaults, then ``"*"``, then the env's
        overrides."""
        return DemoConfig.for_env(env, {**self.demo.get("*", {}), **self.demo.get(env, {})})
