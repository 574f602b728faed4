"""Unit tests of learner/losses.py: masking, per-kind normalisation, beta, weights, GRPO clipping
and KL."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leafe.learner.config import LossConfig
from leafe.learner.losses import (
    IGNORE,
    KIND_INDEX,
    KindTokens,
    distill_loss,
    grpo_loss,
    token_logprobs,
    total_loss,
)

V = 11


def _setup(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, V, generator=g)
    labels = torch.full((3, 5), IGNORE)
    labels[0, 3:] = torch.tensor([1, 2])
    labels[1, 1:] = torch.tensor([3, 4, 5, 6])
    labels[2, 4:] = torch.tensor([7])
    return logits, labels


def _sft(
    logits: torch.Tensor, labels: torch.Tensor, kinds: list[str], beta: float = 1.0
) -> torch.Tensor:
    k = torch.tensor([KIND_INDEX[x] for x in kinds])
    counts = {
        name: float((labels[k == KIND_INDEX[name]] != IGNORE).sum())
        for name in ("cf", "reh", "rft")
    }
    tokens = KindTokens(**counts)
    return distill_loss(
        token_logprobs(logits, labels), labels, k, torch.ones(len(kinds)), tokens, beta
    ).loss


def test_masked_positions_never_change_the_loss() -> None:
    """Changing logits at masked positions (prompt, history, padding) leaves the loss unchanged."""
    logits, labels = _setup()
    before = _sft(logits, labels, ["cf", "cf", "reh"])
    changed = logits.clone()
    changed[labels == IGNORE] = torch.randn(int((labels == IGNORE).sum()), V) * 50
    assert torch.allclose(before, _sft(changed, labels, ["cf", "cf", "reh"]))


def test_gradient_is_zero_at_masked_positions() -> None:
    """Only target slots receive gradient."""
    logits, labels = _setup()
    logits.requires_grad_(True)
    _sft(logits, labels, ["cf", "reh", "rft"]).backward()
    assert logits.grad is not None
    assert torch.all(logits.grad[labels == IGNORE] == 0)
    assert torch.all(logits.grad[labels != IGNORE].abs().sum(-1) > 0)


def test_target_tokens_do_count() -> None:
    """Changing a target token changes the loss (the mask does not hide targets)."""
    logits, labels = _setup()
    other = labels.clone()
    other[1, 2] = 9
    assert not torch.allclose(_sft(logits, labels, ["cf"] * 3), _sft(logits, other, ["cf"] * 3))


def test_cf_and_reh_are_token_means_combined_with_beta() -> None:
    """L = mean NLL over cf target tokens + beta * mean NLL over reh target tokens."""
    logits, labels = _setup()
    logp = token_logprobs(logits, labels)
    nll = -(logp.sum(-1))
    cf_mean = (nll[0] + nll[1]) / 6  # 2 + 4 cf target tokens
    reh_mean = nll[2] / 1
    got = _sft(logits, labels, ["cf", "cf", "reh"], beta=0.3)
    assert torch.allclose(got, cf_mean + 0.3 * reh_mean)


def test_sample_weight_scales_its_share_only() -> None:
    """Weight 2 doubles a sample's contribution; the denominator is the unweighted token count."""
    logits, labels = _setup()
    logp = token_logprobs(logits, labels)
    kinds = torch.tensor([0, 0, 0])
    tokens = KindTokens(cf=7.0)
    w = torch.tensor([2.0, 1.0, 1.0])
    got = distill_loss(logp, labels, kinds, w, tokens, 1.0).loss
    nll = -(logp.sum(-1))
    assert torch.allclose(got, (2 * nll[0] + nll[1] + nll[2]) / 7)


def test_micro_batch_shares_sum_to_the_global_loss() -> None:
    """Splitting a batch into micro-batches and summing the shares gives the whole-batch loss."""
    logits, labels = _setup()
    kinds = ["cf", "reh", "cf"]
    whole = _sft(logits, labels, kinds)
    k = torch.tensor([KIND_INDEX[x] for x in kinds])
    tokens = KindTokens(cf=3.0, reh=4.0)
    parts = [
        distill_loss(
            token_logprobs(logits[i : i + 1], labels[i : i + 1]),
            labels[i : i + 1],
            k[i : i + 1],
            torch.ones(1),
            tokens,
            1.0,
        ).loss
        for i in range(3)
    ]
    assert torch.allclose(whole, sum(parts))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), junk=st.lists(st.integers(0, V - 1), min_size=15, max_size=15))
def test_property_masked_labels_and_logits_are_ignored(seed: int, junk: list[int]) -> None:
    """For any logits, replacing everything at masked slots by arbitrary values leaves the loss
    fixed."""
    logits, labels = _setup(seed)
    base = _sft(logits, labels, ["cf", "reh", "rft"])
    noisy = logits.clone()
    flat = torch.tensor(junk, dtype=torch.float32).reshape(3, 5)
    noisy[labels == IGNORE] = flat[labels == IGNORE].unsqueeze(-1).expand(-1, V) * 3.0
    assert torch.allclose(base, _sft(noisy, labels, ["cf", "reh", "rft"]), atol=1e-6)


def _grpo(
    logp: torch.Tensor,
    labels: torch.Tensor,
    adv: list[float],
    behaviour: torch.Tensor | None,
    **kw: float,
):
    n = labels.shape[0]
    has = torch.tensor([behaviour is not None] * n)
    beh = behaviour if behaviour is not None else torch.zeros_like(logp)
    tokens = KindTokens(grpo=float((labels != IGNORE).sum()))
    kinds = torch.full((n,), KIND_INDEX["grpo"])
    return grpo_loss(logp, labels, kinds, torch.ones(n), torch.tensor(adv), beh, has, tokens, **kw)


