"""Selective recompute (``trainer.recompute``): the same optimizer steps as keeping every
activation, with less kept from the forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leafe.learner.config import BatchConfig, OptimConfig, TrainerConfig
from leafe.learner.model_io import load_model
from leafe.learner.recompute import recompute_in_backward
from leafe.learner.trainer import Trainer
from tests.support.learner import make_samples

pytestmark = pytest.mark.usefixtures("one_thread")

KEYS = ("loss", "loss_cf", "loss_reh", "loss_rft", "grad_norm")


def _cfg(precision: str, recompute: str) -> TrainerConfig:
    return TrainerConfig(
        optim=OptimConfig(lr=1e-3, warmup_steps=2, schedule="constant"),
        batch=BatchConfig(global_batch=8, micro_batch_tokens=60, bucketing="pack"),
        precision=precision,  # type: ignore[arg-type]
        recompute=recompute,  # type: ignore[arg-type]
        seed=3,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("part", ["mlp", "self_attn"])
def test_recomputing_a_part_gives_the_same_steps(
    dist_env, tiny_dir: Path, part: str, precision: str
) -> None:
    """Two optimizer steps with the MLP or the attention block of every layer recomputed in the
    backward equal those that keep everything: losses and gradient norm within 1e-6 (the same
    arithmetic, bf16 autocast included), the second step on weights the first one updated."""
    batch = make_samples(8, kinds=("cf", "reh", "rft"))
    kept = Trainer(_cfg(precision, "none"), tiny_dir, dist_env)
    recomputed = Trainer(_cfg(precision, part), tiny_dir, dist_env)
    for _ in range(2):
        a, b = kept.train_step(batch), recomputed.train_step(batch)
        assert b.micro_batches > 1
        for key in KEYS:
            assert abs(getattr(b, key) - getattr(a, key)) <= 1e-6, (key, a, b)


def _saved_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors autograd keeps from one forward of ``model`` (under bf16 autocast)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, 48))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids).logits.sum()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_a_recomputed_part_keeps_less_of_the_forward(tiny_dir: Path) -> None:
    """Each wrapped part keeps only its input: the forward keeps fewer bytes for the backward, the
    MLP's part more so than the attention block's."""
    kept = _saved_bytes(load_model(tiny_dir))
    saved = {}
    for part in ("mlp", "self_attn"):
        model = load_model(tiny_dir)
        assert recompute_in_backward(model, part) == model.config.num_hidden_layers  # type: ignore[arg-type]
        saved[part] = _saved_bytes(model)
    assert saved["mlp"] < saved["self_attn"] < kept, (saved, kept)


def test_an_unknown_part_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="part must be one of"):
        recompute_in_backward(load_model(tiny_dir), "lm_head")  # type: ignore[arg-type]
