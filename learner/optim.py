"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine to a floor).

The schedule is a pure function of the step (:func:`lr_factor`), wrapped in a ``LambdaLR`` so its
state (the step count) is checkpointed with the optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from leafe.learner.config import OptimConfig

__all__ = ["build_optimizer", "lr_factor"]


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based: the step about to be taken)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.total_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over the trainable parameters (no foreach on DTensors mixing devices) and its
    scheduler."""
    if cfg.lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {cfg.lr}")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler
