"""Index lists made safe for kernels that trust them, and the rows of bad ones poisoned.

Some vendor kernels read whatever slot an index names: FlashMLA's sparse
decode treats only -1 as "no token" and checks no upper bound, its sparse
prefill takes -1 or values >= S_kv as none but not other negatives.  Before
such a kernel runs, `SparseIndexPlan.sanitize` copies the list with every index the
contract calls "no token" or bad (and every entry past the token's
topk_length, for kernels that take no lengths) turned into -1, in one launch
and without a host synchronisation:

* decode (``bad_is_error``): an index outside [-1, num_slots) is bad data:
  it becomes -1, its token is marked in ``bad_rows`` and
  `mla_multi.errors.SPARSE_INDEX` is ORed into the device's error flag;
  `SparseIndexPlan.finish` then makes the marked tokens' output rows and LSE
  NaN after the kernel (the TRITON and REFERENCE backends' result for bad
  indices), in the launch that turns an empty token's LSE into -inf;
* prefill: an index outside [0, S_kv) is no token and becomes -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_multi import errors
from mla_multi.kernels import capturing_on
from mla_multi.kernels.launch import bound_by_layout, launches_directly, layout_key, pdl_enter

_SPARSE_INDEX_ERROR = tl.constexpr(errors.SPARSE_INDEX)


@triton.jit
def _clean_block(idx, offs, mask, count, num_slots, BAD_IS_ERROR: tl.constexpr):
    """(entries of one block with every index outside [0, num_slots) and every one past `count` -1, 1 where a
    lane holds a bad index (outside [-1, num_slots); BAD_IS_ERROR) else 0)."""
    outside = (idx < 0) | (idx >= num_slots)
    bad = tl.zeros(offs.shape, dtype=tl.int32)
    if BAD_IS_ERROR:
        bad = (mask & (idx != -1) & outside).to(tl.int32)
    return tl.where(outside | (offs >= count), -1, idx), bad


@triton.jit
def _sanitize_list(Indices, Out, Topk_length, token, num_slots, topk, stride_in_t, stride_out_t, BLOCK: tl.constexpr,
                   BAD_IS_ERROR: tl.constexpr, HAS_LENGTH: tl.constexpr):
    """One token's list sanitised into Out, block by block; 1 where it holds a bad index (BAD_IS_ERROR), else 0."""
    count = topk
    if HAS_LENGTH:
        count = tl.load(Topk_length + token)
    any_bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, topk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < topk
        idx = tl.load(Indices + token * stride_in_t + offs, mask=mask, other=-1)
        clean, bad = _clean_block(idx, offs, mask, count, num_slots, BAD_IS_ERROR)
        any_bad = any_bad | bad
        tl.store(Out + token * stride_out_t + offs, clean, mask=mask)
    return tl.max(any_bad, axis=0)


