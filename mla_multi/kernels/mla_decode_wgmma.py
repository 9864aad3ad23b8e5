"""Split-KV MLA decode for sm_90 with the QK product computed once per tile (Gluon).

The Triton decode kernel (`mla_decode`) gives a 64-row tile's QK product all
eight warps along the rows, so both warpgroups compute the whole 576-deep QK
(53 % of the FLOPs) and the rate stops near 38 % of the matmul peak on an H200.
These kernels state the split themselves, with Gluon's explicit layouts,
warpgroup MMA and warp specialisation (`triton.experimental.gluon`, Triton >= 3.6).
Two kernels, the two forms of one warp-specialised kernel
(`_mla_decode_ws_kernel`), chosen by `DecodeLaunchConfig.kernel`
(bench/RESULTS.md has their measurements):

* ``wgmma_rm`` (`_mla_decode_ws_kernel` with ROWS_AS_M; 33+ rows, FlashMLA's
  split): three warpgroups of their own.  The first computes
  ``S = Q K^T [BLOCK_H, BLOCK_N]`` with the query rows (heads, and folded
  query tokens: row = token * N + head) as the MMA's M, so the softmax reduces
  inside each warp; its P feeds its own ``O[:, :256] += P V`` from registers
  and goes, with the rescale, through shared memory to the second, which
  computes ``O[:, 256:]``; the third fills the cache stages.  mbarriers join
  them; there is no CTA-wide barrier in the loop.
* ``wgmma_ws`` (the same kernel, tokens as M: ``S^T = K Q^T``; 17-32 rows of a
  16-bit cache, up to 16 of an FP8 one, where the rows are the MMA's N and
  need no padding to 64).

Common to both: the cache tile is copied to shared memory with ``cp.async``
(any page size: one block-table entry per tile when the page is a multiple of
the tile, one per token otherwise), two 64-token stages; the query sits in
shared memory for the whole split.  The loaders that copy tiles as they are
(16-bit caches, FP8 bytes into raw stages) take TMA instead where
``DecodeLaunchConfig.tma`` asks for it and `tma_cache_reason` finds the cache
describable (pages a multiple of the tile): two bulk tensor copies a tile, a
split's partial last tile still by cp.async so that its rows past the end are
zeros (1-4 % faster than cp.async at 64-128 heads on an H200).  FP8 caches,
two ways:

* raw stages (``DecodeLaunchConfig.raw_stages`` > 0, the default tables): the
  loader copies the cache's bytes with cp.async into raw FP8 stages, QK runs
  on the FP8 tensor cores from them with the query quantised to e4m3 per row
  (each row multiplied by the power of two that puts its largest magnitude in
  [128, 256), the scores by its inverse), and the loader converts each tile's latent part once into the float16
  stages P V reads.  The e4m3 query is the only added error (against float64
  on the dequantised cache: output relative error 0.7-2.6e-2, LSE 0.02-0.08
  on normal inputs; `MLA_MULTI_FP8_QK=0` selects the other way).  Up to 16
  rows (``num_stages`` = 0: no float16 stages, four raw stages) P V runs on
  the FP8 tensor cores too: the second warpgroup reads V from the raw stage
  into registers as the MMA's A operand, its rows (latent columns) permuted
  so that each thread transposes only bytes it loaded itself
  (`_v_operand`), and P goes through shared memory as e4m3 scaled by 2^8;
  P's rounding adds up to 1.7e-2 to the output's error against float64
  with the e4m3 query (measured), within the same 4e-2 bound against the
  query as given;
* float16 products (e4m3 converts to float16 exactly, one instruction per
  pair; bfloat16 takes three), the query multiplied by the power of two that
  puts its largest magnitude in [2^12, 2^13) and the scores by its inverse
  (both exact), so FP8 has the bfloat16 path's accuracy on the dequantised
  cache.  The tile is converted once per element into the float16 tile both
  products read, in the loader warpgroup, which loads the cache as 32-bit
  words three quarters of a tile ahead of the quarter it converts.

fp8_ds_mla caches (uint8 [.., 656]: FlashMLA's rows of 512 e4m3 values, four float32 tile scales and 64
bfloat16 rotary values; the sparse decode reads them as one-token pages) with a bfloat16 query: the
loader (`_ws_load_ds_mla`) dequantises each row's latent part once into the
bfloat16 stages both products read (the scales a tile ahead by cp.async into shared memory, read as
bfloat16 pairs; the block-table entries a tile ahead of the rows they name), and copies the rotary part by
cp.async;
the products are the bfloat16 path's.  An FP8 cache whose rows are not 4-byte aligned takes the Triton kernel.  Everything
else is the Triton kernel's contract: the same workspace (`attn_logits`, merged by
`mla_decode`'s reduce kernel), natural-log LSE, bad index data read in bounds
and reported through the error flag with NaN rows, no host synchronisation.

The module imports on any Triton; `gluon_available()` says whether the
installed one can build these kernels (and why not).
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from mla_multi import errors
from mla_multi.cache_formats import FP8_DS_MLA_V4 as _V4_FORMAT
from mla_multi.kernels.launch import BoundLaunch

try:  # Gluon and its Hopper ops: Triton >= 3.6 with the NVIDIA backend's Python side
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _GLUON_IMPORT_ERROR = ""
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _TensorDescriptor
    except ImportError:  # pragma: no cover - depends on the installed Triton
        _TensorDescriptor = None
except Exception as error:  # pragma: no cover - depends on the installed Triton
    gluon = None
    _GLUON_IMPORT_ERROR = f"{type(error).__name__}: {error}"

__all__ = ["gluon_available", "bind_split_kernel", "tma_keywords", "ws_split_kernel"]


@functools.lru_cache(maxsize=1)
def gluon_available() -> tuple[bool, str]:
    """(True, "") when the installed Triton can build the warpgroup decode kernels, else (False, reason)."""
    if gluon is None:
        import triton

        return False, f"triton {triton.__version__} has no Gluon with Hopper warpgroup MMA ({_GLUON_IMPORT_ERROR})"
    if not (hasattr(async_copy, "async_load") or hasattr(async_copy, "async_copy_global_to_shared")):
        return False, "this Triton's Gluon has no cp.async copy (async_copy.async_load)"
    return True, ""


if gluon is not None:
    # the warp-specialised kernel's worker partitions: the second compute
    # warpgroup and the loader, with their register budgets (setmaxnreg; the
    # first warpgroup gets the rest of 3 x 168)
    WS_LOAD_WARPS = gl.constexpr(4)
    WS_PV_REGS = gl.constexpr(168)
    WS_LOAD_REGS = gl.constexpr(56)
    # an FP8 loader holds three quarters of a tile ahead in registers (54 words a thread) and the quarter
    # it converts (an fp8_ds_mla one 48 words, its scales going through shared memory); 160 / 144 / 200
    # is the split with which no partition spills under Triton 3.6 and 3.9
    WS_PV_REGS_FP8 = gl.constexpr(160)
    WS_LOAD_REGS_FP8 = gl.constexpr(144)
    # the raw-stage FP8 loader (cp.async, then a 16-row piece converted at a time)
    WS_LOAD_REGS_RAW = gl.constexpr(112)
    # FP8 P V (`_fp8_pv`): the second warpgroup holds both halves' output (64 registers) and operands
    # (64), the loader only issues copies
    WS_PV_REGS_F8PV = gl.constexpr(200)
    WS_LOAD_REGS_F8PV = gl.constexpr(56)
    # P in [0, 1] times 2^8 as e4m3 (largest 448): values down to 2^-14 keep e4m3's normal precision
    FP8_P_SCALE = gl.constexpr(256.0)
    # the launch's register cap: 12 warps share the 64K registers of an SM
    WS_MAXNREG = 168
    _BLOCK_INDEX_ERROR = gl.constexpr(errors.BLOCK_INDEX)
    _SPARSE_INDEX_ERROR = gl.constexpr(errors.SPARSE_INDEX)
    _SEQ_RANGE_ERROR = gl.constexpr(errors.SEQ_RANGE)
    # names that moved between Triton releases (3.6: thread_barrier and
    # async_copy_global_to_shared; later: barrier and async_load)
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    _async_load = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    @gluon.constexpr_function
    def _shared_layout(cols, bits):
        """NVMMA shared layout of a row-major tile `cols` wide: the widest swizzle its rows allow."""
        row_bytes = cols * bits // 8
        swizzle = 0
        for width in (128, 64, 32):
            if swizzle == 0 and row_bytes % width == 0:
                swizzle = width
        return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bits, rank=2)

    @gluon.constexpr_function
    def _operand_dtype(query_dtype, cache_dtype):
        """The warp-specialised kernel's MMA operand type: the query's, float16 for an FP8 cache (the
        query's again for an fp8_ds_mla one, uint8 bytes, dequantised with its scales)."""
        return gl.float16 if _scaled_query(cache_dtype) else query_dtype

    @gluon.constexpr_function
    def _scaled_query(cache_dtype):
        """Whether the products are float16 with the query scaled by a power of two: an FP8 cache with one
        per-tensor scale (not fp8_ds_mla's uint8 rows, dequantised into the query's type)."""
        return cache_dtype.primitive_bitwidth == 8 and cache_dtype != gl.uint8

    @gluon.constexpr_function
    def _tile_layout(cols, bits, num_warps):
        """Row-major blocked layout with 16-byte vectors along the rows, for copies and conversions."""
        vec = min(128 // bits, cols)
        threads_c = min(32, cols // vec)
        threads_r = 32 // threads_c
        warps_c = min(num_warps, max(1, cols // (vec * threads_c)))
        return gl.BlockedLayout(
            size_per_thread=[1, vec],
            threads_per_warp=[threads_r, threads_c],
            warps_per_cta=[num_warps // warps_c, warps_c],
            order=[1, 0],
        )

    @gluon.jit
    def _tile_page(block_table_row, start, split_end, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
        """The block-table entry of a tile that lies inside one page (0 for a tile past the split), loaded
        a tile ahead of its copies so that their addresses do not wait on it; a page smaller than the tile
        (whose rows look up their own entries) reads nothing."""
        if PAGE_SIZE % BLOCK_N != 0:
            return 0
        return gl.load(block_table_row + start // PAGE_SIZE, mask=start < split_end, other=0)

    @gluon.jit
    def _tile_rows(
        start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
        PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr,
        FIRST: gl.constexpr = 0, COUNT: gl.constexpr = 0,
    ):
        """Cache row offsets of tile positions [start, start + BLOCK_N) (in `layout`), their validity
        and whether a block-table entry the tile needed lay outside [0, num_cache_blocks) (read as 0).
        `page`: the tile's block-table entry (`_tile_page`) when the page is a multiple of the tile.
        COUNT > 0: only the tile's positions [start + FIRST, start + FIRST + COUNT)."""
        pos = start + FIRST + gl.arange(0, COUNT if COUNT > 0 else BLOCK_N, layout=layout)
        valid = pos < split_end
        if PAGE_SIZE % BLOCK_N == 0:
            # the tile lies inside one page: one block-table entry
            live = start < split_end
            bad = ((page < 0) | (page >= num_cache_blocks)) & live
            page = gl.where(bad, 0, page).to(gl.int64)
            rows = page * stride_kv_block + (pos % PAGE_SIZE).to(gl.int64) * stride_kv_token
        else:
            pages = gl.load(block_table_row + pos // PAGE_SIZE, mask=valid, other=0)
            pages_bad = (pages < 0) | (pages >= num_cache_blocks)
            bad = gl.max(pages_bad.to(gl.int32), 0) > 0
            pages = gl.where(pages_bad, 0, pages).to(gl.int64)
            rows = pages * stride_kv_block + (pos % PAGE_SIZE).to(gl.int64) * stride_kv_token
        return rows, valid, bad

    @gluon.jit
    def _issue_tile(
        kv_buf, kpe_buf, KV_cache, start, split_end, block_table_row, num_cache_blocks, stride_kv_block,
        stride_kv_token, page,
        KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
        kv_layout: gl.constexpr, kpe_layout: gl.constexpr,
    ):
        """Start the cp.async copies of one cache tile (positions past split_end are zero-filled)."""
        rows, valid, bad = _tile_rows(
            start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
            PAGE_SIZE, BLOCK_N, gl.SliceLayout(1, kv_layout),
        )
        cols = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, kv_layout))
        _async_load(kv_buf, KV_cache + rows[:, None] + cols[None, :], mask=valid[:, None])
        rows_pe, valid_pe, bad_pe = _tile_rows(
            start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
            PAGE_SIZE, BLOCK_N, gl.SliceLayout(1, kpe_layout),
        )
        cols_pe = KV_LORA_RANK + gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, kpe_layout))
        _async_load(kpe_buf, KV_cache + rows_pe[:, None] + cols_pe[None, :], mask=valid_pe[:, None])
        return bad | bad_pe

    @gluon.jit
    def _split_range(Seq_lens, batch, split, num_kv_splits, max_seq_len, BLOCK_N: gl.constexpr,
                     FULL: gl.constexpr = False):
        """This split's cache positions [split_start, split_end) and tile count; a length outside the
        block-table row reads as 0 (bad_seq_len: the request's rows become NaN). FULL (V4 index lists read as
        they are, whose lengths are all max_seq_len: `mla_decode.V4Pages`): Seq_lens is not read, so that the
        loader's first load is the lists' entries, not a length they wait on (the loader's alone: the other
        partitions' loads wait on nothing, and FULL there spilled under Triton 3.9)."""
        if FULL:
            seq_len = max_seq_len
            bad_seq_len = max_seq_len < 0
        else:
            seq_len = gl.load(Seq_lens + batch)
            bad_seq_len = (seq_len < 0) | (seq_len > max_seq_len)
            seq_len = gl.where(bad_seq_len, 0, seq_len)
        tokens_per_split = gl.cdiv(gl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
        split_start = split * tokens_per_split
        split_end = gl.minimum(split_start + tokens_per_split, seq_len)
        num_tiles = gl.cdiv(gl.maximum(split_end - split_start, 0), BLOCK_N)
        return seq_len, bad_seq_len, split_start, split_end, num_tiles

    @gluon.jit
    def _power_of_two_scales(amax, TOP: gl.constexpr = 12):
        """(2^(TOP - e), 2^(e - TOP)), e = floor(log2 amax), built from the exponent bits (exact; e is
        clamped to [-100, 100] so that all zeros, subnormals, infinities or NaN still get a finite power
        of two); elementwise on a tensor of maxima."""
        exponent = ((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exponent = gl.minimum(gl.maximum(exponent, -100), 100)
        up = ((127 + TOP - exponent) << 23).to(gl.float32, bitcast=True)
        down = ((127 - TOP + exponent) << 23).to(gl.float32, bitcast=True)
        return up, down

    @gluon.jit
    def _query_pointers(
        Q_nope, Q_pe, batch, first_row, num_heads, stride_qn_b, stride_qn_t, stride_qn_h,
        stride_qp_b, stride_qp_t, stride_qp_h,
        Q_LEN: gl.constexpr, ROWS: gl.constexpr, ROPE_DIM: gl.constexpr, q_layout: gl.constexpr,
        qpe_layout: gl.constexpr,
    ):
        """Query rows [first_row, first_row + ROWS) (row = token * num_heads + head): the latent part's row
        pointers [ROWS] and mask [ROWS, 1] (in `q_layout`; columns added per chunk), the rotary part's
        pointers and mask [ROWS, ROPE_DIM] (in `qpe_layout`)."""
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
        ptrs = Q_nope + batch * stride_qn_b + (rows // num_heads) * stride_qn_t + (rows % num_heads) * stride_qn_h
        mask = (rows < Q_LEN * num_heads)[:, None]
        rows_pe = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, qpe_layout))
        cols_pe = gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, qpe_layout))
        ptrs_pe = (
            Q_pe + batch * stride_qp_b + (rows_pe // num_heads) * stride_qp_t + (rows_pe % num_heads) * stride_qp_h
        )
        mask_pe = (rows_pe < Q_LEN * num_heads)[:, None]
        return ptrs, mask, ptrs_pe[:, None] + cols_pe[None, :], mask_pe

    @gluon.jit
    def _load_query(
        q_smem, qpe_smem, Q_nope, Q_pe, batch, first_row, num_heads,
        stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h,
        Q_LEN: gl.constexpr, ROWS: gl.constexpr, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr,
        num_warps: gl.constexpr, SCALE_ROWS: gl.constexpr = False, AT_ONCE: gl.constexpr = False,
    ):
        """Query rows [first_row, first_row + ROWS) (row = token * num_heads + head) into shared memory,
        128 columns at a time (a whole 64 x 512 tile would take 128 registers a thread on one warpgroup).
        AT_ONCE (a 512-wide 16-bit query, no SCALE_ROWS): all four chunks loaded before the first is stored, one
        trip to memory where the compiler made two: the DeepSeek-V4 kernels whose splits are one tile, which wait
        on it (where a split holds several tiles, 128 heads x 64 tokens measured 1 % slower with it:
        bench/RESULTS.md).

        SCALE_ROWS (a float16 query for an FP8 cache): the rows are multiplied by the power of two that
        puts their largest magnitude in [2^12, 2^13), so that nothing overflows float16 and every
        bfloat16 value down to 2^-26 of that maximum converts exactly (what lies below is rounded to
        float16's subnormal spacing, 2^-37 of the maximum: far below the query's own bfloat16
        rounding); returns the factor that undoes it on the scores (1.0 without SCALE_ROWS)."""
        CHUNK: gl.constexpr = 128 if KV_LORA_RANK > 128 else KV_LORA_RANK
        q_layout: gl.constexpr = _tile_layout(CHUNK, 16, num_warps)
        qpe_layout: gl.constexpr = _tile_layout(ROPE_DIM, 16, num_warps)
        ptrs, mask, ptrs_pe, mask_pe = _query_pointers(
            Q_nope, Q_pe, batch, first_row, num_heads, stride_qn_b, stride_qn_t, stride_qn_h,
            stride_qp_b, stride_qp_t, stride_qp_h, Q_LEN, ROWS, ROPE_DIM, q_layout, qpe_layout,
        )
        if SCALE_ROWS:
            # one read from global memory: the 16-bit query's bits are parked in the float16 tile while the
            # maximum is found, then scaled and converted in place (each thread rereads what it stored;
            # holding 64 x 512 values in registers across the maximum instead spilled)
            q_pe = gl.load(ptrs_pe, mask=mask_pe, other=0.0)
            amax = gl.convert_layout(gl.max(gl.abs(q_pe.to(gl.float32)), 1), gl.SliceLayout(1, q_layout))
            for c in gl.static_range(KV_LORA_RANK // CHUNK):
                cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, q_layout))
                q = gl.load(ptrs[:, None] + cols[None, :], mask=mask, other=0.0)
                amax = gl.maximum(amax, gl.max(gl.abs(q.to(gl.float32)), 1))
                q_smem.slice(c * CHUNK, CHUNK, dim=1).store(q.to(q_smem.dtype, bitcast=True))
            up, down = _power_of_two_scales(gl.max(amax, 0))
            qpe_smem.store((q_pe.to(gl.float32) * up).to(qpe_smem.dtype))
            for c in gl.static_range(KV_LORA_RANK // CHUNK):
                chunk = q_smem.slice(c * CHUNK, CHUNK, dim=1)
                q = chunk.load(q_layout).to(Q_nope.dtype.element_ty, bitcast=True)
                chunk.store((q.to(gl.float32) * up).to(q_smem.dtype))
        elif AT_ONCE:
            gl.static_assert(KV_LORA_RANK == 4 * CHUNK, "AT_ONCE loads four 128-column chunks")
            cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, q_layout))
            chunk = ptrs[:, None] + cols[None, :]
            q_pe = gl.load(ptrs_pe, mask=mask_pe, other=0.0)
            q0 = gl.load(chunk, mask=mask, other=0.0)
            q1 = gl.load(chunk + CHUNK, mask=mask, other=0.0)
            q2 = gl.load(chunk + 2 * CHUNK, mask=mask, other=0.0)
            q3 = gl.load(chunk + 3 * CHUNK, mask=mask, other=0.0)
            qpe_smem.store(q_pe)
            q_smem.slice(0, CHUNK, dim=1).store(q0)
            q_smem.slice(CHUNK, CHUNK, dim=1).store(q1)
            q_smem.slice(2 * CHUNK, CHUNK, dim=1).store(q2)
            q_smem.slice(3 * CHUNK, CHUNK, dim=1).store(q3)
            down = 1.0
        else:
            qpe_smem.store(gl.load(ptrs_pe, mask=mask_pe, other=0.0))
            for c in gl.static_range(KV_LORA_RANK // CHUNK):
                cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, q_layout))
                q = gl.load(ptrs[:, None] + cols[None, :], mask=mask, other=0.0)
                q_smem.slice(c * CHUNK, CHUNK, dim=1).store(q)
            down = 1.0
        return down

    @gluon.jit
    def _load_query_e4m3(
        q_smem, qpe_smem, Q_nope, Q_pe, batch, first_row, num_heads,
        stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h,
        Q_LEN: gl.constexpr, ROWS: gl.constexpr, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr,
        num_warps: gl.constexpr, park=None,
    ):
        """Query rows [first_row, first_row + ROWS) quantised to e4m3 into shared memory, each row
        multiplied by the power of two that puts its largest magnitude (over all 576 columns) in
        [128, 256) (e4m3 reaches 448): returns the per-row factors that undo it on the scores
        [ROWS] (exact powers of two; the rounding to e4m3's 3 mantissa bits is the error this adds).
        Up to 16 rows are read once and held in registers (64 values a thread); more rows (64 held in
        registers across the maximum spilled) are copied once with cp.async into `park` (a 16-bit shared
        tile [ROWS, KV_LORA_RANK]), all chunks at once, and read from there for the maximum and again
        for the conversion."""
        ONE_READ: gl.constexpr = ROWS * KV_LORA_RANK <= 16 * 512
        CHUNK: gl.constexpr = KV_LORA_RANK if (ONE_READ or KV_LORA_RANK <= 128) else 128
        q_layout: gl.constexpr = _tile_layout(CHUNK, 16, num_warps)
        qpe_layout: gl.constexpr = _tile_layout(ROPE_DIM, 16, num_warps)
        ptrs, mask, ptrs_pe, mask_pe = _query_pointers(
            Q_nope, Q_pe, batch, first_row, num_heads, stride_qn_b, stride_qn_t, stride_qn_h,
            stride_qp_b, stride_qp_t, stride_qp_h, Q_LEN, ROWS, ROPE_DIM, q_layout, qpe_layout,
        )
        if not ONE_READ:
            # the latent part's bits copied into `park` with cp.async, all chunks in flight at once
            park_ptrs = ptrs.to(gl.pointer_type(park.dtype), bitcast=True)
            for c in gl.static_range(KV_LORA_RANK // CHUNK):
                cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, q_layout))
                _async_load(park.slice(c * CHUNK, CHUNK, dim=1), park_ptrs[:, None] + cols[None, :], mask=mask)
            async_copy.commit_group()
        q_pe = gl.load(ptrs_pe, mask=mask_pe, other=0.0).to(gl.float32)
        amax = gl.convert_layout(gl.max(gl.abs(q_pe), 1), gl.SliceLayout(1, q_layout))
        if ONE_READ:
            cols = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, q_layout))
            q = gl.load(ptrs[:, None] + cols[None, :], mask=mask, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(q), 1))
        else:
            async_copy.wait_group(0)
            _cta_barrier()
            for c in gl.static_range(KV_LORA_RANK // CHUNK):
                q = park.slice(c * CHUNK, CHUNK, dim=1).load(q_layout).to(Q_nope.dtype.element_ty, bitcast=True)
                amax = gl.maximum(amax, gl.max(gl.abs(q.to(gl.float32)), 1))
        up, down = _power_of_two_scales(amax, 7)
        up_pe = gl.convert_layout(up, gl.SliceLayout(1, qpe_layout))
        qpe_smem.store((q_pe * up_pe[:, None]).to(qpe_smem.dtype))
        if ONE_READ:
            q_smem.store((q * up[:, None]).to(q_smem.dtype))
        else:
            for c in gl.static_range(KV_LORA_RANK // CHUNK):
                q = park.slice(c * CHUNK, CHUNK, dim=1).load(q_layout).to(Q_nope.dtype.element_ty, bitcast=True)
                q_smem.slice(c * CHUNK, CHUNK, dim=1).store((q.to(gl.float32) * up[:, None]).to(q_smem.dtype))
        return down

    @gluon.constexpr_function
    def _max_through_smem(rows_as_m, block_h):
        """Whether the tokens-as-M softmax takes its max through `_max_over_tokens` (up to 32 rows: 1 KiB of
        shared memory, which 64 rows' 16-bit stages leave no room for)."""
        return (not rows_as_m) and block_h <= 32

    @gluon.constexpr_function
    def _warp_maxima_layout(rows):
        """[4, rows]: the four warps' maxima of a tokens-as-M score tile, each thread holding all four for
        the rows it holds in the tile (the wgmma accumulator's: row bit 0 and bits 3.. in registers, bits
        1-2 in the lanes), so that their max is in the tile's row layout without moving data."""
        reg_bases = [[0, 1]] + [[0, 1 << b] for b in range(3, (rows - 1).bit_length())] + [[1, 0], [2, 0]]
        return gl.DistributedLinearLayout(
            reg_bases=reg_bases, lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, rows],
        )

    @gluon.jit
    def _max_over_tokens(s, red_smem, tile):
        """max over the tokens of S^T [BLOCK_N, rows] whose tokens lie across the 4 warps (16 a warp per
        64): each warp's maxima by shuffles, exchanged through shared memory with one barrier (`red_smem`
        [2, 4, rows] by tile parity, so a warp still reading the last tile's is not overwritten)."""
        BLOCK_N: gl.constexpr = s.shape[0]
        ROWS: gl.constexpr = s.shape[1]
        part = gl.max(gl.reshape(s, [4, BLOCK_N // 4, ROWS]), 1)
        buf = red_smem.index(tile % 2)
        buf.store(part)
        _cta_barrier()
        all4 = buf.load(_warp_maxima_layout(ROWS))
        return gl.convert_layout(gl.max(all4, 0), gl.SliceLayout(0, s.type.layout))

    @gluon.jit
    def _online_softmax(s, m_i, l_i, start, split_end, s_rows, row_limit, qk_scale,
                        Q_LEN: gl.constexpr, BLOCK_N: gl.constexpr, SUM_TILES: gl.constexpr = False,
                        red_smem=None, tile=0):
        """One tile of S^T [BLOCK_N, rows] -> (P^T, new max, new sum, rescale of the old output); log2 domain.
        SUM_TILES: `l_i` is [BLOCK_N, rows], summed over the tokens only at the end (`gl.sum(l_i, 0)`), so the
        tile's sum needs no exchange between the warps (the tokens are spread over them), and (up to 32 rows)
        the max one barrier (`_max_over_tokens`, through `red_smem`)."""
        pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s.type.layout))
        s = s * qk_scale
        if Q_LEN > 1:
            visible = (pos < split_end)[:, None] & (pos[:, None] < row_limit[None, :])
        else:
            visible = (pos < split_end)[:, None] & (s_rows >= 0)[None, :]
        s = gl.where(visible, s, float("-inf"))
        if _max_through_smem(False, s.shape[1]) and SUM_TILES:
            m_new = gl.maximum(m_i, _max_over_tokens(s, red_smem, tile))
        else:
            m_new = gl.maximum(m_i, gl.max(s, 0))
        # a row that has seen nothing yet keeps max -inf: subtract 0 instead (no NaN)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        if SUM_TILES:
            l_new = l_i * alpha[None, :] + p
        else:
            l_new = l_i * alpha + gl.sum(p, 0)
        return p, m_new, l_new, alpha

    @gluon.jit
    def _online_softmax_rows(s, m_i, l_i, start, split_end, s_rows, row_limit, qk_scale,
                             Q_LEN: gl.constexpr, BLOCK_N: gl.constexpr):
        """`_online_softmax` for S [rows, BLOCK_N] (rows as the MMA's M): the reductions stay in each warp."""
        pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        s = s * qk_scale
        if Q_LEN > 1:
            visible = (pos < split_end)[None, :] & (pos[None, :] < row_limit[:, None])
        else:
            visible = (pos < split_end)[None, :] & (s_rows >= 0)[:, None]
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_new, alpha

    @gluon.jit
    def _finish_rows(m_i, l_i, invalid, K_scale, HAS_K_SCALE: gl.constexpr):
        """(1 / sum, natural-log LSE) per row; NaN for a request with bad index data, 0 / -inf for no mass."""
        # l_i >= 0, or NaN where a NaN (or +inf) score reached the softmax: `!= 0` keeps NaN rows on the mass
        # path, so that their output and LSE come out NaN (the NaN policy) at no extra cost
        has_mass = l_i != 0.0
        inv_l = gl.where(has_mass, 1.0 / gl.where(has_mass, l_i, 1.0), 0.0)
        if HAS_K_SCALE:
            inv_l = inv_l * gl.load(K_scale).to(gl.float32)
        inv_l = gl.where(invalid, float("nan"), inv_l)
        # m is in the log2 domain
        lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        lse = gl.where(invalid, float("nan"), lse)
        return inv_l, lse

    @gluon.jit
    def _sink_factor(Sink, lse, s_rows, num_heads, Q_LEN: gl.constexpr):
        """exp(lse) / (exp(lse) + exp(sink)) of rows `s_rows` (Sink [num_heads] float32: +inf gives 0, -inf 1);
        1 for a row without mass (LSE -inf: its output stays 0), NaN for a NaN LSE."""
        sink = gl.load(Sink + s_rows % num_heads, mask=s_rows < Q_LEN * num_heads, other=0.0)
        empty = lse == float("-inf")
        return gl.where(empty, 1.0, 1.0 / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse))))

    @gluon.jit
    def _store_rows(
        acc, inv_l, lse, s_rows, batch, split, num_heads, Out, Lse, Attn_logits,
        stride_o_b, stride_o_t, stride_o_h, stride_lse_b, stride_lse_t, stride_lse_h,
        stride_al_row, stride_al_h, stride_al_split,
        Q_LEN: gl.constexpr, COLS: gl.constexpr, DIRECT_OUTPUT: gl.constexpr, FIRST_COL: gl.constexpr = 0,
        STORE_LSE: gl.constexpr = True, KV_LORA_RANK: gl.constexpr = 0, ROWS_FIRST: gl.constexpr = False,
    ):
        """O^T [COLS, rows] * inv_l (latent columns FIRST_COL..; ROWS_FIRST: `acc` is O [rows, COLS]) and the
        LSE of rows `s_rows`: the output (one split) or this split's partials (whose LSE column is
        KV_LORA_RANK, COLS + FIRST_COL when 0)."""
        if ROWS_FIRST:
            acc = gl.permute(acc, (1, 0))
        o_layout: gl.constexpr = acc.type.layout
        rows_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        out = acc * gl.convert_layout(inv_l, rows_o)[None, :]
        o_rows = gl.convert_layout(s_rows, rows_o)
        o_valid = o_rows < Q_LEN * num_heads
        o_cols = FIRST_COL + gl.arange(0, COLS, layout=gl.SliceLayout(1, o_layout))
        if DIRECT_OUTPUT:
            out_ptrs = Out + batch * stride_o_b + (o_rows // num_heads) * stride_o_t + (o_rows % num_heads) * stride_o_h
            gl.store(out_ptrs[None, :] + o_cols[:, None], out.to(Out.dtype.element_ty), mask=o_valid[None, :])
        else:
            partial_ptrs = (
                Attn_logits
                + (batch * Q_LEN + o_rows // num_heads) * stride_al_row
                + (o_rows % num_heads) * stride_al_h
                + split * stride_al_split
            )
            gl.store(partial_ptrs[None, :] + o_cols[:, None], out, mask=o_valid[None, :])
        if STORE_LSE:
            _store_lse(
                lse, s_rows, batch, split, num_heads, Lse, Attn_logits, stride_lse_b, stride_lse_t, stride_lse_h,
                stride_al_row, stride_al_h, stride_al_split, Q_LEN, DIRECT_OUTPUT,
                KV_LORA_RANK if KV_LORA_RANK > 0 else COLS + FIRST_COL,
            )

    @gluon.jit
    def _store_lse(
        lse, s_rows, batch, split, num_heads, Lse, Attn_logits, stride_lse_b, stride_lse_t, stride_lse_h,
        stride_al_row, stride_al_h, stride_al_split, Q_LEN: gl.constexpr, DIRECT_OUTPUT: gl.constexpr,
        LSE_COL: gl.constexpr,
    ):
        """The LSE of rows `s_rows`: into `Lse` (one split) or column LSE_COL of this split's partials."""
        lse_valid = s_rows < Q_LEN * num_heads
        if DIRECT_OUTPUT:
            lse_ptrs = Lse + batch * stride_lse_b + (s_rows // num_heads) * stride_lse_t + (s_rows % num_heads) * stride_lse_h
        else:
            lse_ptrs = (
                Attn_logits
                + (batch * Q_LEN + s_rows // num_heads) * stride_al_row
                + (s_rows % num_heads) * stride_al_h
                + split * stride_al_split
                + LSE_COL
            )
        gl.store(lse_ptrs, lse, mask=lse_valid)

    # -- warp-specialised kernel ---------------------------------------------------
    # Three warpgroups with their own instruction streams (FlashMLA's split):
    # the first computes QK for all the program's rows (one pass over the cache
    # tile), the softmax, and P V for latent columns [0, 256); the second
    # computes P V for columns [256, 512) from the P and rescale the first
    # leaves in shared memory, while the first goes on to the next tile's QK;
    # the third fills the cache stages.  ROWS_AS_M puts the query rows on the
    # MMA's M (S = Q K^T: the softmax reduces inside each warp and P feeds the
    # first warpgroup's PV from registers; 64 rows); otherwise the cache tokens
    # are M (S^T = K Q^T: any row count from 8, the reductions cross warps).

    @gluon.constexpr_function
    def _ws_layouts(rows_as_m, block_h, block_n, half_cols, qk_k=16):
        """(S layout, output layout, the slice of S holding one value per query row, the slice holding one per
        cache token, the output's slice of one value per query row).  qk_k: the QK instruction's K (16 for
        16-bit operands, 32 for FP8)."""
        if rows_as_m:
            s_layout = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, qk_k]
            )
            o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, half_cols, 16])
            return s_layout, o_layout, gl.SliceLayout(1, s_layout), gl.SliceLayout(0, s_layout), gl.SliceLayout(1, o_layout)
        s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_h, qk_k])
        o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_h, 16])
        return s_layout, o_layout, gl.SliceLayout(0, s_layout), gl.SliceLayout(1, s_layout), gl.SliceLayout(0, o_layout)

    @gluon.constexpr_function
    def _query_parked(raw_stages, block_h, kv_lora_rank):
        """Whether the e4m3 query's 16-bit values wait in the first float16 stage while their maximum is
        found (more rows than `_load_query_e4m3` holds in registers), so that the loader converts its first
        tile only once the query is in place."""
        return raw_stages > 0 and block_h * kv_lora_rank > 16 * 512

    @gluon.constexpr_function
    def _fp8_pv(raw_stages, stages):
        """Whether P V runs on the FP8 tensor cores straight from the raw stages (no float16 stages): the
        second warpgroup reads each tile's latent part from its raw stage into registers, transposed to the
        MMA's A operand, and multiplies it by an e4m3 P (tokens as M, at most 16 rows: `_pv_whole`)."""
        return raw_stages > 0 and stages == 0

    @gluon.constexpr_function
    def _v_load_layout(block_n):
        """[BLOCK_N tokens, 256 latent columns] of a raw stage as the second warpgroup reads them for
        `_v_operand`: 8 consecutive columns (one 8-byte load) of 16 tokens a thread; the lanes take tokens
        4 and 8 and columns 8-32, the warps columns 64 and 128.  A quarter warp's loads cover 64 bytes of
        4 rows, two wavefronts a warp with the 128-byte swizzle."""
        assert block_n == 64, "the FP8 P V operand takes 64-token tiles"
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0], [32, 0]],
            lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
            warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[block_n, 256],
        )

    @gluon.jit
    def _v_operand(v, a_layout: gl.constexpr):
        """V [64 tokens, 256 columns] -> the A operand [256, 64] of P V with its M permuted: row m holds
        column c(m) with c's bits (high to low) = m's bits 5-4, 2-0, 7-6, 3.  Each thread's 8 rows of the
        operand (m bits 3, 6, 7 in its registers) are then the 8 consecutive columns it loaded, so the
        transposition stays in its registers (byte permutes, no shared memory)."""
        a = gl.reshape(v, [64, 4, 8, 4, 2])  # tokens, m bits 5-4, 2-0, 7-6, 3
        a = gl.reshape(gl.permute(a, (3, 1, 4, 2, 0)), [256, 64])
        return gl.convert_layout(a, a_layout)

    @gluon.constexpr_function
    def _o_store_layout(rows):
        """O^T [256 latent columns, 16 rows] as `_unpermute_columns` leaves the FP8 P V output (the wgmma
        accumulator's lanes and warps), its 8 consecutive columns first among each thread's registers, so
        that each row's 8 go out in two 16-byte stores."""
        assert rows == 16, "the FP8 P V output layout is for 16 rows"
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [2, 0], [4, 0], [0, 1], [0, 8]],
            lane_bases=[[0, 2], [0, 4], [8, 0], [16, 0], [32, 0]],
            warp_bases=[[64, 0], [128, 0]], block_bases=[], shape=[256, rows],
        )

    @gluon.jit
    def _unpermute_columns(acc):
        """O^T [256 (M of `_v_operand`), rows] -> O^T [256 latent columns, rows] (a relabelling, and a
        reordering of each thread's registers)."""
        rows: gl.constexpr = acc.shape[1]
        o = gl.reshape(acc, [4, 4, 2, 8, rows])  # m bits 7-6, 5-4, 3, 2-0
        o = gl.reshape(gl.permute(o, (1, 3, 0, 2, 4)), [256, rows])
        return gl.convert_layout(o, _o_store_layout(rows))

    @gluon.jit
    def _last_rescale(row_smem, p_ready, p_empty, num_tiles, rows_o: gl.constexpr):
        """The second warpgroup's final 1 / sum per row, which the first leaves after its last tile's P."""
        mbarrier.wait(p_ready, num_tiles & 1)
        inv_l = row_smem.load(rows_o)
        _cta_barrier()
        mbarrier.arrive(p_empty, count=1)
        return inv_l

    @gluon.jit
    def _ws_fp8_pv_partition(
        raw_kv, raw_ready, raw_empty, p_smem, row_smem, p_ready, p_empty, num_tiles,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, RAW_STAGES: gl.constexpr,
    ):
        """P V for all the latent columns on the FP8 tensor cores (`_fp8_pv`), in two halves of 256
        columns: returns the two O^T halves [256 latent columns, rows] (relabelled by `_unpermute_columns`)
        and the final 1 / sum per row."""
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 32]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        v_layout: gl.constexpr = _v_load_layout(BLOCK_N)
        rows_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        acc0 = gl.zeros([256, BLOCK_H], gl.float32, layout=o_layout)
        acc1 = gl.zeros([256, BLOCK_H], gl.float32, layout=o_layout)
        p_t = p_smem.permute((1, 0))
        for tile in tl.range(0, num_tiles, disable_licm=True):
            slot = tile % RAW_STAGES
            mbarrier.wait(raw_ready.index(slot), (tile // RAW_STAGES) & 1)
            v_tile = raw_kv.index(slot)
            a0 = _v_operand(v_tile.slice(0, 256, dim=1).load(v_layout), a_layout)
            a1 = _v_operand(v_tile.slice(256, 256, dim=1).load(v_layout), a_layout)
            mbarrier.wait(p_ready, tile & 1)
            alpha = row_smem.load(rows_o)[None, :]
            acc0 = warpgroup_mma(a0, p_t, acc0 * alpha, is_async=True)
            acc1 = warpgroup_mma(a1, p_t, acc1 * alpha, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            _cta_barrier()
            mbarrier.arrive(p_empty, count=1)
            mbarrier.arrive(raw_empty.index(slot), count=1)
        inv_l = _last_rescale(row_smem, p_ready, p_empty, num_tiles, rows_o)
        return _unpermute_columns(acc0), _unpermute_columns(acc1), inv_l

    @gluon.constexpr_function
    def _pv_whole(rows_as_m, block_h):
        """Whether the second warpgroup computes P V for all the latent columns (the first then only QK and
        the softmax): with the tokens as M and at most 16 rows, whose whole output is 64 registers a thread."""
        return (not rows_as_m) and block_h <= 16

    @gluon.jit
    def _tile_bad_block(block_table_row, start, split_end, num_cache_blocks, PAGE_SIZE: gl.constexpr,
                        BLOCK_N: gl.constexpr, tokens_layout: gl.constexpr):
        """Whether the block-table entries of the tile at `start` lie outside [0, num_cache_blocks) (the
        loader read such an entry as block 0; the compute partition reports it)."""
        if PAGE_SIZE % BLOCK_N == 0:
            page = gl.load(block_table_row + start // PAGE_SIZE)
            return (page < 0) | (page >= num_cache_blocks)
        pages = _tile_pages(block_table_row, start, split_end, PAGE_SIZE, BLOCK_N, tokens_layout)
        return gl.max(((pages < 0) | (pages >= num_cache_blocks)).to(gl.int32), 0) > 0

    @gluon.jit
    def _tile_pages(block_table_row, start, split_end, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                    tokens_layout: gl.constexpr):
        """The block-table entry of each position of the tile at `start` (0 past the split's end)."""
        pos = start + gl.arange(0, BLOCK_N, layout=tokens_layout)
        return gl.load(block_table_row + pos // PAGE_SIZE, mask=pos < split_end, other=0)

    @gluon.jit
    def _tile_entries(block_table_row, start, split_end, num_cache_blocks, BLOCK_N: gl.constexpr,
                      tokens_layout: gl.constexpr):
        """One-token pages whose entry -1 names no token (MASKED_ENTRIES: the sparse decode's index lists read
        as they are): whether an entry of the tile at `start` lies outside [-1, num_cache_blocks), and which
        of its positions name a token (the others' scores are masked; the loader read zeros for them)."""
        pages = _tile_pages(block_table_row, start, split_end, 1, BLOCK_N, tokens_layout)
        bad = gl.max(((pages < -1) | (pages >= num_cache_blocks)).to(gl.int32), 0) > 0
        return bad, pages != -1

    @gluon.jit
    def _ws_qk(q_smem, qpe_smem, k_stages, kpe_stages, ready, tile, K_STAGES: gl.constexpr,
               ROWS_AS_M: gl.constexpr, s_shape: gl.constexpr, s_layout: gl.constexpr, ROPE: gl.constexpr = True):
        """Wait until the stage holding `tile` is ready and issue its QK product (async; S, or S^T with the
        tokens as M): 16-bit stages, or raw FP8 stages with an e4m3 query on the FP8 tensor cores."""
        slot = tile % K_STAGES
        mbarrier.wait(ready.index(slot), (tile // K_STAGES) & 1)
        # cp.async wrote the tile through the generic proxy; the tensor cores read it through the async one
        fence_async_shared()
        s = gl.zeros(s_shape, gl.float32, layout=s_layout)
        if ROWS_AS_M:
            s = warpgroup_mma(q_smem, k_stages.index(slot).permute((1, 0)), s, use_acc=False, is_async=True)
            if ROPE:
                s = warpgroup_mma(qpe_smem, kpe_stages.index(slot).permute((1, 0)), s, is_async=True)
        else:
            s = warpgroup_mma(k_stages.index(slot), q_smem.permute((1, 0)), s, use_acc=False, is_async=True)
            if ROPE:
                s = warpgroup_mma(kpe_stages.index(slot), qpe_smem.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _ws_softmax_pv(
        s, acc, m_i, l_i, start, split_end, s_rows, row_limit, qk_scale, tile, p_smem, row_smem, kv_smem,
        ready_bars, empty_bars, p_ready, p_empty, red_smem, Q_LEN: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, HALF_COLS: gl.constexpr, ROWS_AS_M: gl.constexpr, WAIT_READY: gl.constexpr,
        o_layout: gl.constexpr, rows_o: gl.constexpr, OWN_PV: gl.constexpr = True, FP8_P: gl.constexpr = False,
    ):
        """One tile's softmax on its scores `s`, P and the rescale to the second warpgroup, and (OWN_PV) P V
        for the first half of the columns (WAIT_READY: the float16 stage is waited for here, not before QK)."""
        slot = tile % STAGES
        dtype: gl.constexpr = p_smem.dtype
        if ROWS_AS_M:
            p, m_i, l_i, alpha = _online_softmax_rows(
                s, m_i, l_i, start, split_end, s_rows, row_limit, qk_scale, Q_LEN, BLOCK_N
            )
        else:
            p, m_i, l_i, alpha = _online_softmax(
                s, m_i, l_i, start, split_end, s_rows, row_limit, qk_scale, Q_LEN, BLOCK_N, True, red_smem, tile
            )
        if FP8_P:
            # e4m3 P [rows, tokens] (K-major for the FP8 MMA), scaled into e4m3's normal range
            p16 = gl.permute((p * FP8_P_SCALE).to(dtype), (1, 0))
        else:
            p16 = p.to(dtype)
        # the second warpgroup is done with the previous P and rescale
        mbarrier.wait(p_empty, (tile & 1) ^ 1)
        p_smem.store(p16)
        row_smem.store(alpha)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_ready, count=1)
        if OWN_PV:
            if WAIT_READY:
                mbarrier.wait(ready_bars.index(slot), (tile // STAGES) & 1)
                fence_async_shared()
            kv_tile = kv_smem.index(slot)
            if ROWS_AS_M:
                acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
                p_regs = gl.convert_layout(p16, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
                acc = warpgroup_mma(p_regs, kv_tile.slice(0, HALF_COLS, dim=1), acc, is_async=True)
            else:
                acc = acc * gl.convert_layout(alpha, rows_o)[None, :]
                acc = warpgroup_mma(kv_tile.slice(0, HALF_COLS, dim=1).permute((1, 0)), p_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _cta_barrier()
            mbarrier.arrive(empty_bars.index(slot), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _ws_softmax_partition(
        bufs, ptrs, scalars, strides,
        Q_LEN: gl.constexpr, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_K_SCALE: gl.constexpr,
        DIRECT_OUTPUT: gl.constexpr, ROWS_AS_M: gl.constexpr, RAW_STAGES: gl.constexpr,
        MASKED_ENTRIES: gl.constexpr = False, V4_PAGE: gl.constexpr = 0, QK_ROPE: gl.constexpr = True,
        Sink=None, HAS_SINK: gl.constexpr = False, QUERY_AT_ONCE: gl.constexpr = False,
    ):
        """QK, softmax, P and the rescale to the second warpgroup, PV for the first half of the columns.
        V4_PAGE > 0 (V4 rows, `_ws_load_v4`): QK of the 512 columns alone, the rotary stage unused; so too
        without QK_ROPE (a zero rotary query: the rotary stage's product skipped).
        HAS_SINK (one split writing the output): each row's 1 / sum times its head's sink factor
        (`_sink_factor`), which both warpgroups' outputs take; the LSE stored is the one without it.
        RAW_STAGES > 0: QK on the FP8 tensor cores from the raw stages, the query quantised per row.
        `_pv_whole`: no P V here; the second warpgroup computes all of it."""
        (q_smem, qpe_smem, p_smem, row_smem, kv_smem, kpe_smem, ready_bars, empty_bars, p_ready, p_empty,
         raw_kv, raw_pe, raw_ready, raw_empty, red_smem, q_done, ds_scales) = bufs
        Q_nope, Q_pe, KV_cache, Block_table, Seq_lens, K_scale, Attn_logits, Out, Lse, Error_flag = ptrs
        sm_scale, num_heads, num_kv_splits, max_seq_len, num_cache_blocks = scalars
        (stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h, stride_kv_block, stride_kv_token,
         stride_bt_b, stride_al_row, stride_al_h, stride_al_split, stride_o_b, stride_o_t, stride_o_h,
         stride_lse_b, stride_lse_t, stride_lse_h) = strides
        HALF_COLS: gl.constexpr = KV_LORA_RANK // 2
        head_block = gl.program_id(0)
        split = gl.program_id(1)
        batch = gl.program_id(2)
        FP8_QK: gl.constexpr = RAW_STAGES > 0
        PV_WHOLE: gl.constexpr = _pv_whole(ROWS_AS_M, BLOCK_H)
        FP8_PV: gl.constexpr = _fp8_pv(RAW_STAGES, STAGES)
        layouts: gl.constexpr = _ws_layouts(ROWS_AS_M, BLOCK_H, BLOCK_N, HALF_COLS, 32 if FP8_QK else 16)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        rows_s: gl.constexpr = layouts[2]
        tokens_s: gl.constexpr = layouts[3]
        rows_o: gl.constexpr = layouts[4]
        seq_len, bad_seq_len, split_start, split_end, num_tiles = _split_range(
            Seq_lens, batch, split, num_kv_splits, max_seq_len, BLOCK_N
        )
        first_row = head_block * BLOCK_H
        # an FP8 cache: float16 products (the tile converts to float16 in one instruction per pair),
        # the query scaled by a power of two, undone on the scores
        FP8: gl.constexpr = _scaled_query(KV_cache.dtype.element_ty)
        if FP8_QK:
            gl.static_assert(BLOCK_H <= BLOCK_N, "the query parks in a float16 stage")
            q_down = _load_query_e4m3(
                q_smem, qpe_smem, Q_nope, Q_pe, batch, first_row, num_heads,
                stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h,
                Q_LEN, BLOCK_H, KV_LORA_RANK, ROPE_DIM, 4, kv_smem.index(0).slice(0, BLOCK_H, dim=0),
            )
        else:
            q_down = _load_query(
                q_smem, qpe_smem, Q_nope, Q_pe, batch, first_row, num_heads,
                stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h,
                Q_LEN, BLOCK_H, KV_LORA_RANK, ROPE_DIM, 4, FP8, QUERY_AT_ONCE,
            )
        fence_async_shared()
        _cta_barrier()
        if _query_parked(RAW_STAGES, BLOCK_H, KV_LORA_RANK):
            mbarrier.arrive(q_done, count=1)
        qk_scale = sm_scale * 1.4426950408889634
        if HAS_K_SCALE:
            qk_scale = qk_scale * gl.load(K_scale).to(gl.float32)
        if FP8_QK:
            # one factor per query row, broadcast over the tile's tokens
            row_scale = gl.convert_layout(q_down, rows_s) * qk_scale
            if ROWS_AS_M:
                qk_scale = row_scale[:, None]
            else:
                qk_scale = row_scale[None, :]
        else:
            qk_scale = qk_scale * q_down
        s_rows = first_row + gl.arange(0, BLOCK_H, layout=rows_s)
        row_limit = seq_len - Q_LEN + 1 + s_rows // num_heads
        block_table_row = Block_table + batch * stride_bt_b

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=rows_s)
        if ROWS_AS_M:
            l_i = gl.zeros([BLOCK_H], gl.float32, layout=rows_s)
            acc = gl.zeros([BLOCK_H, HALF_COLS], gl.float32, layout=o_layout)
            s_shape: gl.constexpr = [BLOCK_H, BLOCK_N]
        else:
            # the tokens lie across the four warps: the sum stays per token until the end
            l_i = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)
            acc = gl.zeros([HALF_COLS, BLOCK_H], gl.float32, layout=o_layout)
            s_shape: gl.constexpr = [BLOCK_N, BLOCK_H]
        bad_block = batch < 0
        if FP8_QK:
            # QK reads the raw FP8 stages; P V the float16 stages the loader converts them into
            k_stages = raw_kv
            kpe_stages = raw_pe
            k_ready = raw_ready
            k_empty = raw_empty
            K_STAGES: gl.constexpr = RAW_STAGES
        else:
            k_stages = kv_smem
            kpe_stages = kpe_smem
            k_ready = ready_bars
            k_empty = empty_bars
            K_STAGES: gl.constexpr = STAGES
        # nothing hoisted out of the loop: the shared-memory descriptors of the
        # query's 36 wgmma k-steps would otherwise be held across it (spilled)
        for tile in tl.range(0, num_tiles, disable_licm=True):
            start = split_start + tile * BLOCK_N
            # the block-table entries the loader used, checked here too (the
            # loader read a bad one as block 0)
            if MASKED_ENTRIES:
                tile_bad, keep = _tile_entries(block_table_row, start, split_end, num_cache_blocks, BLOCK_N, tokens_s)
                bad_block = bad_block | tile_bad
            elif V4_PAGE == 0:  # (V4 index lists: checked by the loader, below)
                bad_block = bad_block | _tile_bad_block(
                    block_table_row, start, split_end, num_cache_blocks, PAGE_SIZE, BLOCK_N, tokens_s
                )
            s = _ws_qk(q_smem, qpe_smem, k_stages, kpe_stages, k_ready, tile, K_STAGES, ROWS_AS_M, s_shape, s_layout,
                       QK_ROPE and V4_PAGE == 0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if V4_PAGE > 0:
                # the V4 index lists: the entries the loader stored (`_ws_load_v4`); a bad one makes the token's
                # rows NaN, one that does not count is no score
                tile_entries = ds_scales.index(tile % (2 * K_STAGES)).load(tokens_s)
                keep = tile_entries >= 0
                bad_block = bad_block | (gl.min(tile_entries, 0) < -1)
            if MASKED_ENTRIES or V4_PAGE > 0:  # a -1 entry's score (of the zeros the loader wrote) is no score
                if ROWS_AS_M:
                    s = gl.where(keep[None, :], s, float("-inf"))
                else:
                    s = gl.where(keep[:, None], s, float("-inf"))
            if FP8_QK or PV_WHOLE:
                # QK is done with the stage (a raw one's other arrival is the loader's conversion; a 16-bit
                # one's the second warpgroup's P V)
                _cta_barrier()
                mbarrier.arrive(k_empty.index(tile % K_STAGES), count=1)
            acc, m_i, l_i = _ws_softmax_pv(
                s, acc, m_i, l_i, start, split_end, s_rows, row_limit, qk_scale, tile, p_smem, row_smem,
                kv_smem, ready_bars, empty_bars, p_ready, p_empty, red_smem, Q_LEN, BLOCK_N, STAGES, HALF_COLS,
                ROWS_AS_M, FP8_QK, o_layout, rows_o, not PV_WHOLE, FP8_PV,
            )

        gl.atomic_or(Error_flag, _SPARSE_INDEX_ERROR if (MASKED_ENTRIES or V4_PAGE > 0) else _BLOCK_INDEX_ERROR,
                     mask=bad_block)
        gl.atomic_or(Error_flag, _SEQ_RANGE_ERROR, mask=bad_seq_len)
        if not ROWS_AS_M:
            l_i = gl.sum(l_i, 0)
        inv_l, lse = _finish_rows(m_i, l_i, bad_block | bad_seq_len, K_scale, HAS_K_SCALE)
        if HAS_SINK:
            gl.static_assert(DIRECT_OUTPUT, "the sink of split partials is applied when they are merged")
            inv_l = inv_l * _sink_factor(Sink, lse, s_rows, num_heads, Q_LEN)
        # the second warpgroup's last rescale: 1 / sum per row (of the scaled P of an FP8 P V)
        mbarrier.wait(p_empty, (num_tiles & 1) ^ 1)
        if FP8_PV:
            row_smem.store(inv_l * (1.0 / FP8_P_SCALE))
        else:
            row_smem.store(inv_l)
        _cta_barrier()
        mbarrier.arrive(p_ready, count=1)
        if PV_WHOLE:
            _store_lse(
                lse, s_rows, batch, split, num_heads, Lse, Attn_logits, stride_lse_b, stride_lse_t, stride_lse_h,
                stride_al_row, stride_al_h, stride_al_split, Q_LEN, DIRECT_OUTPUT, KV_LORA_RANK,
            )
        else:
            _store_rows(
                acc, inv_l, lse, s_rows, batch, split, num_heads, Out, Lse, Attn_logits,
                stride_o_b, stride_o_t, stride_o_h, stride_lse_b, stride_lse_t, stride_lse_h,
                stride_al_row, stride_al_h, stride_al_split, Q_LEN, HALF_COLS, DIRECT_OUTPUT, 0, True,
                KV_LORA_RANK, ROWS_AS_M,
            )

    @gluon.jit
    def _ws_pv_partition(
        bufs, ptrs, scalars, strides,
        Q_LEN: gl.constexpr, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_K_SCALE: gl.constexpr,
        DIRECT_OUTPUT: gl.constexpr, ROWS_AS_M: gl.constexpr, RAW_STAGES: gl.constexpr,
    ):
        """PV for the second half of the latent columns (`_pv_whole`: all of them), from the first warpgroup's P
        and rescale."""
        (q_smem, qpe_smem, p_smem, row_smem, kv_smem, kpe_smem, ready_bars, empty_bars, p_ready, p_empty,
         raw_kv, raw_pe, raw_ready, raw_empty, red_smem, q_done, ds_scales) = bufs
        Q_nope, Q_pe, KV_cache, Block_table, Seq_lens, K_scale, Attn_logits, Out, Lse, Error_flag = ptrs
        sm_scale, num_heads, num_kv_splits, max_seq_len, num_cache_blocks = scalars
        (stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h, stride_kv_block, stride_kv_token,
         stride_bt_b, stride_al_row, stride_al_h, stride_al_split, stride_o_b, stride_o_t, stride_o_h,
         stride_lse_b, stride_lse_t, stride_lse_h) = strides
        PV_WHOLE: gl.constexpr = _pv_whole(ROWS_AS_M, BLOCK_H)
        FP8_PV: gl.constexpr = _fp8_pv(RAW_STAGES, STAGES)
        COLS: gl.constexpr = KV_LORA_RANK if PV_WHOLE else KV_LORA_RANK // 2
        FIRST_COL: gl.constexpr = KV_LORA_RANK - COLS
        head_block = gl.program_id(0)
        split = gl.program_id(1)
        batch = gl.program_id(2)
        layouts: gl.constexpr = _ws_layouts(ROWS_AS_M, BLOCK_H, BLOCK_N, COLS)
        o_layout: gl.constexpr = layouts[1]
        rows_o: gl.constexpr = layouts[4]
        seq_len, bad_seq_len, split_start, split_end, num_tiles = _split_range(
            Seq_lens, batch, split, num_kv_splits, max_seq_len, BLOCK_N
        )
        if FP8_PV:
            o_lo, o_hi, inv_l = _ws_fp8_pv_partition(
                raw_kv, raw_ready, raw_empty, p_smem, row_smem, p_ready, p_empty, num_tiles, BLOCK_H, BLOCK_N,
                RAW_STAGES,
            )
            s_rows = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, o_lo.type.layout))
            _store_rows(
                o_lo, inv_l, inv_l, s_rows, batch, split, num_heads, Out, Lse, Attn_logits,
                stride_o_b, stride_o_t, stride_o_h, stride_lse_b, stride_lse_t, stride_lse_h,
                stride_al_row, stride_al_h, stride_al_split, Q_LEN, 256, DIRECT_OUTPUT, 0, False, 0,
            )
            _store_rows(
                o_hi, inv_l, inv_l, s_rows, batch, split, num_heads, Out, Lse, Attn_logits,
                stride_o_b, stride_o_t, stride_o_h, stride_lse_b, stride_lse_t, stride_lse_h,
                stride_al_row, stride_al_h, stride_al_split, Q_LEN, 256, DIRECT_OUTPUT, 256, False, 0,
            )
        else:
            if ROWS_AS_M:
                acc = gl.zeros([BLOCK_H, COLS], gl.float32, layout=o_layout)
            else:
                acc = gl.zeros([COLS, BLOCK_H], gl.float32, layout=o_layout)
            for tile in tl.range(0, num_tiles, disable_licm=True):
                slot = tile % STAGES
                mbarrier.wait(ready_bars.index(slot), (tile // STAGES) & 1)
                mbarrier.wait(p_ready, tile & 1)
                fence_async_shared()
                v_tile = kv_smem.index(slot).slice(FIRST_COL, COLS, dim=1)
                if ROWS_AS_M:
                    acc = acc * row_smem.load(rows_o)[:, None]
                    acc = warpgroup_mma(p_smem, v_tile, acc, is_async=True)
                else:
                    acc = acc * row_smem.load(rows_o)[None, :]
                    acc = warpgroup_mma(v_tile.permute((1, 0)), p_smem, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _cta_barrier()
                mbarrier.arrive(p_empty, count=1)
                mbarrier.arrive(empty_bars.index(slot), count=1)
            inv_l = _last_rescale(row_smem, p_ready, p_empty, num_tiles, rows_o)
            s_rows = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=rows_o)
            _store_rows(
                acc, inv_l, inv_l, s_rows, batch, split, num_heads, Out, Lse, Attn_logits,
                stride_o_b, stride_o_t, stride_o_h, stride_lse_b, stride_lse_t, stride_lse_h,
                stride_al_row, stride_al_h, stride_al_split, Q_LEN, COLS, DIRECT_OUTPUT, FIRST_COL, False, 0,
                ROWS_AS_M,
            )

    @gluon.jit
    def _e4m3_words_to_f16(words):
        """int32 words of four e4m3 bytes -> int32 words of two float16 (the first and second byte pair of
        each word, in memory order): two conversions a word, nothing unpacked to single bytes."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
        )

    @gluon.jit
    def _as_words_reinterpret(desc, shape: gl.constexpr, layout: gl.constexpr):
        return desc.reinterpret(gl.int32, shape, layout)

    @gluon.jit
    def _as_words_private(desc, shape: gl.constexpr, layout: gl.constexpr):
        return desc._reinterpret(gl.int32, shape, layout)

    # a 16-bit shared tile viewed as int32 words (the method's name before Triton 3.7: _reinterpret)
    _as_words = _as_words_reinterpret if hasattr(gl.shared_memory_descriptor, "reinterpret") else _as_words_private

    @gluon.jit
    def _fp8_piece_load(
        src, page, PIECE: gl.constexpr, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr, kv_layout: gl.constexpr, pe_layout: gl.constexpr, FIRST: gl.constexpr,
    ):
        """Rows [FIRST, FIRST + PIECE) of the FP8 tile at `tile_start` as int32 words (zero past split_end):
        the latent part [PIECE, KV_LORA_RANK / 4] and the rotary part [PIECE, ROPE_DIM / 4].
        src: (the cache as int32 words, tile start, split end, block-table row, blocks, block and token strides)."""
        KV_words, tile_start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token = src
        rows, valid, bad = _tile_rows(
            tile_start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
            PAGE_SIZE, BLOCK_N, gl.SliceLayout(1, kv_layout), FIRST, PIECE,
        )
        cols = gl.arange(0, KV_LORA_RANK // 4, layout=gl.SliceLayout(0, kv_layout))
        kv = gl.load(KV_words + (rows >> 2)[:, None] + cols[None, :], mask=valid[:, None], other=0)
        # the same rows in the rotary part's layout (which spreads each row over the same threads)
        rows_pe = gl.convert_layout(rows, gl.SliceLayout(1, pe_layout))
        valid_pe = gl.convert_layout(valid, gl.SliceLayout(1, pe_layout))
        cols_pe = KV_LORA_RANK // 4 + gl.arange(0, ROPE_DIM // 4, layout=gl.SliceLayout(0, pe_layout))
        pe = gl.load(KV_words + (rows_pe >> 2)[:, None] + cols_pe[None, :], mask=valid_pe[:, None], other=0)
        return kv, pe

    @gluon.jit
    def _store_e4m3_words(dst_words, words, FIRST: gl.constexpr, PIECE: gl.constexpr):
        """Convert [PIECE, W] words of e4m3 bytes to float16 pairs and store them at rows
        [FIRST, FIRST + PIECE) of a float16 tile's word view [rows, 2 W]."""
        lo, hi = _e4m3_words_to_f16(words)
        dst_words.slice(FIRST, PIECE, dim=0).store(gl.reshape(gl.join(lo, hi), [PIECE, 2 * words.shape[1]]))

    @gluon.jit
    def _fp8_piece_store(kv_words, pe_words, kv, pe, FIRST: gl.constexpr, PIECE: gl.constexpr):
        """Convert a piece's words to float16 pairs and store them at rows [FIRST, FIRST + PIECE) of the
        stage's word views."""
        _store_e4m3_words(kv_words, kv, FIRST, PIECE)
        _store_e4m3_words(pe_words, pe, FIRST, PIECE)

    @gluon.jit
    def _ws_load_fp8(
        kv_smem, kpe_smem, ready_bars, empty_bars, KV_cache, block_table_row, split_start, split_end, num_tiles,
        num_cache_blocks, stride_kv_block, stride_kv_token,
        KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """FP8 tiles through the loader's registers, three quarters of a tile ahead: the tile goes in 16-row
        quarters, and quarter k + 3 is loaded before quarter k is converted and stored, so the loads are in
        flight during the stores and the wait for a free stage (quarters are int32 words of four e4m3
        bytes: a byte array carried across the loop is held one byte a register).  Three quarters ahead
        keep a tile's worth of registers, as loading whole tiles did.  Needs 4-byte aligned cache rows."""
        gl.static_assert(BLOCK_N == 64, "the FP8 loader takes 64-token tiles in four 16-row quarters")
        gl.static_assert(KV_cache.dtype.element_ty == gl.float8e4nv, "the FP8 loader converts e4m3fn bytes")
        PIECE: gl.constexpr = 16
        # two words (8 FP8 bytes) a thread, four words (16 bytes) once converted: the 8 threads of a quarter
        # warp store 8 different 16-byte chunks of a swizzled row (no bank conflicts)
        kv_layout: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [WS_LOAD_WARPS, 1], [1, 0])
        # the rotary part one word a thread on the same threads per row (its row offsets are the latent part's)
        pe_layout: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [WS_LOAD_WARPS, 1], [1, 0])
        words_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        KV_words = KV_cache.to(gl.pointer_type(gl.int32), bitcast=True)
        page = _tile_page(block_table_row, split_start, split_end, PAGE_SIZE, BLOCK_N)
        src = (KV_words, split_start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token)
        kv0, pe0 = _fp8_piece_load(
            src, page, PIECE, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, kv_layout, pe_layout, 0
        )
        kv1, pe1 = _fp8_piece_load(
            src, page, PIECE, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, kv_layout, pe_layout, 16
        )
        kv2, pe2 = _fp8_piece_load(
            src, page, PIECE, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, kv_layout, pe_layout, 32
        )
        next_page = _tile_page(block_table_row, split_start + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
        for tile in range(num_tiles):
            slot = tile % STAGES
            start = split_start + tile * BLOCK_N
            src = (KV_words, start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token)
            nxt = (KV_words, start + BLOCK_N, split_end, block_table_row, num_cache_blocks, stride_kv_block,
                   stride_kv_token)
            after_next = _tile_page(block_table_row, start + 2 * BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
            kv_words = _as_words(kv_smem.index(slot), [BLOCK_N, KV_LORA_RANK // 2], words_layout)
            pe_words = _as_words(kpe_smem.index(slot), [BLOCK_N, ROPE_DIM // 2], words_layout)
            kv3, pe3 = _fp8_piece_load(
                src, page, PIECE, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, kv_layout, pe_layout, 48
            )
            mbarrier.wait(empty_bars.index(slot), ((tile // STAGES) & 1) ^ 1)
            _fp8_piece_store(kv_words, pe_words, kv0, pe0, 0, PIECE)
            kv0, pe0 = _fp8_piece_load(
                nxt, next_page, PIECE, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, kv_layout, pe_layout, 0
            )
            _fp8_piece_store(kv_words, pe_words, kv1, pe1, 16, PIECE)
            kv1, pe1 = _fp8_piece_load(
                nxt, next_page, PIECE, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, kv_layout, pe_layout, 16
            )
            _fp8_piece_store(kv_words, pe_words, kv2, pe2, 32, PIECE)
            kv2, pe2 = _fp8_piece_load(
                nxt, next_page, PIECE, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, kv_layout, pe_layout, 32
            )
            _fp8_piece_store(kv_words, pe_words, kv3, pe3, 48, PIECE)
            # generic-proxy stores, read next by the tensor cores
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(ready_bars.index(slot), count=1)
            page = next_page
            next_page = after_next

    # e4m3 bytes times a bfloat16 scale, four values a word, two conversions a word: e4m3 pairs -> float16
    # pairs (exact), each float16 made the bfloat16 of 2^-112 times its value by moving its bits (sign
    # kept, exponent and mantissa shifted right by 3: exact, e4m3 values being normal float16 numbers),
    # then multiplied by 2^112 (exact) and by the pair of bfloat16 scales ($3: the scale rounded to
    # bfloat16, as FlashMLA applies it), rounded once; results in memory order.  (The float32 route takes
    # eight conversions a word; on an H100 the two measured the same, the loader's limit being latency.)
    _DS_SCALED_BF16 = gl.constexpr(
        "{ .reg .b16 lo, hi; .reg .b32 a, b, t, u, k; "
        "mov.b32 k, 0x77807780; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
        "shr.b32 t, a, 3; and.b32 t, t, 0x0FFF0FFF; and.b32 u, a, 0x80008000; or.b32 t, t, u; "
        "mul.rn.bf16x2 t, t, k; mul.rn.bf16x2 $0, t, $3; "
        "shr.b32 t, b, 3; and.b32 t, t, 0x0FFF0FFF; and.b32 u, b, 0x80008000; or.b32 t, t, u; "
        "mul.rn.bf16x2 t, t, k; mul.rn.bf16x2 $1, t, $3; }"
    )
    # the same product with no conversion instruction (the V4 loader's): each byte's sign put at a bfloat16's
    # bit 15 and its exponent and mantissa bits at bits 10..4 (`prmt` pairs each byte with its sign byte, a
    # shift, a mask) make the bfloat16 of 2^-120 times the e4m3 value (exactly, subnormals included: an e4m3
    # subnormal lands on a bfloat16 subnormal, which `mul.bf16x2` keeps), then multiplied by 2^120 (exact) and
    # by the scale pair, rounded once. The two NaN codes (0x7F, 0xFF), which no writer of the package or of
    # FlashMLA produces, read as +480 and -480 times the scale. Five instructions an output word where the
    # route above takes seven, two of them conversions: 4 % off DeepSeek-V4's 128-head decode on an H200
    # (1-4 % at every V4 row); in the fp8_ds_mla loader 6 % off from 64 tokens at 128 heads but 3 % on at 32
    # tokens and at 64 heads, so that loader keeps the route above.
    _BITS_SCALED_BF16 = gl.constexpr(
        "{ .reg .b32 t, k; mov.b32 k, 0x7B807B80; "
        "prmt.b32 t, $2, 0, 0x9180; shl.b32 t, t, 4; and.b32 t, t, 0x87F087F0; "
        "mul.rn.bf16x2 t, t, k; mul.rn.bf16x2 $0, t, $3; "
        "prmt.b32 t, $2, 0, 0xB3A2; shl.b32 t, t, 4; and.b32 t, t, 0x87F087F0; "
        "mul.rn.bf16x2 t, t, k; mul.rn.bf16x2 $1, t, $3; }"
    )

    @gluon.jit
    def _e4m3_words_scaled(words, scales, BY_BITS: gl.constexpr = False):
        """int32 words of four e4m3 bytes times their scales (int32 words of the scale as a bfloat16
        pair) -> int32 words of two bfloat16 in memory order (BY_BITS: `_BITS_SCALED_BF16`'s way)."""
        return gl.inline_asm_elementwise(
            _BITS_SCALED_BF16 if BY_BITS else _DS_SCALED_BF16, "=r,=r,r,r", [words, scales],
            dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
        )

    @gluon.jit
    def _bf16_pair(scale):
        """float32 values -> int32 words holding each value twice as bfloat16 (rounded to nearest)."""
        bits = scale.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return bits | (bits << 16)

    @gluon.jit
    def _ds_entries(block_table_row, start, split_end, FIRST: gl.constexpr, PIECE: gl.constexpr,
                    PAGE_SIZE: gl.constexpr, layout: gl.constexpr):
        """The block-table entries of tile positions [start + FIRST, start + FIRST + PIECE) (0 past
        split_end), loaded a tile before their rows are (pages of a multiple of 64 tokens: one entry a
        64-token tile, which needs no register of its own a row)."""
        if PAGE_SIZE % 64 == 0:
            # a 64-token tile (its start a multiple of 64) lies in one page: one entry, loaded as a scalar
            entry = gl.load(block_table_row + start // PAGE_SIZE, mask=start < split_end, other=0)
            return gl.full([PIECE], 0, gl.int32, layout=gl.SliceLayout(1, layout)) + entry
        pos = start + FIRST + gl.arange(0, PIECE, layout=gl.SliceLayout(1, layout))
        return gl.load(block_table_row + pos // PAGE_SIZE, mask=pos < split_end, other=0)

    @gluon.jit
    def _ds_rows(entries, start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token,
                 FIRST: gl.constexpr, PIECE: gl.constexpr, PAGE_SIZE: gl.constexpr, layout: gl.constexpr,
                 MASKED: gl.constexpr = False):
        """Word offsets of the cache rows of tile positions [start + FIRST, start + FIRST + PIECE) and their
        validity; an entry outside [0, num_cache_blocks) reads block 0 (the softmax partition flags it), or,
        MASKED (the index lists themselves, where an entry -1 is no token), nothing: its row is zeros."""
        pos = start + FIRST + gl.arange(0, PIECE, layout=gl.SliceLayout(1, layout))
        outside = (entries < 0) | (entries >= num_cache_blocks)
        block = gl.where(outside, 0, entries).to(gl.int64)
        rows = block * stride_kv_block + (pos % PAGE_SIZE).to(gl.int64) * stride_kv_token
        valid = pos < split_end
        if MASKED:
            valid = valid & ~outside
        return rows >> 2, valid

    @gluon.jit
    def _ds_piece_load(KV_words, words, valid, layout: gl.constexpr):
        """A piece of fp8_ds_mla rows (`_ds_rows`; zeros where not valid): the latent part's four 128-value
        groups as int32 words [PIECE, 32] each."""
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
        at = KV_words + words[:, None] + cols[None, :]
        mask = valid[:, None]
        k0 = gl.load(at, mask=mask, other=0)
        k1 = gl.load(at + 32, mask=mask, other=0)
        k2 = gl.load(at + 64, mask=mask, other=0)
        k3 = gl.load(at + 96, mask=mask, other=0)
        return k0, k1, k2, k3

    # the scale copies' layouts (the one that spills in no instance of Triton 3.6 and 3.9): a row a thread,
    # 64 rows over the loader's 128 threads (twice), four copies of 4 bytes (the heads as M); or [64 rows,
    # 4 scales], two scales a thread, no copy made twice (the cache tokens as M)
    _DS_SCALE_ROWS = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [WS_LOAD_WARPS, 1], [1, 0]))
    _DS_SCALE_PAIRS = gl.constexpr(gl.BlockedLayout([1, 2], [16, 2], [WS_LOAD_WARPS, 1], [1, 0]))

    @gluon.constexpr_function
    def _ds_scale_layout(rows_as_m):
        return _DS_SCALE_ROWS if rows_as_m else _DS_SCALE_PAIRS

    @gluon.jit
    def _ds_scale_entries(block_table_row, start, split_end, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                          ROWS_AS_M: gl.constexpr):
        """The block-table entries of the tile at `start` in the scale copies' layout, loaded a tile before
        the scales they name (`_ds_scale_copy` then waits on no load to address its own)."""
        return _ds_entries(block_table_row, start, split_end, 0, BLOCK_N, PAGE_SIZE, _ds_scale_layout(ROWS_AS_M))

    @gluon.jit
    def _ds_scale_copy(ds_scales, KV_words, entries, start, split_end, num_cache_blocks, stride_kv_block,
                       stride_kv_token, KV_LORA_RANK: gl.constexpr, PAGE_SIZE: gl.constexpr,
                       BLOCK_N: gl.constexpr, ROWS_AS_M: gl.constexpr, MASKED: gl.constexpr = False):
        """The four float32 scales of each row of the tile at `start` (its entries from `_ds_scale_entries`)
        copied by cp.async into a shared buffer [4 x BLOCK_N] (group-major; zeros past split_end), one
        committed group: they take no registers while in flight."""
        layout: gl.constexpr = _ds_scale_layout(ROWS_AS_M)
        words, valid = _ds_rows(entries, start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 0,
                                BLOCK_N, PAGE_SIZE, layout, MASKED)
        if not ROWS_AS_M:
            group = gl.arange(0, 4, layout=gl.SliceLayout(0, layout))
            at = KV_words + (words + KV_LORA_RANK // 4)[:, None] + group[None, :]
            groups = _as_words(ds_scales, [4, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            _async_load(groups.permute([1, 0]), at, mask=valid[:, None])
        else:
            at = KV_words + words + KV_LORA_RANK // 4
            _async_load(ds_scales.slice(0, BLOCK_N), at, mask=valid)
            _async_load(ds_scales.slice(BLOCK_N, BLOCK_N), at + 1, mask=valid)
            _async_load(ds_scales.slice(2 * BLOCK_N, BLOCK_N), at + 2, mask=valid)
            _async_load(ds_scales.slice(3 * BLOCK_N, BLOCK_N), at + 3, mask=valid)
        async_copy.commit_group()

    @gluon.jit
    def _ds_group_pairs(ds_scales, FIRST: gl.constexpr, GROUP: gl.constexpr, PIECE: gl.constexpr,
                        layout: gl.constexpr):
        """The scales of rows [FIRST, FIRST + PIECE), 128-value group GROUP, from the shared buffer, as
        bfloat16 pairs."""
        BLOCK_N: gl.constexpr = ds_scales.shape[0] // 4
        bits = ds_scales.slice(GROUP * BLOCK_N + FIRST, PIECE).load(gl.SliceLayout(1, layout))
        return _bf16_pair(bits.to(gl.float32, bitcast=True))

    @gluon.jit
    def _ds_group_store(dst_rows, words, pairs, GROUP: gl.constexpr):
        """One 128-value group [PIECE, 32 words] dequantised with its scale pairs into bfloat16 columns
        [128 GROUP, 128 GROUP + 128) of a stage's rows (its word view)."""
        lo, hi = _e4m3_words_scaled(words, gl.broadcast(pairs[:, None], words)[0])
        dst_rows.slice(GROUP * 64, 64, dim=1).store(gl.reshape(gl.join(lo, hi), [words.shape[0], 64]))

    @gluon.jit
    def _ds_piece_store(kv_words, ds_scales, k0, k1, k2, k3, FIRST: gl.constexpr, PIECE: gl.constexpr):
        """A piece's latent groups dequantised into rows [FIRST, FIRST + PIECE) of the stage's word view
        (the four groups' scales read first: a shared load after the stage's stores would wait for them)."""
        layout: gl.constexpr = k0.type.layout
        p0 = _ds_group_pairs(ds_scales, FIRST, 0, PIECE, layout)
        p1 = _ds_group_pairs(ds_scales, FIRST, 1, PIECE, layout)
        p2 = _ds_group_pairs(ds_scales, FIRST, 2, PIECE, layout)
        p3 = _ds_group_pairs(ds_scales, FIRST, 3, PIECE, layout)
        rows = kv_words.slice(FIRST, PIECE, dim=0)
        _ds_group_store(rows, k0, p0, 0)
        _ds_group_store(rows, k1, p1, 1)
        _ds_group_store(rows, k2, p2, 2)
        _ds_group_store(rows, k3, p3, 3)

    @gluon.jit
    def _ds_rope_copy(pe_words, KV_words, words, valid, FIRST: gl.constexpr, PIECE: gl.constexpr,
                      KV_LORA_RANK: gl.constexpr, layout: gl.constexpr):
        """A piece's bfloat16 rotary values (after the latent bytes and the four scales) copied by cp.async
        as they are into rows [FIRST, FIRST + PIECE) of the stage's word view (zeros where not valid)."""
        cols = KV_LORA_RANK // 4 + KV_LORA_RANK // 128 + gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
        _async_load(pe_words.slice(FIRST, PIECE, dim=0), KV_words + words[:, None] + cols[None, :],
                    mask=valid[:, None])

    @gluon.jit
    def _ws_load_ds_mla(
        kv_smem, kpe_smem, ds_scales, ready_bars, empty_bars, KV_cache, block_table_row, split_start, split_end,
        num_tiles, num_cache_blocks, stride_kv_block, stride_kv_token,
        KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, MASKED: gl.constexpr = False, ROWS_AS_M: gl.constexpr = True,
    ):
        """fp8_ds_mla tiles (656-byte rows: 512 e4m3 latent values, four float32 scales, one per 128 values,
        64 bfloat16 rotary values) into the bfloat16 stages both products read.  The latent part is
        dequantised once per element through the loader's registers, in 16-row quarters three ahead of the
        one stored, as `_ws_load_fp8` does; the scales go a tile ahead by cp.async into two shared buffers
        (float32, read as bfloat16 pairs as a quarter is stored), which leaves the registers to the latent
        bytes; the rotary part is copied by cp.async as it is.  The block-table entries are loaded a tile ahead
        of the rows they name (those of the scales two tiles ahead), so that no load of the cache waits on one
        (with one-token pages, as the sparse decode reads, every row has its own).  ROWS_AS_M picks the scale
        copies' layout (`_ds_scale_layout`).  Needs 4-byte aligned rows and a bfloat16 query."""
        gl.static_assert(BLOCK_N == 64, "the fp8_ds_mla loader takes 64-token tiles in four 16-row quarters")
        gl.static_assert(KV_LORA_RANK == 512 and ROPE_DIM == 64, "fp8_ds_mla rows hold 512 latent and 64 rotary values")
        gl.static_assert(kv_smem.dtype == gl.bfloat16, "fp8_ds_mla is read with a bfloat16 query")
        P: gl.constexpr = 16
        # a row a thread, four words (16 bytes) of each 128-value group: 8 threads a group of a row
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WS_LOAD_WARPS, 1], [1, 0])
        words_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        KV_words = KV_cache.to(gl.pointer_type(gl.int32), bitcast=True)
        se = _ds_scale_entries(block_table_row, split_start, split_end, PAGE_SIZE, BLOCK_N, ROWS_AS_M)
        _ds_scale_copy(ds_scales.index(0), KV_words, se, split_start, split_end, num_cache_blocks,
                       stride_kv_block, stride_kv_token, KV_LORA_RANK, PAGE_SIZE, BLOCK_N, ROWS_AS_M, MASKED)
        se = _ds_scale_entries(block_table_row, split_start + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N, ROWS_AS_M)
        e0 = _ds_entries(block_table_row, split_start, split_end, 0, P, PAGE_SIZE, layout)
        e1 = _ds_entries(block_table_row, split_start, split_end, 16, P, PAGE_SIZE, layout)
        e2 = _ds_entries(block_table_row, split_start, split_end, 32, P, PAGE_SIZE, layout)
        e3 = _ds_entries(block_table_row, split_start, split_end, 48, P, PAGE_SIZE, layout)
        w0, v0 = _ds_rows(e0, split_start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 0, P,
                          PAGE_SIZE, layout, MASKED)
        a0, a1, a2, a3 = _ds_piece_load(KV_words, w0, v0, layout)
        w1, v1 = _ds_rows(e1, split_start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 16, P,
                          PAGE_SIZE, layout, MASKED)
        b0, b1, b2, b3 = _ds_piece_load(KV_words, w1, v1, layout)
        w2, v2 = _ds_rows(e2, split_start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 32, P,
                          PAGE_SIZE, layout, MASKED)
        c0, c1, c2, c3 = _ds_piece_load(KV_words, w2, v2, layout)
        # the first tile's scales, read by every loader thread
        async_copy.wait_group(0)
        _cta_barrier()
        for tile in range(num_tiles):
            slot = tile % STAGES
            start = split_start + tile * BLOCK_N
            nxt = start + BLOCK_N
            # the next tile's entries and scales, in flight during this one (the scales by cp.async)
            n0 = _ds_entries(block_table_row, nxt, split_end, 0, P, PAGE_SIZE, layout)
            n1 = _ds_entries(block_table_row, nxt, split_end, 16, P, PAGE_SIZE, layout)
            n2 = _ds_entries(block_table_row, nxt, split_end, 32, P, PAGE_SIZE, layout)
            n3 = _ds_entries(block_table_row, nxt, split_end, 48, P, PAGE_SIZE, layout)
            _ds_scale_copy(ds_scales.index((tile + 1) % 2), KV_words, se, nxt, split_end, num_cache_blocks,
                           stride_kv_block, stride_kv_token, KV_LORA_RANK, PAGE_SIZE, BLOCK_N, ROWS_AS_M, MASKED)
            # (the stage's arrival below counts these copies too, issued just before its rotary copies)
            # the entries of the tile after: its scales' addresses in the next iteration wait on no load
            se = _ds_scale_entries(block_table_row, nxt + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N, ROWS_AS_M)
            kv_words = _as_words(kv_smem.index(slot), [BLOCK_N, KV_LORA_RANK // 2], words_layout)
            pe_words = _as_words(kpe_smem.index(slot), [BLOCK_N, ROPE_DIM // 2], words_layout)
            scales = ds_scales.index(tile % 2)
            w3, v3 = _ds_rows(e3, start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 48, P,
                              PAGE_SIZE, layout, MASKED)
            d0, d1, d2, d3 = _ds_piece_load(KV_words, w3, v3, layout)
            mbarrier.wait(empty_bars.index(slot), ((tile // STAGES) & 1) ^ 1)
            w0, v0 = _ds_rows(e0, start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 0, P,
                              PAGE_SIZE, layout, MASKED)
            _ds_rope_copy(pe_words, KV_words, w0, v0, 0, P, KV_LORA_RANK, layout)
            w1, v1 = _ds_rows(e1, start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 16, P,
                              PAGE_SIZE, layout, MASKED)
            _ds_rope_copy(pe_words, KV_words, w1, v1, 16, P, KV_LORA_RANK, layout)
            w2, v2 = _ds_rows(e2, start, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 32, P,
                              PAGE_SIZE, layout, MASKED)
            _ds_rope_copy(pe_words, KV_words, w2, v2, 32, P, KV_LORA_RANK, layout)
            _ds_rope_copy(pe_words, KV_words, w3, v3, 48, P, KV_LORA_RANK, layout)
            # the stage turns ready when the rotary copies have landed too
            async_copy.mbarrier_arrive(ready_bars.index(slot))
            _ds_piece_store(kv_words, scales, a0, a1, a2, a3, 0, P)
            w0, v0 = _ds_rows(n0, nxt, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 0, P,
                              PAGE_SIZE, layout, MASKED)
            a0, a1, a2, a3 = _ds_piece_load(KV_words, w0, v0, layout)
            _ds_piece_store(kv_words, scales, b0, b1, b2, b3, 16, P)
            w1, v1 = _ds_rows(n1, nxt, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 16, P,
                              PAGE_SIZE, layout, MASKED)
            b0, b1, b2, b3 = _ds_piece_load(KV_words, w1, v1, layout)
            _ds_piece_store(kv_words, scales, c0, c1, c2, c3, 32, P)
            w2, v2 = _ds_rows(n2, nxt, split_end, num_cache_blocks, stride_kv_block, stride_kv_token, 32, P,
                              PAGE_SIZE, layout, MASKED)
            c0, c1, c2, c3 = _ds_piece_load(KV_words, w2, v2, layout)
            _ds_piece_store(kv_words, scales, d0, d1, d2, d3, 48, P)
            e0 = n0
            e1 = n1
            e2 = n2
            e3 = n3
            # the next tile's scales (their group, committed at this tile's start) landed before the barrier
            async_copy.wait_group(0)
            # generic-proxy stores, read next by the tensor cores
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(ready_bars.index(slot), count=1)

    # the fp8_ds_mla_v4 layout (`mla_multi.cache_formats`): a token's data (its e4m3 latent values, then its
    # bfloat16 RoPE values) at offset * V4_DATA_BYTES in its block, its scale bytes at block_size * V4_DATA_BYTES
    # + offset * V4_SCALE_BYTES, one UE8M0 scale per 64 values
    _V4_DATA_BYTES = gl.constexpr(_V4_FORMAT.data_bytes)
    _V4_SCALE_BYTES = gl.constexpr(_V4_FORMAT.scale_bytes)
    _V4_LATENT_WORDS = gl.constexpr((_V4_FORMAT.width - _V4_FORMAT.rope_dims) // 4)
    _V4_GROUP_VALUES = gl.constexpr(_V4_FORMAT.values_per_scale)

    # DeepSeek-V4 rows (fp8_ds_mla_v4, 584 bytes a token) read in place: a 16-row piece as int32 words, two
    # words (8 bytes) a thread, [16, 16] words (one 64-value scale group of 16 rows) covered once (measured on
    # an H200: 7-8 % faster than 32-row pieces of 16 bytes a thread)
    _V4_PIECE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [2, 2], [1, 0]))
    # [16, 32] words (two groups of 16 rows, the rotary part), four words (16 bytes) a thread
    _V4_WIDE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [2, 2], [1, 0]))

    @gluon.jit
    def _v4_list_args(v4_lists, batch, max_seq_len, num_cache_blocks):
        """The V4 index lists (read as they are, `_v4_list_entries`): this token's row of the second list
        (less the first list's width, so that a list position addresses it), the first list's width, where
        the entries that count end in each list (topk_length clamped to [0, width]: list positions) and the
        caches' slot counts. v4_lists: (Extra_table, stride_extra_t, the first list's width, Topk_length,
        Extra_topk_length, extra_first_slot); max_seq_len is both lists' width."""
        Extra_table, stride_extra_t, topk, Topk_length, Extra_topk_length, first_extra_slot = v4_lists
        main_end = gl.minimum(gl.maximum(gl.load(Topk_length + batch), 0), topk)
        extra_end = topk + gl.minimum(gl.maximum(gl.load(Extra_topk_length + batch), 0), max_seq_len - topk)
        return (Extra_table + (batch.to(gl.int64) * stride_extra_t - topk), topk, main_end, extra_end,
                first_extra_slot, num_cache_blocks - first_extra_slot)

    @gluon.jit
    def _v4_list_entries(main_row, lists, pos, split_end):
        """The V4 index lists read as they are at list positions `pos` (those past the first list's width are the
        second list's): the slot each names where it counts; -2 where it is bad (outside [-1, its cache's
        slots), wherever it lies in the list); else -1 (-1 itself, past its topk_length or past split_end)."""
        extra_row, topk, main_end, extra_end, first_extra_slot, extra_slots = lists
        in_main = pos < topk
        # one load a position, from the list it lies in
        entry = gl.load(gl.where(in_main, main_row, extra_row) + pos, mask=pos < split_end, other=-1)
        bad = (entry < -1) | (entry >= gl.where(in_main, first_extra_slot, extra_slots))
        counts = (pos < gl.where(in_main, main_end, extra_end)) & (entry >= 0) & ~bad
        return gl.where(counts, entry + gl.where(in_main, 0, first_extra_slot), gl.where(bad, -2, -1))

    @gluon.jit
    def _v4_entries(block_table_row, lists, start, split_end, FIRST: gl.constexpr, PIECE: gl.constexpr,
                    layout: gl.constexpr):
        """The slots of tile positions [start + FIRST, start + FIRST + PIECE) in the index lists
        (`_v4_list_entries`: -1 where none counts, -2 where bad)."""
        pos = start + FIRST + gl.arange(0, PIECE, layout=gl.SliceLayout(1, layout))
        return _v4_list_entries(block_table_row, lists, pos, split_end)

    @gluon.jit
    def _v4_rows(entries, KV_words, Extra_words, extra_first_slot, stride_kv_block, stride_extra_block,
                 V4_PAGE: gl.constexpr, SELECT_OFFSETS: gl.constexpr):
        """Word pointers of the data (576 bytes: 448 e4m3 values, 64 bfloat16 rotary values) and of the scales
        (8 bytes in the block's tail) of the rows `entries` name, and which to read. The entries (`_v4_list_entries`) are slots of both caches (those >= extra_first_slot the second
        cache's, less extra_first_slot), or negative (none counts there, or bad), which reads nothing: its row
        is zeros. A row starts on 16 bytes (the caches and their block strides do: `V4Pages`)."""
        valid = entries >= 0
        entries = gl.maximum(entries, 0)
        extra = entries >= extra_first_slot
        slot = gl.where(extra, entries - extra_first_slot, entries)
        block = (slot // V4_PAGE).to(gl.int64)
        offset = (slot % V4_PAGE).to(gl.int64)
        base = block * gl.where(extra, stride_extra_block, stride_kv_block).to(gl.int64)
        if SELECT_OFFSETS:
            # words from KV_words, the second cache's rows too (its distance from the first added): a select of
            # offsets, not of pointers, keeps the rows' 16-byte alignment visible to the compiler (from Triton
            # 3.9 the loads of a selected pointer are single words); two registers more a row
            distance = (Extra_words.to(gl.int64, bitcast=True) - KV_words.to(gl.int64, bitcast=True)) >> 2
            words = gl.where(extra, distance, 0)
            data = KV_words + gl.multiple_of(words + ((base + offset * _V4_DATA_BYTES) >> 2), 4)
            scales = KV_words + (words + ((base + V4_PAGE * _V4_DATA_BYTES + offset * _V4_SCALE_BYTES) >> 2))
        else:
            words = gl.where(extra, Extra_words, KV_words)
            data = words + gl.multiple_of((base + offset * _V4_DATA_BYTES) >> 2, 4)
            scales = words + ((base + V4_PAGE * _V4_DATA_BYTES + offset * _V4_SCALE_BYTES) >> 2)
        return data, scales, valid

    @gluon.constexpr_function
    def _v4_piece_layout(wide):
        """The layout of a V4 loader's rows and entries: `_V4_WIDE_LAYOUT`'s where its pieces are wide."""
        return _V4_WIDE_LAYOUT if wide else _V4_PIECE_LAYOUT

    @gluon.jit
    def _v4_row_words(data, valid, COLS: gl.constexpr, layout: gl.constexpr):
        """Pointers to the first COLS words of the rows starting at `data` [PIECE, COLS] in `layout`, and the
        mask of the `valid` rows."""
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        return data[:, None] + cols[None, :], valid[:, None]

    @gluon.jit
    def _v4_piece_load(data, scales, valid, layout: gl.constexpr):
        """A piece of V4 rows as int32 words (zeros where not valid): the seven 64-value latent groups [PIECE,
        16] each, the rotary part in two halves [PIECE, 16] and each row's two words of UE8M0 scale bytes
        [PIECE]."""
        at, mask = _v4_row_words(data, valid, 16, layout)
        g0 = gl.load(at, mask=mask, other=0)
        g1 = gl.load(at + 16, mask=mask, other=0)
        g2 = gl.load(at + 32, mask=mask, other=0)
        g3 = gl.load(at + 48, mask=mask, other=0)
        g4 = gl.load(at + 64, mask=mask, other=0)
        g5 = gl.load(at + 80, mask=mask, other=0)
        g6 = gl.load(at + 96, mask=mask, other=0)
        r0 = gl.load(at + _V4_LATENT_WORDS, mask=mask, other=0)
        r1 = gl.load(at + (_V4_LATENT_WORDS + 16), mask=mask, other=0)
        s0 = gl.load(scales, mask=valid, other=0)
        s1 = gl.load(scales + 1, mask=valid, other=0)
        return (g0, g1, g2, g3, g4, g5, g6, r0, r1, s0, s1)

    @gluon.jit
    def _v4_piece_load_wide(data, scales, valid, layout: gl.constexpr, narrow: gl.constexpr):
        """A piece of V4 rows as int32 words (zeros where not valid): latent groups 0-1, 2-3 and 4-5 [PIECE, 32]
        each and the rotary part [PIECE, 32] in `layout` (four words a thread), group 6 [PIECE, 16] in `narrow`
        (two words a thread), each row's two words of UE8M0 scale bytes [PIECE]."""
        at, mask = _v4_row_words(data, valid, 32, layout)
        g01 = gl.load(at, mask=mask, other=0)
        g23 = gl.load(at + 32, mask=mask, other=0)
        g45 = gl.load(at + 64, mask=mask, other=0)
        rope = gl.load(at + _V4_LATENT_WORDS, mask=mask, other=0)
        # (the same rows in `narrow`: the layouts place rows alike, so the conversions move nothing)
        at6, mask6 = _v4_row_words(gl.convert_layout(data, gl.SliceLayout(1, narrow)),
                                   gl.convert_layout(valid, gl.SliceLayout(1, narrow)), 16, narrow)
        g6 = gl.load(at6 + 96, mask=mask6, other=0)
        s0 = gl.load(scales, mask=valid, other=0)
        s1 = gl.load(scales + 1, mask=valid, other=0)
        return (g01, g23, g45, g6, rope, s0, s1)

    @gluon.jit
    def _v4_quarter(entries, src, V4_PAGE: gl.constexpr, layout: gl.constexpr, narrow: gl.constexpr,
                    WIDE: gl.constexpr):
        """The rows a quarter's `entries` name loaded (`_v4_rows`; `_v4_piece_load_wide` where WIDE, else
        `_v4_piece_load`); src: (the two caches as int32 words, extra_first_slot, their block strides)."""
        KV_words, Extra_words, extra_first_slot, stride_kv_block, stride_extra_block = src
        data, scales, valid = _v4_rows(entries, KV_words, Extra_words, extra_first_slot, stride_kv_block,
                                       stride_extra_block, V4_PAGE, WIDE)
        if WIDE:
            piece = _v4_piece_load_wide(data, scales, valid, layout, narrow)
        else:
            piece = _v4_piece_load(data, scales, valid, narrow)
        return piece

    @gluon.jit
    def _v4_quarter_store(kv_words, piece, FIRST: gl.constexpr, PIECE: gl.constexpr, layout: gl.constexpr,
                          narrow: gl.constexpr, WIDE: gl.constexpr):
        """A quarter `_v4_quarter` loaded, stored (`_v4_piece_store_wide` or `_v4_piece_store`)."""
        if WIDE:
            _v4_piece_store_wide(kv_words, piece, FIRST, PIECE, layout, narrow)
        else:
            _v4_piece_store(kv_words, piece, FIRST, PIECE)

    @gluon.jit
    def _v4_group_store(rows, words, code, GROUP: gl.constexpr):
        """One 64-value group [PIECE, 16 words] times its UE8M0 scale (`code`'s low byte: 2^(code - 127), a
        bfloat16 whose exponent field is the byte) into bfloat16 columns [64 GROUP, 64 GROUP + 64) of a
        stage's rows (its word view)."""
        bits = (code & 0xFF) << 7
        pairs = bits | (bits << 16)
        lo, hi = _e4m3_words_scaled(words, gl.broadcast(pairs[:, None], words)[0], True)
        rows.slice(GROUP * 32, 32, dim=1).store(gl.reshape(gl.join(lo, hi), [words.shape[0], 32]))

    @gluon.jit
    def _v4_piece_store(kv_words, piece, FIRST: gl.constexpr, PIECE: gl.constexpr):
        """A piece's latent groups dequantised, and its rotary part as it is, into rows [FIRST, FIRST + PIECE)
        of the stage's word view: [448 latent | 64 rotary] bfloat16 values, the V4 row."""
        rows = kv_words.slice(FIRST, PIECE, dim=0)
        s0 = piece[9]
        s1 = piece[10]
        _v4_group_store(rows, piece[0], s0, 0)
        _v4_group_store(rows, piece[1], s0 >> 8, 1)
        _v4_group_store(rows, piece[2], s0 >> 16, 2)
        _v4_group_store(rows, piece[3], s0 >> 24, 3)
        _v4_group_store(rows, piece[4], s1, 4)
        _v4_group_store(rows, piece[5], s1 >> 8, 5)
        _v4_group_store(rows, piece[6], s1 >> 16, 6)
        rows.slice(2 * _V4_LATENT_WORDS, 16, dim=1).store(piece[7])
        rows.slice(2 * _V4_LATENT_WORDS + 16, 16, dim=1).store(piece[8])

    @gluon.jit
    def _v4_pair_store(rows, words, code, PAIR: gl.constexpr, layout: gl.constexpr):
        """Two 64-value groups [PIECE, 32 words] (2 PAIR and 2 PAIR + 1) times their UE8M0 scales (`code`'s low
        byte the first's, its next byte the second's) into bfloat16 columns [128 PAIR, 128 PAIR + 128)."""
        first = (code & 0xFF) << 7
        second = ((code >> 8) & 0xFF) << 7
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
        bits = gl.where(cols[None, :] < 16, first[:, None], second[:, None])
        lo, hi = _e4m3_words_scaled(words, bits | (bits << 16), True)
        rows.slice(PAIR * 64, 64, dim=1).store(gl.reshape(gl.join(lo, hi), [words.shape[0], 64]))

    @gluon.jit
    def _v4_piece_store_wide(kv_words, piece, FIRST: gl.constexpr, PIECE: gl.constexpr, layout: gl.constexpr,
                             narrow: gl.constexpr):
        """A piece's latent groups dequantised, and its rotary part as it is, into rows [FIRST, FIRST + PIECE)
        of the stage's word view: [448 latent | 64 rotary] bfloat16 values, the V4 row."""
        rows = kv_words.slice(FIRST, PIECE, dim=0)
        s0 = piece[5]
        s1 = piece[6]
        _v4_pair_store(rows, piece[0], s0, 0, layout)
        _v4_pair_store(rows, piece[1], s0 >> 16, 1, layout)
        _v4_pair_store(rows, piece[2], s1, 2, layout)
        _v4_group_store(rows, piece[3], gl.convert_layout(s1 >> 16, gl.SliceLayout(1, narrow)), 6)
        rows.slice(2 * _V4_LATENT_WORDS, 32, dim=1).store(piece[4])

    @gluon.jit
    def _v4_entries_store(tile_entries, e0, e1, e2, e3, PIECE: gl.constexpr):
        """A tile's entries, four pieces, into its row of the entries ring (`_ws_load_v4`)."""
        tile_entries.slice(0, PIECE).store(e0)
        tile_entries.slice(PIECE, PIECE).store(e1)
        tile_entries.slice(2 * PIECE, PIECE).store(e2)
        tile_entries.slice(3 * PIECE, PIECE).store(e3)

    @gluon.jit
    def _ws_load_v4(
        kv_smem, ready_bars, empty_bars, KV_cache, v4_args, block_table_row, split_start, split_end, num_tiles,
        stride_kv_block, KV_LORA_RANK: gl.constexpr, V4_PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, lists, entries_smem, WIDE: gl.constexpr,
    ):
        """DeepSeek-V4 tiles (fp8_ds_mla_v4: in a block of V4_PAGE tokens each token's 448 e4m3 values and 64
        bfloat16 rotary values, 576 bytes, then the tokens' seven UE8M0 scales and a pad byte each) of one or
        two caches, named by the index lists' entries (slots, `_v4_entries`, `_v4_rows`; `lists` from
        `_v4_list_args`; a row that does not count read as zeros), into the bfloat16 stages both
        products read as the 512-wide V4 row [448 latent | 64 rotary] (the query's rotary part is not used:
        QK reads the 512 columns, P V the same). 16-row quarters through the loader's registers, a whole tile
        ahead of the one stored (each row's address waits on its own entry: a tile's rows are gathered and the
        loader waits on the memory's latency, so as many rows as its registers hold are in flight), the entries
        two tiles ahead; the scale bytes come with their rows (WIDE: two groups a load, 16 bytes a thread, where
        a split holds several tiles; else 8 bytes a thread, the faster for one tile: bench/RESULTS.md). Needs rows
        on 16-byte boundaries and a bfloat16 query. Each tile's entries go to `entries_smem` [2 x STAGES, BLOCK_N] (tile t's at t % (2 x STAGES), written while tile t - 1 is stored:
        tile t + 1 - 2 x STAGES, their last reader, is done by then), where the softmax partition reads which
        positions count and whether one is bad (no list read there: its registers hold the accumulator)."""
        gl.static_assert(BLOCK_N == 64, "the V4 loader takes 64-token tiles in four 16-row quarters")
        gl.static_assert(KV_LORA_RANK == 512, "V4 rows are 512 values wide")
        gl.static_assert(_V4_LATENT_WORDS == 112 and _V4_GROUP_VALUES == 64,
                         "seven 64-value groups of 16 words, then 64 bfloat16 RoPE values")
        gl.static_assert(kv_smem.dtype == gl.bfloat16, "V4 rows are read with a bfloat16 query")
        P: gl.constexpr = 16
        layout: gl.constexpr = _v4_piece_layout(WIDE)
        narrow: gl.constexpr = _V4_PIECE_LAYOUT
        words_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        Extra_cache, extra_first_slot, stride_extra_block = v4_args
        KV_words = KV_cache.to(gl.pointer_type(gl.int32), bitcast=True)
        Extra_words = Extra_cache.to(gl.pointer_type(gl.int32), bitcast=True)
        src = (KV_words, Extra_words, extra_first_slot, stride_kv_block, stride_extra_block)
        e0 = _v4_entries(block_table_row, lists, split_start, split_end, 0, P, layout)
        e1 = _v4_entries(block_table_row, lists, split_start, split_end, 16, P, layout)
        e2 = _v4_entries(block_table_row, lists, split_start, split_end, 32, P, layout)
        e3 = _v4_entries(block_table_row, lists, split_start, split_end, 48, P, layout)
        # the next tile's entries, loaded before this tile's rows are
        n0 = _v4_entries(block_table_row, lists, split_start + BLOCK_N, split_end, 0, P, layout)
        n1 = _v4_entries(block_table_row, lists, split_start + BLOCK_N, split_end, 16, P, layout)
        n2 = _v4_entries(block_table_row, lists, split_start + BLOCK_N, split_end, 32, P, layout)
        n3 = _v4_entries(block_table_row, lists, split_start + BLOCK_N, split_end, 48, P, layout)
        a = _v4_quarter(e0, src, V4_PAGE, layout, narrow, WIDE)
        b = _v4_quarter(e1, src, V4_PAGE, layout, narrow, WIDE)
        c = _v4_quarter(e2, src, V4_PAGE, layout, narrow, WIDE)
        q3 = _v4_quarter(e3, src, V4_PAGE, layout, narrow, WIDE)
        _v4_entries_store(entries_smem.index(0), e0, e1, e2, e3, P)
        for tile in range(num_tiles):
            slot = tile % STAGES
            start = split_start + tile * BLOCK_N
            nxt = start + BLOCK_N
            # the entries of the tile after the next: the next tile's rows, loaded below, wait on no load
            after = nxt + BLOCK_N
            m0 = _v4_entries(block_table_row, lists, after, split_end, 0, P, layout)
            m1 = _v4_entries(block_table_row, lists, after, split_end, 16, P, layout)
            m2 = _v4_entries(block_table_row, lists, after, split_end, 32, P, layout)
            m3 = _v4_entries(block_table_row, lists, after, split_end, 48, P, layout)
            kv_words = _as_words(kv_smem.index(slot), [BLOCK_N, KV_LORA_RANK // 2], words_layout)
            mbarrier.wait(empty_bars.index(slot), ((tile // STAGES) & 1) ^ 1)
            # the next tile's entries (see above)
            _v4_entries_store(entries_smem.index((tile + 1) % (2 * STAGES)), n0, n1, n2, n3, P)
            # each quarter stored, then the next tile's same quarter loaded into its registers
            _v4_quarter_store(kv_words, a, 0, P, layout, narrow, WIDE)
            a = _v4_quarter(n0, src, V4_PAGE, layout, narrow, WIDE)
            _v4_quarter_store(kv_words, b, 16, P, layout, narrow, WIDE)
            b = _v4_quarter(n1, src, V4_PAGE, layout, narrow, WIDE)
            _v4_quarter_store(kv_words, c, 32, P, layout, narrow, WIDE)
            c = _v4_quarter(n2, src, V4_PAGE, layout, narrow, WIDE)
            _v4_quarter_store(kv_words, q3, 48, P, layout, narrow, WIDE)
            q3 = _v4_quarter(n3, src, V4_PAGE, layout, narrow, WIDE)
            n0 = m0
            n1 = m1
            n2 = m2
            n3 = m3
            # generic-proxy stores, read next by the tensor cores
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(ready_bars.index(slot), count=1)

    @gluon.jit
    def _tma_tile(kv_buf, pe_buf, bar, KV_desc, KV_pe_desc, start, page, num_cache_blocks, PAGE_SIZE: gl.constexpr,
                  LOAD_ROPE: gl.constexpr = True):
        """One whole tile inside a page by TMA: two bulk tensor copies (latent and rotary columns, addressed
        by the tile's first row in the cache viewed as [blocks x PAGE_SIZE, width]; the rotary one only where
        LOAD_ROPE) that complete the stage's barrier by their bytes, issued by one thread.  An entry outside
        [0, num_cache_blocks) reads block 0, as the cp.async rows do."""
        PE_COLS: gl.constexpr = pe_buf.shape[1] if LOAD_ROPE else 0
        TILE_BYTES: gl.constexpr = kv_buf.shape[0] * (kv_buf.shape[1] + PE_COLS) * kv_buf.dtype.primitive_bitwidth // 8
        block = gl.where((page < 0) | (page >= num_cache_blocks), 0, page)
        row = block * PAGE_SIZE + start % PAGE_SIZE
        mbarrier.expect(bar, TILE_BYTES)
        _tma_load(KV_desc, [row, 0], bar, kv_buf)
        if LOAD_ROPE:
            _tma_load(KV_pe_desc, [row, 0], bar, pe_buf)

    @gluon.jit
    def _convert_latent(raw_kv_buf, kv_buf, KV_LORA_RANK: gl.constexpr, BLOCK_N: gl.constexpr):
        """A raw stage's latent part (e4m3) -> the float16 stage, 16 rows at a time, as int32 words: two
        conversions a word (`_e4m3_words_to_f16`)."""
        PIECE: gl.constexpr = 16
        # two words (8 bytes) read a thread, four (16 bytes) stored: 16 threads read a row's 128
        # swizzled bytes, 8 threads store 128, without bank conflicts
        layout: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [WS_LOAD_WARPS, 1], [1, 0])
        words_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        raw_words = _as_words(raw_kv_buf, [BLOCK_N, KV_LORA_RANK // 4], words_layout)
        kv_words = _as_words(kv_buf, [BLOCK_N, KV_LORA_RANK // 2], words_layout)
        for i in gl.static_range(BLOCK_N // PIECE):
            _store_e4m3_words(kv_words, raw_words.slice(i * PIECE, PIECE, dim=0).load(layout), i * PIECE, PIECE)

    @gluon.jit
    def _ws_load_raw(
        kv_smem, raw_kv, raw_pe, ready_bars, empty_bars, raw_ready, raw_empty, q_done, KV_cache, KV_desc,
        KV_pe_desc, block_table_row, split_start, split_end, num_tiles, num_cache_blocks, stride_kv_block,
        stride_kv_token, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RAW_STAGES: gl.constexpr, QUERY_PARKED: gl.constexpr,
        TMA: gl.constexpr,
    ):
        """FP8 tiles for QK on FP8 tensor cores: each tile's bytes are copied (`_fill_stage`) into a raw
        stage RAW_STAGES - 1 tiles ahead (QK reads it there), and its latent part is converted once into
        a float16 stage for P V.  A raw stage is free again once QK has read it and it was converted
        (its empty barrier counts both)."""
        gl.static_assert(KV_cache.dtype.element_ty == gl.float8e4nv, "the FP8 QK path reads e4m3fn bytes")
        for i in gl.static_range(RAW_STAGES - 1):
            if i < num_tiles:
                start = split_start + i * BLOCK_N
                page = _tile_page(block_table_row, start, split_end, PAGE_SIZE, BLOCK_N)
                _fill_stage(
                    raw_kv.index(i), raw_pe.index(i), raw_ready.index(i), KV_cache, KV_desc, KV_pe_desc, start,
                    split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
                    KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, TMA,
                )
        # the block-table entry of the tile the next copies are for, loaded an iteration before they are
        # issued (a load just before them put its latency into every tile: 6.5 % of the loader's time)
        page = _tile_page(block_table_row, split_start + (RAW_STAGES - 1) * BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
        for tile in range(num_tiles):
            # the copies of tile + RAW_STAGES - 1, into the stage tile - 1 had (read by its QK, converted)
            ahead = tile + RAW_STAGES - 1
            start = split_start + ahead * BLOCK_N
            next_page = _tile_page(block_table_row, start + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
            if ahead < num_tiles:
                ahead_slot = ahead % RAW_STAGES
                mbarrier.wait(raw_empty.index(ahead_slot), ((ahead // RAW_STAGES) & 1) ^ 1)
                _fill_stage(
                    raw_kv.index(ahead_slot), raw_pe.index(ahead_slot), raw_ready.index(ahead_slot), KV_cache,
                    KV_desc, KV_pe_desc, start, split_end, block_table_row, num_cache_blocks, stride_kv_block,
                    stride_kv_token, page, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, TMA,
                )
            raw_slot = tile % RAW_STAGES
            slot = tile % STAGES
            mbarrier.wait(raw_ready.index(raw_slot), (tile // RAW_STAGES) & 1)
            mbarrier.wait(empty_bars.index(slot), ((tile // STAGES) & 1) ^ 1)
            if QUERY_PARKED:
                # the first float16 stage holds the 16-bit query until it is in place as e4m3
                if tile == 0:
                    mbarrier.wait(q_done, 0)
            _convert_latent(raw_kv.index(raw_slot), kv_smem.index(slot), KV_LORA_RANK, BLOCK_N)
            # generic-proxy stores, read next by the tensor cores
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(ready_bars.index(slot), count=1)
            mbarrier.arrive(raw_empty.index(raw_slot), count=1)
            page = next_page

    @gluon.jit
    def _cp_async_tile(
        kv_buf, kpe_buf, ready_bar, KV_cache, start, split_end, block_table_row, num_cache_blocks, stride_kv_block,
        stride_kv_token, page, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr, LOAD_ROPE: gl.constexpr = True,
    ):
        """Copy one tile into a stage with cp.async (16 bytes each; positions past split_end zero-filled), the
        stage's ready barrier completing when the copies land: FP8 bytes whole rows at a time, 16-bit
        values 128 columns at a time (the rotary columns only where LOAD_ROPE: a zero rotary query reads
        none of them)."""
        if kv_buf.dtype.primitive_bitwidth == 8:
            _issue_tile(
                kv_buf, kpe_buf, KV_cache, start, split_end, block_table_row, num_cache_blocks, stride_kv_block,
                stride_kv_token, page, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N,
                _tile_layout(KV_LORA_RANK, 8, WS_LOAD_WARPS), _tile_layout(ROPE_DIM, 8, WS_LOAD_WARPS),
            )
        else:
            CHUNK: gl.constexpr = 128
            chunk_layout: gl.constexpr = _tile_layout(CHUNK, 16, WS_LOAD_WARPS)
            kpe_layout: gl.constexpr = _tile_layout(ROPE_DIM, 16, WS_LOAD_WARPS)
            rows, valid, bad = _tile_rows(
                start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
                PAGE_SIZE, BLOCK_N, gl.SliceLayout(1, chunk_layout),
            )
            for c in gl.static_range(KV_LORA_RANK // CHUNK):
                cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_layout))
                _async_load(
                    kv_buf.slice(c * CHUNK, CHUNK, dim=1), KV_cache + rows[:, None] + cols[None, :], mask=valid[:, None]
                )
            if LOAD_ROPE:
                rows_pe, valid_pe, bad_pe = _tile_rows(
                    start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
                    PAGE_SIZE, BLOCK_N, gl.SliceLayout(1, kpe_layout),
                )
                cols_pe = KV_LORA_RANK + gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, kpe_layout))
                _async_load(kpe_buf, KV_cache + rows_pe[:, None] + cols_pe[None, :], mask=valid_pe[:, None])
        # the stage turns ready when every loader thread's copies have landed, without the loader waiting
        # for them: each thread's copies hold the phase open (cp.async.mbarrier.arrive), then one arrive.
        # (Marking a tile ready only after issuing the next one's copies made the first warpgroup wait
        # for the next stage to drain: 22 % of its time at 128 heads.)
        async_copy.mbarrier_arrive(ready_bar)
        _cta_barrier()
        mbarrier.arrive(ready_bar, count=1)

    @gluon.jit
    def _fill_stage(
        kv_buf, kpe_buf, ready_bar, KV_cache, KV_desc, KV_pe_desc, start, split_end, block_table_row,
        num_cache_blocks, stride_kv_block, stride_kv_token, page, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr,
        PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, TMA: gl.constexpr, LOAD_ROPE: gl.constexpr = True,
    ):
        """Copy one tile of the cache's values (16-bit, or FP8 bytes into a raw stage) into a stage: by TMA
        (`_tma_tile`; the tile inside one page, `tma_cache_reason`) when TMA and the tile is whole; by
        cp.async otherwise, and for a split's partial last tile, so that its rows past the end are zeros,
        not the page's stale values. LOAD_ROPE False: the rotary columns are not copied."""
        if TMA:
            if start + BLOCK_N <= split_end:
                _tma_tile(kv_buf, kpe_buf, ready_bar, KV_desc, KV_pe_desc, start, page, num_cache_blocks, PAGE_SIZE,
                          LOAD_ROPE)
            else:
                _cp_async_tile(
                    kv_buf, kpe_buf, ready_bar, KV_cache, start, split_end, block_table_row, num_cache_blocks,
                    stride_kv_block, stride_kv_token, page, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, LOAD_ROPE,
                )
        else:
            _cp_async_tile(
                kv_buf, kpe_buf, ready_bar, KV_cache, start, split_end, block_table_row, num_cache_blocks,
                stride_kv_block, stride_kv_token, page, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, LOAD_ROPE,
            )

    @gluon.jit
    def _ws_load_tiles(
        kv_smem, kpe_smem, ready_bars, empty_bars, KV_cache, KV_desc, KV_pe_desc, block_table_row, split_start,
        split_end, num_tiles, num_cache_blocks, stride_kv_block, stride_kv_token,
        KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, TMA: gl.constexpr, LOAD_ROPE: gl.constexpr = True,
    ):
        """Tiles copied as they are, nothing converted (16-bit stages, or the raw FP8 stages of FP8 P V): wait
        until the compute partitions released a stage, then fill it (`_fill_stage`; LOAD_ROPE as its)."""
        page = _tile_page(block_table_row, split_start, split_end, PAGE_SIZE, BLOCK_N)
        for tile in range(num_tiles):
            slot = tile % STAGES
            start = split_start + tile * BLOCK_N
            # the next tile's block-table entry is in flight while this stage drains
            next_page = _tile_page(block_table_row, start + BLOCK_N, split_end, PAGE_SIZE, BLOCK_N)
            mbarrier.wait(empty_bars.index(slot), ((tile // STAGES) & 1) ^ 1)
            _fill_stage(
                kv_smem.index(slot), kpe_smem.index(slot), ready_bars.index(slot), KV_cache, KV_desc, KV_pe_desc,
                start, split_end, block_table_row, num_cache_blocks, stride_kv_block, stride_kv_token, page,
                KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, TMA, LOAD_ROPE,
            )
            page = next_page

    @gluon.jit
    def _ws_load(
        bufs, ptrs, scalars, strides,
        Q_LEN: gl.constexpr, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_K_SCALE: gl.constexpr,
        DIRECT_OUTPUT: gl.constexpr, ROWS_AS_M: gl.constexpr, RAW_STAGES: gl.constexpr, KV_desc, KV_pe_desc,
        TMA: gl.constexpr, MASKED_ENTRIES: gl.constexpr = False, V4_PAGE: gl.constexpr = 0, v4_args=None,
        v4_lists=None, V4_WIDE: gl.constexpr = False, QK_ROPE: gl.constexpr = True,
    ):
        """The loader warpgroup: 16-bit caches by cp.async into the stages both products read (the rotary
        columns only where QK_ROPE: a zero rotary query's product is skipped, so they go unread); FP8 caches
        either as raw bytes by cp.async for QK on FP8 tensor cores, the latent part converted once into the
        float16 stages P V reads (RAW_STAGES > 0), or through registers, converted once per element into
        the float16 stages both products read."""
        (q_smem, qpe_smem, p_smem, row_smem, kv_smem, kpe_smem, ready_bars, empty_bars, p_ready, p_empty,
         raw_kv, raw_pe, raw_ready, raw_empty, red_smem, q_done, ds_scales) = bufs
        Q_nope, Q_pe, KV_cache, Block_table, Seq_lens, K_scale, Attn_logits, Out, Lse, Error_flag = ptrs
        sm_scale, num_heads, num_kv_splits, max_seq_len, num_cache_blocks = scalars
        stride_kv_block = strides[6]
        stride_kv_token = strides[7]
        stride_bt_b = strides[8]
        split = gl.program_id(1)
        batch = gl.program_id(2)
        seq_len, bad_seq_len, split_start, split_end, num_tiles = _split_range(
            Seq_lens, batch, split, num_kv_splits, max_seq_len, BLOCK_N, V4_PAGE > 0
        )
        block_table_row = Block_table + batch * stride_bt_b
        if _fp8_pv(RAW_STAGES, STAGES):
            # QK and P V on the FP8 tensor cores read the raw stages; nothing is converted
            gl.static_assert(KV_cache.dtype.element_ty == gl.float8e4nv, "the FP8 P V path reads e4m3fn bytes")
            _ws_load_tiles(
                raw_kv, raw_pe, raw_ready, raw_empty, KV_cache, KV_desc, KV_pe_desc, block_table_row, split_start,
                split_end, num_tiles, num_cache_blocks, stride_kv_block, stride_kv_token, KV_LORA_RANK, ROPE_DIM,
                PAGE_SIZE, BLOCK_N, RAW_STAGES, TMA,
            )
        elif RAW_STAGES > 0:
            _ws_load_raw(
                kv_smem, raw_kv, raw_pe, ready_bars, empty_bars, raw_ready, raw_empty, q_done, KV_cache, KV_desc,
                KV_pe_desc, block_table_row, split_start, split_end, num_tiles, num_cache_blocks, stride_kv_block,
                stride_kv_token, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N, STAGES, RAW_STAGES,
                _query_parked(RAW_STAGES, BLOCK_H, KV_LORA_RANK), TMA,
            )
        elif V4_PAGE > 0:
            _ws_load_v4(
                kv_smem, ready_bars, empty_bars, KV_cache, v4_args, block_table_row, split_start, split_end,
                num_tiles, stride_kv_block, KV_LORA_RANK, V4_PAGE, BLOCK_N, STAGES,
                _v4_list_args(v4_lists, batch, max_seq_len, num_cache_blocks), ds_scales, V4_WIDE,
            )
        elif KV_cache.dtype.element_ty == gl.uint8:
            _ws_load_ds_mla(
                kv_smem, kpe_smem, ds_scales, ready_bars, empty_bars, KV_cache, block_table_row, split_start, split_end,
                num_tiles, num_cache_blocks, stride_kv_block, stride_kv_token, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE,
                BLOCK_N, STAGES, MASKED_ENTRIES, ROWS_AS_M,
            )
        elif KV_cache.dtype.element_ty.primitive_bitwidth == 8:
            _ws_load_fp8(
                kv_smem, kpe_smem, ready_bars, empty_bars, KV_cache, block_table_row, split_start, split_end,
                num_tiles, num_cache_blocks, stride_kv_block, stride_kv_token, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE,
                BLOCK_N, STAGES,
            )
        else:
            _ws_load_tiles(
                kv_smem, kpe_smem, ready_bars, empty_bars, KV_cache, KV_desc, KV_pe_desc, block_table_row,
                split_start, split_end, num_tiles, num_cache_blocks, stride_kv_block, stride_kv_token, KV_LORA_RANK,
                ROPE_DIM, PAGE_SIZE, BLOCK_N, STAGES, TMA, QK_ROPE,
            )

    @gluon.jit
    def _mla_decode_ws_kernel(
        Q_nope, Q_pe, KV_cache, Block_table, Seq_lens, K_scale, Attn_logits, Out, Lse, Error_flag,
        sm_scale, num_heads, num_kv_splits, max_seq_len, num_cache_blocks,
        stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h,
        stride_kv_block, stride_kv_token, stride_bt_b, stride_al_row, stride_al_h, stride_al_split,
        stride_o_b, stride_o_t, stride_o_h, stride_lse_b, stride_lse_t, stride_lse_h,
        Q_LEN: gl.constexpr, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_K_SCALE: gl.constexpr,
        FP8_CACHE: gl.constexpr, DIRECT_OUTPUT: gl.constexpr, num_warps: gl.constexpr, ROWS_AS_M: gl.constexpr,
        RAW_STAGES: gl.constexpr = 0, TMA: gl.constexpr = False, KV_desc=None, KV_pe_desc=None,
        MASKED_ENTRIES: gl.constexpr = False, V4_PAGE: gl.constexpr = 0, Extra_cache=None, extra_first_slot=0,
        stride_extra_block=0, QK_ROPE: gl.constexpr = True, Sink=None, HAS_SINK: gl.constexpr = False,
        PDL: gl.constexpr = False, Extra_table=None, stride_extra_t=0, v4_topk=0, Topk_length=None,
        Extra_topk_length=None, V4_WIDE: gl.constexpr = False,
    ):
        """Warp-specialised: a QK + softmax + PV warpgroup, a PV warpgroup, a loader (cp.async, or TMA for
        16-bit tiles inside one page; FP8 through registers, converted once into the 16-bit stages).
        ROWS_AS_M: the query rows as the MMA's M (64 rows) instead of the cache tokens. MASKED_ENTRIES
        (fp8_ds_mla pages of one token): a block-table entry -1 is no token, masked, not an error.
        V4_PAGE > 0: DeepSeek-V4 rows (fp8_ds_mla_v4, pages of V4_PAGE tokens) of KV_cache and Extra_cache read
        in place (`_ws_load_v4`) through both index lists as they are (`_v4_list_entries`): the block table is
        the first list (v4_topk wide, slots of KV_cache, -1 no token, entries past Topk_length[batch] do not
        count), Extra_table the second (its rows stride_extra_t apart, slots of Extra_cache, whose blocks lie
        stride_extra_block bytes apart, Extra_topk_length), Seq_lens both widths' sum and PAGE_SIZE 1; the
        query 512 wide; V4_WIDE: the loader's wide pieces (`_ws_load_v4`).
        QK_ROPE False: the query's rotary part is zero (V4 rows laid out as 576-wide ones with a zero tail), its
        product is skipped. HAS_SINK (DIRECT_OUTPUT): the output times exp(lse) / (exp(lse) + exp(Sink[head]))
        (Sink float32 [num_heads]), the LSE without it. PDL: launched by programmatic dependent launch
        (`launch.pdl_constexprs`): the shared memory and barriers set up, then the wait on the kernel before."""
        if V4_PAGE > 0:
            gl.static_assert(PAGE_SIZE == 1 and not MASKED_ENTRIES, "V4 rows are named slot by slot")
        if MASKED_ENTRIES:
            gl.static_assert(PAGE_SIZE == 1, "entries of -1 are tokens of one-token pages")
        gl.static_assert(num_warps == 4, "the warp-specialised decode kernel's default partition is one warpgroup")
        # the products' operand type: float16 for an FP8 cache (see the softmax partition)
        dtype: gl.constexpr = _operand_dtype(Q_nope.dtype.element_ty, KV_cache.dtype.element_ty)
        if RAW_STAGES > 0:
            gl.static_assert(FP8_CACHE, "raw FP8 stages need an FP8 cache")
            fp8: gl.constexpr = KV_cache.dtype.element_ty
            q_smem = gl.allocate_shared_memory(fp8, [BLOCK_H, KV_LORA_RANK], _shared_layout(KV_LORA_RANK, 8))
            qpe_smem = gl.allocate_shared_memory(fp8, [BLOCK_H, ROPE_DIM], _shared_layout(ROPE_DIM, 8))
        else:
            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA_RANK], _shared_layout(KV_LORA_RANK, 16))
            qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE_DIM], _shared_layout(ROPE_DIM, 16))
        FP8_PV: gl.constexpr = _fp8_pv(RAW_STAGES, STAGES)
        if FP8_PV:
            gl.static_assert(_pv_whole(ROWS_AS_M, BLOCK_H), "FP8 P V takes the tokens as M and up to 16 rows")
            # P^T as e4m3 [rows, tokens]: the FP8 MMA's B operand, K-major
            p_smem = gl.allocate_shared_memory(fp8, [BLOCK_H, BLOCK_N], _shared_layout(BLOCK_N, 8))
        elif ROWS_AS_M:
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], _shared_layout(BLOCK_N, 16))
        else:
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], _shared_layout(BLOCK_H, 16))
        row_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # no float16 stages for FP8 P V: one placeholder stage's barriers, no tile
        STAGES_16: gl.constexpr = 1 if FP8_PV else STAGES
        if not FP8_PV:
            kv_smem = gl.allocate_shared_memory(
                dtype, [STAGES, BLOCK_N, KV_LORA_RANK], _shared_layout(KV_LORA_RANK, 16)
            )
        ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES_16, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES_16, 1], mbarrier.MBarrierLayout())
        if RAW_STAGES > 0:
            # the cache's bytes (QK), and float16 stages of the latent part only (P V)
            raw_kv = gl.allocate_shared_memory(
                fp8, [RAW_STAGES, BLOCK_N, KV_LORA_RANK], _shared_layout(KV_LORA_RANK, 8)
            )
            raw_pe = gl.allocate_shared_memory(fp8, [RAW_STAGES, BLOCK_N, ROPE_DIM], _shared_layout(ROPE_DIM, 8))
            raw_ready = gl.allocate_shared_memory(gl.int64, [RAW_STAGES, 1], mbarrier.MBarrierLayout())
            raw_empty = gl.allocate_shared_memory(gl.int64, [RAW_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(RAW_STAGES):
                mbarrier.init(raw_ready.index(i), count=1)
                mbarrier.init(raw_empty.index(i), count=2)
            kpe_smem = raw_pe
            if FP8_PV:
                kv_smem = raw_kv
        else:
            kpe_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE_DIM], _shared_layout(ROPE_DIM, 16))
            raw_kv = kv_smem
            raw_pe = kpe_smem
            raw_ready = ready_bars
            raw_empty = empty_bars
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # each warp's maxima of a tile's scores, two tiles (`_max_over_tokens`; a placeholder where unused)
        red_smem = gl.allocate_shared_memory(
            gl.float32, [2, 4, BLOCK_H if _max_through_smem(ROWS_AS_M, BLOCK_H) else 1],
            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
        )
        # a 16-bit stage is free when both warpgroups are done with it; when the first warpgroup computes no
        # P V and reads raw stages for QK, when the second is
        empty_arrivals: gl.constexpr = 1 if (RAW_STAGES > 0 and _pv_whole(ROWS_AS_M, BLOCK_H)) else 2
        for i in gl.static_range(STAGES_16):
            mbarrier.init(ready_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=empty_arrivals)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_empty, count=1)
        # the query is in shared memory (`_query_parked`: the loader's first conversion waits for it)
        q_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_done, count=1)
        # an fp8_ds_mla cache: a tile's row scales as bfloat16 pairs, per 128-value group, two tiles
        # (V4 pages: each tile's entries, `_ws_load_v4`)
        ds_scales = gl.allocate_shared_memory(
            gl.int32, [2, 4 * BLOCK_N] if (KV_cache.dtype.element_ty == gl.uint8 and V4_PAGE == 0) else
            [2 * STAGES, BLOCK_N] if V4_PAGE > 0 else [1, 1],
            gl.SwizzledSharedLayout(1, 1, 1, [0]),
        )
        bufs = (
            q_smem, qpe_smem, p_smem, row_smem, kv_smem, kpe_smem, ready_bars, empty_bars, p_ready, p_empty,
            raw_kv, raw_pe, raw_ready, raw_empty, red_smem, q_done, ds_scales,
        )
        ptrs = (Q_nope, Q_pe, KV_cache, Block_table, Seq_lens, K_scale, Attn_logits, Out, Lse, Error_flag)
        scalars = (sm_scale, num_heads, num_kv_splits, max_seq_len, num_cache_blocks)
        strides = (
            stride_qn_b, stride_qn_t, stride_qn_h, stride_qp_b, stride_qp_t, stride_qp_h, stride_kv_block,
            stride_kv_token, stride_bt_b, stride_al_row, stride_al_h, stride_al_split, stride_o_b, stride_o_t,
            stride_o_h, stride_lse_b, stride_lse_t, stride_lse_h,
        )
        if PDL:
            # (`launch.pdl_enter`, which Gluon code cannot call)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # (the argument tuples are written out: a constexpr kept in a tuple variable arrives as a tensor)
        gl.warp_specialize(
            [
                (_ws_softmax_partition, (bufs, ptrs, scalars, strides, Q_LEN, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE,
                                         BLOCK_H, BLOCK_N, STAGES, HAS_K_SCALE, DIRECT_OUTPUT, ROWS_AS_M,
                                         RAW_STAGES, MASKED_ENTRIES, V4_PAGE, QK_ROPE, Sink, HAS_SINK,
                                         V4_PAGE > 0 and not V4_WIDE)),
                (_ws_pv_partition, (bufs, ptrs, scalars, strides, Q_LEN, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE,
                                    BLOCK_H, BLOCK_N, STAGES, HAS_K_SCALE, DIRECT_OUTPUT, ROWS_AS_M,
                                    RAW_STAGES)),
                (_ws_load, (bufs, ptrs, scalars, strides, Q_LEN, KV_LORA_RANK, ROPE_DIM, PAGE_SIZE,
                            BLOCK_H, BLOCK_N, STAGES, HAS_K_SCALE, DIRECT_OUTPUT, ROWS_AS_M, RAW_STAGES,
                            KV_desc, KV_pe_desc, TMA, MASKED_ENTRIES, V4_PAGE,
                            (Extra_cache, extra_first_slot, stride_extra_block),
                            (Extra_table, stride_extra_t, v4_topk, Topk_length, Extra_topk_length,
                             extra_first_slot), V4_WIDE, QK_ROPE)),
            ],
            [4, WS_LOAD_WARPS],
            [WS_PV_REGS_F8PV, WS_LOAD_REGS_F8PV] if FP8_PV else [WS_PV_REGS, WS_LOAD_REGS_RAW] if RAW_STAGES > 0 else (
                [WS_PV_REGS_FP8, WS_LOAD_REGS_FP8] if FP8_CACHE else [WS_PV_REGS, WS_LOAD_REGS]
            ),
        )

    ws_split_kernel = _mla_decode_ws_kernel
else:  # pragma: no cover - depends on the installed Triton
    ws_split_kernel = None


def tma_cache_reason(kv_cache, block_n: int, kv_lora_rank: int) -> str:
    """Why the warp-specialised kernel's loader cannot copy this cache's tiles by TMA ("" when it can):
    a 16-bit or float8_e4m3fn cache whose pages are whole tiles and whose rows, evenly spaced across blocks,
    start on 16-byte boundaries, addressed by int32 row coordinates."""
    if gluon is None or not hasattr(tma, "async_load") and not hasattr(tma, "async_copy_global_to_shared"):
        return "this Triton's Gluon has no TMA copy"
    if _TensorDescriptor is None:
        return "this Triton has no Gluon TensorDescriptor (triton.experimental.gluon.nvidia.hopper)"
    if kv_cache.element_size() != 2 and kv_cache.dtype != torch.float8_e4m3fn:
        return f"a {kv_cache.dtype} cache is read by cp.async (TMA takes 16-bit and float8_e4m3fn caches)"
    num_blocks, page_size, width = kv_cache.shape
    if page_size % block_n:
        return f"block_size {page_size} is not a multiple of the {block_n}-token tile"
    row_stride = kv_cache.stride(1)
    if kv_cache.stride(2) != 1 or kv_cache.stride(0) != page_size * row_stride:
        return f"kv_cache strides {tuple(kv_cache.stride())} are not rows evenly spaced across blocks"
    size = kv_cache.element_size()
    if (row_stride * size) % 16 or kv_cache.data_ptr() % 16 or (kv_lora_rank * size) % 16:
        return f"kv_cache rows (data_ptr {kv_cache.data_ptr()}, row stride {row_stride}) are not 16-byte aligned"
    if num_blocks * page_size >= 2**31:
        return f"{num_blocks} blocks x {page_size} rows exceed int32 row coordinates"
    return ""


def _stage_layout(cols: int, bits: int):
    """The shared layout of a stage `cols` wide (the kernel's `_shared_layout`), on the host."""
    return _shared_layout.fn(cols, bits) if hasattr(_shared_layout, "fn") else _shared_layout(cols, bits)


def tma_descriptor_type(block_n: int, cols: int, dtype: str = "bf16") -> str:
    """The kernel signature's type of a cache descriptor (`_tma_cache_descriptors`; dtype "bf16", "fp16" or
    "fp8e4nv"), for ahead-of-time compilation."""
    bits = 8 if dtype.startswith("fp8") else 16
    return f"tensordesc<{dtype}[{block_n},{cols}],{_stage_layout(cols, bits)!r}>"


class _CacheBase:
    """What a TMA descriptor needs of the cache tensor (its address and dtype), without keeping the cache
    alive: a descriptor stays valid for any tensor at the same address with the same shape and strides."""

    def __init__(self, tensor):
        self._data_ptr = tensor.data_ptr()
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self._data_ptr


# (address, shape, strides, dtype, block_n, kv_lora_rank) -> the two descriptors, or None where
# `tma_cache_reason` rules TMA out: one lookup a call instead of building them again
_TMA_DESCRIPTORS: dict = {}
_TMA_DESCRIPTORS_MAX = 64


def _tma_cache_descriptors(kv_cache, block_n: int, kv_lora_rank: int):
    """TMA descriptors of the latent and the rotary columns of `kv_cache` viewed as [blocks x page, width],
    with the shared layouts of the loader's stages; None when `tma_cache_reason` gives a reason."""
    key = (kv_cache.data_ptr(), *kv_cache.shape, *kv_cache.stride(), kv_cache.dtype, block_n, kv_lora_rank)
    found = _TMA_DESCRIPTORS.get(key, False)
    if found is not False:
        return found
    descriptors = None
    if not tma_cache_reason(kv_cache, block_n, kv_lora_rank):
        num_blocks, page_size, width = kv_cache.shape
        descriptors = tuple(
            _TensorDescriptor(
                _CacheBase(kv_cache[:, :, first:]), [num_blocks * page_size, cols], [kv_cache.stride(1), 1],
                [block_n, cols], _stage_layout(cols, kv_cache.element_size() * 8),
            )
            for first, cols in ((0, kv_lora_rank), (kv_lora_rank, width - kv_lora_rank))
        )
    if len(_TMA_DESCRIPTORS) >= _TMA_DESCRIPTORS_MAX:
        _TMA_DESCRIPTORS.clear()
    _TMA_DESCRIPTORS[key] = descriptors
    return descriptors


def tma_loader(config, fp8_cache: bool) -> bool:
    """Whether `config`'s loader copies tiles as they are and asks for TMA (`DecodeLaunchConfig.tma`): the
    warp-specialised kernels with 16-bit values, or with FP8 bytes into raw stages.  The launch still keeps
    cp.async for a cache `tma_cache_reason` rules out."""
    return config.warp_specialised and config.tma and fp8_cache == (config.raw_stages > 0)


def _split_kernel_constexprs(*, q_len, kv_lora_rank, rope_dim, page_size, config, has_k_scale, fp8_cache, direct,
                             tma: bool, masked_entries: bool = False, v4_page: int = 0, qk_rope: bool = True,
                             sink: bool = False, pdl: dict | None = None, v4_wide: bool = False) -> dict:
    extra = {**(pdl or {}), "maxnreg": WS_MAXNREG, "ROWS_AS_M": config.kernel == "wgmma_rm",
             "RAW_STAGES": config.raw_stages, "MASKED_ENTRIES": masked_entries}
    if v4_page:
        extra["V4_PAGE"] = v4_page
        if v4_wide:
            extra["V4_WIDE"] = True
    if not qk_rope:
        extra["QK_ROPE"] = False
    if sink:
        extra["HAS_SINK"] = True
    if tma:
        extra["TMA"] = True
    return dict(
        Q_LEN=q_len,
        KV_LORA_RANK=kv_lora_rank,
        ROPE_DIM=rope_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        STAGES=config.num_stages,
        HAS_K_SCALE=has_k_scale,
        FP8_CACHE=fp8_cache,
        DIRECT_OUTPUT=direct,
        num_warps=config.num_warps,
        **extra,
    )


# the V4 split kernel's arguments passed by name: the second cache, its first slot, its block stride in bytes, the
# second index list, its row stride, the first list's width and both lists' lengths
V4_KEYWORDS = ("Extra_cache", "extra_first_slot", "stride_extra_block", "Extra_table", "stride_extra_t", "v4_topk",
               "Topk_length", "Extra_topk_length")


def tma_keywords(kv_cache, block_n: int, kv_lora_rank: int) -> dict:
    """The TMA descriptor arguments of a bound split kernel for `kv_cache` (built once per cache and kept)."""
    descriptors = _tma_cache_descriptors(kv_cache, block_n, kv_lora_rank)
    return {"KV_desc": descriptors[0], "KV_pe_desc": descriptors[1]}


def bind_split_kernel(grid, device, kv_cache, *, q_len, kv_lora_rank, rope_dim, page_size, config, has_k_scale,
                      fp8_cache, direct, allow_tma: bool = True, masked_entries: bool = False, v4_page: int = 0,
                      qk_rope: bool = True, sink: bool = False, pdl: dict | None = None, v4_wide: bool = False):
    """The warp-specialised split kernel bound for a plan (`mla_multi.kernels.launch.BoundLaunch`), and whether it
    takes TMA descriptors of the cache (`tma_keywords`): the plan's key fixes everything
    `tma_cache_reason` reads. allow_tma=False keeps cp.async where the configuration asks for TMA
    (`mla_decode.eager_tma`: small eager launches). masked_entries: block-table entries -1 are no token
    (the warp-specialised kernel over one-token fp8_ds_mla pages). v4_page > 0: DeepSeek-V4 rows in pages of
    that many tokens, read in place (`V4_KEYWORDS` passed by name at every call). qk_rope=False: the query's
    rotary part is zero and its product is skipped. sink (direct only): the sink applied to the output (`Sink`
    passed by name at every call). pdl: `launch.pdl_constexprs` of the device ({} or None: a plain launch).
    v4_wide: the V4 loader's wide pieces (`_ws_load_v4`: where a split holds several tiles)."""
    tma_ok = (allow_tma and not v4_page and tma_loader(config, fp8_cache)
              and not tma_cache_reason(kv_cache, config.block_n, kv_lora_rank))
    constexprs = _split_kernel_constexprs(
        q_len=q_len, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, page_size=page_size, config=config,
        has_k_scale=has_k_scale, fp8_cache=fp8_cache, direct=direct, tma=tma_ok, masked_entries=masked_entries,
        v4_page=v4_page, qk_rope=qk_rope, sink=sink, pdl=pdl, v4_wide=v4_wide,
    )
    names = ("KV_desc", "KV_pe_desc") if tma_ok else V4_KEYWORDS if v4_page else ()

    if sink:
        names += ("Sink",)
    return BoundLaunch(ws_split_kernel, grid, constexprs, device, keyword_names=names), tma_ok