def test_grpo_on_policy_gradient_is_advantage_times_score() -> None:
    """Without behaviour logprobs the ratio is 1 and d loss / d logp = -A / N per target token."""
    logits, labels = _setup()
    logp = token_logprobs(logits, labels).detach().requires_grad_(True)
    out = _grpo(logp, labels, [1.0, -0.5, 2.0], None, clip_eps=0.2)
    out.loss.backward()
    n = float((labels != IGNORE).sum())
    expected = torch.tensor([1.0, -0.5, 2.0]).unsqueeze(-1).expand(3, 5) * -(1 / n)
    assert logp.grad is not None
    assert torch.allclose(logp.grad[labels != IGNORE], expected[labels != IGNORE])
    assert torch.all(logp.grad[labels == IGNORE] == 0)


def test_grpo_clips_the_ratio() -> None:
    """A ratio beyond 1 + eps with positive advantage gives no gradient (PPO clip), and counts as
    clipped."""
    labels = torch.tensor([[IGNORE, 1, 2]])
    logp = torch.tensor([[0.0, -1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -1.5, -1.05]])  # ratios e^0.5 = 1.65 (clipped), e^0.05 = 1.05
    out = _grpo(logp, labels, [1.0], behaviour, clip_eps=0.2)
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0, 1] == 0
    assert logp.grad[0, 2] < 0
    assert out.grpo_stats["clipped"] == 1.0


def test_grpo_dual_clip_bounds_a_negative_advantage_token() -> None:
    """A token sampled at a tiny behaviour probability and likely now (ratio ~ e^8) with A < 0: the
    PPO objective is unbounded there (effect-hard's rebuilt GRPO round 1, step 236: loss 56 against
    ~0.1); dual clip c caps its loss at c * |A| and takes its gradient away, other tokens keep
    theirs."""
    labels = torch.tensor([[IGNORE, 1, 2]])
    logp = torch.tensor([[0.0, -0.5, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -8.5, -1.05]])
    plain = _grpo(logp, labels, [-1.0], behaviour, clip_eps=0.2)
    assert plain.loss.item() > 1000
    out = _grpo(logp, labels, [-1.0], behaviour, clip_eps=0.2, dual_clip=3.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((3.0 + math.exp(0.05)) / 2, rel=1e-5)
    assert logp.grad is not None
    assert logp.grad[0, 1] == 0
    assert logp.grad[0, 2] > 0
    assert out.grpo_stats["clipped"] == 1.0


def test_grpo_dual_clip_leaves_positive_advantages_and_small_ratios_alone() -> None:
    """Dual clip changes nothing where the ratio is below c or the advantage is positive."""
    logits, labels = _setup()
    logp = token_logprobs(logits, labels)
    behaviour = logp - 0.5
    for adv in ([1.0, 0.5, 2.0], [-1.0, -0.5, -2.0]):
        a = _grpo(logp, labels, adv, behaviour, clip_eps=0.2)
        b = _grpo(logp, labels, adv, behaviour, clip_eps=0.2, dual_clip=3.0)
        assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        _grpo(logp, labels, [1.0, 1.0, 1.0], behaviour, clip_eps=0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=1.0)
    assert LossConfig(dual_clip=3.0).dual_clip == 3.0


def test_grpo_k3_kl_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    """k3 = exp(d) - d - 1 >= 0, zero when the policy equals the reference."""
    logits, labels = _setup()
    logp = token_logprobs(logits, labels)
    same = _grpo(logp, labels, [0.0, 0.0, 0.0], None, clip_eps=0.2, ref_logp=logp, kl_coef=0.5)
    moved = _grpo(
        logp, labels, [0.0, 0.0, 0.0], None, clip_eps=0.2, ref_logp=logp - 0.3, kl_coef=0.5
    )
    assert same.grpo_stats["kl"] == pytest.approx(0.0, abs=1e-6)
    n = float((labels != IGNORE).sum())
    k3 = math.exp(-0.3) + 0.3 - 1
    assert moved.loss.item() == pytest.approx(0.5 * k3, rel=1e-4)
    assert moved.grpo_stats["kl"] == pytest.approx(k3 * n, rel=1e-4)


def test_total_loss_sums_distill_and_grpo_terms() -> None:
    """Mixed batches: the GRPO rows add their objective; distillation rows their NLL means."""
    logits, labels = _setup()
    logp = token_logprobs(logits, labels)
    kinds = torch.tensor([KIND_INDEX["cf"], KIND_INDEX["grpo"], KIND_INDEX["cf"]])
    tokens = KindTokens(cf=3.0, grpo=4.0)
    adv = torch.tensor([0.0, 1.0, 0.0])
    no_behaviour = torch.zeros(3, dtype=torch.bool)
    out = total_loss(
        logp,
        labels,
        kinds,
        torch.ones(3),
        adv,
        torch.zeros_like(logp),
        no_behaviour,
        tokens,
        beta=1.0,
        clip_eps=0.2,
    )
    cf = -(logp[0].sum() + logp[2].sum()) / 3
    grpo = -(4 * 1.0) / 4  # ratio 1, A = 1 on 4 tokens
    assert out.loss.item() == pytest.approx((cf + grpo).item(), rel=1e-5)
