"""Split-KV MLA decode over the paged latent cache (Triton).

Decode is MQA over the latent: every query head attends to the same cache rows
``kv_cache[block, slot] = [kv_c (Lkv) | k_pe (R)]`` with a 576-wide QK head
(Lkv + R) and a 512-wide V that is the first Lkv columns of the same rows.

Design (why it is shaped this way):

* One program owns a block of ``BLOCK_H`` query rows (heads, and for multi-token
  decode the Q query tokens folded into the head dimension: row = token * N +
  head) and one KV split of one request.  Each KV tile ``[BLOCK_N, Lkv + R]`` is
  loaded once per head block and used for both products, ``q @ K^T`` on the
  576 columns and ``P @ V`` on the first 512, so a 128-head model reads the
  cache twice at BLOCK_H=64 instead of eight times at 16 heads per program.
* The grid is ``(head blocks, splits, requests)`` with the head blocks fastest:
  the programs that share a KV tile start together and the second read of a
  tile comes from L2.
* Head counts under the MMA minimum (16 rows) are padded with masked rows.
* The per-split length is computed inside the kernel from ``seq_lens`` (rounded
  up to ``BLOCK_N`` so that a tile never straddles a page when the page is a
  multiple of the tile), so the launch depends only on Python ints: no host
  synchronisation and no allocation, safe to capture in a CUDA graph.
* Stage 1 writes a normalised partial output and its natural-log LSE per split
  into ``attn_logits[B * Q, N, max_num_kv_splits, W]`` (columns 0..Lkv-1 and
  Lkv; W = `attn_logits_width(Lkv)` pads the rows to 64 bytes); stage 2 merges
  the splits by LSE.  Splits that receive no tokens write LSE -inf and are
  skipped by the merge.  With one split, stage 1 writes the final output
  directly and stage 2 is not launched.
* The 512 latent columns are two halves (two accumulators, two V tiles): no
  [BLOCK_H, 512] float32 tensor is ever converted or stored at once, which
  is what spilled registers with a single accumulator.
* QK is ``q @ K^T`` (the query rows as the matrix op's M) or, with
  ``DecodeLaunchConfig.tokens_as_m``, ``(K @ q^T)^T`` (the tile's cache tokens
  as M).  AMD's compiler gives a QK that feeds P V every warp along M, so with
  the rows as M a block of fewer than 16 x warps rows computes each QK element
  in several warps (4 for 16 or 32 rows on 4 or 8 warps); with the tokens as M
  and 16 tokens per warp each is computed once.  The AMD tables take it from
  17 rows on (`launch_config._decode_table`; the compile check reports the
  repetition as ``mma_repeat``).
* FP8 caches carry a per-tensor scale: the scores are scaled by ``k_scale`` and
  the output once at the end, so the tile is only converted (to float16,
  one instruction per pair), never multiplied.  Where the Triton backend has
  no conversion for the cache's FP8 flavour (``float8_e4m3fnuz`` on NVIDIA,
  any FP8 on sm_80) the bytes are decoded with integer arithmetic instead.
  On NVIDIA K^T of an FP8 tile is loaded separately (see `load_k_transposed`).
* Bad index data never moves a load outside its tensor: ``seq_lens`` outside
  ``[0, max_blocks * block_size]`` are read as 0, and a block-table entry
  outside ``[0, num_blocks)`` as block 0 (a scalar compare and select per tile,
  nothing more in the loop).  Such a request's rows and LSE are NaN (a split
  that met a bad block writes LSE NaN and the merge propagates it) and the
  kind of error is ORed into the device's error flag (`mla_multi.errors`).
* Launch configurations (`launch_config.decode_config`) come from the
  compile check's register/spill/LDS report and H200 timings
  (bench/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from mla_multi import errors
from mla_multi.cache_formats import FP8_DS_MLA_V4
from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES
from mla_multi.ds_mla_cache import KV_LORA_RANK as DS_KV_LORA_RANK
from mla_multi.ds_mla_cache import ROPE_DIM as DS_ROPE_DIM
from mla_multi.kernels import capturing, capturing_on
from mla_multi.kernels.launch import BoundLaunch, pdl_constexprs, pdl_enter
from mla_multi.kernels.launch_config import (
    CompileSpec,
    DecodeLaunchConfig,
    all_decode_configs,
    all_decode_reduce_configs,
    decode_config,
    decode_reduce_config,
    fp8_bit_decode_needed,
    load_k_transposed,
    tl_range_disables_licm,
    wgmma_decode_reason,
)

__all__ = ["mla_decode_fwd", "attn_logits_width", "compile_specs", "FP8_DTYPES", "SUPPORTED_KV_LORA_RANKS"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# exponent bias of each FP8 flavour; 0 in the kernel means "not decoded by bits"
_FP8_EXPONENT_BIAS = {torch.float8_e4m3fn: 7, torch.float8_e4m3fnuz: 8}
_QUERY_DTYPES = (torch.float16, torch.bfloat16)
_CACHE_DTYPES = (torch.float16, torch.bfloat16) + FP8_DTYPES
MAX_QUERY_LEN = 8
SUPPORTED_KV_LORA_RANKS = "powers of two from 16 to 512 (DeepSeek: 512)"
_LOG2E = 1.4426950408889634
BLOCK_INDEX_ERROR = tl.constexpr(errors.BLOCK_INDEX)
SEQ_RANGE_ERROR = tl.constexpr(errors.SEQ_RANGE)
# float32 values per partial row: a multiple of 16, so every partial row starts
# 64-byte aligned and the partial stores are vectorised
_ATTN_LOGITS_ALIGN = 16


def attn_logits_width(kv_lora_rank: int) -> int:
    """Last dim of the ``attn_logits`` workspace: the partial output (Lkv), its LSE
    (column Lkv) and padding to a multiple of 16 float32 values (528 for Lkv 512).

    Aligned rows let the compiler vectorise the partial stores (4 values per
    store instead of 1, a quarter of the address registers in the epilogue).
    """
    return -(-(kv_lora_rank + 1) // _ATTN_LOGITS_ALIGN) * _ATTN_LOGITS_ALIGN


@triton.jit
def _fp8_bits_to_float(bits, EXPONENT_BIAS: tl.constexpr):
    """Decode e4m3 bytes (uint8) to float32 by integer arithmetic.

    EXPONENT_BIAS is 7 for float8_e4m3fn and 8 for float8_e4m3fnuz.  NaN codes are
    not produced by the saturating quantiser and are not special-cased.
    """
    b = bits.to(tl.int32)
    sign = (b >> 7) & 1
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal_bits = (sign << 31) | ((exponent + (127 - EXPONENT_BIAS)) << 23) | (mantissa << 20)
    normal = normal_bits.to(tl.float32, bitcast=True)
    # subnormals: mantissa * 2^(1 - bias - 3)
    subnormal = mantissa.to(tl.float32) * tl.exp2(-(EXPONENT_BIAS + 2.0))
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _sink_factor(sink, lse, empty):
    """exp(lse) / (exp(lse) + exp(sink)), an attention sink's factor on a row's output (+inf gives 0, -inf 1);
    1 for a row without mass (`empty`: where lse is -inf; its output stays 0), NaN for a NaN LSE."""
    return tl.where(empty, 1.0, 1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))


@triton.jit
def _token_and_head(rows, num_heads, Q_LEN: tl.constexpr):
    """(query token, head) of each folded row (row = token * num_heads + head)."""
    if Q_LEN == 1:
        # one query token: the row is the head (no division to keep alive)
        return rows * 0, rows
    return rows // num_heads, rows % num_heads


@triton.jit
def _row_power_of_two_scales(amax):
    """(2^(12 - e), 2^(e - 12)) per row, e = floor(log2 amax), built from the
    exponent bits (exact); e is clamped to [-100, 100] so that an all-zero,
    subnormal, infinite or NaN row still gets a finite power of two."""
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.minimum(tl.maximum(exponent, -100), 100)
    up = ((127 + 12 - exponent) << 23).to(tl.float32, bitcast=True)
    down = ((127 - 12 + exponent) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def _decode_tile(
    start, split_end, q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, bad_block,
    KV_cache, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, offs_lo, offs_hi, offs_r, qk_scale,
    rows, row_limit,
    Q_LEN: tl.constexpr, KV_LORA_RANK: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    LOAD_K_TRANSPOSED: tl.constexpr, FP8_BITS_BIAS: tl.constexpr, ROW_SCALED: tl.constexpr,
    TOKENS_AS_M: tl.constexpr,
):
    """One [BLOCK_N, Lkv + R] cache tile: QK on the 576 columns, online softmax, P @ V on the first Lkv.

    A block-table entry outside [0, num_cache_blocks) is read as block 0 (in
    bounds) and marked in `bad_block` (a scalar when the tile lies in one page,
    else one flag per position); the caller turns the request's rows to NaN.
    """
    pos = start + tl.arange(0, BLOCK_N)
    pos_valid = pos < split_end
    if PAGE_SIZE % BLOCK_N == 0:
        # the tile lies inside one page: one block-table entry
        page = tl.load(block_table_row + start // PAGE_SIZE)
        page_bad = (page < 0) | (page >= num_cache_blocks)
        bad_block = bad_block | page_bad
        page = tl.where(page_bad, 0, page).to(tl.int64)
        row_ptrs = KV_cache + page * stride_kv_block + (pos % PAGE_SIZE) * stride_kv_token
    else:
        pages = tl.load(block_table_row + pos // PAGE_SIZE, mask=pos_valid, other=0)
        # masked positions read page 0, which only a cache of no block makes bad,
        # and such a cache has no position to read
        pages_bad = (pages < 0) | (pages >= num_cache_blocks)
        bad_block = bad_block | pages_bad
        pages = tl.where(pages_bad, 0, pages).to(tl.int64)
        row_ptrs = KV_cache + pages * stride_kv_block + (pos % PAGE_SIZE) * stride_kv_token
    kv_lo = tl.load(row_ptrs[:, None] + offs_lo[None, :], mask=pos_valid[:, None], other=0.0)
    kv_hi = tl.load(row_ptrs[:, None] + offs_hi[None, :], mask=pos_valid[:, None], other=0.0)
    k_pe = tl.load(row_ptrs[:, None] + KV_LORA_RANK + offs_r[None, :], mask=pos_valid[:, None], other=0.0)
    if FP8_BITS_BIAS != 0:
        kv_lo = _fp8_bits_to_float(kv_lo, FP8_BITS_BIAS).to(q_lo.dtype)
        kv_hi = _fp8_bits_to_float(kv_hi, FP8_BITS_BIAS).to(q_lo.dtype)
        k_pe = _fp8_bits_to_float(k_pe, FP8_BITS_BIAS).to(q_lo.dtype)
    else:
        kv_lo = kv_lo.to(q_lo.dtype)
        kv_hi = kv_hi.to(q_lo.dtype)
        k_pe = k_pe.to(q_lo.dtype)

    if TOKENS_AS_M:
        # S^T = K Q^T: the cache tokens are the matrix op's M, so the warps
        # split the tile's tokens and each computes its share of QK once (with
        # the query rows as M, AMD lays a chained QK out with every warp on M,
        # and rows < 16 x warps repeat it in every warp); the tile is never
        # transposed, so no K^T is loaded either
        qk_t = tl.dot(kv_lo, tl.trans(q_lo))
        qk_t = tl.dot(kv_hi, tl.trans(q_hi), acc=qk_t)
        qk_t = tl.dot(k_pe, tl.trans(q_pe), acc=qk_t)
        qk = tl.trans(qk_t)
    else:
        if LOAD_K_TRANSPOSED:
            # K^T is loaded a second time (an L2 hit) instead of transposed:
            # a tile that is converted in registers and also transposed for
            # the other product would not be pipelined (async copies)
            if PAGE_SIZE % BLOCK_N == 0:
                kt_ptrs = KV_cache + page * stride_kv_block + (pos % PAGE_SIZE) * stride_kv_token
            else:
                kt_ptrs = row_ptrs
            kt_lo = tl.load(kt_ptrs[None, :] + offs_lo[:, None], mask=pos_valid[None, :], other=0.0)
            kt_hi = tl.load(kt_ptrs[None, :] + offs_hi[:, None], mask=pos_valid[None, :], other=0.0)
            if FP8_BITS_BIAS != 0:
                kt_lo = _fp8_bits_to_float(kt_lo, FP8_BITS_BIAS).to(q_lo.dtype)
                kt_hi = _fp8_bits_to_float(kt_hi, FP8_BITS_BIAS).to(q_lo.dtype)
            else:
                kt_lo = kt_lo.to(q_lo.dtype)
                kt_hi = kt_hi.to(q_lo.dtype)
            qk = tl.dot(q_lo, kt_lo)
            qk = tl.dot(q_hi, kt_hi, acc=qk)
        else:
            qk = tl.dot(q_lo, tl.trans(kv_lo))
            qk = tl.dot(q_hi, tl.trans(kv_hi), acc=qk)
        qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk)
    if ROW_SCALED:
        qk = qk * qk_scale[:, None]
    else:
        qk = qk * qk_scale
    if Q_LEN > 1:
        visible = pos_valid[None, :] & (pos[None, :] < row_limit[:, None])
    else:
        visible = pos_valid[None, :] & (rows >= 0)[:, None]
    qk = tl.where(visible, qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # a row that has seen nothing yet keeps max -inf: subtract 0 instead (no NaN)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(kv_lo.dtype)
    acc_lo = tl.dot(p, kv_lo, acc=acc_lo * alpha[:, None])
    acc_hi = tl.dot(p, kv_hi, acc=acc_hi * alpha[:, None])
    return m_new, l_i, acc_lo, acc_hi, bad_block


@triton.jit
def _mla_decode_split_kernel(
    Q_nope,
    Q_pe,
    KV_cache,
    Block_table,
    Seq_lens,
    K_scale,
    Attn_logits,
    Out,
    Lse,
    Error_flag,
    sm_scale,
    num_heads,
    num_kv_splits,
    max_seq_len,
    num_cache_blocks,
    stride_qn_b,
    stride_qn_t,
    stride_qn_h,
    stride_qp_b,
    stride_qp_t,
    stride_qp_h,
    stride_kv_block,
    stride_kv_token,
    stride_bt_b,
    stride_al_row,
    stride_al_h,
    stride_al_split,
    stride_o_b,
    stride_o_t,
    stride_o_h,
    stride_lse_b,
    stride_lse_t,
    stride_lse_h,
    Q_LEN: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    LOAD_K_TRANSPOSED: tl.constexpr,
    FP8_COMPUTE_FP16: tl.constexpr,
    FP8_BITS_BIAS: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr,
    DISABLE_LICM: tl.constexpr,
    TOKENS_AS_M: tl.constexpr,
    Sink=None,
    HAS_SINK: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    if PDL:
        pdl_enter()
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    batch = tl.program_id(2)

    seq_len = tl.load(Seq_lens + batch)
    # a length outside the block-table row would walk past it: read as 0, the
    # request's rows become NaN below
    bad_seq_len = (seq_len < 0) | (seq_len > max_seq_len)
    seq_len = tl.where(bad_seq_len, 0, seq_len)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    rows = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_valid = rows < Q_LEN * num_heads
    token, head = _token_and_head(rows, num_heads, Q_LEN)
    # The 512 latent columns are handled as two halves (two accumulators, two
    # V tiles) so that no single [BLOCK_H, 512] fp32 tensor has to be converted
    # or stored at once: that conversion was what spilled registers.
    HALF: tl.constexpr = KV_LORA_RANK // 2
    offs_lo = tl.arange(0, HALF)
    offs_hi = HALF + tl.arange(0, HALF)
    offs_r = tl.arange(0, ROPE_DIM)

    q_nope_ptrs = Q_nope + batch * stride_qn_b + token * stride_qn_t + head * stride_qn_h
    q_lo = tl.load(q_nope_ptrs[:, None] + offs_lo[None, :], mask=row_valid[:, None], other=0.0)
    q_hi = tl.load(q_nope_ptrs[:, None] + offs_hi[None, :], mask=row_valid[:, None], other=0.0)
    q_pe_ptrs = Q_pe + batch * stride_qp_b + token * stride_qp_t + head * stride_qp_h
    q_pe = tl.load(q_pe_ptrs[:, None] + offs_r[None, :], mask=row_valid[:, None], other=0.0)
    # scores in the log2 domain: exp2 is the native instruction
    qk_scale = sm_scale * 1.4426950408889634
    if HAS_K_SCALE:
        k_scale = tl.load(K_scale).to(tl.float32)
        qk_scale = qk_scale * k_scale
    if FP8_COMPUTE_FP16:
        # FP8 tiles convert to float16 in one instruction per pair (bfloat16
        # takes a detour through float32), and float16 holds e4m3 exactly.  The
        # query is scaled per row by a power of two that puts its largest
        # magnitude in [2^12, 2^13): float16 then holds every bfloat16 value of
        # the row exactly (down to 2^-26 of its maximum) and nothing overflows;
        # the scores undo the factor.
        amax = tl.maximum(tl.max(tl.abs(q_lo.to(tl.float32)), 1), tl.max(tl.abs(q_hi.to(tl.float32)), 1))
        amax = tl.maximum(amax, tl.max(tl.abs(q_pe.to(tl.float32)), 1))
        up, down = _row_power_of_two_scales(amax)
        q_lo = (q_lo.to(tl.float32) * up[:, None]).to(tl.float16)
        q_hi = (q_hi.to(tl.float32) * up[:, None]).to(tl.float16)
        q_pe = (q_pe.to(tl.float32) * up[:, None]).to(tl.float16)
        qk_scale = qk_scale * down
    # bottom-right causal limit of each folded query token
    row_limit = seq_len - Q_LEN + 1 + token

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    block_table_row = Block_table + batch * stride_bt_b
    if PAGE_SIZE % BLOCK_N == 0:
        bad_block = batch < 0
    else:
        bad_block = tl.zeros([BLOCK_N], dtype=tl.int1)

    if DISABLE_LICM:
        # Nothing hoisted out of the tile loop: with a 64-row tile on sm_90 the
        # shared-memory descriptors of the query tile's 36 wgmma k-steps would
        # otherwise be computed before the loop and held (spilled) across it;
        # recomputed, each is an add beside its wgmma.
        for start in tl.range(split_start, split_end, BLOCK_N, disable_licm=True):
            m_i, l_i, acc_lo, acc_hi, bad_block = _decode_tile(
                start, split_end, q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, bad_block, KV_cache, block_table_row,
                num_cache_blocks, stride_kv_block, stride_kv_token, offs_lo, offs_hi, offs_r, qk_scale, rows,
                row_limit, Q_LEN, KV_LORA_RANK, PAGE_SIZE, BLOCK_N, LOAD_K_TRANSPOSED, FP8_BITS_BIAS,
                FP8_COMPUTE_FP16, TOKENS_AS_M,
            )
    else:
        for start in range(split_start, split_end, BLOCK_N):
            m_i, l_i, acc_lo, acc_hi, bad_block = _decode_tile(
                start, split_end, q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, bad_block, KV_cache, block_table_row,
                num_cache_blocks, stride_kv_block, stride_kv_token, offs_lo, offs_hi, offs_r, qk_scale, rows,
                row_limit, Q_LEN, KV_LORA_RANK, PAGE_SIZE, BLOCK_N, LOAD_K_TRANSPOSED, FP8_BITS_BIAS,
                FP8_COMPUTE_FP16, TOKENS_AS_M,
            )

    if PAGE_SIZE % BLOCK_N != 0:
        bad_block = tl.max(bad_block.to(tl.int32), 0) > 0
    tl.atomic_or(Error_flag, BLOCK_INDEX_ERROR, mask=bad_block)
    tl.atomic_or(Error_flag, SEQ_RANGE_ERROR, mask=bad_seq_len)
    invalid = bad_block | bad_seq_len

    # l_i >= 0, or NaN where a NaN (or +inf) score reached the softmax: `!= 0` keeps NaN rows on the mass path,
    # so that their output and LSE come out NaN (the NaN policy) at no extra cost
    has_mass = l_i != 0.0
    inv_l = tl.where(has_mass, 1.0 / tl.where(has_mass, l_i, 1.0), 0.0)
    if HAS_K_SCALE:
        inv_l = inv_l * k_scale
    inv_l = tl.where(invalid, float("nan"), inv_l)
    # natural-log LSE: m is in the log2 domain
    lse = tl.where(has_mass, (m_i + tl.log2(tl.where(has_mass, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    lse = tl.where(invalid, float("nan"), lse)

    # The output rows are derived again from a loop result (l_i >= 0, so the
    # term is 0): otherwise the compiler keeps the query loads' per-row
    # offsets alive across the loop, in registers the tile loop needs.
    rows = head_block * BLOCK_H + tl.arange(0, BLOCK_H) + (l_i < 0.0).to(tl.int32)
    row_valid = rows < Q_LEN * num_heads
    token, head = _token_and_head(rows, num_heads, Q_LEN)

    if DIRECT_OUTPUT:
        if HAS_SINK:  # the sink's factor folded into 1 / sum
            empty = lse == float("-inf")
            inv_l = inv_l * _sink_factor(tl.load(Sink + head, mask=row_valid, other=0.0), lse, empty)
        out_ptrs = Out + batch * stride_o_b + token * stride_o_t + head * stride_o_h
        out_dtype = Out.dtype.element_ty
        tl.store(out_ptrs[:, None] + offs_lo[None, :], (acc_lo * inv_l[:, None]).to(out_dtype), mask=row_valid[:, None])
        tl.store(out_ptrs[:, None] + offs_hi[None, :], (acc_hi * inv_l[:, None]).to(out_dtype), mask=row_valid[:, None])
        lse_ptrs = Lse + batch * stride_lse_b + token * stride_lse_t + head * stride_lse_h
        tl.store(lse_ptrs, lse, mask=row_valid)
    else:
        partial_ptrs = (
            Attn_logits + (batch * Q_LEN + token) * stride_al_row + head * stride_al_h + split * stride_al_split
        )
        tl.store(partial_ptrs[:, None] + offs_lo[None, :], acc_lo * inv_l[:, None], mask=row_valid[:, None])
        tl.store(partial_ptrs[:, None] + offs_hi[None, :], acc_hi * inv_l[:, None], mask=row_valid[:, None])
        tl.store(partial_ptrs + KV_LORA_RANK, lse, mask=row_valid)


@triton.jit
def _mla_decode_reduce_kernel(
    Attn_logits,
    Out,
    Lse,
    Sink,
    num_kv_splits,
    stride_al_row,
    stride_al_h,
    stride_al_split,
    stride_o_b,
    stride_o_t,
    stride_o_h,
    stride_lse_b,
    stride_lse_t,
    stride_lse_h,
    Q_LEN: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    HAS_SINK: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PARTIALS_BESIDE_LSE: tl.constexpr = False,
):
    """Merge the per-split partial outputs of one (query token, head) by LSE.

    HAS_SINK: the output times exp(lse) / (exp(lse) + exp(Sink[head])) (an attention sink, Sink float32
    [heads]: +inf gives 0, -inf 1; a row without mass keeps its 0); the LSE stored is the one without it.

    One program owns BLOCK_DV output columns and reads BLOCK_SPLITS splits per
    step (all of them in one step up to 64 splits) with a running maximum, so
    the merge is a few wide independent loads rather than a chain of small ones
    (`launch_config.decode_reduce_config` sizes the tile). PDL: launched by programmatic dependent launch
    (`launch.pdl_enter`). PARTIALS_BESIDE_LSE (NVIDIA, `reduce_partials_beside_lse`): the partial rows loaded
    with the split LSEs, not after them (one trip to memory, not two); a split without mass has whatever its
    rows hold dropped. On AMD that load's split addresses spill scalar registers: there the rows of splits
    with mass are loaded once their LSEs are in.
    """
    if PDL:
        pdl_enter()
    row = tl.program_id(0)
    head = tl.program_id(1)
    column_block = tl.program_id(2)
    batch = row // Q_LEN
    token = row % Q_LEN
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = column_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
    base = Attn_logits + row * stride_al_row + head * stride_al_h

    top = float("-inf")
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    weight_sum = 0.0
    for first in range(0, num_kv_splits, BLOCK_SPLITS):
        splits = first + offs_s
        split_lse = tl.load(
            base + splits * stride_al_split + KV_LORA_RANK, mask=splits < num_kv_splits, other=float("-inf")
        )
        has_mass = split_lse > float("-inf")
        if PARTIALS_BESIDE_LSE:
            # whatever the rows of a split without mass hold is dropped, never weighed
            partial = tl.load(base + splits[:, None] * stride_al_split + offs_d[None, :],
                              mask=(splits < num_kv_splits)[:, None], other=0.0)
            partial = tl.where(has_mass[:, None], partial, 0.0)
        else:
            # a split without mass is never read
            partial = tl.load(
                base + splits[:, None] * stride_al_split + offs_d[None, :], mask=has_mass[:, None], other=0.0
            )
        new_top = tl.maximum(top, tl.max(split_lse, 0))
        top_use = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(top - top_use)
        # a split of a request with bad indices wrote LSE NaN: its weight is NaN,
        # so the whole row comes out NaN (no flag of its own in the loop)
        weight = tl.where(has_mass, tl.exp(split_lse - top_use), tl.where(split_lse == split_lse, 0.0, float("nan")))
        acc = acc * rescale + tl.sum(weight[:, None] * partial, 0)
        weight_sum = weight_sum * rescale + tl.sum(weight, 0)
        top = new_top
    top = tl.where(top == float("-inf"), 0.0, top)

    total = weight_sum
    # total is 0 (no split has mass: 0 and -inf), positive, or NaN (a bad split: NaN)
    no_mass = total == 0.0
    out = acc * tl.where(no_mass, 0.0, 1.0 / tl.where(no_mass, 1.0, total))
    lse = tl.where(no_mass, float("-inf"), top + tl.log(tl.where(no_mass, 1.0, total)))
    if HAS_SINK:
        out = out * _sink_factor(tl.load(Sink + head), lse, no_mass)
    out_ptrs = Out + batch * stride_o_b + token * stride_o_t + head * stride_o_h
    tl.store(out_ptrs + offs_d, out.to(Out.dtype.element_ty))
    tl.store(Lse + batch * stride_lse_b + token * stride_lse_t + head * stride_lse_h, lse, mask=column_block == 0)


def reduce_partials_beside_lse(platform) -> bool:
    """Whether the split merge on `platform` loads its partial rows beside the split LSEs
    (`_mla_decode_reduce_kernel`'s PARTIALS_BESIDE_LSE): NVIDIA (one trip to memory where there were two: 128
    heads B = 1 S = 8192 decode 20.2 -> 19.6 µs on an H200, bench/RESULTS.md); on AMD the load's split addresses
    spill scalar registers (gfx942 / gfx950, 7-19 of them), so not there."""
    return platform.is_cuda()


def ds_mla_decode_reason(platform, kv_cache=None) -> str:
    """Why the decode kernels cannot read an fp8_ds_mla cache (uint8 [num_blocks, block_size, 656]) in place
    ("" when they can): only the sm_90 warp-specialised kernels' loader dequantises its rows (e4m3 values,
    four float32 scales a row, 16-bit rotary values), and it reads them as 4-byte words."""
    reason = wgmma_decode_reason(platform, torch.uint8)
    if reason:
        return f"fp8_ds_mla rows are read by the sm_90 warp-specialised decode kernels only: {reason}"
    if kv_cache is not None and any(value % 4 for value in (kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1))):
        return (
            f"the fp8_ds_mla kv_cache's rows start off 4-byte boundaries (data_ptr {kv_cache.data_ptr()}, strides "
            f"{tuple(kv_cache.stride())})"
        )
    return ""


def split_partials(num_rows: int, num_heads: int, num_kv_splits: int, kv_lora_rank: int, device) -> torch.Tensor:
    """The ``attn_logits`` buffer of a launch of `num_kv_splits` splits: float32 [rows, N, splits, W]. With one
    split the kernels write the output and LSE directly and never touch it, so one row of W values expanded
    to that shape (stride 0) stands in for it (at 8192 query rows of 128 heads the real one is 2.2 GiB)."""
    width = attn_logits_width(kv_lora_rank)
    if num_kv_splits == 1:
        return torch.empty(width, dtype=torch.float32, device=device).expand(num_rows, num_heads, 1, width)
    return torch.empty((num_rows, num_heads, num_kv_splits, width), dtype=torch.float32, device=device)


def shared_split_partials(num_rows: int, num_heads: int, num_kv_splits: int, kv_lora_rank: int,
                          device) -> tuple[torch.Tensor, tuple | None]:
    """`split_partials` of an eager functional call, sliced from the device's shared workspace
    (`mla_multi.workspace.current_workspace_manager`), which every layer shares too: the partials live only
    while the call's kernels run, in stream order. During a CUDA-graph capture (the graph must not read a
    buffer that a later, larger call reallocates), with one split, or where the shared workspace is locked
    too small, a buffer of their own.

    Returns (the partials, (the shared workspace, the buffer they view, its device key) or None where they are a
    buffer of their own): while `mla_multi.workspace.still_shared` holds for these three the same call gets the
    same view back, which a caller may keep instead of asking again."""
    device = torch.device(device)
    if num_kv_splits == 1 or capturing_on(device):
        return split_partials(num_rows, num_heads, num_kv_splits, kv_lora_rank, device), None
    from mla_multi.workspace import WorkspaceLockedError, current_workspace_manager

    spec = ((num_rows, num_heads, num_kv_splits, attn_logits_width(kv_lora_rank)), torch.float32)
    key = errors.canonical_device(device)
    workspace = current_workspace_manager(key)
    try:
        (partials,) = workspace.get_simultaneous(spec)
    except WorkspaceLockedError:
        return split_partials(num_rows, num_heads, num_kv_splits, kv_lora_rank, device), None
    return partials, (workspace, workspace._buffer, key)


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True)
class V4Pages:
    """DeepSeek-V4 caches (``fp8_ds_mla_v4``, uint8 [num_blocks, page_size, 584] whose block stride is the
    padded block: `mla_multi.cache_formats`) read in place by the sm_90 warp-specialised kernel through the
    sparse index lists as they are: the main cache is the plan's ``kv_cache``, an optional second one (the
    same page size) is passed to each launch as ``extra_cache``; the block table is the first index list [B,
    topk] itself (slots ``block * page_size + offset`` of the main cache, -1 no token), each launch passes the
    second list (slots of the second cache) and both lengths (``lists=`` of `DecodeKernelPlan.launch`: entries
    past a token's topk_length do not count; one outside [-1, its cache's slots) makes the token's rows NaN
    and sets `errors.SPARSE_INDEX`); every token's length is topk + extra_topk, and ``seq_lens`` must hold it: the
    kernel's loader takes every split's range from that width without reading ``seq_lens`` (which stands in
    for a length not given, clamped to its list), its other partitions from ``seq_lens`` (the TRITON backend
    passes a constant of the width, `_V4InPlaceLaunch`). ``lists``: (topk,
    extra_topk, the second list's row stride). The query is 512 wide (``q_pe``: 64 columns the kernel does not
    read). Both caches start on 16 bytes (their blocks do, being multiples of 576 bytes): the loader's row
    addresses are known multiples of 16."""

    page_size: int
    first_extra_slot: int  # the main cache's slot count
    num_slots: int  # both caches'
    extra_block_stride: int  # bytes
    lists: tuple[int, int, int]


def v4_tiles_per_split(v4: V4Pages, num_kv_splits: int, block_n: int) -> int:
    """The tiles a split of full V4 index lists holds (the split kernel's `_split_range`)."""
    tokens = -(-(v4.lists[0] + v4.lists[1]) // num_kv_splits)
    return -(-tokens // block_n)


def _check_inputs(
    q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, attn_logits, out, lse, error_flag=None,
    v4: V4Pages | None = None,
):
    if q_nope.dim() not in (3, 4):
        raise ValueError(f"q_nope has shape {tuple(q_nope.shape)}; accepted: [B, N, Lkv] or [B, Q, N, Lkv]")
    if q_pe.dim() != q_nope.dim() or q_pe.shape[:-1] != q_nope.shape[:-1]:
        raise ValueError(
            f"q_pe has shape {tuple(q_pe.shape)}; accepted: q_nope's leading dims {tuple(q_nope.shape[:-1])} + [R]"
        )
    batch, num_heads, kv_lora_rank = q_nope.shape[0], q_nope.shape[-2], q_nope.shape[-1]
    q_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
    rope_dim = q_pe.shape[-1]
    if not 1 <= q_len <= MAX_QUERY_LEN:
        raise ValueError(f"q_nope has {q_len} query tokens per request; accepted: 1..{MAX_QUERY_LEN}")
    if not 1 <= num_heads <= 128:
        raise ValueError(f"q_nope has {num_heads} heads; accepted: 1..128")
    if not (_is_power_of_two(kv_lora_rank) and 16 <= kv_lora_rank <= 512):
        raise ValueError(f"kv_lora_rank={kv_lora_rank}; accepted: {SUPPORTED_KV_LORA_RANKS}")
    if not (_is_power_of_two(rope_dim) and 16 <= rope_dim <= 128):
        raise ValueError(f"qk_rope_head_dim={rope_dim}; accepted: powers of two from 16 to 128 (DeepSeek: 64)")
    if q_nope.dtype not in _QUERY_DTYPES or q_pe.dtype != q_nope.dtype:
        raise ValueError(
            f"q_nope/q_pe dtypes {q_nope.dtype}/{q_pe.dtype}; accepted: both float16 or both bfloat16"
        )
    ds_mla = kv_cache.dtype == torch.uint8
    if ds_mla and (kv_lora_rank, rope_dim) != (DS_KV_LORA_RANK, DS_ROPE_DIM):
        raise ValueError(
            f"an fp8_ds_mla (uint8) kv_cache with kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={rope_dim}; "
            f"accepted: {DS_KV_LORA_RANK} and {DS_ROPE_DIM}"
        )
    if ds_mla and q_nope.dtype != torch.bfloat16:
        raise ValueError(f"an fp8_ds_mla (uint8) kv_cache with a {q_nope.dtype} query; accepted: bfloat16")
    width = FP8_DS_MLA_V4.bytes_per_token if v4 is not None else FP8_DS_MLA_BYTES if ds_mla else kv_lora_rank + rope_dim
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; accepted: [num_blocks, block_size, {width}] "
            + ("(fp8_ds_mla_v4 bytes)" if v4 is not None else "(fp8_ds_mla bytes)" if ds_mla
               else "(kv_lora_rank + qk_rope_head_dim)")
        )
    if v4 is not None and (not ds_mla or kv_cache.shape[1] != v4.page_size):
        raise ValueError(
            f"V4 pages of {v4.page_size} tokens with a {kv_cache.dtype} kv_cache of shape {tuple(kv_cache.shape)}; "
            f"accepted: uint8 [num_blocks, {v4.page_size}, {FP8_DS_MLA_V4.bytes_per_token}]"
        )
    if kv_cache.dtype not in _CACHE_DTYPES + (torch.uint8,):
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype}; accepted: {', '.join(map(str, _CACHE_DTYPES))}, or uint8 "
            "(fp8_ds_mla rows, sm_90 warpgroup kernels)"
        )
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        # a bad block-table entry is read as block 0, which must exist
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}; accepted: at least one block of one token")
    if kv_cache.stride(-1) != 1 or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("q_nope, q_pe and kv_cache must have a contiguous last dimension")
    if kv_cache.dtype in FP8_DTYPES:
        if k_scale is None:
            raise ValueError(f"k_scale=None with a {kv_cache.dtype} kv_cache; accepted: a float32 tensor of 1 element")
    if k_scale is not None and (not torch.is_tensor(k_scale) or k_scale.numel() != 1):
        raise ValueError(f"k_scale={k_scale!r}; accepted: None or a tensor of 1 element")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table has shape {tuple(block_table.shape)} and dtype {block_table.dtype}; "
            f"accepted: [{batch}, max_blocks] int32"
        )
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)} and dtype {seq_lens.dtype}; accepted: [{batch}] int32")
    if not isinstance(num_kv_splits, int) or num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits!r}; accepted: a Python int >= 1")
    if (
        attn_logits.dim() != 4
        or attn_logits.dtype != torch.float32
        or (attn_logits.shape[0], attn_logits.shape[1]) != (batch * q_len, num_heads)
        or attn_logits.shape[3] < kv_lora_rank + 1
        or attn_logits.stride(-1) != 1
    ):
        raise ValueError(
            f"attn_logits has shape {tuple(attn_logits.shape)} and dtype {attn_logits.dtype}; accepted: float32 "
            f"[{batch * q_len}, {num_heads}, max_num_kv_splits, >= {kv_lora_rank + 1}] with a contiguous last dim "
            f"(attn_logits_width({kv_lora_rank}) = {attn_logits_width(kv_lora_rank)} keeps the rows aligned)"
        )
    if num_kv_splits > attn_logits.shape[2]:
        raise ValueError(
            f"num_kv_splits={num_kv_splits} exceeds the {attn_logits.shape[2]} splits reserved in attn_logits; "
            f"accepted: 1..{attn_logits.shape[2]}"
        )
    if out.shape != q_nope.shape or out.dtype != q_nope.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}; accepted: {tuple(q_nope.shape)} {q_nope.dtype}"
        )
    if lse.shape != q_nope.shape[:-1] or lse.dtype != torch.float32:
        raise ValueError(
            f"lse has shape {tuple(lse.shape)} and dtype {lse.dtype}; accepted: {tuple(q_nope.shape[:-1])} float32"
        )
    devices = {t.device for t in (q_nope, q_pe, kv_cache, block_table, seq_lens, attn_logits, out, lse)}
    if k_scale is not None:
        devices.add(k_scale.device)
    if error_flag is not None:
        if error_flag.shape != (1,) or error_flag.dtype != torch.int32:
            raise ValueError(
                f"error_flag has shape {tuple(error_flag.shape)} and dtype {error_flag.dtype}; accepted: [1] int32"
            )
        devices.add(error_flag.device)
    if len(devices) != 1:
        raise ValueError(f"tensors are on devices {sorted(map(str, devices))}; accepted: all on one device")
    return batch, q_len, num_heads, kv_lora_rank, rope_dim


