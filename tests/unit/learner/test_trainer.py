"""Unit tests of the FSDP2 trainer on one plain-python rank (the same code path torchrun ranks
run)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from leafe.learner.checkpoint import Progress, load_latest, save_checkpoint
from leafe.learner.config import BatchConfig, LossConfig, OptimConfig, TrainerConfig
from leafe.learner.model_io import load_model, verify_manifest
from leafe.learner.trainer import Trainer
from leafe.protocol.samples import Sample
from tests.support.learner import assert_same_weights, make_sample, make_samples

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(precision: str = "fp32", **batch: int | str) -> TrainerConfig:
    """fp32 unless asked: these tests pin the step's math, which bf16 rounding would blur."""
    return TrainerConfig(
        optim=OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=6),
        batch=BatchConfig(**({"global_batch": 8} | batch)),  # type: ignore[arg-type]
        precision=precision,  # type: ignore[arg-type]
        seed=3,
    )


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in trainer.export_state().items()}


def test_training_lowers_the_loss_on_a_fixed_batch(dist_env, tiny_dir: Path) -> None:
    """Repeated steps on one batch reduce L (the optimizer, schedule and loss are wired
    together)."""
    trainer = Trainer(_cfg(), tiny_dir, dist_env)
    batch = make_samples(8)
    losses = [trainer.train_step(batch).loss for _ in range(5)]
    assert losses[-1] < losses[0] - 0.05
    assert trainer.step == 5


def test_micro_batch_split_does_not_change_the_step(dist_env, tiny_dir: Path) -> None:
    """Gradient accumulation over many small micro-batches equals one big micro-batch: same loss,
    same gradient norm, same updated weights (up to AdamW sign flips of ~zero gradients, see the
    helper)."""
    batch = make_samples(8, kinds=("cf", "reh", "rft"))
    one = Trainer(_cfg(micro_batch_tokens=100_000), tiny_dir, dist_env)
    many = Trainer(_cfg(micro_batch_tokens=24), tiny_dir, dist_env)
    s1, s2 = one.train_step(batch), many.train_step(batch)
    assert s1.micro_batches == 1 and s2.micro_batches > 3
    assert s1.loss == pytest.approx(s2.loss, rel=1e-5)
    assert s1.grad_norm == pytest.approx(s2.grad_norm, rel=1e-5)
    assert_same_weights(_params(one), _params(many), max_lr=s1.lr)


def _mixed_batch() -> list[Sample]:
    """cf/reh/rft samples plus GRPO samples with advantages of both signs and behaviour logprobs
    near the tiny model's (about -ln 49152), so that some ratios are clipped and some are not."""
    batch = make_samples(9, kinds=("cf", "reh", "rft"))
    behaviour = [[-10.7, -10.9, -11.2], [-10.8, -10.6, -10.85], None, [-11.0, -10.75, -10.8]]
    for j, (adv, bl) in enumerate(zip([1.5, -0.7, 0.4, -1.2], behaviour, strict=True)):
        batch.append(
            make_sample(50 + j, kind="grpo", completion_len=3, advantage=adv, behaviour_logprobs=bl)
        )
    return batch


def test_packing_does_not_change_the_step(dist_env, tiny_dir: Path) -> None:
    """Packed rows (several samples per row, per-sample attention) and left-padded length buckets
    give the same step on a batch mixing every kind, GRPO with behaviour logprobs included: same
    loss and per-kind losses, clip fraction, gradient norm and updated weights; packing processes no
    padding."""
    batch = _mixed_batch()
    bucketed = Trainer(_cfg(micro_batch_tokens=40, global_batch=13), tiny_dir, dist_env)
    packed = Trainer(
        _cfg(micro_batch_tokens=40, global_batch=13, bucketing="pack"), tiny_dir, dist_env
    )
    for _ in range(2):  # the second step runs on weights (and AdamW moments) the first one updated
        a, b = bucketed.train_step(batch), packed.train_step(batch)
        assert b.micro_batches > 1
        assert b.padded_tokens == b.real_tokens < a.padded_tokens
        for key in ("loss", "loss_cf", "loss_reh", "loss_rft", "loss_grpo", "ratio", "grad_norm"):
            assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-5), key
        assert b.clip_frac == a.clip_frac and a.clip_frac is not None and 0 < a.clip_frac < 1
    assert_same_weights(_params(bucketed), _params(packed), max_lr=2 * a.lr)


