"""DeepSeek-V4 sparse MLA on the dense split-KV decode kernels: the rows a token names, made 576 wide.

The V4 contract (`mla_multi.ops.mla_sparse_decode_v4` / `mla_sparse_prefill_v4`, docs/v4.md) attends a
512-wide query to 512-wide rows whose value is the whole row; the dense decode kernels
(`mla_multi.kernels.mla_decode`) attend a [512 latent | 64 rotary] query to 576-wide rows whose value is
the first 512 columns. A V4 row is such a row with a zero rotary part, and the V4 query such a query with a
zero rotary part, so the dense kernels compute the V4 attention exactly once the rows are laid out for them:

* decode (`gather_rows`, one launch): for every query token, the entries of its index list that count (the
  first ``topk_length`` of the top-k segment, then the first ``extra_topk_length`` of the second segment;
  -1 is no token, a duplicate counts twice) are dequantised from their cache (``fp8_ds_mla_v4``,
  ``fp8_ds_mla_v41``, ``fp4_ds_mla_v41`` or float rows) into the token's own stretch of a scratch of
  576-wide rows in the query's dtype (zero tail), in list order; a table of one-token pages pointing at
  them and the count are the token's block-table row and sequence length. An index outside [-1,
  num_slots) of its segment sets the count one past the table row (the dense kernels then make the
  token's rows and LSE NaN) and `mla_multi.errors.SPARSE_INDEX` in the device's error flag.
* prefill (`pad_rows` and `compact_lists`, two launches): the float rows [S, 512] of both segments are
  copied once into one zero-tailed [S + S_extra, 576] scratch (the second segment after the first) and
  each token's entries that count (an index outside [0, S) of its segment is no token) are compacted into
  its table row, the second segment's offset by S: nothing is copied per query token.

Every program of the gathering launch (a token, ``ROWS`` entries of its list) counts the entries that count
before its own in the index lists (a few KB read), so the compaction needs no second launch. The sink is the
decode kernels' (`mla_decode.mla_decode_fwd`'s `attn_sink`: applied where the output is written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_multi import errors
from mla_multi.cache_formats import FP4_DS_MLA_V41, FP8_DS_MLA_V4, FP8_DS_MLA_V41
from mla_multi.kernels.launch import bound_by_layout, layout_key, pdl_enter

_SPARSE_INDEX_ERROR = tl.constexpr(errors.SPARSE_INDEX)

# the layouts the gathering kernel reads (constexpr codes)
FORMAT_CODES = {"rows": 0, "fp8_ds_mla_v4": 1, "fp8_ds_mla_v41": 2, "fp4_ds_mla_v41": 3}
_ROWS_FORMAT = tl.constexpr(0)
_V4_FORMAT = tl.constexpr(1)
_V41_FORMAT = tl.constexpr(2)
_FP4_FORMAT = tl.constexpr(3)
# the byte layouts' facts (`mla_multi.cache_formats`): fp8_ds_mla_v4's data bytes a token (its e4m3 latent values,
# then its bf16 RoPE values), its scale bytes a token in the block's tail, its latent values; the values a
# scale covers in each format
_V4_DATA_BYTES = tl.constexpr(FP8_DS_MLA_V4.data_bytes)
_V4_SCALE_BYTES = tl.constexpr(FP8_DS_MLA_V4.scale_bytes)
_V4_LATENT = tl.constexpr(FP8_DS_MLA_V4.width - FP8_DS_MLA_V4.rope_dims)
_V4_GROUP = tl.constexpr(FP8_DS_MLA_V4.values_per_scale)
_V41_GROUP = tl.constexpr(FP8_DS_MLA_V41.values_per_scale)
_FP4_GROUP = tl.constexpr(FP4_DS_MLA_V41.values_per_scale)

WIDTH = 512  # d_qk = d_v
PAGE_WIDTH = 576  # the dense kernels' row: WIDTH and a zero rotary part of 64
ROPE_DIM = PAGE_WIDTH - WIDTH


@triton.jit
def _segment_entries(Indices, Topk_length, token, stride_t, offs, topk, num_slots, in_range,
                     HAS_LENGTH: tl.constexpr, BAD_IS_ERROR: tl.constexpr):
    """A segment's entries at list positions `offs` (masked by `in_range`): (index, counts, bad)."""
    count = topk
    if HAS_LENGTH:
        count = tl.minimum(tl.maximum(tl.load(Topk_length + token), 0), topk)
    live = in_range & (offs < topk)
    idx = tl.load(Indices + token.to(tl.int64) * stride_t + offs, mask=live, other=-1)
    counts = live & (offs < count) & (idx >= 0) & (idx < num_slots)
    if BAD_IS_ERROR:
        bad = live & ((idx < -1) | (idx >= num_slots))
    else:
        bad = live ^ live  # never
    return idx, counts, bad