def mla_decode_fwd(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None,
    num_kv_splits: int,
    attn_logits: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: DecodeLaunchConfig | None = None,
    platform: Any = None,
    error_flag: torch.Tensor | None = None,
    masked_entries: bool = False,
    v4: V4Pages | None = None,
    extra_cache: torch.Tensor | None = None,
    zero_rope: bool = False,
    attn_sink: torch.Tensor | None = None,
    lists: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV MLA decode into preallocated buffers (no allocation, no host sync).

    Args:
        q_nope: [B, N, Lkv] or [B, Q, N, Lkv] float16/bfloat16, the absorbed
            query (Q <= 8 query tokens per request for speculative decoding;
            token j of request b sees cache positions < seq_lens[b] - Q + 1 + j).
        q_pe: [B, (Q,) N, R], the rotary part, same dtype as q_nope.
        kv_cache: [num_blocks, block_size, Lkv + R] float16/bfloat16 or FP8
            (float8_e4m3fn / float8_e4m3fnuz) with per-tensor ``k_scale``.
        block_table: [B, max_blocks] int32; the first ceil(seq_len / block_size)
            entries of a row are read.
        seq_lens: [B] int32 on the device; 0 gives output 0 and LSE -inf.
            A request whose seq_len lies outside [0, max_blocks * block_size],
            or that reads a block-table entry outside [0, num_blocks), gets
            output and LSE NaN and sets a bit of `error_flag`; no load leaves
            the tensors whatever these values.
        scale: softmax scale (always explicit).
        k_scale: float32 tensor of 1 element (FP8 dequantisation scale) or None.
        num_kv_splits: Python int, 1 .. attn_logits.shape[2].
        attn_logits: float32 workspace [B * Q, N, max_num_kv_splits, W], W >= Lkv + 1
            (`attn_logits_width(Lkv)`: the partial output, its LSE, padding).
        out: [B, (Q,) N, Lkv] in q's dtype, written.
        lse: [B, (Q,) N] float32 natural-log LSE, written.
        config: launch configuration; default ``decode_config(platform, ...)``.
        platform: the Platform the configuration is chosen for; default the current one.
        error_flag: int32 [1] that bad indices are ORed into (`mla_multi.errors` bits);
            default the device's flag, `mla_multi.errors.error_flag(device)`.
        masked_entries: an fp8_ds_mla cache of one-token pages read on sm_90 (the sparse decode's index
            lists as the block table): an entry -1 is no token, masked; one outside [-1, num_blocks)
            makes the request's rows NaN and sets `errors.SPARSE_INDEX`.
        v4: DeepSeek-V4 pages read in place on sm_90 (`V4Pages`): kv_cache the main ``fp8_ds_mla_v4``
            cache, ``extra_cache`` the second (default: none, the main cache stands in), q_nope [B, N, 512].
        lists: (extra_indices, topk_length, extra_topk_length), each a tensor or None, with ``v4`` (block_table
            the first index list).
        zero_rope: q_pe is zero (V4 rows laid out as 576-wide ones with a zero tail): the sm_90
            warp-specialised kernels skip its product and copy no rotary columns of a 16-bit cache's rows
            (the others compute it: the same result, the tail read).
        attn_sink: float32 [N] on q's device, an attention sink per head: out *= exp(lse) / (exp(lse) +
            exp(sink)) (+inf gives 0, -inf nothing, a row without mass keeps 0); lse stays the one without it.
            Applied by the reduce over split partials, or by the split kernel writing the output (one split).

    Returns:
        (out, lse), the buffers passed in.
    """
    plan = DecodeKernelPlan(
        q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, attn_logits, out, lse,
        config=config, platform=platform, error_flag=error_flag, masked_entries=masked_entries, v4=v4,
        zero_rope=zero_rope, sink=attn_sink is not None,
    )
    plan.launch(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, attn_logits, out, lse, scale,
                extra_cache=extra_cache, attn_sink=attn_sink, lists=lists)
    return out, lse


# Eager launches of fewer query rows (B x Q) than this skip the TMA loader: Triton's launcher encodes the
# cache's two descriptors on every call (18-23 µs of host time on an H100, where a small batch's
# kernel takes 13-40 µs), which TMA's 1-4 % of kernel time does not repay. Captured launches, whose
# host work is done once, and larger batches keep it.
EAGER_TMA_MIN_ROWS = 16


def eager_tma(tensor: torch.Tensor, rows: int) -> bool:
    """Whether a decode launch of `rows` query rows (B x Q) on `tensor`'s device may take the TMA loader."""
    return rows >= EAGER_TMA_MIN_ROWS or capturing(tensor)