def test_a_shared_prefix_does_not_change_the_step(dist_env, tiny_dir: Path) -> None:
    """``share_prefix``: the same mixed batch with a 40-token prompt prefix in common gives the same
    step whether each packed row holds the prefix once or every sample in full: same losses, clip
    fraction, gradient norm and updated weights, for fewer tokens through the model."""
    prefix = list(range(100, 140))
    batch = [
        msgspec.structs.replace(s, prompt_ids=[*prefix, *s.prompt_ids]) for s in _mixed_batch()
    ]
    full = Trainer(
        _cfg(micro_batch_tokens=160, global_batch=13, bucketing="pack"), tiny_dir, dist_env
    )
    cfg = _cfg(micro_batch_tokens=160, global_batch=13, bucketing="pack", share_prefix=True)  # type: ignore[arg-type]
    shared = Trainer(cfg, tiny_dir, dist_env)
    for _ in range(2):
        a, b = full.train_step(batch), shared.train_step(batch)
        assert b.padded_tokens < a.padded_tokens == a.real_tokens == b.real_tokens
        for key in ("loss", "loss_cf", "loss_reh", "loss_rft", "loss_grpo", "ratio", "grad_norm"):
            assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-5), key
        assert b.clip_frac == a.clip_frac
    assert_same_weights(_params(full), _params(shared), max_lr=2 * a.lr)


