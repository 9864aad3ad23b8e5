"""Sparse MLA decode in Triton: each query token attends to the cached rows its top-k indices name.

One program per (token, block of heads) walks the token's index list in tiles
of BLOCK_N entries: it gathers the named cache rows (a slot is block *
block_size + offset), computes QK over the 512 latent and 64 rotary columns,
keeps an online softmax and accumulates P V over the 512 latent columns. The
cache is 16-bit, per-tensor FP8 (values x k_scale) or FlashMLA's fp8_ds_mla
layout (uint8 rows of 656 bytes: e4m3fn values x their 128-value tile scale,
then bf16 rotary values, `mla_multi.ds_mla_cache`); every tile is converted to
the query's dtype before its products.

Index semantics are the reference's: -1 is no token, an entry past
topk_length[token] does not count, a duplicate counts twice, and an index
outside [-1, num_slots) is bad data: the token's rows and LSE become NaN and
`errors.SPARSE_INDEX` is ORed into the error flag. No load leaves the cache
whatever the indices (they are clamped to slot 0 and masked).

This is the portable first version: one split per token (no split-KV), no
warp specialisation. It is selected only when forced
(``MLA_MULTI_SPARSE_DECODE_BACKEND=TRITON``) until it is measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_multi import errors

SPARSE_INDEX_ERROR = tl.constexpr(errors.SPARSE_INDEX)

# cache formats (the CACHE_FORMAT constexpr)
FORMAT_FLOAT = 0  # 16- or 32-bit values
FORMAT_FP8 = 1  # per-tensor FP8, values x k_scale
FORMAT_DS_MLA = 2  # fp8_ds_mla bytes


@triton.jit
def _sparse_decode_kernel(
    Q_nope, Q_pe, KV_cache, Indices, Topk_length, K_scale, Attn_sink, Out, Lse, Error_flag, Partials,
    sm_scale, num_heads, topk, num_slots, split_len,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_cache_slot, stride_idx_t, stride_o_t, stride_o_h,
    stride_lse_t, stride_p_t, stride_p_h, stride_p_s,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    CACHE_FORMAT: tl.constexpr, HAS_TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr,
    OUT_OF_RANGE_IS_NONE: tl.constexpr = False, SPLIT: tl.constexpr = False,
):
    # the head blocks of one token are neighbours in the launch order: they gather the same rows from L2
    head_block = tl.program_id(0)
    token = tl.program_id(1)
    split = tl.program_id(2)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, topk)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_d = tl.arange(0, KV_LORA_RANK)
    offs_r = tl.arange(0, ROPE_DIM)

    q_nope = tl.load(Q_nope + token * stride_qn_t + heads[:, None] * stride_qn_h + offs_d[None, :],
                     mask=head_mask[:, None], other=0.0)
    q_pe = tl.load(Q_pe + token * stride_qp_t + heads[:, None] * stride_qp_h + offs_r[None, :],
                   mask=head_mask[:, None], other=0.0)
    count = topk
    if HAS_TOPK_LENGTH:
        count = tl.minimum(tl.maximum(tl.load(Topk_length + token), 0), topk)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, KV_LORA_RANK], dtype=tl.float32)
    bad = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_list = offs_n < hi
        idx = tl.load(Indices + token * stride_idx_t + offs_n, mask=in_list, other=-1)
        if not OUT_OF_RANGE_IS_NONE:
            bad = bad | ((in_list & ((idx < -1) | (idx >= num_slots))).to(tl.int32))
        valid = (offs_n < count) & (idx >= 0) & (idx < num_slots)
        slot = tl.where(valid, idx, 0).to(tl.int64)
        row = KV_cache + slot * stride_cache_slot
        if CACHE_FORMAT == 2:
            raw = tl.load(row[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
            values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            scale_ptr = (row + KV_LORA_RANK).to(tl.pointer_type(tl.float32))
            tile_scale = tl.load(scale_ptr[:, None] + tl.arange(0, KV_LORA_RANK // 128)[None, :], mask=valid[:, None],
                                 other=0.0)
            # one scale per 128 values: scale the [BLOCK_N, 4, 128] view
            scaled = tl.reshape(values, [BLOCK_N, KV_LORA_RANK // 128, 128]) * tile_scale[:, :, None]
            k_nope = tl.reshape(scaled, [BLOCK_N, KV_LORA_RANK]).to(q_nope.dtype)
            rope_ptr = (row + KV_LORA_RANK + 4 * (KV_LORA_RANK // 128)).to(tl.pointer_type(tl.bfloat16))
            k_pe = tl.load(rope_ptr[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0).to(q_nope.dtype)
        else:
            k_nope = tl.load(row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            k_pe = tl.load(row[:, None] + KV_LORA_RANK + offs_r[None, :], mask=valid[:, None], other=0.0)
            if CACHE_FORMAT == 1:
                k_scale = tl.load(K_scale)
                k_nope = (k_nope.to(tl.float32) * k_scale).to(q_nope.dtype)
                k_pe = (k_pe.to(tl.float32) * k_scale).to(q_nope.dtype)
            else:
                k_nope = k_nope.to(q_nope.dtype)
                k_pe = k_pe.to(q_nope.dtype)
        scores = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))
        scores = tl.where(valid[None, :], scores * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope)
        m_i = m_new

    # l_i >= 0, or NaN where a NaN (or +inf) score reached the softmax: `!= 0` keeps NaN rows on the mass path,
    # so that their output and LSE come out NaN (the NaN policy)
    has_any = l_i != 0.0
    lse = tl.where(has_any, m_i + tl.log(tl.where(has_any, l_i, 1.0)), float("-inf"))
    out = tl.where(has_any[:, None], acc / tl.where(has_any, l_i, 1.0)[:, None], 0.0)
    if SPLIT:  # this split's normalised output and LSE; `_sparse_reduce_kernel` merges them (and the sink)
        is_bad = tl.max(bad, axis=0) > 0
        lse = tl.where(is_bad, float("nan"), lse)
        base = Partials + token * stride_p_t + heads * stride_p_h + split * stride_p_s
        tl.store(base[:, None] + offs_d[None, :], out, mask=head_mask[:, None])
        tl.store(base + KV_LORA_RANK, lse, mask=head_mask)
        if is_bad:
            tl.atomic_or(Error_flag, SPARSE_INDEX_ERROR, mask=head_block == 0)
        return
    if HAS_SINK:
        sink = tl.load(Attn_sink + heads, mask=head_mask, other=0.0)
        factor = 1.0 / (1.0 + tl.exp(sink - tl.where(has_any, lse, 0.0)))
        out = out * tl.where(has_any, factor, 1.0)[:, None]
    is_bad = tl.max(bad, axis=0) > 0
    out = tl.where(is_bad, float("nan"), out)
    lse = tl.where(is_bad, float("nan"), lse)
    tl.store(Out + token * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=head_mask[:, None])
    tl.store(Lse + token * stride_lse_t + heads, lse, mask=head_mask)
    if is_bad:
        tl.atomic_or(Error_flag, SPARSE_INDEX_ERROR, mask=head_block == 0)


@triton.jit
def _sparse_reduce_kernel(
    Partials, Attn_sink, Out, Lse, num_splits, stride_p_t, stride_p_h, stride_p_s, stride_o_t, stride_o_h,
    stride_lse_t, KV_LORA_RANK: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Merge one (token, head)'s split results by LSE, then apply the sink. A split with bad indices wrote
    LSE NaN: the row comes out NaN."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, KV_LORA_RANK)
    base = Partials + token * stride_p_t + head * stride_p_h
    split_lse = tl.load(base + offs_s * stride_p_s + KV_LORA_RANK, mask=offs_s < num_splits, other=float("-inf"))
    has_mass = split_lse > float("-inf")
    top = tl.max(split_lse, axis=0)
    top_use = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(has_mass, tl.exp(split_lse - top_use), tl.where(split_lse == split_lse, 0.0, float("nan")))
    total = tl.sum(weight, axis=0)
    no_mass = total == 0.0
    acc = tl.zeros([KV_LORA_RANK], dtype=tl.float32)
    for s in range(0, num_splits):  # one 512-wide row at a time: no [splits, 512] tile in registers
        lse_s = tl.load(base + s * stride_p_s + KV_LORA_RANK)
        if lse_s > float("-inf"):
            acc += tl.exp(lse_s - top_use) * tl.load(base + s * stride_p_s + offs_d)
    out = acc / tl.where(no_mass, 1.0, total)
    lse = tl.where(no_mass, float("-inf"), top_use + tl.log(tl.where(no_mass, 1.0, total)))
    if HAS_SINK:
        sink = tl.load(Attn_sink + head)
        out = out * tl.where(no_mass, 1.0, 1.0 / (1.0 + tl.exp(sink - tl.where(no_mass, 0.0, lse))))
    tl.store(Out + token * stride_o_t + head * stride_o_h + offs_d, out.to(Out.dtype.element_ty))
    tl.store(Lse + token * stride_lse_t + head, lse)


def num_splits_for(tokens: int, num_heads: int, topk: int, block_n: int, num_compute_units: int,
                   block_h: int | None = None) -> int:
    """Splits of each token's index list: enough programs for two waves of the device, each split at least
    four tiles long."""
    programs = max(1, tokens * triton.cdiv(num_heads, block_h or block_h_for(num_heads)))
    wanted = triton.cdiv(2 * num_compute_units, programs)
    return max(1, min(wanted, topk // (4 * block_n), MAX_SPLITS))


MAX_SPLITS = 64


def _cache_format(kv_cache: torch.Tensor) -> int:
    if kv_cache.dtype == torch.uint8:
        return FORMAT_DS_MLA
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return FORMAT_FP8
    return FORMAT_FLOAT


def block_h_for(num_heads: int) -> int:
    """Heads per program: 16, the MMA's smallest M (wider blocks spill the 512-wide accumulator: 128 heads
    in blocks of 64 spilled on every target in the compile check)."""
    return 16


def block_n_for(cache_format: int) -> int:
    """Index entries per tile: 16 for fp8_ds_mla (its tile scales widen the dequantised tile), else 32."""
    return 16 if cache_format == FORMAT_DS_MLA else 32


def num_warps_for(platform, cache_format: int) -> int:
    """4 warps (8 halve AMD's registers per thread: the fp8_ds_mla tile then spilled 111-153 registers on
    gfx942 / gfx950 in the compile check)."""
    return 4


def fp8_reason(platform, kv_dtype: torch.dtype) -> str:
    """Why `platform` cannot run the kernel's FP8 reads of `kv_dtype` ("" when it can)."""
    fp8 = kv_dtype == torch.uint8 or kv_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    if fp8 and platform.is_cuda() and not platform.has_device_capability(8, 9):
        return (f"NVIDIA {platform.arch} has no float8_e4m3fn conversion in Triton (sm_89+): the FP8 and "
                "fp8_ds_mla sparse caches need it")
    return ""


