"""Configuration of the paper table (``experiments/paper_table.py``): one TOML file per scale.

``experiments/configs/paper_small.toml`` (the end-to-end check, < ~45 min on 2 shared cores),
``experiments/configs/paper_full.toml`` (>= 64 test tasks x 16 samples per row),
``experiments/configs/paper_humaneval.toml`` (the second environment). ``--scale NAME`` reads
``experiments/configs/paper_NAME.toml``; ``--config FILE`` any other. Every field has a docstring;
unknown fields are errors naming the field and file (``leafe.services.config.load_config``).

Task ranges (indices into ``env.tasks(split)``), all fixed before anything runs, as range (split):
indices; what uses them:

- demonstrations (train): ``demo_offset`` + [0, max(warm.demo_counts)); SFT, Early Experience
- RL tasks (train): ``train_offset`` + [0, ``train_tasks``); GRPO, RFT, LEAFE Stage 1, Table 3
- validation (train): ``val_offset`` + [0, ``val_tasks``); every choice (SFT, GRPO lr and round)
- test (test): ``test_offset`` + [0, ``test_tasks``); the table only

The validation range must be disjoint from the other two train ranges (checked here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from experiments.paper.sections import (
    EarlyConfig,
    EffectConfig,
    GrpoConfig,
    LeafeConfig,
    Options,
    WarmStartConfig,
    require,
)
from leafe.services.config import load_config

__all__ = [
    "CONFIGS",
    "EFFECT_ROWS",
    "FULL_POWER",
    "ROLLOUT_KEYS",
    "ROWS",
    "EarlyConfig",
    "EffectConfig",
    "GrpoConfig",
    "LeafeConfig",
    "PaperConfig",
    "ProbeConfig",
    "ServingConfig",
    "TrainingConfig",
    "WarmStartConfig",
    "load_paper_config",
    "scale_path",
]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
"""The ``experiments/configs/`` directory (scale TOML files live there)."""

ROWS: dict[str, str] = {
    "base": "Base",
    "sft": "Base + SFT",
    "iwm": "EarlyExp (IWM)",
    "sr": "EarlyExp (SR)",
    "grpo": "GRPO (from Base + SFT)",
    "rft": "RFT (from Base + SFT)",
    "leafe": "LEAFE (from GRPO, model reflections)",
    "leafe-oracle": "LEAFE with oracle reflections (ablation, from GRPO)",
    "reh": "L_reh only (from GRPO)",
    "sft-reseed": "Base + SFT, other sampling seeds (noise check)",
}
"""Row label -> the name the report prints, in table order. The oracle row is an ablation, never
"LEAFE"."""

EFFECT_ROWS: dict[str, str] = {
    "warm": "Warm start (demonstrations + reflections + following e)",
    "grpo": "GRPO (from the warm start)",
    "reh": "L_reh only (model-e trees)",
    "leafe": "LEAFE (model e)",
    "reh-oracle": "L_reh only (oracle-e trees)",
    "leafe-oracle": "LEAFE with oracle e (ablation)",
    "dagger": "DAgger with the oracle (one round on W's own rollouts, no tree)",
    "reh-own": "L_reh only, the policy's own steps (oracle-e trees)",
    "leafe-self": "LEAFE (self-taught e, after the reflector's rounds)",
}
"""The rows of the ``effect`` protocol: every row starts from the one shared warm start."""

ROLLOUT_KEYS = ("horizon", "history_window")
"""Keys of a room variant that set the rollout (not the environment): a variant may choose its
horizon and the history window of its prompts (chosen on validation with the room difficulty)."""

FULL_POWER = (64, 16)
"""The ``full`` scale's minimum test tasks x samples per row (the power requirement)."""


class ServingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The inference servers collection and evaluation run on."""

    servers: int = 1
    """CPU inference servers side by side (the client sends each request to the least loaded)."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Serving dtype (bf16 prefill is ~2x fp32 on this CPU, FACTS.md)."""
    threads: int = 1
    """Torch threads per server (1 per server on a shared 2-core machine)."""
    concurrency: int = 16
    """Episodes in flight (the server batches them)."""
    engines: list[str] = msgspec.field(default_factory=list)
    """External SGLang URLs (GPU); empty = CPU server processes (`services/inference/fleet.py`)."""
    collect_timeout_s: float = 3600.0
    """Longest one collection phase may run."""


class TrainingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``leafe train`` settings shared by every training phase."""

    preset: str = "cpu"
    """``leafe train`` preset (global batch 16 on ``cpu``)."""
    precision: Literal["auto", "bf16", "fp32"] = "bf16"
    """Trainer precision (bf16 autocast with fp32 masters on CPU; see the report's measurement)."""
    bucketing: Literal["pack", "length", "none"] = "pack"
    """Micro-batch layout (``pack``: sequence packing)."""
    global_batch: int = 0
    """Samples per optimizer step (0 = the preset's: 16 on ``cpu``)."""
    export_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of every exported checkpoint. fp32: a chain of trainings (GRPO rounds, LEAFE from GRPO)
    keeps its updates; a bf16 export rounds away any change under one bf16 ulp (~1e-4 for weights of
    ~0.03), and 2 Adam steps at lr 1e-5 changed only 1.4% of SmolLM2's bf16 weights in the small
    run."""
    max_steps: int = 0
    """Cap on the optimizer steps of every training but the warm start's (0 = none): only for the
    small scale's machinery check, where CPU time allows a few steps per method."""
    threads: int = 2
    """Torch threads of the ``leafe train`` / ``leafe replay`` children."""
    min_samples: int = 1
    """A training with fewer samples is not run and its row not evaluated (the report says why)."""
    keep_checkpoints: bool = False
    """Keep the trainer's DCP checkpoints (~1.6 GB each) after a training phase finished."""
    checkpoint_every: int = 100
    """A training phase writes a DCP checkpoint every N optimizer steps (only the latest is kept),
    so one cut by the end of a working period resumes there on the next invocation instead of from
    step 0 (a GRPO round's epoch is ~1,500 steps, ~4 h on 2 cores); 0 = only at the end. Resuming is
    exact (``learner/offline.py``: weights, AdamW, schedule and the epoch's sample order)."""


class ProbeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Cost probe of a second environment: Base on a few test tasks, to estimate its rows' cost."""

    env: str = ""
    """Environment of the probe (empty = no probe)."""
    env_options: Options = msgspec.field(default_factory=dict)
    """Its options."""
    tasks: int = 2
    """Test tasks probed."""
    samples: int = 2
    """Samples per task."""
    horizon: int = 2
    """Turns per episode."""


class PaperConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One paper-table experiment (see the module docstring for the task ranges)."""

    name: str
    """Scale name: run-id prefix ``pt-<name>``, work dir ``runs/paper/<name>``, logs under
    ``experiments/results/paper_logs/<name>/``."""
    extends: str = ""
    """A scale whose TOML this one's values override (``experiments/configs/paper_<extends>.toml``
    is read first)."""
    report_name: str = "paper_table"
    """File stem of the report under ``--results``."""
    protocol: Literal["table", "effect"] = "table"
    """``table``: the paper table (``experiments/paper/phases.py``); ``effect``: LEAFE's own effect
    from one shared warm start that acts on e (``experiments/paper/effect.py``)."""
    model: str = "smollm2-135m-instruct"
    """Base model (``leafe.learner.model_io.resolve_model``)."""
    env: str = "sokoban"
    """Environment registry name."""
    rows: list[str] = msgspec.field(default_factory=lambda: list(ROWS))
    """Rows produced (labels of :data:`ROWS`); phases no row needs are left out."""
    table3: bool = True
    """Run the Table 3 shape from Base + SFT (tree vs independent sampling vs iterative
    refinement)."""
    val_base: bool = True
    """Evaluate Base on the validation slice of every room variant (shows the room to improve)."""
    demo_offset: int = 0
    """First train index of the demonstrations."""
    train_offset: int = 1000
    """First train index of the RL tasks."""
    train_tasks: int = 8
    """RL tasks (GRPO, RFT, Stage 1, Table 3)."""
    val_offset: int = 2000
    """First train index of the validation slice."""
    val_tasks: int = 4
    """Validation tasks."""
    val_samples: int = 4
    """Samples per validation task."""
    test_offset: int = 0
    """First test index evaluated."""
    test_tasks: int = 4
    """Held-out test tasks per row."""
    eval_samples: int = 4
    """n of the Pass@k estimator on test."""
    ks: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4])
    """k values reported."""
    horizon: int = 8
    """Policy actions per rollout (training, validation and test)."""
    history_window: int = 2
    """Past steps in an action prompt (0 = all); reflections see the whole history."""
    seed: int = 0
    """Sampling seed of training-time episodes (sample s of task i: seed + 1000 i + s)."""
    val_seed: int = 777
    """Sampling seed of every validation evaluation (the same for every candidate: paired)."""
    eval_seed: int = 12345
    """Sampling seed of every test evaluation (the same for every row: paired comparisons)."""
    reseed_offset: int = 1_000_000
    """The noise-check row evaluates Base + SFT with ``eval_seed + reseed_offset``."""
    warm: WarmStartConfig = msgspec.field(default_factory=WarmStartConfig)
    """Base + SFT."""
    grpo: GrpoConfig = msgspec.field(default_factory=GrpoConfig)
    """GRPO rounds."""
    early: EarlyConfig = msgspec.field(default_factory=EarlyConfig)
    """Early Experience."""
    leafe: LeafeConfig = msgspec.field(default_factory=LeafeConfig)
    """LEAFE, L_reh, RFT."""
    serving: ServingConfig = msgspec.field(default_factory=ServingConfig)
    """Inference servers."""
    training: TrainingConfig = msgspec.field(default_factory=TrainingConfig)
    """Training children."""
    probe: ProbeConfig = msgspec.field(default_factory=ProbeConfig)
    """Cost probe of a second environment."""
    effect: EffectConfig = msgspec.field(default_factory=EffectConfig)
    """The ``effect`` protocol's settings (unused by ``table``)."""
    notes: str = ""
    """Free text printed in the report."""

    def __post_init__(self) -> None:
        require(
            self.name.replace("-", "").isalnum(),
            "name",
            self.name,
            "must be key-safe (letters, digits, -)",
        )
        known = self.row_names
        unknown = sorted(set(self.rows) - set(known))
        require(not unknown, "rows", unknown, f"unknown row(s); known: {', '.join(known)}")
        require(bool(self.rows), "rows", self.rows, "need at least one row")
        fair = sorted({"dagger", "reh-own", "leafe-self"} & set(self.rows))
        require(
            not fair or self.effect.own_rehearsal,
            "rows",
            fair,
            "the fair rows need effect.own_rehearsal = true",
        )
        require(
            "leafe-self" not in self.rows or self.effect.reflector_rounds >= 1,
            "rows",
            "leafe-self",
            "needs effect.reflector_rounds >= 1",
        )
        for field in ("demo_offset", "train_offset", "val_offset", "test_offset"):
            require(getattr(self, field) >= 0, field, getattr(self, field), "must be >= 0")
        for field in (
            "train_tasks",
            "val_tasks",
            "val_samples",
            "test_tasks",
            "eval_samples",
            "horizon",
        ):
            require(getattr(self, field) >= 1, field, getattr(self, field), "must be >= 1")
        ok = (
            bool(self.ks)
            and self.ks == sorted(set(self.ks))
            and 1 <= self.ks[0]
            and self.ks[-1] <= self.eval_samples
        )
        require(ok, "ks", self.ks, f"must be increasing, in 1..eval_samples ({self.eval_samples})")
        require(
            self.reseed_offset >= 1000 * self.test_tasks,
            "reseed_offset",
            self.reseed_offset,
            "overlaps seeds",
        )
        self._check_disjoint()

    def _check_disjoint(self) -> None:
        val = range(self.val_offset, self.val_offset + self.val_tasks)
        demos = range(self.demo_offset, self.demo_offset + max(self.warm.demo_counts))
        rl = range(self.train_offset, self.train_offset + self.train_tasks)
        ranges = [("demonstration", demos), ("RL", rl)]
        if self.protocol == "effect":
            fx = self.effect
            same = sorted(set(fx.rooms) & set(self.warm.variants))
            require(not same, "effect.rooms", same, "names already used by warm.variants")
            labels = range(fx.label_offset, fx.label_offset + fx.label_tasks)
            audit = range(fx.audit_offset, fx.audit_offset + fx.audit_tasks)
            ranges += [("label", labels), ("audit", audit)]
            for (na, a), (nb, b) in [(x, y) for i, x in enumerate(ranges) for y in ranges[i + 1 :]]:
                require(
                    not set(a) & set(b), "effect ranges", (na, nb), "train ranges must be disjoint"
                )
        for name, other in ranges:
            overlap = set(val) & set(other)
            require(
                not overlap,
                "val_offset",
                self.val_offset,
                f"the validation slice {val.start}..{val.stop - 1} overlaps the {name} tasks "
                f"{other.start}..{other.stop - 1} (train indices {sorted(overlap)[:3]}...)",
            )

    @property
    def row_names(self) -> dict[str, str]:
        """This protocol's rows: label -> the name the report prints."""
        return EFFECT_ROWS if self.protocol == "effect" else ROWS

    @property
    def prefix(self) -> str:
        """Run-id prefix of every run of this experiment."""
        return f"pt-{self.name}"

    def room_variant(self, name: str) -> Options:
        """A room variant's options, from the warm start's (``warm.variants``) or the rows'
        candidates (``effect.rooms``)."""
        known = {**self.warm.variants, **self.effect.rooms}
        if name not in known:
            raise KeyError(f"unknown room variant {name!r}; known: {', '.join(known)}")
        return known[name]

    @property
    def max_demos(self) -> int:
        """Demonstrations collected per room variant."""
        return max(self.warm.demo_counts)