def test_export_writes_a_loadable_hf_directory_with_the_trained_weights(
    dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    """The export (fp32 here) loads with transformers into exactly the trainer's weights; the
    manifest verifies; the tied LM head is not duplicated."""
    trainer = Trainer(_cfg(), tiny_dir, dist_env)
    trainer.train_step(make_samples(8))
    digest = trainer.export(tmp_path / "v000001", version="v000001", dtype="fp32")
    manifest = verify_manifest(tmp_path / "v000001", digest)
    assert manifest is not None and manifest["version"] == "v000001"
    assert "lm_head.weight" not in load_file(str(tmp_path / "v000001" / "model.safetensors"))
    loaded = load_model(tmp_path / "v000001").state_dict()
    for k, v in _params(trainer).items():
        assert torch.equal(loaded[k], v), k


def test_bf16_export_is_the_default(dist_env, tiny_dir: Path, tmp_path: Path) -> None:
    """Exports default to bf16 tensors (half the bytes to ship to the engines)."""
    trainer = Trainer(_cfg(), tiny_dir, dist_env)
    trainer.export(tmp_path / "v1", version="v1")
    tensors = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_gives_the_same_next_step_as_an_uninterrupted_run(
    dist_env, tiny_dir: Path, tmp_path: Path, precision: str
) -> None:
    """Checkpoint after 2 steps, rebuild from scratch, load: step 3's loss, lr and weights match a
    run that never stopped (model, AdamW moments, scheduler and progress all restored), in fp32 and
    in bf16 (whose checkpoint holds the same fp32 master weights and moments)."""
    batches = [make_samples(8, start=8 * i) for i in range(3)]
    straight = Trainer(_cfg(precision), tiny_dir, dist_env)
    expected = [straight.train_step(b) for b in batches]
    first = Trainer(_cfg(precision), tiny_dir, dist_env)
    for b in batches[:2]:
        first.train_step(b)
    save_checkpoint(tmp_path / "ckpt", first, Progress(step=first.step, samples_seq=41), keep=1)
    del first
    resumed = Trainer(_cfg(precision), tiny_dir, dist_env)
    progress = load_latest(tmp_path / "ckpt", resumed)
    assert progress is not None and (progress.step, progress.samples_seq) == (2, 41)
    got = resumed.train_step(batches[2])
    assert got.step == 3
    assert got.lr == expected[2].lr
    assert got.loss == pytest.approx(expected[2].loss, abs=1e-6)
    assert got.grad_norm == pytest.approx(expected[2].grad_norm, rel=1e-6)
    assert_same_weights(_params(straight), _params(resumed), max_lr=0.0, atol=1e-7)


ACTIONS = [314, 1592, 2718, 8281]
"""The toy's action tokens (think up/down/left/right); the first one is rewarded."""


def _policy(trainer: Trainer, prompt: list[int]) -> torch.Tensor:
    """Full-vocabulary log-probabilities of the next token."""
    with torch.no_grad():
        logits = (
            trainer.model(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].float()
        )
    return torch.log_softmax(logits, -1)


def _expected_reward(trainer: Trainer, prompt: list[int]) -> float:
    p = _policy(trainer, prompt)[ACTIONS].exp()
    return float(p[0] / p.sum())


def test_grpo_raises_the_reward_of_the_rewarded_completion(dist_env, tiny_dir: Path) -> None:
    """Toy bandit: the agent picks one of 4 action tokens (sampled from the policy restricted to
    them); reward 1 for the first, 0 otherwise. Groups of 16, group-normalised advantages, behaviour
    logprobs from the sampling policy: a few GRPO steps raise the expected reward well above its
    start."""
    cfg = TrainerConfig(
        optim=OptimConfig(lr=3e-3),
        batch=BatchConfig(global_batch=16),
        loss=LossConfig(clip_eps=0.2),
        seed=1,
    )
    trainer = Trainer(cfg, tiny_dir, dist_env)
    prompt = [11, 42, 7, 99, 5, 63]
    gen = torch.Generator().manual_seed(0)
    start = _expected_reward(trainer, prompt)
    for it in range(5):
        logp = _policy(trainer, prompt)
        picks = torch.multinomial(logp[ACTIONS].exp(), 16, replacement=True, generator=gen).tolist()
        rewards = torch.tensor([1.0 if k == 0 else 0.0 for k in picks])
        adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
        group = [
            _with_ids(
                make_sample(
                    100 * it + j,
                    kind="grpo",
                    advantage=a,
                    behaviour_logprobs=[float(logp[ACTIONS[k]])],
                ),
                prompt,
                [ACTIONS[k]],
            )
            for j, (k, a) in enumerate(zip(picks, adv, strict=True))
        ]
        stats = trainer.train_step(group)
        assert stats.loss_grpo is not None and stats.clip_frac is not None
    end = _expected_reward(trainer, prompt)
    assert end > start + 0.2, (start, end)


def _with_ids(s: Sample, prompt: list[int], completion: list[int]) -> Sample:
    import msgspec

    return msgspec.structs.replace(s, prompt_ids=prompt, completion_ids=completion)


def test_grpo_with_kl_reports_a_growing_kl_to_the_reference(dist_env, tiny_dir: Path) -> None:
    """With kl_coef > 0 a frozen reference is built; KL starts at 0 and grows as the policy
    moves."""
    cfg = TrainerConfig(
        optim=OptimConfig(lr=1e-2), batch=BatchConfig(global_batch=4), loss=LossConfig(kl_coef=0.1)
    )
    trainer = Trainer(cfg, tiny_dir, dist_env)
    batch = [make_sample(i, kind="grpo", advantage=1.0 if i % 2 else -1.0) for i in range(4)]
    first = trainer.train_step(batch)
    second = trainer.train_step(batch)
    assert first.kl == pytest.approx(0.0, abs=1e-7)
    assert second.kl is not None and second.kl > 0


def test_a_partial_batch_takes_a_proportionally_smaller_step_when_asked(
    dist_env, tiny_dir: Path
) -> None:
    """``scale_partial_batches``: one sample of a global batch of 8 moves every weight 1/8 as far as
    the same step unscaled (AdamW's first step is lr * sign-like, whatever the batch); a full batch
    is unchanged, and the schedule's lr is back in place for the next step."""
    import msgspec

    one = make_samples(1)
    deltas = {}
    for scale in (False, True):
        cfg = _cfg()
        cfg = msgspec.structs.replace(
            cfg,
            optim=msgspec.structs.replace(cfg.optim, warmup_steps=0, scale_partial_batches=scale),
        )
        trainer = Trainer(cfg, tiny_dir, dist_env)
        before = _params(trainer)
        stats = trainer.train_step(one)
        after = _params(trainer)
        deltas[scale] = torch.cat([(after[k] - before[k]).flatten() for k in before]).abs().sum()
        assert stats.lr == pytest.approx(1e-3 / (8 if scale else 1))
        assert trainer.scheduler.get_last_lr()[0] == pytest.approx(
            trainer.optimizer.param_groups[0]["lr"]
        )
    assert float(deltas[True] / deltas[False]) == pytest.approx(1 / 8, rel=0.02)


def test_lr_by_kind_sets_each_kinds_step_size(dist_env, tiny_dir: Path) -> None:
    """``lr_by_kind``: a step on ``sft`` samples at 4x the base lr moves the weights 4x as far as
    the same step at the base lr (AdamW's first step scales with lr); a mixed batch gets the
    samples' mean lr; the schedule's own lr is unchanged afterwards."""
    import msgspec

    batch = [msgspec.structs.replace(s, kind="sft") for s in make_samples(8)]
    deltas = {}
    for by_kind in ({}, {"sft": 4e-3}):
        cfg = _cfg()
        cfg = msgspec.structs.replace(
            cfg,
            optim=msgspec.structs.replace(
                cfg.optim, warmup_steps=0, schedule="constant", lr_by_kind=by_kind
            ),
        )
        trainer = Trainer(cfg, tiny_dir, dist_env)
        before = _params(trainer)
        stats = trainer.train_step(batch)
        after = _params(trainer)
        deltas[bool(by_kind)] = (
            torch.cat([(after[k] - before[k]).flatten() for k in before]).abs().sum()
        )
        assert stats.lr == pytest.approx(4e-3 if by_kind else 1e-3)
        assert trainer.scheduler.get_last_lr()[0] == pytest.approx(1e-3)
        # 2 sft samples at 4e-3, 6 cf samples at the base 1e-3
        mixed = [*batch[:2], *make_samples(6, start=100, kinds=("cf",))]
        assert trainer.train_step(mixed).lr == pytest.approx(
            (2 * 4e-3 + 6e-3) / 8 if by_kind else 1e-3
        )
    assert float(deltas[True] / deltas[False]) == pytest.approx(4.0, rel=0.05)


def test_lr_by_kind_refuses_unknown_kinds_and_non_positive_lrs() -> None:
    with pytest.raises(ValueError, match="sample kind"):
        OptimConfig(lr=1e-5, lr_by_kind={"sf": 5e-5})
    with pytest.raises(ValueError, match="> 0"):
        OptimConfig(lr=1e-5, lr_by_kind={"sft": 0.0})


def test_the_allocator_reuses_freed_memory_unless_asked_to_release_it(
    dist_env, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinning glibc's mmap threshold made every CPU step 1.63x slower (a page fault per 4 KiB of
    every freed-and-reallocated activation, ``learner/memory.py``): only ``release_freed_memory``
    (the memory-bound setting) pins it; the default keeps freed blocks in the heap for reuse; with
    neither the allocator is left alone."""
    from leafe.learner import trainer as trainer_module

    calls: list[str] = []
    monkeypatch.setattr(trainer_module, "pin_mmap_threshold", lambda: calls.append("pin") or True)
    monkeypatch.setattr(trainer_module, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    base = msgspec.structs.asdict(_cfg())
    for overrides, want in (
        ({}, ["reuse"]),
        ({"release_freed_memory": True}, ["pin"]),
        ({"reuse_freed_memory": False}, []),
    ):
        calls.clear()
        Trainer(TrainerConfig(**{**base, **overrides}), tiny_dir, dist_env)
        assert calls == want, overrides


def test_a_default_trainer_bounds_a_step_on_a_huge_ratio_with_a_negative_advantage(
    dist_env, tiny_dir: Path
) -> None:
    """Issue 62: a GRPO sample whose completion the behaviour policy sampled at probability e^-30
    a token (an importance ratio far past the rebuilt round's 57) on a negative advantage: the PPO
    clip does not bound -r * A there, so the plain objective's loss is huge; the default trainer's
    dual clip (c = 3) caps it at c * |A| a token and counts the capped tokens, and an on-policy step
    (ratio 1) is bit for bit the plain objective's."""
    far = make_sample(1, kind="grpo", advantage=-1.0, completion_len=4)
    far = msgspec.structs.replace(far, behaviour_logprobs=[-30.0] * 4)
    losses = {}
    for name, loss in (("default", LossConfig()), ("off", LossConfig(dual_clip=0.0))):
        trainer = Trainer(msgspec.structs.replace(_cfg(), loss=loss), tiny_dir, dist_env)
        stats = trainer.train_step([far])
        losses[name] = stats.loss
        assert stats.dual_clipped == (4 if name == "default" else 0)
    assert losses["off"] > 100
    assert losses["default"] == pytest.approx(3.0, rel=1e-6)
    near = make_sample(2, kind="grpo", advantage=-1.0, completion_len=4)
    steps = []
    for loss in (LossConfig(), LossConfig(dual_clip=0.0)):
        trainer = Trainer(msgspec.structs.replace(_cfg(), loss=loss), tiny_dir, dist_env)
        steps.append((trainer.train_step([near]).loss, _params(trainer)))
    assert steps[0][0] == steps[1][0]
    assert all(torch.equal(steps[0][1][k], steps[1][1][k]) for k in steps[0][1])
