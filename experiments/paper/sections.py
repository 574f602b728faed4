"""The stage sections of the paper table's configuration (``[warm]``, ``[grpo]``, ``[early]``,
``[leafe]``, ``[effect]``): what each stage trains and samples. ``experiments/paper/config.py``
assembles them into :class:`~experiments.paper.config.PaperConfig` with the task ranges, serving and
training.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "EarlyConfig",
    "EffectConfig",
    "GrpoConfig",
    "LeafeConfig",
    "Options",
    "WarmStartConfig",
    "require",
]

Options = dict[str, Any]


def require(ok: bool, field: str, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"{field} = {value!r}: {want}")


class WarmStartConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base + SFT: SFT on demonstrations, room difficulty, demonstration count and epochs chosen on
    the validation slice (every candidate's validation result goes into the report)."""

    variants: dict[str, Options] = msgspec.field(default_factory=dict)
    """Room difficulty candidates: name -> env options (e.g. ``max_solution_len``,
    ``max_steps``)."""
    demo_counts: list[int] = msgspec.field(default_factory=lambda: [8])
    """Demonstrations (train tasks from ``demo_offset``) tried per variant; each is one training."""
    epochs: int = 2
    """Epochs of each SFT training; the weights after every epoch are a candidate (constant lr, so
    epoch e of a longer run equals a run of e epochs)."""
    lr: float = 5e-5
    """SFT learning rate (also Early Experience's)."""
    max_parse_failure: float = 0.10
    """A candidate must leave fewer unparseable answers than this on validation."""
    pass1_range: list[float] = msgspec.field(default_factory=lambda: [0.10, 0.50])
    """... and a validation Pass@1 in this range (room to improve)."""
    pass1_target: float = 0.30
    """Among the candidates that meet both, the one with Pass@1 closest to this wins (ties:
    cheaper)."""
    max_passk: float = 1.0
    """... and a validation Pass@k at the largest k of at most this (rooms where large k can
    show)."""

    def __post_init__(self) -> None:
        require(
            bool(self.variants), "warm.variants", self.variants, "need at least one room variant"
        )
        require(
            bool(self.demo_counts), "warm.demo_counts", self.demo_counts, "need at least one count"
        )
        require(
            min(self.demo_counts, default=0) >= 1, "warm.demo_counts", self.demo_counts, "all >= 1"
        )
        require(self.epochs >= 1, "warm.epochs", self.epochs, "must be >= 1")
        require(self.lr > 0, "warm.lr", self.lr, "must be > 0")
        require(
            0 < self.max_parse_failure <= 1,
            "warm.max_parse_failure",
            self.max_parse_failure,
            "in (0, 1]",
        )
        lo_hi = self.pass1_range
        ok = len(lo_hi) == 2 and 0 <= lo_hi[0] <= lo_hi[1] <= 1
        require(ok, "warm.pass1_range", lo_hi, "must be [lo, hi] with 0 <= lo <= hi <= 1")
        for name in self.variants:
            require(
                name.replace("-", "").replace("_", "").isalnum(),
                "warm.variants",
                name,
                "key-safe name",
            )


class GrpoConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Online GRPO from Base + SFT: collect with the current weights -> ``grpo`` -> train ->
    reload."""

    rounds: int = 2
    """Rounds; the round with the best validation Pass@1 becomes the GRPO row (round >= 1)."""
    group: int = 4
    """Rollouts per RL task and round (the group of the advantage)."""
    lrs: list[float] = msgspec.field(default_factory=lambda: [1e-5])
    """Learning rates tried in round 1 (chosen on validation; later rounds use the winner)."""
    epochs: int = 1
    """Epochs over each round's samples (1 = on-policy)."""
    share_prefix: bool = False
    """Train the rounds with the learner's ``share_prefix``: a round's one-action samples are ~60%
    the same system prompt and task header, computed once a packed row instead of once a sample (the
    same step up to bf16 rounding; ~1.5x faster steps). Off by default so that phases recorded
    without it rebuild exactly."""
    dual_clip: float = 0.0
    """The rounds' ``loss.dual_clip`` (dual-clip PPO's c, e.g. 3): a bound on a negative-advantage
    token's objective. 0 (off) by default, pinned in every training's trainer table, so that phases
    recorded before the learner's default became 3 rebuild exactly; new protocols set it."""

    def __post_init__(self) -> None:
        require(self.rounds >= 1, "grpo.rounds", self.rounds, "must be >= 1")
        require(
            self.group >= 2, "grpo.group", self.group, "must be >= 2 (an advantage needs a group)"
        )
        require(bool(self.lrs) and min(self.lrs) > 0, "grpo.lrs", self.lrs, "need >= 1 lr, all > 0")
        require(self.epochs >= 1, "grpo.epochs", self.epochs, "must be >= 1")
        require(
            self.dual_clip == 0.0 or self.dual_clip > 1.0,
            "grpo.dual_clip",
            self.dual_clip,
            "must be 0 (off) or > 1",
        )


class EarlyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Early Experience from Base on the chosen demonstrations (``actors/early.py``)."""

    alternatives: int = 4
    """Proposals sampled at each expert state (K)."""
    max_states: int = 0
    """Expert states per demonstration that get alternatives (0 = all)."""
    sr_max_new_tokens: int = 128
    """Answer length cap when evaluating the SR policy (it reasons in ``<think>`` first)."""

    def __post_init__(self) -> None:
        require(self.alternatives >= 1, "early.alternatives", self.alternatives, "must be >= 1")
        require(
            self.sr_max_new_tokens >= 8, "early.sr_max_new_tokens", self.sr_max_new_tokens, ">= 8"
        )


class LeafeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Stage 1 (the tree) and Stage 2 (distillation); also RFT's and L_reh's training settings."""

    explorer: Options = msgspec.field(default_factory=dict)
    """``ExplorerConfig`` overrides for Stage 1 (the oracle row adds ``reflection_source =
    "oracle"``)."""
    explore_samples: int = 1
    """Trees per RL task (each its own episode and sampling seed)."""
    lr: float = 1e-5
    """Learning rate of LEAFE, L_reh and RFT."""
    epochs: int = 2
    """Epochs of LEAFE, L_reh and RFT."""
    beta: float = 1.0
    """Weight of L_reh in LEAFE's Stage 2."""
    rehearsal_fraction: float = 0.2
    """Share of successful-path steps kept for D_reh (paper: 20%)."""

    def __post_init__(self) -> None:
        require(
            self.explore_samples >= 1, "leafe.explore_samples", self.explore_samples, "must be >= 1"
        )
        require(
            self.lr > 0 and self.epochs >= 1,
            "leafe.lr/epochs",
            (self.lr, self.epochs),
            "lr > 0, >= 1",
        )
        require(
            "reflection_source" not in self.explorer,
            "leafe.explorer",
            self.explorer,
            "no reflection_source",
        )


class EffectConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``effect`` protocol (``experiments/paper/effect.py``): a warm start that
    teaches the policy to act on e, a follow-rate gate, then every row from it. Train ranges
    (disjoint from the others, checked)."""

    label_offset: int = 3000
    """First train index of the rooms whose labelled trees give the warm start's reflection and
    follow data."""
    label_tasks: int = 64
    """Label rooms."""
    label_samples: int = 2
    """Trees per label room."""
    label_explorer: Options = msgspec.field(default_factory=dict)
    """``ExplorerConfig`` overrides of the label and audit trees (``oracle_labels`` is set by the
    protocol)."""
    audit_offset: int = 4000
    """First train index of the rooms the follow audit samples at (never trained on)."""
    audit_tasks: int = 32
    """Audit rooms (one labelled tree each, from the warm start)."""
    audit_samples: int = 8
    """Answers sampled per verdict and condition."""
    follow_gate: float = 0.70
    """The follow rate the warm start must reach (with the oracle's e, above its share without e);
    below it the rows are not run and the report says why."""
    warm_epochs: int = 2
    """Epochs of the shared warm start (each is a candidate, chosen on validation)."""
    warm_lr: float = 5e-5
    """Its learning rate."""
    explorer: Options = msgspec.field(default_factory=dict)
    """``ExplorerConfig`` overrides of Stage 1 (both reflection sources)."""
    explore_samples: int = 1
    """Stage-1 trees per RL task."""
    row_steps: int = 40
    """Optimizer steps of every distillation row (LEAFE, L_reh: equal steps)."""
    row_lr: float = 3e-5
    """Their learning rate."""
    beta: float = 1.0
    """Weight of L_reh in LEAFE."""
    rehearsal_fraction: float = 0.2
    """Share of successful paths kept for D_reh (the paper's 20% of successful rollouts)."""
    rooms: dict[str, Options] = msgspec.field(default_factory=dict)
    """Room variants the follow audit and every row may run on instead of the warm start's own,
    chosen on validation with the warm start (``select-rooms``: warm.max_passk at the largest k,
    Pass@1 in warm.pass1_range nearest warm.pass1_target). Empty: the rows run on ``select-sft``'s
    rooms."""
    inherit: str = ""
    """Another ``effect`` experiment (its name) whose warm start, every phase up to ``select-warm``,
    this one takes instead of running its own: the records and logs committed under
    ``experiments/results/paper_logs/<inherit>/``, the weights rebuilt from them. Its registered
    protocol must agree on everything the warm start depends on (checked at start). Needs
    ``rooms``."""
    own_rehearsal: bool = False
    """The fair table (issue #61): every distillation row's rehearsal is the policy's own steps of
    its trees (``reh-own``: no step with e in its prompt, none byte-identical to a cf sample), and
    the rows ``dagger``, ``reh-own`` and ``leafe-self`` may be asked for."""
    dagger: Options = msgspec.field(default_factory=dict)
    """Options of the ``dagger`` builder (``learner/materializers/fair.py``) of the DAgger row,
    replayed from the oracle-e Stage 1 log (its root rollouts are W's own)."""
    self_taught: Options = msgspec.field(default_factory=dict)
    """Options of the ``self-taught`` builder (the reflector's targets)."""
    reflector_rounds: int = 0
    """Rounds of the self-taught reflector: reflect -> branch -> keep what beat the no-e path ->
    train; the ``leafe-self`` row distills the last round's trees."""
    reflector_steps: int = 60
    """Optimizer steps of each reflector training."""

    def __post_init__(self) -> None:
        for name in self.rooms:
            require(
                name.replace("-", "").replace("_", "").isalnum(),
                "effect.rooms",
                name,
                "key-safe name",
            )
        require(
            not self.inherit or bool(self.rooms),
            "effect.inherit",
            self.inherit,
            "needs effect.rooms",
        )
        for name in (
            "label_tasks",
            "label_samples",
            "audit_tasks",
            "audit_samples",
            "warm_epochs",
            "row_steps",
            "reflector_steps",
        ):
            require(getattr(self, name) >= 1, f"effect.{name}", getattr(self, name), "must be >= 1")
        require(0 < self.follow_gate <= 1, "effect.follow_gate", self.follow_gate, "in (0, 1]")
        require(
            0 <= self.reflector_rounds <= 5,
            "effect.reflector_rounds",
            self.reflector_rounds,
            "in [0, 5]",
        )
        for key in ("reflection_source", "oracle_labels"):
            for field in ("label_explorer", "explorer"):
                require(
                    key not in getattr(self, field),
                    f"effect.{field}",
                    key,
                    "is set by the protocol",
                )