class DecodeKernelPlan:
    """The launches of one decode shape: checked once, configured once, bound once.

    Built from one set of tensors (see `mla_decode_fwd` for their meaning);
    `launch` then runs any tensors with the same shapes, strides, dtypes,
    devices and 16-byte alignment (Triton's specialisation), the cache's
    4-byte alignment and capture state (`eager_tma`) included, without
    further Python work than passing them on: no checks, no configuration,
    no allocation, no synchronisation. The plan belongs to its caller
    (`TritonDecodeLaunch`); `mla_decode_fwd` makes one a call.
    """

    def __init__(
        self, q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, attn_logits, out, lse, *,
        config: DecodeLaunchConfig | None = None, platform: Any = None, error_flag: torch.Tensor | None = None,
        masked_entries: bool = False, v4: V4Pages | None = None, zero_rope: bool = False, sink: bool = False,
    ) -> None:
        batch, q_len, num_heads, kv_lora_rank, rope_dim = _check_inputs(
            q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, attn_logits, out, lse, error_flag,
            v4,
        )
        self.v4 = v4
        if platform is None:
            from mla_multi.platforms import current_platform

            platform = current_platform()
        device = q_nope.device
        self.error_flag = errors.error_flag(device) if error_flag is None else error_flag
        self.batch = batch
        self.num_kv_splits = num_kv_splits
        self.kv_lora_rank = kv_lora_rank
        # the warpgroup kernels read an FP8 cache in 4-byte words or wider copies: rows must start on 4-byte boundaries
        ds_mla = kv_cache.dtype == torch.uint8  # fp8_ds_mla rows: the warp-specialised kernels' own loader
        fp8_rows_unaligned = (kv_cache.dtype in FP8_DTYPES or ds_mla) and any(
            value % 4 for value in (kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1))
        )
        if config is None:
            config = decode_config(
                platform, num_heads, q_len, kv_cache.dtype, kv_lora_rank, rope_dim, warpgroup=not fp8_rows_unaligned
            )
        self.config = config
        self.fp8_bits = kv_cache.dtype in FP8_DTYPES and fp8_bit_decode_needed(platform, kv_cache.dtype)
        fp8_bits_bias = _FP8_EXPONENT_BIAS[kv_cache.dtype] if self.fp8_bits else 0
        cache = kv_cache.view(torch.uint8) if self.fp8_bits else kv_cache

        if q_nope.dim() == 3:
            # a [B, N, D] tensor is [B, 1, N, D] with any token stride
            qn_strides = (q_nope.stride(0), 0, q_nope.stride(1))
            qp_strides = (q_pe.stride(0), 0, q_pe.stride(1))
            o_strides = (out.stride(0), 0, out.stride(1))
            lse_strides = (lse.stride(0), 0, lse.stride(1))
        else:
            qn_strides = (q_nope.stride(0), q_nope.stride(1), q_nope.stride(2))
            qp_strides = (q_pe.stride(0), q_pe.stride(1), q_pe.stride(2))
            o_strides = (out.stride(0), out.stride(1), out.stride(2))
            lse_strides = (lse.stride(0), lse.stride(1), lse.stride(2))
        self.has_k_scale = k_scale is not None
        # V4 pages: the table is the first index list, both lists' entries the rows
        self.int_args = (
            num_heads,
            num_kv_splits,
            (v4.lists[0] + v4.lists[1]) if v4 is not None else block_table.shape[1] * kv_cache.shape[1],
            v4.num_slots if v4 is not None else kv_cache.shape[0],
            *qn_strides,
            *qp_strides,
            cache.stride(0),
            cache.stride(1),
            block_table.stride(0),
            attn_logits.stride(0),
            attn_logits.stride(1),
            attn_logits.stride(2),
            *o_strides,
            *lse_strides,
        )
        self.split = self.reduce = None
        self.tma = False
        rows = q_len * num_heads
        direct = num_kv_splits == 1
        # an attention sink: applied by the reduce (splits) or by the split kernel writing the output (one split)
        self.reduce_sink = sink and not direct
        self.split_sink = sink and direct
        if batch == 0:
            return
        grid = (triton.cdiv(rows, config.block_h), num_kv_splits, batch)
        # programmatic dependent launch where the split kernel fills half the device at most: there the gaps
        # between launches are a part of the step (H200: V4 sparse decode at one token 17.5 -> 15.9 µs, dense
        # at one request 0.97x); a full wave measured slower (bf16, 128 heads, 64 x 8192: 1.03-1.04x), and so
        # did the fp8_ds_mla lists read as they are (`masked_entries`, one token: 16.4 -> 17.3 µs; for the reduce
        # alone 15.9 or 16.6 by the run, not kept), while the V4 lists, whose split kernel is also the op's first
        # launch, gain from it for both kernels (14.8 against 15.4 for the reduce alone; bench/RESULTS.md)
        small = grid[0] * grid[1] * grid[2] <= platform.num_compute_units // 2
        pdl = pdl_constexprs(device) if small and not masked_entries else {}
        if ds_mla:
            reason = ds_mla_decode_reason(platform, kv_cache)
            if not reason and not (config.warp_specialised and config.raw_stages == 0 and config.num_stages > 0
                                   and config.block_n == 64):
                reason = (
                    f"decode config {config.name}: fp8_ds_mla rows need a warp-specialised kernel (wgmma_ws or "
                    f"wgmma_rm) with 64-token tiles, num_stages > 0 and raw_stages=0"
                )
            if reason:
                raise ValueError(f"an fp8_ds_mla kv_cache cannot be decoded here: {reason}")
        if v4 is not None and not config.warpgroup:
            raise ValueError(f"V4 pages are read by the sm_90 warp-specialised kernels; decode config {config.name} "
                             f"is the Triton kernel's")
        if masked_entries and (v4 is not None or not (ds_mla and kv_cache.shape[1] == 1)):
            raise ValueError(
                f"masked_entries=True reads -1 entries of one-token fp8_ds_mla pages; got a {kv_cache.dtype} cache "
                f"of block size {kv_cache.shape[1]}"
            )
        if config.warpgroup:
            reason = wgmma_decode_reason(platform, kv_cache.dtype, kv_lora_rank, rope_dim)
            if not reason and fp8_rows_unaligned:
                reason = (
                    f"the FP8 kv_cache's rows start off 4-byte boundaries (data_ptr {kv_cache.data_ptr()}, strides "
                    f"{tuple(kv_cache.stride())}); accepted: a data pointer and block/token strides that are multiples of 4"
                )
            if not reason and config.raw_stages and (kv_cache.dtype != torch.float8_e4m3fn or not config.warp_specialised):
                reason = (
                    f"raw FP8 stages (raw_stages={config.raw_stages}) need a float8_e4m3fn kv_cache and a warp-specialised "
                    f"kernel (wgmma_ws or wgmma_rm); got a {kv_cache.dtype} kv_cache and kernel {config.kernel}"
                )
            if not reason and config.warp_specialised and config.num_stages == 0 and (
                not config.raw_stages or config.kernel != "wgmma_ws" or config.block_h > 16
            ):
                reason = (
                    f"no float16 stages (num_stages=0) means P V on the FP8 tensor cores from the raw stages, which "
                    f"needs raw_stages > 0, kernel wgmma_ws and block_h <= 16; got raw_stages={config.raw_stages}, "
                    f"kernel {config.kernel}, block_h={config.block_h}"
                )
            if reason:
                raise ValueError(f"decode config {config.name} runs the warpgroup kernel, which cannot run here: {reason}")
            from mla_multi.kernels import mla_decode_wgmma

            self.split, self.tma = mla_decode_wgmma.bind_split_kernel(
                grid,
                device,
                kv_cache,
                q_len=q_len,
                kv_lora_rank=kv_lora_rank,
                rope_dim=rope_dim,
                page_size=1 if v4 is not None else kv_cache.shape[1],
                config=config,
                has_k_scale=k_scale is not None,
                fp8_cache=kv_cache.dtype in FP8_DTYPES or ds_mla,
                direct=direct,
                allow_tma=eager_tma(q_nope, batch * q_len),
                masked_entries=masked_entries,
                v4_page=0 if v4 is None else v4.page_size,
                qk_rope=not zero_rope,
                sink=self.split_sink,
                pdl=pdl,
                v4_wide=v4 is not None and v4_tiles_per_split(v4, num_kv_splits, config.block_n) > 1,
            )
        else:
            self.split = BoundLaunch(
                _mla_decode_split_kernel,
                grid,
                dict(
                    Q_LEN=q_len,
                    KV_LORA_RANK=kv_lora_rank,
                    ROPE_DIM=rope_dim,
                    PAGE_SIZE=kv_cache.shape[1],
                    BLOCK_H=config.block_h,
                    BLOCK_N=config.block_n,
                    HAS_K_SCALE=k_scale is not None,
                    LOAD_K_TRANSPOSED=load_k_transposed(platform, kv_cache.dtype, config),
                    FP8_COMPUTE_FP16=kv_cache.dtype in FP8_DTYPES,
                    FP8_BITS_BIAS=fp8_bits_bias,
                    DIRECT_OUTPUT=direct,
                    DISABLE_LICM=config.disable_licm and tl_range_disables_licm(),
                    TOKENS_AS_M=config.tokens_as_m,
                    HAS_SINK=self.split_sink,
                    **pdl,
                    **config.launch_options(),
                ),
                device,
                keyword_names=("Sink",) if self.split_sink else (),
            )
        if not direct:
            reduce_config = decode_reduce_config(num_kv_splits, kv_lora_rank)
            block_dv = min(reduce_config.block_dv, kv_lora_rank)
            self.reduce = BoundLaunch(
                _mla_decode_reduce_kernel,
                (batch * q_len, num_heads, kv_lora_rank // block_dv),
                dict(
                    Q_LEN=q_len,
                    KV_LORA_RANK=kv_lora_rank,
                    BLOCK_DV=block_dv,
                    BLOCK_SPLITS=reduce_config.block_splits,
                    HAS_SINK=self.reduce_sink,
                    PARTIALS_BESIDE_LSE=reduce_partials_beside_lse(platform),
                    **pdl,
                    **reduce_config.launch_options(),
                ),
                device,
            )
            self.reduce_int_args = (
                num_kv_splits, attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2), *o_strides,
                *lse_strides,
            )

    def launch(self, q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, attn_logits, out, lse, scale, *,
               extra_cache=None, attn_sink=None, lists=None) -> None:
        """Run the plan on tensors with the plan's key (writes `out` and `lse`); `extra_cache`: V4 pages' second
        cache (`V4Pages`); `attn_sink`: float32 [heads] (a plan made with `sink`): out *= exp(lse) / (exp(lse) +
        exp(sink)) per head, the LSE without it; `lists`: V4 pages' (extra_indices, topk_length,
        extra_topk_length), each a tensor or None."""
        split = self.split
        if split is None:
            return
        keywords = {"Sink": attn_sink} if self.split_sink else {}
        cache = kv_cache.view(torch.uint8) if self.fp8_bits else kv_cache
        args = (
            q_nope, q_pe, cache, block_table, seq_lens, k_scale if self.has_k_scale else seq_lens, attn_logits, out,
            lse, self.error_flag, float(scale), *self.int_args,
        )
        v4 = self.v4
        if v4 is not None:
            # a missing list or length: the first list, seq_lens (a length is clamped to its list's width)
            extra_indices, topk_length, extra_topk_length = lists or (None, None, None)
            split(*args, Extra_cache=kv_cache if extra_cache is None else extra_cache,
                  extra_first_slot=v4.first_extra_slot, stride_extra_block=v4.extra_block_stride,
                  Extra_table=block_table if extra_indices is None else extra_indices, stride_extra_t=v4.lists[2],
                  v4_topk=v4.lists[0], Topk_length=seq_lens if topk_length is None else topk_length,
                  Extra_topk_length=seq_lens if extra_topk_length is None else extra_topk_length, **keywords)
        elif self.tma:
            from mla_multi.kernels.mla_decode_wgmma import tma_keywords

            split(*args, **tma_keywords(kv_cache, self.config.block_n, self.kv_lora_rank), **keywords)
        else:
            split(*args, **keywords)
        if self.reduce is not None:
            self.reduce(attn_logits, out, lse, attn_sink if self.reduce_sink else lse, *self.reduce_int_args)