@triton.jit
def _ue8m0(code):
    """UE8M0 scale bytes (int32 0..255) -> 2 ** (code - 127) in float32 (0xFF: NaN)."""
    bits = code << 23
    bits = tl.where(code == 0, 0x00400000, bits)  # 2 ** -127, a subnormal
    bits = tl.where(code == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(code):
    """float8_e4m3fn bytes (uint8) -> float32."""
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _read_rows(Cache, slot, valid, block_size, stride_block, stride_token, FORMAT: tl.constexpr,
               ROWS: tl.constexpr, WIDTH: tl.constexpr, COL0: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] float32 values (columns COL0 + [0, COLS) of WIDTH) of the cache's slots (rows where
    `valid` is false: 0)."""
    offs_d = COL0 + tl.arange(0, COLS)
    slot = slot.to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    mask = valid[:, None]
    if FORMAT == _ROWS_FORMAT:
        row = Cache + block * stride_block + offset * stride_token
        values = tl.load(row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    elif FORMAT == _V4_FORMAT:
        # the block's tokens' 448 e4m3 values and 64 bf16 rotary values (576 bytes each), then their 7
        # UE8M0 scales and a pad byte each: a tile's scales loaded once a row and spread over their 64 values
        base = Cache + block * stride_block
        data = base + offset * _V4_DATA_BYTES
        tail = base + block_size * _V4_DATA_BYTES + offset * _V4_SCALE_BYTES
        latent = offs_d[None, :] < _V4_LATENT
        codes = tl.load(data[:, None] + offs_d[None, :], mask=mask & latent, other=0)
        offs_g = COL0 // _V4_GROUP + tl.arange(0, COLS // _V4_GROUP)
        scale_codes = tl.load(tail[:, None] + offs_g[None, :], mask=mask & (offs_g[None, :] < _V4_LATENT // _V4_GROUP),
                              other=127)
        scaled = tl.reshape(tl.reshape(_e4m3(codes), [ROWS, COLS // _V4_GROUP, _V4_GROUP])
                            * _ue8m0(scale_codes.to(tl.int32))[:, :, None], [ROWS, COLS])
        rope_ptr = (data + _V4_LATENT).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + (offs_d[None, :] - _V4_LATENT), mask=mask & (offs_d[None, :] >= _V4_LATENT),
                       other=0.0).to(tl.float32)
        values = tl.where(latent, scaled, rope)
    elif FORMAT == _V41_FORMAT:
        # 512 e4m3 values, then 16 UE8M0 scales (one per 32)
        row = Cache + block * stride_block + offset * stride_token
        codes = tl.load(row[:, None] + offs_d[None, :], mask=mask, other=0)
        offs_g = COL0 // _V41_GROUP + tl.arange(0, COLS // _V41_GROUP)
        scale_codes = tl.load(row[:, None] + WIDTH + offs_g[None, :], mask=mask, other=127)
        values = tl.reshape(tl.reshape(_e4m3(codes), [ROWS, COLS // _V41_GROUP, _V41_GROUP])
                            * _ue8m0(scale_codes.to(tl.int32))[:, :, None], [ROWS, COLS])
    else:
        # 512 e2m1 values two a byte (the even one in the low nibble), then 32 e4m3 scales (one per 16)
        row = Cache + block * stride_block + offset * stride_token
        packed = tl.load(row[:, None] + offs_d[None, :] // 2, mask=mask, other=0).to(tl.int32)
        code = (packed >> ((offs_d[None, :] % 2) * 4)) & 15
        exponent = (code >> 1) & 3
        mantissa = (code & 1).to(tl.float32)
        # e2m1: exponent 0 is the subnormal 0 / 0.5, else 2 ** (exponent - 1) * (1 + mantissa / 2)
        power = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
        magnitude = tl.where(exponent == 0, mantissa * 0.5, power * (1.0 + mantissa * 0.5))
        magnitude = tl.where(code >= 8, -magnitude, magnitude)
        offs_g = COL0 // _FP4_GROUP + tl.arange(0, COLS // _FP4_GROUP)
        scale_codes = tl.load(row[:, None] + WIDTH // 2 + offs_g[None, :], mask=mask, other=0)
        values = tl.reshape(tl.reshape(magnitude, [ROWS, COLS // _FP4_GROUP, _FP4_GROUP])
                            * _e4m3(scale_codes)[:, :, None],
                            [ROWS, COLS])
    return values


@triton.jit
def _gather_rows_kernel(
    Indices, Topk_length, Extra_indices, Extra_topk_length, Cache, Extra_cache, Rows, Table, Lens, Error_flag,
    topk, extra_topk, num_slots, extra_num_slots, stride_idx_t, stride_extra_t,
    block_size, stride_block, stride_token, extra_block_size, extra_stride_block, extra_stride_token,
    stride_table_t, stride_rows,
    ROWS: tl.constexpr, SCAN: tl.constexpr, FORMAT: tl.constexpr, EXTRA_FORMAT: tl.constexpr,
    HAS_LENGTH: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LENGTH: tl.constexpr, GATHER: tl.constexpr,
    BAD_IS_ERROR: tl.constexpr, WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr, COLS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (token, chunk): the entries at list positions chunk * ROWS + [0, ROWS) of the token's two
    segments (positions past topk are the second segment's). GATHER (decode): each entry that counts is
    dequantised into Rows[token * stride_table_t + its rank] (576 wide, zero tail) and the table points at it;
    otherwise (prefill) the table takes its index (the second segment's offset by num_slots). The chunk-0
    program writes the count (stride_table_t + 1 for a token with a bad index, and the error flag)."""
    if PDL:
        pdl_enter()
    token = tl.program_id(0)
    start = tl.program_id(1) * ROWS
    # the entries that count before this chunk
    before = tl.zeros([SCAN], dtype=tl.int32)
    for scan in range(0, start, SCAN):
        scan_offs = scan + tl.arange(0, SCAN)
        in_range = scan_offs < start
        scan_idx, scan_counts, scan_bad = _segment_entries(
            Indices, Topk_length, token, stride_idx_t, scan_offs, topk, num_slots, in_range, HAS_LENGTH, False)
        before += scan_counts.to(tl.int32)
        if HAS_EXTRA:
            scan_idx, scan_counts, scan_bad = _segment_entries(
                Extra_indices, Extra_topk_length, token, stride_extra_t, scan_offs - topk, extra_topk,
                extra_num_slots, in_range & (scan_offs >= topk), HAS_EXTRA_LENGTH, False)
            before += scan_counts.to(tl.int32)
    offs = start + tl.arange(0, ROWS)
    idx, counts, bad = _segment_entries(Indices, Topk_length, token, stride_idx_t, offs, topk, num_slots,
                                      offs < topk, HAS_LENGTH, False)
    is_extra = offs < 0  # never
    if HAS_EXTRA:
        is_extra = offs >= topk
        extra_idx, extra_counts, extra_bad = _segment_entries(Extra_indices, Extra_topk_length, token, stride_extra_t,
                                                      offs - topk, extra_topk, extra_num_slots, is_extra,
                                                      HAS_EXTRA_LENGTH, False)
        idx = tl.where(is_extra, extra_idx, idx)
        counts = tl.where(is_extra, extra_counts, counts)
    rank = tl.sum(before, axis=0) + tl.cumsum(counts.to(tl.int32), axis=0) - 1
    table_row = Table + token.to(tl.int64) * stride_table_t
    if GATHER:
        target = token.to(tl.int64) * stride_table_t + rank
        out = Rows + target * stride_rows
        # a quarter of the row at a time: the registers of one [ROWS, 128] tile a segment
        for col in tl.static_range(0, WIDTH, COLS):
            if HAS_EXTRA:
                # a program's entries lie in one segment unless its chunk straddles topk: that segment's
                # reads alone
                if start + ROWS <= topk:
                    values = _read_rows(Cache, idx, counts, block_size, stride_block, stride_token, FORMAT, ROWS,
                                        WIDTH, col, COLS)
                elif start >= topk:
                    values = _read_rows(Extra_cache, idx, counts, extra_block_size, extra_stride_block,
                                        extra_stride_token, EXTRA_FORMAT, ROWS, WIDTH, col, COLS)
                else:
                    values = _read_rows(Cache, idx, counts & (offs < topk), block_size, stride_block, stride_token,
                                        FORMAT, ROWS, WIDTH, col, COLS)
                    extra_values = _read_rows(Extra_cache, idx, counts & is_extra, extra_block_size,
                                              extra_stride_block, extra_stride_token, EXTRA_FORMAT, ROWS, WIDTH, col,
                                              COLS)
                    values = tl.where(is_extra[:, None], extra_values, values)
            else:
                values = _read_rows(Cache, idx, counts, block_size, stride_block, stride_token, FORMAT, ROWS, WIDTH,
                                    col, COLS)
            offs_d = col + tl.arange(0, COLS)
            tl.store(out[:, None] + offs_d[None, :], values.to(Rows.dtype.element_ty), mask=counts[:, None])
        offs_r = tl.arange(0, ROPE_DIM)
        tl.store(out[:, None] + WIDTH + offs_r[None, :], tl.zeros([ROWS, ROPE_DIM], Rows.dtype.element_ty),
                 mask=counts[:, None])
        tl.store(table_row + rank, target.to(tl.int32), mask=counts)
    else:
        tl.store(table_row + rank, tl.where(is_extra, idx + num_slots, idx), mask=counts)
    if tl.program_id(1) == 0:
        total = tl.zeros([SCAN], dtype=tl.int32)
        any_bad = tl.zeros([SCAN], dtype=tl.int32)
        for scan in range(0, topk + extra_topk, SCAN):
            scan_offs = scan + tl.arange(0, SCAN)
            scan_idx, scan_counts, scan_bad = _segment_entries(
                Indices, Topk_length, token, stride_idx_t, scan_offs, topk, num_slots, scan_offs < topk, HAS_LENGTH,
                BAD_IS_ERROR)
            total += scan_counts.to(tl.int32)
            any_bad = any_bad | scan_bad.to(tl.int32)
            if HAS_EXTRA:
                scan_idx, scan_counts, scan_bad = _segment_entries(
                    Extra_indices, Extra_topk_length, token, stride_extra_t, scan_offs - topk, extra_topk,
                    extra_num_slots, scan_offs >= topk, HAS_EXTRA_LENGTH, BAD_IS_ERROR)
                total += scan_counts.to(tl.int32)
                any_bad = any_bad | scan_bad.to(tl.int32)
        is_bad = tl.max(any_bad, axis=0) > 0
        tl.store(Lens + token, tl.where(is_bad, stride_table_t + 1, tl.sum(total, axis=0)))
        if is_bad:
            tl.atomic_or(Error_flag, _SPARSE_INDEX_ERROR)


