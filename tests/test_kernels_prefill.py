"""Tests of the Triton varlen prefill attention kernel (mla_multi/kernels/prefill.py).

Three layers:
* interpreter: the kernel runs under ``TRITON_INTERPRET=1`` on the CPU in a child
  process (the variable must be set before triton is imported), float16/float32,
  small ragged batches, compared with the float64 reference;
* argument checks: in-process, no kernel launch;
* GPU (``-m gpu``): bfloat16, lengths 1..8192 in one batch, 16 and 128 heads.
"""

from __future__ import annotations

import sys
import zlib

import pytest
import torch
from interpreter import print_results, run_interpreter_script


# (case id, dtype, causal, query lengths, key lengths, q heads, kv heads, head_dim_qk, head_dim_v, tile)
# tile None = the default config of the (CPU) platform; a platform name = that device's config;
# (block_m, block_n) = an explicit small tile so the interpreter covers many tiles per sequence.
_MLA_QLENS = [5, 0, 37, 70, 1, 16, 23]
_MLA_KLENS = [5, 3, 50, 70, 0, 40, 9]  # lq < lk, lq == lk, lk < lq (rows with no key), empty sides
INTERPRETER_CASES = [
    (f"{dt}-{'causal' if c else 'full'}-mla-{tile_id}", dt, c, _MLA_QLENS, _MLA_KLENS, 3, 3, 192, 128, tile)
    for dt in ("float32", "float16")
    for c in (True, False)
    for tile_id, tile in (("m32n16", (32, 16)), ("m16n32", (16, 32)))
] + [
    ("float16-causal-mla-H100", "float16", True, [70, 3, 0, 129], [70, 64, 2, 140], 2, 2, 192, 128, "H100"),
    ("float16-full-mla-MI300X", "float16", False, [70, 3, 0, 129], [70, 64, 2, 140], 2, 2, 192, 128, "MI300X"),
    ("float16-causal-mla-MI355X", "float16", True, [70, 3, 0, 129], [70, 64, 2, 140], 2, 2, 192, 128, "MI355X"),
    # the one-dimensional launch ordered for 8 and 5 XCDs: 63 items (7 sequences x 3 heads x 3 tiles) and 48
    # (4 x 4 x 3), which the counts do not divide, so some dies take one item more
    ("float16-causal-mla-xcd8", "float16", True, _MLA_QLENS, _MLA_KLENS, 3, 3, 192, 128, (32, 16, "x8")),
    ("float32-full-gqa-xcd5", "float32", False, [40, 17, 0, 5], [70, 33, 3, 0], 4, 2, 192, 128, (16, 16, "x5")),
    ("float16-causal-mla-default", "float16", True, [33, 0, 64], [40, 5, 64], 2, 2, 192, 128, None),
    # TMA descriptors for the unmasked tiles (the interpreter emulates them).
    ("float16-causal-mla-tma", "float16", True, _MLA_QLENS, _MLA_KLENS, 3, 3, 192, 128, (32, 16, "tma")),
    ("float32-full-gqa-tma", "float32", False, [40, 17], [70, 33], 4, 2, 192, 128, (16, 16, "tma")),
    ("float32-causal-gqa-d96-v64", "float32", True, [17, 33, 1], [9, 40, 30], 4, 2, 96, 64, (16, 16)),
    ("float32-full-d72-v40", "float32", False, [20, 47], [20, 31], 2, 2, 72, 40, (32, 16)),
    ("float16-causal-d64-v64", "float16", True, [50], [50], 2, 2, 64, 64, (32, 32)),
]


def _reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, head_chunk=None):
    """float64 attention through the package's reference backend, a few heads at a time
    (the reference holds [heads, lq, lk] scores), k/v heads repeated for grouped queries."""
    from mla_multi.backends.reference import varlen_attention_reference

    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    head_chunk = head_chunk or q.shape[1]
    outs, lses = [], []
    for h in range(0, q.shape[1], head_chunk):
        sl = slice(h, h + head_chunk)
        o, lse = varlen_attention_reference(
            q[:, sl].double(), k[:, sl].double(), v[:, sl].double(), cu_seqlens_q, cu_seqlens_k, scale, causal
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=0)


