"""Varlen prefill attention for sm_90 in the FlashAttention-3 structure (Gluon).

Work items are (query tile of 128 rows, head, sequence); each program, warp-specialised:

* a loader warp brings each item's first K / V tile, then its query tile (once the
  last one's scores are done with its buffer), then the rest, by TMA: the query
  into its buffer, K and V into two rings of
  ``STAGES`` shared-memory stages, K and V apart: each stage's ``ready``
  barrier completed by the copies' bytes, its ``empty`` barrier by both
  consumers (K once the scores are in, V once the product is); it hands
  each item to the consumers through a ring of two slots, with its
  sequence's boundaries, which it has read already (the consumers would
  wait for those loads at the start of each item: 1-1.3 % on short items);
* two consumer warpgroups, one per 64-row half of the query tile, each with its
  own scores, softmax and output: ``S = Q K^T`` by warpgroup MMA from shared
  memory (the 128 non-rotary and 64 rotary columns as two products into one
  accumulator), the online softmax in base 2, and ``O += P V`` with P from
  registers.  Inside a warpgroup, tile j's scores are issued before tile j-1's
  ``P V`` and tile j's softmax runs while that product is in flight (FA3's
  intra-warpgroup overlap); the two halves run apart, so one's softmax also
  overlaps the other's products;
* the output leaves each warpgroup through an 8 KiB shared staging buffer of its own, 64 columns at a
  time (`_store_staged`), by TMA stores where the tile's rows lie inside the sequence (16 x 512 at 128
  heads 4.9 % faster than reading it back), else read back as 16-byte pieces of rows: stored straight
  from the accumulator's layout, each store wrote 16 bytes of every 32-byte sector it touched and every
  sector of the output reached L2 twice (Nsight Compute on an H100, 16 x 512 at 128 heads: 586 -> 522 µs;
  bench/RESULTS.md); a context chunk's in-place merge still reads and writes from the accumulator's layout;
* causal attention (aligned bottom-right, as `prefill.varlen_attention`) stops
  at the last key tile the tile's last row sees; masks are applied only on the
  tiles that cross the diagonal or the end of the keys.

Launched persistent: one program per SM, the rings running on across its items, so
the next item's tiles load while this one ends.  The programs take their items
dynamically (the loader warp adds 1 to a counter of the launch's stream as an item
starts and hands the next item to the consumers through a ring of two slots; the
last program to finish puts the counter back to 0), in bands of (sequence, head)
pairs whose items run from the most expensive causal tile to the cheapest, so that
the launch ends on cheap tiles: a ragged batch or a long sequence otherwise leaves
programs finishing far apart, as do the SMs' uneven speeds (`takes_dynamic`,
`band_of`).  Batches of equal sequences up to ``PERSISTENT_MAX_SEQLEN_Q`` walk a
fixed order instead, in alternating rounds that balance them by construction; a
launch without a counter (one made while a stream is captured) keeps that order
there and one program per item elsewhere.  bench/RESULTS.md has the measurements.

K's rotary columns may come apart (MLA: one rotary key shared by every head,
``k_pe [total_k, 64]``), or inside K (``[total_k, heads, 192]``): both are one
more TMA descriptor over the columns.  The contract is
`prefill.varlen_attention`'s (LSE in natural log, an empty key range gives 0 and
-inf, boundaries checked on the device: a bad sequence gets NaN rows and sets
the ``CU_SEQLENS`` bit of the error flag), and its in-kernel merge (``merge=True``:
the result merged into the one already in ``out`` / ``lse``, as the chunked
prefill's context chunks are).

`wgmma_prefill_reason` says where it runs, `takes` when
`prefill.varlen_attention`'s default launch hands it the tensors (on sm_90),
`varlen_attention_wgmma` launches it; bench/RESULTS.md has its measurements.
"""

from __future__ import annotations

import functools

import torch

from mla_multi import errors
from mla_multi.kernels import capturing_on, rows_of_heads
from mla_multi.kernels.launch import BoundLaunch, alignment_key
from mla_multi.kernels.prefill_inputs import check_inputs
from mla_multi.kernels.mla_decode_wgmma import gluon, gluon_available

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from mla_multi.kernels.merge import merge_scales
    from mla_multi.kernels.mla_decode_wgmma import _CacheBase, _cta_barrier, _TensorDescriptor, _stage_layout, _tma_load

    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

__all__ = ["wgmma_prefill_reason", "varlen_attention_wgmma", "takes", "takes_reason", "layout_reason",
           "query_for_kernel", "BLOCK_M", "BLOCK_N", "STAGES"]

BLOCK_M = 128  # query rows a program: two warpgroups of 64
BLOCK_N = 128  # keys a tile
STAGES = 2  # K / V stages: 48 KiB query tile + 2 x 80 KiB (+ 16 KiB of output staging)
PERSISTENT_MAX_SEQLEN_Q = 4096  # the longest query sequence launched persistent by default (bench/RESULTS.md)
BAND_ROUNDS = 2  # a causal band of the dynamic schedule holds the items of this many rounds of the grid (`band_of`)
BAND_KV_BYTES = 32 << 20  # and at most this much K and V (its pairs' tiles stay in L2 while they are read)
ITEM_FIELDS = 8  # int32 a work item in the loader's ring to the consumers (`_sequence`)
COUNTER_SLOTS = 64  # the dynamic schedule's counters a device: one a stream (`_schedule_counter`)
NOPE_DIM, ROPE_DIM, HEAD_DIM_V = 128, 64, 128
_LOG2_E = 1.4426950408889634
# registers a thread: the loader warp is launched as a whole warpgroup, so 12 warps share an SM's 64K
# registers at launch (168 each); setmaxnreg then gives the consumers 240 and the loader 24
_MAXNREG = 168


@functools.lru_cache(maxsize=64)
def wgmma_prefill_reason(platform, dtype: torch.dtype, head_dim_qk: int, head_dim_v: int) -> str:
    """Why the sm_90 prefill kernel cannot serve (dtype, head dims) on `platform` ("" where it can)."""
    available, why = gluon_available()
    if not available:
        return why
    if not (platform.is_cuda() and platform.device_capability is not None and platform.device_capability[0] == 9):
        return f"{platform.name} ({platform.arch}): the kernel is written for sm_90 (Hopper warpgroup MMA and TMA)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}; the sm_90 prefill kernel takes bfloat16 and float16"
    if (head_dim_qk, head_dim_v) != (NOPE_DIM + ROPE_DIM, HEAD_DIM_V):
        return (f"head dims {head_dim_qk} / {head_dim_v}; the sm_90 prefill kernel takes MLA's "
                f"{NOPE_DIM + ROPE_DIM} / {HEAD_DIM_V}")
    return ""


