"""FLASHMLA: DeepSeek's FlashMLA kernels on NVIDIA (the `sgl-flash-mla` wheel, extra ``flashmla``).

Three phases, all through FlashMLA's Python interface (`flash_mla`), its
sm_90 kernels reached with ``use_legacy=True``; the bound sparse decodes
call the legacy op that interface calls (`legacy_sparse_decode_op`) directly
where the installed one has the published schema, with the schedule kept by
the bound call (the interface's per-call checks compare what the bound
layout already fixes):

* decode (dense): ``flash_mla_with_kvcache(q [B, Q, N, 576], cache [blocks,
  64, 1, 576], block_table, seq_lens, 512, sched, causal=Q > 1)``, bf16
  query and cache, pages of 64 tokens.  Its split-KV scheduler
  (``get_mla_decoding_metadata``) runs in the planning stage: `plan` makes it
  once per step for every layer (into fixed buffers for a CUDA-graph plan);
  a call without a plan schedules on the device itself, with no host
  synchronisation.
* sparse_decode: the same entry with ``indices`` over the fp8_ds_mla cache
  (``[blocks, block_size, 1, 656]`` uint8), every query token its own
  request (``q [T, 1, N, 576]``, ``indices [T, 1, topk]``); 64 or 128 heads.
* sparse_prefill: ``flash_mla_sparse_fwd(q [T, N, 576], kv [S, 1, 576],
  indices [T, 1, topk], scale, 512)``, bf16 rows; 64 or 128 heads.
* the DeepSeek-V4 contract (`forward_v4`, d_qk = d_v = 512): sparse decode
  over the 584-byte ``fp8_ds_mla_v4`` cache through the legacy kernels
  (``use_legacy=True, kv_format="V4"``, sm_90 and sm_100) and over the V4.1
  caches (``fp8_ds_mla_v41``, with an ``fp4_ds_mla_v41`` second segment)
  through the wheel's current kernels (``use_legacy=False``, sm_100 only),
  with the sink and the second segment (``extra_k_cache``); sparse prefill
  ``flash_mla_sparse_fwd(q [T, N, 512], kv [S, 1, 512], ...)`` over bf16
  rows with the sink and topk_length (its one kv: no second segment).

FlashMLA trusts its indices: its decode treats only -1 as "no token" and
checks no upper bound, and its sm_90 sparse decode takes no topk_length.
`mla_multi.kernels.sparse_indices.SparseIndexPlan` therefore copies every
index list first (one launch) with out-of-contract entries and entries past
the token's topk_length turned into -1 (so the scheduler depends on the
shapes alone and is made once per shape); in decode a bad index (outside
[-1, num_slots)) makes its token's rows NaN and sets the error flag, as in
the other backends, in the one launch after the kernel that also turns the
+inf LSE of a token with nothing to attend to into -inf.  A decode request
with no token gets 0 and LSE -inf.  The 576-wide query FlashMLA reads is a
view when q_nope and q_pe are adjacent slices of one buffer (`joined_query`),
a copy otherwise.

The V4 decode folds topk_length and extra_topk_length into the sanitised
index lists the same way (FlashMLA's split-KV schedule depends on the length
values it is given; without them it depends on the shapes alone), so one
schedule serves every call of a layout: FlashMLA makes it on the layout's
first eager call (its in-call scheduler, on the device) and later calls,
those captured in CUDA graphs included, reuse its buffers; a call captured
before any eager one schedules inside the graph and keeps nothing.  Index
lists whose length is not a multiple of FlashMLA's tile (64 in decode, 128
in prefill) are padded with -1.  The V4 prefill passes topk_length (clamped
to [0, topk]) beside the folded lists, so that its kernel stops at each
token's length.  FlashMLA returns natural-log LSEs, as the package does.

`FLASHMLA_CALLS` declares every FlashMLA function called and the keywords
passed; a test checks them against the published wheel's source.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import threading
import weakref
from typing import Any, ClassVar

import torch

from mla_multi.backends.base import (
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLADecodeImpl,
    MLASparseBackend,
    MLASparseImpl,
    SparseSelectorConfig,
    dtype_name,
)
from mla_multi.kernels import capturing, capturing_on, keep_unless_capturing
from mla_multi.metadata import pinned, to_device
from mla_multi.platforms import Platform

DISTRIBUTION = "sgl-flash-mla"
HEAD_DIM_V = 512
DENSE_PAGE_SIZE = 64
SPARSE_HEADS = (64, 128)
# topk multiples of the sm_90 kernels (their asserts: decode tiles of 64 indices, prefill pairs of 64-index tiles)
TOPK_MULTIPLE = {"sparse_decode": 64, "sparse_prefill": 128}
# compute capabilities whose kernels the wheel's legacy extension carries (dense decode: sm_90 only)
DENSE_CAPABILITIES = ((9, 0),)
SPARSE_CAPABILITIES = ((9, 0), (10, 0))
# The V4 contract: the 584-byte cache in the legacy kernels (sm_90, sm_100); the V4.1 caches in the wheel's
# current kernels, which run on sm_100 only (its `_loader`: "upstream's current kernels: V4.1 on SM100")
V4_LEGACY_FORMATS = ("fp8_ds_mla_v4",)
V41_FORMATS = ("fp8_ds_mla_v41", "fp4_ds_mla_v41")
V41_CAPABILITIES = ((10, 0),)
V4_WIDTH = 512


@dataclasses.dataclass(frozen=True)
class FlashMLACall:
    """A FlashMLA function this module calls and the keyword arguments it passes."""

    function: str
    keywords: tuple[str, ...]


FLASHMLA_CALLS: tuple[FlashMLACall, ...] = (
    FlashMLACall("get_mla_decoding_metadata", ("seqlens_k", "num_q_tokens_per_head_k", "h_k", "h_q",
                                                "is_fp8_kvcache", "topk", "use_legacy")),
    FlashMLACall("flash_mla_with_kvcache", ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
                                             "tile_scheduler_metadata", "softmax_scale", "causal", "is_fp8_kvcache",
                                             "indices", "attn_sink", "topk_length", "use_legacy",
                                             "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length",
                                             "kv_format")),
    FlashMLACall("get_mla_metadata", ()),
    FlashMLACall("flash_mla_sparse_fwd", ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length",
                                           "use_legacy")),
)


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[Any, str | None]:
    """(the flash_mla module, None) or (None, why it cannot be used)."""
    try:
        module = importlib.import_module("flash_mla")
    except Exception as error:  # any failure of an optional library is a reason
        return None, f"{DISTRIBUTION} is not importable (pip install 'mla-multi[flashmla]'): {type(error).__name__}: {error}"
    missing = [call.function for call in FLASHMLA_CALLS if not hasattr(module, call.function)]
    if missing:
        return None, f"the installed flash_mla ({version()}) lacks {', '.join(missing)}"
    for call in FLASHMLA_CALLS:
        parameters = inspect.signature(getattr(module, call.function)).parameters
        absent = [k for k in call.keywords if k not in parameters]
        if absent:
            return None, f"the installed flash_mla ({version()}) has no {', '.join(absent)} in {call.function}"
    has_legacy = getattr(module, "has_legacy", None)
    if has_legacy is None or not has_legacy():
        return None, f"the installed flash_mla ({version()}) has no legacy (sm_90, V3.2-format) kernels"
    return module, None


def clear_caches() -> None:
    """Forget the probe of the installed flash_mla and the graph buffers of its schedules (tests swap libraries;
    a sparse impl binds again when the module changes)."""
    _probe.cache_clear()
    legacy_sparse_decode_op.cache_clear()
    _graph_buffers.clear()


def version() -> str:
    try:
        return f"{DISTRIBUTION} {importlib.metadata.version(DISTRIBUTION)}"
    except importlib.metadata.PackageNotFoundError:
        return "flash_mla (version unknown)"


def _module():
    module, reason = _probe()
    if module is None:
        raise RuntimeError(reason)
    return module


# FlashMLA's legacy sparse decode op as `flash_mla_with_kvcache(..., use_legacy=True)` calls it (sgl-flash-mla
# 1.0.0, `flash_mla_interface.py`): its arguments by name, and four results (out, lse, the schedule's metadata and
# split counts)
LEGACY_SPARSE_DECODE_ARGUMENTS = ("q", "kv", "indices", "topk_length", "attn_sink", "tile_scheduler_metadata",
                                  "num_splits", "extra_kv", "extra_indices", "extra_topk_length", "d_v", "sm_scale",
                                  "kv_format")


@functools.lru_cache(maxsize=4)
def legacy_sparse_decode_op(module):
    """FlashMLA's legacy sparse decode op, called directly by the bound sparse decodes where the installed one
    takes `LEGACY_SPARSE_DECODE_ARGUMENTS` and returns four results: what `flash_mla_with_kvcache` adds on every
    call (its checks that a schedule's shapes match the call's, which the bound launch's layout key already
    holds) is then not paid (~4-5 µs of host time a call). None where it differs or cannot be read (a test's
    stand-in module): the interface is called."""
    get_ops = getattr(getattr(module, "_loader", None), "get_ops", None)
    if get_ops is None:
        return None
    try:
        op = get_ops(True).sparse_decode_fwd
        schema = op.default._schema
        names = tuple(argument.name for argument in schema.arguments)
        returns = len(schema.returns)
    except Exception:  # noqa: BLE001 - any failure: call the interface
        return None
    return op if names == LEGACY_SPARSE_DECODE_ARGUMENTS and returns == 4 else None


def _sched(module, tile_scheduler_metadata=None, num_splits=None):
    sched, _ = module.get_mla_metadata()
    sched.tile_scheduler_metadata = tile_scheduler_metadata
    sched.num_splits = num_splits
    return sched


class _FlashMLARequirements:
    vendors = frozenset({"cuda"})
    supported_dtypes = (torch.bfloat16,)
    capabilities: ClassVar[tuple[tuple[int, int], ...]] = SPARSE_CAPABILITIES

    @classmethod
    def availability_reasons(cls) -> list[str]:
        reason = _probe()[1]
        return [reason] if reason else []

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        reasons = super().platform_reasons(platform)
        if not reasons and platform.device_capability not in cls.capabilities:
            names = ", ".join(f"sm_{major}{minor}" for major, minor in cls.capabilities)
            reasons.append(f"FlashMLA's kernels here run on {names}; {platform.name} is {platform.arch}")
        return reasons


def _latent_reasons(dims) -> list[str]:
    if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (512, 64):
        return [f"kv_lora_rank {dims.kv_lora_rank} / qk_rope_head_dim {dims.qk_rope_head_dim}; FlashMLA takes 512 / 64"]
    return []


# --------------------------------------------------------------------------- dense decode


@dataclasses.dataclass
class FlashMLADecodePlan:
    """A scheduled decode batch: FlashMLA's split-KV metadata and the requests with no token."""

    batch: int
    query_len: int
    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor
    empty_rows: torch.Tensor | None
    cuda_graph: bool
    sched: Any = None  # the FlashMLASchedMeta every call of the plan passes (made by its first call)


