"""The interfaces every MLA backend implements, one pair per phase.

After vLLM's MLA prefill backend base: a backend *class* declares what it can
run (vendors, dtypes, block sizes, head counts, KV-cache dtypes, CUDA-graph
support) and explains, as a list of reasons, why it cannot run a given
configuration; an *impl* object does the computation.

`validate_configuration` is the one source of truth for the registry: the
base class checks availability, vendor, dtype and the declared capabilities;
a backend with further limits extends it through ``super()``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from mla_multi.dims import MLADims
from mla_multi.platforms import Platform


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class PrefillSelectorConfig:
    """Hashable description of a prefill problem, the key of backend selection."""

    dims: MLADims
    dtype: torch.dtype

    def describe(self) -> str:
        d = self.dims
        return (
            f"phase=prefill num_heads={d.num_heads} qk_head_dim={d.qk_head_dim} "
            f"v_head_dim={d.v_head_dim} dtype={dtype_name(self.dtype)}"
        )


@dataclasses.dataclass(frozen=True)
class DecodeSelectorConfig:
    """Hashable description of a decode problem, the key of backend selection.

    kv_cache_dtype is already resolved to a torch dtype (see
    `mla_multi.backends.base.resolve_kv_cache_dtype`); max_query_len is the
    number of query tokens per request (1, or more for speculative decoding).
    num_tokens: the batch's query tokens where a call is planned (None where
    unknown, as when a layer is built); a selection rule may depend on it
    (`registry.SELECTION_RULES`). needs_lse: the caller uses the decode LSE
    (a merge across ranks or chunks, an attention sink), so a backend whose
    kernel for the configuration writes none must decline it.
    """

    dims: MLADims
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    block_size: int
    max_query_len: int = 1
    num_tokens: int | None = None
    needs_lse: bool = False

    def describe(self) -> str:
        d = self.dims
        return (
            f"phase=decode num_heads={d.num_heads} kv_lora_rank={d.kv_lora_rank} "
            f"qk_rope_head_dim={d.qk_rope_head_dim} dtype={dtype_name(self.dtype)} "
            f"kv_cache_dtype={dtype_name(self.kv_cache_dtype)} block_size={self.block_size} "
            f"max_query_len={self.max_query_len}"
            + (f" num_tokens={self.num_tokens}" if self.num_tokens is not None else "")
            + (" needs_lse" if self.needs_lse else "")
        )


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def prefill_lse_heads_tokens(lse: torch.Tensor, num_heads: int, num_tokens: int, source: str,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """A library's prefill LSE as [N, T] float32, +inf (an empty row in some kernels) turned into -inf; with the
    output [T, N, V], NaN where its row is NaN (the non-finite policy: a NaN that reaches a row's softmax makes
    that row and its LSE NaN; some libraries leave such a row's LSE -inf)."""
    lse = lse.float()
    if lse.shape != (num_heads, num_tokens):
        raise RuntimeError(f"{source} returned an LSE of shape {tuple(lse.shape)}; expected ({num_heads}, {num_tokens})")
    lse = torch.where(lse == float("inf"), torch.full((), float("-inf"), device=lse.device), lse)
    if out is not None:
        lse = lse.masked_fill(out.isnan().any(dim=-1).transpose(0, 1), float("nan"))
    return lse


_KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32", "float64")


def resolve_kv_cache_dtype(
    kv_cache_dtype: str | torch.dtype, dtype: torch.dtype, platform: Platform
) -> torch.dtype:
    """Turn vLLM's kv_cache_dtype spelling into a torch dtype.

    "auto" is the model dtype; "fp8" / "fp8_e4m3" is the platform's FP8 flavour
    (float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950 and NVIDIA).
    """
    if isinstance(kv_cache_dtype, torch.dtype):
        return kv_cache_dtype
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        if platform.fp8_dtype is None:
            # Platforms without FP8 arithmetic can still store e4m3fn and
            # dequantise it (the reference backend does).
            return torch.float8_e4m3fn
        return platform.fp8_dtype
    if kv_cache_dtype in _KV_CACHE_DTYPE_NAMES:
        return getattr(torch, kv_cache_dtype)
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r}; accepted: {', '.join(_KV_CACHE_DTYPE_NAMES)} or a torch.dtype"
    )


