"""Unit tests of learner/linear_logprobs.py: the chunked LM head gives the plain path's log-probs,
losses and gradients, never holds a micro-batch's full-vocabulary logits, and leaves the trainer's
steps unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from leafe.learner.batching import MicroBatch, collate, collate_packed, kind_tokens, to_items
from leafe.learner.config import BatchConfig, LossConfig, OptimConfig, TrainerConfig
from leafe.learner.linear_logprobs import (
    chunked_token_logprobs,
    full_logits_sample_logprobs,
    sample_logprobs,
)
from leafe.learner.losses import IGNORE, total_loss
from leafe.learner.model_io import load_model
from leafe.learner.trainer import Trainer
from leafe.protocol.samples import Sample
from tests.support.learner import make_sample, make_samples

pytestmark = pytest.mark.usefixtures("one_thread")


def _mixed_batch() -> list[Sample]:
    """cf/reh/rft samples and GRPO samples with advantages of both signs, with and without behaviour
    logprobs (near the tiny model's, about -ln 49152, so that some ratios are clipped)."""
    batch = make_samples(7, kinds=("cf", "reh", "rft"))
    behaviour = [[-10.7, -10.9, -11.2], None, [-11.0, -10.75, -10.8]]
    for j, (adv, bl) in enumerate(zip([1.5, -0.7, -1.2], behaviour, strict=True)):
        batch.append(
            make_sample(50 + j, kind="grpo", completion_len=3, advantage=adv, behaviour_logprobs=bl)
        )
    return batch


def test_chunked_token_logprobs_equal_the_full_logits_values_and_gradients() -> None:
    """Any chunk size gives the log-softmax of the full logits at each target (0 at IGNORE), and the
    same gradients for the hidden states and the head's weight and bias."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (2, 9), generator=g)
    targets[0, :4] = IGNORE
    targets[1, 7:] = IGNORE
    up = torch.randn(2, 9, generator=g)
    logits = F.linear(hidden, weight, bias)
    ref = torch.where(
        targets != IGNORE,
        logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0],
        0,
    )
    ref_grads = torch.autograd.grad((ref * up).sum(), [hidden, weight, bias])
    for chunk in (1, 4, 7, 18, 1000):
        logp = chunked_token_logprobs(hidden, weight, targets, bias=bias, chunk_tokens=chunk)
        assert logp.dtype == torch.float32 and logp.shape == targets.shape
        assert torch.allclose(logp, ref, atol=1e-6), chunk
        assert torch.all(logp[targets == IGNORE] == 0)
        grads = torch.autograd.grad((logp * up).sum(), [hidden, weight, bias])
        for a, b in zip(grads, ref_grads, strict=True):
            assert torch.allclose(a, b, atol=1e-5), chunk


def _micro_batch(packed: bool) -> MicroBatch:
    items, skipped = to_items(_mixed_batch(), 4096, 49152)
    assert not skipped
    return (collate_packed if packed else collate)(items, 2)


@pytest.mark.parametrize("packed", [False, True], ids=["left_padded", "packed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_losses_equal_the_full_logits_path_on_a_tiny_model(
    tiny_dir: Path, packed: bool, precision: str
) -> None:
    """On the tiny random Llama, cf + beta * reh + rft + GRPO (clipped ratio, behaviour logprobs
    present and missing, k3 KL to a reference) computed through the chunked head equal the
    full-logits path's to 1e-5, in both batch layouts and under bf16 autocast too. So do the
    gradients of every parameter in fp32; in bf16 those of the decoder layers are identical and the
    head's (tied to the embeddings) differs by bf16 rounding only: autocast rounds each chunk's
    weight gradient to bf16 before the fp32 sum."""
    from leafe.learner.attention import use_varlen_attention

    model = load_model(tiny_dir).train()
    use_varlen_attention(model)
    mb = _micro_batch(packed)
    items, _ = to_items(_mixed_batch(), 4096, 49152)
    tokens = kind_tokens(items)
    ref_logp = torch.full(mb.labels.shape, -10.8)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def loss(logp: torch.Tensor) -> torch.Tensor:
        args = (
            mb.labels,
            mb.kinds,
            mb.weights,
            mb.advantages,
            mb.behaviour_logp,
            mb.has_behaviour,
            tokens,
        )
        return total_loss(logp, *args, beta=0.5, clip_eps=0.2, ref_logp=ref_logp, kl_coef=0.1).loss

    results = []
    for logprobs in (
        full_logits_sample_logprobs,
        lambda m, b: sample_logprobs(m, b, chunk_tokens=5),
    ):
        model.zero_grad(set_to_none=True)
        with amp:
            logp = logprobs(model, mb)
        value = loss(logp)
        value.backward()
        results.append(
            (
                logp.detach(),
                float(value.detach()),
                {n: p.grad.clone() for n, p in model.named_parameters()},
            )
        )
    (full_logp, full_loss, full_grads), (logp, chunked_loss, grads) = results
    assert abs(chunked_loss - full_loss) <= 1e-5
    assert torch.allclose(logp, full_logp, atol=1e-5)
    for name, g in grads.items():
        if precision == "fp32":
            assert torch.allclose(g, full_grads[name], atol=1e-5, rtol=1e-4), name
        else:  # bf16 keeps 8 bits of mantissa: a unit roundoff of 2**-9 ~ 2e-3
            assert float((g - full_grads[name]).norm() / full_grads[name].norm()) < 1e-3, name


def test_no_full_vocabulary_logits_are_kept_for_the_backward(tiny_dir: Path) -> None:
    """Autograd keeps nothing as wide as the vocabulary with more rows than one chunk: the forward
    saves each chunk's inputs only, and the backward recomputes one chunk's logits at a time. The
    full-logits path, by contrast, keeps [N, V] blocks."""
    model = load_model(tiny_dir).train()
    mb = _micro_batch(packed=True)
    vocab = model.config.vocab_size

    def widest_saved(logprobs) -> int:  # type: ignore[no-untyped-def]
        rows: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 1 and t.shape[-1] == vocab and t.dim() >= 2:
                rows.append(t.numel() // vocab)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs(model, mb).sum().backward()
        return max(rows, default=0)

    targets = int((mb.packing.targets != IGNORE).sum())  # type: ignore[union-attr]
    assert targets > 8
    assert widest_saved(full_logits_sample_logprobs) >= targets
    # the head's weight [V, H] is saved in both paths (H = 64 rows of V): only logits blocks count
    # here
    chunked = widest_saved(lambda m, b: sample_logprobs(m, b, chunk_tokens=4))
    assert chunked <= max(4, model.config.hidden_size)


def _cfg(**trainer: object) -> TrainerConfig:
    return TrainerConfig(
        optim=OptimConfig(lr=1e-3, warmup_steps=2, schedule="constant"),
        batch=BatchConfig(global_batch=10, micro_batch_tokens=60, bucketing="pack"),
        loss=LossConfig(kl_coef=0.05),
        precision="fp32",
        seed=3,
        **trainer,  # type: ignore[arg-type]
    )


class FullLogitsTrainer(Trainer):
    """The trainer's previous loss path: full logits at the kept positions."""

    def _logp(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return full_logits_sample_logprobs(model, mb)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_trainer_steps_equal_the_full_logits_path_without_activation_checkpointing(
    dist_env, tiny_dir: Path, checkpointed: bool
) -> None:
    """Two optimizer steps of the FSDP trainer with the chunked head, with or without activation
    checkpointing, equal those of the full-logits path without checkpointing: loss, per-kind losses,
    KL, clip fraction, ratio and gradient norm within 1e-5."""
    batch = _mixed_batch()
    before = FullLogitsTrainer(_cfg(activation_checkpointing=False), tiny_dir, dist_env)
    after = Trainer(_cfg(activation_checkpointing=checkpointed), tiny_dir, dist_env)
    after.chunk_tokens = 4
    for _ in range(2):  # the second step runs on weights (and AdamW moments) the first one updated
        a, b = before.train_step(batch), after.train_step(batch)
        assert b.micro_batches > 1
        for key in (
            "loss",
            "loss_cf",
            "loss_reh",
            "loss_rft",
            "loss_grpo",
            "kl",
            "ratio",
            "grad_norm",
        ):
            assert abs(getattr(b, key) - getattr(a, key)) <= 1e-5, key
        assert b.clip_frac == a.clip_frac