@triton.jit
def _pad_rows_kernel(Kv, Extra_kv, Rows, count, extra_count, stride_kv, stride_extra, stride_rows,
                     ROWS: tl.constexpr, HAS_EXTRA: tl.constexpr, WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Rows[r] = [Kv[r] | 0] for r < count, then [Extra_kv[r - count] | 0], in Rows' dtype."""
    if PDL:
        pdl_enter()
    offs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs64 = offs.to(tl.int64)
    offs_d = tl.arange(0, WIDTH)
    main = offs < count
    values = tl.load(Kv + offs64[:, None] * stride_kv + offs_d[None, :], mask=main[:, None], other=0.0).to(tl.float32)
    written = main
    if HAS_EXTRA:
        extra = (offs >= count) & (offs < count + extra_count)
        extra_values = tl.load(Extra_kv + (offs64 - count)[:, None] * stride_extra + offs_d[None, :],
                               mask=extra[:, None], other=0.0).to(tl.float32)
        values = tl.where(extra[:, None], extra_values, values)
        written = main | extra
    out = Rows + offs64 * stride_rows
    tl.store(out[:, None] + offs_d[None, :], values.to(Rows.dtype.element_ty), mask=written[:, None])
    offs_r = tl.arange(0, ROPE_DIM)
    tl.store(out[:, None] + WIDTH + offs_r[None, :], tl.zeros([ROWS, ROPE_DIM], Rows.dtype.element_ty),
             mask=written[:, None])


# --------------------------------------------------------------------------- launches

# entries of a list per gathering program, and the block its count of the entries before them reads
_GATHER_ROWS = 16
_GATHER_COLS = 128  # columns of a row dequantised at a time
_COMPACT_ROWS = 128
_SCAN = 512
_PAD_ROWS = 16


def _segment_args(cache, fmt: str):
    """(block_size, block stride, token stride) of a segment's cache in the kernel's units (bytes, or elements
    of a float cache)."""
    if fmt == "rows":
        if cache.dim() == 2:  # prefill rows [S, 512]
            return 1, cache.stride(0), cache.stride(0)
        return cache.shape[1], cache.stride(0), cache.stride(1)
    return cache.shape[1], cache.stride(0), cache.stride(1)


def _optional_key(tensor):
    return None if tensor is None else layout_key(tensor)


def gather_rows(indices, topk_length, cache, fmt: str, extra_indices, extra_topk_length, extra_cache,
                extra_fmt: str | None, *, rows: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> None:
    """Decode: for each token, the entries of its lists that count, dequantised into its stretch of `rows`
    ([T * W, 576], W = table.shape[1] = max(topk + extra_topk, 1), in the query's dtype) in list order; `table`
    [T, W] int32 points at them and `lens` [T] int32 counts them (W + 1 for a token with an index outside
    [-1, num_slots) of its segment, and `errors.SPARSE_INDEX`). Caches: paged, of `fmt` ("rows" for a float
    [blocks, block_size, 512] cache)."""
    tokens, topk = indices.shape
    extra_topk = 0 if extra_indices is None else extra_indices.shape[1]
    if tokens == 0:
        return
    width = table.shape[1]
    num_slots = cache.shape[0] * cache.shape[1]
    grid = (tokens, max(1, triton.cdiv(topk + extra_topk, _GATHER_ROWS)))
    has_extra = extra_indices is not None
    extra_slots = extra_cache.shape[0] * extra_cache.shape[1] if has_extra else 0
    constexprs = dict(
        ROWS=_GATHER_ROWS, SCAN=_SCAN, FORMAT=FORMAT_CODES[fmt], EXTRA_FORMAT=FORMAT_CODES[extra_fmt or fmt],
        HAS_LENGTH=topk_length is not None, HAS_EXTRA=has_extra, HAS_EXTRA_LENGTH=extra_topk_length is not None,
        GATHER=True, BAD_IS_ERROR=True, WIDTH=WIDTH, ROPE_DIM=ROPE_DIM, COLS=_GATHER_COLS, num_warps=4,
    )
    launch = bound_by_layout(_gather_rows_kernel, grid, constexprs, indices.device,
                    ("gather", layout_key(indices), _optional_key(topk_length), layout_key(cache), fmt,
                     _optional_key(extra_indices), _optional_key(extra_topk_length), _optional_key(extra_cache),
                     extra_fmt, layout_key(rows), layout_key(table)))
    flag = errors.error_flag(indices.device)
    block_size, stride_block, stride_token = _segment_args(cache, fmt)
    if has_extra:
        extra_args = _segment_args(extra_cache, extra_fmt)
        extra_stride = extra_indices.stride(0)
    else:
        extra_args, extra_stride = (1, 0, 0), 0
    launch(indices, lens if topk_length is None else topk_length, indices if extra_indices is None else extra_indices,
           lens if extra_topk_length is None else extra_topk_length, cache, cache if extra_cache is None else extra_cache,
           rows, table, lens, flag, topk, extra_topk, num_slots, extra_slots, indices.stride(0), extra_stride,
           block_size, stride_block, stride_token, *extra_args, width, rows.stride(0))


def compact_lists(indices, topk_length, num_slots: int, extra_indices, extra_topk_length, extra_num_slots: int, *,
                  table: torch.Tensor, lens: torch.Tensor) -> None:
    """The prefill's lists (rows of the padded scratch `pad_rows` writes): each token's entries that count, in
    list order, into its `table` row ([T, max(topk + extra_topk, 1)] int32; the second segment's indices offset
    by num_slots) and their count into `lens`; an index outside [0, num_slots) of its segment is no token. One
    launch, bound once a layout."""
    tokens, topk = indices.shape
    if tokens == 0:
        return
    extra_topk = 0 if extra_indices is None else extra_indices.shape[1]
    grid = (tokens, max(1, triton.cdiv(topk + extra_topk, _COMPACT_ROWS)))
    constexprs = dict(
        ROWS=_COMPACT_ROWS, SCAN=_SCAN, FORMAT=0, EXTRA_FORMAT=0, HAS_LENGTH=topk_length is not None,
        HAS_EXTRA=extra_indices is not None, HAS_EXTRA_LENGTH=extra_topk_length is not None, GATHER=False,
        BAD_IS_ERROR=False, WIDTH=WIDTH, ROPE_DIM=ROPE_DIM, COLS=_GATHER_COLS, num_warps=4,
    )
    launch = bound_by_layout(_gather_rows_kernel, grid, constexprs, indices.device,
                             ("compact", layout_key(indices), _optional_key(topk_length), _optional_key(extra_indices),
                              _optional_key(extra_topk_length), layout_key(table)))
    launch(indices, lens if topk_length is None else topk_length, indices if extra_indices is None else extra_indices,
           lens if extra_topk_length is None else extra_topk_length, table, table, table, table, lens,
           errors.error_flag(indices.device), topk, extra_topk, num_slots, extra_num_slots, indices.stride(0),
           0 if extra_indices is None else extra_indices.stride(0), 1, 0, 0, 1, 0, 0, table.shape[1], 0)


def pad_rows(kv: torch.Tensor, extra_kv: torch.Tensor | None, rows: torch.Tensor) -> None:
    """rows [S + S_extra, 576] = [kv | 0] then [extra_kv | 0], in rows' dtype (kv [S, 512] float rows)."""
    count = kv.shape[0]
    extra_count = 0 if extra_kv is None else extra_kv.shape[0]
    if count + extra_count == 0:
        return
    grid = (triton.cdiv(count + extra_count, _PAD_ROWS),)
    launch = bound_by_layout(_pad_rows_kernel, grid,
                    dict(ROWS=_PAD_ROWS, HAS_EXTRA=extra_kv is not None, WIDTH=WIDTH, ROPE_DIM=ROPE_DIM, num_warps=4),
                    kv.device, ("pad", layout_key(kv), _optional_key(extra_kv), layout_key(rows)))
    launch(kv, kv if extra_kv is None else extra_kv, rows, count, extra_count, kv.stride(0),
           0 if extra_kv is None else extra_kv.stride(0), rows.stride(0))


# --------------------------------------------------------------------------- ahead-of-time compilation


def compile_specs(platform) -> list:
    """The gathering kernel for each decode format pair (the FP8 ones where Triton converts float8_e4m3fn:
    not NVIDIA before sm_89), the prefill's compaction and padding, as the TRITON backend launches them (bf16
    rows, 128 heads)."""
    from mla_multi.kernels.launch_config import CompileSpec

    fp8 = not (platform.is_cuda() and not platform.has_device_capability(8, 9))
    gather_signature = {
        "Indices": "*i32", "Topk_length": "*i32", "Extra_indices": "*i32", "Extra_topk_length": "*i32",
        "Cache": "*u8", "Extra_cache": "*u8", "Rows": "*bf16", "Table": "*i32", "Lens": "*i32", "Error_flag": "*i32",
        "topk": "i32", "extra_topk": "i32", "num_slots": "i32", "extra_num_slots": "i32", "stride_idx_t": "i32",
        "stride_extra_t": "i32", "block_size": "i32", "stride_block": "i32", "stride_token": "i32",
        "extra_block_size": "i32", "extra_stride_block": "i32", "extra_stride_token": "i32",
        "stride_table_t": "i32", "stride_rows": "i32",
    }
    common = dict(SCAN=_SCAN, HAS_LENGTH=True, HAS_EXTRA=True, HAS_EXTRA_LENGTH=True, WIDTH=WIDTH, ROPE_DIM=ROPE_DIM,
                  COLS=_GATHER_COLS)
    pairs = [("rows", "rows")]
    if fp8:
        pairs += [("fp8_ds_mla_v4", "fp8_ds_mla_v4"), ("fp8_ds_mla_v41", "fp8_ds_mla_v41"),
                  ("fp8_ds_mla_v41", "fp4_ds_mla_v41")]
    specs = []
    for main, extra in pairs:
        signature = dict(gather_signature)
        if main == "rows":
            signature.update(Cache="*bf16", Extra_cache="*bf16")
        signature.update({name: "constexpr" for name in ("ROWS", "SCAN", "FORMAT", "EXTRA_FORMAT", "HAS_LENGTH",
                                                         "HAS_EXTRA", "HAS_EXTRA_LENGTH", "GATHER", "BAD_IS_ERROR",
                                                         "WIDTH", "ROPE_DIM", "COLS")})
        specs.append(CompileSpec(
            name=f"v4_gather_rows[{main}+{extra},bf16]", fn=_gather_rows_kernel, signature=signature,
            constexprs=dict(common, ROWS=_GATHER_ROWS, FORMAT=FORMAT_CODES[main], EXTRA_FORMAT=FORMAT_CODES[extra],
                            GATHER=True, BAD_IS_ERROR=True),
            options={"num_warps": 4}, divisible_by_16=("Indices", "Extra_indices", "Rows", "stride_rows"),
        ))
    signature = dict(gather_signature, Cache="*i32", Extra_cache="*i32", Rows="*i32")
    signature.update({name: "constexpr" for name in ("ROWS", "SCAN", "FORMAT", "EXTRA_FORMAT", "HAS_LENGTH",
                                                     "HAS_EXTRA", "HAS_EXTRA_LENGTH", "GATHER", "BAD_IS_ERROR",
                                                     "WIDTH", "ROPE_DIM", "COLS")})
    specs.append(CompileSpec(
        name="v4_compact_lists[prefill]", fn=_gather_rows_kernel, signature=signature,
        constexprs=dict(common, ROWS=_COMPACT_ROWS, FORMAT=0, EXTRA_FORMAT=0, GATHER=False, BAD_IS_ERROR=False),
        options={"num_warps": 4}, divisible_by_16=("Indices", "Extra_indices", "Table", "stride_table_t"),
    ))
    specs.append(CompileSpec(
        name="v4_pad_rows[bf16]", fn=_pad_rows_kernel,
        signature={"Kv": "*bf16", "Extra_kv": "*bf16", "Rows": "*bf16", "count": "i32", "extra_count": "i32",
                   "stride_kv": "i32", "stride_extra": "i32", "stride_rows": "i32", "ROWS": "constexpr",
                   "HAS_EXTRA": "constexpr", "WIDTH": "constexpr", "ROPE_DIM": "constexpr"},
        constexprs={"ROWS": _PAD_ROWS, "HAS_EXTRA": True, "WIDTH": WIDTH, "ROPE_DIM": ROPE_DIM},
        options={"num_warps": 4}, divisible_by_16=("Kv", "Extra_kv", "Rows", "stride_kv", "stride_extra", "stride_rows"),
    ))
    return specs
