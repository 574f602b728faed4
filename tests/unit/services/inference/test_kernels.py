"""The CPU kernels (services/inference/kernels.py) change speed, not results: the same logits as the
plain forward, the same tokens as an engine without them, and new weights served after a swap."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from leafe.learner.model_io import load_model, tiny_model_dir
from leafe.services.inference import kernels
from leafe.services.inference.decode import GenSequence, GenSpec, StopChecker
from leafe.services.inference.engine import GenerationEngine
from leafe.services.inference.kernels import (
    PackedLinear,
    accelerate,
    decode_attention,
    exact_attention,
    fused_decode,
    fused_prefill,
)
from tests.unit.services.inference.conftest import perturbed_state

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch without oneDNN"
)


def _model(
    state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32, kernels: bool = False
) -> Any:
    model = load_model(tiny_model_dir(), dtype=dtype).eval()
    model.load_state_dict(state)  # cast to the model's dtype
    if kernels:
        accelerate(model)
    return model


def _prompt_then_step(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill of ``ids`` and of one decode step over its cache (the grouped decode
    attention in bfloat16)."""
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        step = model(input_ids=ids[:, -1:], past_key_values=out.past_key_values).logits
    return out.logits.float(), step.float()


def _onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN can run ``dtype`` linear layers on this CPU, asked of torch directly: bfloat16
    needs AVX512-BF16 or AMX (not on AVX2-only CPUs, nor under ``ONEDNN_MAX_CPU_ISA=AVX2``)."""
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accelerated_forward_equals_the_plain_one(
    sharp_state: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """The kernels leave the logits as the plain forward gives them. Every linear layer is packed
    where oneDNN serves the dtype on this CPU; where it does not (bfloat16 on an AVX2-only CPU, or
    with the fallback forced as ``make test``'s second pass does) none is, and the reason is
    reported."""
    plain, fast = _model(sharp_state, dtype), _model(sharp_state, dtype)
    applied = accelerate(fast)
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    if _onednn_serves(dtype):
        assert applied["linear"] == "onednn" and all(isinstance(m, PackedLinear) for m in linears)
    else:
        assert applied["linear"] == "aten" and "bfloat16" in applied["linear_reason"], applied
        assert not any(isinstance(m, PackedLinear) for m in linears)
    assert fast.state_dict().keys() == plain.state_dict().keys()  # weight updates see the same keys
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(1))
    want, got = _prompt_then_step(plain, ids), _prompt_then_step(fast, ids)
    if dtype == torch.float32:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        return
    # bfloat16: both paths round differently; each must be as close as the other to the same weights
    # run in float32
    exact = _prompt_then_step(plain.float(), ids)
    for g, w, e in zip(got, want, exact, strict=True):
        err_fast, err_plain = (g - e).abs().mean(), (w - e).abs().mean()
        assert err_fast <= 1.25 * err_plain + 1e-3, (err_fast, err_plain)


def test_decode_attention_is_as_close_to_exact_as_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    bsz, heads, kv_heads, width, dim = 5, 6, 2, 40, 16
    q = torch.randn(bsz, heads, 1, dim, generator=gen).bfloat16()
    k, v = (torch.randn(bsz, kv_heads, width, dim, generator=gen).bfloat16() for _ in range(2))
    mask = torch.rand(bsz, 1, 1, width, generator=gen) > 0.3
    mask[:, :, :, -1] = True
    exact = exact_attention(q, k, v, mask)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    module = torch.nn.Module()
    ours, _ = decode_attention(module, q, k, v, mask, scaling=dim**-0.5)
    assert ours.shape == exact.shape == (bsz, 1, heads, dim)
    err_ours = (ours.double() - exact).abs().mean()
    err_sdpa = (sdpa.double() - exact).abs().mean()
    assert err_ours <= err_sdpa * 1.1, (err_ours, err_sdpa)
    assert (ours.double() - exact).abs().max() < 2e-2


needs_compiler = pytest.mark.skipif(
    isinstance(kernels.fused_library(), str), reason="the decode kernel cannot be compiled here"
)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128), (6, 2, 16), (4, 4, 64)]
)
def test_compiled_decode_attention_matches_exact_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """Every head group and head size the kernel specializes (and the generic one); masked gaps;
    keys and values as the arena hands them (a strided view of its first rows); a row with every
    column masked."""
    gen = torch.Generator().manual_seed(heads * dim)
    bsz, width = 5, 37
    q = torch.randn(bsz, heads, 1, dim, generator=gen).to(dtype)
    arena = torch.randn(2, bsz + 2, kv_heads, width, dim, generator=gen).to(dtype)
    k, v = arena[0, :bsz], arena[1, :bsz]  # rows of a larger arena: not contiguous as a whole
    mask = torch.rand(bsz, 1, 1, width, generator=gen) > 0.4
    mask[:, :, :, -1] = True
    mask[1, :, :, :20] = False  # a leading gap, as rows that joined later have
    mask[4] = False  # nothing to attend to: zeros, not NaN
    exact = exact_attention(q, k, v, mask)
    exact[4] = 0.0
    got = fused_decode(q, k, v, mask, dim**-0.5)
    assert got.shape == (bsz, 1, heads, dim) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-5)
    # rounding of q, k, v to bfloat16 is in the exact reference too: what is left is the output's
    else:
        assert (got.double() - exact).abs().max() <= 2**-8 * exact.abs().max() + 1e-3
    assert torch.equal(got[4], torch.zeros_like(got[4]))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "q_len"), [(9, 3, 64, 7), (4, 2, 16, 40), (2, 2, 128, 3)]
)
def test_compiled_prefill_attention_matches_exact_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, q_len: int
) -> None:
    """The engine's prefill layout: a cached prefix, a masked gap, left-padded new tokens under a
    causal mask; queries as the projection hands them (a transposed view); query blocks that do not
    fill the kernel's 64 columns; padding queries with nothing to attend to get zeros."""
    gen = torch.Generator().manual_seed(heads * dim + q_len)
    bsz, cached = 3, 11
    width = cached + q_len
    q = torch.randn(bsz, q_len, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k, v = (torch.randn(bsz, kv_heads, width, dim, generator=gen).to(dtype) for _ in range(2))
    mask = torch.zeros(bsz, 1, q_len, width, dtype=torch.bool)
    for i in range(q_len):
        mask[:, :, i, : cached + i + 1] = True  # causal over the cached prefix and the new tokens
    mask[1, :, :, :4] = False  # row 1 caches a shorter prefix: its leading columns are a gap
    mask[2, :, :2] = False  # row 2 has 2 fewer new tokens: its first 2 queries are left padding
    mask[2, :, :, cached : cached + 2] = False
    exact = exact_attention(q, k, v, mask)
    exact[2, :2] = 0.0
    got = fused_prefill(q, k, v, mask, dim**-0.5)
    assert got.shape == (bsz, q_len, heads, dim) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-5)
    else:
        assert (got.double() - exact).abs().max() <= 2**-8 * exact.abs().max() + 1e-3
    assert torch.equal(got[2, :2], torch.zeros_like(got[2, :2]))


def test_without_a_compiler_grouped_attention_serves_and_says_why(
    monkeypatch: pytest.MonkeyPatch, sharp_state: dict[str, torch.Tensor]
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    kernels.fused_library.cache_clear()
    try:
        model = _model(sharp_state)
        applied = accelerate(model)
    finally:
        kernels.fused_library.cache_clear()
    assert applied["attention"] == "grouped decode, sdpa prefill"
    assert "/nonexistent/cc" in applied["attention_reason"]
    assert model.config._attn_implementation == kernels.ATTENTION


@needs_compiler
def test_accelerate_installs_the_compiled_kernel_and_reports_it(
    sharp_state: dict[str, torch.Tensor],
) -> None:
    model = _model(sharp_state)
    applied = accelerate(model)
    assert applied["attention"] == "fused decode and prefill (compiled)"
    assert model.config._attn_implementation == kernels.FUSED_ATTENTION


def _engine(model: Any, tokenizer: Any) -> GenerationEngine:
    engine = GenerationEngine(
        model,
        StopChecker(tokenizer, frozenset({int(tokenizer.eos_token_id)})),
        pad_id=int(tokenizer.pad_token_id),
    )
    engine.start()
    return engine


def _greedy(
    engine: GenerationEngine, prompts: list[list[int]]
) -> list[tuple[list[int], list[float]]]:
    spec = GenSpec(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    futures = [engine.submit([GenSequence(prompt=p, spec=spec)]).future for p in prompts]
    return [(f.result(timeout=120)[0].output_ids, f.result()[0].logprobs) for f in futures]


def test_engine_serves_the_new_weights_after_a_swap(
    tokenizer: Any, sharp_state: dict[str, torch.Tensor]
) -> None:
    """The reordered copies are rebuilt on a swap: without that the engine would serve the old
    weights."""
    new = perturbed_state(load_model(tiny_model_dir()), seed=7)
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 11] for i in range(4)]
    fast = _engine(_model(sharp_state, kernels=True), tokenizer)
    reference = _engine(
        _model(sharp_state), tokenizer
    )  # swapped the same way (a swap assigns, unties)
    try:
        before = _greedy(fast, prompts)
        for engine in (fast, reference):
            engine.swap_weights({k: v.clone() for k, v in new.items()}, "v1").result(timeout=60)
        after, want = _greedy(fast, prompts), _greedy(reference, prompts)
    finally:
        fast.stop()
        reference.stop()
    assert [ids for ids, _ in after] == [ids for ids, _ in want]
    assert [ids for ids, _ in after] != [ids for ids, _ in before]
    for (_, got), (_, exp) in zip(after, want, strict=True):
        assert got == pytest.approx(exp, abs=1e-3)


def test_a_dtype_onednn_cannot_serve_keeps_aten_and_says_why(
    sharp_state: dict[str, torch.Tensor],
) -> None:
    model = _model(sharp_state, torch.float16)
    applied = accelerate(model)
    assert applied["linear"] == "aten" and "float16" in applied["linear_reason"]
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_bfloat16_engine_follows_float32_as_closely_as_the_plain_engine(
    tokenizer: Any, sharp_state: dict[str, torch.Tensor]
) -> None:
    """A bfloat16 engine with the kernels: its greedy tokens follow the float32 model's about as far
    as the plain bfloat16 engine's do. bfloat16 rounding flips the random tiny model's near-ties
    either way (38 vs 39 of 64 tokens once); broken attention over the cache would follow it for a
    token or two."""
    engines = {
        "fast": _engine(_model(sharp_state, torch.bfloat16, kernels=True), tokenizer),
        "plain": _engine(_model(sharp_state, torch.bfloat16), tokenizer),
        "float32": _engine(_model(sharp_state), tokenizer),
    }
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 11, 60 + i] for i in range(8)]
    try:
        out = {name: [ids for ids, _ in _greedy(e, prompts)] for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.stop()
    agree = {
        name: sum(_agreeing_prefix(a, b) for a, b in zip(out[name], out["float32"], strict=True))
        for name in ("fast", "plain")
    }
    assert agree["fast"] >= 0.9 * agree["plain"], agree
    assert agree["fast"] >= 0.5 * 8 * len(prompts), agree
