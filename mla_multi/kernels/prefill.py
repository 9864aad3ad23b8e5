"""Varlen flash attention with LSE for MLA prefill (qk head dim 192, v head dim 128).

The prefill phase of MLA is ordinary multi-head attention whose query/key head
dim (``qk_nope_head_dim + qk_rope_head_dim`` = 192) differs from the value head
dim (``v_head_dim`` = 128). Padding V to 192 (what a generic flash kernel needs)
wastes a third of the second matmul and the output bandwidth, so this kernel
handles the two head dims natively: the 192-wide dot product is computed as a
128-wide plus a 64-wide ``tl.dot`` (Triton block shapes are powers of two), and
the accumulator is 128 wide.

Layout follows flash-attn's varlen interface: tokens of all sequences are packed
along the first dimension and ``cu_seqlens`` (int32, ``[B + 1]``) marks the
sequence boundaries. The log-sum-exp is returned in natural log, float32,
``[num_heads, num_tokens]``.

Performance notes (what the kernel does and why):

* the softmax runs in base 2 with ``log2(e)`` folded into the scale, so each
  score costs one FMA and one ``exp2``;
* the key loop is split into an unmasked part (every key visible to every query
  row of the tile, no boundary checks) and a masked part (the causal diagonal
  and the ragged end of the sequence), so the mask arithmetic runs on at most
  ``BLOCK_M / BLOCK_N + 1`` tiles per program;
* the grid is ``(query tiles, heads, batch)`` with an early exit for tiles past
  a sequence's end; for causal attention the query tiles run in reverse order so
  the longest rows (the most keys) are scheduled first and the short ones fill
  the tail, while programs running together still share one head's K/V in L2;
  on a device of several XCDs (MI300X, MI355X: eight dies, each with its own L2,
  dealt the programs in turn) the launch is one-dimensional and program i takes
  the work item that gives each XCD a contiguous range of them (`_xcd_item`), so
  that a head's query tiles read its K and V through one L2 instead of eight;
* on Hopper the unmasked K/V tiles can come through the tensor-memory
  accelerator (``PrefillLaunchConfig.use_tma``); it measured within noise of the
  pipelined pointer loads on an H200, so pointer loads stay the default;
* the boundaries are read once per program and checked before anything else:
  a sequence whose range does not lie inside the tensors (a first boundary
  other than 0, a decreasing boundary, one past the token count, or a length
  over ``max_seqlen``) computes nothing, writes NaN to the output rows and LSE
  of its range that lie inside the tensors (every such row: a program walks the
  tiles past the grid too) and ORs ``CU_SEQLENS`` into the device's error flag
  (`mla_multi.errors`). No load or store then depends on unchecked data.

On sm_90 the default launch (no ``config`` given, no ``merge``) hands MLA-shaped
16-bit inputs of at least a tile to ``prefill_wgmma``'s kernel (FlashAttention-3's
structure in Gluon: a TMA loader warp, two consumer warpgroups), 1.16-1.26x this
kernel's speed on an H100; ``prefill_wgmma.takes`` says when.

Launch configurations per platform live in ``launch_config.prefill_config``;
measured numbers are in ``bench/RESULTS.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from mla_multi import errors
from mla_multi.kernels.merge import merge_scales
from mla_multi.kernels.prefill_inputs import check_inputs, split_head_dim_qk

__all__ = ["varlen_attention", "compile_specs", "kernel_constexprs"]

_LOG2_E = 1.4426950408889634
CU_SEQLENS_ERROR = tl.constexpr(errors.CU_SEQLENS)


@triton.jit
def _poison_sequence_rows(
    Out, Lse, row_lo, row_hi, first_tile, tile_step, head, offs_dv, stride_o_t, stride_o_h, stride_lse_h,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """NaN into output rows [row_lo, row_hi) of one head (and their LSE), tiles first_tile, first_tile + tile_step, ...

    Stored POISON_ROWS rows at a time: a whole [BLOCK_M, BLOCK_DV] tile of NaN
    raised the register peak of the kernel (a spill on gfx950) for this cold path.
    """
    POISON_ROWS: tl.constexpr = 16
    nan_rows = tl.full([POISON_ROWS, BLOCK_DV], float("nan"), dtype=Out.dtype.element_ty)
    offs_rows = tl.arange(0, POISON_ROWS)
    for tile_row0 in range(row_lo + first_tile * BLOCK_M, row_hi, tile_step * BLOCK_M):
        for row0 in range(tile_row0, tl.minimum(tile_row0 + BLOCK_M, row_hi), POISON_ROWS):
            rows = row0 + offs_rows
            row_in = rows < row_hi
            o_ptrs = Out + rows.to(tl.int64)[:, None] * stride_o_t + head.to(tl.int64) * stride_o_h + offs_dv[None, :]
            tl.store(o_ptrs, nan_rows, mask=row_in[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
            if STORE_LSE:
                tl.store(Lse + head.to(tl.int64) * stride_lse_h + rows, float("nan"), mask=row_in)


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q_a,
    q_b,
    k_ptrs_a,
    k_ptrs_b,
    v_ptrs,
    k_desc_a,
    k_desc_b,
    v_desc,
    desc_row,
    desc_col_k,
    desc_col_v,
    start_n_lo,
    start_n_hi,
    stride_k_t,
    stride_kb_t,
    stride_v_t,
    offs_m,
    offs_n,
    seqlen_k,
    causal_offset,
    qk_scale_log2,
    offs_d_b,
    offs_dv,
    HEAD_DIM_QK: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK_A: tl.constexpr,
    BLOCK_DQK_B: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DQK_B: tl.constexpr,
    PAD_DQK_B: tl.constexpr,
    PAD_DV: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """One pass of the online softmax over key tiles [start_n_lo, start_n_hi); the
    K/V pointers (not the descriptor coordinates) already point at key start_n_lo.

    MASKED=False: every key of every tile is visible to every row (no checks).
    MASKED=True: keys past ``seqlen_k`` and, when CAUSAL, keys past the causal
    bound ``offs_m + causal_offset`` are excluded.
    USE_TMA: unmasked tiles come through the tensor-memory accelerator (Hopper+)
    from 2-D descriptors whose rows are tokens and whose columns are
    ``head * stride_h + d``; masked tiles always use pointer loads so keys of a
    neighbouring sequence are never read into the softmax.
    """
    for start_n in tl.range(start_n_lo, start_n_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if MASKED:
            key_in = (start_n + offs_n) < seqlen_k
            k_a = tl.load(k_ptrs_a, mask=key_in[:, None], other=0.0)
        elif USE_TMA:
            k_a = k_desc_a.load([desc_row + start_n, desc_col_k])
        else:
            k_a = tl.load(k_ptrs_a)
        qk = tl.dot(q_a, tl.trans(k_a))
        if HAS_DQK_B:
            if MASKED:
                if PAD_DQK_B:
                    k_b = tl.load(
                        k_ptrs_b,
                        mask=key_in[:, None] & (offs_d_b[None, :] < HEAD_DIM_QK),
                        other=0.0,
                    )
                else:
                    k_b = tl.load(k_ptrs_b, mask=key_in[:, None], other=0.0)
            elif USE_TMA:
                k_b = k_desc_b.load([desc_row + start_n, desc_col_k + BLOCK_DQK_A])
            else:
                if PAD_DQK_B:
                    k_b = tl.load(k_ptrs_b, mask=offs_d_b[None, :] < HEAD_DIM_QK, other=0.0)
                else:
                    k_b = tl.load(k_ptrs_b)
            qk = tl.dot(q_b, tl.trans(k_b), qk)

        if MASKED:
            visible = key_in[None, :]
            if CAUSAL:
                visible = visible & ((start_n + offs_n)[None, :] <= (offs_m + causal_offset)[:, None])
            qk = tl.where(visible, qk * qk_scale_log2, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no visible key yet keeps m = -inf; subtracting
            # it would give -inf - -inf = NaN, so such rows subtract 0 instead
            # (their p and alpha are exp2(-inf) = 0 either way).
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale_log2)
            p = tl.math.exp2(qk * qk_scale_log2 - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]

        if MASKED:
            if PAD_DV:
                v = tl.load(v_ptrs, mask=key_in[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
            else:
                v = tl.load(v_ptrs, mask=key_in[:, None], other=0.0)
        elif USE_TMA:
            v = v_desc.load([desc_row + start_n, desc_col_v])
        else:
            if PAD_DV:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij

        k_ptrs_a += BLOCK_N * stride_k_t
        if HAS_DQK_B:
            k_ptrs_b += BLOCK_N * stride_kb_t
        v_ptrs += BLOCK_N * stride_v_t
    return acc, l_i, m_i


@triton.jit
def _xcd_item(program, num_programs, NUM_XCDS: tl.constexpr):
    """The work item of `program` in a one-dimensional launch of `num_programs` on a device that deals its
    programs to NUM_XCDS dies in turn (program p to die p % NUM_XCDS): each die gets a contiguous range of
    items, in order, the first `tall` dies one item more than the others. A bijection of [0, num_programs)."""
    per = (num_programs + NUM_XCDS - 1) // NUM_XCDS
    tall = num_programs - (per - 1) * NUM_XCDS
    xcd = program % NUM_XCDS
    local = program // NUM_XCDS
    return tl.where(xcd < tall, xcd * per + local, tall * per + (xcd - tall) * (per - 1) + local)


@triton.jit
def _varlen_attention_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    K_pe,
    k_desc_a,
    k_desc_b,
    v_desc,
    cu_seqlens_q,
    cu_seqlens_k,
    Error_flag,
    qk_scale_log2,
    total_q,
    total_k,
    max_seqlen_q,
    max_seqlen_k,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_lse_h,
    stride_kpe_t,
    stride_kpe_h,
    num_m_blocks,
    num_queries_per_kv,
    num_heads,
    HEAD_DIM_QK: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK_A: tl.constexpr,
    BLOCK_DQK_B: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
    SPLIT_K: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    NUM_XCDS: tl.constexpr = 1,
):
    HAS_DQK_B: tl.constexpr = BLOCK_DQK_B > 0
    PAD_DQK_B: tl.constexpr = BLOCK_DQK_A + BLOCK_DQK_B != HEAD_DIM_QK
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V

    if NUM_XCDS > 1:  # one-dimensional launch: the items in (query tile, head, sequence) order, by XCD
        item = _xcd_item(tl.program_id(0), tl.num_programs(0), NUM_XCDS)
        pid_m = item % num_m_blocks
        head = (item // num_m_blocks) % num_heads
        seq = item // (num_m_blocks * num_heads)
    else:
        pid_m = tl.program_id(0)
        head = tl.program_id(1)
        seq = tl.program_id(2)
    if CAUSAL:
        # Heaviest (last) query tiles first: they see the most keys.
        start_m = num_m_blocks - 1 - pid_m
    else:
        start_m = pid_m

    q_start = tl.load(cu_seqlens_q + seq)
    q_end = tl.load(cu_seqlens_q + seq + 1)
    k_start = tl.load(cu_seqlens_k + seq)
    k_end = tl.load(cu_seqlens_k + seq + 1)
    # Boundaries inside [0, total] and ordered first, so the differences cannot overflow.
    valid = (q_start >= 0) & (q_start <= q_end) & (q_end <= total_q) & (k_start >= 0) & (k_start <= k_end)
    valid = valid & (k_end <= total_k) & (q_end - q_start <= max_seqlen_q) & (k_end - k_start <= max_seqlen_k)
    valid = valid & ((seq > 0) | ((q_start == 0) & (k_start == 0)))
    offs_dv = tl.arange(0, BLOCK_DV)
    if valid == 0:
        tl.atomic_or(Error_flag, CU_SEQLENS_ERROR, mask=(pid_m == 0) & (head == 0))
        row_lo = tl.minimum(tl.maximum(q_start, 0), total_q)
        row_hi = tl.maximum(tl.minimum(q_end, total_q), row_lo)
        _poison_sequence_rows(
            Out, Lse, row_lo, row_hi, pid_m, num_m_blocks, head, offs_dv, stride_o_t, stride_o_h, stride_lse_h,
            HEAD_DIM_V, BLOCK_M, BLOCK_DV, STORE_LSE,
        )
        return
    seqlen_q = q_end - q_start
    if start_m * BLOCK_M >= seqlen_q:
        return
    seqlen_k = k_end - k_start
    kv_head = head // num_queries_per_kv

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d_a = tl.arange(0, BLOCK_DQK_A)
    if HAS_DQK_B:
        offs_d_b = BLOCK_DQK_A + tl.arange(0, BLOCK_DQK_B)
    else:
        offs_d_b = offs_d_a
    row_in = offs_m < seqlen_q

    # 64-bit bases (token index times stride overflows int32 for long batches); the
    # offsets inside a tile stay 32-bit.
    q_row0 = q_start.to(tl.int64) + start_m * BLOCK_M
    offs_tile_m = tl.arange(0, BLOCK_M)
    q_base = Q + q_row0 * stride_q_t + head.to(tl.int64) * stride_q_h
    k_base = K + k_start.to(tl.int64) * stride_k_t + kv_head.to(tl.int64) * stride_k_h
    v_base = V + k_start.to(tl.int64) * stride_v_t + kv_head.to(tl.int64) * stride_v_h

    q_ptrs_a = q_base + offs_tile_m[:, None] * stride_q_t + offs_d_a[None, :]
    q_a = tl.load(q_ptrs_a, mask=row_in[:, None], other=0.0)
    if HAS_DQK_B:
        q_ptrs_b = q_base + offs_tile_m[:, None] * stride_q_t + offs_d_b[None, :]
        if PAD_DQK_B:
            q_b = tl.load(q_ptrs_b, mask=row_in[:, None] & (offs_d_b[None, :] < HEAD_DIM_QK), other=0.0)
        else:
            q_b = tl.load(q_ptrs_b, mask=row_in[:, None], other=0.0)
    else:
        q_b = q_a
    k_ptrs_a = k_base + offs_n[:, None] * stride_k_t + offs_d_a[None, :]
    if SPLIT_K:
        # the rotary columns come from K_pe [total_k, (heads,) BLOCK_DQK_B], shared by the heads (stride 0)
        kpe_base = K_pe + k_start.to(tl.int64) * stride_kpe_t + kv_head.to(tl.int64) * stride_kpe_h
        k_ptrs_b = kpe_base + offs_n[:, None] * stride_kpe_t + (offs_d_b - BLOCK_DQK_A)[None, :]
        stride_kb_t = stride_kpe_t
    else:
        k_ptrs_b = k_base + offs_n[:, None] * stride_k_t + offs_d_b[None, :]
        stride_kb_t = stride_k_t
    v_ptrs = v_base + offs_n[:, None] * stride_v_t + offs_dv[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Bottom-right aligned causal mask: query i sees keys j <= i + causal_offset.
    causal_offset = seqlen_k - seqlen_q
    if CAUSAL:
        # Keys every row of this tile sees: j <= start_m * BLOCK_M + causal_offset.
        full_end = tl.minimum(start_m * BLOCK_M + causal_offset + 1, seqlen_k)
        # Keys any row of this tile sees.
        masked_end = tl.minimum((start_m + 1) * BLOCK_M + causal_offset, seqlen_k)
    else:
        full_end = seqlen_k
        masked_end = seqlen_k
    full_end = tl.maximum(full_end, 0)
    masked_end = tl.maximum(masked_end, 0)
    unmasked_hi = (full_end // BLOCK_N) * BLOCK_N

    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q_a, q_b, k_ptrs_a, k_ptrs_b, v_ptrs,
        k_desc_a, k_desc_b, v_desc, k_start, kv_head * stride_k_h, kv_head * stride_v_h,
        0, unmasked_hi, stride_k_t, stride_kb_t, stride_v_t, offs_m, offs_n, seqlen_k, causal_offset,
        qk_scale_log2, offs_d_b, offs_dv,
        HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK_A, BLOCK_DQK_B, BLOCK_DV, BLOCK_N,
        False, CAUSAL, HAS_DQK_B, PAD_DQK_B, PAD_DV, USE_TMA, WARP_SPECIALIZE,
    )  # fmt: skip
    # 64-bit advance: unmasked_hi * stride overflows int32 past ~87K keys at 128 x 192.
    skip_k = unmasked_hi.to(tl.int64) * stride_k_t
    skip_kb = unmasked_hi.to(tl.int64) * stride_kb_t
    skip_v = unmasked_hi.to(tl.int64) * stride_v_t
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q_a, q_b, k_ptrs_a + skip_k, k_ptrs_b + skip_kb, v_ptrs + skip_v,
        k_desc_a, k_desc_b, v_desc, k_start, kv_head * stride_k_h, kv_head * stride_v_h,
        unmasked_hi, masked_end, stride_k_t, stride_kb_t, stride_v_t, offs_m, offs_n, seqlen_k, causal_offset,
        qk_scale_log2, offs_d_b, offs_dv,
        HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK_A, BLOCK_DQK_B, BLOCK_DV, BLOCK_N,
        True, CAUSAL, HAS_DQK_B, PAD_DQK_B, PAD_DV, USE_TMA,
    )  # fmt: skip

    # Rows that saw no key (empty key set, or causal with seqlen_k < seqlen_q)
    # have l = 0: output 0 and LSE -inf, never NaN.
    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = (
        Out
        + q_row0 * stride_o_t
        + head.to(tl.int64) * stride_o_h
        + offs_tile_m[:, None] * stride_o_t
        + offs_dv[None, :]
    )
    if PAD_DV:
        o_mask = row_in[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    else:
        o_mask = row_in[:, None]
    lse_ptrs = Lse + head.to(tl.int64) * stride_lse_h + q_start + offs_m
    lse = tl.where(no_key, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    if MERGE:
        # merged into the result already in Out / Lse, as `merge_attn_states` merges (an LSE of +inf is an
        # empty side; both empty: 0 and -inf; a side of weight 0 contributes nothing, whatever it holds)
        scale_prev, scale_new, lse = merge_scales(tl.load(lse_ptrs, mask=row_in, other=float("-inf")), lse)
        o_prev = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        out = tl.where((scale_new > 0.0)[:, None], out * scale_new[:, None], 0.0) + tl.where(
            (scale_prev > 0.0)[:, None], o_prev * scale_prev[:, None], 0.0
        )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    if STORE_LSE:
        tl.store(lse_ptrs, lse, mask=row_in)


def kernel_constexprs(
    head_dim_qk: int,
    head_dim_v: int,
    block_m: int,
    block_n: int,
    causal: bool,
    store_lse: bool = True,
    use_tma: bool = False,
) -> dict[str, Any]:
    """The compile-time arguments of the kernel for one head-dim pair and tile.

    Shared by the launcher and the ahead-of-time compile check so both compile
    exactly the same specialisation.
    """
    block_dqk_a, block_dqk_b = split_head_dim_qk(head_dim_qk)
    return {
        "HEAD_DIM_QK": head_dim_qk,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_DQK_A": block_dqk_a,
        "BLOCK_DQK_B": block_dqk_b,
        "BLOCK_DV": max(16, triton.next_power_of_2(head_dim_v)),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "CAUSAL": bool(causal),
        "STORE_LSE": bool(store_lse),
        "USE_TMA": bool(use_tma),
    }


def _tma_descriptors(k: torch.Tensor, v: torch.Tensor, constexprs: dict[str, Any]):
    """Host-side TMA descriptors for K (two column blocks) and V, or None when the
    tensors do not meet the descriptor rules (16-byte aligned base and row stride,
    head dims that need no padding)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host descriptors
        return None
    block_a, block_b, block_dv = constexprs["BLOCK_DQK_A"], constexprs["BLOCK_DQK_B"], constexprs["BLOCK_DV"]
    head_dim_qk, head_dim_v = k.shape[2], v.shape[2]
    if block_a + block_b != head_dim_qk or block_dv != head_dim_v or block_b == 0:
        return None
    elem = k.element_size()
    for t in (k, v):
        if t.data_ptr() % 16 or (t.stride(0) * elem) % 16 or t.shape[0] == 0:
            return None
    block_n = constexprs["BLOCK_N"]
    # 2-D views: rows are tokens, columns run over all heads (head h at h * stride_h);
    # the column extent stops at the last head's last element so no read leaves the tensor.
    k_cols = (k.shape[1] - 1) * k.stride(1) + head_dim_qk
    v_cols = (v.shape[1] - 1) * v.stride(1) + head_dim_v
    k_desc_a = TensorDescriptor(k, [k.shape[0], k_cols], [k.stride(0), 1], [block_n, block_a])
    k_desc_b = TensorDescriptor(k, [k.shape[0], k_cols], [k.stride(0), 1], [block_n, block_b])
    v_desc = TensorDescriptor(v, [v.shape[0], v_cols], [v.stride(0), 1], [block_n, block_dv])
    return k_desc_a, k_desc_b, v_desc


