"""``make test`` runs the tests whose path depends on the CPU's instruction set a second time with
the AVX2-only fallback forced (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, see the
Makefile), so a host with AVX-512 and AMX also exercises what an AVX2-only CPU (AMD Zen 3) runs.
This pins that the forcing really takes effect: a torch that ignored the variables would make that
pass a silent repeat of the first."""

from __future__ import annotations

import os

import pytest
import torch


def test_the_forced_fallback_takes_effect() -> None:
    """Under the forced pass, torch dispatches the capability asked for and oneDNN serves no
    bfloat16 (so the inference engine keeps aten's linear layers in bfloat16, as on an AVX2-only
    CPU)."""
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "")
    if not forced:
        pytest.skip("not make test's forced-fallback pass (it sets ATEN_CPU_CAPABILITY=avx2)")
    assert torch.backends.cpu.get_cpu_capability() == forced.upper()
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