if gluon is not None:
    _CU_SEQLENS_ERROR = gl.constexpr(errors.CU_SEQLENS)
    _CONSUMER_REGS = gl.constexpr(240)
    _ITEM_FIELDS = gl.constexpr(ITEM_FIELDS)
    _LOADER_REGS = gl.constexpr(24)

    @gluon.jit
    def _item(round, num_programs):
        """The work item a program takes in `round`: programs walk the items in rounds of the grid's size, in
        alternate directions (a program that takes a long causal tile in one round takes a short one next)."""
        pid = gl.program_id(0)
        return round * num_programs + gl.where(round % 2 == 0, pid, num_programs - 1 - pid)

    @gluon.jit
    def _publish_item(item_smem, item_ready, item_empty, n, fields):
        """The loader hands the consumers its n-th work item through a ring of two slots: `_place`'s item,
        query tile, head and sequence and the sequence's four boundaries, which the loader has read already (the
        consumers would otherwise wait for those loads at the start of every item)."""
        slot = n % 2
        mbarrier.wait(item_empty.index(slot), ((n // 2) & 1) ^ 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        for j in gl.static_range(_ITEM_FIELDS):
            item_smem.index(slot).slice(j, 1).store(gl.zeros([1], gl.int32, layout) + fields[j])
        _cta_barrier()
        mbarrier.arrive(item_ready.index(slot), count=1)

    @gluon.jit
    def _fetch_add(Counter):
        """Lane 0 of the loader warp adds 1 to the counter (relaxed, no fence: nothing else is ordered by it)
        and gets its old value, the other lanes 0: [32] int32, one a lane. Its use (`gl.sum`) is where the warp
        waits for the atomic, so it can be issued early; Triton's scalar atomic waits at once, to broadcast
        its value through shared memory."""
        lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        return gl.inline_asm_elementwise(
            "{ .reg .pred first; mov.u32 $0, 0; setp.eq.u32 first, $2, 0; "
            "@first atom.global.relaxed.gpu.add.u32 $0, [$1], 1; }",
            "=r,l,r", [Counter + lanes * 0, lanes],
            dtype=gl.int32, is_pure=False, pack=1,
        )

    @gluon.jit
    def _take_item(item_smem, item_ready, item_empty, n):
        """A consumer warpgroup's n-th work item, from the loader's ring (`_publish_item`): (item, pid_m, head,
        batch, q_start, q_end, k_start, k_end)."""
        slot = n % 2
        mbarrier.wait(item_ready.index(slot), (n // 2) & 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        row = item_smem.index(slot)
        fields = (
            gl.max(row.slice(0, 1).load(layout), 0), gl.max(row.slice(1, 1).load(layout), 0),
            gl.max(row.slice(2, 1).load(layout), 0), gl.max(row.slice(3, 1).load(layout), 0),
            gl.max(row.slice(4, 1).load(layout), 0), gl.max(row.slice(5, 1).load(layout), 0),
            gl.max(row.slice(6, 1).load(layout), 0), gl.max(row.slice(7, 1).load(layout), 0),
        )
        _cta_barrier()  # every thread has read the slot before it is handed back
        mbarrier.arrive(item_empty.index(slot), count=1)
        return fields

    @gluon.jit
    def _sequence(item, Cu_q, Cu_k, num_m_blocks, num_heads, num_items, band, CAUSAL: gl.constexpr,
                  BANDED: gl.constexpr):
        """Work item `item`'s fields (`ITEM_FIELDS`): the item, its query tile, head and sequence (`_place`) and
        the sequence's query and key boundaries, read by the loader and handed to the consumers
        (`_publish_item`)."""
        valid, pid_m, head, batch = _place(item, num_m_blocks, num_heads, num_items, band, CAUSAL, BANDED)
        q_start = gl.load(Cu_q + batch)
        q_end = gl.load(Cu_q + batch + 1)
        k_start = gl.load(Cu_k + batch)
        k_end = gl.load(Cu_k + batch + 1)
        return (item, pid_m, head, batch, q_start, q_end, k_start, k_end)

    @gluon.jit
    def _place(item, num_m_blocks, num_heads, num_items, band, CAUSAL: gl.constexpr, BANDED: gl.constexpr):
        """(valid, query tile, head, sequence) of work item `item`. The (sequence, head) pairs go in bands
        (`band`: the pairs a band, the pairs of a smaller first band where that does not divide them, and both
        bands' items, kernel arguments that are read where used, not held in registers), each band's items
        query tile by query tile: bands of 1 put the query tiles of one head of one sequence side by side; a
        wider band sorts the dynamic schedule's items by cost (causal tiles run in reverse order, the longest
        rows first), so that the last band ends with its cheapest tiles. BANDED False: bands of 1, whatever
        `band` says."""
        valid = item < num_items
        item = gl.where(valid, item, 0)
        if BANDED:
            pairs, first, first_items, band_items = band
            in_first = item < first_items
            rest = item - first_items
            in_band = gl.where(in_first, item, rest % band_items)
            band_pairs = gl.where(in_first, first, pairs)
            pid_m = in_band // band_pairs
            pair = gl.where(in_first, 0, first + rest // band_items * pairs) + in_band % band_pairs
        else:
            pid_m = item % num_m_blocks
            pair = item // num_m_blocks
        head = pair % num_heads
        batch = pair // num_heads
        if CAUSAL:
            pid_m = num_m_blocks - 1 - pid_m
        return valid, pid_m, head, batch

    @gluon.jit
    def _bounds(fields, total_q, total_k, max_seqlen_q, max_seqlen_k, num_items, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """A work item's rows and keys from its `_sequence` fields: (q_start, q_end, lq, k_start, lk, m0, head,
        bad, num_tiles). A bad sequence (boundaries not non-decreasing inside the tensors, a length over its
        bound) and an item past the last get no tile."""
        item, pid_m, head, batch, q_start, q_end, k_start, k_end = fields
        valid = item < num_items
        # as the Triton kernel: the first sequence starts at 0, each range lies ordered inside its tensor
        bad = ((batch == 0) & ((q_start != 0) | (k_start != 0))) | (q_start < 0) | (q_end < q_start) | (q_end > total_q)
        bad = bad | (k_start < 0) | (k_end < k_start) | (k_end > total_k)
        bad = (bad | (q_end - q_start > max_seqlen_q) | (k_end - k_start > max_seqlen_k)) & valid
        lq = gl.where(bad, 0, gl.where(valid, q_end - q_start, 0))
        lk = gl.where(bad, 0, k_end - k_start)
        m0 = pid_m * BLOCK_M
        n_keys = lk
        if CAUSAL:
            last_row = gl.minimum(m0 + BLOCK_M, lq) - 1
            n_keys = gl.maximum(gl.minimum(lk, last_row + lk - lq + 1), 0)
        n_keys = gl.where(m0 < lq, n_keys, 0)
        num_tiles = (n_keys + BLOCK_N - 1) // BLOCK_N
        return q_start, q_end, lq, k_start, lk, m0, head, bad, num_tiles

    @gluon.jit
    def _load_item(bufs, Q_desc, QP_desc, KN_desc, KP_desc, V_desc, Cu_q, Cu_k, total_q, total_k, max_seqlen_q,
                   max_seqlen_k, num_m_blocks, num_heads, num_items, q_head_stride, kn_head_stride, kp_head_stride,
                   kp_offset, v_head_stride, group, band, item, n, kv_count, q_count, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, BANDED: gl.constexpr):
        """One work item, the program's n-th: its fields to the consumers (`_publish_item`), then every K / V
        tile into the ring and, after the first, the query tile once its buffer is free. Returns the K / V
        tiles and query tiles loaded so far."""
        q_smem, qp_smem, kn_smem, kp_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty = bufs[:11]
        item_smem, item_ready, item_empty = bufs[12:]
        Q_BYTES: gl.constexpr = BLOCK_M * (q_smem.shape[1] + qp_smem.shape[1]) * q_smem.dtype.primitive_bitwidth // 8
        K_BYTES: gl.constexpr = BLOCK_N * (kn_smem.shape[2] + kp_smem.shape[2]) * kn_smem.dtype.primitive_bitwidth // 8
        V_BYTES: gl.constexpr = BLOCK_N * v_smem.shape[2] * v_smem.dtype.primitive_bitwidth // 8
        fields = _sequence(item, Cu_q, Cu_k, num_m_blocks, num_heads, num_items, band, CAUSAL, BANDED)
        _publish_item(item_smem, item_ready, item_empty, n, fields)
        q_start, q_end, lq, k_start, lk, m0, head, bad, num_tiles = _bounds(
            fields, total_q, total_k, max_seqlen_q, max_seqlen_k, num_items, BLOCK_M, BLOCK_N, CAUSAL
        )
        kv_head = head // group
        for tile in range(num_tiles):
            slot = kv_count % STAGES
            phase = ((kv_count // STAGES) & 1) ^ 1
            row = k_start + tile * BLOCK_N
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_ready.index(slot), K_BYTES)
            _tma_load(KN_desc, [row, kv_head * kn_head_stride], k_ready.index(slot), kn_smem.index(slot))
            _tma_load(KP_desc, [row, kv_head * kp_head_stride + kp_offset], k_ready.index(slot),
                      kp_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_ready.index(slot), V_BYTES)
            _tma_load(V_desc, [row, kv_head * v_head_stride], v_ready.index(slot), v_smem.index(slot))
            kv_count += 1
            if tile == 0:
                # the query tile after the item's first K / V tile: their ring slot frees before the query
                # buffer does (the previous item's last scores), so they no longer queue behind it
                # (bench/RESULTS.md: 16 x 512 at 128 heads 1-1.7 % faster, the other shapes unchanged)
                mbarrier.wait(q_empty, (q_count & 1) ^ 1)
                mbarrier.expect(q_bar, Q_BYTES)
                _tma_load(Q_desc, [q_start + m0, head * q_head_stride], q_bar, q_smem)
                _tma_load(QP_desc, [q_start + m0, head * q_head_stride + q_smem.shape[1]], q_bar, qp_smem)
                q_count += 1
        return kv_count, q_count

    @gluon.jit
    def _load_partition(bufs, Q_desc, QP_desc, KN_desc, KP_desc, V_desc, Cu_q, Cu_k, total_q, total_k,
                        max_seqlen_q, max_seqlen_k, num_m_blocks, num_heads, num_items, q_head_stride,
                        kn_head_stride, kp_head_stride, kp_offset, v_head_stride, group, band, Counter,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        DYNAMIC: gl.constexpr):
        """The loader warp: each of the program's work items (`_load_item`; the ring runs on across items: the
        next item's first tiles arrive while the consumers finish this one), handed to the consumers through the
        item ring, then an item past the last, which stops them. DYNAMIC: the items after the first come from
        the launch's counter (`Counter[0]`, taken with an atomic add as the item before starts loading); the
        program that finishes last puts the counter back to 0 for the next launch (`Counter[1]` counts the
        finished programs). Otherwise the fixed order of `_item`."""
        item_smem, item_ready, item_empty = bufs[12:]
        num_programs = gl.num_programs(0)
        kv_count = 0  # K / V tiles loaded so far: their ring slot and phase
        q_count = 0  # query tiles loaded so far
        n = 0  # items handed to the consumers so far
        if DYNAMIC:
            item = gl.program_id(0)
            while item < num_items:
                taken = _fetch_add(Counter)  # in flight during the item's loads
                kv_count, q_count = _load_item(
                    bufs, Q_desc, QP_desc, KN_desc, KP_desc, V_desc, Cu_q, Cu_k, total_q, total_k, max_seqlen_q,
                    max_seqlen_k, num_m_blocks, num_heads, num_items, q_head_stride, kn_head_stride, kp_head_stride,
                    kp_offset, v_head_stride, group, band, item, n, kv_count, q_count, BLOCK_M, BLOCK_N, STAGES,
                    CAUSAL, CAUSAL)
                item = num_programs + gl.sum(taken, 0)
                n += 1
        else:
            for round in range(gl.cdiv(num_items, num_programs)):
                kv_count, q_count = _load_item(
                    bufs, Q_desc, QP_desc, KN_desc, KP_desc, V_desc, Cu_q, Cu_k, total_q, total_k, max_seqlen_q,
                    max_seqlen_k, num_m_blocks, num_heads, num_items, q_head_stride, kn_head_stride, kp_head_stride,
                    kp_offset, v_head_stride, group, band, _item(round, num_programs), n, kv_count, q_count, BLOCK_M,
                    BLOCK_N, STAGES, CAUSAL, False)
                n += 1
        # past the last item: the consumers stop (in the fixed order they may have stopped at the last round's
        # item past the last already; this one is then never taken)
        _publish_item(item_smem, item_ready, item_empty, n, (num_items, 0, 0, 0, 0, 0, 0, 0))
        if DYNAMIC:
            # (acquire and release: this program's item fetches come before it, the reset after it)
            if gl.atomic_add(Counter + 1, 1, sem="acq_rel") == num_programs - 1:
                # every program has taken its last item: the counter is free for the next launch
                gl.atomic_xchg(Counter, 0, sem="relaxed")
                gl.atomic_xchg(Counter + 1, 0, sem="relaxed")

    @gluon.jit
    def _row_max(s):
        """max over the columns of a [rows, 128] accumulator tile as a tree: the column bits a thread holds in
        its registers (64, 32, 16, 8) halved one at a time (independent maxima, free splits of register
        dimensions), then the last 8 columns (one register bit, two lane bits) by `gl.max`. `gl.max` alone
        reduces a thread's 32 values a row in one dependent chain, on the path from the scores to P."""
        x = _halve_max(_halve_max(_halve_max(_halve_max(s))))
        return gl.convert_layout(gl.max(x, 1), gl.SliceLayout(1, s.type.layout))

    @gluon.jit
    def _column_halves(x):
        """[rows, n] -> the two [rows, n / 2] halves of its columns, their top column bit split off (free where
        that bit lies in each thread's registers, as in the MMA accumulator's layout)."""
        return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))

    @gluon.jit
    def _halve_max(x):
        """[rows, n] -> [rows, n / 2]: the maxima of the two halves of the columns."""
        a, b = _column_halves(x)
        return gl.maximum(a, b)

    @gluon.jit
    def _softmax_tile(s, tile, m_i, l_i, lk, diagonal_from, row_keys, qk_scale, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr, cols_s: gl.constexpr):
        """One key tile's online softmax in base 2: the masked, scaled scores' probabilities p, the new running
        maximum and sum, and alpha, the factor that rescales what was accumulated before. The maximum is
        taken over the raw scores and scaled once a row (qk_scale > 0), so that each probability costs one
        fused multiply-add before its exponential."""
        key0 = tile * BLOCK_N
        needs_mask = key0 + BLOCK_N > lk
        if CAUSAL:
            needs_mask = needs_mask | (key0 + BLOCK_N - 1 > diagonal_from)
        if needs_mask:
            keys = key0 + gl.arange(0, BLOCK_N, layout=cols_s)
            s = gl.where(keys[None, :] < row_keys[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, _row_max(s) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s * qk_scale - m_safe[:, None])
        return p, m_new, alpha, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _scores(q_half, qp_half, kn, kp, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """A key tile's scores S = Q K^T, issued asynchronously: the non-rotary and the rotary columns as two
        warpgroup products into one accumulator."""
        s = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
        s = warpgroup_mma(q_half, kn.permute((1, 0)), s, use_acc=False, is_async=True)
        return warpgroup_mma(qp_half, kp.permute((1, 0)), s, is_async=True)

    @gluon.constexpr_function
    def _o_store_layout(half_m, cols):
        """[64 rows, 64 columns] of a warpgroup's output with 8 consecutive columns in each thread's
        registers, 8 lanes along a row and two more row bits in the lanes, so that each store of a warp
        writes four whole 128-byte row pieces (the accumulator's own layout writes 16 bytes of each 32-byte
        sector a store: every sector of the output reached L2 twice).  Its warps keep the accumulator's
        16-row bands, so each warp reads back only the rows it staged."""
        assert half_m == 64 and cols == 64, "the output store layout is for 64 x 64 pieces"
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [4, 0], [8, 0]],
            lane_bases=[[0, 8], [0, 16], [0, 32], [1, 0], [2, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[half_m, cols],
        )

    @gluon.jit
    def _store_staged(o16, o_stage, Out, q_start, first_row, lq, head, stride_o_t, stride_o_h, O_desc,
                      TMA_OUT: gl.constexpr):
        """A warpgroup's output tile [64, 128] (16-bit, the accumulator's layout) stored to global memory
        through its 8 KiB staging buffer, 64 columns at a time: TMA_OUT and the tile's rows all inside the
        sequence, by TMA stores from the buffer (the warpgroup waits only for the first half to be read
        before it stages the second, and for the second at its next tile); otherwise read back in 16-byte
        pieces of rows and stored with the rows masked."""
        HALF_M: gl.constexpr = o16.shape[0]
        HEAD_V: gl.constexpr = o16.shape[1]
        PIECE: gl.constexpr = HEAD_V // 2
        lo, hi = _column_halves(o16)
        if TMA_OUT:
            tma.store_wait(0)  # the last tile's second half has been read from the buffer
            _cta_barrier()
        if TMA_OUT and first_row + HALF_M <= lq:
            row = q_start + first_row
            o_stage.store(lo)
            fence_async_shared()
            _cta_barrier()
            _tma_store(O_desc, [row, head * stride_o_h], o_stage)
            tma.store_wait(0)
            _cta_barrier()
            o_stage.store(hi)
            fence_async_shared()
            _cta_barrier()
            _tma_store(O_desc, [row, head * stride_o_h + PIECE], o_stage)
        else:
            layout: gl.constexpr = _o_store_layout(HALF_M, PIECE)
            rows = first_row + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
            cols = gl.arange(0, PIECE, layout=gl.SliceLayout(0, layout))
            ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_o_t + head * stride_o_h + cols[None, :]
            mask = (rows < lq)[:, None]
            o_stage.store(lo)
            _cta_barrier()
            staged = o_stage.load(layout)
            _cta_barrier()
            gl.store(ptrs, staged, mask=mask)
            o_stage.store(hi)
            _cta_barrier()
            staged = o_stage.load(layout)
            _cta_barrier()
            gl.store(ptrs + PIECE, staged, mask=mask)

    @gluon.jit
    def _consume(HALF: gl.constexpr, bufs, Out, Lse, Error_flag, qk_scale, total_q, total_k, max_seqlen_q,
                 max_seqlen_k, num_m_blocks, num_items, stride_o_t, stride_o_h, stride_lse_h, O_desc,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 STORE_LSE: gl.constexpr, MERGE: gl.constexpr, TMA_OUT: gl.constexpr):
        """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of each query tile the loader hands it
        (`_take_item`). MERGE: the result is merged into the one already in Out / Lse (over other keys) by
        their LSEs, in place."""
        (q_smem, qp_smem, kn_smem, kp_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_stage,
         item_smem, item_ready, item_empty) = bufs
        HALF_M: gl.constexpr = BLOCK_M // 2
        HEAD_V: gl.constexpr = v_smem.shape[2]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HEAD_V, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        q_half = q_smem.slice(HALF * HALF_M, HALF_M, dim=0)
        qp_half = qp_smem.slice(HALF * HALF_M, HALF_M, dim=0)
        kv_count = 0  # K / V tiles consumed before this item (the loader's order)
        q_count = 0
        n = 0  # items taken so far
        fields = _take_item(item_smem, item_ready, item_empty, 0)
        while fields[0] < num_items:
            q_start, q_end, lq, k_start, lk, m0, head, bad, num_tiles = _bounds(
                fields, total_q, total_k, max_seqlen_q, max_seqlen_k, num_items, BLOCK_M, BLOCK_N, CAUSAL
            )
            first_row = m0 + HALF * HALF_M
            rows = first_row + gl.arange(0, HALF_M, layout=rows_s)
            # the last key each row sees, plus one (bottom-right causal alignment)
            if CAUSAL:
                row_keys = gl.minimum(rows + lk - lq + 1, lk)
            else:
                row_keys = gl.zeros([HALF_M], gl.int32, layout=rows_s) + lk
            diagonal_from = first_row + lk - lq  # tiles whose last key lies past this need the causal mask
            m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=rows_s)
            l_i = gl.zeros([HALF_M], gl.float32, layout=rows_s)
            acc = gl.zeros([HALF_M, HEAD_V], gl.float32, layout=o_layout)
            # FlashAttention-3's intra-warpgroup overlap: tile j's scores are issued before tile j-1's P V, and
            # tile j's softmax runs while that product is in flight
            p16 = gl.zeros([HALF_M, BLOCK_N], dtype, layout=p_layout)
            if num_tiles > 0:
                mbarrier.wait(q_bar, q_count & 1)
                slot = kv_count % STAGES
                mbarrier.wait(k_ready.index(slot), (kv_count // STAGES) & 1)
                s = _scores(q_half, qp_half, kn_smem.index(slot), kp_smem.index(slot), HALF_M, BLOCK_N, s_layout)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                mbarrier.arrive(k_empty.index(slot), count=1)
                p, m_i, alpha, l_i = _softmax_tile(s, 0, m_i, l_i, lk, diagonal_from, row_keys, qk_scale,
                                                   BLOCK_N, CAUSAL, cols_s)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
            for tile in range(1, num_tiles):
                count = kv_count + tile
                slot = count % STAGES
                prev = (count - 1) % STAGES
                mbarrier.wait(k_ready.index(slot), (count // STAGES) & 1)
                s = _scores(q_half, qp_half, kn_smem.index(slot), kp_smem.index(slot), HALF_M, BLOCK_N, s_layout)
                mbarrier.wait(v_ready.index(prev), ((count - 1) // STAGES) & 1)
                acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                mbarrier.arrive(k_empty.index(slot), count=1)
                p, m_i, alpha, l_i = _softmax_tile(s, tile, m_i, l_i, lk, diagonal_from, row_keys, qk_scale,
                                                   BLOCK_N, CAUSAL, cols_s)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
                p16 = gl.convert_layout(p.to(dtype), p_layout)
            if num_tiles > 0:
                mbarrier.arrive(q_empty, count=1)  # every score of this item is in: the next query tile may load
                count = kv_count + num_tiles - 1
                last = count % STAGES
                mbarrier.wait(v_ready.index(last), (count // STAGES) & 1)
                acc = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(v_empty.index(last), count=1)
                q_count += 1
            kv_count += num_tiles

            o_cols = gl.arange(0, HEAD_V, layout=cols_o)
            if bad:
                # as the Triton kernel: NaN in every row of the sequence's range that lies inside the tensor (this
                # item's tiles of it: m0, m0 + the query tiles, ...), the error flag once
                gl.atomic_or(Error_flag, _CU_SEQLENS_ERROR, mask=(HALF == 0) & (m0 == 0) & (head == 0))
                row_lo = gl.minimum(gl.maximum(q_start, 0), total_q)
                row_hi = gl.maximum(gl.minimum(q_end, total_q), row_lo)
                nan_tile = gl.full([HALF_M, HEAD_V], float("nan"), dtype, layout=o_layout)
                for tile_row0 in range(row_lo + m0 + HALF * HALF_M, row_hi,
                                       num_m_blocks * BLOCK_M):
                    bad_rows = tile_row0 + gl.arange(0, HALF_M, layout=rows_o)
                    o_ptrs = Out + bad_rows.to(gl.int64)[:, None] * stride_o_t + head * stride_o_h + o_cols[None, :]
                    gl.store(o_ptrs, nan_tile, mask=(bad_rows < row_hi)[:, None])
                    if STORE_LSE:
                        gl.store(Lse + head * stride_lse_h + bad_rows,
                                 gl.full([HALF_M], float("nan"), gl.float32, layout=rows_o), mask=bad_rows < row_hi)
            else:
                # rows with no key: output 0, LSE -inf
                empty_row = l_i == 0.0
                inv_l = gl.where(empty_row, 0.0, 1.0 / l_i)
                lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
                out = acc * gl.convert_layout(inv_l, rows_o)[:, None]
                o_rows = first_row + gl.arange(0, HALF_M, layout=rows_o)
                row_in = o_rows < lq
                o_ptrs = Out + (q_start + o_rows).to(gl.int64)[:, None] * stride_o_t + head * stride_o_h + o_cols[None, :]
                if MERGE:
                    # `merge.merge_scales`, as the Triton kernel's merge and `merge_attn_states`
                    lse_ptrs = Lse + head * stride_lse_h + q_start + o_rows
                    scale_prev, scale_new, lse_o = merge_scales(gl.load(lse_ptrs, mask=row_in, other=float("-inf")),
                                                                gl.convert_layout(lse, rows_o))
                    o_prev = gl.load(o_ptrs, mask=row_in[:, None], other=0.0).to(gl.float32)
                    out = gl.where((scale_new > 0.0)[:, None], out * scale_new[:, None], 0.0) + gl.where(
                        (scale_prev > 0.0)[:, None], o_prev * scale_prev[:, None], 0.0
                    )
                    gl.store(o_ptrs, out.to(dtype), mask=row_in[:, None])
                    gl.store(lse_ptrs, lse_o, mask=row_in)
                else:
                    _store_staged(out.to(dtype), o_stage.index(HALF), Out, q_start, first_row, lq, head, stride_o_t,
                                  stride_o_h, O_desc, TMA_OUT)
                    if STORE_LSE:
                        gl.store(Lse + head * stride_lse_h + q_start + rows, lse, mask=rows < lq)
            n += 1
            fields = _take_item(item_smem, item_ready, item_empty, n)
        if TMA_OUT:
            tma.store_wait(0)  # the last tile's stores have read the staging buffer before the program ends

    @gluon.jit
    def _prefill_wgmma_kernel(
        Q_desc, QP_desc, KN_desc, KP_desc, V_desc, O_desc, Out, Lse, Cu_q, Cu_k, Error_flag, Counter,
        qk_scale, total_q, total_k, max_seqlen_q, max_seqlen_k, num_m_blocks, num_heads, batch,
        q_head_stride, kn_head_stride, kp_head_stride, kp_offset, v_head_stride, group,
        stride_o_t, stride_o_h, stride_lse_h, band_pairs, band_first, band_first_items, band_items,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        STORE_LSE: gl.constexpr, MERGE: gl.constexpr = False, DYNAMIC: gl.constexpr = False,
        TMA_OUT: gl.constexpr = False,
    ):
        dtype: gl.constexpr = Q_desc.dtype
        NOPE: gl.constexpr = Q_desc.block_type.shape[1]
        ROPE: gl.constexpr = QP_desc.block_type.shape[1]
        HEAD_V: gl.constexpr = V_desc.block_type.shape[1]
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, NOPE], Q_desc.layout)
        qp_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], QP_desc.layout)
        kn_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, NOPE], KN_desc.layout)
        kp_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], KP_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_V], V_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=2)  # both consumer warpgroups are done with the query tile
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumer warpgroups release a stage
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()
        # each consumer warpgroup's output staging (64 rows x 64 columns: `_store_staged`)
        o_stage = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, HEAD_V // 2], O_desc.layout)
        # the work items the loader takes from the launch's counter (DYNAMIC), handed to the consumers
        item_smem = gl.allocate_shared_memory(gl.int32, [2, _ITEM_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_empty.index(i), count=2)
        fence_async_shared()
        bufs = (q_smem, qp_smem, kn_smem, kp_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_stage,
                item_smem, item_ready, item_empty)
        num_items = num_m_blocks * num_heads * batch
        band = (band_pairs, band_first, band_first_items, band_items)  # `band_arguments`
        gl.warp_specialize(
            [
                (_consume, (0, bufs, Out, Lse, Error_flag, qk_scale, total_q, total_k, max_seqlen_q, max_seqlen_k,
                            num_m_blocks, num_items, stride_o_t, stride_o_h, stride_lse_h, O_desc, BLOCK_M, BLOCK_N,
                            STAGES, CAUSAL, STORE_LSE, MERGE, TMA_OUT)),
                (_consume, (1, bufs, Out, Lse, Error_flag, qk_scale, total_q, total_k, max_seqlen_q, max_seqlen_k,
                            num_m_blocks, num_items, stride_o_t, stride_o_h, stride_lse_h, O_desc, BLOCK_M, BLOCK_N,
                            STAGES, CAUSAL, STORE_LSE, MERGE, TMA_OUT)),
                (_load_partition, (bufs, Q_desc, QP_desc, KN_desc, KP_desc, V_desc, Cu_q, Cu_k, total_q, total_k,
                                   max_seqlen_q, max_seqlen_k, num_m_blocks, num_heads, num_items, q_head_stride,
                                   kn_head_stride,
                                   kp_head_stride, kp_offset, v_head_stride, group, band, Counter, BLOCK_M,
                                   BLOCK_N, STAGES, CAUSAL, DYNAMIC)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _LOADER_REGS],
        )


# (address, shape, strides, dtype, block) -> a descriptor over a `_CacheBase` (the address alone, the tensor not
# kept alive): the workspace's buffers come back at the same addresses layer after layer and step after step
_DESCRIPTORS: dict = {}
_DESCRIPTORS_MAX = 256


def _descriptor(tensor: torch.Tensor, block: list[int]):
    """A TMA descriptor over `tensor` [rows, heads, dim] (or [rows, dim]) viewed as [rows, columns]: the row
    stride of dim 0, every head's columns side by side; blocks of `block` = [rows, columns]."""
    key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, *block)
    found = _DESCRIPTORS.get(key)
    if found is None:
        width = (tensor.shape[1] - 1) * tensor.stride(1) + tensor.shape[2] if tensor.dim() == 3 else tensor.shape[1]
        found = _TensorDescriptor(_CacheBase(tensor), [tensor.shape[0], width], [tensor.stride(0), 1], block,
                                  _stage_layout(block[1], tensor.element_size() * 8))
        if len(_DESCRIPTORS) >= _DESCRIPTORS_MAX:
            _DESCRIPTORS.clear()
        _DESCRIPTORS[key] = found
    return found


def takes(q, k, v, k_pe, platform) -> bool:
    """Whether `prefill.varlen_attention` hands these tensors to this kernel as they are: CUDA tensors and
    `takes_reason` empty (see `query_for_kernel` for a query whose layout alone keeps it out)."""
    return q.device.type == "cuda" and not takes_reason(q, k, v, k_pe, platform)


def takes_reason(q, k, v, k_pe, platform, *, query_layout: bool = True) -> str:
    """Why this kernel does not take these tensors ("" where it does; their device is the caller's to check):
    `wgmma_prefill_reason`, at least a tile of queries and of keys, the key's split, and every tensor's layout
    (`layout_reason`: its rows on 16 bytes, each token's heads side by side, for TMA). query_layout=False
    leaves q's layout out: the reason for a contiguous copy of q."""
    why = wgmma_prefill_reason(platform, q.dtype, q.shape[2], v.shape[2])
    if why:
        return why
    if q.shape[0] < BLOCK_M or k.shape[0] < BLOCK_N:
        return f"{q.shape[0]} queries / {k.shape[0]} keys: fewer than a tile ({BLOCK_M} / {BLOCK_N})"
    if k.shape[2] != (NOPE_DIM if k_pe is not None else NOPE_DIM + ROPE_DIM):
        return f"k has {k.shape[2]} columns a head; accepted: {NOPE_DIM} with k_pe apart, else {NOPE_DIM + ROPE_DIM}"
    if k_pe is not None and k_pe.dim() == 3 and k_pe.shape[1] > 1:  # a rotary key per head: not run on a GPU yet
        return "a rotary key per head (k_pe [S, heads, 64]): not run on a GPU yet"
    for name, tensor in (("q", q), ("k", k), ("v", v), ("k_pe", k_pe)):
        if tensor is None or (name == "q" and not query_layout):
            continue
        why = layout_reason(tensor)
        if why:
            return f"{name}: {why}"
    return ""


def layout_reason(tensor: torch.Tensor) -> str:
    """Why the kernel's TMA descriptors cannot read `tensor` ([rows, heads, dim] or [rows, dim]) where it lies
    ("" where they can): each descriptor views it as [rows, columns] with the row stride of dim 0, so its
    address and row stride must be multiples of 16 bytes, its last dimension contiguous and each row's heads
    side by side (`_rows_of_heads`). A [T, N, D] view of a [N, T, D] tensor (transformers' query,
    ``query_states[0].transpose(0, 1)``) is not: its heads lie T rows apart."""
    if tensor.stride(-1) != 1:
        return f"strides {tuple(tensor.stride())}: the last dimension is not contiguous"
    if tensor.data_ptr() % 16 or (tensor.stride(0) * tensor.element_size()) % 16:
        return (f"address {tensor.data_ptr()} / row stride {tensor.stride(0)}: rows do not start on 16 bytes")
    if not _rows_of_heads(tensor):
        return (f"shape {tuple(tensor.shape)} with strides {tuple(tensor.stride())}: each row's heads do not lie "
                "side by side (heads outermost, as a [T, N, D] view of a [N, T, D] tensor)")
    return ""


def query_for_kernel(q, k, v, k_pe, platform) -> torch.Tensor | None:
    """The query `prefill.varlen_attention`'s default launch gives this kernel: q itself where `takes` holds; a
    contiguous copy of q where only q's layout keeps the kernel from it (transformers' query is a [T, N, 192]
    view of [1, N, T, 192]: copied once, T x N x 192 values read and written, where the kernel reads each
    query tile once and its K and V once a tile: the Triton kernel it would otherwise fall back to is 1.14-1.27x
    this one's time); None where the kernel does not take these tensors. Their device is the caller's to check
    (`prefill._sm90_kernel` asks for CUDA tensors only)."""
    why = takes_reason(q, k, v, k_pe, platform)
    if not why:
        return q
    if why.startswith("q: ") and not takes_reason(q, k, v, k_pe, platform, query_layout=False):
        return q.contiguous()
    return None


def _tma_rows(out: torch.Tensor) -> bool:
    """Whether TMA can store into `out` [rows, heads, 128]: its columns contiguous, its address and row stride
    on 16 bytes."""
    return (out.stride(2) == 1 and out.data_ptr() % 16 == 0 and (out.stride(0) * out.element_size()) % 16 == 0
            and (out.stride(1) * out.element_size()) % 16 == 0 and _rows_of_heads(out))


# whether each token's heads lie side by side inside its row, as the descriptors view the tensor
_rows_of_heads = rows_of_heads


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# device -> (int32 [2 * COUNTER_SLOTS] zeros, {raw stream: the stream's [2] view})
_COUNTERS: dict = {}


def _schedule_counter(device: torch.device) -> torch.Tensor | None:
    """The dynamic schedule's counter of the current stream of `device` (the item counter and the finished
    programs; zero between launches: the last program of each launch puts it back), or None where there is
    none: its device's counters would have to be made while a stream is captured (the graph would zero them
    on each replay only), or every slot has its stream. Each stream gets its own: launches on two streams may
    overlap, launches on one stream do not. A captured launch keeps the counter of the stream it was captured
    on: replaying its graph on another stream while the capture stream runs this kernel would share it."""
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    entry = _COUNTERS.get(device)
    if entry is not None:
        view = entry[1].get(stream)
        if view is not None:
            return view
    elif capturing_on(device):
        return None
    else:
        entry = _COUNTERS[device] = (torch.zeros(2 * COUNTER_SLOTS, dtype=torch.int32, device=device), {})
    counters, views = entry
    if len(views) >= COUNTER_SLOTS:
        return None
    view = views[stream] = counters[2 * len(views):2 * len(views) + 2]
    return view


def varlen_attention_wgmma(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                           *, causal: bool, out=None, lse=None, return_lse: bool = True, error_flag=None, k_pe=None,
                           merge: bool = False, block_n: int = BLOCK_N, stages: int = STAGES,
                           persistent: bool | None = None, dynamic: bool | None = None, band: int | None = None):
    """`prefill.varlen_attention` on the sm_90 kernel: q [T, N, 192], k [S, Nk, 192] or, with
    k_pe [S, 64] (or [S, 1, 64]), [S, Nk, 128]; v [S, Nk, 128]; the inputs checked as there.  Every
    tensor's rows must start on 16 bytes (TMA); `wgmma_prefill_reason` says where the kernel runs.

    persistent: one program per SM walking the work items (query tile, head, sequence), the next item's
    tiles loading while this one finishes; False: one program per item, scheduled by the hardware;
    None: persistent where the items are taken dynamically, else where the sequences are short
    (`PERSISTENT_MAX_SEQLEN_Q`).  dynamic: a persistent launch's programs take their next item from a
    counter as they finish one (`_schedule_counter`), in bands of `band` (sequence, head) pairs whose items
    are sorted by cost (None: `band_of`); False: each program walks its items in a fixed order (`_item`),
    which balances equal sequences up to `PERSISTENT_MAX_SEQLEN_Q` but leaves programs finishing apart on
    ragged batches and long sequences; None: `takes_dynamic`."""
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, k_pe)
    if merge and (out is None or lse is None or not return_lse):
        raise ValueError("merge=True needs out and lse holding the result to merge into, and return_lse=True")
    for name, tensor in (("q", q), ("k", k), ("v", v), ("k_pe", k_pe)):
        if tensor is not None and (tensor.data_ptr() % 16 or (tensor.stride(0) * tensor.element_size()) % 16):
            raise ValueError(f"{name} rows do not start on 16 bytes (address {tensor.data_ptr()}, row stride "
                             f"{tensor.stride(0)}); accepted by the TMA kernel: 16-byte aligned rows")
    if error_flag is None:
        error_flag = errors.error_flag(q.device)
    num_tokens, num_heads, _ = q.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, HEAD_DIM_V), dtype=q.dtype, device=q.device)
    if return_lse and lse is None:
        lse = torch.empty((num_heads, num_tokens), dtype=torch.float32, device=q.device)
    if cu_seqlens_q.numel() == 1 or num_heads == 0 or num_tokens == 0:
        return out, (lse if return_lse else None)
    launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, out, lse if return_lse else None,
           error_flag, k_pe, merge, block_n, stages, persistent, dynamic, band)
    return out, (lse if return_lse else None)


# (dtypes, block, stages, modes, pointer alignments, integer specialisations, device) -> its BoundLaunch: the
# kernel bound once and launched directly after (`mla_multi.kernels.launch`); the grid is set per call
_LAUNCHES: dict = {}
_LAUNCHES_MAX = 64


def _int_key(values) -> tuple:
    """What Triton specialises an integer argument on (equal to 1, a multiple of 16, 32 or 64 bits)."""
    return tuple((value == 1, value % 16 == 0, -(2**31) <= value < 2**31) for value in values)


def takes_dynamic(total_q: int, total_k: int, batch: int, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """Whether the default launch takes its items dynamically: everywhere but batches of equal sequences (every
    query and key row inside a sequence of the longest length) up to `PERSISTENT_MAX_SEQLEN_Q`, which the
    fixed order balances by construction (each program alternates long and short causal tiles) and runs 0-6 %
    faster (bench/RESULTS.md); a ragged batch ran 7-10 % faster dynamically, one sequence of 8192 8 % faster
    than one program per item."""
    equal = total_q == batch * max_seqlen_q and total_k == batch * max_seqlen_k
    return not (equal and max_seqlen_q <= PERSISTENT_MAX_SEQLEN_Q)


def band_of(grid: int, num_m_blocks: int, max_seqlen_k: int, causal: bool) -> int:
    """The (sequence, head) pairs a band of the dynamic schedule (`_sequence`). Causal: enough pairs that a band
    holds `BAND_ROUNDS` rounds of the grid, its items sorted by cost, so that the last items taken are the
    cheapest (a band much narrower ends the launch with expensive items: bench/RESULTS.md), but no more than
    `BAND_KV_BYTES` of K and V; not causal: 1 (every item costs the same, and a pair's query tiles side by
    side read its keys together)."""
    if not causal:
        return 1
    wide = -(-BAND_ROUNDS * grid // num_m_blocks)
    return max(1, min(wide, BAND_KV_BYTES // max(1, max_seqlen_k * (NOPE_DIM + HEAD_DIM_V) * 2)))


def band_arguments(band: int, pairs: int, num_m_blocks: int) -> tuple[int, int, int, int]:
    """The kernel's band arguments (`_sequence`): the pairs a band, the pairs of the smaller band that goes
    first where `band` does not divide the pairs, and the two bands' items."""
    first = pairs % band
    return band, first, first * num_m_blocks, band * num_m_blocks


def launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
           out, lse, error_flag, k_pe=None, merge: bool = False, block_n: int = BLOCK_N, stages: int = STAGES,
           persistent: bool | None = None, dynamic: bool | None = None, band: int | None = None) -> None:
    """The kernel on checked tensors (`varlen_attention_wgmma`'s, or `prefill.varlen_attention`'s with `takes`
    holding), with at least one sequence, head and token; lse None: not stored. The descriptors and the bound
    launch are looked up, not rebuilt, when the addresses and layouts come again. A persistent launch takes
    its items dynamically (`_schedule_counter`; dynamic=False, or no counter: in a fixed order)."""
    if not scale > 0:  # the kernel scales each row's maximum once, which needs a positive scale
        raise ValueError(f"scale={scale!r}; accepted: a positive float")
    num_tokens, num_heads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    q_desc = _descriptor(q, [BLOCK_M, NOPE_DIM])
    qp_desc = _descriptor(q, [BLOCK_M, ROPE_DIM])
    kn_desc = _descriptor(k, [block_n, NOPE_DIM])
    if k_pe is None:  # the rotary columns inside each head's key
        kp_desc = _descriptor(k, [block_n, ROPE_DIM])
        kp_head_stride, kp_offset = k.stride(1), NOPE_DIM
    elif k_pe.dim() == 3 and k_pe.shape[1] > 1:  # a rotary key per key head
        kp_desc = _descriptor(k_pe, [block_n, ROPE_DIM])
        kp_head_stride, kp_offset = k_pe.stride(1), 0
    else:  # one rotary key for every head
        kp_desc = _descriptor(k_pe if k_pe.dim() == 2 else k_pe[:, 0], [block_n, ROPE_DIM])
        kp_head_stride, kp_offset = 0, 0
    v_desc = _descriptor(v, [block_n, HEAD_DIM_V])
    # the output by TMA stores from the staging buffers (`_store_staged`), where its rows allow a descriptor
    tma_out = not merge and _tma_rows(out)
    o_desc = _descriptor(out, [BLOCK_M // 2, HEAD_DIM_V // 2]) if tma_out else qp_desc
    num_m_blocks = max(1, -(-max_seqlen_q // BLOCK_M))
    num_items = num_m_blocks * num_heads * batch
    if dynamic is None:
        dynamic = takes_dynamic(num_tokens, k.shape[0], batch, max_seqlen_q, max_seqlen_k)
    counter = _schedule_counter(q.device) if dynamic and persistent is not False else None
    if persistent is None:
        persistent = counter is not None or max_seqlen_q <= PERSISTENT_MAX_SEQLEN_Q
    grid = min(num_items, _sm_count(q.device)) if persistent else num_items
    if counter is None:
        band = 1
    elif band is None:
        band = band_of(grid, num_m_blocks, max_seqlen_k, causal)
    band_layout = band_arguments(band, num_heads * batch, num_m_blocks)
    store_lse = lse is not None
    lse_arg = lse if store_lse else out
    ints = (num_tokens, k.shape[0], max_seqlen_q, max_seqlen_k, num_m_blocks, num_heads, batch, q.stride(1),
            k.stride(1), kp_head_stride, kp_offset, v.stride(1), num_heads // k.shape[1], out.stride(0), out.stride(1),
            lse.stride(0) if store_lse else 0, *band_layout)
    key = (q.dtype, out.dtype, block_n, stages, bool(causal), store_lse, bool(merge), counter is not None, tma_out,
           alignment_key(out, lse_arg, cu_seqlens_q, cu_seqlens_k, error_flag, counter), _int_key(ints), q.device)
    bound = _LAUNCHES.get(key)
    if bound is None:
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        bound = _LAUNCHES[key] = BoundLaunch(
            _prefill_wgmma_kernel, (grid,),
            dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=stages, CAUSAL=bool(causal), STORE_LSE=store_lse,
                 MERGE=bool(merge), DYNAMIC=counter is not None, TMA_OUT=tma_out, num_warps=4, maxnreg=_MAXNREG),
            q.device,
        )
    bound.grid = (grid, 1, 1)
    bound(q_desc, qp_desc, kn_desc, kp_desc, v_desc, o_desc, out, lse_arg, cu_seqlens_q, cu_seqlens_k, error_flag,
          error_flag if counter is None else counter, float(scale) * _LOG2_E, *ints)


# ---------------------------------------------------------------------------
# ahead-of-time compilation (mla_multi.compile_check)
# ---------------------------------------------------------------------------

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _descriptor_type(dtype: str, rows: int, cols: int) -> str:
    return f"tensordesc<{dtype}[{rows},{cols}],{_stage_layout(cols, 16)!r}>"


def compile_specs(platform) -> list:
    """The sm_90 prefill kernel for bfloat16 and float16, causal or not, with and without the LSE, and merging
    a non-causal result into the output (none on platforms where `wgmma_prefill_reason` gives a reason)."""
    from mla_multi.kernels.launch_config import CompileSpec

    specs = []
    for dtype in (torch.bfloat16, torch.float16):
        if wgmma_prefill_reason(platform, dtype, NOPE_DIM + ROPE_DIM, HEAD_DIM_V):
            continue
        name = _DTYPE_NAMES[dtype]
        # (causal, LSE, merge, dynamic, TMA output): every mode a launch can ask for; context chunks are merged,
        # non-causal, their output read and written from registers
        for causal, store_lse, merge, dynamic, tma_out in (
            (True, True, False, True, True), (True, False, False, True, True), (False, True, False, True, True),
            (False, False, False, True, True), (False, True, True, True, False), (True, True, False, False, True),
            (False, True, True, False, False), (True, True, False, True, False),
        ):
            signature = {
                "Q_desc": _descriptor_type(name, BLOCK_M, NOPE_DIM),
                "QP_desc": _descriptor_type(name, BLOCK_M, ROPE_DIM),
                "KN_desc": _descriptor_type(name, BLOCK_N, NOPE_DIM),
                "KP_desc": _descriptor_type(name, BLOCK_N, ROPE_DIM),
                "V_desc": _descriptor_type(name, BLOCK_N, HEAD_DIM_V),
                "O_desc": _descriptor_type(name, BLOCK_M // 2, HEAD_DIM_V // 2) if tma_out
                else _descriptor_type(name, BLOCK_M, ROPE_DIM),
                "Out": f"*{name}", "Lse": "*fp32", "Cu_q": "*i32", "Cu_k": "*i32", "Error_flag": "*i32",
                "Counter": "*i32", "qk_scale": "fp32",
            }
            for arg in ("total_q total_k max_seqlen_q max_seqlen_k num_m_blocks num_heads batch q_head_stride "
                        "kn_head_stride kp_head_stride kp_offset v_head_stride group stride_o_t stride_o_h "
                        "stride_lse_h band_pairs band_first band_first_items band_items").split():
                signature[arg] = "i32"
            constexprs = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "STAGES": STAGES, "CAUSAL": causal,
                          "STORE_LSE": store_lse, "MERGE": merge, "DYNAMIC": dynamic, "TMA_OUT": tma_out}
            for key in constexprs:
                signature[key] = "constexpr"
            mode = (("causal" if causal else "full") + ("" if store_lse else ",no-lse") + (",merge" if merge else "")
                    + ("" if dynamic else ",fixed") + ("" if tma_out or merge else ",no-tma-out"))
            specs.append(CompileSpec(
                name=f"prefill_wgmma[m{BLOCK_M}n{BLOCK_N}s{STAGES},{name},{mode}]",
                fn=_prefill_wgmma_kernel,
                signature=signature,
                constexprs=constexprs,
                options={"num_warps": 4, "maxnreg": _MAXNREG},
                divisible_by_16=("Out", "Lse", "Cu_q", "Cu_k", "Counter", "stride_o_t", "stride_o_h", "stride_lse_h"),
            ))
    return specs
