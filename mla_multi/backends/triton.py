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
from typing import ClassVar

import torch

from mla_multi.backends.base import (
    FP8_DTYPES,
    dtype_name,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    MLASparseBackend,
    MLASparseImpl,
)
from mla_multi.kernels import interpreter_active
from mla_multi.platforms import Platform, current_platform


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
        from mla_multi.kernels.prefill import _split_head_dim_qk, split_key_reason

        if _interpreted(current_platform()) or split_key_reason(current_platform()):
            return False
        rope = self.qk_rope_head_dim
        return _split_head_dim_qk(self.qk_nope_head_dim + rope) == (self.qk_nope_head_dim, rope)

    # `forward_varlen(out=)` writes the output into a given [T, N, V] buffer
    takes_out = True

    @functools.cached_property
    def merges_chunks(self) -> bool:
        """Whether a context chunk's result merges into a given (out, lse) inside the kernel
        (`run_prefill_context_chunk(merge_into=)`): no [T, N, V] temporary a chunk, no merge launch."""
        from mla_multi.kernels.prefill import merge_reason

        return not _interpreted(current_platform()) and not merge_reason(current_platform())

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
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.platform = current_platform()
        self.max_num_kv_splits: int | None = None
        self.max_model_len: int | None = None
        self.max_partial_rows: int | None = None
        # eager calls without a step (the sparse decode's, a functional call's): their layout -> (the output's
        # specs, the split count, the bound kernels), so that a repeated call allocates and launches only
        self._eager_plans: dict = {}

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

    def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, num_kv_splits=None,
                    workspace_manager=None, max_seq_len: int | None = None, step_plans: dict | None = None,
                    masked_entries: bool = False, min_tokens_per_split: int | None = None):
        """See `MLADecodeImpl.forward_mqa`. `step_plans` (a step's `metadata.backend_plans`) keeps the
        workspace views and the bound kernels of the step, so that every later layer only launches.
        `masked_entries`: `mla_decode_fwd`'s (the sparse decode's index lists read as the block table);
        `min_tokens_per_split`: `choose_num_kv_splits`'s, which bounds a given `num_kv_splits` too."""
        from mla_multi.kernels.launch import layout_key
        from mla_multi.kernels.mla_decode import DecodeKernelPlan, capturing, mla_decode_fwd, shared_split_partials

        if k_scale is not None and not torch.is_tensor(k_scale):
            k_scale = torch.tensor([float(k_scale)], dtype=torch.float32, device=q_nope.device)
        key = eager_key = None
        if step_plans is not None and workspace_manager is not None:
            key = ("TRITON decode launch", self.num_heads, layout_key(q_nope), layout_key(q_pe), layout_key(kv_cache),
                   id(block_table), id(seq_lens), None if k_scale is None else layout_key(k_scale), num_kv_splits,
                   max_seq_len, id(workspace_manager), self.scale, capturing(q_nope), masked_entries)
            found = step_plans.get(key)
            if found is not None and found[0] is workspace_manager._buffer:
                _, attn_logits, out, lse, plan = found
                plan.launch(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, attn_logits, out, lse, self.scale)
                return out, lse
        elif step_plans is None and workspace_manager is None and q_nope.device.type == "cuda":
            from mla_multi import envs

            # everything the split count and the bound kernels depend on: the layouts (the cache's 4-byte
            # alignment too), the bounds, the reservation, a capture in progress, the MLA_MULTI_* environment
            eager_key = (layout_key(q_nope), layout_key(q_pe), layout_key(kv_cache), kv_cache.data_ptr() % 4,
                         layout_key(block_table), layout_key(seq_lens), None if k_scale is None else layout_key(k_scale),
                         num_kv_splits, max_seq_len, masked_entries, min_tokens_per_split, capturing(q_nope),
                         self.max_num_kv_splits,
                         self.max_model_len, self.max_partial_rows, envs.snapshot())
            found = self._eager_plans.get(eager_key)
            if found is not None:
                (partials, out_spec, lse_spec), plan = found
                out, lse = (torch.empty(shape, dtype=dtype, device=q_nope.device) for shape, dtype in (out_spec, lse_spec))
                attn_logits = shared_split_partials(*partials, q_nope.device)
                plan.launch(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, attn_logits, out, lse, self.scale)
                return out, lse
        batch = q_nope.shape[0]
        q_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
        num_kv_splits = self.choose_num_kv_splits(
            batch, q_len, max_seq_len, kv_cache.dtype, num_kv_splits, max_blocks=block_table.shape[1],
            min_tokens_per_split=min_tokens_per_split,
        )
        out_shape = tuple(q_nope.shape)
        specs = self._workspace_specs(batch * q_len, num_kv_splits, out_shape, q_nope.dtype)
        if workspace_manager is not None:
            attn_logits, out, lse = workspace_manager.get_simultaneous(*specs)
        else:
            out, lse = (torch.empty(shape, dtype=dtype, device=q_nope.device) for shape, dtype in specs[1:])
            attn_logits = shared_split_partials(batch * q_len, self.num_heads, num_kv_splits, self.kv_lora_rank,
                                                q_nope.device)
        if (key is None and eager_key is None) or q_nope.device.type != "cuda":
            return mla_decode_fwd(
                q_nope, q_pe, kv_cache, block_table, seq_lens, self.scale, k_scale=k_scale,
                num_kv_splits=num_kv_splits, attn_logits=attn_logits, out=out, lse=lse, platform=self.platform,
                masked_entries=masked_entries,
            )
        plan = DecodeKernelPlan(
            q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, attn_logits, out, lse,
            platform=self.platform, masked_entries=masked_entries,
        )
        plan.launch(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, attn_logits, out, lse, self.scale)
        if key is not None:
            step_plans[key] = (workspace_manager._buffer, attn_logits, out, lse, plan)
        else:
            if len(self._eager_plans) >= 64:
                self._eager_plans.clear()
            partials = (batch * q_len, self.num_heads, num_kv_splits, self.kv_lora_rank)
            self._eager_plans[eager_key] = ((partials, specs[1], specs[2]), plan)
        return out, lse


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