@triton.jit
def _sanitize_indices_kernel(
    Indices, Out, Bad_rows, Error_flag, Topk_length, num_slots, topk, stride_in_t, stride_out_t,
    Indices2, Out2, Topk_length2, num_slots2, topk2, stride_in2_t, stride_out2_t,
    BLOCK: tl.constexpr, BAD_IS_ERROR: tl.constexpr, HAS_LENGTH: tl.constexpr, SECOND: tl.constexpr,
    HAS_LENGTH2: tl.constexpr, WHOLE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Program `token`: its list sanitised (and SECOND: its second list, DeepSeek-V4's window segment, in the
    same program); Bad_rows[token] = whether either holds a bad index (BAD_IS_ERROR). WHOLE: both lists fit one
    BLOCK. Every runtime argument is positional (a launch passes no keyword): without SECOND the second list's
    are the first's, unread."""
    if PDL:
        pdl_enter()
    token = tl.program_id(0)
    if WHOLE:  # every entry and length loaded before the first store: one trip to memory, not one a list
        offs = tl.arange(0, BLOCK)
        mask = offs < topk
        idx = tl.load(Indices + token * stride_in_t + offs, mask=mask, other=-1)
        count = topk
        if HAS_LENGTH:
            count = tl.load(Topk_length + token)
        if SECOND:
            mask2 = offs < topk2
            idx2 = tl.load(Indices2 + token * stride_in2_t + offs, mask=mask2, other=-1)
            count2 = topk2
            if HAS_LENGTH2:
                count2 = tl.load(Topk_length2 + token)
        clean, bad_lanes = _clean_block(idx, offs, mask, count, num_slots, BAD_IS_ERROR)
        tl.store(Out + token * stride_out_t + offs, clean, mask=mask)
        if SECOND:
            clean2, bad_lanes2 = _clean_block(idx2, offs, mask2, count2, num_slots2, BAD_IS_ERROR)
            tl.store(Out2 + token * stride_out2_t + offs, clean2, mask=mask2)
            bad_lanes = bad_lanes | bad_lanes2
        bad = tl.max(bad_lanes, axis=0)
    else:
        bad = _sanitize_list(Indices, Out, Topk_length, token, num_slots, topk, stride_in_t, stride_out_t, BLOCK,
                             BAD_IS_ERROR, HAS_LENGTH)
        if SECOND:
            bad = bad | _sanitize_list(Indices2, Out2, Topk_length2, token, num_slots2, topk2, stride_in2_t,
                                       stride_out2_t, BLOCK, BAD_IS_ERROR, HAS_LENGTH2)
    if BAD_IS_ERROR:
        tl.store(Bad_rows + token, bad.to(tl.int8))
        if bad > 0:
            tl.atomic_or(Error_flag, _SPARSE_INDEX_ERROR)


@triton.jit
def _finish_rows_kernel(Bad_rows, Out, Lse, row_width, lse_width, stride_o_t, stride_lse_t, BLOCK: tl.constexpr,
                        LSE_BLOCK: tl.constexpr, HAS_BAD: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        pdl_enter()
    token = tl.program_id(0)
    lse_offs = tl.arange(0, LSE_BLOCK)
    lse_mask = lse_offs < lse_width
    # the LSE loaded beside the mark (one trip to memory) and stored under both outcomes
    lse = tl.load(Lse + token * stride_lse_t + lse_offs, mask=lse_mask, other=0.0)
    if HAS_BAD:
        bad = tl.load(Bad_rows + token) != 0
    else:
        bad = token < 0  # never
    lse = tl.where(lse == float("inf"), float("-inf"), lse)
    tl.store(Lse + token * stride_lse_t + lse_offs, tl.where(bad, float("nan"), lse), mask=lse_mask)
    if bad:
        for start in range(0, row_width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(Out + token * stride_o_t + offs, tl.full([BLOCK], float("nan"), tl.float32).to(
                Out.dtype.element_ty), mask=offs < row_width)


@triton.jit
def _compact_indices_kernel(
    Indices, Topk_length, Table, Lens, Error_flag, num_slots, topk, stride_in_t, stride_table_t,
    BLOCK: tl.constexpr, HAS_LENGTH: tl.constexpr, OUT_OF_RANGE_IS_NONE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Each token's valid indices, in order (duplicates kept), to the front of its Table row; Lens = their
    count, or topk + 1 (past the row: the dense decode's NaN rows) when an index is bad (decode; in prefill an
    index outside [0, num_slots) is no token)."""
    if PDL:
        pdl_enter()
    token = tl.program_id(0)
    count = topk
    if HAS_LENGTH:
        count = tl.minimum(tl.maximum(tl.load(Topk_length + token), 0), topk)
    written = 0
    any_bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, topk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_list = offs < topk
        idx = tl.load(Indices + token * stride_in_t + offs, mask=in_list, other=-1)
        if not OUT_OF_RANGE_IS_NONE:
            any_bad = any_bad | (in_list & ((idx < -1) | (idx >= num_slots))).to(tl.int32)
        valid = (offs < count) & (idx >= 0) & (idx < num_slots)
        position = written + tl.cumsum(valid.to(tl.int32), axis=0) - 1
        tl.store(Table + token * stride_table_t + position, idx, mask=valid)
        written += tl.sum(valid.to(tl.int32), axis=0)
    bad = tl.max(any_bad, axis=0) > 0
    tl.store(Lens + token, tl.where(bad, topk + 1, written))
    if bad:
        tl.atomic_or(Error_flag, _SPARSE_INDEX_ERROR)


class IndexCompaction:
    """`compact_indices` bound to one layout (the lists', their lengths', the table's), decided once: calling it
    with lists of that layout launches the compaction and nothing else."""

    __slots__ = ("launch", "flag", "ints", "has_length")

    def __init__(self, indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None, table: torch.Tensor, *,
                 out_of_range_is_none: bool = False) -> None:
        topk = indices.shape[1]
        self.has_length = topk_length is not None
        self.launch = bound_by_layout(
            _compact_indices_kernel, (indices.shape[0],),
            dict(_list_launch(topk), HAS_LENGTH=self.has_length, OUT_OF_RANGE_IS_NONE=out_of_range_is_none),
            indices.device,
            ("compact", layout_key(indices), None if topk_length is None else layout_key(topk_length), num_slots,
             out_of_range_is_none),
        )
        self.flag = errors.error_flag(indices.device)
        self.ints = (num_slots, topk, indices.stride(0), table.stride(0))

    def __call__(self, indices: torch.Tensor, topk_length: torch.Tensor | None, table: torch.Tensor,
                 lens: torch.Tensor) -> None:
        self.launch(indices, topk_length if self.has_length else lens, table, lens, self.flag, *self.ints)


def compact_indices(indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None = None, *,
                    out_of_range_is_none: bool = False, out: tuple | None = None):
    """(table [T, topk] int32, lens [T] int32): each token's valid indices first, in order, as the block-table
    row of a paged cache of one-token pages (slot = page), and their count; a token with a bad index (outside
    [-1, num_slots)) gets lens = topk + 1, which the dense decode turns into NaN rows, and the error flag.
    `out`: a (table, lens) pair of those shapes to write (`scratch`) instead of new tensors."""
    tokens, topk = indices.shape
    if out is None:
        table = torch.empty((tokens, max(topk, 1)), dtype=torch.int32, device=indices.device)
        lens = torch.empty(tokens, dtype=torch.int32, device=indices.device)
    else:
        table, lens = out
    if tokens:
        IndexCompaction(indices, num_slots, topk_length, table, out_of_range_is_none=out_of_range_is_none)(
            indices, topk_length, table, lens)
    return table, lens


class Scratch:
    """Index buffers that live only while one call's kernels run, kept for the calls of one layout: an eager
    call reuses them (the next call's kernels follow this one's in stream order), a call being captured in a
    CUDA graph gets its own (the graph must not share them with later eager calls)."""

    def __init__(self) -> None:
        self._buffers: dict = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if capturing_on(device):
            return torch.empty(shape, dtype=dtype, device=device)
        found = self._buffers.get(name)
        if found is None or found.shape != shape or found.dtype != dtype or found.device != device:
            found = self._buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return found

    def full(self, name: str, shape: tuple, value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `value` everywhere, made once, that a call may write after the fill (a capture gets its
        own)."""
        if capturing_on(device):
            return torch.full(shape, value, dtype=dtype, device=device)
        found = self._buffers.get(name)
        if found is None or found.shape != shape or found.dtype != dtype or found.device != device:
            found = self._buffers[name] = torch.full(shape, value, dtype=dtype, device=device)
        return found

    def constant(self, name: str, shape: tuple, value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `value` everywhere that nothing writes: made once, and a CUDA-graph capture reads the one
        an eager call made (no fill inside the graph); made during a capture, it belongs to that graph alone."""
        found = self._buffers.get(name)
        if found is None or found.shape != shape or found.dtype != dtype or found.device != device:
            found = torch.full(shape, value, dtype=dtype, device=device)
            if not capturing_on(device):
                self._buffers[name] = found
        return found


@triton.jit
def _dequant_rows_kernel(Table, Lens, Cache, Rows, topk, stride_table_t, stride_cache_slot, stride_rows,
                         ROWS: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
                         PDL: tl.constexpr = False):
    """The fp8_ds_mla rows a token's compacted table names, dequantised into its own stretch of Rows
    (row token * topk + j), and the table pointed at them. A token marked bad (Lens > topk) is left alone:
    its table holds fewer entries than its length, and the decode makes its rows NaN from the length."""
    if PDL:
        pdl_enter()
    token = tl.program_id(0)
    offs = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    count = tl.load(Lens + token)
    count = tl.where(count > topk, 0, count)
    valid = offs < count
    slot = tl.load(Table + token * stride_table_t + offs, mask=valid, other=0).to(tl.int64)
    row = Cache + slot * stride_cache_slot
    offs_d = tl.arange(0, KV_LORA_RANK)
    raw = tl.load(row[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
    values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale_ptr = (row + KV_LORA_RANK).to(tl.pointer_type(tl.float32))
    tile_scale = tl.load(scale_ptr[:, None] + tl.arange(0, KV_LORA_RANK // 128)[None, :], mask=valid[:, None],
                         other=0.0)
    latent = tl.reshape(tl.reshape(values, [ROWS, KV_LORA_RANK // 128, 128]) * tile_scale[:, :, None],
                        [ROWS, KV_LORA_RANK])
    offs_r = tl.arange(0, ROPE_DIM)
    rope_ptr = (row + KV_LORA_RANK + 4 * (KV_LORA_RANK // 128)).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(rope_ptr[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
    target = token.to(tl.int64) * topk + offs
    out = Rows + target * stride_rows
    tl.store(out[:, None] + offs_d[None, :], latent.to(Rows.dtype.element_ty), mask=valid[:, None])
    tl.store(out[:, None] + KV_LORA_RANK + offs_r[None, :], rope.to(Rows.dtype.element_ty), mask=valid[:, None])
    tl.store(Table + token * stride_table_t + offs, target.to(tl.int32), mask=valid)


_DEQUANT_ROWS = 16


def dequantize_named_rows(table: torch.Tensor, lens: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype):
    """fp8_ds_mla cache rows named by a compacted table ([T, topk], `compact_indices`) -> a [T * topk, 1, 576]
    cache of `dtype` one-token pages, each token's rows in its own stretch, and the table pointed at them
    (in place). T * topk * 576 values of scratch; the rows no table entry names stay unwritten."""
    tokens, topk = table.shape
    flat = cache.reshape(-1, cache.shape[-1])
    rows = torch.empty(tokens * topk, 576, dtype=dtype, device=table.device)
    if tokens and topk:
        launch = bound_by_layout(
            _dequant_rows_kernel, (tokens, triton.cdiv(topk, _DEQUANT_ROWS)),
            dict(ROWS=_DEQUANT_ROWS, KV_LORA_RANK=512, ROPE_DIM=64, num_warps=4), table.device,
            ("dequant", layout_key(table), layout_key(flat), dtype),
        )
        launch(table, lens, flat, rows, topk, table.stride(0), flat.stride(0), rows.stride(0))
    return rows.view(tokens * topk, 1, 576), table


_BLOCK = 1024
# an index list's kernels (sanitize, compact) take a list of up to this many entries in one pass: a second
# pass waits on the first's scan (1 / 64 / 128 lists of 2048 entries replayed from a CUDA graph, H200:
# compaction 3.7 / 4.2 / 4.4 µs a launch against 5.2 / 5.8 / 6.1 in two passes of 1024 with 4 warps; bench/RESULTS.md)
_LIST_BLOCK = 4096


def _sanitized(indices, num_slots: int, topk_length, out):
    """`SparseIndexPlan.sanitize`'s contract in PyTorch (CPU tensors): (the clean list, its tokens holding a
    bad index, bool [T])."""
    outside = (indices < 0) | (indices >= num_slots)
    past = torch.zeros_like(outside)
    if topk_length is not None:
        past = torch.arange(indices.shape[1], device=indices.device).unsqueeze(0) >= topk_length.unsqueeze(1)
    clean = torch.where(outside | past, torch.full_like(indices, -1), indices)
    if out is not None:
        out[:, :clean.shape[1]].copy_(clean)
        clean = out
    return clean, (outside & (indices != -1)).any(dim=-1)


def _list_launch(topk: int) -> dict:
    """The index-list kernels' block (the whole list up to `_LIST_BLOCK` entries) and warps."""
    block = min(_LIST_BLOCK, max(16, triton.next_power_of_2(topk)))
    return {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4}


class SparseIndexPlan:
    """The two launches around a trusting kernel, bound for one layout: `sanitize` before, `finish` after.

    `finish` makes a marked token's output rows and LSE NaN and turns the +inf
    LSE some kernels leave for a token with nothing to attend to into -inf."""

    def __init__(self, tokens: int, topk: int, heads: int, row_width: int, device: torch.device, *,
                 bad_is_error: bool, has_length: bool, second: tuple[int, bool] | None = None) -> None:
        from mla_multi.kernels.launch import BoundLaunch, pdl_constexprs

        self.tokens, self.topk, self.heads, self.row_width = tokens, topk, heads, row_width
        self.device = device
        self.bad_is_error = bad_is_error
        self.has_length = has_length
        # (topk, has_length) of a second list of the same tokens (`sanitize_pair`: one launch for both), or None
        self.second = second
        self.gpu = device.type == "cuda"
        self.scratch = Scratch()  # the sanitised copy and the marks, reused by eager calls
        # (the tensors, their addresses or None) of the buffers an eager caller keeps (`keep`, `eager_kept`)
        self._eager = None
        if self.gpu and tokens:
            self.flag = errors.error_flag(device)
            pdl = pdl_constexprs(device)
            longest = max(topk, 0 if second is None else second[0])
            self._sanitize = BoundLaunch(
                _sanitize_indices_kernel, (tokens,),
                dict(_list_launch(longest), BAD_IS_ERROR=bad_is_error, HAS_LENGTH=has_length,
                     SECOND=second is not None, HAS_LENGTH2=second is not None and second[1],
                     WHOLE=longest <= _LIST_BLOCK, **pdl),
                device)
            self._finish = BoundLaunch(
                _finish_rows_kernel, (tokens,),
                dict(BLOCK=_BLOCK, LSE_BLOCK=max(16, triton.next_power_of_2(heads)), HAS_BAD=bad_is_error,
                     num_warps=4, **pdl), device)

    def sanitize(self, indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None):
        """(indices with every out-of-contract entry and every entry past topk_length -1, bad_rows or None).

        `out` [T, >= topk] int32 (rows of stride >= topk, last stride 1) receives the list in its first topk
        columns instead of the plan's scratch."""
        if self.second is not None:
            raise ValueError("a plan made with a second list sanitises both at once: sanitize_pair")
        clean, _, bad_rows = self._run(indices, num_slots, topk_length, out, None)
        return clean, bad_rows

    def sanitize_pair(self, indices, num_slots: int, topk_length, second_indices, second_num_slots: int,
                      second_topk_length, *, out=None, second_out=None):
        """Both lists of a plan made with `second`, in one launch: (the first clean, the second clean, bad_rows
        or None), bad_rows marking a token whose either list holds a bad index; `out` / `second_out` as
        `sanitize`'s."""
        if self.second is None:
            raise ValueError("a plan made without a second list: sanitize")
        return self._run(indices, num_slots, topk_length, out,
                         (second_indices, second_num_slots, second_topk_length, second_out))

    def _run(self, indices, num_slots, topk_length, out, second):
        if not self.gpu:  # the same contract in PyTorch (CPU tensors, tests)
            clean, bad = _sanitized(indices, num_slots, topk_length, out)
            second_clean = None
            if second is not None:
                second_clean, second_bad = _sanitized(second[0], second[1], second[2], second[3])
                bad = bad | second_bad
            if not self.bad_is_error:
                return clean, second_clean, None
            errors.error_flag(indices.device).bitwise_or_(bad.any().to(torch.int32) * errors.SPARSE_INDEX)
            return clean, second_clean, bad.to(torch.int8)
        clean = out if out is not None else self.scratch.get("clean", (self.tokens, self.topk), torch.int32,
                                                             self.device)
        bad_rows = self.scratch.get("bad", (self.tokens,), torch.int8, self.device) if self.bad_is_error else None
        second_clean = None
        if second is not None:
            second_indices, second_num_slots, second_length, second_clean = second
            if second_clean is None:
                second_clean = self.scratch.get("second clean", (self.tokens, self.second[0]), torch.int32,
                                                self.device)
            second = (second_indices, second_num_slots, second_length, second_clean)
        self.launch(indices, num_slots, topk_length, clean, bad_rows, second)
        return clean, second_clean, bad_rows

    def launch(self, indices, num_slots: int, topk_length, clean, bad_rows, second=None) -> None:
        """The sanitising launch (GPU) into buffers the caller keeps: clean [T, >= topk] (as `sanitize`'s
        `out`), bad_rows int8 [T] (None unless bad_is_error), second (indices, num_slots, topk_length, its clean
        buffer) for a plan made with `second`."""
        if not self.tokens:
            return
        second_clean = None if second is None else second[3]
        # the tensors themselves: the plan's first launch compiles through Triton, which types a pointer
        # parameter by its argument (an int would be typed int64)
        self.launch_kept(self.kept(clean, bad_rows, second_clean, addresses=False), indices, num_slots,
                         topk_length, None if second is None else second[:3])

    def kept(self, clean: torch.Tensor, bad_rows: torch.Tensor | None,
             second_clean: torch.Tensor | None = None, *, addresses: bool = True) -> tuple:
        """What `launch_kept` passes for the buffers kept for eager calls (`keep`: `launch`'s clean, bad_rows,
        second clean): their addresses as ints, beside the error flag's, and their row strides. The
        bound launcher takes an int pointer as it is, where it asks CUDA about every tensor's address (0.2-0.3
        µs of host a pointer); `keep` holds the tensors alive. Addresses only after the plan's first launch
        (`launch`, which passes the tensors: `addresses=False`) has bound the kernel."""
        if not (self.gpu and self.tokens):
            return ()
        # a kernel Triton launches itself (not bound: `launch.direct_launch_reason`) takes only the tensors
        addresses = addresses and self._sanitize.bound and self._finish.bound
        ref = torch.Tensor.data_ptr if addresses else (lambda tensor: tensor)
        address = ref(clean)
        bad = ref(bad_rows) if bad_rows is not None else address
        second = (address, clean.stride(0)) if second_clean is None else (ref(second_clean), second_clean.stride(0))
        return (address, bad, ref(self.flag), clean.stride(0)) + second

    def keep(self, clean: torch.Tensor, bad_rows: torch.Tensor | None, second_clean: torch.Tensor | None = None
             ) -> None:
        """Keep an eager call's buffers (`sanitize`'s clean, bad_rows, second clean; after its `finish`) for
        the plan's later eager calls (`eager_kept`), which holds the tensors alive; a call being captured keeps
        nothing (its buffers belong to its graph)."""
        if not (self.gpu and self.tokens) or capturing_on(self.device):
            return
        tensors = self.kept(clean, bad_rows, second_clean, addresses=False)
        addresses = self.kept(clean, bad_rows, second_clean)
        self._eager = (tensors, addresses if addresses[0] is not tensors[0] else None)

    def eager_kept(self) -> tuple | None:
        """The kept buffers (`keep`) as this call's launches take them (`launch_kept`, then `finish` with its
        element 1 where bad_is_error): their addresses while the bound launches go direct, the tensors while a
        Triton launch hook (a profiler's) sends them through Triton's own launch, which would type an int as an
        integer (`launch.launches_directly`); None before `keep`."""
        if self._eager is None:
            return None
        tensors, addresses = self._eager
        if addresses is not None and launches_directly():
            return addresses
        return tensors

    def launch_kept(self, kept: tuple, indices, num_slots: int, topk_length, second=None) -> None:
        """`launch` into the buffers `kept` describes: second (indices, num_slots, topk_length) for a plan made
        with `second`."""
        if not self.tokens:
            return
        clean, bad, flag, stride_out, second_clean, second_stride_out = kept
        length = topk_length if self.has_length else clean
        stride_in = indices.stride(0)
        if second is None:
            self._sanitize(indices, clean, bad, flag, length, num_slots, self.topk, stride_in, stride_out,
                           indices, clean, length, num_slots, self.topk, stride_in, stride_out)
            return
        second_indices, second_num_slots, second_length = second
        self._sanitize(indices, clean, bad, flag, length, num_slots, self.topk, stride_in, stride_out,
                       second_indices, second_clean, second_length if self.second[1] else second_clean,
                       second_num_slots, self.second[0], second_indices.stride(0), second_stride_out)

    def finish(self, bad_rows: torch.Tensor | int | None, out: torch.Tensor, lse: torch.Tensor) -> None:
        """out [T, N, width] and lse [T, N] (contiguous rows) in place; bad_rows as `launch` took it, or its
        address (an eager call's kept buffer, `kept`)."""
        if not self.gpu:
            lse.masked_fill_(lse == float("inf"), float("-inf"))
            if bad_rows is not None:
                marked = bad_rows.bool()
                out[marked] = float("nan")
                lse[marked] = float("nan")
            return
        if self.tokens:
            self._finish(bad_rows if bad_rows is not None else lse, out, lse, self.heads * self.row_width, self.heads,
                         out.stride(0), lse.stride(0))


def compile_specs(platform) -> list:
    """Both kernels as the FLASHMLA adapter launches them (bf16 outputs, 128 heads)."""
    from mla_multi.kernels.launch_config import CompileSpec

    specs = []
    list_2048 = _list_launch(2048)  # DeepSeek-V3.2's topk
    for bad_is_error in (True, False):
        signature = {"Indices": "*i32", "Out": "*i32", "Bad_rows": "*i8", "Error_flag": "*i32", "Topk_length": "*i32",
                     "num_slots": "i32", "topk": "i32", "stride_in_t": "i32", "stride_out_t": "i32",
                     "Indices2": "*i32", "Out2": "*i32", "Topk_length2": "*i32", "num_slots2": "i32", "topk2": "i32",
                     "stride_in2_t": "i32", "stride_out2_t": "i32", "BLOCK": "constexpr", "BAD_IS_ERROR": "constexpr",
                     "HAS_LENGTH": "constexpr", "SECOND": "constexpr", "HAS_LENGTH2": "constexpr",
                     "WHOLE": "constexpr"}
        # the decode's two lists in one launch (DeepSeek-V4: top-k 512 and the window segment); lists longer
        # than one block (blocks in turn) once
        for pair, whole in ((False, True), (True, True), (False, False)) if bad_is_error else ((False, True),):
            constexprs = {"BLOCK": list_2048["BLOCK"], "BAD_IS_ERROR": bad_is_error, "HAS_LENGTH": True,
                          "SECOND": pair, "HAS_LENGTH2": pair, "WHOLE": whole}
            specs.append(CompileSpec(
                name=f"sanitize_indices[{'decode' if bad_is_error else 'prefill'}{',two lists' if pair else ''}"
                     f"{'' if whole else ',blocks in turn'}]",
                fn=_sanitize_indices_kernel, signature=signature, constexprs=constexprs,
                options={"num_warps": list_2048["num_warps"]},
                divisible_by_16=("Indices", "Out", "stride_in_t", "stride_out_t"),
            ))
        signature = {"Bad_rows": "*i8", "Out": "*bf16", "Lse": "*fp32", "row_width": "i32", "lse_width": "i32",
                     "stride_o_t": "i32", "stride_lse_t": "i32", "BLOCK": "constexpr", "LSE_BLOCK": "constexpr",
                     "HAS_BAD": "constexpr"}
        specs.append(CompileSpec(
            name=f"finish_rows[bf16,{'decode' if bad_is_error else 'prefill'}]", fn=_finish_rows_kernel,
            signature=signature, constexprs={"BLOCK": _BLOCK, "LSE_BLOCK": 128, "HAS_BAD": bad_is_error},
            options={"num_warps": 4}, divisible_by_16=("Out", "Lse", "row_width", "stride_o_t", "stride_lse_t"),
        ))
    signature = {"Indices": "*i32", "Topk_length": "*i32", "Table": "*i32", "Lens": "*i32", "Error_flag": "*i32",
                 "num_slots": "i32", "topk": "i32", "stride_in_t": "i32", "stride_table_t": "i32",
                 "BLOCK": "constexpr", "HAS_LENGTH": "constexpr"}
    specs.append(CompileSpec(
        name="compact_indices", fn=_compact_indices_kernel, signature=dict(signature, OUT_OF_RANGE_IS_NONE="constexpr"),
        constexprs={"BLOCK": list_2048["BLOCK"], "HAS_LENGTH": True, "OUT_OF_RANGE_IS_NONE": False},
        options={"num_warps": list_2048["num_warps"]},
        divisible_by_16=("Indices", "Table", "stride_in_t", "stride_table_t"),
    ))
    signature = {"Table": "*i32", "Lens": "*i32", "Cache": "*u8", "Rows": "*bf16", "topk": "i32",
                 "stride_table_t": "i32", "stride_cache_slot": "i32", "stride_rows": "i32", "ROWS": "constexpr",
                 "KV_LORA_RANK": "constexpr", "ROPE_DIM": "constexpr"}
    if not (platform.is_cuda() and not platform.has_device_capability(8, 9)):  # sm_80: FP8 is a reason
        specs.append(CompileSpec(
            name="dequant_rows[ds_mla,bf16]", fn=_dequant_rows_kernel, signature=signature,
            constexprs={"ROWS": _DEQUANT_ROWS, "KV_LORA_RANK": 512, "ROPE_DIM": 64}, options={"num_warps": 4},
            divisible_by_16=("Table", "Cache", "Rows", "stride_table_t", "stride_cache_slot", "stride_rows"),
        ))
    return specs