def _cu(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _compare(out, lse, ref_out, ref_lse):
    """Relative-norm output error, max LSE error over finite entries, and the -inf pattern."""
    out64 = out.double()
    denom = ref_out.norm().item()
    out_err = (out64 - ref_out).norm().item() / max(denom, 1e-30)
    finite = torch.isfinite(ref_lse)
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    return {
        "out_err": out_err if out.isfinite().all() else float("inf"),
        "lse_err": lse_err if lse[finite].isfinite().all() else float("inf"),
        "out_nan": bool(out.isnan().any()),
        "lse_nan": bool(lse.isnan().any()),
        "inf_pattern_ok": bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))),
        "empty_rows_zero": bool((out[~finite.t()] == 0).all()) if (~finite).any() else True,
    }


def _run_interpreter_case(case):
    """Runs one case; called in the child process with TRITON_INTERPRET=1."""
    from mla_multi.kernels.launch_config import PrefillLaunchConfig, prefill_config
    from mla_multi.kernels.prefill import varlen_attention
    from mla_multi.platforms import SPECS

    case_id, dtype_name, causal, qlens, klens, num_heads, num_kv_heads, dqk, dv, tile = case
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(zlib.crc32(case_id.encode()))
    total_q, total_k = sum(qlens), sum(klens)
    # q as a view of a wider tensor (strided heads/tokens), as MLA slices it out of a projection.
    q_wide = torch.randn(total_q, num_heads, dqk + 24, generator=generator).to(dtype)
    q = q_wide[:, :, 24:]
    k = torch.randn(total_k, num_kv_heads, dqk, generator=generator).to(dtype)
    v_wide = torch.randn(total_k, num_kv_heads * dv * 2, generator=generator).to(dtype)
    v = v_wide.view(total_k, num_kv_heads, 2 * dv)[:, :, :dv]
    cu_q, cu_k = _cu(qlens), _cu(klens)
    scale = dqk**-0.5
    if tile is None:
        config = None
    elif isinstance(tile, str):
        config = prefill_config(SPECS[tile], dqk, dv, torch.bfloat16, causal)
    else:
        xcds = [int(option[1:]) for option in tile[2:] if option.startswith("x")]
        config = PrefillLaunchConfig(
            block_m=tile[0], block_n=tile[1], num_warps=4, num_stages=1, use_tma="tma" in tile[2:],
            xcds=xcds[0] if xcds else 1,
        )
    out = torch.full((total_q, num_heads, dv), float("nan"), dtype=dtype)
    lse = torch.full((num_heads, total_q), float("nan"), dtype=torch.float32)
    res_out, res_lse = varlen_attention(
        q, k, v, cu_q, cu_k, max(qlens), max(klens), scale, causal=causal, out=out, lse=lse, config=config
    )
    ref_out, ref_lse = _reference(q, k, v, cu_q, cu_k, scale, causal)
    result = _compare(out, lse, ref_out, ref_lse)
    result["returned_buffers"] = res_out.data_ptr() == out.data_ptr() and res_lse.data_ptr() == lse.data_ptr()
    # return_lse=False: same output, no LSE.
    out2, lse2 = varlen_attention(
        q, k, v, cu_q, cu_k, max(qlens), max(klens), scale, causal=causal, return_lse=False, config=config
    )
    result["no_lse_out_equal"] = bool(torch.equal(out2, out)) and lse2 is None
    if dqk == 192 and num_kv_heads == num_heads:
        # the rotary key apart (k_pe, shared by the heads): k [.., 128] and k_pe [T, 64]
        k_pe = torch.randn(total_k, 64, generator=generator).to(dtype)
        k_shared = k.clone()
        k_shared[:, :, 128:] = k_pe[:, None, :]
        split_out, split_lse = varlen_attention(
            q, k_shared[:, :, :128], v, cu_q, cu_k, max(qlens), max(klens), scale, causal=causal, config=config,
            k_pe=k_pe,
        )
        ref_out, ref_lse = _reference(q, k_shared, v, cu_q, cu_k, scale, causal)
        split = _compare(split_out, split_lse, ref_out, ref_lse)
        result["split_out_err"], result["split_lse_err"] = split["out_err"], split["lse_err"]
        result["split_ok"] = not split["out_nan"] and not split["lse_nan"] and split["inf_pattern_ok"]
    if not causal:
        # merge=True: a second key set merged into (out, lse) in place equals attention over both sets
        # (one side empty for some sequences, both for others)
        klens2 = [(n * 7 + 3) % 41 if i % 3 else 0 for i, n in enumerate(klens)]
        k2 = torch.randn(sum(klens2), num_kv_heads, dqk, generator=generator).to(dtype)
        v2 = torch.randn(sum(klens2), num_kv_heads, dv, generator=generator).to(dtype)
        cu_k2 = _cu(klens2)
        merged_out, merged_lse = varlen_attention(
            q, k2, v2, cu_q, cu_k2, max(qlens), max(max(klens2), 1), scale, causal=False, out=out.clone(),
            lse=lse.clone(), config=config, merge=True,
        )
        both_k = torch.cat([torch.cat([k[cu_k[i]:cu_k[i + 1]], k2[cu_k2[i]:cu_k2[i + 1]]]) for i in range(len(klens))])
        both_v = torch.cat([torch.cat([v[cu_k[i]:cu_k[i + 1]], v2[cu_k2[i]:cu_k2[i + 1]]]) for i in range(len(klens))])
        ref_out, ref_lse = _reference(q, both_k, both_v, cu_q, _cu([a + b for a, b in zip(klens, klens2)]), scale, False)
        merged = _compare(merged_out, merged_lse, ref_out, ref_lse)
        result["merge_out_err"], result["merge_lse_err"] = merged["out_err"], merged["lse_err"]
        result["merge_ok"] = (not merged["out_nan"] and not merged["lse_nan"] and merged["inf_pattern_ok"]
                              and merged["empty_rows_zero"])
    return result


