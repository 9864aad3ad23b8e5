"""Tests of the Triton LSE merge kernel (mla_multi/kernels/merge.py).

The interpreter cases run in a child process with ``TRITON_INTERPRET=1`` (it must be
set before triton is imported); the GPU cases run in-process under ``-m gpu``.
Every case plants the infinity rules: +inf read as -inf, both sides -inf -> 0 and
-inf, a -inf side whose output holds NaN contributes nothing.
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreter import print_results, run_interpreter_script


# (case id, dtype, num_tokens, num_heads, head_dim, strided inputs, output lse buffer)
INTERPRETER_CASES = [
    ("float32-t7-h11-d128", "float32", 7, 11, 128, False, True),
    ("float16-t5-h16-d128-strided", "float16", 5, 16, 128, True, True),
    ("float16-t9-h3-d96-nolse", "float16", 9, 3, 96, False, False),
    ("float32-t1-h8-d512", "float32", 1, 8, 512, True, True),
]


def _make_inputs(dtype, num_tokens, num_heads, head_dim, strided, device, generator=None):
    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    if strided:  # outputs as views into wider buffers, LSE as a transposed [T, N] buffer
        prefix_output = rand(num_tokens, num_heads, head_dim + 32)[:, :, 16 : 16 + head_dim]
        suffix_output = rand(num_tokens, num_heads * 2, head_dim)[:, ::2]
        prefix_lse = (torch.randn(num_heads, num_tokens + 3, generator=generator) * 4)[:, 1 : 1 + num_tokens]
        suffix_lse = torch.randn(num_heads, num_tokens, generator=generator) * 4
    else:
        prefix_output = rand(num_tokens, num_heads, head_dim)
        suffix_output = rand(num_tokens, num_heads, head_dim)
        prefix_lse = torch.randn(num_heads, num_tokens, generator=generator) * 4
        suffix_lse = torch.randn(num_heads, num_tokens, generator=generator) * 4
    prefix_lse, suffix_lse = prefix_lse.to(device), suffix_lse.to(device)
    inf = float("inf")
    # The infinity rules, planted on the diagonal (token t, head t).
    plants = [(-inf, -inf), (inf, -inf), (inf, inf), (-inf, 1.5), (2.0, inf), (-inf, inf)]
    for i, (p, s) in enumerate(plants[: min(num_tokens, num_heads)]):
        prefix_lse[i, i] = p
        suffix_lse[i, i] = s
    if num_tokens > 3 and num_heads > 3:
        prefix_output[3, 3] = float("nan")  # prefix side is -inf there: must not leak
    return prefix_output, prefix_lse, suffix_output, suffix_lse


def _reference(prefix_output, prefix_lse, suffix_output, suffix_lse):
    from mla_multi.backends.reference import merge_attn_states_reference

    # The planted NaN sits where its side's weight is 0: it must contribute nothing, so
    # the float64 oracle sees a 0 there (0 * NaN would poison the oracle itself).
    return merge_attn_states_reference(
        prefix_output.double().nan_to_num(0.0), prefix_lse.double(), suffix_output.double(), suffix_lse.double()
    )


def _compare(out, lse, ref_out, ref_lse):
    out_err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    result = {
        "out_err": out_err if out.isfinite().all() else float("inf"),
        "out_nan": bool(out.isnan().any()),
        "empty_zero": bool((out.double()[torch.isneginf(ref_lse).t()] == 0).all()),
    }
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        result["lse_err"] = (lse.double() - ref_lse)[finite].abs().max().item()
        result["lse_nan"] = bool(lse.isnan().any())
        result["inf_pattern_ok"] = bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)))
    return result


def _run_interpreter_case(case):
    from mla_multi.kernels.merge import merge_attn_states

    case_id, dtype_name, num_tokens, num_heads, head_dim, strided, with_lse = case
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(num_tokens * 1000 + num_heads * 10 + head_dim)
    inputs = _make_inputs(dtype, num_tokens, num_heads, head_dim, strided, "cpu", generator)
    output = torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=dtype)
    output_lse = torch.full((num_heads, num_tokens), float("nan")) if with_lse else None
    out, lse = merge_attn_states(*inputs, output=output, output_lse=output_lse, return_lse=with_lse)
    ref_out, ref_lse = _reference(*inputs)
    result = _compare(out, lse, ref_out, ref_lse)
    result["buffers_used"] = out.data_ptr() == output.data_ptr() and (
        (lse is None) if not with_lse else lse.data_ptr() == output_lse.data_ptr()
    )
    return result


def _interpreter_main():
    results = {case[0]: _run_interpreter_case(case) for case in INTERPRETER_CASES}
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__, "--interpreter")


def _check(result, dtype_name, with_lse):
    tol = 1e-6 if dtype_name == "float32" else 2e-3
    assert not result["out_nan"], result
    assert result["out_err"] <= tol and result["empty_zero"], result
    if with_lse:
        assert not result["lse_nan"] and result["lse_err"] <= 1e-5 and result["inf_pattern_ok"], result


@pytest.mark.interpreter
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=[c[0] for c in INTERPRETER_CASES])
def test_merge_attn_states_interpreter(interpreter_results, case):
    result = interpreter_results[case[0]]
    _check(result, case[1], case[6])
    assert result["buffers_used"], result


@pytest.mark.parametrize(
    "change, match",
    [
        ("prefix_output_2d", "prefix_output must be a 3-D"),
        ("suffix_output_shape", "suffix_output must have shape"),
        ("prefix_lse_dtype", "prefix_lse.dtype"),
        ("suffix_lse_shape", "suffix_lse must have shape"),
        ("output_shape", "output must have shape"),
        ("output_lse_dtype", "output_lse.dtype"),
        ("int_output", "prefix_output.dtype"),
    ],
)
def test_merge_attn_states_bad_input(change, match):
    from mla_multi.kernels.merge import merge_attn_states

    args = dict(
        prefix_output=torch.zeros(4, 2, 128),
        prefix_lse=torch.zeros(2, 4),
        suffix_output=torch.zeros(4, 2, 128),
        suffix_lse=torch.zeros(2, 4),
    )
    if change == "prefix_output_2d":
        args["prefix_output"] = torch.zeros(4, 256)
    elif change == "suffix_output_shape":
        args["suffix_output"] = torch.zeros(4, 3, 128)
    elif change == "prefix_lse_dtype":
        args["prefix_lse"] = torch.zeros(2, 4, dtype=torch.float16)
    elif change == "suffix_lse_shape":
        args["suffix_lse"] = torch.zeros(4, 2)
    elif change == "output_shape":
        args["output"] = torch.zeros(4, 2, 64)
    elif change == "output_lse_dtype":
        args["output_lse"] = torch.zeros(2, 4, dtype=torch.float64)
    elif change == "int_output":
        args["prefix_output"] = torch.zeros(4, 2, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        merge_attn_states(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(4099, 128, 128), (3, 16, 512), (1000, 13, 128)])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_merge_attn_states_gpu(dtype, num_tokens, num_heads, head_dim, strided):
    from mla_multi.kernels.merge import merge_attn_states

    torch.manual_seed(num_tokens + num_heads)
    inputs = _make_inputs(dtype, num_tokens, num_heads, head_dim, strided, "cuda")
    output = torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    output_lse = torch.full((num_heads, num_tokens), float("nan"), device="cuda")
    out, lse = merge_attn_states(*inputs, output=output, output_lse=output_lse)
    ref_out, ref_lse = _reference(*inputs)
    result = _compare(out, lse, ref_out, ref_lse)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert not result["out_nan"] and not result["lse_nan"], result
    assert result["out_err"] <= tol and result["empty_zero"], result
    assert result["lse_err"] <= 1e-5 and result["inf_pattern_ok"], result


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