class _BackendDeclarations:
    """Class-level declarations and checks shared by both phases."""

    name: ClassVar[str]
    vendors: ClassVar[frozenset[str]] = frozenset({"cuda", "rocm", "cpu"})
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    # A backend with a planning stage (FlashInfer's plan/run) sets this; its
    # impl then has `plan(...)` and `plan_key()`, `MLAAttention.plan` calls it
    # once per batch and layers with equal keys share the plan.
    requires_plan: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> bool:
        """Whether the backend's libraries import here."""
        return not cls.availability_reasons()

    @classmethod
    def availability_reasons(cls) -> list[str]:
        """Why the backend's libraries cannot be used here (empty when they can)."""
        return []

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        """Why the backend cannot run on `platform`; replaces vLLM's compute-capability check."""
        if platform.vendor not in cls.vendors:
            return [
                f"platform {platform.name} ({platform.vendor} {platform.arch}) is not supported; "
                f"supported vendors: {', '.join(sorted(cls.vendors))}"
            ]
        return []

    @classmethod
    def supports_platform(cls, platform: Platform) -> bool:
        return not cls.platform_reasons(platform)

    @classmethod
    def _common_reasons(cls, platform: Platform, dtype: torch.dtype) -> list[str]:
        reasons = list(cls.availability_reasons())
        reasons += cls.platform_reasons(platform)
        if not cls.supports_dtype(dtype):
            reasons.append(
                f"dtype {dtype_name(dtype)} is not supported; supported: "
                f"{', '.join(dtype_name(d) for d in cls.supported_dtypes)}"
            )
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        """Declared capabilities, JSON-friendly (for `mla-multi info`)."""
        return {
            "vendors": sorted(cls.vendors),
            "dtypes": [dtype_name(d) for d in cls.supported_dtypes],
        }


# --------------------------------------------------------------------------- prefill


class MLAPrefillImpl(ABC):
    """Prefill attention over new tokens (causal) and cached-context chunks (non-causal).

    Backends implement `forward_varlen`; the two vLLM-style entry points are
    expressed through it, and a backend may override them.
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        device: torch.device | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.device = device

    @abstractmethod
    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        return_softmax_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Varlen attention.

        q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv]; cu_seqlens int32 [B + 1].
        Causal masks are aligned bottom-right. Returns out [Tq, N, Dv] in q's
        dtype, and with `return_softmax_lse` also lse [N, Tq] float32.
        """

    # What the layer may ask of an impl beyond `forward_varlen`, declared here (False: not offered) and
    # overridden by the backends that offer it; `MLAAttention` reads these and names no backend.
    # `forward_varlen` takes the keys' shared rotary part apart (k [T, N, P] and k_pe [T, R]):
    takes_split_key: bool = False
    # `forward_varlen(out=)` writes the output into a given [T, N, V] buffer:
    takes_out: bool = False
    # `run_prefill_context_chunk(merge_into=)` merges a chunk's result into a given (out, lse) inside the kernel:
    merges_chunks: bool = False

    def serves_short_prefills(self, dtype: torch.dtype) -> bool:
        """Whether steps whose prefills are all short (`attention.SHORT_PREFILL_TOKENS`) and have no context
        are better run here than on another chosen prefill backend (this impl's kernel is the faster there)."""
        return False

    def reserve_workspace(self, workspace_manager) -> None:
        """Size `workspace_manager` (the layer's shared workspace) for what the backend's library keeps there
        before it is locked (default: nothing)."""

    def run_prefill_new_tokens(self, prefill_metadata, q, k, v, return_softmax_lse: bool, k_pe=None, out=None):
        """Causal attention of the new tokens among themselves.

        q, k [num_tokens, N, P + R], v [num_tokens, N, V] (with `takes_split_key`: k [num_tokens, N, P] and
        k_pe [num_tokens, R]). Returns out [num_tokens, N, V] (written into `out` by backends with `takes_out`),
        plus lse [N, num_tokens] with `return_softmax_lse`.
        """
        extra = {} if k_pe is None else {"k_pe": k_pe}
        if out is not None:
            extra["out"] = out
        return self.forward_varlen(
            q,
            k,
            v,
            prefill_metadata.query_start_loc,
            prefill_metadata.query_start_loc,
            prefill_metadata.max_query_len,
            prefill_metadata.max_query_len,
            causal=True,
            return_softmax_lse=return_softmax_lse,
            **extra,
        )

    def run_prefill_context_chunk(self, prefill_metadata, chunk_idx: int, q, k, v, k_pe=None, merge_into=None):
        """Non-causal attention of the new tokens over context chunk `chunk_idx`.

        q [num_tokens, N, P + R], k [chunk_tokens, N, P + R] (or [.., P] and k_pe, as above), v [chunk_tokens, N, V].
        Returns (out [num_tokens, N, V], lse [N, num_tokens] float32). `merge_into` (backends with
        `merges_chunks`): an (out, lse) pair that the chunk's result is merged into, in place, and returned.
        """
        chunked = prefill_metadata.chunked_context
        extra = {} if k_pe is None else {"k_pe": k_pe}
        if merge_into is not None:
            extra.update(out=merge_into[0], lse=merge_into[1], merge=True)
        return self.forward_varlen(
            q,
            k,
            v,
            prefill_metadata.query_start_loc,
            chunked.cu_seq_lens[chunk_idx],
            prefill_metadata.max_query_len,
            chunked.max_seq_lens[chunk_idx],
            causal=False,
            return_softmax_lse=True,
            **extra,
        )


