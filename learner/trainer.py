"""The FSDP2 trainer: one optimizer step per global batch of samples, on 1..N ranks.

Every rank receives the *same* global batch (offline: same shards and seed; online: rank 0 decides)
and takes its deterministic share of each micro-batch
(:func:`leafe.learner.batching.plan_micro_batches`). A micro-batch's loss is its share of the global
loss (token sums over the global token counts, see ``learner/losses.py``), multiplied by
``world_size`` because FSDP averages gradients over ranks; so 1 rank and N ranks compute the same
gradient up to float rounding. Gradients are reduce-scattered only on the last micro-batch of the
step. Micro-batches are left-padded rows or packed rows (``TrainerConfig.batch.bucketing``);
precision bf16 keeps fp32 master weights (``learner/fsdp.py``).

    with distributed_env() as env:
        trainer = Trainer(TrainerConfig(), tiny_model_dir(), env)
        stats = trainer.train_step(samples)  # StepStats: loss, per-kind losses, tokens, lr ...
        trainer.export(store / "v000001", version="v000001")

Run multi-rank with ``torchrun --nproc_per_node=2 -m leafe.services.learner.train ...``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch
from torch import Tensor, nn

from leafe.learner.batching import (
    MicroBatch,
    TrainItem,
    collate,
    collate_packed,
    kind_tokens,
    plan_micro_batches,
    to_items,
)
from leafe.learner.config import TrainerConfig
from leafe.learner.distributed import DistEnv, all_reduce_sum, barrier
from leafe.learner.fsdp import autocast, build_model, full_state_dict, resolve_precision
from leafe.learner.linear_logprobs import CHUNK_TOKENS, sample_logprobs
from leafe.learner.losses import KIND_INDEX, KindTokens, LossOutput, total_loss
from leafe.learner.memory import pin_mmap_threshold, reuse_freed_memory
from leafe.learner.model_io import export_weights, load_tokenizer
from leafe.learner.optim import build_optimizer
from leafe.learner.recompute import recompute_in_backward
from leafe.protocol.samples import Sample

__all__ = ["StepStats", "StepSums", "Trainer"]

log = structlog.get_logger(__name__)


class StepStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one optimizer step did (identical on every rank)."""

    step: int
    """Optimizer steps taken so far (this one included)."""
    loss: float
    """L for the global batch."""
    loss_cf: float | None
    """Token-mean NLL of counterfactual targets (None when the batch had none)."""
    loss_reh: float | None
    """Token-mean NLL of rehearsal targets."""
    loss_rft: float | None
    """Token-mean NLL of RFT targets."""
    loss_grpo: float | None
    """Token-mean clipped policy-gradient term (KL excluded)."""
    kl: float | None
    """Token-mean k3 KL to the reference (GRPO with kl_coef > 0)."""
    clip_frac: float | None
    """Fraction of GRPO tokens whose ratio was clipped."""
    ratio: float | None = None
    """Mean importance ratio exp(logp - logp_behaviour) over GRPO tokens (1.0 when on-policy)."""
    dual_clipped: int = 0
    """GRPO tokens whose objective the dual clip capped (``loss.dual_clip``: ratio > c on A < 0)."""
    samples: int
    """Samples trained."""
    skipped: int
    """Samples skipped as unusable (too long, empty, malformed, an id outside the vocabulary; see
    ``leafe.learner.batching.unusable``)."""
    target_tokens: int
    """Tokens with loss."""
    real_tokens: int
    """Non-pad tokens processed."""
    padded_tokens: int
    """Tokens processed including padding (rows x row length, summed over micro-batches and
    ranks)."""
    micro_batches: int
    """Micro-batches per rank."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for this step."""
    seconds: float
    """Wall time of the step."""


