"""TRITON: the portable backend, one set of kernels for AMD and NVIDIA GPUs.

Prefill runs `mla_multi.kernels.prefill.varlen_attention` (qk 192 / v 128
natively, LSE); decode runs the split-KV kernel of
`mla_multi.kernels.mla_decode` with the number of splits from
`mla_multi.heuristics`, its scratch taken from a reserved `WorkspaceManager`
so that a captured CUDA graph never allocates.

Under ``TRITON_INTERPRET=1`` (Triton's debugging mode) both backends also run
on the CPU, through the interpreter, when forced (``backend="TRITON"`` or
``MLA_MULTI_*_BACKEND=TRITON``): the kernels can be stepped through without a
GPU. The interpreter computes bfloat16 ``tl.dot`` wrongly (Triton 3.9), so
there bfloat16 is a reason: float16 (and float32 for prefill) only.
"""

from __future__ import annotations

import functools
import weakref
from typing import ClassVar

import torch

from mla_multi.backends.base import (
    FP8_DTYPES,
    DecodeLaunch,
    dtype_name,
    forward_v4_in_parts,
    v4_entries_per_token,
    v4_tokens_per_call,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    MLASparseBackend,
    MLASparseImpl,
)
from mla_multi.kernels import capturing, interpreter_active, keep_unless_capturing
from mla_multi.platforms import Platform, current_platform
from mla_multi.workspace import still_shared


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as error:  # any failure of an optional library is a reason
        return f"triton is not importable: {type(error).__name__}: {error}"
    return None


def _gpu_platform_reasons(platform: Platform) -> list[str]:
    if not platform.is_gpu():
        return [f"platform {platform.name} has no GPU; the Triton kernels need a CUDA or ROCm device"]
    if platform.is_cuda() and not platform.has_device_capability(8, 0):
        return [f"NVIDIA {platform.arch} is older than sm_80; the kernels use bf16 MMA of sm_80+"]
    return []


def _latent_dims_reasons(dims) -> list[str]:
    """The decode kernels' latent row: 512 latent and 64 rotary values (DeepSeek's and Kimi-K2's)."""
    if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (512, 64):
        return [f"kv_lora_rank {dims.kv_lora_rank} / qk_rope_head_dim {dims.qk_rope_head_dim}; supported: 512 / 64"]
    return []


def _sparse_fp8_reasons(platform: Platform, kv_dtype: torch.dtype) -> list[str]:
    """Why `platform` cannot read an FP8 or fp8_ds_mla sparse cache (the dequantising launch and the kernels'
    FP8 reads convert float8_e4m3fn in Triton, which NVIDIA GPUs before sm_89 lack)."""
    fp8 = kv_dtype == torch.uint8 or kv_dtype in FP8_DTYPES
    if fp8 and platform.is_cuda() and not platform.has_device_capability(8, 9):
        return [f"NVIDIA {platform.arch} has no float8_e4m3fn conversion in Triton (sm_89+): the FP8 and "
                "fp8_ds_mla sparse caches need it"]
    return []


def _v4_fp8_reasons(platform: Platform, config) -> list[str]:
    """Why `platform` cannot read the V4 byte formats of `config` (their e4m3 values and scales convert
    float8_e4m3fn in Triton, which NVIDIA GPUs before sm_89 lack)."""
    formats = [f for f in (config.kv_format, config.extra_kv_format) if f not in (None, "rows")]
    if formats and platform.is_cuda() and not platform.has_device_capability(8, 9):
        return [f"NVIDIA {platform.arch} has no float8_e4m3fn conversion in Triton (sm_89+): the "
                f"{' and '.join(dict.fromkeys(formats))} cache{'s need' if len(set(formats)) > 1 else ' needs'} it"]
    return []


def _interpreted(platform: Platform) -> bool:
    """The CPU with Triton's interpreter on: the kernels run there, interpreted."""
    return platform.is_cpu() and interpreter_active()


class _TritonRequirements:
    """What both Triton backends need: an importable Triton and a GPU of sm_80+ or ROCm
    (or the CPU under Triton's interpreter)."""

    vendors = frozenset({"cuda", "rocm"})
    supported_dtypes = (torch.float16, torch.bfloat16)
    # the dtypes whose results the interpreter gets right (its bfloat16 tl.dot is wrong)
    interpreter_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16,)

    @classmethod
    def availability_reasons(cls) -> list[str]:
        error = _triton_import_error()
        return [error] if error else []

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        if _interpreted(platform):
            return []
        return super().platform_reasons(platform) or _gpu_platform_reasons(platform)

    @classmethod
    def _common_reasons(cls, platform: Platform, dtype: torch.dtype) -> list[str]:
        if not _interpreted(platform):
            return super()._common_reasons(platform, dtype)
        reasons = list(cls.availability_reasons())
        if dtype not in cls.interpreter_dtypes:
            why = ", which computes bfloat16 tl.dot wrongly" if dtype == torch.bfloat16 else ""
            reasons.append(
                f"dtype {dtype_name(dtype)} is not supported under the Triton interpreter (TRITON_INTERPRET=1){why}; "
                f"supported there: {', '.join(dtype_name(d) for d in cls.interpreter_dtypes)}"
            )
        return reasons

    @classmethod
    def info(cls) -> dict:
        info = super().info()
        if interpreter_active():
            info["implementation"] = (
                "the Triton interpreter (TRITON_INTERPRET=1): runs on the CPU when forced, "
                f"{', '.join(dtype_name(d) for d in cls.interpreter_dtypes)}"
            )
        return info