# ---------------------------------------------------------------------------
# ahead-of-time compilation (mla_multi.compile_check)
# ---------------------------------------------------------------------------

_TRITON_DTYPE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e4m3fnuz: "fp8e4b8",
    torch.uint8: "u8",
}


def _split_kernel_signature(q_dtype: torch.dtype, cache_dtype: torch.dtype, has_k_scale: bool) -> dict[str, str]:
    q = _TRITON_DTYPE[q_dtype]
    signature = {
        "Q_nope": f"*{q}",
        "Q_pe": f"*{q}",
        "KV_cache": f"*{_TRITON_DTYPE[cache_dtype]}",
        "Block_table": "*i32",
        "Seq_lens": "*i32",
        "K_scale": "*fp32" if has_k_scale else "*i32",
        "Attn_logits": "*fp32",
        "Out": f"*{q}",
        "Lse": "*fp32",
        "Error_flag": "*i32",
        "sm_scale": "fp32",
        "num_heads": "i32",
        "num_kv_splits": "i32",
        "max_seq_len": "i32",
        "num_cache_blocks": "i32",
    }
    for name in (
        "stride_qn_b stride_qn_t stride_qn_h stride_qp_b stride_qp_t stride_qp_h stride_kv_block "
        "stride_kv_token stride_bt_b stride_al_row stride_al_h stride_al_split stride_o_b stride_o_t "
        "stride_o_h stride_lse_b stride_lse_t stride_lse_h"
    ).split():
        signature[name] = "i32"
    for name in (
        "Q_LEN KV_LORA_RANK ROPE_DIM PAGE_SIZE BLOCK_H BLOCK_N HAS_K_SCALE LOAD_K_TRANSPOSED FP8_COMPUTE_FP16 FP8_BITS_BIAS "
        "DIRECT_OUTPUT DISABLE_LICM TOKENS_AS_M HAS_SINK".split()
    ):
        signature[name] = "constexpr"
    signature["Sink"] = "constexpr"  # None without a sink; a specification with one names its type
    return signature