def sparse_prefill(q_nope, q_pe, kv, indices, scale, *, topk_length=None, attn_sink=None, out=None, lse=None):
    """Sparse prefill: the same kernel over kv [S_kv, 576] rows (a cache of one-token blocks), where an index
    that is -1 or outside [0, S_kv) is no token rather than bad data."""
    return sparse_decode(q_nope, q_pe, kv.unsqueeze(1), indices, scale, topk_length=topk_length,
                         attn_sink=attn_sink, out=out, lse=lse, out_of_range_is_none=True)


def sparse_decode(q_nope, q_pe, kv_cache, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None,
                  out=None, lse=None, error_flag=None, block_n: int | None = None, num_warps: int | None = None,
                  out_of_range_is_none: bool = False, num_splits: int | None = None, block_h: int | None = None):
    """Launch the sparse decode kernel. Shapes as `ReferenceSparseDecodeImpl.forward` (T tokens): q_nope
    [T, N, 512], q_pe [T, N, 64] (16-bit), kv_cache [blocks, block_size, 576 or 656 (uint8)], indices int32
    [T, topk]; returns (out [T, N, 512], lse [T, N] float32). The caller checks the inputs."""
    tokens, num_heads, kv_lora_rank = q_nope.shape
    rope_dim = q_pe.shape[-1]
    topk = indices.shape[1]
    device = q_nope.device
    if out is None:
        out = torch.empty_like(q_nope)
    if lse is None:
        lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=device)
    if error_flag is None:
        error_flag = errors.error_flag(device)
    fmt = _cache_format(kv_cache)
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])  # one row per slot
    if tokens == 0 or topk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    block_h = block_h or block_h_for(num_heads)
    block_n = block_n or block_n_for(fmt)
    from mla_multi.platforms import current_platform

    platform = current_platform()
    if num_warps is None:
        num_warps = num_warps_for(platform, fmt)
    if num_splits is None:
        num_splits = num_splits_for(tokens, num_heads, topk, block_n, platform.num_compute_units, block_h)
    split_len = triton.cdiv(triton.cdiv(topk, num_splits), block_n) * block_n
    num_splits = triton.cdiv(topk, split_len)
    partials = lse
    if num_splits > 1:
        partials = torch.empty(tokens, num_heads, num_splits, kv_lora_rank + 1, dtype=torch.float32, device=device)
    grid = (triton.cdiv(num_heads, block_h), tokens, num_splits)
    _sparse_decode_kernel[grid](
        q_nope, q_pe, flat, indices,
        topk_length if topk_length is not None else indices,
        k_scale if k_scale is not None else lse,
        attn_sink if attn_sink is not None else lse,
        out, lse, error_flag, partials,
        float(scale), num_heads, topk, flat.shape[0], split_len,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), flat.stride(0), indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        partials.stride(0), partials.stride(1), partials.stride(2) if num_splits > 1 else 0,
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_H=block_h, BLOCK_N=block_n, CACHE_FORMAT=fmt,
        HAS_TOPK_LENGTH=topk_length is not None, HAS_SINK=attn_sink is not None,
        OUT_OF_RANGE_IS_NONE=out_of_range_is_none, SPLIT=num_splits > 1, num_warps=num_warps,
    )
    if num_splits > 1:
        _sparse_reduce_kernel[(tokens, num_heads)](
            partials, attn_sink if attn_sink is not None else lse, out, lse, num_splits,
            partials.stride(0), partials.stride(1), partials.stride(2), out.stride(0), out.stride(1), lse.stride(0),
            KV_LORA_RANK=kv_lora_rank, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            HAS_SINK=attn_sink is not None, num_warps=4,
        )
    return out, lse


