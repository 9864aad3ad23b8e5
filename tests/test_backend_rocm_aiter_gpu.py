"""ROCM_AITER's FP8 MLA prefill with the real aiter on an MI355X (gfx950): the adapter against float64
attention over the unquantised inputs, within FP8 tolerance. Skipped without a ROCm device, without aiter,
and off gfx950 (aiter refuses the FP8 prefill on gfx942, which the CPU tests show as a reason).

    python -m pytest -q -m gpu tests/test_backend_rocm_aiter_gpu.py
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mla_multi.backends import rocm_aiter
from mla_multi.backends.base import PrefillSelectorConfig
from mla_multi.backends.reference import varlen_attention_reference
from mla_multi.dims import MLADims
from mla_multi.platforms import current_platform
from mla_multi.testing import relative_error

pytestmark = pytest.mark.gpu


def _require_gfx950_aiter():
    if getattr(torch.version, "hip", None) is None:
        pytest.skip("needs a ROCm device (torch built for HIP)")
    probe = rocm_aiter.probe_aiter()
    if probe.error:
        pytest.skip(probe.error)
    platform = current_platform()
    config = PrefillSelectorConfig(MLADims.deepseek_v3(16), platform.fp8_dtype or torch.float8_e4m3fn)
    reasons = rocm_aiter.AiterMLAPrefillBackend.validate_configuration(platform, config)
    if reasons:
        pytest.skip("; ".join(reasons))
    return platform


@pytest.mark.parametrize("num_heads, lengths, causal", [
    (16, [300, 17, 0, 1500], True), (128, [4096, 77], True), (16, [513, 40], False),
])
def test_fp8_prefill_on_aiter_matches_float64(num_heads, lengths, causal):
    platform = _require_gfx950_aiter()
    fp8 = platform.fp8_dtype
    generator = torch.Generator().manual_seed(num_heads + len(lengths))
    total = sum(lengths)
    q = torch.randn(total, num_heads, 192, generator=generator).to(torch.bfloat16)
    k = (torch.randn(total, num_heads, 192, generator=generator) * 0.7).to(torch.bfloat16)
    v = torch.randn(total, num_heads, 128, generator=generator).to(torch.bfloat16)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    device = torch.device("cuda")
    k8, k_scale = rocm_aiter.quantize_per_tensor(k.to(device), fp8)
    v8, v_scale = rocm_aiter.quantize_per_tensor(v.to(device), fp8)
    scale = 192 ** -0.5
    impl = rocm_aiter.AiterMLAPrefillImpl(num_heads, scale, 512, 128, 64, 128, device)
    out = impl.forward_varlen(q.to(device), k8, v8, cu.to(device), cu.to(device), max(lengths), max(lengths), causal,
                              False, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    ref, _ = varlen_attention_reference(q.double(), k.double(), v.double(), cu, cu, scale, causal)
    for b, length in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if length:
            assert relative_error(out[rows].cpu(), ref[rows]) < 6e-2, (b, relative_error(out[rows].cpu(), ref[rows]))