# what a DeepSeek launch sees 16-divisible (the attn_logits strides too: its
# rows are `attn_logits_width` = 528 wide)
_SPLIT_DIVISIBLE = tuple(
    (
        "Q_nope Q_pe KV_cache Block_table Seq_lens K_scale Attn_logits Out Lse stride_qn_b stride_qn_h "
        "stride_al_row stride_al_h stride_al_split "
        "stride_qp_b stride_qp_h stride_kv_block stride_kv_token stride_o_b stride_o_h stride_qn_t stride_qp_t stride_o_t"
    ).split()
)


def _reduce_kernel_signature(q_dtype: torch.dtype) -> dict[str, str]:
    signature = {"Attn_logits": "*fp32", "Out": f"*{_TRITON_DTYPE[q_dtype]}", "Lse": "*fp32", "Sink": "*fp32"}
    for name in (
        "num_kv_splits stride_al_row stride_al_h stride_al_split stride_o_b stride_o_t stride_o_h "
        "stride_lse_b stride_lse_t stride_lse_h"
    ).split():
        signature[name] = "i32"
    for name in ("Q_LEN", "KV_LORA_RANK", "BLOCK_DV", "BLOCK_SPLITS", "HAS_SINK"):
        signature[name] = "constexpr"
    return signature


def _wgmma_spec(name: str, config: DecodeLaunchConfig, cache_dtype: torch.dtype, constexprs: dict) -> CompileSpec:
    """The sm_90 warp-specialised Gluon split kernel (`mla_decode_wgmma`) at one configuration, as the launch
    would build it; `constexprs` holds those it shares with the Triton split kernel."""
    from mla_multi.kernels import mla_decode_wgmma

    fp8 = cache_dtype in FP8_DTYPES or cache_dtype == torch.uint8  # uint8: fp8_ds_mla rows
    has_k_scale = cache_dtype in FP8_DTYPES
    signature = {
        k: v for k, v in _split_kernel_signature(torch.bfloat16, cache_dtype, has_k_scale).items() if v != "constexpr"
    }
    constexprs = {**constexprs, "STAGES": config.num_stages, "FP8_CACHE": fp8, "num_warps": config.num_warps}
    for key in constexprs:
        signature[key] = "constexpr"
    constexprs["ROWS_AS_M"] = config.kernel == "wgmma_rm"
    constexprs["RAW_STAGES"] = config.raw_stages
    constexprs.setdefault("MASKED_ENTRIES", False)
    constexprs.setdefault("V4_PAGE", 0)
    constexprs.setdefault("QK_ROPE", True)
    constexprs.setdefault("HAS_SINK", False)
    constexprs.setdefault("V4_WIDE", False)
    for key in ("ROWS_AS_M", "RAW_STAGES", "MASKED_ENTRIES", "V4_PAGE", "QK_ROPE", "HAS_SINK", "V4_WIDE"):
        signature[key] = "constexpr"
    # the arguments passed by name where they are used (the compile check leaves the others at their defaults,
    # as a launch that does not pass them): the sink (`HAS_SINK`, one split); the V4 pages' second cache and
    # index lists (`V4Pages`)
    if constexprs["HAS_SINK"]:
        signature["Sink"] = "*fp32"
    divisible = _SPLIT_DIVISIBLE
    if constexprs["V4_PAGE"]:
        signature |= {"Extra_cache": "*u8", "extra_first_slot": "i32", "stride_extra_block": "i32",
                      "Extra_table": "*i32", "stride_extra_t": "i32", "v4_topk": "i32", "Topk_length": "*i32",
                      "Extra_topk_length": "*i32"}
        divisible = divisible + ("Extra_cache",)
    if mla_decode_wgmma.tma_loader(config, fp8) and constexprs["PAGE_SIZE"] % config.block_n == 0:
        # the launch's TMA loader (`tma_cache_reason` holds for a DeepSeek cache of whole-tile pages)
        constexprs["TMA"] = True
        signature["TMA"] = "constexpr"
        for arg, cols in (("KV_desc", constexprs["KV_LORA_RANK"]), ("KV_pe_desc", constexprs["ROPE_DIM"])):
            signature[arg] = mla_decode_wgmma.tma_descriptor_type(config.block_n, cols, _TRITON_DTYPE[cache_dtype])
    return CompileSpec(
        name=name,
        fn=mla_decode_wgmma.ws_split_kernel,
        signature=signature,
        constexprs=constexprs,
        options={"num_warps": config.num_warps, "maxnreg": mla_decode_wgmma.WS_MAXNREG},
        divisible_by_16=divisible,
    )