_graph_buffers: dict = {}
_lock = threading.Lock()


class FlashMLADecodeImpl(MLADecodeImpl):
    """Dense MLA decode through FlashMLA (bf16, pages of 64)."""

    def plan_key(self) -> tuple:
        return ("FLASHMLA", "decode", self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                self.kv_cache_dtype, self.block_size)

    def _schedule(self, seq_lens: torch.Tensor, query_len: int):
        module = _module()
        metadata, splits = module.get_mla_decoding_metadata(
            seqlens_k=seq_lens, num_q_tokens_per_head_k=query_len * self.num_heads, h_k=1, h_q=self.num_heads,
            is_fp8_kvcache=False, topk=None, use_legacy=True,
        )
        return metadata, splits

    def plan(self, seq_lens_cpu: torch.Tensor, block_table: torch.Tensor, query_len: int = 1, *, k_scale=None,
             cuda_graph: bool = False, slot: int = 0) -> FlashMLADecodePlan:
        """Schedule one decode batch (seq_lens_cpu [B] on the host, block_table [B, max_blocks] on the device).

        A `cuda_graph` plan writes its metadata into buffers fixed per (batch, query_len, slot), so that a graph
        captured after it replays correctly after re-planning with new lengths."""
        device = block_table.device
        lengths = torch.as_tensor(seq_lens_cpu).to(torch.int32)
        batch = lengths.numel()
        if batch == 0:
            raise ValueError("FLASHMLA decode cannot plan an empty batch; accepted: at least one request")
        metadata, splits = self._schedule(to_device(lengths, device), query_len)
        empty = lengths == 0
        empty_rows = None
        if cuda_graph:
            key = (device, self.plan_key(), batch, query_len, slot)
            with _lock:
                buffers = _graph_buffers.get(key)
                if buffers is None or buffers[0].shape != metadata.shape:
                    buffers = (torch.empty_like(metadata), torch.empty_like(splits),
                               torch.zeros(batch, dtype=torch.bool, device=device))
                    _graph_buffers[key] = buffers
            buffers[0].copy_(metadata)
            buffers[1].copy_(splits)
            buffers[2].copy_(pinned(empty), non_blocking=True)
            metadata, splits, empty_rows = buffers
        elif bool(empty.any()):
            empty_rows = to_device(empty, device)
        return FlashMLADecodePlan(batch, query_len, metadata, splits, empty_rows, cuda_graph)

    def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, num_kv_splits=None,
                    workspace_manager=None, max_seq_len: int | None = None, plan: FlashMLADecodePlan | None = None):
        """q_nope [B, (Q,) N, 512], q_pe [B, (Q,) N, 64] bf16; kv_cache [blocks, 64, 576] bf16. Returns out with
        q_nope's shape and lse [B, (Q,) N] float32. num_kv_splits is FlashMLA's scheduler's to choose (ignored)."""
        module = _module()
        batch = q_nope.shape[0]
        query_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
        q = joined_query(q_nope, q_pe)
        if q.dim() == 3:
            q = q.unsqueeze(1)
        if plan is None:
            metadata, splits = self._schedule(seq_lens, query_len)
            empty_rows = seq_lens == 0
        else:
            if (plan.batch, plan.query_len) != (batch, query_len):
                raise ValueError(f"the FLASHMLA plan is for {plan.batch} requests of {plan.query_len} tokens; "
                                 f"q_nope has {batch} of {query_len}")
            metadata, splits, empty_rows = plan.tile_scheduler_metadata, plan.num_splits, plan.empty_rows
        sched = None if plan is None else plan.sched
        if sched is None:
            sched = _sched(module)
            if plan is not None:
                plan.sched = sched
        # the dense call reads these two and writes back what it returns: set them anew on every call
        sched.tile_scheduler_metadata, sched.num_splits = metadata, splits
        out, lse = module.flash_mla_with_kvcache(
            q=q, k_cache=kv_cache.unsqueeze(2), block_table=block_table, cache_seqlens=seq_lens,
            head_dim_v=self.kv_lora_rank, tile_scheduler_metadata=sched,
            softmax_scale=self.scale, causal=query_len > 1, is_fp8_kvcache=False, use_legacy=True,
        )
        out = out.view(q_nope.shape)
        lse = lse.transpose(1, 2).reshape(q_nope.shape[:-1])  # [B, N, Q] -> [B, (Q,) N]
        if empty_rows is not None:
            empty = empty_rows.view(batch, *([1] * (lse.dim() - 1)))
            out = out.masked_fill(empty.unsqueeze(-1), 0)
            lse = lse.masked_fill(empty, float("-inf"))
        return out, lse


