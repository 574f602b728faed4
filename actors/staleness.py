"""The staleness gate: an actor takes no new training episode while the samples it has produced
would fall further behind the learner than the learner keeps (issue 62's backpressure).

The learner drops a sample whose policy version is more than ``max_policy_lag`` pushes behind its
own (``leafe.learner.online``). An actor that runs ahead of a slow learner fills the samples stream
faster than it is trained, and by the time the learner reaches those samples it has pushed several
versions: an online GRPO run dropped 59% of its samples so. Dropping is waste; the gate stops the
work before it is done instead.

The rule is AReaL's staleness-bounded rollout capacity (its ``StalenessManager``: rollouts
accepted + running <= (max staleness + current version + 1) x rollouts consumed per version), in
this system's units: a learner version is one push (``WeightsPublished``), the rollouts a version
consumes are the episodes whose samples fill ``global_batch x push_every`` samples, shared among the
run's actors. So an actor may start its ``n``-th gated episode (``n`` from 1) only while

    n <= (max_policy_lag + (version - base) + 1) x episodes_per_version

where ``version`` is the learner's latest push and ``base`` the version when the actor started its
first gated episode. Demonstrations carry no policy version and are never gated (``GATED_MODES``).
Episodes give a varying number of samples, so ``episodes_per_version`` is an estimate (``leafe
run`` derives it from the run's config and the samples an episode of the mode gave in the shipped
records); so that an estimate too high cannot deadlock the run (the learner waiting for a full
batch, the actor for a push), a gate closed for ``max_wait_s`` without a push lends one
version's credit.
"""

from __future__ import annotations

import math

import msgspec

__all__ = ["GATED_MODES", "StalenessConfig", "StalenessGate"]

GATED_MODES = frozenset({"explore", "rollout"})
"""Task modes whose samples carry the engine's policy version (the ones the learner can drop)."""


class StalenessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[actor.staleness]``: the gate (``leafe run`` sets it for a continuous run with a
    learner)."""

    episodes_per_version: float = 0.0
    """Episodes of this actor whose samples fill one learner version (``global_batch x push_every``
    samples); 0 = no gate."""
    max_policy_lag: int = 4
    """Versions of lead allowed (the learner's ``max_policy_lag``)."""
    max_wait_s: float = 120.0
    """A gate closed this long without a new push lends one version's credit (an
    ``episodes_per_version`` estimated too high must not deadlock the run)."""

    def __post_init__(self) -> None:
        if self.episodes_per_version < 0 or self.max_policy_lag < 0 or self.max_wait_s <= 0:
            raise ValueError(
                "actor.staleness: episodes_per_version and max_policy_lag must be >= 0 and "
                f"max_wait_s > 0, got {self}"
            )


class StalenessGate:
    """The gate's bookkeeping (pure; the actor service asks it before every fetch)."""

    def __init__(self, config: StalenessConfig) -> None:
        self.config = config
        self.started = 0
        """Gated episodes started by this actor."""
        self.base: int | None = None
        """Learner version when the first gated episode started (None before)."""
        self.lent = 0
        """Versions of credit lent after ``max_wait_s`` closed (counted: the report's figure)."""

    @property
    def enabled(self) -> bool:
        """Whether the gate can close at all."""
        return self.config.episodes_per_version > 0

    def capacity(self, version: int) -> float:
        """Gated episodes this actor may still start at learner version ``version`` (inf when
        off)."""
        if not self.enabled:
            return math.inf
        base = version if self.base is None else self.base
        versions = self.config.max_policy_lag + (version - base) + self.lent + 1
        return math.floor(versions * self.config.episodes_per_version) - self.started

    def may_start(self, version: int) -> bool:
        """Whether one more gated episode may start now."""
        return self.capacity(version) >= 1

    def on_start(self, mode: str, version: int) -> None:
        """Count an episode of ``mode`` started at learner version ``version``."""
        if mode not in GATED_MODES:
            return
        if self.base is None:
            self.base = version
        self.started += 1

    def lend(self) -> None:
        """One version's credit, after the gate stayed closed ``max_wait_s`` without a push."""
        self.lent += 1