def _interpreter_main():
    results = {case[0]: _run_interpreter_case(case) for case in INTERPRETER_CASES}
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__, "--interpreter")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=[c[0] for c in INTERPRETER_CASES])
def test_varlen_attention_interpreter(interpreter_results, case):
    result = interpreter_results[case[0]]
    tol = 1e-5 if case[1] == "float32" else 2e-3
    assert not result["out_nan"] and not result["lse_nan"], result
    assert result["out_err"] <= tol, result
    assert result["lse_err"] <= 1e-4, result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"], result
    assert result["returned_buffers"] and result["no_lse_out_equal"], result
    if "split_ok" in result:  # MLA dims: the same attention with the rotary key apart
        assert result["split_ok"] and result["split_out_err"] <= tol and result["split_lse_err"] <= 1e-4, result
    if not case[2]:  # non-causal: a second key set merged in place (merge=True)
        assert result["merge_ok"] and result["merge_out_err"] <= tol and result["merge_lse_err"] <= 1e-4, result


# ----------------------------------------------------------------------------------------------
# Argument checks (no launch).


def test_amd_configs_order_their_programs_for_the_xcds():
    from mla_multi.kernels.launch_config import PrefillLaunchConfig, prefill_config
    from mla_multi.platforms import SPECS

    for name in ("MI300X", "MI355X"):
        config = prefill_config(SPECS[name], 192, 128, torch.bfloat16, True)
        assert config.xcds == 8 and config.name.endswith("x8"), config
    for name in ("H100", "A100", "RX7900XTX", "MI250X", "CPU"):
        assert prefill_config(SPECS[name], 192, 128, torch.bfloat16, True).xcds == 1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"xcds={bad!r}; accepted: a positive int"):
            PrefillLaunchConfig(128, 64, 8, 1, xcds=bad)


