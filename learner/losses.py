"""Losses of Stage 2 (distillation) and of the GRPO baseline, as pure functions of tensors.

Shapes: ``logits [B, K, V]`` are the model's logits at the K positions that predict the K label
slots; ``labels [B, K]`` hold the target token id or :data:`IGNORE` (-100) for anything that is not
a target (prompt, history, padding). Only label slots != -100 contribute, whatever the logits there
are.

Normalisation (the paper's formula, token level): for each kind k, over the *global* batch (all
micro-batches and ranks of one optimizer step),

    L_k = sum_i w_i * sum_t nll_{i,t} / N_k        N_k = number of target tokens of kind k

so equal weights give the plain token mean of kind k, and ``Sample.weight`` scales a sample's share
(the denominator is *not* weighted, so weight 2 counts a sample twice). Then

    L = L_cf + beta * L_reh + L_rft + L_grpo

``rft`` is plain SFT (its own token mean): it is the term of every imitation kind, rejection-sampled
rollouts (``rft``), demonstrations (``sft``) and Early Experience (``iwm``, ``sr``); see
:data:`LOSS_TERM`. Each micro-batch returns its *share* of L (its token sums divided by the global
N_k), so the shares summed over micro-batches and ranks give exactly L, however the batch is split.
GRPO, token-level mean over the group's completion tokens:

    r = exp(logp - logp_behaviour),  pg = -min(r * A, clip(r, 1-eps, 1+eps) * A)
    k3 = exp(ref - logp) - (ref - logp) - 1            (only with a reference model and kl_coef > 0)

Missing behaviour logprobs mean on-policy data: logp_behaviour = logp.detach() (r = 1, gradient A *
dlogp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "IGNORE",
    "KINDS",
    "KIND_INDEX",
    "LOSS_TERM",
    "KindTokens",
    "LossOutput",
    "distill_loss",
    "grpo_loss",
    "token_logprobs",
    "total_loss",
]

IGNORE = -100
"""Label of a position that carries no loss."""
KINDS = ("cf", "reh", "rft", "grpo")
KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
"""Loss term name -> integer code used in batch tensors."""
LOSS_TERM = {
    "cf": "cf",
    "reh": "reh",
    "rft": "rft",
    "sft": "rft",
    "iwm": "rft",
    "sr": "rft",
    "grpo": "grpo",
}
"""Sample kind -> the loss term it trains (imitation kinds share the plain SFT term)."""


@dataclass(frozen=True)
class KindTokens:
    """Target-token counts per kind over the global batch: the denominators N_k."""

    cf: float = 0.0
    reh: float = 0.0
    rft: float = 0.0
    grpo: float = 0.0

    def as_list(self) -> list[float]:
        """Counts in :data:`KINDS` order."""
        return [self.cf, self.reh, self.rft, self.grpo]


@dataclass
class LossOutput:
    """A micro-batch's share of the loss and detached sums for logging."""

    loss: Tensor
    """Scalar share of L (sum over micro-batches and ranks = L)."""
    nll_sum: list[float] = field(default_factory=lambda: [0.0] * len(KINDS))
    """Weighted NLL sums per kind (divide by N_k for the per-kind loss)."""
    grpo_stats: dict[str, float] = field(default_factory=dict)
    """GRPO sums: ``pg``, ``kl``, ``clipped`` tokens (PPO clip or dual clip), ``capped`` tokens
    (dual clip only), ``ratio`` (divide by N_grpo)."""


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) per slot in fp32, exactly 0.0 where ``labels == IGNORE`` (no gradient flows
    there)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    mask = labels != IGNORE
    safe = labels.clamp(min=0)
    logits = logits.float()
    picked = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logp = picked - torch.logsumexp(logits, dim=-1)
    return torch.where(mask, logp, torch.zeros_like(logp))


def _coefficients(kinds: Tensor, tokens: KindTokens, beta: float) -> Tensor:
    """Per-sample coefficient 1/N_k (beta/N_reh for rehearsal, 0 for GRPO and for empty kinds)."""
    scale = [beta if k == "reh" else 1.0 for k in KINDS[:3]]
    coef = [s / n if n > 0 else 0.0 for s, n in zip(scale, tokens.as_list()[:3], strict=True)] + [
        0.0
    ]
    return torch.tensor(coef, dtype=torch.float32, device=kinds.device)[kinds]