class TritonPrefillImpl(MLAPrefillImpl):
    @functools.cached_property
    def takes_split_key(self) -> bool:
        """Whether the keys' shared rotary part may come apart (`forward_varlen(k_pe=)`): the kernel then reads
        one rotary key for every head instead of a copy per head (a fifth of a chunk's K and V, for MLA)."""
        from mla_multi.kernels.prefill import split_key_reason
        from mla_multi.kernels.prefill_inputs import split_head_dim_qk

        if _interpreted(current_platform()) or split_key_reason(current_platform()):
            return False
        rope = self.qk_rope_head_dim
        return split_head_dim_qk(self.qk_nope_head_dim + rope) == (self.qk_nope_head_dim, rope)

    # `forward_varlen(out=)` writes the output into a given [T, N, V] buffer
    takes_out = True

    @functools.cached_property
    def merges_chunks(self) -> bool:
        """Whether a context chunk's result merges into a given (out, lse) inside the kernel
        (`run_prefill_context_chunk(merge_into=)`): no [T, N, V] temporary a chunk, no merge launch."""
        from mla_multi.kernels.prefill import merge_reason

        return not _interpreted(current_platform()) and not merge_reason(current_platform())

    def serves_short_prefills(self, dtype: torch.dtype) -> bool:
        """Where sm_90's prefill kernel runs (a GPU launch of `dtype` at these head dims): it is the faster
        for short prefills, the rotary key taken apart (bench/RESULTS.md, "Prefill on sm_90: ...")."""
        from mla_multi.kernels.prefill_wgmma import wgmma_prefill_reason

        if self.device is None or torch.device(self.device).type != "cuda":
            return False
        return not wgmma_prefill_reason(current_platform(), dtype, self.qk_nope_head_dim + self.qk_rope_head_dim,
                                        self.v_head_dim)

    def forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, return_softmax_lse,
                       k_pe=None, out=None, lse=None, merge=False):
        from mla_multi.kernels.prefill import varlen_attention

        out, lse = varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, self.scale, causal=causal,
            return_lse=return_softmax_lse, k_pe=k_pe, out=out, lse=lse, merge=merge,
        )
        return (out, lse) if return_softmax_lse else out


class TritonPrefillBackend(_TritonRequirements, MLAPrefillBackend):
    name: ClassVar[str] = "TRITON"
    interpreter_dtypes = (torch.float16, torch.float32)

    @classmethod
    def validate_configuration(cls, platform, config) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        if config.dims.qk_head_dim > 256 or config.dims.v_head_dim > 256:
            reasons.append(
                f"head dims qk {config.dims.qk_head_dim} / v {config.dims.v_head_dim}; supported: up to 256"
            )
        return reasons

    @staticmethod
    def get_prefill_impl_cls():
        return TritonPrefillImpl


