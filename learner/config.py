"""Typed configuration of the learner (online service) and the trainer (offline and online), with
presets.

A run starts from a preset and overrides fields from TOML (``leafe.services.config.load_config``)::

    # leafe train --preset paper
    load_config(TrainConfig, preset=train_preset("paper"), files=["my.toml"])
    # leafe learner --preset cpu
    load_config(LearnerConfig, preset=learner_preset("cpu"))

Presets (functions returning configs, not flag piles):
- ``paper``: the paper's Stage-2 hyperparameters: lr 1e-6, global batch 128 samples, 2 epochs
  offline (the paper reports 2-3), bf16 on GPU.
- ``cpu``: the same losses and cadence at a scale a 2-core CPU can step through with SmolLM2-135M or
  the tiny test model: global batch 16, lr 1e-5, packed 2048-token rows, frequent pushes, precision
  ``auto`` (bf16 on CPUs with bf16 dot products). Packing + bf16 train SmolLM2 2.8x faster than fp32
  length buckets on one Zen core (``bench/results/learner.json``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from leafe.protocol.config import ConfigError

__all__ = [
    "PRESETS",
    "BatchConfig",
    "LearnerConfig",
    "LossConfig",
    "OptimConfig",
    "TrainConfig",
    "TrainerConfig",
    "cpu_preset",
    "learner_preset",
    "paper_preset",
    "train_preset",
]


class LossConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """L = L_cf + beta * L_reh + L_rft + L_grpo (each term a token mean over its kind in the global
    batch)."""

    beta: float = 1.0
    """Weight of the rehearsal term (the paper does not publish beta; 1.0 = equal weight)."""
    clip_eps: float = 0.2
    """GRPO: PPO-style clip range of the importance ratio, [1 - eps, 1 + eps]."""
    kl_coef: float = 0.0
    """GRPO: coefficient of the k3 KL estimate to the frozen initial model; 0 disables the
    reference."""
    dual_clip: float = 3.0
    """GRPO: dual-clip bound c > 1 on a negative-advantage token's objective (c * |A|, dual-clip
    PPO's c = 3): a token the behaviour policy sampled at a tiny probability can no longer give a
    step an unbounded loss (a rebuilt GRPO round had one step at loss 56 from an importance ratio of
    57 on a negative advantage). It changes only tokens with A < 0 and ratio > c, so steps near the
    behaviour policy are bit for bit those of the plain objective; 0 = off, the objective every
    GRPO record before issue 62 was trained with."""

    def __post_init__(self) -> None:
        if self.dual_clip and not self.dual_clip > 1.0:
            raise ValueError(f"loss.dual_clip must be 0 (off) or > 1, got {self.dual_clip}")


class OptimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """AdamW with warmup then a constant or cosine schedule, and global-norm gradient clipping."""

    lr: float = 1e-6
    """Peak learning rate (paper: 1e-6)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: keep ``lr`` (online default) or cosine-decay to ``min_lr_ratio * lr`` at
    ``total_steps``."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of ``lr``."""
    total_steps: int = 0
    """Steps of the cosine schedule; 0 = the offline trainer computes it from the data and
    epochs."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    scale_partial_batches: bool = False
    """A step on fewer samples than ``global_batch`` uses ``lr * samples / global_batch``. AdamW's
    step size does not shrink with the batch, so without this one sample taken after
    ``max_batch_wait_s`` moves the weights as far as a full batch, in a far noisier direction. Off
    for offline training (only an epoch's last batch is partial; reproductions stay bit-identical);
    on in ``leafe run``'s warm-start presets."""
    lr_by_kind: dict[str, float] = msgspec.field(default_factory=dict)
    """Peak lr per sample kind (``sft``, ``cf``, ``reh``, ``grpo``, ...), for one online run that
    trains phases the offline protocol trains with different lrs (the warm start's ``sft`` at 5e-5,
    then LEAFE at 3e-5 or GRPO at 1e-5). A step's lr is the schedule's times the mean of
    ``lr_by_kind[kind] / lr`` over its samples (kinds not listed: 1). Empty = one lr for every
    kind."""

    def __post_init__(self) -> None:
        from leafe.learner.losses import LOSS_TERM

        bad = {k: v for k, v in self.lr_by_kind.items() if k not in LOSS_TERM or not v > 0}
        if bad:
            raise ValueError(
                f"optim.lr_by_kind {bad}: every key must be a sample kind ({', '.join(LOSS_TERM)}) "
                "and every lr > 0"
            )


class BatchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How samples become optimizer steps and micro-batches."""

    global_batch: int = 128
    """Samples per optimizer step, over all ranks (paper: 128); gradients accumulate over
    micro-batches."""
    micro_batch_tokens: int = 8192
    """``length`` mode: max padded tokens (rows x longest row) per rank per micro-batch; ``pack``
    mode: max tokens of the one packed row a rank runs per micro-batch (a longer sample gets a row
    of its own)."""
    micro_batch_size: int = 8
    """``none`` mode: samples per rank per micro-batch, in arrival order."""
    bucketing: Literal["pack", "length", "none"] = "length"
    """``pack``: several samples per row (first-fit decreasing up to ``micro_batch_tokens``),
    positions restarting at 0 per sample and causal attention within each sample only (no padding,
    no cross-sample attention; ``learner/attention.py``); ``length``: sort the global batch by
    length and fill left-padded micro-batches up to the token budget; ``none``: fixed-size
    micro-batches in arrival order (the naive baseline). The step's math is the same in every mode:
    the whole global batch is accumulated."""
    max_seq_len: int = 4096
    """Samples with more prompt + completion tokens are skipped (logged and counted), never
    truncated."""
    share_prefix: bool = False
    """``pack`` mode: the prompt prefix every sample of a step shares (the system prompt, the task's
    rules) is put once at the head of each packed row, and each sample's rest attends to it and to
    itself (``learner/attention.py``): the same logits and gradients as the samples in full, up to
    the order of float sums, for fewer tokens through the model (an agent's one-action samples are
    ~60% shared prefix)."""


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the FSDP trainer needs, shared by ``leafe train`` and ``leafe learner``."""

    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    """Loss coefficients."""
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    """Batching."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """``bf16``: bf16 compute with fp32 master weights, gradients and AdamW state (on GPU FSDP's
    MixedPrecisionPolicy, on CPU bf16 autocast; see ``learner/fsdp.py``); ``auto``: bf16 on GPU and
    on CPUs with native bf16 dot products (AVX512-BF16 or AMX), fp32 on other CPUs."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (saves memory, re-gathers in backward)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input from the forward and recompute the layer in the backward
    (transformers' ``activation_checkpointing_enable``): one more forward of compute for much less
    memory (``bench/learner_memory.py``; figures in docs/benchmarks.md, section "The learner's
    memory"). Off by default on CPU, where step time is the constraint; turn it on where memory is
    (a 7B policy on GPU)."""
    recompute: Literal["none", "mlp", "self_attn"] = "none"
    """Selective recompute (``learner/recompute.py``): keep only the input of every decoder layer's
    MLP (``"mlp"``) or attention block (``"self_attn"``) from the forward and run that part again in
    the backward; less memory than keeping everything for less extra compute than
    ``activation_checkpointing`` (which recomputes whole layers and overrides this). The same
    arithmetic: losses and gradients do not change."""
    release_freed_memory: bool = False
    """Pin glibc's mmap threshold (``learner/memory.py``) so freed activation blocks go back to the
    OS at once: a lower peak RSS for many more page faults, whose kernel time makes every step
    markedly slower (figures in docs/benchmarks.md, section "The learner's memory"). Off by
    default; turn it on where memory binds, with ``activation_checkpointing``."""
    reuse_freed_memory: bool = True
    """Unless ``release_freed_memory``: turn glibc's ``mmap`` off for the learner's process so every
    block comes from the heap and a freed one is reused without page faults (``learner/memory.py``).
    GRPO steps run faster at the same peak RSS with identical losses (figures in docs/benchmarks.md,
    section "The learner's page faults"). The allocator changes no arithmetic; process-wide and not
    undone."""
    seed: int = 0
    """Seed of torch RNG and of the offline shuffle."""
    checkpoint_every: int = 50
    """Write a DCP checkpoint every N optimizer steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept; older ones are deleted after a new one is written."""
    push_every: int = 50
    """Export weights and publish ``WeightsPublished`` every N steps; 0 = never (offline: only at
    the end)."""
    export_dtype: Literal["bf16", "fp32"] = "bf16"
    """dtype of exported safetensors (``fp32`` keeps full precision, e.g. for exact comparisons)."""
    retain_versions: int = 3
    """Weight versions kept in the store; older ones are pruned (never the newest nor one in
    use)."""


class LearnerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The online learner service (``leafe learner``): samples stream -> steps -> checkpoints ->
    pushes."""

    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """Trainer settings."""
    durable: str = ""
    """Durable consumer name on ``LEAFE_SAMPLES``; empty = ``learner-<run>`` (durable names are per
    stream, which all runs share)."""
    kinds: list[str] = msgspec.field(default_factory=lambda: ["cf", "reh"])
    """Sample kinds trained (subjects ``leafe.<run>.samples.<kind>``): ``cf``+``reh`` for LEAFE,
    ``grpo`` or ``rft`` for the baselines."""
    fetch_batch: int = 256
    """Messages per pull request."""
    ack_wait_s: float = 60.0
    """Consumer AckWait; held messages are kept alive with in-progress acks every third of it."""
    max_ack_pending: int = 4096
    """Consumer bound on unacknowledged messages; a checkpoint is forced before this is reached."""
    max_batch_wait_s: float = 30.0
    """A partial global batch of at least ``min_batch`` samples is trained once its oldest sample
    waited this long."""
    min_batch: int = 0
    """Smallest partial batch trained after ``max_batch_wait_s``, counting only samples that would
    be trained (not stale, of a trained kind); 0 = the global batch: no step on a handful of
    samples, because AdamW's normalised step moves the weights as far on 1 sample as on a full batch
    (an online LEAFE run took 38 of its 53 steps on 1-4 samples, one at loss 1.04 and gradient norm
    27.8). The stream's tail is trained when ``leafe run`` asks for it (the control file's
    ``flush``: a continuous warm start's end, the drain), as ``leafe train`` trains an epoch's last
    partial batch. Set 1 for the old behaviour (any partial batch after the wait)."""
    max_policy_lag: int | None = 4
    """Drop samples whose ``policy_version`` is more than this many versions behind the learner's
    (counted and logged); None keeps every sample."""
    stop_after_steps: int = 0
    """Stop (after a final checkpoint) once this many steps were taken in this process; 0 = run
    forever."""
    push_on_stop: bool = True
    """On a graceful stop, push the weights if steps were taken since the last push (so the final
    weights are always served and evaluable); False leaves them in the checkpoint only."""


class TrainConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Offline training on dataset shards (``leafe train``)."""

    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """Trainer settings."""
    epochs: int = 2
    """Passes over the data (paper: 2-3)."""
    shuffle: bool = True
    """Shuffle samples each epoch (seeded by ``trainer.seed`` and the epoch: resumable)."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total; 0 = run all epochs."""
    drop_last: bool = False
    """Drop an epoch's final partial global batch instead of training on it."""


def paper_preset() -> TrainConfig:
    """The paper's Stage-2 settings (lr 1e-6, batch 128, 2 epochs), bf16 on GPU."""
    return TrainConfig(
        trainer=TrainerConfig(
            optim=OptimConfig(lr=1e-6, warmup_steps=10, schedule="cosine"),
            batch=BatchConfig(global_batch=128),
        ),
        epochs=2,
    )


def cpu_preset() -> TrainConfig:
    """Same losses at CPU scale: batch 16, lr 1e-5, packed 2048-token rows, push every 10 steps."""
    return TrainConfig(
        trainer=TrainerConfig(
            optim=OptimConfig(lr=1e-5, warmup_steps=2, schedule="constant"),
            batch=BatchConfig(
                global_batch=16,
                micro_batch_tokens=2048,
                micro_batch_size=4,
                max_seq_len=2048,
                bucketing="pack",
            ),
            precision="auto",
            checkpoint_every=10,
            push_every=10,
        ),
        epochs=2,
    )


PRESETS = {"paper": paper_preset, "cpu": cpu_preset}
"""Preset name -> function returning a :class:`TrainConfig`."""


def train_preset(name: str) -> TrainConfig:
    """The named offline preset; an unknown name is a :class:`ConfigError` listing the known
    ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown trainer preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def learner_preset(name: str) -> LearnerConfig:
    """The online learner's defaults with the named preset's trainer settings."""
    return LearnerConfig(trainer=train_preset(name).trainer)