# ---------------------------------------------------------------------------
# ahead-of-time compilation (mla_multi.compile_check)
# ---------------------------------------------------------------------------

_CACHE_TYPES = {FORMAT_FLOAT: "bf16", FORMAT_FP8: "fp8e4nv", FORMAT_DS_MLA: "u8"}


def compile_specs(platform) -> list:
    """DeepSeek dims (512 / 64), bf16 queries, 16 and 128 heads, every cache format (gfx942's per-tensor
    FP8 is e4m3fnuz), with topk_length and attn_sink."""
    from mla_multi.kernels.launch_config import CompileSpec

    fp8 = "fp8e4b8" if getattr(platform, "arch", None) == "gfx942" else "fp8e4nv"
    fp8_dtype = torch.float8_e4m3fnuz if fp8 == "fp8e4b8" else torch.float8_e4m3fn
    specs = []
    for heads in (16, 128):
        for fmt in (FORMAT_FLOAT, FORMAT_FP8, FORMAT_DS_MLA):
            if fmt != FORMAT_FLOAT and fp8_reason(platform, torch.uint8 if fmt == FORMAT_DS_MLA else fp8_dtype):
                continue  # a reason of the backend on this platform
            if fmt == FORMAT_DS_MLA and getattr(platform, "arch", None) == "gfx942":
                # decoding e4m3fn in software spills 58 registers in this kernel there; the backend reads
                # fp8_ds_mla through `sparse_indices.dequantize_named_rows` and the dense decode instead
                continue
            cache = fp8 if fmt == FORMAT_FP8 else _CACHE_TYPES[fmt]
            signature = {
                "Q_nope": "*bf16", "Q_pe": "*bf16", "KV_cache": f"*{cache}", "Indices": "*i32", "Topk_length": "*i32",
                "K_scale": "*fp32", "Attn_sink": "*fp32", "Out": "*bf16", "Lse": "*fp32", "Error_flag": "*i32",
                "Partials": "*fp32", "sm_scale": "fp32", "num_heads": "i32", "topk": "i32", "num_slots": "i32",
                "split_len": "i32",
            }  # fmt: skip
            strides = ["stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_cache_slot",
                       "stride_idx_t", "stride_o_t", "stride_o_h", "stride_lse_t", "stride_p_t", "stride_p_h",
                       "stride_p_s"]
            signature.update({name: "i32" for name in strides})
            constexprs = dict(KV_LORA_RANK=512, ROPE_DIM=64, BLOCK_H=block_h_for(heads), BLOCK_N=block_n_for(fmt),
                              CACHE_FORMAT=fmt,
                              HAS_TOPK_LENGTH=True, HAS_SINK=True, OUT_OF_RANGE_IS_NONE=False,
                              SPLIT=fmt == FORMAT_DS_MLA)
            signature.update({name: "constexpr" for name in constexprs})
            specs.append(CompileSpec(
                name=f"sparse_decode[h{heads},{ 'ds_mla' if fmt == FORMAT_DS_MLA else cache}]",
                fn=_sparse_decode_kernel,
                signature=signature,
                constexprs=constexprs,
                options={"num_warps": num_warps_for(platform, fmt), "num_stages": 1},
                divisible_by_16=("Q_nope", "Q_pe", "KV_cache", "Indices", "Out", "stride_qn_t", "stride_qn_h",
                                 "stride_qp_t", "stride_cache_slot", "stride_o_t", "stride_o_h"),
            ))
    for heads in (16, 128):
        signature = dict(specs[0].signature)
        constexprs = dict(specs[0].constexprs, BLOCK_H=block_h_for(heads), OUT_OF_RANGE_IS_NONE=True)
        specs.append(CompileSpec(
            name=f"sparse_prefill[h{heads},bf16]", fn=_sparse_decode_kernel, signature=signature,
            constexprs=constexprs, options=dict(specs[0].options), divisible_by_16=specs[0].divisible_by_16,
        ))
    signature = {"Partials": "*fp32", "Attn_sink": "*fp32", "Out": "*bf16", "Lse": "*fp32", "num_splits": "i32",
                 "stride_p_t": "i32", "stride_p_h": "i32", "stride_p_s": "i32", "stride_o_t": "i32", "stride_o_h": "i32",
                 "stride_lse_t": "i32", "KV_LORA_RANK": "constexpr", "BLOCK_S": "constexpr", "HAS_SINK": "constexpr"}
    specs.append(CompileSpec(
        name="sparse_reduce[bf16]", fn=_sparse_reduce_kernel, signature=signature,
        constexprs={"KV_LORA_RANK": 512, "BLOCK_S": MAX_SPLITS, "HAS_SINK": True}, options={"num_warps": 4},
        divisible_by_16=("Partials", "Out", "stride_p_t", "stride_p_h", "stride_p_s", "stride_o_t", "stride_o_h"),
    ))
    return specs
