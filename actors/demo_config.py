"""Configuration of demonstration episodes (mode ``demo``) and of the Early Experience baseline on
them.

A demonstration renders every prompt exactly as a plain rollout of the same environment would
(``RolloutConfig``: ``response_prefix``, ``history_window``, ``action_stop``, ``max_new_tokens``,
``env_in_thread``, ``seeded_sampling``), so the SFT samples train the format the policy is evaluated
with. :class:`DemoConfig` adds what only demonstrations have; the actor service resolves it per
environment like the other configs (``ActorServiceConfig.demo``)::

    # in the actor's TOML (leafe actor --config), or [actor.demo.sokoban] in leafe run
    [demo.sokoban]
    # Early Experience: K proposals per expert state, executed off the expert path
    alternatives = 4
    # and the policy explains why the expert action beats each alternative
    self_reflection = true

Defaults: plain demonstrations (no engine call). Answer formats: ``tag`` (``<action>up</action>``,
every env whose instructions ask for it) and ``fence`` (HumanEval: the function in a fenced
``python`` block).
"""

from __future__ import annotations

import msgspec

from leafe.protocol.answers import AnswerFormat
from leafe.protocol.config import convert_config, merge_tables

__all__ = ["DEMO_DEFAULTS", "AnswerFormat", "DemoConfig"]

DemoOverride = dict[str, int | float | str | bool | list[str]]


class DemoConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One demonstration episode: how expert actions are written, and the Early Experience
    extras."""

    answer_format: AnswerFormat = "tag"
    """How an expert action is written as the policy's answer: ``tag`` = ``<action>A</action>``,
    ``fence`` = a fenced ``python`` block (code environments)."""
    alternatives: int = 0
    """Early Experience: completions sampled from the engine at each expert state (K); the distinct
    parseable ones that differ from the expert action are executed and logged as one-step branches.
    0 = a plain demonstration (no engine call)."""
    temperature: float = 1.0
    """Sampling temperature of the alternatives (the paper's setting: 1)."""
    top_p: float = 1.0
    """Nucleus mass of the alternatives."""
    max_states: int = 0
    """Expert states (from the start) that get alternatives; 0 = every state of the
    demonstration."""
    self_reflection: bool = False
    """Ask the policy, for every executed alternative, why the expert action is better (the ``sr``
    baseline); needs ``alternatives`` > 0."""
    reflect_temperature: float = 0.7
    """Sampling temperature of self-reflections."""
    reflect_max_new_tokens: int = 96
    """Length cap of a self-reflection, tokens."""
    max_reflection_chars: int = 400
    """Longer self-reflections are cut (flag ``experience_truncated``)."""

    def __post_init__(self) -> None:
        checks = [
            (self.alternatives >= 0, "alternatives", self.alternatives, "must be >= 0"),
            (self.temperature >= 0, "temperature", self.temperature, "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]"),
            (self.max_states >= 0, "max_states", self.max_states, "must be >= 0"),
            (
                self.reflect_temperature >= 0,
                "reflect_temperature",
                self.reflect_temperature,
                "must be >= 0",
            ),
            (
                self.reflect_max_new_tokens >= 1,
                "reflect_max_new_tokens",
                self.reflect_max_new_tokens,
                ">= 1",
            ),
            (
                self.max_reflection_chars >= 1,
                "max_reflection_chars",
                self.max_reflection_chars,
                "must be >= 1",
            ),
            (
                not self.self_reflection or self.alternatives > 0,
                "self_reflection",
                self.self_reflection,
                "needs alternatives > 0 (it compares the expert action with executed alternatives)",
            ),
        ]
        for ok, name, value, want in checks:
            if not ok:
                raise ValueError(f"{name} = {value!r}: {want}")

    @property
    def uses_engine(self) -> bool:
        """Whether the episode samples from the engine (alternatives, self-reflections)."""
        return self.alternatives > 0

    @classmethod
    def for_env(cls, env: str, overrides: DemoOverride | None = None) -> DemoConfig:
        """The defaults of ``env`` (:data:`DEMO_DEFAULTS`) with ``overrides`` applied."""
        table = merge_tables(DEMO_DEFAULTS.get(env, {}), overrides or {})
        return convert_config(table, cls, where=f"env {env!r}")


DEMO_DEFAULTS: dict[str, DemoOverride] = {
    "humaneval": {"answer_format": "fence", "reflect_max_new_tokens": 160},
}
"""Per-environment defaults of :class:`DemoConfig` (every other env answers in the ``tag``
format)."""