class MLAPrefillBackend(_BackendDeclarations, ABC):
    """A prefill implementation and the declaration of what it can run."""

    @staticmethod
    @abstractmethod
    def get_prefill_impl_cls() -> type[MLAPrefillImpl]:
        """The implementation class of this backend."""

    @staticmethod
    def get_prefill_metadata_cls() -> type:
        from mla_multi.metadata import MLAPrefillMetadata

        return MLAPrefillMetadata

    @classmethod
    def validate_configuration(cls, platform: Platform, config: PrefillSelectorConfig) -> list[str]:
        """Reasons this backend cannot run `config` on `platform`; empty when it can."""
        return cls._common_reasons(platform, config.dtype)


# --------------------------------------------------------------------------- decode


class MLADecodeImpl(ABC):
    """MQA over the paged latent cache (the absorbed decode of MLA)."""

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        kv_cache_dtype: torch.dtype,
        block_size: int,
        device: torch.device | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = block_size
        self.device = device

    # The split count is the impl's to choose per batch (`choose_num_kv_splits`), so that every layer of a
    # step launches with the one its first layer chose; False: the library decides (or there are no splits).
    chooses_num_kv_splits: ClassVar[bool] = False
    # rows of split partials reserved (`reserve_workspace`), where the impl keeps partials in the workspace
    max_partial_rows: int | None = None

    def reserve_workspace(self, workspace_manager, max_num_seqs: int, max_model_len: int, max_query_len: int = 1,
                          dtype: torch.dtype | None = None) -> None:
        """Size `workspace_manager` for the worst case before it is locked (default: nothing to reserve).

        `dtype` is the query's (the output's) dtype where the caller knows it."""

    def choose_num_kv_splits(self, batch: int, q_len: int, bound: int | None, kv_cache_dtype, num_kv_splits=None,
                             max_blocks: int | None = None, min_tokens_per_split: int | None = None) -> int | None:
        """The split count of a batch of `batch` requests of `q_len` tokens whose lengths are at most `bound`
        (impls with `chooses_num_kv_splits`); None: the library's to choose."""
        return num_kv_splits

    def bind(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, num_kv_splits=None,
             max_seq_len: int | None = None, **options) -> "DecodeLaunch":
        """The decode of tensors laid out as these, planned once: everything that depends only on the layout
        (the split count, launch configurations, bound kernels) is decided here, and the returned launch only
        runs. The one way into an impl's kernels for the functional ops, the layer and the sparse paths.
        Default: a launch that calls `forward_mqa`."""
        return DecodeLaunch(self, num_kv_splits, max_seq_len, options)

    @abstractmethod
    def forward_mqa(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        num_kv_splits: int | None = None,
        workspace_manager=None,
        max_seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode attention.

        q_nope [B, N, Lkv] (absorbed) or [B, Q, N, Lkv] for Q query tokens per
        request (causal within the request); q_pe likewise with R; kv_cache
        [num_blocks, block_size, Lkv + R]; block_table [B, max_blocks] int32;
        seq_lens [B] int32 (tokens in the cache, the new ones included).
        num_kv_splits forces the split count (backends without splits ignore
        it); workspace_manager supplies scratch (reserved ahead for CUDA
        graphs); max_seq_len is a host-side bound of seq_lens for heuristics.
        Backends with `requires_plan` also take `plan=`, made by their `plan`.
        Returns out with q_nope's shape and dtype and lse [B, (Q,) N] float32;
        the output may live in the workspace, valid until its next use.
        """


class DecodeLaunch:
    """A decode bound to one layout by `MLADecodeImpl.bind`: calling it runs tensors laid out as those it was
    bound for (new values, new lengths) and returns (out, lse).

    `out` / `lse`, when given, are contiguous tensors of the shapes and dtypes the call would allocate and
    receive the result; `attn_logits` is the split partials' buffer where the caller owns one
    (`new_partials`); `workspace_manager` supplies reserved scratch (CUDA graphs).
    """

    def __init__(self, impl: MLADecodeImpl, num_kv_splits: int | None = None, max_seq_len: int | None = None,
                 options: dict | None = None) -> None:
        self.impl = impl
        self.num_kv_splits = num_kv_splits
        self.max_seq_len = max_seq_len
        self.options = options or {}

    def new_partials(self) -> torch.Tensor | None:
        """A split-partials buffer of this launch's own (None where the impl keeps none)."""
        return None

    def __call__(self, q_nope, q_pe, kv_cache, block_table, seq_lens, scale: float, *, k_scale=None, out=None,
                 lse=None, attn_logits=None, workspace_manager=None):
        impl = self.impl
        impl.scale = float(scale)
        result, result_lse = impl.forward_mqa(
            q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale=k_scale, num_kv_splits=self.num_kv_splits,
            workspace_manager=workspace_manager, max_seq_len=self.max_seq_len, **self.options,
        )
        if out is not None:
            result = out.copy_(result)
        if lse is not None and result_lse is not None:
            result_lse = lse.copy_(result_lse)
        return result, result_lse


class MLADecodeBackend(_BackendDeclarations, ABC):
    """A decode implementation and the declaration of what it can run.

    `supported_block_sizes` / `supported_num_heads` of None mean any.
    """

    supported_kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_block_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_num_heads: ClassVar[tuple[int, ...] | None] = None
    max_num_heads: ClassVar[int] = 128
    max_query_len: ClassVar[int] = 1
    supports_cuda_graphs: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def get_decode_impl_cls() -> type[MLADecodeImpl]:
        """The implementation class of this backend."""

    @classmethod
    def validate_configuration(cls, platform: Platform, config: DecodeSelectorConfig) -> list[str]:
        """Reasons this backend cannot run `config` on `platform`; empty when it can."""
        reasons = cls._common_reasons(platform, config.dtype)
        if config.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(
                f"kv_cache_dtype {dtype_name(config.kv_cache_dtype)} is not supported; supported: "
                f"{', '.join(dtype_name(d) for d in cls.supported_kv_cache_dtypes)}"
            )
        if cls.supported_block_sizes is not None and config.block_size not in cls.supported_block_sizes:
            reasons.append(
                f"block_size {config.block_size} is not supported; supported: "
                f"{', '.join(map(str, cls.supported_block_sizes))}"
            )
        num_heads = config.dims.num_heads
        if cls.supported_num_heads is not None and num_heads not in cls.supported_num_heads:
            reasons.append(
                f"num_heads {num_heads} is not supported; supported: "
                f"{', '.join(map(str, cls.supported_num_heads))}"
            )
        elif num_heads > cls.max_num_heads:
            reasons.append(f"num_heads {num_heads} is over the maximum of {cls.max_num_heads}")
        if config.max_query_len > cls.max_query_len:
            reasons.append(
                f"max_query_len {config.max_query_len} (query tokens per decode request) is over "
                f"the maximum of {cls.max_query_len}"
            )
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        info.update(
            kv_cache_dtypes=[dtype_name(d) for d in cls.supported_kv_cache_dtypes],
            block_sizes=list(cls.supported_block_sizes) if cls.supported_block_sizes else "any",
            num_heads=list(cls.supported_num_heads) if cls.supported_num_heads else f"1..{cls.max_num_heads}",
            max_query_len=cls.max_query_len,
            cuda_graphs=cls.supports_cuda_graphs,
        )
        return info


# --------------------------------------------------------------------------- sparse (DeepSeek Sparse Attention)


@dataclasses.dataclass(frozen=True)
class SparseSelectorConfig:
    """Hashable description of a sparse MLA problem (phase sparse_decode or sparse_prefill).

    kv_dtype is the cache's (decode: float, FP8 with a scale, or uint8 for the
    fp8_ds_mla layout) or the kv rows' (prefill); topk the index-list length;
    max_query_len the query tokens per request (decode). num_tokens: the
    batch's query tokens where a call is planned (None where unknown, as when
    a layer is built); with_lengths: the call passes topk_length. A selection
    rule may depend on both (`registry.SELECTION_RULES`).
    """

    dims: MLADims
    dtype: torch.dtype
    kv_dtype: torch.dtype
    topk: int
    max_query_len: int = 1
    num_tokens: int | None = None
    with_lengths: bool = False
    kv_format: str | None = None
    extra_kv_format: str | None = None
    with_sink: bool = False

    @property
    def v4(self) -> bool:
        """The V4 contract (`mla_multi.ops.mla_sparse_decode_v4` / `mla_sparse_prefill_v4`)."""
        return self.kv_format is not None

    def describe(self) -> str:
        d = self.dims
        if self.v4:
            kv = self.kv_format + (f" + second segment {self.extra_kv_format}" if self.extra_kv_format else "")
            return (
                f"V4 num_heads={d.num_heads} d_qk=d_v={d.kv_cache_width} dtype={dtype_name(self.dtype)} kv={kv} "
                f"topk={self.topk} max_query_len={self.max_query_len}"
                + (f" num_tokens={self.num_tokens}" if self.num_tokens is not None else "")
                + (" with topk_length" if self.with_lengths else "") + (" with attn_sink" if self.with_sink else "")
            )
        kv = "fp8_ds_mla (uint8, 656 bytes a token)" if self.kv_dtype == torch.uint8 else dtype_name(self.kv_dtype)
        return (
            f"num_heads={d.num_heads} kv_lora_rank={d.kv_lora_rank} qk_rope_head_dim={d.qk_rope_head_dim} "
            f"dtype={dtype_name(self.dtype)} kv={kv} topk={self.topk} max_query_len={self.max_query_len}"
            + (f" num_tokens={self.num_tokens}" if self.num_tokens is not None else "")
            + (" with topk_length" if self.with_lengths else "")
        )


class MLASparseImpl(ABC):
    """Sparse MLA in the latent space: every query token attends to the cached rows its indices name."""

    # What the ops and layers may ask of an impl, declared here (False: not offered) and overridden by the
    # backends that offer it; `MLAAttentionV4` reads it and names no backend.
    # `bind_v4`'s launch takes `out=` (a contiguous [T, N, 512] buffer in q's dtype) and writes the output there:
    v4_takes_out: bool = False

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, device=None) -> None:
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.device = device

    @abstractmethod
    def forward(self, q_nope, q_pe, kv, indices, scale: float, *, k_scale=None, topk_length=None,
                attn_sink=None) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [T, N, Lkv], q_pe [T, N, R]; kv the paged cache (sparse_decode, indices are slots) or
        [S, Lkv + R] rows (sparse_prefill, indices are rows); indices int32 [T, topk]; topk_length [T];
        attn_sink float32 [N]. Returns out [T, N, Lkv] in q's dtype and lse [T, N] float32."""

    def forward_v4(self, q, kv, indices, scale: float, *, kv_format: str, topk_length=None, attn_sink=None,
                   extra_kv=None, extra_indices=None, extra_topk_length=None, extra_kv_format=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The V4 contract: q [T, N, 512] (d_qk = d_v = 512); kv a cache of `kv_format` (sparse_decode,
        indices are slots) or [S, 512] rows (sparse_prefill; kv_format "rows"); an optional second segment
        (extra_kv / extra_indices / extra_topk_length, its own format) softmaxed with the first. Returns out
        [T, N, 512] in q's dtype and lse [T, N] (without the sink). Only backends that declare
        `supported_v4_formats` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the V4 contract")

    def bind(self, q_nope, q_pe, kv, indices, *, k_scale=None, topk_length=None, attn_sink=None):
        """The sparse attention of tensors laid out as these (shapes, strides, dtypes, devices, 16-byte
        alignment; None where None), planned once: the returned launch takes `forward`'s arguments, runs any
        tensors of that layout (new values, new addresses) and returns (out, lse). The way the sparse ops call
        an impl, one per op plan. Default: `forward` itself."""
        return self.forward

    def bind_v4(self, q, kv, indices, *, kv_format: str, topk_length=None, attn_sink=None, extra_kv=None,
                extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        """`bind` for the V4 contract: the launch takes `forward_v4`'s arguments but the two formats, which
        are bound: (q, kv, indices, scale, *, topk_length, attn_sink, extra_kv, extra_indices,
        extra_topk_length). Default: `forward_v4` with the formats given."""
        forward_v4 = self.forward_v4

        def launch(q, kv, indices, scale, **tensors):
            return forward_v4(q, kv, indices, scale, kv_format=kv_format, extra_kv_format=extra_kv_format, **tensors)

        return launch


# the most named rows (top-k and window entries together) a V4 call of an impl that gathers or dequantises them
# first holds at once (TRITON's 576-wide bf16 rows: 75 MB; REFERENCE's float32 rows of 512: 128 MB); a call of more
# runs its tokens in parts (`v4_tokens_per_call`, `forward_v4_in_parts`)
V4_ROWS_AT_ONCE = 1 << 16


def v4_entries_per_token(indices, extra_indices) -> int:
    """The entries a token of a V4 call names: both index lists' widths, at least one."""
    return max(indices.shape[1] + (0 if extra_indices is None else extra_indices.shape[1]), 1)


def v4_tokens_per_call(indices, extra_indices) -> int:
    """The tokens of a V4 call whose named rows (`v4_entries_per_token`) fit V4_ROWS_AT_ONCE, at least one."""
    return max(1, V4_ROWS_AT_ONCE // v4_entries_per_token(indices, extra_indices))


def forward_v4_in_parts(forward_v4, q, kv, indices, scale, per_call: int, *, out=None, topk_length=None,
                        extra_indices=None, extra_topk_length=None, takes_out: bool = False, **fixed):
    """`forward_v4` (an impl's, the V4 contract) over q's tokens `per_call` at a time, the token-indexed arguments
    sliced, into `out` (made where None; passed down where `takes_out`, else each part copied in) and an LSE of
    the parts' dtype: what an impl that holds every named row of a call at once (gathered, dequantised) runs
    for a call of many entries, so that its scratch stays bounded. Returns (out, lse)."""
    tokens = q.shape[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = None
    for start in range(0, tokens, per_call):
        part = slice(start, min(tokens, start + per_call))
        result, part_lse = forward_v4(
            q[part], kv, indices[part], scale, topk_length=None if topk_length is None else topk_length[part],
            extra_indices=None if extra_indices is None else extra_indices[part],
            extra_topk_length=None if extra_topk_length is None else extra_topk_length[part],
            **fixed, **({"out": out[part]} if takes_out else {}))
        if not takes_out:
            out[part] = result
        if lse is None:
            lse = torch.empty(q.shape[:2], dtype=part_lse.dtype, device=q.device)
        lse[part] = part_lse
    return out, lse


class MLASparseBackend(_BackendDeclarations, ABC):
    """A sparse MLA implementation (one phase) and the declaration of what it can run."""

    supported_kv_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    max_num_heads: ClassVar[int] = 128
    max_topk: ClassVar[int] = 1 << 20
    max_query_len: ClassVar[int] = 1
    # cache formats (`mla_multi.cache_formats` names, and "rows" for float rows) the backend runs the V4
    # contract over; none: it rejects every V4 configuration with that reason
    supported_v4_formats: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[MLASparseImpl]:
        """The implementation class of this backend."""

    @classmethod
    def validate_configuration(cls, platform: Platform, config: SparseSelectorConfig) -> list[str]:
        reasons = cls._common_reasons(platform, config.dtype)
        if config.v4:
            formats = [f for f in (config.kv_format, config.extra_kv_format) if f is not None]
            missing = [f for f in formats if f not in cls.supported_v4_formats]
            if missing:
                supported = ", ".join(cls.supported_v4_formats) or "none (not implemented yet)"
                reasons.append(f"the V4 contract (d_qk = d_v = 512) over {' and '.join(missing)} is not implemented "
                               f"by {cls.name}; V4 formats supported: {supported}")
        elif config.kv_dtype not in cls.supported_kv_dtypes:
            names = ", ".join("fp8_ds_mla (uint8)" if d == torch.uint8 else dtype_name(d) for d in cls.supported_kv_dtypes)
            reasons.append(f"kv dtype {dtype_name(config.kv_dtype)} is not supported; supported: {names}")
        if config.dims.num_heads > cls.max_num_heads:
            reasons.append(f"num_heads {config.dims.num_heads} is over the maximum of {cls.max_num_heads}")
        if config.topk > cls.max_topk:
            reasons.append(f"topk {config.topk} is over the maximum of {cls.max_topk}")
        if config.max_query_len > cls.max_query_len:
            reasons.append(f"max_query_len {config.max_query_len} is over the maximum of {cls.max_query_len}")
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        info.update(kv_dtypes=[dtype_name(d) for d in cls.supported_kv_dtypes],
                    v4_formats=list(cls.supported_v4_formats), max_topk=cls.max_topk,
                    num_heads=f"1..{cls.max_num_heads}", max_query_len=cls.max_query_len)
        return info
