"""FP8 prefill through `mm.ops.mla_prefill`: FP8 k / v with per-tensor scales (and an FP8 query with its
own), REFERENCE on the CPU against float64 attention over the unquantised inputs, the argument errors, and
the registered op under `torch.compile(fullgraph=True)`. ROCM_AITER's kernel path: tests/test_backend_rocm_aiter.py."""

from __future__ import annotations

import pytest
import torch

import mla_multi as mm
from mla_multi.backends.reference import varlen_attention_reference
from mla_multi.testing import relative_error

SCALE = 192 ** -0.5
FP8 = torch.float8_e4m3fn


def _quantised(x: torch.Tensor):
    scale = x.float().abs().amax() / 448
    return (x.float() / scale).to(FP8), scale.reshape(1)


def _case(seed=0, lengths=(9, 30, 1), heads=4):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, 192, generator=generator).to(torch.bfloat16)
    k = torch.randn(total, heads, 192, generator=generator).to(torch.bfloat16)
    v = torch.randn(total, heads, 128, generator=generator).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("fp8_query", [False, True], ids=["bf16 q", "fp8 q"])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_prefill_matches_float64(fp8_query, causal):
    q, k, v, cu, longest = _case()
    k8, k_scale = _quantised(k)
    v8, v_scale = _quantised(v)
    keywords = dict(k_scale=k_scale, v_scale=float(v_scale))
    query = q
    if fp8_query:
        query, keywords["q_scale"] = _quantised(q)
    out, lse = mm.ops.mla_prefill(query, k8, v8, cu, cu, longest, longest, SCALE, causal=causal, return_lse=True,
                                  **keywords)
    ref, ref_lse = varlen_attention_reference(q.double(), k.double(), v.double(), cu, cu, SCALE, causal)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert relative_error(out, ref) < 6e-2
    assert relative_error(lse, ref_lse) < 2e-2
    # the dequantised values exactly: FP8 rounding is the only difference from float64 over the rounded inputs
    exact, _ = varlen_attention_reference((query.double() * float(keywords["q_scale"])) if fp8_query else q.double(),
                                          k8.double() * float(k_scale), v8.double() * float(v_scale), cu, cu, SCALE,
                                          causal)
    assert relative_error(out, exact) < 1e-2


def test_fp8_prefill_argument_errors_name_the_argument():
    q, k, v, cu, longest = _case()
    k8, k_scale = _quantised(k)
    v8, v_scale = _quantised(v)
    call = lambda q_, k_, v_, **kw: mm.ops.mla_prefill(q_, k_, v_, cu, cu, longest, longest, SCALE, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="k_scale=None"):
        call(q, k8, v8, v_scale=v_scale)
    with pytest.raises(ValueError, match="v_scale=None"):
        call(q, k8, v8, k_scale=k_scale)
    with pytest.raises(ValueError, match="k_scale"):
        call(q, k8, v8, k_scale=-1.0, v_scale=v_scale)
    with pytest.raises(ValueError, match="q_scale=None"):
        call(q.to(FP8), k8, v8, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="q_scale=.*not FP8"):
        call(q, k8, v8, q_scale=k_scale, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="k_scale=.*not FP8"):
        call(q, k, v, k_scale=k_scale)
    with pytest.raises(ValueError, match="v has dtype"):
        call(q, k8, v, k_scale=k_scale, v_scale=v_scale)


def test_fp8_prefill_selects_a_backend_that_takes_fp8():
    """On the CPU REFERENCE; forced TRITON (bf16 / fp16 prefill kernels) says why not."""
    q, k, v, cu, longest = _case()
    k8, k_scale = _quantised(k)
    v8, v_scale = _quantised(v)
    with pytest.raises(mm.NoBackendError, match="float8_e4m3fn"):
        mm.ops.mla_prefill(q, k8, v8, cu, cu, longest, longest, SCALE, k_scale=k_scale, v_scale=v_scale,
                           backend="TRITON")


def test_fp8_prefill_compiles_fullgraph():
    q, k, v, cu, longest = _case(seed=3)
    k8, k_scale = _quantised(k)
    v8, v_scale = _quantised(v)

    def step(q, k, v, k_scale, v_scale):
        return mm.ops.mla_prefill(q, k, v, cu, cu, longest, longest, SCALE, k_scale=k_scale, v_scale=v_scale) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    expected = step(q, k8, v8, k_scale, v_scale)
    assert torch.equal(compiled(q, k8, v8, k_scale, v_scale), expected)