class TritonSparseDecodeImpl(MLASparseImpl):
    """Each token's valid indices are compacted (one launch) into the block-table row of a cache of one-token
    pages, which the dense split-KV decode kernels then read (their split heuristic, their sm_90 warpgroup
    kernels): 16-bit and per-tensor FP8 caches as they are; an fp8_ds_mla cache in place on sm_90 (the
    warp-specialised kernels' loader dequantises each named row as it loads it; without topk_length the
    kernels read the index lists themselves, -1 masked, and nothing is compacted), elsewhere its named rows
    first dequantised (one launch) into a scratch of T * topk rows in the query's dtype."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_place = None  # the dense decode impl that reads fp8_ds_mla pages in place (made on first use)

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        in_place = None
        if kv.dtype == torch.uint8 and not self._in_place_reason(kv, q_nope.dtype):
            in_place = functools.partial(self._decode_in_place, scale=scale)
        return _sparse_through_dense_decode(q_nope, q_pe, kv, indices, scale, k_scale, topk_length, attn_sink,
                                            in_place=in_place, lists_as_they_are=self._lists_as_they_are(q_nope))

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
        from mla_multi.kernels import interpreter_active
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

    def _decode_in_place(self, q_nope, q_pe, pages, table, lens, *, scale, masked_entries=False):
        """The dense decode impl over an fp8_ds_mla cache of one-token pages (`pages` [slots, 1, 656]), its split
        count chosen with splits down to one tile (and kept, with the bound kernels, per layout by the impl's
        eager plans). masked_entries: `table` is the index lists as they are (-1: no token, masked by the
        kernel) and `lens` their full length."""
        decode = self._in_place
        if decode is None:
            decode = self._in_place = TritonDecodeImpl(
                self.num_heads, 1.0, self.kv_lora_rank, self.qk_rope_head_dim, torch.uint8, 1, q_nope.device
            )
        decode.scale = float(scale)
        return decode.forward_mqa(q_nope, q_pe, pages, table, lens, masked_entries=masked_entries,
                                  min_tokens_per_split=_SPARSE_MIN_TOKENS_PER_SPLIT)


def _sparse_through_dense_decode(q_nope, q_pe, kv, indices, scale, k_scale, topk_length, attn_sink,
                                 out_of_range_is_none: bool = False, in_place=None, lists_as_they_are: bool = False):
    """Compact the indices into one-token pages and decode them with the dense kernels; `in_place`, for an
    fp8_ds_mla cache its kernels read as it is: (q_nope, q_pe, pages, table, lens, masked_entries=False) ->
    (out, lse). With `lists_as_they_are` and no topk_length, `in_place` takes the index lists themselves
    (masked_entries=True)."""
    from mla_multi import ops
    from mla_multi.kernels.sparse_indices import compact_indices, dequantize_named_rows

    num_slots = kv.shape[0] * kv.shape[1]
    if (in_place is not None and lists_as_they_are and topk_length is None and not out_of_range_is_none
            and indices.stride(-1) == 1):
        # the kernels read the index lists as they are (-1 masked): no compaction launch
        out, lse = in_place(q_nope, q_pe, kv.reshape(num_slots, 1, kv.shape[-1]), indices,
                            _full_lengths(indices), masked_entries=True)
    else:
        table, lens = compact_indices(indices, num_slots, topk_length, out_of_range_is_none=out_of_range_is_none)
        if in_place is not None:
            out, lse = in_place(q_nope, q_pe, kv.reshape(num_slots, 1, kv.shape[-1]), table, lens)
        else:
            if kv.dtype == torch.uint8:  # fp8_ds_mla not read in place: its named rows dequantised into pages
                pages, table = dequantize_named_rows(table, lens, kv, q_nope.dtype)
            else:
                pages = kv.reshape(num_slots, 1, kv.shape[-1])
            out, lse = ops.mla_decode(q_nope, q_pe, pages, table, lens, scale, k_scale=k_scale, backend="TRITON",
                                      return_lse=True)
    if attn_sink is not None:  # out *= exp(lse) / (exp(lse) + exp(sink)); a token with no mass keeps 0
        factor = torch.sigmoid(lse - attn_sink)
        out = out * torch.where(torch.isfinite(lse), factor, torch.ones_like(factor)).unsqueeze(-1).to(out.dtype)
    return out, lse


_FULL_LENGTHS: dict = {}


def _full_lengths(indices: torch.Tensor) -> torch.Tensor:
    """int32 [tokens] holding topk: every token's whole index list (kept per shape and device, except when made
    during a CUDA-graph capture, whose memory the graph owns)."""
    tokens, topk = indices.shape
    key = (indices.device, tokens, topk)
    lengths = _FULL_LENGTHS.get(key)
    if lengths is None:
        lengths = torch.full((tokens,), topk, dtype=torch.int32, device=indices.device)
        if not (indices.is_cuda and torch.cuda.is_current_stream_capturing()):
            if len(_FULL_LENGTHS) >= 64:
                _FULL_LENGTHS.clear()
            _FULL_LENGTHS[key] = lengths
    return lengths


class TritonSparseDecodeBackend(_TritonRequirements, MLASparseBackend):
    """Sparse decode through the dense decode kernels (`TritonSparseDecodeImpl`): 16-bit, per-tensor FP8 and
    fp8_ds_mla caches. Ranked before REFERENCE (measured: 28-950 µs where REFERENCE takes 2.9-8.9 ms) and
    after FLASHMLA / ROCM_AITER where those serve."""

    name: ClassVar[str] = "TRITON"
    supported_kv_dtypes = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.uint8)
    max_num_heads = 128
    max_query_len = 1 << 16

    @classmethod
    def validate_configuration(cls, platform, config) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        reasons += _latent_dims_reasons(config.dims)
        if platform.is_cuda() and config.kv_dtype == torch.float8_e4m3fnuz:
            reasons.append("a float8_e4m3fnuz cache on NVIDIA: its FP8 flavour is float8_e4m3fn")
        if not _interpreted(platform):
            from mla_multi.kernels.sparse_decode import fp8_reason

            reason = fp8_reason(platform, config.kv_dtype)
            if reason:
                reasons.append(reason)
        return reasons

    @staticmethod
    def get_impl_cls():
        return TritonSparseDecodeImpl


class TritonSparsePrefillImpl(MLASparseImpl):
    """Every query token a decode request over the kv rows as one-token pages: the compacted indices (an index
    outside [0, S_kv) is no token) feed the dense decode kernels."""

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        return _sparse_through_dense_decode(q_nope, q_pe, kv.unsqueeze(1), indices, scale, None, topk_length,
                                            attn_sink, out_of_range_is_none=True)


class TritonSparsePrefillBackend(_TritonRequirements, MLASparseBackend):
    """Sparse prefill over kv rows [S_kv, 576] (16-bit) through the dense decode kernels."""

    name: ClassVar[str] = "TRITON"
    supported_kv_dtypes = (torch.float16, torch.bfloat16)
    max_num_heads = 128

    @classmethod
    def validate_configuration(cls, platform, config) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        reasons += _latent_dims_reasons(config.dims)
        return reasons

    @staticmethod
    def get_impl_cls():
        return TritonSparsePrefillImpl