def _valid_args():
    q = torch.zeros(4, 2, 192, dtype=torch.float16)
    k = torch.zeros(6, 2, 192, dtype=torch.float16)
    v = torch.zeros(6, 2, 128, dtype=torch.float16)
    return dict(
        q=q, k=k, v=v, cu_seqlens_q=_cu([4]), cu_seqlens_k=_cu([6]), max_seqlen_q=4, max_seqlen_k=6, scale=0.1
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.zeros(4, 192, dtype=torch.float16)), "q must be a 3-D"),
        (dict(k=torch.zeros(6, 2, 128, dtype=torch.float16)), "k head dim"),
        (dict(v=torch.zeros(5, 2, 128, dtype=torch.float16)), "v shape"),
        (dict(q=torch.zeros(4, 3, 192, dtype=torch.float16)), "multiple of k/v heads"),
        (dict(q=torch.zeros(4, 2, 192, dtype=torch.int32)), "q.dtype"),
        (dict(k=torch.zeros(6, 2, 192, dtype=torch.bfloat16)), "share one dtype"),
        (dict(q=torch.zeros(4, 2, 384, dtype=torch.float16)[:, :, ::2]), "contiguous last"),
        (dict(cu_seqlens_q=_cu([4]).long()), "cu_seqlens_q must be a 1-D int32"),
        (dict(cu_seqlens_k=_cu([3, 3])), "batch \\+ 1"),
        (dict(max_seqlen_q=-1), "max_seqlen_q"),
        (dict(out=torch.zeros(4, 2, 192, dtype=torch.float16)), "out must be"),
        (dict(lse=torch.zeros(4, 2)), "lse must be"),
        (dict(error_flag=torch.zeros(2, dtype=torch.int32)), "error_flag has shape"),
        (dict(merge=True), "merge=True with out=None, lse=None"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_varlen_attention_bad_input(change, match):
    # Boundary data is the kernel's to check (tests/test_safety.py); `mm.ops.mla_prefill` checks it on the host.
    from mla_multi.kernels.prefill import varlen_attention

    args = _valid_args()
    args.update(change)
    causal = True
    with pytest.raises(ValueError, match=match):
        varlen_attention(**args, causal=causal)


def test_split_head_dim_qk():
    from mla_multi.kernels.prefill_inputs import split_head_dim_qk as _split_head_dim_qk

    assert _split_head_dim_qk(192) == (128, 64)
    assert _split_head_dim_qk(576) == (512, 64)
    assert _split_head_dim_qk(128) == (128, 0)
    assert _split_head_dim_qk(72) == (64, 16)
    assert _split_head_dim_qk(200) == (128, 128)


# ----------------------------------------------------------------------------------------------
# GPU: bfloat16 numerics at serving lengths.

_GPU_LENGTHS = [1, 17, 128, 300, 1000, 2049, 8192, 0, 77]


def gpu_case(num_heads: int, prefix: int, split: bool, seed: int):
    """A bf16 varlen case on the GPU (`_GPU_LENGTHS`, each with `prefix` more keys: the chunked-prefill shape):
    q / k / v sliced out of wider tensors as the MLA forward produces them; `split`: one rotary key for every
    head, also passed apart (rows of a latent cache). Returns q, k, v, {"k_pe": ...} or {}, cu_q, cu_k, the
    lengths, and NaN-poisoned out and LSE."""
    device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(seed)
    qlens = _GPU_LENGTHS
    klens = [n + prefix if n > 0 else prefix for n in qlens]
    total_q, total_k = sum(qlens), sum(klens)
    q = torch.randn(total_q, num_heads, 256, device=device, dtype=dtype)[:, :, :192]
    kv = torch.randn(total_k, num_heads, 192 + 128, device=device, dtype=dtype)
    k, v = kv[:, :, :192], kv[:, :, 192:]
    extra = {}
    if split:
        k_pe = torch.randn(total_k, 576, device=device, dtype=dtype)[:, 512:]
        kv[:, :, 128:192] = k_pe[:, None, :]
        extra = {"k_pe": k_pe}
    out = torch.full((total_q, num_heads, 128), float("nan"), device=device, dtype=dtype)
    lse = torch.full((num_heads, total_q), float("nan"), device=device, dtype=torch.float32)
    return q, k, v, extra, _cu(qlens, device), _cu(klens, device), qlens, klens, out, lse


def assert_matches_float64(out, lse, q, k, v, cu_q, cu_k, scale, causal):
    """Output and LSE against float64: relative output error <= 1e-2, LSE within 2e-2, no NaN, rows without
    keys 0 and -inf."""
    ref_out, ref_lse = _reference(q, k, v, cu_q, cu_k, scale, causal, head_chunk=4)
    result = _compare(out, lse, ref_out, ref_lse)
    assert not result["out_nan"] and not result["lse_nan"], result
    assert result["out_err"] <= 1e-2, result
    assert result["lse_err"] <= 2e-2, result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"], result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("prefix", [0, 333], ids=["self", "with-context"])
@pytest.mark.parametrize("tile", [None, "triton", "tma", "split", "xcd8"],
                         ids=["default", "triton-kernel", "tma", "split-key", "xcd-order"])
def test_varlen_attention_gpu_bf16(num_heads, causal, prefix, tile):
    from mla_multi.kernels.launch_config import PrefillLaunchConfig, prefill_config
    from mla_multi.kernels.prefill import varlen_attention
    from mla_multi.platforms import current_platform

    config = None
    if tile == "triton":  # the Triton kernel's own default configuration (sm_90's default launch is prefill_wgmma's)
        config = prefill_config(current_platform(), 192, 128, torch.bfloat16, causal)
    if tile == "tma":
        if torch.cuda.get_device_capability()[0] < 9 or torch.version.hip is not None:
            pytest.skip("tma: needs NVIDIA sm_90+")
        default = prefill_config(current_platform(), 192, 128, torch.bfloat16, causal)
        config = PrefillLaunchConfig(default.block_m, default.block_n, default.num_warps, default.num_stages, True)
    if tile == "xcd8":  # the Triton kernel's launch ordered for 8 XCDs, as on MI300X / MI355X
        import dataclasses

        config = dataclasses.replace(prefill_config(current_platform(), 192, 128, torch.bfloat16, causal), xcds=8)

    q, k, v, split, cu_q, cu_k, qlens, klens, out, lse = gpu_case(num_heads, prefix, tile == "split",
                                                                   num_heads * 7 + causal + prefix)
    scale = 192**-0.5
    if config is not None and config.use_tma:  # the descriptor path must really be taken
        from mla_multi.kernels.prefill import _tma_descriptors, kernel_constexprs

        constexprs = kernel_constexprs(192, 128, config.block_m, config.block_n, causal, True, True)
        assert _tma_descriptors(k, v, constexprs) is not None
    varlen_attention(
        q, k[:, :, :128] if split else k, v, cu_q, cu_k, max(qlens), max(klens), scale, causal=causal, out=out,
        lse=lse, config=config, **split,
    )
    torch.cuda.synchronize()
    assert_matches_float64(out, lse, q, k, v, cu_q, cu_k, scale, causal)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_varlen_attention_gpu_no_key_rows():
    """Causal with fewer keys than queries: the first rows see nothing (0, -inf)."""
    from mla_multi.kernels.prefill import varlen_attention

    device = "cuda"
    torch.manual_seed(3)
    qlens, klens = [300, 5, 129], [100, 0, 129]
    q = torch.randn(sum(qlens), 8, 192, device=device, dtype=torch.bfloat16)
    k = torch.randn(sum(klens), 8, 192, device=device, dtype=torch.bfloat16)
    v = torch.randn(sum(klens), 8, 128, device=device, dtype=torch.bfloat16)
    cu_q, cu_k = _cu(qlens, device), _cu(klens, device)
    out = torch.full((sum(qlens), 8, 128), float("nan"), device=device, dtype=torch.bfloat16)
    lse = torch.full((8, sum(qlens)), float("nan"), device=device)
    varlen_attention(q, k, v, cu_q, cu_k, 300, 129, 0.07, causal=True, out=out, lse=lse)
    ref_out, ref_lse = _reference(q, k, v, cu_q, cu_k, 0.07, True)
    result = _compare(out, lse, ref_out, ref_lse)
    assert not result["out_nan"] and not result["lse_nan"], result
    assert result["out_err"] <= 1e-2 and result["lse_err"] <= 2e-2, result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"], result


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
