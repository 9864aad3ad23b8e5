"""The Triton split-KV MLA decode kernel against a float64 reference.

* CPU: the Triton interpreter (TRITON_INTERPRET=1 must be set before triton is
  imported, so the cases run in one subprocess: this file executed as a script)
  with float16 queries and float16 / FP8 caches, small dims.
* GPU (marked ``gpu``): bf16 and FP8, heads 1..128, block sizes 1/16/64,
  sequence lengths 0..32768 mixed in one batch, and CUDA-graph capture/replay.
"""

from __future__ import annotations


import pytest
import torch
from interpreter import print_results, run_interpreter_script


def _reference(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, k_scale):
    """float64 reference (the package's REFERENCE backend when present)."""
    try:
        from mla_multi.backends.reference import mla_decode_reference
    except ImportError:  # pragma: no cover - the reference backend ships with the package
        mla_decode_reference = None
    if mla_decode_reference is not None:
        return mla_decode_reference(
            q_nope.double(), q_pe.double(), kv_cache, block_table, seq_lens, scale, k_scale=k_scale
        )
    single = q_nope.dim() == 3
    qn = q_nope.double().unsqueeze(1) if single else q_nope.double()
    qp = q_pe.double().unsqueeze(1) if single else q_pe.double()
    batch, q_len, heads, lora = qn.shape
    out = torch.zeros(batch, q_len, heads, lora, dtype=torch.float64)
    lse = torch.full((batch, q_len, heads), float("-inf"), dtype=torch.float64)
    block = kv_cache.shape[1]
    out, lse = out.to(qn.device), lse.to(qn.device)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        pos = torch.arange(length, device=qn.device)
        rows = kv_cache[block_table[b, pos // block].long(), pos % block].double()
        if k_scale is not None:
            rows = rows * float(k_scale.reshape(()))
        scores = torch.einsum("qhd,sd->qhs", torch.cat([qn[b], qp[b]], -1), rows) * scale
        limit = length - q_len + 1 + torch.arange(q_len, device=qn.device)
        scores = scores.masked_fill(~(pos[None, :] < limit[:, None])[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, -1)
        probs = torch.where(torch.isfinite(row_lse)[..., None], torch.exp(scores - row_lse[..., None]), 0.0)
        out[b] = torch.einsum("qhs,sd->qhd", probs.nan_to_num(0.0), rows[:, :lora])
        lse[b] = row_lse
    return (out.squeeze(1), lse.squeeze(1)) if single else (out, lse)


def _make_case(batch, heads, q_len, lora, rope, block_size, seq_lens, cache_dtype, q_dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(1, -(-max(seq_lens) // block_size)) + 1
    num_blocks = batch * max_blocks + 2
    cache = torch.randn(num_blocks, block_size, lora + rope, generator=generator)
    # scattered pages: a permutation, so block tables are not the identity
    block_table = torch.randperm(num_blocks, generator=generator)[: batch * max_blocks].reshape(batch, max_blocks)
    # every cache row no request may read is NaN: rows past a sequence in its
    # last page, its spare pages and the pages of no request
    readable = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, length in enumerate(seq_lens):
        pos = torch.arange(length)
        readable[block_table[b, pos // block_size], pos % block_size] = True
    cache[~readable] = float("nan")
    k_scale = None
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        k_scale = torch.tensor([0.0125], dtype=torch.float32)
        limit = 448.0 if cache_dtype == torch.float8_e4m3fn else 240.0
        cache = (cache / k_scale).clamp(-limit, limit).to(cache_dtype)
    else:
        cache = cache.to(cache_dtype)
    shape = (batch, heads) if q_len == 1 else (batch, q_len, heads)
    q_nope = torch.randn(*shape, lora, generator=generator).to(q_dtype)
    q_pe = torch.randn(*shape, rope, generator=generator).to(q_dtype)
    tensors = dict(
        q_nope=q_nope,
        q_pe=q_pe,
        kv_cache=cache,
        block_table=block_table.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        k_scale=k_scale,
    )
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in tensors.items()}


def _e4m3_query(tensors: dict) -> dict:
    """`tensors` with the query as the FP8 QK path computes with it: each row (576 values) multiplied by the
    power of two that puts its largest magnitude in [128, 256), rounded to e4m3 and divided back (exact in
    bfloat16)."""
    q = torch.cat([tensors["q_nope"], tensors["q_pe"]], dim=-1).float()
    _, exponent = torch.frexp(q.abs().amax(dim=-1, keepdim=True))  # amax = m * 2^exponent, m in [0.5, 1)
    up = torch.ldexp(torch.ones_like(q[..., :1]), 8 - exponent)
    q = ((q * up).to(torch.float8_e4m3fn).float() / up).to(tensors["q_nope"].dtype)
    lora = tensors["q_nope"].shape[-1]
    return {**tensors, "q_nope": q[..., :lora].contiguous(), "q_pe": q[..., lora:].contiguous()}


def _run_decode(tensors, scale, num_kv_splits, max_splits=None, **kwargs):
    from mla_multi.kernels.mla_decode import attn_logits_width, mla_decode_fwd

    q_nope = tensors["q_nope"]
    shape = q_nope.shape[:-1]
    rows = q_nope.shape[0] * (q_nope.shape[1] if q_nope.dim() == 4 else 1)
    lora = q_nope.shape[-1]
    device = q_nope.device
    out = torch.full(q_nope.shape, float("nan"), dtype=q_nope.dtype, device=device)
    lse = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    attn_logits = torch.full(
        (rows, shape[-1], max_splits or num_kv_splits, attn_logits_width(lora)),
        float("nan"),
        dtype=torch.float32,
        device=device,
    )
    mla_decode_fwd(
        q_nope,
        tensors["q_pe"],
        tensors["kv_cache"],
        tensors["block_table"],
        tensors["seq_lens"],
        scale,
        k_scale=tensors["k_scale"],
        num_kv_splits=num_kv_splits,
        attn_logits=attn_logits,
        out=out,
        lse=lse,
        **kwargs,
    )
    return out, lse


def _errors(tensors, out, lse, scale):
    # the reference runs where the inputs are (float64 on the GPU is fast enough)
    ref_out, ref_lse = _reference(
        tensors["q_nope"],
        tensors["q_pe"],
        tensors["kv_cache"],
        tensors["block_table"],
        tensors["seq_lens"],
        scale,
        tensors["k_scale"],
    )
    ref_out, ref_lse = ref_out.cpu().double(), ref_lse.cpu().double()
    out, lse = out.cpu().double(), lse.cpu().double()
    finite = torch.isfinite(ref_lse)
    empty_rows = out[~finite]
    return {
        "rel_err": float((out - ref_out).norm() / ref_out.norm().clamp_min(1e-300)),
        "lse_err": float((lse[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0,
        "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        "inf_pattern_ok": bool(torch.equal(~finite, lse == float("-inf"))),
        "empty_rows_zero": bool((empty_rows == 0).all()) if empty_rows.numel() else True,
    }


def _sink_errors(tensors, out, lse, scale, sink):
    """`_errors` against the float64 reference times exp(lse) / (exp(lse) + exp(sink)) per head (1 where the row
    has no mass), the LSE the reference's own."""
    ref_out, ref_lse = _reference(
        tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"], scale,
        tensors["k_scale"],
    )
    ref_out, ref_lse, sink = ref_out.cpu().double(), ref_lse.cpu().double(), sink.cpu().double()
    finite = torch.isfinite(ref_lse)
    factor = torch.where(finite, torch.sigmoid(torch.where(finite, ref_lse, 0.0) - sink), 1.0)
    ref_out = ref_out * factor.unsqueeze(-1)
    out, lse = out.cpu().double(), lse.cpu().double()
    return {
        "rel_err": float((out - ref_out).norm() / ref_out.norm().clamp_min(1e-300)),
        "lse_err": float((lse[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0,
        "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        "inf_pattern_ok": bool(torch.equal(~finite, lse == float("-inf"))),
        "empty_rows_zero": bool((out[~finite] == 0).all()),
        # +inf sink: the head's rows all zero; -inf: the rows as without a sink
        "inf_sink_zero": bool((out[..., sink == float("inf"), :] == 0).all()),
    }


# an attention sink per head: finite either way, +inf (zero output), -inf (no effect)
SINK = [0.5, float("inf"), float("-inf"), -1.0]
# (id, lora, rope, splits): one split (the output written by the split kernel) and several (the reduce)
SINK_CASES = [("sink-direct", 64, 16, 1), ("sink-splits", 64, 16, 3), ("sink-deepseek-splits", 512, 64, 2)]

# (id, batch, heads, q_len, lora, rope, block_size, seq_lens, cache dtype name, splits, platform name or None)
INTERPRETER_CASES = [
    ("h1-bs16-splits3", 3, 1, 1, 64, 16, 16, [37, 0, 1], "float16", 3, None),
    ("h3-bs1-direct", 3, 3, 1, 64, 16, 1, [5, 1, 0], "float16", 1, None),
    ("h16-bs64-odd", 3, 16, 1, 64, 16, 64, [100, 65, 17], "float16", 2, None),
    ("h40-two-head-blocks", 2, 40, 1, 64, 16, 16, [33, 50], "float16", 2, None),
    ("h3-q3-causal", 3, 3, 3, 64, 16, 16, [40, 3, 2], "float16", 2, None),
    ("h20-q2-folded", 2, 20, 2, 64, 16, 16, [29, 2], "float16", 3, None),
    ("empty-splits", 1, 2, 1, 64, 16, 16, [20], "float16", 8, None),
    ("many-splits-two-merge-steps", 2, 2, 1, 64, 16, 16, [1200, 0], "float16", 70, None),
    ("fp8-e4m3fn", 2, 4, 1, 64, 16, 16, [40, 19], "float8_e4m3fn", 4, None),
    ("fp8-e4m3fnuz", 2, 4, 1, 64, 16, 64, [70, 0], "float8_e4m3fnuz", 2, None),
    ("fp8-e4m3fnuz-bit-decode", 2, 4, 1, 64, 16, 16, [40, 9], "float8_e4m3fnuz", 2, "H100"),
    ("fp8-e4m3fn-bit-decode", 2, 3, 1, 64, 16, 16, [23, 31], "float8_e4m3fn", 2, "A100"),
    ("fp8-e4m3fnuz-amd-tiles", 2, 20, 1, 64, 16, 16, [45, 17], "float8_e4m3fnuz", 2, "MI300X"),
    ("deepseek-dims", 2, 16, 1, 512, 64, 16, [70, 33], "float16", 2, None),
    ("h2-bs32", 2, 2, 1, 64, 16, 32, [70, 5], "float16", 2, None),
    ("h2-bs128", 2, 2, 1, 64, 16, 128, [200, 129], "float16", 2, None),
    ("h2-q8-bs256-spec-decode", 1, 2, 8, 64, 16, 256, [300], "float16", 2, None),
    # the AMD tables from 17 rows on: 64-token tiles with the tokens as M
    ("amd-mi300x-h40-tokens-as-m", 2, 40, 1, 64, 16, 64, [150, 17], "float16", 2, "MI300X"),
    ("amd-mi355x-fp8-h20-tokens-as-m", 2, 20, 1, 64, 16, 16, [130, 0], "float8_e4m3fn", 3, "MI355X"),
    ("amd-mi300x-fp8-h40-q2-tokens-as-m", 2, 40, 2, 64, 16, 128, [200, 65], "float8_e4m3fnuz", 2, "MI300X"),
]

# QK as K Q^T (`DecodeLaunchConfig.tokens_as_m`) with an explicit configuration:
# (id, heads, q_len, block_size, seq_lens, cache dtype name, splits, (block_h, block_n, warps))
TOKENS_AS_M_CASES = [
    (f"tokens-as-m-bs{block_size}-splits{splits}", 20, 1, block_size, [0, 1, 17, 300], "float16", splits, (32, 64, 4))
    for block_size in (1, 16, 64, 128)
    for splits in (1, 3)
] + [
    ("tokens-as-m-h16-q3-causal", 5, 3, 16, [40, 3, 2, 130], "float16", 2, (16, 64, 4)),
    ("tokens-as-m-fp8-e4m3fn", 4, 1, 64, [70, 19, 1, 0], "float8_e4m3fn", 2, (16, 64, 4)),
    ("tokens-as-m-fp8-e4m3fnuz", 40, 1, 16, [90, 33, 64, 5], "float8_e4m3fnuz", 3, (32, 64, 4)),
]


def _interpreter_main() -> None:
    """Run every interpreter case; print one JSON object per case (this file as a script)."""
    from mla_multi.kernels.launch_config import DecodeLaunchConfig
    from mla_multi.platforms import SPECS

    results = {}
    for case_id, batch, heads, q_len, lora, rope, block_size, seq_lens, dtype_name, splits, platform in INTERPRETER_CASES:
        tensors = _make_case(
            batch, heads, q_len, lora, rope, block_size, seq_lens, getattr(torch, dtype_name), torch.float16, "cpu", 7
        )
        scale = (lora + rope) ** -0.5
        kwargs = {"platform": SPECS[platform]} if platform else {}
        out, lse = _run_decode(tensors, scale, splits, max_splits=splits + 1, **kwargs)
        results[case_id] = _errors(tensors, out, lse, scale)
    # FP8 caches take float16 products: a bfloat16 query far outside float16's
    # range (both ways) is scaled by a power of two first (the softmax scale
    # compensates, so these are the usual scores)
    for case_id, factor in (("fp8-query-beyond-float16-max", 2.0**17), ("fp8-query-below-float16-min", 2.0**-30)):
        tensors = _make_case(2, 4, 1, 64, 16, 16, [40, 19], torch.float8_e4m3fn, torch.bfloat16, "cpu", 5)
        tensors["q_nope"] = tensors["q_nope"] * factor
        tensors["q_pe"] = tensors["q_pe"] * factor
        scale = 80**-0.5 / factor
        out, lse = _run_decode(tensors, scale, 2, max_splits=3)
        results[case_id] = _errors(tensors, out, lse, scale)
    for case_id, heads, q_len, block_size, seq_lens, dtype_name, splits, tile in TOKENS_AS_M_CASES:
        tensors = _make_case(
            len(seq_lens), heads, q_len, 64, 16, block_size, seq_lens, getattr(torch, dtype_name), torch.float16,
            "cpu", 13,
        )
        config = DecodeLaunchConfig(*tile, 1, tokens_as_m=True)
        out, lse = _run_decode(tensors, 80**-0.5, splits, max_splits=splits + 1, config=config)
        results[case_id] = _errors(tensors, out, lse, 80**-0.5)
    # the tile loop without loop-invariant code motion (the sm_90 64-row tiles' loop)
    tensors = _make_case(2, 40, 1, 64, 16, 16, [45, 70], torch.float16, torch.float16, "cpu", 11)
    config = DecodeLaunchConfig(64, 16, 4, 1, disable_licm=True)
    for case_id, splits in (("no-licm-loop-direct", 1), ("no-licm-loop-splits", 3)):
        out, lse = _run_decode(tensors, 80**-0.5, splits, max_splits=4, config=config)
        results[case_id] = _errors(tensors, out, lse, 80**-0.5)
    for case_id, lora, rope, splits in SINK_CASES:
        tensors = _make_case(3, len(SINK), 1, lora, rope, 16, [37, 0, 5], torch.float16, torch.float16, "cpu", 3)
        scale = (lora + rope) ** -0.5
        sink = torch.tensor(SINK)
        out, lse = _run_decode(tensors, scale, splits, max_splits=splits + 1, attn_sink=sink)
        results[case_id] = _sink_errors(tensors, out, lse, scale, sink)
    for beside in (False, True):
        results[f"merge-drops-rows-of-splits-without-mass-{beside}"] = _merge_poisoned_partials(beside)
    print_results(results)


def _merge_poisoned_partials(beside: bool):
    """The split merge alone over partials whose splits without mass (LSE -inf) hold NaN and +inf rows (a
    kernel may leave them unwritten): row 0 mixes such splits with finite ones, row 1 has no mass at all, row 2
    holds a split of NaN LSE (bad index data). Against the merge in float64. `beside`: the rows loaded with the
    LSEs (PARTIALS_BESIDE_LSE, NVIDIA's way), else after them."""
    from mla_multi.kernels.mla_decode import _mla_decode_reduce_kernel, attn_logits_width

    rows, heads, splits, lora = 3, 2, 5, 64
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(rows, heads, splits, attn_logits_width(lora), generator=gen)
    split_lse = logits[..., lora]
    split_lse[0, :, 1] = float("-inf")
    split_lse[0, :, 3] = float("-inf")
    split_lse[1] = float("-inf")
    split_lse[2, :, 4] = float("nan")
    empty = split_lse == float("-inf")
    partial = logits[..., :lora]
    partial[empty] = float("nan")
    partial[0, 1, 3] = float("inf")
    out = torch.full((rows, heads, lora), float("nan"))
    lse = torch.full((rows, heads), float("nan"))
    _mla_decode_reduce_kernel[(rows, heads, 1)](
        logits, out, lse, lse, splits, logits.stride(0), logits.stride(1), logits.stride(2), out.stride(0), 0,
        out.stride(1), lse.stride(0), 0, lse.stride(1), Q_LEN=1, KV_LORA_RANK=lora, BLOCK_DV=lora, BLOCK_SPLITS=8,
        PARTIALS_BESIDE_LSE=beside,
    )
    weights = torch.softmax(split_lse[:2].double(), dim=-1).nan_to_num(0.0)
    ref = (weights.unsqueeze(-1) * partial[:2].double().nan_to_num(0.0, posinf=0.0)).sum(-2)
    ref_lse = torch.logsumexp(split_lse[:2].double(), dim=-1)
    return {
        "rel_err": float((out[0].double() - ref[0]).norm() / ref[0].norm()),
        "lse_err": float((lse[0].double() - ref_lse[0]).abs().max()),
        "empty_row": bool((out[1] == 0).all() and (lse[1] == float("-inf")).all()),
        "bad_row_nan": bool(torch.isnan(out[2]).all() and torch.isnan(lse[2]).all()),
    }


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__)


@pytest.mark.parametrize(
    "case_id",
    [case[0] for case in INTERPRETER_CASES + TOKENS_AS_M_CASES] + ["no-licm-loop-direct", "no-licm-loop-splits"],
)
def test_decode_interpreter(interpreter_results, case_id):
    result = interpreter_results[case_id]
    assert not result["nan"], result
    assert result["inf_pattern_ok"], result
    assert result["empty_rows_zero"], result
    # float16 output and float16 products: ~1e-3 relative; FP8 values are exact in float16
    assert result["rel_err"] <= 3e-3, result
    assert result["lse_err"] <= 2e-3, result


@pytest.mark.parametrize("beside", [False, True], ids=["after-the-lse", "beside-the-lse"])
def test_merge_drops_the_rows_of_splits_without_mass(interpreter_results, beside):
    # splits of LSE -inf whose rows hold NaN / +inf: never weighed, whether read beside their LSEs and dropped
    # (NVIDIA) or not read (AMD)
    result = interpreter_results[f"merge-drops-rows-of-splits-without-mass-{beside}"]
    assert result["rel_err"] <= 1e-6 and result["lse_err"] <= 1e-5, result
    assert result["empty_row"] and result["bad_row_nan"], result


@pytest.mark.parametrize("case_id", ["fp8-query-beyond-float16-max", "fp8-query-below-float16-min"])
def test_decode_interpreter_fp8_query_range(interpreter_results, case_id):
    result = interpreter_results[case_id]
    assert not result["nan"], result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"], result
    # bfloat16 query and output: the bf16 bound
    assert result["rel_err"] <= 1e-2, result
    assert result["lse_err"] <= 2e-2, result


@pytest.mark.parametrize("case_id", [case[0] for case in SINK_CASES])
def test_decode_interpreter_attention_sink(interpreter_results, case_id):
    result = interpreter_results[case_id]
    assert not result["nan"], result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"] and result["inf_sink_zero"], result
    assert result["rel_err"] <= 3e-3, result
    assert result["lse_err"] <= 2e-3, result


def _inputs(**overrides):
    tensors = _make_case(2, 4, 1, 64, 16, 16, [5, 9], torch.float16, torch.float16, "cpu", 0)
    tensors.update(overrides)
    return tensors


@pytest.mark.parametrize(
    "overrides, splits, message",
    [
        ({"block_table": torch.zeros(2, 2, dtype=torch.int64)}, 1, "block_table"),
        ({"seq_lens": torch.zeros(3, dtype=torch.int32)}, 1, "seq_lens"),
        ({"q_pe": torch.zeros(2, 4, 32, dtype=torch.float16)}, 1, "kv_cache"),
        ({"kv_cache": torch.zeros(4, 16, 80, dtype=torch.float8_e4m3fn)}, 1, "k_scale"),
        ({}, 5, "num_kv_splits"),
    ],
    ids=["block-table-int64", "seq-lens-shape", "rope-mismatch", "fp8-without-scale", "too-many-splits"],
)
def test_bad_input_raises(overrides, splits, message):
    tensors = _inputs(**overrides)
    with pytest.raises(ValueError, match=message):
        _run_decode(tensors, 0.1, splits, max_splits=4)


def test_attn_logits_rows_are_aligned_and_narrow_rows_rejected():
    from mla_multi.kernels.mla_decode import attn_logits_width, mla_decode_fwd

    # the partial output, its LSE, padding to 16 float32 values
    assert [attn_logits_width(rank) for rank in (16, 64, 512)] == [32, 80, 528]
    tensors = _inputs()
    q_nope = tensors["q_nope"]
    narrow = torch.zeros(2, 4, 1, 64, dtype=torch.float32)  # Lkv columns, no room for the LSE
    with pytest.raises(ValueError, match=r"attn_logits has shape \(2, 4, 1, 64\).*>= 65.*attn_logits_width\(64\) = 80"):
        mla_decode_fwd(
            q_nope, tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"], 0.1,
            k_scale=None, num_kv_splits=1, attn_logits=narrow, out=torch.empty_like(q_nope),
            lse=torch.empty(q_nope.shape[:-1], dtype=torch.float32),
        )


def test_triton_backend_reserves_aligned_partial_rows():
    from mla_multi.backends.triton import TritonDecodeImpl
    from mla_multi.kernels.mla_decode import attn_logits_width

    impl = TritonDecodeImpl.__new__(TritonDecodeImpl)
    impl.num_heads, impl.kv_lora_rank = 16, 512
    logits_spec = impl._workspace_specs(8, 4, (8, 16, 512), torch.bfloat16)[0]
    assert logits_spec == ((8, 16, 4, attn_logits_width(512)), torch.float32)


def test_unsupported_lora_rank_is_rejected():
    tensors = _make_case(1, 2, 1, 48, 16, 16, [4], torch.float16, torch.float16, "cpu", 0)
    with pytest.raises(ValueError, match="kv_lora_rank=48"):
        _run_decode(tensors, 0.1, 1)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _gpu_fp8_dtype():
    from mla_multi.platforms import current_platform

    return current_platform().fp8_dtype or torch.float8_e4m3fn


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [1, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_gpu(kv, heads, block_size):
    from mla_multi.heuristics import max_num_kv_splits, num_kv_splits
    from mla_multi.platforms import current_platform

    seq_lens = [0, 1, 17, 4096, 32768]
    cache_dtype = torch.bfloat16 if kv == "bf16" else _gpu_fp8_dtype()
    tensors = _make_case(5, heads, 1, 512, 64, block_size, seq_lens, cache_dtype, torch.bfloat16, "cuda", heads)
    scale = 576**-0.5
    platform = current_platform()
    reserved = max_num_kv_splits(32768, platform)
    splits = num_kv_splits(platform, 5, heads, 32768, reserved, kv_cache_dtype=cache_dtype)
    out, lse = _run_decode(tensors, scale, splits, max_splits=reserved)
    torch.cuda.synchronize()
    # sm_90's FP8 QK path computes with the query rounded to e4m3 (test_kernels_decode_wgmma has its bounds
    # against the query as given)
    from mla_multi.kernels.launch_config import decode_config

    if decode_config(platform, heads, 1, cache_dtype).raw_stages:
        tensors = _e4m3_query(tensors)
    result = _errors(tensors, out, lse, scale)
    assert not result["nan"], result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"], result
    assert result["rel_err"] <= (1e-2 if kv == "bf16" else 6e-2), result
    assert result["lse_err"] <= 2e-2, result


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kernel", ["default", "triton"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads", [4, 64, 128])
def test_decode_gpu_attention_sink(heads, splits, kernel):
    """The sink applied by the kernel writing the output (one split: on sm_90 the warp-specialised kernel by
    default, the Triton kernel where it is forced) or by the reduce (splits), against the float64 reference;
    the LSE is the one without it."""
    from mla_multi.kernels.launch_config import DecodeLaunchConfig

    values = torch.tensor(SINK * (heads // len(SINK)))
    tensors = _make_case(4, heads, 1, 512, 64, 64, [0, 1, 300, 2100], torch.bfloat16, torch.bfloat16, "cuda", heads)
    scale = 576**-0.5
    sink = values.cuda()
    config = {"config": DecodeLaunchConfig(16, 32, 4, 2)} if kernel == "triton" else {}
    out, lse = _run_decode(tensors, scale, splits, attn_sink=sink, **config)
    result = _sink_errors(tensors, out, lse, scale, sink)
    assert not result["nan"], result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"] and result["inf_sink_zero"], result
    assert result["rel_err"] <= 1e-2, result
    assert result["lse_err"] <= 2e-2, result


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_gpu_every_triton_kernel_config(kv):
    """Each configuration of the Triton kernel that the device's tables hold (on sm_90 also the ones
    used where Gluon is missing, e.g. the one-stage 64-row FP8 tile), one split and several, block
    sizes 1 and 64, heads that fill and that pad the row block."""
    from mla_multi.kernels.launch_config import DecodeLaunchConfig, _decode_table
    from mla_multi.platforms import current_platform

    platform = current_platform()
    cache_dtype = torch.bfloat16 if kv == "bf16" else _gpu_fp8_dtype()
    configs = []
    for wgmma in (True, False):
        for config in _decode_table(platform, fp8=kv == "fp8", wgmma=wgmma).values():
            if config.kernel == "triton" and config not in configs:
                configs.append(config)
    assert configs
    # the AMD tables' QK as K Q^T (tokens as M), on this device's matrix units
    configs += [DecodeLaunchConfig(32, 64, 4, 1, tokens_as_m=True), DecodeLaunchConfig(16, 64, 4, 1, tokens_as_m=True)]
    for config in configs:
        for heads, block_size in ((config.block_h, 64), (max(1, config.block_h - 3), 1)):
            tensors = _make_case(
                3, heads, 1, 512, 64, block_size, [1, 700, 3000], cache_dtype, torch.bfloat16, "cuda", heads
            )
            for splits in (1, 3):
                out, lse = _run_decode(tensors, 576**-0.5, splits, max_splits=4, config=config)
                torch.cuda.synchronize()
                result = _errors(tensors, out, lse, 576**-0.5)
                where = (config.name, heads, block_size, splits, result)
                assert not result["nan"] and result["inf_pattern_ok"], where
                # float16 products for FP8 (exact conversions, the query scaled by a power of two)
                assert result["rel_err"] <= 1e-2 and result["lse_err"] <= 2e-2, where


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("q_len", [2, 4])
def test_decode_gpu_multi_token(q_len):
    check_multi_token_gpu(16, q_len, (4,), seed=3)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("q_len", [2, 4])
def test_decode_gpu_multi_token_tokens_as_m(q_len):
    """The AMD tables' tokens-as-M tile (S^T = K Q^T) with several query tokens on one row block."""
    from mla_multi.kernels.launch_config import DecodeLaunchConfig

    config = DecodeLaunchConfig(32, 64, 4, 2, tokens_as_m=True)
    check_multi_token_gpu(8, q_len, (1, 4), seed=5, config=config)


def check_multi_token_gpu(heads, q_len, splits_list, seed, **kwargs):
    """Speculative decode of 3 requests (the shortest as long as its query) against float64, per split count."""
    tensors = _make_case(3, heads, q_len, 512, 64, 64, [q_len, 100, 5000], torch.bfloat16, torch.bfloat16, "cuda", seed)
    scale = 576**-0.5
    for splits in splits_list:
        out, lse = _run_decode(tensors, scale, splits, **kwargs)
        torch.cuda.synchronize()
        result = _errors(tensors, out, lse, scale)
        assert not result["nan"] and result["inf_pattern_ok"], (splits, result)
        assert result["rel_err"] <= 1e-2, (splits, result)


@pytest.mark.gpu
@requires_gpu
def test_backend_decode_graphs_through_locked_workspace():
    """The TRITON backend as a serving engine drives it: reserve, lock, capture per batch size, replay."""
    from mla_multi.backends.triton import TritonDecodeImpl
    from mla_multi.workspace import WorkspaceManager

    heads, lora, rope, block_size, max_blocks, num_blocks = 128, 512, 64, 64, 64, 1024
    impl = TritonDecodeImpl(heads, 576**-0.5, lora, rope, torch.bfloat16, block_size)
    workspace = WorkspaceManager("cuda")
    impl.reserve_workspace(workspace, max_num_seqs=16, max_model_len=max_blocks * block_size)
    workspace.lock()
    cache = torch.randn(num_blocks, block_size, lora + rope, device="cuda").to(torch.bfloat16)
    for batch in (1, 5, 16):
        q_nope = torch.randn(batch, heads, lora, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
        block_table = torch.randint(0, num_blocks, (batch, max_blocks), device="cuda", dtype=torch.int32)
        seq_lens = torch.full((batch,), 4096, dtype=torch.int32, device="cuda")
        static = {}

        def step():
            static["out"], static["lse"] = impl.forward_mqa(
                q_nope, q_pe, cache, block_table, seq_lens, workspace_manager=workspace,
                max_seq_len=max_blocks * block_size,
            )

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for trial in range(3):
            seq_lens.copy_(torch.randint(1, max_blocks * block_size, (batch,), device="cuda", dtype=torch.int32))
            seq_lens[-1] = trial  # 0, 1, 2: empty and tiny sequences too
            block_table.random_(0, num_blocks)
            q_nope.normal_()
            static["out"].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            graph_out, graph_lse = static["out"].clone(), static["lse"].clone()
            step()
            torch.cuda.synchronize()
            assert torch.equal(graph_out, static["out"]) and torch.equal(graph_lse, static["lse"]), (batch, trial)
            ref_out, ref_lse = _reference(q_nope, q_pe, cache, block_table, seq_lens, impl.scale, None)
            rel = (graph_out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)
            assert not torch.isnan(graph_out).any() and (rel <= 1e-2 or batch == 1 and trial == 0), (batch, trial, rel)
            if batch == 1 and trial == 0:
                assert not graph_out.any() and (graph_lse == float("-inf")).all()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("tile", ["table", "tokens_as_m"])
def test_decode_cuda_graph_replay_matches_eager(tile):
    """Replays with new lengths (0, 1, 2 and random), block tables and queries equal eager calls, no NaN."""
    from mla_multi.kernels.launch_config import DecodeLaunchConfig
    from mla_multi.kernels.mla_decode import mla_decode_fwd

    config = DecodeLaunchConfig(32, 64, 4, 2, tokens_as_m=True) if tile == "tokens_as_m" else None
    heads = 32 if config else 16
    lora, rope, block_size, max_blocks = 512, 64, 64, 64
    scale = 576**-0.5
    num_blocks = 512
    generator = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(num_blocks, block_size, lora + rope, device="cuda", generator=generator).to(torch.bfloat16)
    for batch in (1, 4, 16):
        splits = 8
        q_nope = torch.randn(batch, heads, lora, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
        block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
        seq_lens = torch.ones(batch, dtype=torch.int32, device="cuda")
        out = torch.empty(batch, heads, lora, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
        attn_logits = torch.empty(batch, heads, splits, lora + 1, dtype=torch.float32, device="cuda")

        def step():
            mla_decode_fwd(
                q_nope, q_pe, cache, block_table, seq_lens, scale,
                k_scale=None, num_kv_splits=splits, attn_logits=attn_logits, out=out, lse=lse, config=config,
            )

        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for trial in range(3):
            new_lens = torch.randint(0, max_blocks * block_size, (batch,), device="cuda", dtype=torch.int32)
            new_lens[0] = trial  # 0, 1, 2: empty and tiny sequences too
            seq_lens.copy_(new_lens)
            block_table.copy_(torch.randint(0, num_blocks, (batch, max_blocks), device="cuda", dtype=torch.int32))
            q_nope.normal_()
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            graph_out, graph_lse = out.clone(), lse.clone()
            out.fill_(float("nan"))
            step()
            torch.cuda.synchronize()
            assert torch.equal(graph_out, out), f"batch {batch} trial {trial}"
            assert torch.equal(graph_lse, lse), f"batch {batch} trial {trial}"
            assert not torch.isnan(graph_out).any()


if __name__ == "__main__":
    _interpreter_main()
