"""The TRITON sparse decode kernel under Triton's interpreter on the CPU (float16), against the REFERENCE
backend's float32 math: 16-bit, per-tensor FP8 and fp8_ds_mla caches, topk_length, attn_sink, -1 entries,
duplicates, tokens with no valid index, bad indices (NaN rows, the error flag, no access outside the tensors).

The interpreter cases run in a child process with ``TRITON_INTERPRET=1`` (it must be set before Triton is
imported); the parent checks the results it prints.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from interpreter import memcheck, print_results, run_interpreter_script

CASES = [
    # id, cache format, tokens, heads, topk, block size, with topk_length, with attn_sink
    ("fp16-plain", "fp16", 3, 4, 40, 16, False, False),
    ("fp16-lengths-sink", "fp16", 4, 20, 70, 1, True, True),
    ("fp8-lengths", "fp8", 3, 16, 64, 64, True, False),
    ("ds_mla-sink", "ds", 3, 4, 48, 16, True, True),
    ("fp16-bad-indices", "fp16", 3, 4, 32, 16, False, False),
    # the index lists split over several programs, merged by the reduce kernel (bad indices in one split)
    ("ds_mla-splits-sink", "ds", 3, 20, 128, 64, True, True, 3),
    ("ds_mla-splits-bad-indices", "ds", 3, 4, 96, 16, False, False, 4),
]


def _run_case(case):
    import mla_multi as mm
    from mla_multi import errors
    from mla_multi.backends.reference import _cache_rows, sparse_attention_reference
    from mla_multi.ds_mla_cache import quantize_fp8_ds_mla
    from mla_multi.kernels.sparse_decode import sparse_decode

    case_id, fmt, tokens, heads, topk, block_size, with_lengths, with_sink = case[:8]
    num_splits = case[8] if len(case) > 8 else 1
    generator = torch.Generator().manual_seed(len(case_id) * 7 + topk)
    num_slots = 128  # a multiple of every block size below
    num_blocks = num_slots // block_size
    k_scale = None
    if fmt == "ds":
        cache = quantize_fp8_ds_mla(torch.randn(num_slots, 512, generator=generator),
                                    torch.randn(num_slots, 64, generator=generator)).view(num_blocks, block_size, 656)
    elif fmt == "fp8":
        cache = (torch.randn(num_blocks, block_size, 576, generator=generator) / 0.05).to(torch.float8_e4m3fn)
        k_scale = torch.tensor([0.05])
    else:
        cache = torch.randn(num_blocks, block_size, 576, generator=generator).half()
    q_nope = torch.randn(tokens, heads, 512, generator=generator).half()
    q_pe = torch.randn(tokens, heads, 64, generator=generator).half()
    indices = torch.randint(-1, num_slots, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[0, 3:9] = indices[0, 2]  # duplicates
    indices[1] = -1  # no valid index
    if case_id.endswith("bad-indices"):
        indices[2, 5] = num_slots + 4
    lengths = torch.randint(topk // 4, topk + 1, (tokens,), generator=generator, dtype=torch.int32) if with_lengths else None
    sink = torch.tensor([0.5, -math.inf, math.inf, -1.0] * (heads // 4 + 1))[:heads] if with_sink else None
    errors.error_flag("cpu").zero_()
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.float16)
    lse = torch.full((tokens, heads), float("nan"))
    with memcheck() as violations:
        sparse_decode(q_nope, q_pe, cache, indices, 0.05, k_scale=k_scale, topk_length=lengths, attn_sink=sink,
                      out=out, lse=lse, num_splits=num_splits)
    flag = int(errors.error_flag("cpu").item())
    rows = _cache_rows(cache, k_scale, torch.float32)
    ref, ref_lse, bad = sparse_attention_reference(torch.cat([q_nope, q_pe], -1), rows, indices, 0.05,
                                                   topk_length=lengths, attn_sink=sink)
    good = ~bad
    finite = torch.isfinite(ref_lse[good])
    result = {
        "violations": len(violations),
        "out_err": ((out[good].float() - ref[good]).norm() / ref[good].norm()).item(),
        "out_finite": bool(torch.isfinite(out[good]).all()),
        "lse_err": (lse[good][finite] - ref_lse[good][finite]).abs().max().item() if finite.any() else 0.0,
        "finite_rows": int(finite.sum()),
        "lse_pattern": bool(torch.equal(torch.isfinite(lse[good]), finite)),
        "empty_rows_zero": bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all()),
        "bad_rows_nan": bool(torch.isnan(out[bad]).all()) and bool(torch.isnan(lse[bad]).all()),
        "num_bad": int(bad.sum()),
        "flag": flag,
    }
    # the op forced to TRITON under the interpreter (CPU platform interpreted): a 16-bit cache goes through
    # the index compaction and the dense decode kernels
    if fmt in ("fp16", "ds") and not case_id.endswith("bad-indices"):
        via_op = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.05, topk_length=lengths, attn_sink=sink,
                                          backend="TRITON")
        result["op_err"] = ((via_op.float() - ref).norm() / ref.norm()).item()
    return result


def _run_prefill():
    """Sparse prefill through the same kernel: kv rows [S_kv, 576]; -1 and indices >= S_kv are no token."""
    import mla_multi as mm
    from mla_multi import errors
    from mla_multi.backends.reference import sparse_attention_reference
    from mla_multi.kernels.sparse_decode import sparse_prefill

    generator = torch.Generator().manual_seed(77)
    tokens, heads, topk, rows = 5, 4, 48, 60
    kv = torch.randn(rows, 576, generator=generator).half()
    q_nope = torch.randn(tokens, heads, 512, generator=generator).half()
    q_pe = torch.randn(tokens, heads, 64, generator=generator).half()
    indices = torch.randint(-1, rows + 30, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[3] = rows + 1  # only out-of-range entries: no token
    lengths = torch.tensor([48, 20, 33, 48, 1], dtype=torch.int32)
    errors.error_flag("cpu").zero_()
    with memcheck() as violations:
        out, lse = sparse_prefill(q_nope, q_pe, kv, indices, 0.05, topk_length=lengths)
    ref, ref_lse, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1), kv.float(), indices, 0.05,
                                                 topk_length=lengths, bad_is_error=False)
    finite = torch.isfinite(ref_lse)
    via_op = mm.ops.mla_sparse_prefill(q_nope, q_pe, kv, indices, 0.05, topk_length=lengths, backend="TRITON")
    return {
        "violations": len(violations),
        "out_err": ((out.float() - ref).norm() / ref.norm()).item(),
        "lse_err": (lse[finite] - ref_lse[finite]).abs().max().item(),
        "lse_pattern": bool(torch.equal(torch.isfinite(lse), finite)),
        "none_row_zero": bool((out[3] == 0).all()) and bool(torch.isneginf(lse[3]).all()),
        "flag": int(errors.error_flag("cpu").item()),
        # the op's TRITON prefill runs the dense decode kernels over the compacted indices
        "op_err": ((via_op.float() - ref).norm() / ref.norm()).item(),
    }


# index lists of one pass (up to `_LIST_BLOCK` entries), several passes, and a short one
COMPACT_TOPKS = [2048, 4096 + 904, 100]


def _run_compact():
    """`compact_indices` (the TRITON path's index compaction) against a PyTorch loop: each token's valid
    entries first, in order, duplicates kept; its count, or topk + 1 and the error flag for a bad entry."""
    from mla_multi import errors
    from mla_multi.kernels.sparse_indices import compact_indices

    generator = torch.Generator().manual_seed(5)
    results = {}
    for topk in COMPACT_TOPKS:
        num_slots = 3 * topk
        indices = torch.randint(-1, num_slots, (4, topk), generator=generator, dtype=torch.int32)
        indices[0, topk // 2:] = -1
        indices[1, -5:] = indices[1, 7]  # duplicates
        indices[3, topk - 1] = num_slots  # bad: the token's length past its row, the flag
        lengths = torch.tensor([topk, topk - 3, topk // 3, topk], dtype=torch.int32)
        checks = []
        for with_lengths in (False, True):
            errors.error_flag("cpu").zero_()
            table, lens = compact_indices(indices, num_slots, lengths if with_lengths else None)
            for t in range(4):
                count = int(lengths[t]) if with_lengths else topk
                row = indices[t, :count]
                want = row[(row >= 0) & (row < num_slots)]
                if t == 3:
                    checks.append(int(lens[t]) == topk + 1)
                else:
                    checks.append(int(lens[t]) == want.numel() and torch.equal(table[t, :want.numel()], want))
            checks.append(bool(int(errors.error_flag("cpu").item()) & errors.SPARSE_INDEX))
        results[str(topk)] = checks
    return results


def _interpreter_main():
    results = {case[0]: _run_case(case) for case in CASES}
    results["prefill"] = _run_prefill()
    results["compact"] = _run_compact()
    print_results(results)


@pytest.fixture(scope="module")
def results():
    return run_interpreter_script(__file__, "--interpreter")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sparse_decode_kernel_under_the_interpreter(results, case):
    from mla_multi import errors

    result = results[case[0]]
    assert result["violations"] == 0, result
    assert result["out_finite"] and result["out_err"] < 2e-3, result
    assert result["lse_pattern"] and result["lse_err"] < 1e-3 and result["finite_rows"] > 0, result
    assert result["empty_rows_zero"], result
    if case[0].endswith("bad-indices"):
        assert result["num_bad"] == 1 and result["bad_rows_nan"], result
        assert result["flag"] & errors.SPARSE_INDEX, result
    else:
        assert result["num_bad"] == 0 and result["flag"] == 0, result
    if "op_err" in result:
        assert result["op_err"] < 2e-3, result


@pytest.mark.interpreter
def test_sparse_prefill_kernel_under_the_interpreter(results):
    result = results["prefill"]
    assert result["violations"] == 0 and result["flag"] == 0, result
    assert result["out_err"] < 2e-3 and result["lse_pattern"] and result["lse_err"] < 1e-3, result
    assert result["none_row_zero"] and result["op_err"] < 2e-3, result


@pytest.mark.interpreter
@pytest.mark.parametrize("topk", COMPACT_TOPKS)
def test_index_compaction_in_one_pass_and_in_several(results, topk):
    checks = results["compact"][str(topk)]
    assert len(checks) == 10 and all(checks), checks


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