class FlashMLADecodeBackend(_FlashMLARequirements, MLADecodeBackend):
    """FlashMLA's dense MLA decode (sm_90 kernels; bf16 cache, pages of 64)."""

    name: ClassVar[str] = "FLASHMLA"
    capabilities = DENSE_CAPABILITIES
    supported_kv_cache_dtypes = (torch.bfloat16,)
    supported_block_sizes = (DENSE_PAGE_SIZE,)
    max_num_heads = 128
    max_query_len = 4
    supports_cuda_graphs = True
    requires_plan: ClassVar[bool] = True

    @staticmethod
    def get_decode_impl_cls():
        return FlashMLADecodeImpl

    @classmethod
    def validate_configuration(cls, platform: Platform, config: DecodeSelectorConfig) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        reasons += _latent_reasons(config.dims)
        if config.kv_cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            reasons.append("an FP8 cache: FlashMLA's dense FP8 decode takes an FP8 query with its own scale "
                           "(descale_q), which this adapter does not quantise; TRITON reads FP8 caches")
        return reasons


# --------------------------------------------------------------------------- sparse


def joined_query(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[.., N, 512] and [.., N, 64] as one [.., N, 576] query: a view where q_pe continues q_nope's rows in
    memory (both slices of one buffer, as `MLAAttention` makes them), else a copy."""
    width = q_nope.shape[-1] + q_pe.shape[-1]
    if (q_nope.stride() == q_pe.stride() and q_nope.stride(-1) == 1 and q_nope.shape[:-1] == q_pe.shape[:-1]
            and q_pe.data_ptr() == q_nope.data_ptr() + q_nope.shape[-1] * q_nope.element_size()
            and q_nope.dtype == q_pe.dtype and all(s >= width for s in q_nope.stride()[:-1] if s != 1)):
        return q_nope.as_strided((*q_nope.shape[:-1], width), q_nope.stride())
    return torch.cat([q_nope, q_pe], dim=-1)


class _SparseCall:
    """What a sparse call of one layout needs beyond its data: FlashMLA's scheduler metadata (its schedule
    depends on the shapes alone, since topk_length is folded into the indices) and the bound index launches."""

    def __init__(self, module, tokens: int, heads: int, topk: int, width: int, device, *, decode: bool,
                 has_length: bool) -> None:
        from mla_multi.kernels.sparse_indices import SparseIndexPlan

        self.index_plan = SparseIndexPlan(tokens, topk, heads, width, device, bad_is_error=decode,
                                          has_length=has_length)
        self.sched = None
        if decode and tokens:
            # one FlashMLASchedMeta for every call of the layout: FlashMLA fills its config on the first call and
            # only compares it after (the schedule is computed here, outside any graph capture)
            self.sched = _sched(module, *module.get_mla_decoding_metadata(
                seqlens_k=torch.full((tokens,), topk, dtype=torch.int32, device=device),
                num_q_tokens_per_head_k=heads, h_k=1, h_q=heads, is_fp8_kvcache=True, topk=topk, use_legacy=True,
            ))


class _SparseImpl(MLASparseImpl):
    """What both FlashMLA sparse phases keep: the call bound to one layout (the impl belongs to one sparse op
    plan, so later calls find it; a call of another layout binds again)."""

    decode: ClassVar[bool]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._bound: tuple | None = None  # (the layout key, its _SparseCall)

    def _call(self, module, q_nope, indices, topk_length, num_slots: int) -> _SparseCall:
        """The call of this layout: every shape, stride, alignment and integer its bound index launches were
        specialised for is in the key."""
        from mla_multi.kernels.launch import alignment_key

        tokens, heads, width = q_nope.shape
        key = (q_nope.device, tokens, heads, width, indices.shape[1], indices.stride(0), topk_length is not None,
               num_slots, alignment_key(indices, topk_length), id(module))
        bound = self._bound
        if bound is None or bound[0] != key:
            bound = self._bound = (key, _SparseCall(module, tokens, heads, indices.shape[1], width, q_nope.device,
                                                    decode=self.decode, has_length=topk_length is not None))
        return bound[1]


def _padded(topk: int, multiple: int) -> int:
    """topk rounded up to FlashMLA's tile (at least one tile)."""
    return max(-(-topk // multiple), 1) * multiple


def _entries(indices):
    """An index list as the sanitising launch reads it: rows of stride-1 entries."""
    return indices if indices.stride(-1) == 1 else indices.contiguous()


def _padded_list(scratch, name: str, indices, topk: int, width: int):
    """(the list as the sanitising launch reads it, `_entries`; the copy FlashMLA reads where topk is not a
    multiple of its tile: [T, width] whose tail stays -1, filled once; else None)."""
    indices = _entries(indices)
    if width == topk:
        return indices, None
    return indices, scratch.full(name, (indices.shape[0], width), -1, torch.int32, indices.device)


class _PagedView:
    """A paged cache [blocks, block_size, width] as FlashMLA's kernels take it, [blocks, block_size, 1, width]:
    the view made once for the cache an engine passes on every call (the same tensor at the same address) and
    given again, where making it costs a call of PyTorch (2.5 µs of host on a slow host). It holds the cache's
    memory only while the tensor lives (a weak reference whose end drops the view)."""

    __slots__ = ("_source", "_address", "_view", "__weakref__")

    def __init__(self) -> None:
        self._source = None
        self._address = None
        self._view = None

    def __call__(self, kv: torch.Tensor) -> torch.Tensor:
        source = self._source
        if source is not None and source() is kv and kv.data_ptr() == self._address:
            return self._view
        view = kv.detach().unsqueeze(2)  # (a view of the tensor itself would keep it alive, and the weak
        # reference with it: detach's tensor shares the memory, not the object)
        holder = weakref.ref(self)

        def dropped(_, holder=holder) -> None:
            paged = holder()
            if paged is not None:
                paged._source = paged._view = None

        self._source, self._address, self._view = weakref.ref(kv, dropped), kv.data_ptr(), view
        return view


class _V4PrefillList:
    """The index list of a V4 prefill: its bound sanitising launch and, where its length is not a multiple of
    FlashMLA's tile, the padded copy FlashMLA reads (`_padded_list`)."""

    def __init__(self, tokens: int, topk: int, heads: int, device, *, has_length: bool) -> None:
        from mla_multi.kernels.sparse_indices import Scratch, SparseIndexPlan

        self.topk, self.width = topk, _padded(topk, TOPK_MULTIPLE["sparse_prefill"])
        # (an index outside [0, S_kv) is no token in prefill: nothing marked)
        self.index_plan = SparseIndexPlan(tokens, topk, heads, V4_WIDTH, device, bad_is_error=False,
                                          has_length=has_length)
        self.scratch = Scratch()

    def sanitize(self, indices, num_slots: int, topk_length):
        """(the list FlashMLA reads [T, width], None)."""
        indices, padded = _padded_list(self.scratch, "padded", indices, self.topk, self.width)
        return self.index_plan.sanitize(indices, num_slots, topk_length, out=padded)


class _V4DecodeCall:
    """What a V4 decode of one layout keeps: the sanitising launch of both index lists (one launch,
    `SparseIndexPlan.sanitize_pair`) and FlashMLA's schedule (made by the layout's first eager call, reused by
    every later call and graph capture)."""

    def __init__(self, tokens: int, heads: int, topk: int, extra_topk: int | None, device, *, has_length: bool,
                 has_extra_length: bool, legacy: bool) -> None:
        from mla_multi.kernels.sparse_indices import Scratch, SparseIndexPlan

        multiple = TOPK_MULTIPLE["sparse_decode"]
        self.topk, self.width = topk, _padded(topk, multiple)
        self.extra_topk = extra_topk
        self.extra_width = None if extra_topk is None else _padded(extra_topk, multiple)
        self.index_plan = SparseIndexPlan(tokens, topk, heads, V4_WIDTH, device, bad_is_error=True,
                                          has_length=has_length,
                                          second=None if extra_topk is None else (extra_topk, has_extra_length))
        self.scratch = Scratch()
        self.device = device
        self.legacy = legacy
        self.schedule_meta = None  # FlashMLA's FlashMLASchedMeta, filled by its first (eager) call
        # (the schedule's metadata, its split counts) where the op is called directly, made by the first eager call
        self.schedule_made = None

    def sanitize(self, indices, num_slots: int, topk_length, extra_indices, extra_slots: int, extra_topk_length):
        """(the top-k list FlashMLA reads [T, width], the window's or None, the tokens marked bad)."""
        indices, padded = _padded_list(self.scratch, "padded", indices, self.topk, self.width)
        if self.extra_topk is None:
            clean, bad_rows = self.index_plan.sanitize(indices, num_slots, topk_length, out=padded)
            return clean, None, bad_rows
        extra_indices, extra_padded = _padded_list(self.scratch, "extra padded", extra_indices, self.extra_topk,
                                                   self.extra_width)
        return self.index_plan.sanitize_pair(indices, num_slots, topk_length, extra_indices, extra_slots,
                                             extra_topk_length, out=padded, second_out=extra_padded)

    def launch(self, kept: tuple, indices, num_slots: int, topk_length, extra_indices, extra_slots: int,
               extra_topk_length) -> None:
        """`sanitize` into the buffers an earlier eager call kept in the index plan, as `kept` gives them
        (`SparseIndexPlan.eager_kept`)."""
        second = None
        if self.extra_topk is not None:
            second = (_entries(extra_indices), extra_slots, extra_topk_length)
        self.index_plan.launch_kept(kept, _entries(indices), num_slots, topk_length, second)

    def call_op(self, op, capture: bool, q, kv, listed, attn_sink, extra_kv, extra_listed, width: int, scale: float,
                kv_format):
        """FlashMLA's legacy op (`legacy_sparse_decode_op`) called with the kept schedule: none before the first
        call, which FlashMLA then schedules itself (on the device) and whose schedule is kept unless made in a
        capture (`keep_unless_capturing`, as `schedule`'s). Returns (out, lse) as FlashMLA gives them."""
        metadata, num_splits = self.schedule_made or (None, None)
        out, lse, made, splits = op(q, kv, listed, None, attn_sink, metadata, num_splits, extra_kv, extra_listed, None,
                                    width, scale, kv_format)
        if metadata is None:
            keep_unless_capturing(self, "schedule_made", (made, splits), capture)
        return out, lse

    def schedule(self, module):
        """The kept schedule, or a new one: kept when made outside a graph capture (a capture's schedule
        is written only when the graph replays, so it serves that capture alone)."""
        if self.schedule_meta is not None:
            return self.schedule_meta
        return keep_unless_capturing(self, "schedule_meta", module.get_mla_metadata()[0], capturing_on(self.device))


def _sparse_reasons(phase: str, config: SparseSelectorConfig) -> list[str]:
    reasons = _latent_reasons(config.dims)
    if config.dims.num_heads not in SPARSE_HEADS:
        reasons.append(f"num_heads {config.dims.num_heads}; FlashMLA's sparse kernels take "
                       f"{' or '.join(map(str, SPARSE_HEADS))}")
    multiple = TOPK_MULTIPLE[phase]
    if config.topk % multiple:
        reasons.append(f"topk {config.topk}; FlashMLA's {phase.replace('_', ' ')} takes a multiple of {multiple}")
    return reasons


def _v4_heads_reasons(config: SparseSelectorConfig) -> list[str]:
    if config.dims.num_heads not in SPARSE_HEADS:
        return [f"num_heads {config.dims.num_heads}; FlashMLA's V4 sparse kernels take "
                f"{' or '.join(map(str, SPARSE_HEADS))}"]
    return []


def _v4_decode_reasons(platform: Platform, config: SparseSelectorConfig) -> list[str]:
    """What FlashMLA's V4 sparse decode rejects beyond the declared formats (FlashMLA's interface rules)."""
    from mla_multi.cache_formats import FORMATS

    reasons = _v4_heads_reasons(config)
    main, extra = config.kv_format, config.extra_kv_format
    if main in FORMATS and FORMATS[main].second_segment_only:
        reasons.append(f"a {main} main cache: FlashMLA takes that format only as the second segment (extra_k_cache) "
                       f"beside {' or '.join(FORMATS[main].main_formats)}")
    elif extra is not None and main in FORMATS and extra in FORMATS:
        allowed = (main,) + tuple(f.name for f in FORMATS.values() if main in f.main_formats)
        if extra not in allowed:
            reasons.append(f"a second segment in {extra} beside a {main} cache: FlashMLA's extra_k_cache takes the "
                           f"main cache's format ({' or '.join(allowed)})")
    v41 = [f for f in (main, extra) if f in V41_FORMATS]
    if v41 and platform.device_capability not in V41_CAPABILITIES:
        names = ", ".join(f"sm_{major}{minor}" for major, minor in V41_CAPABILITIES)
        reasons.append(f"the V4 contract over {' and '.join(dict.fromkeys(v41))} runs in FlashMLA's current kernels "
                       f"(use_legacy=False), on {names} only; {platform.name} is {platform.arch}")
    return reasons


class _JoinedQuery:
    """`joined_query` decided once for a layout: where q_pe's rows continue q_nope's in one buffer (checked by
    address on every call, the one thing a layout does not fix), a view of the given shape; else a copy."""

    __slots__ = ("shape", "stride", "gap")

    def __init__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lead: tuple = ()) -> None:
        joined = joined_query(q_nope, q_pe)
        self.gap = None
        if joined.data_ptr() == q_nope.data_ptr() and q_pe.data_ptr() > q_nope.data_ptr():  # a view: the layout joins
            self.gap = q_pe.data_ptr() - q_nope.data_ptr()
            view = joined
            for dim in lead:
                view = view.unsqueeze(dim)
            self.shape, self.stride = tuple(view.shape), view.stride()

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lead: tuple = ()) -> torch.Tensor:
        if self.gap is not None and q_pe.data_ptr() - q_nope.data_ptr() == self.gap:
            return q_nope.as_strided(self.shape, self.stride)
        joined = torch.cat([q_nope, q_pe], dim=-1)
        for dim in lead:
            joined = joined.unsqueeze(dim)
        return joined


class _SparseDecodeLaunch:
    """The FLASHMLA sparse decode (fp8_ds_mla) bound to one layout (`FlashMLASparseDecodeImpl.bind`): the index
    launches, FlashMLA's schedule and op (`legacy_sparse_decode_op`), the query's join and, once an eager call has
    made them, the sanitised list's buffers decided once; a call sanitises, calls FlashMLA, finishes."""

    def __init__(self, impl: "FlashMLASparseDecodeImpl", q_nope, q_pe, kv, indices, topk_length) -> None:
        self.module = _module()
        tokens, heads, _ = q_nope.shape
        self.num_slots = kv.shape[0] * kv.shape[1]
        self.call = impl._call(self.module, q_nope, indices, topk_length, self.num_slots)
        self.op = None if self.call.sched is None else legacy_sparse_decode_op(self.module)
        self.query = _JoinedQuery(q_nope, q_pe, lead=(1,))
        self.head_dim_v = impl.kv_lora_rank
        self.out_shape, self.lse_shape = (tokens, heads, -1), (tokens, heads)
        self.paged = _PagedView()
        # the sanitised list as FlashMLA reads it, of the buffers the first eager call kept in the index plan
        # (`SparseIndexPlan.keep`): later eager calls launch into them
        self.eager = None

    def __call__(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        call = self.call
        # FlashMLA's shapes first: what the host does between the index launch and FlashMLA's own is time the
        # device waits in an eager call
        q = self.query(q_nope, q_pe, (1,))
        paged = self.paged(kv)
        # an eager GPU call (the index launches' kept buffers; a capture gets its own, a CPU call runs PyTorch)
        eager = q_nope.is_cuda and not capturing(q_nope)
        plan = call.index_plan
        kept = plan.eager_kept() if eager and self.eager is not None else None
        if kept is not None:
            listed, bad_rows = self.eager, kept[1] if plan.bad_is_error else None
            plan.launch_kept(kept, indices, self.num_slots, topk_length)
        else:  # the first eager call, a capture, a CPU call
            clean, bad_rows = call.index_plan.sanitize(indices, self.num_slots, topk_length)
            listed = clean.unsqueeze(1)
        if self.op is not None:
            sched = call.sched
            out, lse, _, _ = self.op(q, paged, listed, None, attn_sink, sched.tile_scheduler_metadata,
                                     sched.num_splits, None, None, None, self.head_dim_v, float(scale), None)
        else:
            out, lse = self.module.flash_mla_with_kvcache(
                q=q, k_cache=paged, block_table=None, cache_seqlens=None, head_dim_v=self.head_dim_v,
                tile_scheduler_metadata=call.sched, softmax_scale=float(scale), causal=False, is_fp8_kvcache=True,
                indices=listed, attn_sink=attn_sink, topk_length=None, use_legacy=True,
            )
        out = out.view(self.out_shape)
        lse = lse.view(self.lse_shape)
        plan.finish(bad_rows, out, lse)
        if eager and kept is None:  # (both index launches bound now: `SparseIndexPlan.keep`)
            plan.keep(clean, bad_rows)
            self.eager = listed
        return out, lse


class _V4DecodeLaunch:
    """The FLASHMLA V4 sparse decode bound to one layout (`FlashMLASparseDecodeImpl.bind_v4`): both segments'
    index launches, FlashMLA's schedule and op (`legacy_sparse_decode_op`, the legacy kernels), its format name,
    the call's fixed arguments and, once an eager call has made them, the sanitised lists' buffers decided once."""

    def __init__(self, impl: "FlashMLASparseDecodeImpl", q, kv, indices, topk_length, attn_sink, extra_kv,
                 extra_indices, extra_topk_length, kv_format: str) -> None:
        from mla_multi.cache_formats import get_format

        self.module = _module()
        tokens, heads, width = q.shape
        self.call = impl._call_v4(self.module, q, indices, topk_length, extra_indices, extra_topk_length, kv,
                                  extra_kv, kv_format)
        self.op = legacy_sparse_decode_op(self.module) if self.call.legacy else None
        self.num_slots = kv.shape[0] * kv.shape[1]
        self.extra_slots = 0 if extra_kv is None else extra_kv.shape[0] * extra_kv.shape[1]
        self.q_copy = q.stride(-1) != 1
        self.sink_copy = attn_sink is not None and not attn_sink.is_contiguous()
        self.width = width
        self.out_shape, self.lse_shape = (tokens, heads, width), (tokens, heads)
        self.kv_format = get_format(kv_format).flashmla_name if self.call.legacy else None
        self.paged, self.extra_paged = _PagedView(), _PagedView()
        # (the top-k list, the window's or None) as FlashMLA reads them, of the buffers the first eager call kept
        # in the index plan (`SparseIndexPlan.keep`): later eager calls launch into them
        self.eager = None

    def __call__(self, q, kv, indices, scale, *, topk_length=None, attn_sink=None, extra_kv=None, extra_indices=None,
                 extra_topk_length=None):
        call = self.call
        # FlashMLA's shapes first: what the host does between the index launch and FlashMLA's own is time the
        # device waits in an eager call
        if self.q_copy:
            q = q.contiguous()
        if self.sink_copy:
            attn_sink = attn_sink.contiguous()
        q_4d = q.unsqueeze(1)
        paged = self.paged(kv)
        extra_cache = None if extra_kv is None else self.extra_paged(extra_kv)
        # an eager GPU call (the index launches' kept buffers; a capture gets its own, a CPU call runs PyTorch)
        capture = capturing(q)
        eager = q.is_cuda and not capture
        plan = call.index_plan
        kept = plan.eager_kept() if eager and self.eager is not None else None
        if kept is not None:
            (listed, extra_listed), bad_rows = self.eager, kept[1]  # (a V4 decode marks bad tokens)
            call.launch(kept, indices, self.num_slots, topk_length, extra_indices, self.extra_slots,
                        extra_topk_length)
        else:  # the first eager call, a capture, a CPU call
            clean, extra_clean, bad_rows = call.sanitize(indices, self.num_slots, topk_length, extra_indices,
                                                         self.extra_slots, extra_topk_length)
            listed = clean.unsqueeze(1)
            extra_listed = None if extra_clean is None else extra_clean.unsqueeze(1)
        if self.op is not None:
            out, lse = call.call_op(self.op, capture, q_4d, paged, listed, attn_sink, extra_cache,
                                    extra_listed, self.width, float(scale), self.kv_format)
        else:
            extra = {}
            if extra_cache is not None:
                extra = dict(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra_listed)
            module = self.module
            out, lse = module.flash_mla_with_kvcache(
                q=q_4d, k_cache=paged, block_table=None, cache_seqlens=None, head_dim_v=self.width,
                tile_scheduler_metadata=call.schedule(module), softmax_scale=float(scale), causal=False,
                is_fp8_kvcache=True, indices=listed, attn_sink=attn_sink, topk_length=None, extra_topk_length=None,
                use_legacy=call.legacy, kv_format=self.kv_format, **extra,
            )
        out = out.view(self.out_shape)
        lse = lse.view(self.lse_shape)
        plan.finish(bad_rows, out, lse)
        if eager and kept is None:  # (both index launches bound now: `SparseIndexPlan.keep`)
            plan.keep(clean, bad_rows, extra_clean)
            self.eager = (listed, extra_listed)
        return out, lse


class FlashMLASparseDecodeImpl(_SparseImpl):
    """Sparse decode over the fp8_ds_mla cache, every query token its own request. FlashMLA's sm_90 kernel
    takes no per-token lengths: entries past topk_length become -1 in the sanitised copy of the indices."""

    decode = True

    def bind(self, q_nope, q_pe, kv, indices, *, k_scale=None, topk_length=None, attn_sink=None):
        """See `MLASparseImpl.bind` (`_SparseDecodeLaunch`)."""
        return _SparseDecodeLaunch(self, q_nope, q_pe, kv, indices, topk_length)

    def bind_v4(self, q, kv, indices, *, kv_format, topk_length=None, attn_sink=None, extra_kv=None,
                extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        """See `MLASparseImpl.bind_v4` (`_V4DecodeLaunch`)."""
        if q.shape[0] == 0:
            return super().bind_v4(q, kv, indices, kv_format=kv_format, extra_kv_format=extra_kv_format)
        return _V4DecodeLaunch(self, q, kv, indices, topk_length, attn_sink, extra_kv, extra_indices,
                               extra_topk_length, kv_format)

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        return _SparseDecodeLaunch(self, q_nope, q_pe, kv, indices, topk_length)(
            q_nope, q_pe, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink)

    def _call_v4(self, module, q, indices, topk_length, extra_indices, extra_topk_length, kv, extra_kv,
                 kv_format: str) -> _V4DecodeCall:
        from mla_multi.kernels.launch import alignment_key

        tokens, heads, _ = q.shape
        extra_key = None if extra_kv is None else (extra_indices.shape[1], extra_indices.stride(0),
                                                   extra_topk_length is not None, tuple(extra_kv.shape))
        key = ("v4", q.device, tokens, heads, indices.shape[1], indices.stride(0), topk_length is not None,
               tuple(kv.shape), kv_format, extra_key,
               alignment_key(indices, topk_length, extra_indices, extra_topk_length), id(module))
        bound = self._bound
        if bound is None or bound[0] != key:
            call = _V4DecodeCall(tokens, heads, indices.shape[1], None if extra_kv is None else extra_indices.shape[1],
                                 q.device, has_length=topk_length is not None,
                                 has_extra_length=extra_topk_length is not None,
                                 legacy=kv_format in V4_LEGACY_FORMATS)
            bound = self._bound = (key, call)
        return bound[1]

    def forward_v4(self, q, kv, indices, scale, *, kv_format, topk_length=None, attn_sink=None, extra_kv=None,
                   extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        """q [T, N, 512] bf16 over a uint8 V4 cache (and its second segment), every token its own request
        (FlashMLA's q [T, 1, N, 512]). Returns out [T, N, 512] and lse [T, N] (natural log)."""
        tokens, heads, width = q.shape
        if tokens == 0:  # FlashMLA takes no empty batch
            return q.new_empty(0, heads, width), torch.empty(0, heads, dtype=torch.float32, device=q.device)
        launch = _V4DecodeLaunch(self, q, kv, indices, topk_length, attn_sink, extra_kv, extra_indices,
                                 extra_topk_length, kv_format)
        return launch(q, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink, extra_kv=extra_kv,
                      extra_indices=extra_indices, extra_topk_length=extra_topk_length)


class FlashMLASparseDecodeBackend(_FlashMLARequirements, MLASparseBackend):
    """FlashMLA's sparse decode over the fp8_ds_mla cache (DeepSeek-V3.2) and, under the V4 contract, over
    the fp8_ds_mla_v4 cache (sm_90, sm_100) and the V4.1 caches (sm_100); 64 or 128 heads."""

    name: ClassVar[str] = "FLASHMLA"
    supported_kv_dtypes = (torch.uint8,)
    supported_v4_formats = V4_LEGACY_FORMATS + V41_FORMATS
    max_num_heads = 128
    max_query_len = 1 << 16

    @staticmethod
    def get_impl_cls():
        return FlashMLASparseDecodeImpl

    @classmethod
    def validate_configuration(cls, platform: Platform, config: SparseSelectorConfig) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        if config.v4:
            return reasons + _v4_decode_reasons(platform, config)
        if config.kv_dtype in (torch.bfloat16, torch.float16):
            reasons.append(f"a {dtype_name(config.kv_dtype)} cache: FlashMLA's sparse decode reads only the "
                           "fp8_ds_mla layout")
        return reasons + _sparse_reasons("sparse_decode", config)


class FlashMLASparsePrefillImpl(_SparseImpl):
    """Sparse prefill over bf16 kv rows (indices outside [0, S_kv) and past topk_length become -1 first)."""

    decode = False

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        module = _module()
        tokens, heads, _ = q_nope.shape
        call = self._call(module, q_nope, indices, topk_length, kv.shape[0])
        clean, _ = call.index_plan.sanitize(indices, kv.shape[0], topk_length)
        out, _, lse = module.flash_mla_sparse_fwd(
            q=joined_query(q_nope, q_pe), kv=kv.unsqueeze(1), indices=clean.unsqueeze(1), sm_scale=float(scale),
            d_v=self.kv_lora_rank, attn_sink=attn_sink, topk_length=None, use_legacy=True,
        )
        out = out.view(tokens, heads, -1)
        lse = lse.view(tokens, heads)
        call.index_plan.finish(None, out, lse)
        return out, lse

    def forward_v4(self, q, kv, indices, scale, *, kv_format="rows", topk_length=None, attn_sink=None,
                   extra_kv=None, extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        """q [T, N, 512] bf16 over kv [S, 512] bf16 rows: FlashMLA's d_qk 512 sparse prefill. Its one kv takes no
        second segment (the backend declines one). Returns out [T, N, 512] and lse [T, N] (natural log)."""
        if extra_kv is not None:
            raise ValueError("extra_kv: FlashMLA's sparse prefill (flash_mla_sparse_fwd) takes one kv; accepted: "
                             "extra_kv=None here, or backend='REFERENCE' for a second segment")
        module = _module()
        tokens, heads, width = q.shape
        if tokens == 0 or kv.shape[0] == 0:  # no row to attend to (FlashMLA cannot describe an empty kv)
            return (q.new_zeros(tokens, heads, width),
                    torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q.device))
        from mla_multi.kernels.launch import alignment_key

        key = ("v4", q.device, tokens, heads, indices.shape[1], indices.stride(0), topk_length is not None,
               kv.shape[0], alignment_key(indices, topk_length), id(module))
        bound = self._bound
        if bound is None or bound[0] != key:
            bound = self._bound = (key, _V4PrefillList(tokens, indices.shape[1], heads, q.device,
                                                   has_length=topk_length is not None))
        segment = bound[1]
        clean, _ = segment.sanitize(indices, kv.shape[0], topk_length)
        # the kernel stops at each token's length (entries past it are -1 already); clamped, so that it never
        # reads past the list
        lengths = None if topk_length is None else topk_length.clamp(0, segment.topk).to(torch.int32)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out, _, lse = module.flash_mla_sparse_fwd(
            q=q, kv=kv.unsqueeze(1), indices=clean.unsqueeze(1), sm_scale=float(scale), d_v=width,
            attn_sink=None if attn_sink is None else attn_sink.contiguous(), topk_length=lengths, use_legacy=True,
        )
        out = out.view(tokens, heads, width)
        lse = lse.view(tokens, heads)
        segment.index_plan.finish(None, out, lse)
        return out, lse


class FlashMLASparsePrefillBackend(_FlashMLARequirements, MLASparseBackend):
    """FlashMLA's sparse prefill over bf16 kv rows: DeepSeek-V3.2's d_qk 576 and, under the V4 contract, d_qk
    512 with the sink and topk_length (one kv: no second segment); 64 or 128 heads."""

    name: ClassVar[str] = "FLASHMLA"
    supported_kv_dtypes = (torch.bfloat16,)
    supported_v4_formats = ("rows",)
    max_num_heads = 128

    @staticmethod
    def get_impl_cls():
        return FlashMLASparsePrefillImpl

    @classmethod
    def validate_configuration(cls, platform: Platform, config: SparseSelectorConfig) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        if not config.v4:
            return reasons + _sparse_reasons("sparse_prefill", config)
        reasons += _v4_heads_reasons(config)
        if config.kv_dtype != torch.bfloat16:
            reasons.append(f"kv rows of {dtype_name(config.kv_dtype)}: FlashMLA's sparse prefill reads bfloat16 rows")
        if config.extra_kv_format is not None:
            reasons.append("a second KV segment: FlashMLA's sparse prefill (flash_mla_sparse_fwd) takes one kv and "
                           "its indices; REFERENCE runs both segments")
        return reasons