def scale_path(scale: str) -> Path:
    """``experiments/configs/paper_<scale>.toml``; a missing one is an error listing the scales
    there are."""
    path = CONFIGS / f"paper_{scale}.toml"
    if not path.is_file():
        known = sorted(p.stem.removeprefix("paper_") for p in CONFIGS.glob("paper_*.toml"))
        raise ValueError(f"unknown scale {scale!r}: no {path}; known: {', '.join(known)}")
    return path


def _chain(path: Path) -> list[Path]:
    """``path`` after the TOML files its ``extends`` names, in the order they are read."""
    from leafe.services.config import read_toml

    out = [path]
    while parent := str(read_toml(str(out[0])).get("extends", "")):
        out.insert(0, scale_path(parent))
        if out[0] in out[1:]:
            raise ValueError(f"extends loops: {' -> '.join(str(p) for p in out)}")
    return out


def load_paper_config(path: Path, overrides: dict[str, Any] | None = None) -> PaperConfig:
    """The experiment in TOML ``path`` with dotted ``overrides`` on top (validated; errors name the
    field). A config named ``full`` must have the required power (:data:`FULL_POWER`)."""
    cfg = load_config(PaperConfig, files=_chain(path), overrides=overrides)
    tasks, samples = FULL_POWER
    if cfg.name == "full" and (cfg.test_tasks < tasks or cfg.eval_samples < samples):
        raise ValueError(
            f"full scale needs >= {tasks} test tasks x {samples} samples, got "
            f"{cfg.test_tasks} x {cfg.eval_samples} ({path})"
        )
    return cfg