def compile_specs(platform) -> list[CompileSpec]:
    """Every (kernel, launch config) this module can launch on `platform`, DeepSeek dims.

    The split kernel is compiled for each configuration that `decode_config`
    can return on the platform, with a bf16 cache and with the platform's FP8
    cache (decoded natively or by bits, as the launch would), at page size 64
    (tile inside a page) and page size 1 (one block-table entry per row), as the
    split (partial) and the direct (single split) variant.  Register and LDS use
    do not depend on the head count or the query length beyond BLOCK_H, so
    those are fixed to values that select each configuration.
    """
    specs: list[CompileSpec] = []
    cache_dtypes: list[torch.dtype] = [torch.bfloat16]
    if platform.fp8_dtype is not None:
        cache_dtypes.append(platform.fp8_dtype)
    elif platform.is_cuda():
        # sm_80 has no FP8 arithmetic but still reads an FP8 cache by bits
        cache_dtypes.append(torch.float8_e4m3fn)
    for cache_dtype in cache_dtypes:
        for config in all_decode_configs(platform, fp8=cache_dtype in FP8_DTYPES):
            bits = cache_dtype in FP8_DTYPES and fp8_bit_decode_needed(platform, cache_dtype)
            launched_dtype = torch.uint8 if bits else cache_dtype
            for page_size, direct in ((64, False), (1, True)):
                kv_name = {torch.bfloat16: "bf16"}.get(cache_dtype, str(cache_dtype).replace("torch.float8_", ""))
                name = f"mla_decode_split[{config.name},kv={kv_name},page={page_size},{'direct' if direct else 'partial'}]"
                constexprs = {
                    "Q_LEN": 1,
                    "KV_LORA_RANK": 512,
                    "ROPE_DIM": 64,
                    "PAGE_SIZE": page_size,
                    "BLOCK_H": config.block_h,
                    "BLOCK_N": config.block_n,
                    "HAS_K_SCALE": cache_dtype in FP8_DTYPES,
                    "DIRECT_OUTPUT": direct,
                }
                if config.warpgroup:
                    if not wgmma_decode_reason(platform, cache_dtype):
                        specs.append(_wgmma_spec(name, config, cache_dtype, constexprs))
                        if cache_dtype == torch.bfloat16 and page_size == 1:
                            # the V4 rows laid out as 576-wide pages (`sparse_v4`): the zero rotary product skipped,
                            # V4's sink applied by the kernel writing the output
                            specs.append(_wgmma_spec(name[:-1] + (",no-rope,sink]" if direct else ",no-rope]"), config,
                                                     cache_dtype, dict(constexprs, QK_ROPE=False, HAS_SINK=direct)))
                    continue
                constexprs |= {
                    "LOAD_K_TRANSPOSED": load_k_transposed(platform, cache_dtype, config),
                    "FP8_COMPUTE_FP16": cache_dtype in FP8_DTYPES,
                    "FP8_BITS_BIAS": _FP8_EXPONENT_BIAS[cache_dtype] if bits else 0,
                    "DISABLE_LICM": config.disable_licm and tl_range_disables_licm(),
                    "TOKENS_AS_M": config.tokens_as_m,
                }
                # with a sink: the V4 rows' one-split launch (bf16 one-token pages, the output written here)
                for sink in (False, True) if (cache_dtype == torch.bfloat16 and direct) else (False,):
                    signature = _split_kernel_signature(torch.bfloat16, launched_dtype, cache_dtype in FP8_DTYPES)
                    if sink:
                        signature["Sink"] = "*fp32"
                    specs.append(
                        CompileSpec(
                            name=name[:-1] + ",sink]" if sink else name,
                            fn=_mla_decode_split_kernel,
                            signature=signature,
                            constexprs={**constexprs, "HAS_SINK": sink, **({} if sink else {"Sink": None})},
                            options=config.launch_options(),
                            divisible_by_16=_SPLIT_DIVISIBLE,
                        )
                    )
    if not ds_mla_decode_reason(platform):
        # fp8_ds_mla rows (sparse decode: one-token pages; any page size reads the same way)
        ds_configs = []
        for heads in (16, 32, 64):
            config = decode_config(platform, heads, 1, torch.uint8)
            if config not in ds_configs:
                ds_configs.append(config)
        for config in ds_configs:
            # masked: the sparse decode's index lists read as they are (-1 entries masked in the kernel)
            for page_size, direct, masked in ((1, False, True), (1, True, True), (1, False, False), (1, True, False),
                                              (64, False, False)):
                constexprs = {
                    "Q_LEN": 1, "KV_LORA_RANK": 512, "ROPE_DIM": 64, "PAGE_SIZE": page_size, "BLOCK_H": config.block_h,
                    "BLOCK_N": config.block_n, "HAS_K_SCALE": False, "DIRECT_OUTPUT": direct,
                }
                if masked:
                    constexprs["MASKED_ENTRIES"] = True
                name = (f"mla_decode_split[{config.name},kv=fp8_ds_mla,page={page_size},"
                        f"{'direct' if direct else 'partial'}{',masked' if masked else ''}]")
                specs.append(_wgmma_spec(name, config, torch.uint8, constexprs))
            # DeepSeek-V4 rows in pages of 64 read in place through the index lists (`V4Pages`), launched by
            # programmatic dependent launch as sm_90 launches them, the loader's pieces narrow and wide
            for direct, wide in ((False, False), (True, False), (False, True), (True, True)):
                constexprs = {
                    "Q_LEN": 1, "KV_LORA_RANK": 512, "ROPE_DIM": 64, "PAGE_SIZE": 1, "BLOCK_H": config.block_h,
                    "BLOCK_N": config.block_n, "HAS_K_SCALE": False, "DIRECT_OUTPUT": direct, "V4_PAGE": 64,
                    "HAS_SINK": direct,  # V4's sink: applied by the kernel writing the output (else the reduce)
                    "PDL": True,
                }
                if wide:
                    constexprs["V4_WIDE"] = True
                name = (f"mla_decode_split[{config.name},kv=fp8_ds_mla_v4,page=64,"
                        f"{'direct' if direct else 'partial'},pdl{',wide' if wide else ''}]")
                specs.append(_wgmma_spec(name, config, torch.uint8, constexprs))
    pdl = platform.is_cuda() and platform.has_device_capability(9, 0)
    for i, reduce_config in enumerate(all_decode_reduce_configs()):
        # the sink's branch (sparse MLA's attention sink) compiled with the first configuration, and there
        # the programmatic dependent launch's wait where the device launches so (sm_90+)
        for sink in (False, True) if i == 0 else (False,):
            tail = (",sink" if sink else "") + (",pdl" if sink and pdl else "")
            specs.append(
                CompileSpec(
                    name=f"mla_decode_reduce[{reduce_config.name}{tail}]",
                    fn=_mla_decode_reduce_kernel,
                    signature=_reduce_kernel_signature(torch.bfloat16),
                    constexprs={
                        "Q_LEN": 1,
                        "KV_LORA_RANK": 512,
                        "BLOCK_DV": reduce_config.block_dv,
                        "BLOCK_SPLITS": reduce_config.block_splits,
                        "HAS_SINK": sink,
                        "PARTIALS_BESIDE_LSE": reduce_partials_beside_lse(platform),
                        **({"PDL": True} if sink and pdl else {}),
                    },
                    options=reduce_config.launch_options(),
                    divisible_by_16=("Attn_logits", "Out", "Lse", "stride_o_b", "stride_o_t", "stride_o_h"),
                )
            )
    return specs
