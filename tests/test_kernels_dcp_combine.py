"""Tests of the LSE correction kernel of decode context parallelism (mla_multi/kernels/dcp_combine.py).

The interpreter cases run in a child process with ``TRITON_INTERPRET=1``; the GPU
cases run in-process under ``-m gpu``. Each case is checked against float64 math
written here and against the PyTorch version in `mla_multi.distributed`; every
case plants the infinity rules (+inf read as -inf, a -inf rank contributes
nothing even with a NaN output, all ranks -inf give 0 and -inf) and NaN-poisons
the destination buffers.
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreter import print_results, run_interpreter_script

# (case id, dtype, world size, rank, rows, heads per rank, head dim, strided partial output)
INTERPRETER_CASES = [
    ("float32-w2-r0-rows5-h3-d64", "float32", 2, 0, 5, 3, 64, False),
    ("float32-w3-r2-rows4-h4-d512-strided", "float32", 3, 2, 4, 4, 512, True),
    ("float16-w2-r1-rows6-h8-d128", "float16", 2, 1, 6, 8, 128, False),
    ("float32-w1-r0-rows3-h5-d96", "float32", 1, 0, 3, 5, 96, False),
]


def _make_inputs(dtype, world, rank, rows, num_local, head_dim, strided, device, generator):
    num_heads = world * num_local
    if strided:  # heads as a strided view of a wider buffer
        partial = torch.randn(rows, num_heads * 2, head_dim, generator=generator)[:, ::2]
    else:
        partial = torch.randn(rows, num_heads, head_dim, generator=generator)
    lses = torch.randn(world, rows, num_heads, generator=generator) * 4
    inf = float("inf")
    # Plants, one per row: every rank empty; this rank without tokens and a NaN
    # partial output; +inf.
    lses[:, 0, 0] = -inf
    partial[0, 0] = float("nan")
    if rows > 1:
        lses[rank, 1, num_heads - 1] = -inf
        partial[1, num_heads - 1] = float("nan")
    if rows > 2:
        lses[0, 2, 1 % num_heads] = inf
    return partial.to(device=device, dtype=dtype), lses.to(device)


def _reference(partial, lses, rank, num_local):
    """float64: dest[w, r, h] = exp(lse_rank - lse) * out[r, w * num_local + h]; lse over all ranks."""
    lses = lses.double().cpu()
    lses = torch.where(lses == float("inf"), float("-inf"), lses)
    total = torch.logsumexp(lses, dim=0)
    finite = torch.isfinite(total)
    factor = torch.where(finite, torch.exp(lses[rank] - torch.where(finite, total, 0.0)), 0.0)
    # The planted NaN sits where its weight is 0: the oracle reads it as 0 (0 * NaN would poison it).
    corrected = torch.where(factor.unsqueeze(-1) > 0, partial.double().cpu() * factor.unsqueeze(-1), 0.0)
    world = lses.shape[0]
    rows, num_heads, head_dim = partial.shape
    dest = corrected.view(rows, world, num_local, head_dim).transpose(0, 1)
    return dest, total[:, rank * num_local : (rank + 1) * num_local]


def _compare(dest, lse, ref_dest, ref_lse):
    finite = torch.isfinite(ref_lse)
    return {
        "dest_err": ((dest.double().cpu() - ref_dest).norm() / ref_dest.norm()).item()
        if torch.isfinite(dest).all()
        else float("inf"),
        "lse_err": (lse.double().cpu() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0,
        "inf_pattern_ok": bool(torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))),
    }


def _run_case(case, device):
    from mla_multi.distributed import correct_partial_outputs_reference
    from mla_multi.kernels.dcp_combine import dcp_correct

    case_id, dtype_name, world, rank, rows, num_local, head_dim, strided = case
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(rows * 100 + num_local * 10 + world)
    partial, lses = _make_inputs(dtype, world, rank, rows, num_local, head_dim, strided, device, generator)
    dest = torch.full((world, rows, num_local, head_dim), float("nan"), dtype=dtype, device=device)
    dest_lse = torch.full((rows, num_local), float("nan"), device=device)
    out, out_lse = dcp_correct(partial, lses, rank, num_local, dest=dest, dest_lse=dest_lse)
    ref_dest, ref_lse = _reference(partial, lses, rank, num_local)
    result = _compare(out, out_lse, ref_dest, ref_lse)
    torch_dest, torch_lse = correct_partial_outputs_reference(partial, lses, rank, num_local)
    torch_result = _compare(torch_dest, torch_lse, ref_dest, ref_lse)
    result.update({f"torch_{key}": value for key, value in torch_result.items()})
    result["buffers_used"] = out.data_ptr() == dest.data_ptr() and out_lse.data_ptr() == dest_lse.data_ptr()
    return result


def _check(result, dtype_name):
    tolerance = 1e-6 if dtype_name == "float32" else 2e-3 if dtype_name == "float16" else 8e-3
    for prefix in ("", "torch_"):
        assert result[prefix + "dest_err"] <= tolerance, result
        assert result[prefix + "lse_err"] <= 1e-5 and result[prefix + "inf_pattern_ok"], result


def _interpreter_main():
    print_results({case[0]: _run_case(case, "cpu") for case in INTERPRETER_CASES})


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__, "--interpreter")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=[c[0] for c in INTERPRETER_CASES])
def test_dcp_correct_interpreter(interpreter_results, case):
    result = interpreter_results[case[0]]
    _check(result, case[1])
    assert result["buffers_used"], result


@pytest.mark.parametrize(
    "change, match",
    [
        ("partial_2d", "partial_output=.*accepted: a 3-D tensor"),
        ("partial_int", "partial_output=.*accepted: float16, bfloat16 or float32"),
        ("heads", "num_local_heads=5; accepted: a positive divisor of the 6 heads"),
        ("rank", r"rank=3; accepted: an int in \[0, 3\)"),
        ("lses_shape", r"lses=.*accepted: float32 \[3, 4, 6\]"),
        ("lses_dtype", "lses=.*accepted: float32"),
        ("dest_shape", r"dest=.*accepted: float \[3, 4, 2, 8\]"),
        ("dest_lse_dtype", r"dest_lse=.*accepted: float32 \[4, 2\]"),
    ],
)
def test_dcp_correct_bad_input(change, match):
    from mla_multi.kernels.dcp_combine import dcp_correct

    args = dict(partial_output=torch.zeros(4, 6, 8), lses=torch.zeros(3, 4, 6), rank=1, num_local_heads=2)
    if change == "partial_2d":
        args["partial_output"] = torch.zeros(4, 48)
    elif change == "partial_int":
        args["partial_output"] = torch.zeros(4, 6, 8, dtype=torch.int32)
    elif change == "heads":
        args["num_local_heads"] = 5
    elif change == "rank":
        args["rank"] = 3
    elif change == "lses_shape":
        args["lses"] = torch.zeros(2, 4, 6)
    elif change == "lses_dtype":
        args["lses"] = torch.zeros(3, 4, 6, dtype=torch.float64)
    elif change == "dest_shape":
        args["dest"] = torch.zeros(3, 4, 6, 8)
    elif change == "dest_lse_dtype":
        args["dest_lse"] = torch.zeros(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        dcp_correct(**args)


GPU_CASES = [
    ("bfloat16-w2-r1-rows128-h64-d512", "bfloat16", 2, 1, 128, 64, 512, False),
    ("bfloat16-w3-r0-rows7-h8-d512-strided", "bfloat16", 3, 0, 7, 8, 512, True),
    ("float16-w4-r3-rows33-h16-d512", "float16", 4, 3, 33, 16, 512, False),
    ("float32-w2-r0-rows1000-h4-d512", "float32", 2, 0, 1000, 4, 512, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_dcp_correct_gpu(case):
    result = _run_case(case, "cuda")
    _check(result, case[1])
    assert result["buffers_used"], result


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