def distill_loss(
    logp: Tensor, labels: Tensor, kinds: Tensor, weights: Tensor, tokens: KindTokens, beta: float
) -> LossOutput:
    """Share of L_cf + beta * L_reh + L_rft in this micro-batch (GRPO rows contribute 0 here)."""
    mask = (labels != IGNORE).float()
    nll_per_sample = -(logp * mask).sum(dim=-1)
    weighted = nll_per_sample * weights.float()
    loss = (weighted * _coefficients(kinds, tokens, beta)).sum()
    sums = [0.0] * len(KINDS)
    for k in range(3):
        sel = kinds == k
        if bool(sel.any()):
            sums[k] = float(weighted[sel].sum().detach())
    return LossOutput(loss=loss, nll_sum=sums)


def grpo_loss(
    logp: Tensor,
    labels: Tensor,
    kinds: Tensor,
    weights: Tensor,
    advantages: Tensor,
    behaviour_logp: Tensor,
    has_behaviour: Tensor,
    tokens: KindTokens,
    *,
    clip_eps: float,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    dual_clip: float = 0.0,
) -> LossOutput:
    """Share of the clipped-ratio GRPO objective (+ kl_coef * k3) over this micro-batch's GRPO
    tokens.

    ``dual_clip`` = c > 1 bounds the objective of a negative-advantage token at c * |A| (dual-clip
    PPO, Ye et al. 2020): without it a token the behaviour policy sampled at a tiny probability
    contributes ratio * |A| without limit; 0 leaves the plain clipped objective."""
    if dual_clip and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be 0 (off) or > 1, got {dual_clip}")
    sel = ((labels != IGNORE) & (kinds == KIND_INDEX["grpo"]).unsqueeze(-1)).float()
    if tokens.grpo <= 0:
        return LossOutput(loss=(logp * 0.0).sum())
    old = torch.where(has_behaviour.unsqueeze(-1), behaviour_logp.float(), logp.detach())
    ratio = torch.exp(logp - old)
    adv = advantages.float().unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    was_clipped = unclipped != clipped
    capped = torch.zeros_like(was_clipped)
    if dual_clip:
        capped = (adv < 0) & (surrogate < dual_clip * adv)
        surrogate = torch.where(capped, dual_clip * adv, surrogate)
        was_clipped = was_clipped | capped
    per_token = -surrogate
    pg_sum = (per_token * sel).sum()
    kl_sum = torch.zeros((), device=logp.device)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp.float() - logp
        kl_sum = ((torch.exp(d) - d - 1.0) * sel).sum()
    w = weights.float().unsqueeze(-1)
    loss = ((per_token * w * sel).sum() + kl_coef * kl_sum) / tokens.grpo
    stats = {
        "pg": float(pg_sum.detach()),
        "kl": float(kl_sum.detach()),
        "clipped": float((was_clipped.float() * sel).sum()),
        "capped": float((capped.float() * sel).sum()),
        "ratio": float((ratio.detach() * sel).sum()),
    }
    return LossOutput(loss=loss, grpo_stats=stats)


def total_loss(
    logp: Tensor,
    labels: Tensor,
    kinds: Tensor,
    weights: Tensor,
    advantages: Tensor,
    behaviour_logp: Tensor,
    has_behaviour: Tensor,
    tokens: KindTokens,
    *,
    beta: float,
    clip_eps: float,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    dual_clip: float = 0.0,
) -> LossOutput:
    """Distillation share + GRPO share of one micro-batch."""
    d = distill_loss(logp, labels, kinds, weights, tokens, beta)
    g = grpo_loss(
        logp,
        labels,
        kinds,
        weights,
        advantages,
        behaviour_logp,
        has_behaviour,
        tokens,
        clip_eps=clip_eps,
        ref_logp=ref_logp,
        kl_coef=kl_coef,
        dual_clip=dual_clip,
    )
    nll = list(d.nll_sum)
    nll[KIND_INDEX["grpo"]] = g.grpo_stats.get("pg", 0.0)
    return LossOutput(loss=d.loss + g.loss, nll_sum=nll, grpo_stats=g.grpo_stats)