class TritonDecodeImpl(MLADecodeImpl):
    chooses_num_kv_splits = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.platform = current_platform()
        self.max_num_kv_splits: int | None = None
        self.max_model_len: int | None = None
        self.max_partial_rows: int | None = None

    def _workspace_specs(self, num_rows: int, num_splits: int, out_shape, out_dtype):
        from mla_multi.kernels.mla_decode import attn_logits_width

        lse_shape = tuple(out_shape[:-1])
        return (
            ((num_rows, self.num_heads, num_splits, attn_logits_width(self.kv_lora_rank)), torch.float32),
            (tuple(out_shape), out_dtype),
            (lse_shape, torch.float32),
        )

    def reserve_workspace(self, workspace_manager, max_num_seqs: int, max_model_len: int, max_query_len: int = 1,
                          dtype: torch.dtype | None = None) -> None:
        """Reserve what any batch of at most `max_num_seqs` requests of `max_query_len` tokens can ask:
        the split-KV partials (`heuristics.max_partial_rows` rows), the latent output (in `dtype`, default
        float32) and the LSE."""
        from mla_multi import errors
        from mla_multi.heuristics import max_num_kv_splits, max_partial_rows

        # the kernels' error flag must exist before a graph captures its address (a memory plan reserves
        # on the meta device: nothing runs there)
        if workspace_manager.device.type != "meta":
            errors.error_flag(workspace_manager.device)
        self.max_model_len = max_model_len
        self.max_num_kv_splits = max_num_kv_splits(max_model_len, self.platform)
        rows = max_partial_rows(
            self.platform, self.num_heads, max_num_seqs, max_model_len, q_len=max_query_len,
            kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim, kv_cache_dtype=self.kv_cache_dtype,
        )
        self.max_partial_rows = rows if self.max_partial_rows is None else max(rows, self.max_partial_rows)
        out_shape = (max_num_seqs, max_query_len, self.num_heads, self.kv_lora_rank)
        workspace_manager.reserve(
            *self._workspace_specs(self.max_partial_rows, 1, out_shape, dtype or torch.float32),
            purpose=f"decode (TRITON, {self.num_heads} heads): split-KV partials, latent output, LSE",
            what=(f"{self.max_partial_rows} partial rows (heuristics.max_partial_rows: {max_num_seqs} requests x "
                  f"{max_query_len} tokens, sequences up to {max_model_len}) x {self.num_heads} heads; "
                  f"output [{max_num_seqs}, {max_query_len}, {self.num_heads}, {self.kv_lora_rank}]"),
        )

    def choose_num_kv_splits(self, batch: int, q_len: int, bound: int | None, kv_cache_dtype, num_kv_splits=None,
                             max_blocks: int | None = None, min_tokens_per_split: int | None = None) -> int:
        """The split count of a batch: forced (`num_kv_splits`) or the heuristic's, within the reservation.

        `bound` is a host-side bound of the batch's sequence lengths (None: the
        reservation's max_model_len, else `max_blocks * block_size`); `min_tokens_per_split`: the heuristic's
        (default `heuristics.MIN_TOKENS_PER_SPLIT`)."""
        from mla_multi.heuristics import MIN_TOKENS_PER_SPLIT
        from mla_multi.heuristics import max_num_kv_splits as reserve_splits
        from mla_multi.heuristics import num_kv_splits as choose_splits

        min_tokens = min_tokens_per_split or MIN_TOKENS_PER_SPLIT

        limit = self.max_num_kv_splits
        if bound is None:
            bound = self.max_model_len or (max_blocks or 1) * self.block_size
        if limit is None:
            # Not reserved ahead: size by the longest sequence this call can see.
            limit = reserve_splits(max(1, bound), self.platform, min_tokens_per_split=min_tokens)
        rows = self.max_partial_rows
        if rows is not None:
            limit = max(1, min(limit, rows // max(1, batch * q_len)))
        if num_kv_splits is None:
            num_kv_splits = choose_splits(
                self.platform, max(1, batch), self.num_heads, bound, limit, q_len=q_len,
                kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim, kv_cache_dtype=kv_cache_dtype,
                max_partial_rows=rows, min_tokens_per_split=min_tokens,
            )
        return max(1, min(int(num_kv_splits), limit))

    def bind(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, num_kv_splits=None,
             max_seq_len: int | None = None, masked_entries: bool = False,
             min_tokens_per_split: int | None = None, v4=None, zero_rope: bool = False,
             sink: bool = False) -> TritonDecodeLaunch:
        """See `MLADecodeImpl.bind`: the split count (`choose_num_kv_splits`) and, on a GPU, the kernels bound
        at the first launch. `masked_entries`: `mla_decode_fwd`'s (the sparse decode's index lists read as the
        block table); `min_tokens_per_split`: `choose_num_kv_splits`'s, which bounds a given `num_kv_splits`
        too; `v4`: `mla_decode.V4Pages` (DeepSeek-V4 caches read in place, the second one passed to each call
        as `extra_cache`); `zero_rope`: q_pe is zero (`mla_decode_fwd`'s); `sink`: each call passes an
        `attn_sink` (`mla_decode_fwd`'s), applied by the kernels."""
        batch = q_nope.shape[0]
        q_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
        num_kv_splits = self.choose_num_kv_splits(
            batch, q_len, max_seq_len, kv_cache.dtype, num_kv_splits, max_blocks=block_table.shape[1],
            min_tokens_per_split=min_tokens_per_split,
        )
        return TritonDecodeLaunch(self, q_nope, num_kv_splits, masked_entries, v4, zero_rope, sink)

    def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, num_kv_splits=None,
                    workspace_manager=None, max_seq_len: int | None = None, step_plans: dict | None = None,
                    masked_entries: bool = False, min_tokens_per_split: int | None = None):
        """See `MLADecodeImpl.forward_mqa`: `bind`, then launch. `step_plans` (a step's
        `metadata.backend_plans`, owned by the caller) keeps the step's launches, so that every later layer
        only launches; without it every call binds anew."""
        from mla_multi.kernels.launch import layout_key

        if k_scale is not None and not torch.is_tensor(k_scale):
            k_scale = torch.tensor([float(k_scale)], dtype=torch.float32, device=q_nope.device)
        launch = key = None
        if step_plans is not None:
            key = ("TRITON decode launch", self.num_heads, layout_key(q_nope), layout_key(q_pe), layout_key(kv_cache),
                   id(block_table), id(seq_lens), None if k_scale is None else layout_key(k_scale), num_kv_splits,
                   max_seq_len, min_tokens_per_split, id(workspace_manager), capturing(q_nope), masked_entries)
            launch = step_plans.get(key)
        if launch is None:
            launch = self.bind(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale=k_scale,
                               num_kv_splits=num_kv_splits, max_seq_len=max_seq_len, masked_entries=masked_entries,
                               min_tokens_per_split=min_tokens_per_split)
            if key is not None:
                step_plans[key] = launch
        return launch(q_nope, q_pe, kv_cache, block_table, seq_lens, self.scale, k_scale=k_scale,
                      workspace_manager=workspace_manager)


class TritonDecodeLaunch(DecodeLaunch):
    """TRITON's decode bound to one layout (`TritonDecodeImpl.bind`): the split count, the output's specs and,
    on a GPU, the bound kernels (`DecodeKernelPlan`), one per capture state and scratch source, made at their
    first launch. Partials come from the given `workspace_manager` (views kept while its buffer stays), the
    caller (`attn_logits`) or the device's shared workspace (`shared_split_partials`)."""

    def __init__(self, impl: TritonDecodeImpl, q_nope: torch.Tensor, num_kv_splits: int, masked_entries: bool,
                 v4=None, zero_rope: bool = False, sink: bool = False) -> None:
        super().__init__(impl, num_kv_splits)
        self.v4 = v4
        self.zero_rope = zero_rope
        self.sink = sink
        batch = q_nope.shape[0]
        q_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
        self.device = q_nope.device
        self.masked_entries = masked_entries
        self.out_spec = (tuple(q_nope.shape), q_nope.dtype)
        self.lse_spec = (tuple(q_nope.shape[:-1]), torch.float32)
        self.partial_dims = (batch * q_len, impl.num_heads, num_kv_splits, impl.kv_lora_rank)
        # bound kernels on a GPU; under the interpreter every launch goes through Triton
        self.bound = q_nope.device.type == "cuda" and not interpreter_active()
        self._kernels: dict = {}  # (capturing, from a workspace) -> DecodeKernelPlan
        self._views = None  # (the workspace's buffer, its (partials, out, lse) views)
        # weak references to the shared workspace, its buffer and the partials viewing it, and its device, of eager
        # calls without a workspace_manager or attn_logits: the view is used again while `workspace.still_shared`
        # holds (`shared_split_partials`); weak, so that a buffer the workspace let go of is not kept alive here
        self._shared = None

    def new_partials(self) -> torch.Tensor:
        from mla_multi.kernels.mla_decode import split_partials

        return split_partials(*self.partial_dims, self.device)

    def __call__(self, q_nope, q_pe, kv_cache, block_table, seq_lens, scale: float, *, k_scale=None, out=None,
                 lse=None, attn_logits=None, workspace_manager=None, extra_cache=None, attn_sink=None, lists=None):
        from mla_multi.kernels.mla_decode import DecodeKernelPlan, mla_decode_fwd

        impl = self.impl
        capture = capturing(q_nope)
        if workspace_manager is not None:
            views = self._views
            if views is None or views[0] is not workspace_manager._buffer:
                specs = impl._workspace_specs(self.partial_dims[0], self.num_kv_splits, *self.out_spec)
                found = workspace_manager.get_simultaneous(*specs)
                views = self._views = (workspace_manager._buffer, found)
            partials, step_out, step_lse = views[1]
            attn_logits = partials if attn_logits is None else attn_logits
            out = step_out if out is None else out
            lse = step_lse if lse is None else lse
        else:
            if out is None:
                out = torch.empty(self.out_spec[0], dtype=self.out_spec[1], device=q_nope.device)
            if lse is None:
                lse = torch.empty(self.lse_spec[0], dtype=torch.float32, device=q_nope.device)
            if attn_logits is None:
                attn_logits = self._shared_partials(q_nope.device, capture)
        if not self.bound:
            return mla_decode_fwd(
                q_nope, q_pe, kv_cache, block_table, seq_lens, scale, k_scale=k_scale,
                num_kv_splits=self.num_kv_splits, attn_logits=attn_logits, out=out, lse=lse, platform=impl.platform,
                masked_entries=self.masked_entries, v4=self.v4, extra_cache=extra_cache, zero_rope=self.zero_rope,
                attn_sink=attn_sink if self.sink else None, lists=lists,
            )
        state = (capture, workspace_manager is not None)
        kernels = self._kernels.get(state)
        if kernels is None:
            kernels = self._kernels[state] = DecodeKernelPlan(
                q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, self.num_kv_splits, attn_logits, out, lse,
                platform=impl.platform, masked_entries=self.masked_entries, v4=self.v4, zero_rope=self.zero_rope,
                sink=self.sink,
            )
        kernels.launch(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, attn_logits, out, lse, scale,
                       extra_cache=extra_cache, attn_sink=attn_sink, lists=lists)
        return out, lse

    def _shared_partials(self, device, capture: bool) -> torch.Tensor:
        """The split partials of a call without a workspace_manager or attn_logits: the view of the device's
        shared workspace kept from an earlier eager call while the workspace keeps its buffer (no lookup a
        call), else `shared_split_partials`'s (kept, `keep_unless_capturing`, where they are the workspace's)."""
        kept = self._shared
        if kept is not None and not capture:
            manager, buffer, key, view = kept
            partials = view()
            if partials is not None and still_shared(manager(), buffer(), key):
                return partials
        from mla_multi.kernels.mla_decode import shared_split_partials

        partials, owner = shared_split_partials(*self.partial_dims, device)
        if owner is not None:
            manager, buffer, key = owner
            keep_unless_capturing(self, "_shared", (weakref.ref(manager), weakref.ref(buffer), key,
                                                    weakref.ref(partials)), capture)
        return partials


class TritonDecodeBackend(_TritonRequirements, MLADecodeBackend):
    name: ClassVar[str] = "TRITON"
    supported_kv_cache_dtypes = (torch.float16, torch.bfloat16) + FP8_DTYPES
    supported_block_sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    max_num_heads = 128
    max_query_len = 8
    supports_cuda_graphs = True

    @classmethod
    def validate_configuration(cls, platform, config) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        reasons += _latent_dims_reasons(config.dims)
        return reasons

    @staticmethod
    def get_decode_impl_cls():
        return TritonDecodeImpl


# the sparse decode's splits go down to one 64-token tile: the lists need no page table's indirection, and a
# short batch fills the device only so (bench/RESULTS.md: 1 token of 128 heads, 32 splits 16.9 µs, 16 19.6 µs)
_SPARSE_MIN_TOKENS_PER_SPLIT = 64


class _SparseThroughDense(MLASparseImpl):
    """Sparse MLA on the dense split-KV decode kernels: every query token a request whose block-table row is
    its compacted index list over a cache of one-token pages. The dense impls and their launches are bound
    at the first call and kept: the impl belongs to one layout (the sparse op's plan), so a later call only
    compacts and launches; a call of another layout binds again."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._dense: dict = {}  # the pages' dtype -> the dense decode impl reading them
        self._launches: dict = {}  # which way (in place, masked, dequantised...) -> (its layout key, the launch)
        from mla_multi.kernels.sparse_indices import Scratch

        self._scratch = Scratch()  # the compacted table and lengths, reused by eager calls

    def _decode_pages(self, way: str, q_nope, q_pe, pages, table, lens, scale: float, k_scale=None, attn_sink=None):
        """Decode one-token `pages` [slots, 1, W] through `table` [T, n] and `lens` [T] with the dense kernels.
        way: "masked" (fp8_ds_mla pages read in place, `table` the index lists as they are: -1 masked by the
        kernels), "in place" (fp8_ds_mla pages read in place, a compacted table) or "pages" (16-bit or FP8
        pages, a compacted table). Read in place, a list splits down to one 64-token tile. `attn_sink`: the
        sink applied by the kernels (`mla_decode_fwd`'s)."""
        in_place = way != "pages"
        attn_sink = _sink_rows(attn_sink)
        launch = self._dense_launch(way, q_nope, q_pe, pages, table, lens, k_scale, masked_entries=way == "masked",
                                    min_tokens_per_split=_SPARSE_MIN_TOKENS_PER_SPLIT if in_place else None,
                                    sink=attn_sink)
        return launch(q_nope, q_pe, pages, table, lens, scale, k_scale=k_scale, attn_sink=attn_sink)

    def _dense_launch(self, way: str, q_nope, q_pe, pages, table, lens, k_scale, *, masked_entries=False,
                      min_tokens_per_split=None, v4=None, zero_rope=False, sink=None):
        """The dense decode launch of `way` for these tensors: the one bound before where their layout is the
        same, else a new one. V4 pages (`v4`) split to fill one wave (`heuristics.gathered_tile_splits`: a
        gathered tile costs the memory's latency), decided when bound. `sink`: the attention sink each call
        passes (its layout is part of the key), or None."""
        from mla_multi.kernels.launch import layout_key

        key = (layout_key(q_nope), layout_key(q_pe), layout_key(pages), pages.data_ptr() % 4, layout_key(table),
               layout_key(lens), None if k_scale is None else layout_key(k_scale), capturing(q_nope), v4, zero_rope,
               None if sink is None else layout_key(sink))
        found = self._launches.get(way)
        if found is not None and found[0] == key:
            return found[1]
        impl = self._dense.get(pages.dtype)
        if impl is None:
            impl = self._dense[pages.dtype] = TritonDecodeImpl(
                self.num_heads, 1.0, q_nope.shape[-1], q_pe.shape[-1], pages.dtype, 1, q_nope.device
            )
        num_kv_splits = width = None
        if v4 is not None:
            from mla_multi.heuristics import gathered_tile_splits

            width = v4.lists[0] + v4.lists[1]  # the entries a token's row holds: both index lists'
            num_kv_splits = gathered_tile_splits(current_platform(), q_nope.shape[0], self.num_heads, width)
        launch = impl.bind(q_nope, q_pe, pages, table, lens, k_scale=k_scale, masked_entries=masked_entries,
                           min_tokens_per_split=min_tokens_per_split, v4=v4, num_kv_splits=num_kv_splits,
                           zero_rope=zero_rope, sink=sink is not None, max_seq_len=width)
        self._launches[way] = (key, launch)
        return launch

    def _through_dense(self, q_nope, q_pe, kv, indices, scale, k_scale, topk_length, attn_sink, *,
                       out_of_range_is_none: bool = False):
        """Compact the indices into one-token pages and decode them with the dense kernels (an fp8_ds_mla
        cache's named rows dequantised first; read in place, see `_SparseInPlaceLaunch`)."""
        from mla_multi.kernels.sparse_indices import compact_indices, dequantize_named_rows

        num_slots = kv.shape[0] * kv.shape[1]
        pages = kv.reshape(num_slots, 1, kv.shape[-1])
        tokens, topk = indices.shape
        out = (self._scratch.get("table", (tokens, max(topk, 1)), torch.int32, indices.device),
               self._scratch.get("lens", (tokens,), torch.int32, indices.device))
        table, lens = compact_indices(indices, num_slots, topk_length, out_of_range_is_none=out_of_range_is_none,
                                      out=out)
        if kv.dtype == torch.uint8:  # fp8_ds_mla not read in place: rows dequantised first
            pages, table = dequantize_named_rows(table, lens, kv, q_nope.dtype)
        return self._decode_pages("pages", q_nope, q_pe, pages, table, lens, scale, k_scale, attn_sink=attn_sink)

    def _v4_pages(self, q, pages, table, lens, scale: float, attn_sink, out=None):
        """The V4 attention of q [T, N, 512] over one-token `pages` [P, 1, 576] (zero tails) through `table` /
        `lens` on the dense kernels: the query's rotary part is zero (a stride-0 view of 64 zeros kept by the
        scratch), so the scores and values are the 512-wide rows'; the zero rotary product is skipped where the
        kernels can (sm_90's warp-specialised ones). The sink is applied by the kernels (the reduce, or the
        kernel writing the output). The caches read in place: `_V4InPlaceLaunch`."""
        q_pe = _zero_rope(self._scratch, q)
        attn_sink = _sink_rows(attn_sink)
        launch = self._dense_launch("v4", q, q_pe, pages, table, lens, None, zero_rope=True, sink=attn_sink)
        return launch(q, q_pe, pages, table, lens, scale, attn_sink=attn_sink, out=out)

    def _v4_scratch(self, q, tokens: int, width: int, rows: int):
        """The compacted table [T, width], the lengths [T] and the 576-wide rows [rows, 576] in q's dtype."""
        from mla_multi.kernels.sparse_v4 import PAGE_WIDTH

        device = q.device
        return (self._scratch.get("v4 table", (tokens, width), torch.int32, device),
                self._scratch.get("v4 lens", (tokens,), torch.int32, device),
                self._scratch.get("v4 rows", (max(rows, 1), PAGE_WIDTH), q.dtype, device))


def _sink_rows(attn_sink):
    """The sink [heads] as the kernels read it (one float32 a head, consecutive), or None."""
    return attn_sink if attn_sink is None or attn_sink.stride(0) == 1 else attn_sink.contiguous()


def _zero_rope(scratch, q):
    """V4's zero rotary query part [T, N, 64]: a stride-0 view of 64 zeros that `scratch` keeps (made during a
    capture, the capture's own)."""
    from mla_multi.kernels.sparse_v4 import ROPE_DIM

    zeros = scratch.constant("v4 zero rope", (ROPE_DIM,), 0, q.dtype, q.device)
    return zeros.expand(q.shape[0], q.shape[1], ROPE_DIM)


def _v4_empty(q):
    """The result of zero query tokens: out [0, N, 512] and lse [0, N]."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(q.shape[:-1], dtype=torch.float32,
                                                                             device=q.device)


class _SparseInPlaceLaunch:
    """TRITON's sparse decode of one layout over an fp8_ds_mla cache read in place (`TritonSparseDecodeImpl.bind`):
    the way (the index lists as they are, or compacted by one launch), the compaction's and the dense kernels'
    launches and the one-token pages' shape are decided once; a call launches and does nothing else."""

    def __init__(self, impl: "TritonSparseDecodeImpl", q_nope, q_pe, kv, indices, topk_length, attn_sink) -> None:
        from mla_multi.kernels.sparse_indices import IndexCompaction

        self.impl = impl
        self.tokens, self.topk = indices.shape
        num_slots = kv.shape[0] * kv.shape[1]
        self.pages_shape = (num_slots, 1, kv.shape[-1])
        self.masked = topk_length is None and indices.stride(-1) == 1 and impl._lists_as_they_are(q_nope)
        self.sink_copy = attn_sink is not None and attn_sink.stride(0) != 1
        self.compaction = None
        self.full_lengths = None
        table, lens = self._lists(indices)
        if not self.masked and self.tokens:  # zero tokens: nothing to compact (the dense launch launches nothing)
            self.compaction = IndexCompaction(indices, num_slots, topk_length, table)
        self.dense = impl._dense_launch(
            "masked" if self.masked else "in place", q_nope, q_pe, kv.reshape(self.pages_shape), table, lens, None,
            masked_entries=self.masked, min_tokens_per_split=_SPARSE_MIN_TOKENS_PER_SPLIT, sink=_sink_rows(attn_sink))

    def _lists(self, indices):
        """(table, lens) of this call: the lists themselves and their full lengths, or the compaction's scratch."""
        scratch, device = self.impl._scratch, indices.device
        if self.masked:
            lens = self.full_lengths
            if lens is None:  # made once (`Scratch.constant`)
                lens = keep_unless_capturing(self, "full_lengths", scratch.constant(
                    "full lengths", (self.tokens,), self.topk, torch.int32, device), capturing(indices))
            return indices, lens
        return (scratch.get("table", (self.tokens, max(self.topk, 1)), torch.int32, device),
                scratch.get("lens", (self.tokens,), torch.int32, device))

    def __call__(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        table, lens = self._lists(indices)
        if self.compaction is not None:
            self.compaction(indices, topk_length, table, lens)
        if self.sink_copy:
            attn_sink = attn_sink.contiguous()
        return self.dense(q_nope, q_pe, kv.reshape(self.pages_shape), table, lens, scale, k_scale=k_scale,
                          attn_sink=attn_sink)


class _V4InPlaceLaunch:
    """TRITON's V4 sparse decode of one layout over fp8_ds_mla_v4 caches read in place
    (`TritonSparseDecodeImpl.bind_v4`): the slots of both caches and the dense kernels' launch decided once; a
    call launches the dense kernels, which read both index lists and their lengths as they are (`V4Pages`: no
    compaction launch; lists of consecutive entries, as the ops pass them), and nothing else."""

    def __init__(self, impl: "TritonSparseDecodeImpl", q, kv, indices, topk_length, attn_sink, extra_kv, extra_indices,
                 extra_topk_length) -> None:
        from mla_multi.kernels.mla_decode import V4Pages

        self.impl = impl
        tokens = q.shape[0]
        topk, extra_topk = indices.shape[1], 0 if extra_indices is None else extra_indices.shape[1]
        self.width = topk + extra_topk  # every token's sequence length (0: empty lists, nothing read)
        self.lens_shape = (tokens,)
        num_slots = kv.shape[0] * kv.shape[1]
        extra_slots = 0 if extra_kv is None else extra_kv.shape[0] * extra_kv.shape[1]
        self.sink_copy = attn_sink is not None and attn_sink.stride(0) != 1
        self.constants = None
        v4 = V4Pages(kv.shape[1], num_slots, num_slots + extra_slots,
                     kv.stride(0) if extra_kv is None else extra_kv.stride(0),
                     (topk, extra_topk, 0 if extra_indices is None else extra_indices.stride(0)))
        q_pe, lens = self._constants(q)
        self.dense = impl._dense_launch("v4 in place", q, q_pe, kv, indices, lens, None, v4=v4,
                                        min_tokens_per_split=_SPARSE_MIN_TOKENS_PER_SPLIT, sink=_sink_rows(attn_sink))

    def _constants(self, q):
        """(the query's zero rotary part, `_zero_rope`; both lists' width for every token, the kernels' sequence
        lengths): made once and kept unless made inside a CUDA-graph capture (`keep_unless_capturing`)."""
        kept = self.constants
        if kept is None:
            scratch = self.impl._scratch
            kept = keep_unless_capturing(self, "constants", (
                _zero_rope(scratch, q),
                scratch.constant(f"v4 full lengths {self.width}", self.lens_shape, self.width, torch.int32, q.device),
            ), capturing(q))
        return kept

    def __call__(self, q, kv, indices, scale, *, topk_length=None, attn_sink=None, extra_kv=None, extra_indices=None,
                 extra_topk_length=None, out=None):
        if self.sink_copy:
            attn_sink = attn_sink.contiguous()
        q_pe, lens = self._constants(q)
        return self.dense(q, q_pe, kv, indices, lens, scale, extra_cache=extra_kv, attn_sink=attn_sink,
                          lists=(extra_indices, topk_length, extra_topk_length), out=out)


class TritonSparseDecodeImpl(_SparseThroughDense):
    """Each token's valid indices are compacted (one launch) into the block-table row of a cache of one-token
    pages, which the dense split-KV decode kernels then read (their split heuristic, their sm_90 warpgroup
    kernels): 16-bit and per-tensor FP8 caches as they are; an fp8_ds_mla cache in place on sm_90 (the
    warp-specialised kernels' loader dequantises each named row as it loads it; without topk_length the
    kernels read the index lists themselves, -1 masked, and nothing is compacted), elsewhere its named rows
    first dequantised (one launch) into a scratch of T * topk rows in the query's dtype."""

    # V4 caches read in place where `_v4_in_place_reason` allows (False: always gathered first; for comparison)
    read_v4_in_place: bool = True
    v4_takes_out = True

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        launch = self.bind(q_nope, q_pe, kv, indices, k_scale=k_scale, topk_length=topk_length, attn_sink=attn_sink)
        return launch(q_nope, q_pe, kv, indices, scale, k_scale=k_scale, topk_length=topk_length, attn_sink=attn_sink)

    def bind(self, q_nope, q_pe, kv, indices, *, k_scale=None, topk_length=None, attn_sink=None):
        """See `MLASparseImpl.bind`: an fp8_ds_mla cache read in place (sm_90) is bound here
        (`_SparseInPlaceLaunch`); every other cache goes through compacted pages (`_through_pages`)."""
        if kv.dtype != torch.uint8 or self._in_place_reason(kv, q_nope.dtype):
            return self._through_pages
        return _SparseInPlaceLaunch(self, q_nope, q_pe, kv, indices, topk_length, attn_sink)

    def _through_pages(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        return self._through_dense(q_nope, q_pe, kv, indices, scale, k_scale, topk_length, attn_sink)

    def bind_v4(self, q, kv, indices, *, kv_format, topk_length=None, attn_sink=None, extra_kv=None,
                extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        """See `MLASparseImpl.bind_v4`: fp8_ds_mla_v4 caches read in place (`_v4_in_place_reason`) are bound here
        (`_V4InPlaceLaunch`); every other way is `forward_v4`."""
        if q.shape[0] == 0 or self._v4_in_place_reason(q, kv, kv_format, extra_kv, extra_kv_format):
            return super().bind_v4(q, kv, indices, kv_format=kv_format, extra_kv_format=extra_kv_format)
        return _V4InPlaceLaunch(self, q, kv, indices, topk_length, attn_sink, extra_kv, extra_indices,
                                extra_topk_length)

    def forward_v4(self, q, kv, indices, scale, *, kv_format, topk_length=None, attn_sink=None, extra_kv=None,
                   extra_indices=None, extra_topk_length=None, extra_kv_format=None, out=None):
        """The V4 contract (`MLASparseImpl.forward_v4`; `out`: `v4_takes_out`). fp8_ds_mla_v4 caches on sm_90
        (`_v4_in_place_reason`): the warp-specialised kernel's V4 loader reads both index lists as they are and
        the rows they name in place (`_V4InPlaceLaunch`, which `bind_v4` keeps for a layout; no launch but the
        dense kernels').
        Elsewhere every token's named rows of both segments dequantised (one launch, `sparse_v4.gather_rows`)
        into its stretch of 576-wide rows in q's dtype, then the dense kernels over them as one-token pages."""
        from mla_multi.kernels.sparse_v4 import PAGE_WIDTH, gather_rows

        tokens = q.shape[0]
        if tokens == 0:
            return _v4_empty(q)
        if not self._v4_in_place_reason(q, kv, kv_format, extra_kv, extra_kv_format):
            launch = _V4InPlaceLaunch(self, q, kv, indices, topk_length, attn_sink, extra_kv, extra_indices,
                                      extra_topk_length)
            return launch(q, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink, extra_kv=extra_kv,
                          extra_indices=extra_indices, extra_topk_length=extra_topk_length, out=out)
        per_call = v4_tokens_per_call(indices, extra_indices)
        if tokens > per_call:  # the gathered rows of at most `base.V4_ROWS_AT_ONCE` entries at a time
            return forward_v4_in_parts(self.forward_v4, q, kv, indices, scale, per_call, out=out, takes_out=True,
                                       topk_length=topk_length, extra_indices=extra_indices,
                                       extra_topk_length=extra_topk_length, kv_format=kv_format,
                                       attn_sink=attn_sink, extra_kv=extra_kv, extra_kv_format=extra_kv_format)
        width = v4_entries_per_token(indices, extra_indices)
        table, lens, rows = self._v4_scratch(q, tokens, width, tokens * width)
        gather_rows(indices, topk_length, kv, kv_format, extra_indices, extra_topk_length, extra_kv,
                    extra_kv_format, rows=rows, table=table, lens=lens)
        return self._v4_pages(q, rows.view(-1, 1, PAGE_WIDTH), table, lens, scale, attn_sink, out=out)

    def _v4_in_place_reason(self, q, kv, kv_format, extra_kv, extra_kv_format) -> str:
        """Why the V4 caches cannot be read in place ("" where they can): fp8_ds_mla_v4 caches (both, the
        second of the main cache's page size, rows on 16 bytes) on a device whose decode kernels read fp8_ds_mla
        in place (`_in_place_reason`: sm_90, a bfloat16 query), slots that int32 holds."""
        if not self.read_v4_in_place:
            return "read_v4_in_place is off (the rows are gathered first)"
        if kv_format != "fp8_ds_mla_v4" or (extra_kv is not None and extra_kv_format not in (None, "fp8_ds_mla_v4")):
            return f"caches of formats {kv_format} / {extra_kv_format} (in place: fp8_ds_mla_v4)"
        if extra_kv is not None and extra_kv.shape[1] != kv.shape[1]:
            return f"a second cache of {extra_kv.shape[1]}-token pages beside {kv.shape[1]}-token ones"
        for cache in (kv,) if extra_kv is None else (kv, extra_kv):
            reason = self._in_place_reason(cache, q.dtype)
            if reason:
                return reason
            if cache.data_ptr() % 16 or cache.stride(0) % 16:
                return (f"a V4 cache whose rows do not start on 16 bytes (data_ptr {cache.data_ptr()}, block stride "
                        f"{cache.stride(0)})")
        slots = kv.shape[0] * kv.shape[1] + (0 if extra_kv is None else extra_kv.shape[0] * extra_kv.shape[1])
        if slots >= 2**31:
            return f"{slots} slots do not fit int32"
        return ""

    def _lists_as_they_are(self, q_nope) -> bool:
        """Whether the in-place kernels read the index lists themselves (-1 masked in the kernel) rather than a
        compacted copy: while the batch's 64-head blocks fill at most half the device's compute units, where
        the compaction launch is a fixed cost worth saving; past that the masking inside every tile costs as
        much or more (bench/RESULTS.md, H200: 1 / 32 / 64 tokens of 128 heads -29 / -2 / +0.5 %, 64 tokens
        of 64 heads -4 %)."""
        blocks = q_nope.shape[0] * -(-self.num_heads // 64)
        return blocks <= current_platform().num_compute_units // 2

    @functools.cached_property
    def _platform_reason(self) -> str:
        """Why this device's decode kernels cannot read fp8_ds_mla rows in place ("" where they can)."""
        from mla_multi.kernels.mla_decode import ds_mla_decode_reason

        if self.device is None or torch.device(self.device).type != "cuda" or interpreter_active():
            return "not a GPU launch"
        return ds_mla_decode_reason(current_platform())

    def _in_place_reason(self, kv, query_dtype) -> str:
        """`_platform_reason`, a bfloat16 query (the rotary values' type) and rows on 4-byte boundaries."""
        from mla_multi.kernels.mla_decode import ds_mla_decode_reason

        if self._platform_reason or kv.device.type != "cuda":
            return self._platform_reason or "not a GPU launch"
        if query_dtype != torch.bfloat16:
            return f"a {query_dtype} query (the in-place loader writes bfloat16 stages)"
        if kv.data_ptr() % 4 or kv.stride(0) % 4 or kv.stride(1) % 4:
            return ds_mla_decode_reason(current_platform(), kv)
        return ""


class TritonSparseDecodeBackend(_TritonRequirements, MLASparseBackend):
    """Sparse decode through the dense decode kernels (`TritonSparseDecodeImpl`): 16-bit, per-tensor FP8 and
    fp8_ds_mla caches, and the V4 contract over every V4 format (`forward_v4`; the FP8 ones on AMD and NVIDIA
    sm_89+). Ranked before REFERENCE (measured: 28-950 µs where REFERENCE takes 2.9-8.9 ms) and after
    FLASHMLA / ROCM_AITER where those serve."""

    name: ClassVar[str] = "TRITON"
    supported_kv_dtypes = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.uint8)
    supported_v4_formats = ("fp8_ds_mla_v4", "fp8_ds_mla_v41", "fp4_ds_mla_v41", "rows")
    max_num_heads = 128
    max_query_len = 1 << 16

    @classmethod
    def validate_configuration(cls, platform, config) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        if config.v4:
            if not _interpreted(platform):
                reasons += _v4_fp8_reasons(platform, config)
            return reasons
        reasons += _latent_dims_reasons(config.dims)
        if platform.is_cuda() and config.kv_dtype == torch.float8_e4m3fnuz:
            reasons.append("a float8_e4m3fnuz cache on NVIDIA: its FP8 flavour is float8_e4m3fn")
        if not _interpreted(platform):
            reasons += _sparse_fp8_reasons(platform, config.kv_dtype)
        return reasons

    @staticmethod
    def get_impl_cls():
        return TritonSparseDecodeImpl


class TritonSparsePrefillImpl(_SparseThroughDense):
    """Every query token a decode request over the kv rows as one-token pages: the compacted indices (an index
    outside [0, S_kv) is no token) feed the dense decode kernels."""

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        return self._through_dense(q_nope, q_pe, kv.unsqueeze(1), indices, scale, None, topk_length, attn_sink,
                                   out_of_range_is_none=True)

    def forward_v4(self, q, kv, indices, scale, *, kv_format="rows", topk_length=None, attn_sink=None,
                   extra_kv=None, extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        """The V4 contract over float rows: kv (and extra_kv after it) copied once into zero-tailed 576-wide rows
        in q's dtype (`sparse_v4.pad_rows`), each token's entries that count compacted into its table row
        (`sparse_v4.compact_lists`), then the dense kernels over the rows as one-token pages: no row is copied
        per query token."""
        from mla_multi.kernels.sparse_v4 import PAGE_WIDTH, compact_lists, pad_rows

        tokens = q.shape[0]
        if tokens == 0:
            return _v4_empty(q)
        count = kv.shape[0]
        extra_count = 0 if extra_kv is None else extra_kv.shape[0]
        width = v4_entries_per_token(indices, extra_indices)
        table, lens, rows = self._v4_scratch(q, tokens, width, count + extra_count)
        pad_rows(kv, extra_kv, rows)
        compact_lists(indices, topk_length, count, extra_indices, extra_topk_length, extra_count, table=table,
                      lens=lens)
        return self._v4_pages(q, rows.view(-1, 1, PAGE_WIDTH), table, lens, scale, attn_sink)


class TritonSparsePrefillBackend(_TritonRequirements, MLASparseBackend):
    """Sparse prefill over kv rows [S_kv, 576] (16-bit) through the dense decode kernels, and the V4 contract
    over float rows [S, 512] (`forward_v4`)."""

    name: ClassVar[str] = "TRITON"
    supported_kv_dtypes = (torch.float16, torch.bfloat16)
    supported_v4_formats = ("rows",)
    max_num_heads = 128

    @classmethod
    def validate_configuration(cls, platform, config) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        if not config.v4:
            reasons += _latent_dims_reasons(config.dims)
        return reasons

    @staticmethod
    def get_impl_cls():
        return TritonSparsePrefillImpl