@dataclass
class StepSums:
    """Sums over a step's micro-batches (then over ranks): the numerators of :class:`StepStats`."""

    loss: float = 0.0
    """Shares of L."""
    nll_cf: float = 0.0
    """Weighted NLL of counterfactual targets."""
    nll_reh: float = 0.0
    """Weighted NLL of rehearsal targets."""
    nll_rft: float = 0.0
    """Weighted NLL of RFT targets."""
    pg_grpo: float = 0.0
    """Clipped policy-gradient term over GRPO tokens."""
    kl: float = 0.0
    """k3 KL over GRPO tokens."""
    clipped: float = 0.0
    """GRPO tokens whose ratio was clipped."""
    ratio: float = 0.0
    """Importance ratios over GRPO tokens."""
    capped: float = 0.0
    """GRPO tokens the dual clip capped."""
    real_tokens: float = 0.0
    """Non-pad tokens processed."""
    padded_tokens: float = 0.0
    """Tokens processed including padding."""

    @classmethod
    def of(cls, out: LossOutput, mb: MicroBatch) -> StepSums:
        """One micro-batch's sums."""
        cf, reh, rft, pg = out.nll_sum
        g = out.grpo_stats
        return cls(
            loss=float(out.loss.detach()),
            nll_cf=cf,
            nll_reh=reh,
            nll_rft=rft,
            pg_grpo=pg,
            kl=g.get("kl", 0.0),
            clipped=g.get("clipped", 0.0),
            ratio=g.get("ratio", 0.0),
            capped=g.get("capped", 0.0),
            real_tokens=float(mb.real_tokens),
            padded_tokens=float(mb.padded_tokens),
        )

    def __add__(self, other: StepSums) -> StepSums:
        return StepSums(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def all_reduce(self, env: DistEnv) -> StepSums:
        """Field-wise sum over ranks (every rank must call)."""
        return StepSums(*all_reduce_sum(env, list(astuple(self))))


def _pad_id(model_dir: Path) -> int:
    tok = load_tokenizer(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None:
        raise ValueError(f"tokenizer of {model_dir} has neither a pad nor an eos token")
    return int(pad)


def _mean(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class Trainer:
    """FSDP2 model + AdamW + schedule; :meth:`train_step` runs one optimizer step."""

    chunk_tokens = CHUNK_TOKENS
    """Target positions per chunk of the LM head's projection and log-softmax."""

    def __init__(self, config: TrainerConfig, model_dir: Path, env: DistEnv) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self.env = env
        self.precision = resolve_precision(config.precision, env)  # "bf16" | "fp32" on this device
        torch.manual_seed(config.seed)
        self.model = build_model(
            self.model_dir,
            env,
            precision=config.precision,
            reshard_after_forward=config.reshard_after_forward,
        )
        if config.activation_checkpointing:
            self.model.activation_checkpointing_enable()  # type: ignore[operator]
        elif config.recompute != "none":
            recompute_in_backward(self.model, config.recompute)
        if config.release_freed_memory:
            pin_mmap_threshold()  # freed activations go back to the OS (learner/memory.py)
        elif (
            config.reuse_freed_memory and not reuse_freed_memory()
        ):  # freed blocks reused: no page faults
            log.warning(
                "learner.allocator.unchanged",
                reason="not glibc, or mallopt refused: freed memory is not kept",
            )
        self.reference: nn.Module | None = None
        if config.loss.kl_coef > 0:
            self.reference = build_model(
                self.model_dir, env, precision=config.precision, trainable=False
            )
        self.optimizer, self.scheduler = build_optimizer(self.model, config.optim)
        self.pad_id = _pad_id(self.model_dir)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.vocab_size: int = getattr(self.model.config, "vocab_size")  # noqa: B009 (Module attrs are untyped)
        """Embedding rows: a sample with an id outside ``0..vocab_size-1`` is skipped
        (``batching.unusable``)."""
        self.step = 0

    def _logp(self, model: nn.Module, mb: MicroBatch) -> Tensor:
        # chunk by chunk: never the [N, V] logits of the micro-batch's N target positions
        return sample_logprobs(model, mb, chunk_tokens=self.chunk_tokens)

    def _collate(self, items: Sequence[TrainItem]) -> MicroBatch:
        if self.config.batch.bucketing == "pack":
            return collate_packed(
                items, self.pad_id, self.env.device, share_prefix=self.config.batch.share_prefix
            )
        return collate(items, self.pad_id, self.env.device)

    def _micro_step(self, mb: MicroBatch, tokens: KindTokens) -> StepSums:
        with autocast(self.precision, self.env, cache=not self.config.activation_checkpointing):
            logp = self._logp(self.model, mb)
            ref_logp = None
            if self.reference is not None and bool((mb.kinds == KIND_INDEX["grpo"]).any()):
                with torch.no_grad():
                    ref_logp = self._logp(self.reference, mb)
        out = total_loss(
            logp,
            mb.labels,
            mb.kinds,
            mb.weights,
            mb.advantages,
            mb.behaviour_logp,
            mb.has_behaviour,
            tokens,
            beta=self.config.loss.beta,
            clip_eps=self.config.loss.clip_eps,
            ref_logp=ref_logp,
            kl_coef=self.config.loss.kl_coef,
            dual_clip=self.config.loss.dual_clip,
        )
        # FSDP averages gradients over ranks; each share is a part of a global *sum*.
        (out.loss * self.env.world_size).backward()
        return StepSums.of(out, mb)

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """One optimizer step on ``samples`` (the whole global batch; every rank passes the same
        list)."""
        t0 = time.perf_counter()
        items, skipped = to_items(samples, self.config.batch.max_seq_len, self.vocab_size)
        if skipped:
            log.warning(
                "learner.samples.skipped",
                count=len(skipped),
                first=skipped[0][0],
                reason=skipped[0][1],
            )

        tokens = kind_tokens(items)
        plan = plan_micro_batches(items, self.env.world_size, self.config.batch)
        dropped = {sid for sid, _ in skipped}
        used = [s for s in samples if s.sample_id not in dropped]
        scale = self._lr_scale(len(items)) * self._kind_scale(used)
        lr = float(self.scheduler.get_last_lr()[0]) * scale
        sums = StepSums()
        for m, shares in enumerate(plan):
            mb = self._collate([items[i] for i in shares[self.env.rank]])
            self.model.set_requires_gradient_sync(m == len(plan) - 1)  # type: ignore[operator]
            sums += self._micro_step(mb, tokens)
        grad_norm = 0.0
        if plan:
            grad_norm = self._clip_and_step(scale)  # == lr above / the schedule's
        sums = sums.all_reduce(self.env)
        return self._stats(
            sums, tokens, items, skipped, len(plan), grad_norm, lr, time.perf_counter() - t0
        )

    def _lr_scale(self, samples: int) -> float:
        """``samples / global_batch`` for a partial batch when ``scale_partial_batches``, else 1."""
        full = self.config.batch.global_batch
        if not self.config.optim.scale_partial_batches or samples >= full:
            return 1.0
        return samples / full

    def _kind_scale(self, samples: Sequence[Sample]) -> float:
        """Mean of ``lr_by_kind[kind] / lr`` over the step's samples (1 when ``lr_by_kind`` is
        empty)."""
        optim = self.config.optim
        if not optim.lr_by_kind or not samples:
            return 1.0
        return sum(optim.lr_by_kind.get(s.kind, optim.lr) / optim.lr for s in samples) / len(
            samples
        )

    def _clip_and_step(self, lr_scale: float = 1.0) -> float:
        max_norm = self.config.optim.max_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if lr_scale != 1.0:  # this step only: the schedule's own lr is restored before it advances
            for group in self.optimizer.param_groups:
                group["lr"] *= lr_scale
        self.optimizer.step()
        if lr_scale != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] /= lr_scale
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(full)

    def _stats(
        self,
        sums: StepSums,
        tokens: KindTokens,
        items: Sequence[Any],
        skipped: Sequence[tuple[str, str]],
        micro: int,
        grad_norm: float,
        lr: float,
        seconds: float,
    ) -> StepStats:
        return StepStats(
            step=self.step,
            loss=sums.loss,
            loss_cf=_mean(sums.nll_cf, tokens.cf),
            loss_reh=_mean(sums.nll_reh, tokens.reh),
            loss_rft=_mean(sums.nll_rft, tokens.rft),
            loss_grpo=_mean(sums.pg_grpo, tokens.grpo),
            kl=_mean(sums.kl, tokens.grpo) if self.reference is not None else None,
            clip_frac=_mean(sums.clipped, tokens.grpo),
            ratio=_mean(sums.ratio, tokens.grpo),
            dual_clipped=int(sums.capped),
            samples=len(items),
            skipped=len(skipped),
            target_tokens=int(sum(tokens.as_list())),
            real_tokens=int(sums.real_tokens),
            padded_tokens=int(sums.padded_tokens),
            micro_batches=micro,
            grad_norm=grad_norm,
            lr=lr,
            seconds=seconds,
        )

    def export_state(self) -> dict[str, Tensor]:
        """Full fp32 weights on CPU on rank 0 (``{}`` on other ranks; every rank must call)."""
        return full_state_dict(self.model, tied=self.tied)

    def export(
        self,
        out_dir: Path,
        *,
        version: str,
        dtype: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Gather the full weights and write an HF export + manifest on rank 0; returns its sha256.

        Every rank must call it; non-zero ranks return ``""`` after the export is on disk.
        """
        sd = self.export_state()
        digest = ""
        if self.env.is_main:
            torch_dtype = (
                torch.bfloat16 if (dtype or self.config.export_dtype) == "bf16" else torch.float32
            )
            digest = export_weights(
                sd,
                Path(out_dir),
                config_dir=self.model_dir,
                version=version,
                dtype=torch_dtype,
                extra=extra,
            )
        barrier(self.env)
        return digest