def _config_for(q: torch.Tensor, head_dim_v: int, causal: bool):
    from mla_multi.kernels.launch_config import prefill_config
    from mla_multi.platforms import current_platform

    return prefill_config(current_platform(), q.shape[2], head_dim_v, q.dtype, causal)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    *,
    causal: bool,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = True,
    config=None,
    error_flag: torch.Tensor | None = None,
    k_pe: torch.Tensor | None = None,
    merge: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Variable-length flash attention returning the log-sum-exp.

    Args:
        q: ``[total_q, num_heads, head_dim_qk]`` float16/bfloat16 (float32 for tests);
            any strides with a contiguous last dimension.
        k: ``[total_k, num_kv_heads, head_dim_qk]``, same dtype; ``num_heads`` must be a
            multiple of ``num_kv_heads`` (MLA prefill uses ``num_kv_heads == num_heads``).
        v: ``[total_k, num_kv_heads, head_dim_v]``, same dtype (``head_dim_v`` may differ
            from ``head_dim_qk``: 128 vs 192 for MLA).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` prefix sums of the query / key
            lengths; sequence ``b`` owns rows ``cu[b]:cu[b+1]``. Zero-length sequences are allowed.
            Read on the device only: a sequence whose boundaries are not non-decreasing from 0
            inside ``[0, total]``, or that is longer than ``max_seqlen_*``, gets NaN in its rows
            that lie inside the output (out and LSE) and sets the ``CU_SEQLENS`` bit of
            ``error_flag``; no load or store leaves the tensors whatever the values.
        max_seqlen_q: upper bound of the query lengths (sizes the grid).
        max_seqlen_k: upper bound of the key lengths.
        scale: softmax scale (always explicit; MLA uses ``1/sqrt(192)`` times any YaRN factor).
        causal: causal mask aligned bottom-right: query ``i`` of a sequence with ``lq``
            queries and ``lk`` keys sees keys ``j <= i + lk - lq``.
        out: optional output buffer ``[total_q, num_heads, head_dim_v]`` in q's dtype.
        lse: optional LSE buffer ``[num_heads, total_q]`` float32.
        return_lse: when False the LSE is neither computed nor returned (``None``).
        config: a ``PrefillLaunchConfig``; default ``launch_config.prefill_config`` for the
            current platform.
        error_flag: int32 ``[1]`` that bad boundaries are ORed into (`mla_multi.errors` bits);
            default the device's flag, ``mla_multi.errors.error_flag(q.device)``.
        k_pe: the keys' rotary columns apart from k (MLA: one rotary key shared by every head):
            ``[total_k, rope_dim]`` (or with a heads axis of 1 or num_kv_heads); k then holds the
            other ``head_dim_qk - rope_dim`` columns, which must be the kernel's first block
            (128 of MLA's 192). The shared rotary key is never repeated per head.
        merge: `out` and `lse` (both required) hold a result over other keys, which this one is
            merged into by their LSEs, in place (as `merge_attn_states` merges): chunked prefill
            accumulates every context chunk into the step's output without a temporary.

    Returns:
        ``(out, lse)``: out ``[total_q, num_heads, head_dim_v]`` in q's dtype, lse
        ``[num_heads, total_q]`` float32 natural log (``None`` when ``return_lse`` is False).
        A query that sees no key (empty key sequence, or causal with ``lk < lq``) gets
        output 0 and LSE -inf.
    """
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, k_pe)
    if merge and (out is None or lse is None or not return_lse):
        raise ValueError(
            f"merge=True with out={'given' if out is not None else None}, lse={'given' if lse is not None else None}, "
            f"return_lse={return_lse}; accepted: out and lse holding the result to merge into, and return_lse=True"
        )
    if error_flag is None:
        error_flag = errors.error_flag(q.device)
    elif error_flag.shape != (1,) or error_flag.dtype != torch.int32 or error_flag.device != q.device:
        raise ValueError(
            f"error_flag has shape {tuple(error_flag.shape)}, dtype {error_flag.dtype} on {error_flag.device}; "
            f"accepted: [1] int32 on {q.device}"
        )
    num_tokens, num_heads, head_dim_qk = q.shape
    head_dim_v = v.shape[2]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim_v), dtype=q.dtype, device=q.device)
    if return_lse and lse is None:
        lse = torch.empty((num_heads, num_tokens), dtype=torch.float32, device=q.device)
    batch = cu_seqlens_q.numel() - 1
    # Launched even for max_seqlen_q 0 or no tokens: the kernel is what checks the boundaries.
    if batch == 0 or num_heads == 0:
        return out, (lse if return_lse else None)
    if config is None:
        # checked above; `takes` holds, so there are tokens (a query in a layout TMA cannot read, transformers'
        # [T, N, 192] view of [1, N, T, 192], is copied once: `prefill_wgmma.query_for_kernel`)
        fast_q = _sm90_kernel(q, k, v, k_pe)
        if fast_q is not None:
            from mla_multi.kernels.prefill_wgmma import launch

            launch(fast_q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, out,
                   lse if return_lse else None, error_flag, k_pe, merge)
            return out, (lse if return_lse else None)
        config = _config_for(q, head_dim_v, causal)

    constexprs = kernel_constexprs(
        head_dim_qk, head_dim_v, config.block_m, config.block_n, causal, return_lse, config.use_tma
    )
    descriptors = _tma_descriptors(k, v, constexprs) if config.use_tma else None
    if descriptors is None:
        constexprs["USE_TMA"] = False
        descriptors = (None, None, None)
    if getattr(config, "warp_specialize", False):
        constexprs["WARP_SPECIALIZE"] = True
    if merge:
        constexprs["MERGE"] = True
    if k_pe is not None:  # pointer loads: the descriptors cover one tensor's columns
        constexprs["SPLIT_K"] = True
        constexprs["USE_TMA"] = False
        descriptors = (None, None, None)
        kpe_strides = (k_pe.stride(0), k_pe.stride(1) if k_pe.dim() == 3 and k_pe.shape[1] > 1 else 0)
    else:
        kpe_strides = (0, 0)
    num_m_blocks = max(1, triton.cdiv(max_seqlen_q, config.block_m))
    if config.xcds > 1:
        constexprs["NUM_XCDS"] = config.xcds
        grid = (num_m_blocks * num_heads * batch,)
    else:
        grid = (num_m_blocks, num_heads, batch)
    lse_arg = lse if return_lse else out  # never written when STORE_LSE is False
    _varlen_attention_kernel[grid](
        q, k, v, out, lse_arg, k_pe if k_pe is not None else k,
        *descriptors,
        cu_seqlens_q, cu_seqlens_k, error_flag,
        float(scale) * _LOG2_E,
        num_tokens, k.shape[0], max_seqlen_q, max_seqlen_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0) if return_lse else 0,
        *kpe_strides,
        num_m_blocks,
        num_heads // k.shape[1],
        num_heads,
        **constexprs,
        **config.launch_options(),
    )  # fmt: skip
    return out, (lse if return_lse else None)


_TRITON_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _sm90_kernel(q, k, v, k_pe) -> torch.Tensor | None:
    """The query with which the default launch takes `prefill_wgmma`'s kernel (sm_90, MLA head dims, 16-byte
    rows, at least a tile; the in-kernel merge too): 1.14-1.27x this kernel's speed on an H100
    (bench/RESULTS.md). q itself, or a contiguous copy of a q whose layout alone kept the kernel from it
    (`prefill_wgmma.query_for_kernel`); None where that kernel does not run."""
    from mla_multi.kernels import interpreter_active, prefill_wgmma

    if q.device.type != "cuda" or interpreter_active():
        return None
    from mla_multi.platforms import current_platform

    return prefill_wgmma.query_for_kernel(q, k, v, k_pe, current_platform())


def split_key_reason(platform) -> str:
    """Why the split-key launch (`varlen_attention(k_pe=)`) is not used on `platform` ("" where it is)."""
    if platform.is_cuda() and platform.device_capability is not None and platform.device_capability[0] < 10:
        return ""
    return (f"{platform.name} ({platform.arch}): the separate rotary-key pointers spill registers there in the "
            "compile check (gfx942, gfx950, sm_100); the rotary key is repeated per head instead")


def merge_reason(platform) -> str:
    """Why context chunks do not merge into the output inside the kernel (`varlen_attention(merge=True)`) on
    `platform` ("" where they do)."""
    if platform.arch == "gfx950":
        return (f"{platform.name} ({platform.arch}): the merging epilogue spills registers there in the compile "
                "check; chunks merge through merge_attn_states instead")
    return ""


def compile_specs(platform) -> list:
    """Kernel instances for the ahead-of-time compile check on `platform`.

    Every launch configuration `all_prefill_configs` can choose, for the MLA head
    dims (qk 192, v 128): bfloat16 causal and non-causal with LSE, causal without
    LSE, float16 causal, and non-causal merging into the output (context chunks); with
    TMA configurations also the pointer-load fallback.
    """
    from mla_multi.kernels.launch_config import CompileSpec, all_prefill_configs

    head_dim_qk, head_dim_v = 192, 128
    variants = [
        (torch.bfloat16, True, True),
        (torch.bfloat16, False, True),
        (torch.bfloat16, True, False),
        (torch.float16, True, True),
    ]
    specs = []
    # the split-key launches (k_pe apart: MLA's chunked prefill) in bf16, causal and not, pointer loads; and
    # the context chunks' launches that merge into the step's output (non-causal, LSE, with and without k_pe)
    variants_split = [(torch.bfloat16, True, True, True, False), (torch.bfloat16, False, True, True, False),
                      (torch.bfloat16, False, True, True, True)]
    for config in all_prefill_configs(platform):
        for use_tma in sorted({False, bool(config.use_tma)}):
            cases = [(d, c, s, False, False) for d, c, s in variants]
            if not merge_reason(platform):
                cases.append((torch.bfloat16, False, True, False, True))
            if not use_tma and not split_key_reason(platform):
                cases += [case for case in variants_split if not (case[4] and merge_reason(platform))]
            for dtype, causal, store_lse, split_k, merge in cases:
                constexprs = kernel_constexprs(
                    head_dim_qk, head_dim_v, config.block_m, config.block_n, causal, store_lse, use_tma
                )
                constexprs["WARP_SPECIALIZE"] = bool(config.warp_specialize and use_tma)
                constexprs["SPLIT_K"] = split_k
                constexprs["MERGE"] = merge
                constexprs["NUM_XCDS"] = config.xcds
                ty = _TRITON_DTYPE_NAMES[dtype]
                signature = {"Q": f"*{ty}", "K": f"*{ty}", "V": f"*{ty}", "Out": f"*{ty}", "Lse": "*fp32",
                             "K_pe": f"*{ty}"}
                if use_tma:
                    block_n = config.block_n
                    signature["k_desc_a"] = f"tensordesc<{ty}[{block_n},{constexprs['BLOCK_DQK_A']}]>"
                    signature["k_desc_b"] = f"tensordesc<{ty}[{block_n},{constexprs['BLOCK_DQK_B']}]>"
                    signature["v_desc"] = f"tensordesc<{ty}[{block_n},{constexprs['BLOCK_DV']}]>"
                else:
                    for name in ("k_desc_a", "k_desc_b", "v_desc"):
                        signature[name] = "constexpr"
                        constexprs[name] = None
                signature.update({
                    "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "Error_flag": "*i32", "qk_scale_log2": "fp32",
                    "total_q": "i32", "total_k": "i32", "max_seqlen_q": "i32", "max_seqlen_k": "i32",
                })  # fmt: skip
                strides = [
                    "stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_v_t", "stride_v_h",
                    "stride_o_t", "stride_o_h", "stride_lse_h", "stride_kpe_t", "stride_kpe_h",
                ]  # fmt: skip
                for name in strides + ["num_m_blocks", "num_queries_per_kv", "num_heads"]:
                    signature[name] = "i32"
                for name in constexprs:
                    signature.setdefault(name, "constexpr")
                mode = ("causal" if causal else "full") + ("" if store_lse else ",no-lse") + (",tma" if use_tma else "")
                mode += (",split-k" if split_k else "") + (",merge" if merge else "")
                specs.append(
                    CompileSpec(
                        name=f"prefill_varlen[{config.name},{ty},{mode}]",
                        fn=_varlen_attention_kernel,
                        signature=signature,
                        constexprs=constexprs,
                        options=config.launch_options(),
                        # The LSE head stride is the token count: any value.
                        divisible_by_16=("Q", "K", "V", "Out", "Lse", "cu_seqlens_q", "cu_seqlens_k",
                                         *(n for n in strides if n not in ("stride_lse_h", "stride_kpe_h"))),
                    )
                )
    from mla_multi.kernels import prefill_wgmma

    return specs + prefill_wgmma.compile_specs(platform)  # the sm_90 kernel (none elsewhere)
