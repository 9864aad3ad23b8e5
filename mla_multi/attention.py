"""`MLAAttention`: the whole MLA attention forward on top of the selected backends.

Per step (DESIGN section 1):
1. the new latent rows [kv_c | k_pe] are written to the paged cache;
2. decodes (first in the batch) run absorbed: q_nope @ W_UK_T -> MQA over the
   576-wide latent cache (`forward_mqa`) -> @ W_UV;
3. prefills run as MHA with qk head dim P + R and v head dim V: new tokens
   causal, cached context in workspace-sized chunks gathered from the cache
   (non-causal, with LSE), all merged with `merge_attn_states`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing

import torch

from mla_multi import checks, ops
from mla_multi.backends.base import FP8_DTYPES, dtype_name, resolve_kv_cache_dtype
from mla_multi.dims import MLADims
from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES
from mla_multi.kernels import rows_of_heads
from mla_multi.metadata import CommonAttentionMetadata, build_prefill_metadata, split_decodes_and_prefills, to_device
from mla_multi.platforms import current_platform
from mla_multi.registry import select_decode_backend, select_prefill_backend
from mla_multi.workspace import WorkspaceManager, current_workspace_manager

# the longest new prefill of a step without context that goes to the context prefill backend where
# `MLAAttention._short_prefills` holds
SHORT_PREFILL_TOKENS = 4096
# the most tokens a step's absorbed products take as Triton launches (`kernels.absorb.MAX_TOKENS`, not imported
# here: the module needs Triton); more take torch.bmm
MAX_PRODUCT_TOKENS = 16

class _AbsorbedViews(typing.NamedTuple):
    """What `MLAAttention._make_views` makes of kv_b_proj's weight, by name (a tuple: read as one)."""

    weight: torch.Tensor  # the parameter the views were made of (identity and address: `_absorbed`)
    address: int
    w_uk: torch.Tensor  # [N, P, Lkv]: q_nope @ W_UK -> the absorbed query
    w_uv: torch.Tensor  # [N, V, Lkv]
    w_uv_t: torch.Tensor  # [N, Lkv, V]: latent output @ W_UV^T -> each head's V
    products: typing.Any  # the products' bound launches (`kernels.absorb.DecodeProducts`) or None
    prologue: typing.Any  # the same where a decode step may take the prologue (no DCP, no byte cache) or None


# what a backward through the layer says (`_InferenceOnly`)
NO_BACKWARD = (
    "MLAAttention is inference-only: its kernels have no backward, so no gradient flows through the attention "
    "output. Run the forward under torch.inference_mode() (or torch.no_grad()), as transformers' generate() does; "
    "to train, use an attention that has a backward"
)


def default_workspace_tokens(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """vLLM's chunked-prefill workspace size: enough for 8 full contexts, capped at 128K tokens."""
    return min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 128 * 1024)


class _InferenceOnly(torch.autograd.Function):
    """Ties the layer's output (computed under no-grad) to the inputs that require grad, with a backward that
    raises `NO_BACKWARD`: a forward in grad mode works, a backward through it says why it cannot."""

    @staticmethod
    def forward(ctx, output, *inputs):
        return output.detach()  # the same memory, not a view in autograd's sense: in-place ops after it work

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NO_BACKWARD)


def _step_output(output, tokens: int, width: int, dtype, device) -> torch.Tensor:
    """A layer step's output [tokens, width]: the caller's, checked, or a new one."""
    if output is None:
        return torch.empty(tokens, width, dtype=dtype, device=device)
    checks.expect_tensor("output", output, (tokens, width), dtype, device)
    return output


class MLAAttention(torch.nn.Module):
    """One MLA attention layer's attention (projections outside q/kv_c/k_pe are the caller's), a `torch.nn.Module`.

    Conventions (the README's "Using MLAAttention in a model" says the same):

    * q [T, N, P + R]: each head's non-rotary part (P = qk_nope_head_dim) first, then its rotary part
      (R = qk_rope_head_dim), after `q_b_proj` (or `q_proj`); any strides with a contiguous last dimension (a
      [T, N, P + R] view of transformers' [1, N, T, P + R] query is taken as it is: the prefill copies it once
      where the fast kernel needs each token's heads side by side).
    * RoPE is the caller's: q's rotary part and k_pe [T, R] come already rotated (DeepSeek's interleaved
      rotation or not: the layer never looks inside them).
    * kv_c_normed [T, Lkv]: the latent after `kv_a_layernorm` (Lkv = kv_lora_rank), the rows of
      `kv_a_proj_with_mqa`'s output before its last R columns, which are k_pe before RoPE.
    * The paged cache [num_blocks, block_size, Lkv + R] (each row: the latent, then the rotated k_pe) in the
      layer's `kv_cache_dtype`; "fp8_ds_mla" (sparse) is uint8 [num_blocks, block_size, 656].
      `allocate_kv_cache(num_blocks)` (or `mla_multi.allocate_kv_cache`) makes one.
    * kv_b_proj_weight [N * (P + V), Lkv]: `kv_b_proj.weight` as checkpoints store it, each head's P rows of
      W_UK then its V rows of W_UV.
    * scale: the softmax scale, 1 / sqrt(P + R) times, for YaRN-scaled models (DeepSeek-V3), mscale^2 with
      mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (transformers' `DeepseekV3Attention.scaling`). The other
      YaRN factor, mscale / mscale_all_dim's ratio (1 for DeepSeek-V3), scales the cos / sin of the caller's RoPE.
    * Batch order: decodes (query_len <= decode_threshold) first, unless the metadata was built with
      `CommonAttentionMetadata.from_lengths(..., reorder=True)`: then q, kv_c_normed, k_pe and the output are
      in the caller's order of requests (`metadata.batch_order` maps it).

    Weights: `kv_b_proj_weight` is the module's parameter (`state_dict()` key ``kv_b_proj_weight``; the caller's
    own `nn.Parameter` where given one, so that a model that also holds it as `kv_b_proj.weight` shares it). The
    absorbed forms `W_UK` [N, P, Lkv] and `W_UV` [N, V, Lkv] are *views* of it, never copies: the layer holds
    no weight memory of its own, `load_state_dict` (in place) takes effect at once, and `.to(device / dtype)`
    carries the weight and re-selects the backends for the new dtype and device. A weight replaced without
    PyTorch's module methods (``param.data = ...``, ``load_state_dict(assign=True)``) is noticed at the next
    forward; `process_weights_after_loading()` (vLLM's name) does it at once and checks the weight.

    Autograd: inference only. Under grad mode the forward runs under `torch.no_grad()` itself: the cache is
    written as in inference (it never requires grad, it gets no grad_fn), and where an input or the weight
    requires grad the output does too, through a node whose backward raises RuntimeError (`NO_BACKWARD`) rather
    than giving a gradient that silently leaves the attention out.

    Args:
        dims: the layer's `MLADims` (heads on this device).
        scale: softmax scale (above).
        kv_b_proj_weight: [N * (P + V), Lkv] as checkpoints store `kv_b_proj.weight`.
        block_size: tokens per cache block.
        max_model_len, max_num_seqs: the worst case the workspace is reserved for.
        kv_cache_dtype: "auto" (the weight dtype), "fp8"/"fp8_e4m3" (the platform's FP8)
            or a torch dtype.
        kv_cache_scale: per-tensor FP8 scale of the cache (float), required for fp8.
        workspace_tokens: context tokens gathered per chunk (default: vLLM's rule).
        prefill_backend, decode_backend: force a backend by name.
        dcp: a `mla_multi.distributed.DecodeContextParallel`: the cache holds only this
            rank's tokens (the layer writes only those), decode runs through DCP over
            the group's world_size * N heads, and the chunked-context prefill gathers
            each chunk from every rank. `metadata.block_table` then holds this rank's
            blocks and `metadata.seq_lens` the global lengths; the layer derives its
            own slot mapping (`metadata.slot_mapping` is not used).
    """

    def __init__(
        self,
        dims: MLADims,
        scale: float,
        kv_b_proj_weight: torch.Tensor,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_dtype: str | torch.dtype = "auto",
        kv_cache_scale: float | None = None,
        workspace_tokens: int | None = None,
        prefill_backend: str | None = None,
        decode_backend: str | None = None,
        dcp=None,
        workspace: WorkspaceManager | None = None,
        sparse_topk: int | None = None,
        sparse_backend: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(dims, MLADims):
            raise ValueError(f"dims={dims!r}; accepted: an MLADims")
        self._check_weight(dims, kv_b_proj_weight)
        for name, value in (("block_size", block_size), ("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            checks.check_positive_int(name, value)
        checks.check_positive_float("scale", scale)
        self.dims = dims
        self.scale = float(scale)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.platform = current_platform()
        if sparse_topk is not None and (not isinstance(sparse_topk, int) or isinstance(sparse_topk, bool)
                                        or sparse_topk < 1):
            raise ValueError(f"sparse_topk={sparse_topk!r}; accepted: None (dense MLA) or a positive int")
        self.sparse_topk = sparse_topk
        if kv_cache_dtype == "fp8_ds_mla":
            if sparse_topk is None:
                raise ValueError("kv_cache_dtype='fp8_ds_mla' is the sparse MLA cache layout; accepted with sparse_topk")
            if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (512, 64):
                raise ValueError(f"kv_cache_dtype='fp8_ds_mla' holds 512 latent and 64 rotary values; this layer has "
                                 f"{dims.kv_lora_rank} / {dims.qk_rope_head_dim}")
            kv_cache_dtype = torch.uint8
        self._kv_cache_dtype_arg = kv_cache_dtype  # resolved against the weight dtype by `_bind`
        self._kv_cache_scale_arg = kv_cache_scale
        self.workspace_tokens = workspace_tokens or default_workspace_tokens(max_model_len, max_num_seqs, block_size)
        if self.workspace_tokens < block_size:
            raise ValueError(
                f"workspace_tokens={self.workspace_tokens}; accepted: at least one block ({block_size} tokens)"
            )
        if dcp is not None:
            from mla_multi.distributed import DecodeContextParallel

            if not isinstance(dcp, DecodeContextParallel):
                raise ValueError(f"dcp={dcp!r}; accepted: None or a mla_multi.distributed.DecodeContextParallel")
        if workspace is not None and not isinstance(workspace, WorkspaceManager):
            raise ValueError(f"workspace={workspace!r}; accepted: None (the device's shared one) or a WorkspaceManager")
        self.dcp = dcp
        self._workspace_arg = workspace
        self._forced_backends = (prefill_backend, decode_backend, sparse_backend)

        # the weight: a parameter of this module (the caller's own Parameter where it is one: shared, not copied)
        if not isinstance(kv_b_proj_weight, torch.nn.Parameter):
            kv_b_proj_weight = torch.nn.Parameter(kv_b_proj_weight, requires_grad=False)
        self.kv_b_proj_weight = kv_b_proj_weight
        self._views: _AbsorbedViews | None = None
        self._bound: tuple | None = None
        self._bind()
        # torch.ops.mla_multi.mla_attention finds the layer by this id (forward under torch.compile)
        from mla_multi import library

        self.layer_id: int = library.register_layer(self)

    @staticmethod
    def _check_weight(dims: MLADims, weight) -> None:
        n, p, v, lkv = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
        checks.check_tensor("kv_b_proj_weight", weight, ndim=2, dtypes=ops.FLOAT_DTYPES, shape=(n * (p + v), lkv))

    def _bind(self) -> None:
        """Everything that follows from the weight's dtype and device: the cache dtype ("auto"), the FP8 scale
        tensor, the workspace, the backends and their reservations, the absorbed views. Run at construction and
        again when the weight's dtype or device changes (`.to()`, `process_weights_after_loading`)."""
        dims = self.dims
        n, p, v, lkv = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
        weight = self.kv_b_proj_weight
        self.dtype = weight.dtype
        self.device = weight.device
        self.kv_cache_dtype = resolve_kv_cache_dtype(self._kv_cache_dtype_arg, self.dtype, self.platform)
        kv_cache_scale = self._kv_cache_scale_arg
        if self.kv_cache_dtype in FP8_DTYPES:
            if kv_cache_scale is None:
                raise ValueError(
                    f"kv_cache_dtype={dtype_name(self.kv_cache_dtype)} needs kv_cache_scale; accepted: a positive float"
                )
            checks.check_scale("kv_cache_scale", kv_cache_scale, required=True)
            self.k_scale = torch.tensor([float(kv_cache_scale)], dtype=torch.float32, device=self.device)
            self.k_scale_value: float | None = float(kv_cache_scale)
        else:
            self.k_scale = None
            self.k_scale_value = None
        dcp = self.dcp
        decode_heads = n
        if dcp is not None:
            dcp.check_device("kv_b_proj_weight", self.device)
            # DCP decodes every head of the layer over the local tokens.
            decode_heads = n * dcp.world_size
        workspace = self._workspace_arg
        self.workspace = workspace if workspace is not None else current_workspace_manager(self.device)
        prefill_backend, decode_backend, sparse_backend = self._forced_backends
        self.__dict__.pop("_decode_step_key_base", None)  # made from the backends chosen here
        if self.sparse_topk is not None:
            self._init_sparse(dims, sparse_backend, dcp)
        else:
            self.prefill_backend = select_prefill_backend(dims, self.dtype, backend=prefill_backend)
            self.decode_backend = select_decode_backend(
                dataclasses.replace(dims, num_heads=decode_heads), self.dtype, self.kv_cache_dtype, self.block_size,
                backend=decode_backend, needs_lse=dcp is not None,  # DCP merges the ranks' partials by their LSE
            )
            self.prefill_impl = self.prefill_backend.get_prefill_impl_cls()(
                n, self.scale, lkv, p, dims.qk_rope_head_dim, v, self.device
            )
            self.decode_impl = self.decode_backend.get_decode_impl_cls()(
                decode_heads, self.scale, lkv, dims.qk_rope_head_dim, self.kv_cache_dtype, self.block_size, self.device
            )
            self.decode_impl.reserve_workspace(self.workspace, self.max_num_seqs, self.max_model_len, dtype=self.dtype)
            # unless forced, each step's decode backend is chosen for its decode rows (a rule may depend on the
            # planned batch: `registry.SELECTION_RULES`); the ranges of rows whose backend differs, with theirs
            self._decode_ranges = self._decode_by_tokens(
                dataclasses.replace(dims, num_heads=decode_heads), self.block_size, decode_backend
            )
            self.context_prefill_backend, self.context_prefill_impl = self._context_prefill(
                dims, prefill_backend, (n, self.scale, lkv, p, dims.qk_rope_head_dim, v, self.device)
            )
            self.short_prefills_on_context_backend = self._short_prefills()
            for impl in {id(i): i for i in (self.prefill_impl, self.context_prefill_impl)}.values():
                impl.reserve_workspace(self.workspace)
            # the chunked-context prefill gathers at most workspace_tokens latent rows at a time; decode and
            # prefill run one after the other, so they share the buffer
            self.workspace.reserve(
                self._gather_spec(self.workspace_tokens),
                purpose="prefill: one gathered context chunk",
                what=f"workspace_tokens={self.workspace_tokens} latent rows of {lkv + dims.qk_rope_head_dim}",
            )
        # the kernels' error flag (mla_multi.errors) must exist before a graph captures its address
        self._error_flag = ops.error_flag(self.device)
        self._bound = (self.dtype, self.device)
        self._make_views()

    # ------------------------------------------------------------------ weights
    def _make_views(self) -> _AbsorbedViews:
        """The views of the weight and the products' bound launches over them (`_AbsorbedViews`, `_products`)."""
        d = self.dims
        n, p, v, lkv = d.num_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
        weight = self._parameters["kv_b_proj_weight"]
        # kv_b_proj maps the latent to [k_nope | v] per head: per head, P rows of W_UK then V rows of W_UV
        per_head = weight.detach().view(n, p + v, lkv)
        w_uk = per_head[:, :p, :]  # q_nope @ W_UK -> absorbed query
        w_uv = per_head[:, p:, :]  # latent output @ W_UV^T -> per-head V
        products = self._products(w_uk, w_uv)
        prologue = products if self.dcp is None and self.kv_cache_dtype != torch.uint8 else None
        self._views = _AbsorbedViews(weight, weight.data_ptr(), w_uk, w_uv, w_uv.transpose(1, 2), products, prologue)
        return self._views

    def _products(self, w_uk: torch.Tensor, w_uv: torch.Tensor):
        """The absorbed products of steps of a few tokens as Triton launches (`kernels.absorb.DecodeProducts`:
        half a `torch.bmm`'s host time, the decode's cache write in the W_UK product's launch), on a GPU where
        the dims and dtype allow them; None elsewhere (`torch.bmm` and the cache op)."""
        if w_uk.device.type != "cuda" or w_uk.stride(2) != 1:  # the prologue reads W_UK's rows as contiguous
            return None
        try:
            from mla_multi.kernels.absorb import DecodeProducts, products_reason
        except ImportError:  # no Triton: the products stay torch's
            return None
        d = self.dims
        if products_reason(w_uk.dtype, d.qk_nope_head_dim, d.kv_lora_rank, d.v_head_dim):
            return None
        return DecodeProducts(w_uk, w_uv.transpose(1, 2))

    def _absorbed(self) -> _AbsorbedViews:
        """The views of `_make_views`, made again where the weight was replaced or moved behind the module's back
        (``param.data = ...``, ``load_state_dict(assign=True)``): one identity and one address comparison."""
        views = self._views
        weight = self._parameters["kv_b_proj_weight"]
        if views.weight is not weight or views.address != weight.data_ptr():
            self.process_weights_after_loading()
            views = self._views
        return views

    def process_weights_after_loading(self) -> None:
        """Check `kv_b_proj_weight` and make the absorbed views of it again, re-selecting the backends where its
        dtype or device changed (vLLM's name for the step after a checkpoint is loaded). Optional: W_UK and W_UV
        are views, so weights loaded in place are used at once, and a replaced weight is noticed by the next
        forward; call it to get a wrong weight's error here rather than there."""
        weight = self._parameters.get("kv_b_proj_weight")
        self._check_weight(self.dims, weight)
        if self._bound != (weight.dtype, weight.device):
            self._bind()
        else:
            self._make_views()

    def _apply(self, fn, recurse=True):
        # `.to()`, `.cuda()`, `.half()` ...: the weight moved or changed dtype; follow it
        result = super()._apply(fn, recurse)
        self.process_weights_after_loading()
        return result

    @property
    def W_UK(self) -> torch.Tensor:
        """[N, P, Lkv]: a view of `kv_b_proj_weight` (q_nope @ W_UK is the absorbed query)."""
        return self._absorbed().w_uk

    @property
    def W_UV(self) -> torch.Tensor:
        """[N, V, Lkv]: a view of `kv_b_proj_weight` (the latent output @ W_UV^T is each head's V)."""
        return self._absorbed().w_uv

    def allocate_kv_cache(self, num_blocks: int, *, device=None) -> torch.Tensor:
        """A zeroed paged cache for this layer: [num_blocks, block_size, Lkv + R] of `kv_cache_dtype` (uint8
        [.., 656] for "fp8_ds_mla") on the layer's device (`mla_multi.allocate_kv_cache`)."""
        from mla_multi.kv_cache import allocate_kv_cache

        kv_cache_dtype = self._kv_cache_dtype_arg
        fmt = "fp8_ds_mla" if kv_cache_dtype is torch.uint8 else self.kv_cache_dtype
        return allocate_kv_cache(self.dims, num_blocks, self.block_size, kv_cache_dtype=fmt, dtype=self.dtype,
                                 device=self.device if device is None else device)

    def extra_repr(self) -> str:
        d = self.dims
        return (f"num_heads={d.num_heads}, kv_lora_rank={d.kv_lora_rank}, qk_nope_head_dim={d.qk_nope_head_dim}, "
                f"qk_rope_head_dim={d.qk_rope_head_dim}, v_head_dim={d.v_head_dim}, scale={self.scale:.6g}, "
                f"block_size={self.block_size}, kv_cache_dtype={dtype_name(self.kv_cache_dtype)}, "
                f"backends={self.backends()}")

    def _decode_by_tokens(self, dims: MLADims, block_size: int, forced: str | None) -> tuple:
        """((low, high, backend, impl), ...): the ranges of a step's decode rows (up to max_num_seqs) whose
        backend, chosen by the registry for that batch, is not `decode_backend`, each with its implementation
        (made and its workspace reserved here, before any capture)."""
        from mla_multi.registry import decode_config, default_registry

        config = decode_config(dims, self.dtype, self.kv_cache_dtype, block_size, platform=self.platform)
        ranges = default_registry.by_num_tokens("decode", config, self.platform, forced, max_tokens=self.max_num_seqs)
        impls = {self.decode_backend: self.decode_impl}
        others = []
        for low, high, backend in ranges:
            if backend is self.decode_backend:
                continue
            impl = impls.get(backend)
            if impl is None:
                impl = impls[backend] = backend.get_decode_impl_cls()(
                    dims.num_heads, self.scale, dims.kv_lora_rank, dims.qk_rope_head_dim, self.kv_cache_dtype,
                    block_size, self.device,
                )
                impl.reserve_workspace(self.workspace, self.max_num_seqs, self.max_model_len, dtype=self.dtype)
            others.append((low, high, backend, impl))
        return tuple(others)

    def _step_decode(self, metadata: CommonAttentionMetadata, num_decodes: int) -> tuple:
        """(backend, impl) of this step's decodes: the range of `_decode_ranges` its decode rows fall in, else
        the layer's `decode_backend`."""
        if self._decode_ranges:
            rows = self._decode_inputs(metadata, num_decodes)[0].shape[0]
            for low, high, backend, impl in self._decode_ranges:
                if low <= rows and (high is None or rows <= high):
                    return backend, impl
        return self.decode_backend, self.decode_impl

    def _init_sparse(self, dims: MLADims, sparse_backend: str | None, dcp) -> None:
        """The sparse phase's backend (sparse mode needs no dense backend and no workspace reservation)."""
        from mla_multi.registry import select_sparse_backend

        if dcp is not None:
            raise ValueError("dcp with sparse_topk: decode context parallelism of sparse MLA is not supported; "
                             "accepted: dcp=None")
        self.sparse_backend = select_sparse_backend(
            "sparse_decode", dims, self.dtype, self.kv_cache_dtype, self.sparse_topk, backend=sparse_backend
        )
        self.sparse_impl = self.sparse_backend.get_impl_cls()(
            dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, self.device
        )
        # unless forced, each step's backend is chosen for its token count (`registry.few_sparse_tokens`: a
        # step of few tokens may go to another backend); the one a single-token step takes, where it differs
        self._sparse_forced = sparse_backend
        self.sparse_few_tokens_backend = select_sparse_backend(
            "sparse_decode", dims, self.dtype, self.kv_cache_dtype, self.sparse_topk, backend=sparse_backend,
            num_tokens=1,
        )
        self.prefill_backend = self.decode_backend = None
        self._decode_ranges = ()

    def _context_prefill(self, dims: MLADims, forced: str | None, impl_args: tuple):
        """(backend, impl) for steps whose prefills have cached context. The chosen prefill backend, unless
        it was not forced, reads K with its rotary part repeated per head, and TRITON runs here taking that
        part apart and merging the chunks inside its kernel (the first backend of the platform's order whose
        impl declares `takes_split_key` and `merges_chunks`): a chunk's K is then a third smaller and needs
        no merge launch. Measured on an H100, N = 128 (bench/RESULTS.md, "Layer steps after the host-path
        work"): 16 prefills x 512 after 3584 cached, TRITON 0.88x FLASHINFER's time through the layer,
        while without context FLASHINFER's kernel is the faster (0.77x TRITON's time at 1 x 8192)."""
        from mla_multi import envs
        from mla_multi.registry import default_registry, prefill_config

        chosen = (self.prefill_backend, self.prefill_impl)
        if forced is not None or envs.MLA_MULTI_PREFILL_BACKEND or self.prefill_impl.takes_split_key:
            return chosen
        # the first backend of the platform's prefill order that runs here and offers both
        for row in default_registry.explain("prefill", prefill_config(dims, self.dtype), self.platform):
            if not row["available"] or row["name"] == self.prefill_backend.name:
                continue
            backend = default_registry.load("prefill", row["name"])
            impl = backend.get_prefill_impl_cls()(*impl_args)
            if impl.takes_split_key and impl.merges_chunks:
                return backend, impl
        return chosen

    def _short_prefills(self) -> bool:
        """Whether steps without context whose prefills are all short (`SHORT_PREFILL_TOKENS`) also go to the
        context backend: where its impl says its kernel is the faster there (`serves_short_prefills`: TRITON
        on sm_90's prefill kernel). Through the layer on an H200, N = 128 (bench/RESULTS.md, "Prefill on
        sm_90: the overlap inside each warpgroup, ..."): 16 prefills x 512, FLASHINFER 1.21x TRITON's time
        (its path repeats the rotary key per head); 1 x 8192, FLASHINFER's faster kernel wins (0.95x
        TRITON's time)."""
        if self.context_prefill_impl is self.prefill_impl:
            return False
        return self.context_prefill_impl.serves_short_prefills(self.dtype)

    def _step_prefill(self, metadata: CommonAttentionMetadata):
        """(backend, impl) of this step's prefills: `context_prefill_*` where any prefill has cached
        context, or where every prefill is short and `short_prefills_on_context_backend` holds; else the
        chosen prefill backend."""
        if self.context_prefill_impl is self.prefill_impl:
            return self.prefill_backend, self.prefill_impl
        if self.short_prefills_on_context_backend and metadata.max_query_len <= SHORT_PREFILL_TOKENS:
            return self.context_prefill_backend, self.context_prefill_impl
        has_context = metadata.backend_plans.get("prefill_has_context")
        if has_context is None:
            num_decodes = self._split(metadata)[0]
            has_context = metadata.backend_plans["prefill_has_context"] = any(
                metadata.host_lengths()[1][num_decodes:]
            )
        if has_context:
            return self.context_prefill_backend, self.context_prefill_impl
        return self.prefill_backend, self.prefill_impl

    @property
    def W_UK_T(self) -> torch.Tensor:
        """[N, P, Lkv], vLLM's name for the absorption weight (`W_UK`, a view of `kv_b_proj_weight`)."""
        return self._absorbed().w_uk

    def lock_workspace(self) -> None:
        """Forbid growth of the workspace (shared by every layer of the device: locking it once locks it for
        all); call before capturing CUDA graphs."""
        self.workspace.lock()

    def _gather_spec(self, num_tokens: int):
        return ((num_tokens, self.dims.kv_lora_rank + self.dims.qk_rope_head_dim), self.dtype)

    def backends(self) -> dict[str, str]:
        if self.sparse_topk is not None:
            names = {"sparse_decode": self.sparse_backend.name}
            if self.sparse_few_tokens_backend is not self.sparse_backend:  # steps of few tokens
                names["sparse_decode_few_tokens"] = self.sparse_few_tokens_backend.name
            return names
        names = {"prefill": self.prefill_backend.name, "decode": self.decode_backend.name}
        for low, high, backend, _ in self._decode_ranges:  # steps of these many decode rows
            names[f"decode_{low}_to_{high}_rows"] = backend.name
        if self.context_prefill_backend is not self.prefill_backend:
            names["prefill_context"] = self.context_prefill_backend.name  # steps whose prefills have context
            if self.short_prefills_on_context_backend:  # and steps whose prefills are all short
                names["prefill_short"] = self.context_prefill_backend.name
        return names

    # ------------------------------------------------------------------ planning
    def plan(self, metadata: CommonAttentionMetadata, *, cuda_graph: bool = False) -> None:
        """Plan this layer's backends for the batch of `metadata`, once per step.

        Backends with a planning stage (FLASHINFER) read the lengths on the host
        here; the plans are kept in `metadata.backend_plans`, so every layer of
        the same configuration only runs. `forward` plans on its own when this
        was not called, except under CUDA-graph capture: call it with
        `cuda_graph=True` before capturing, and again (with the new lengths)
        before each replay. Backends without a planning stage ignore it.
        It also makes `metadata` the current step of the layer's device, which
        the compiled forward runs (`mla_multi.set_step`).
        """
        if not isinstance(metadata, CommonAttentionMetadata):
            raise ValueError(f"metadata={type(metadata).__name__}; accepted: a CommonAttentionMetadata")
        from mla_multi import library

        library.set_current_metadata(self.device, metadata)  # the step a compiled forward runs
        if self.sparse_topk is not None:
            self._token_requests(metadata)
            return
        num_decodes, num_prefills, _, _ = self._split(metadata)
        if num_decodes > 0:
            self._decode_inputs(metadata, num_decodes)
            plan = self._decode_plan(metadata, num_decodes, cuda_graph=cuda_graph)
            step_key = self._decode_step_key(metadata, num_decodes)
            step = metadata.backend_plans.get(step_key)
            if step is not None and step[2].get("plan") is not plan:  # replanned: made again from the new plan
                del metadata.backend_plans[step_key]
            self._decode_step(metadata, num_decodes)  # the split count too: every forward only launches
        if num_prefills > 0:
            self._prefill_metadata(metadata)

    def _decode_rows(self, metadata: CommonAttentionMetadata, num_decodes: int) -> torch.Tensor | None:
        """Indices of the decode requests that carry a query token (padding rows carry none); None where all
        of them do."""
        query_lens = metadata.host_lengths()[0][:num_decodes]
        if 0 not in query_lens:
            return None
        return torch.tensor([i for i, n in enumerate(query_lens) if n > 0], dtype=torch.int64)

    @staticmethod
    def _split(metadata: CommonAttentionMetadata) -> tuple[int, int, int, int]:
        """`split_decodes_and_prefills` of the step, computed once."""
        found = metadata.backend_plans.get("split")
        if found is None:
            found = metadata.backend_plans["split"] = split_decodes_and_prefills(metadata)
        return found

    def _decode_inputs(self, metadata: CommonAttentionMetadata, num_decodes: int):
        """(block_table, seq_lens) of the decode requests that carry a query token, once per step."""
        key = ("decode_inputs", num_decodes)
        found = metadata.backend_plans.get(key)
        if found is None:
            # Decode rows with no new token (padding) carry no query.
            rows = self._decode_rows(metadata, num_decodes)
            if rows is None:
                found = metadata.block_table[:num_decodes], metadata.seq_lens[:num_decodes]
            else:
                index = to_device(rows, metadata.block_table.device)
                found = metadata.block_table[index], metadata.seq_lens[index]
            metadata.backend_plans[key] = found
        return found

    def _decode_plan(self, metadata: CommonAttentionMetadata, num_decodes: int, cuda_graph: bool = False):
        backend, impl = self._step_decode(metadata, num_decodes)
        if not backend.requires_plan:
            return None
        key = ("decode",) + impl.plan_key() + (self.dtype,)
        if self.dcp is not None:  # planned for the local lengths
            key += ("dcp", self.dcp.world_size, self.dcp.interleave)
        plan = metadata.backend_plans.get(key)
        if plan is None or (cuda_graph and not plan.cuda_graph):
            rows = self._decode_rows(metadata, num_decodes)
            block_table = metadata.block_table[:num_decodes]
            seq_lens_cpu = metadata.seq_lens_cpu[:num_decodes]
            if rows is not None:
                block_table = block_table[to_device(rows, block_table.device)]
                seq_lens_cpu = seq_lens_cpu[rows]
            if self.dcp is not None:
                # Under DCP the backend decodes this rank's share of each sequence.
                seq_lens_cpu = self.dcp.local_seq_lens(seq_lens_cpu)
            plan = impl.plan(
                seq_lens_cpu, block_table, 1,
                k_scale=self.k_scale_value, cuda_graph=cuda_graph,
            )
            metadata.backend_plans[key] = plan
        return plan

    def _chunk_tokens(self, metadata: CommonAttentionMetadata, impl) -> int:
        """Context rows gathered per chunk by `impl`: `workspace_tokens`, or, for a backend that reads K whole
        (its rotary part repeated per head: N x (P + R) values a row beside V's N x V) and returns each chunk's
        result for a merge, the share of it whose K and V, with the results beside them (each chunk's, and
        the new tokens' unless the backend writes them into the output: N x V values a new token each, plus
        float32 LSEs), take no more than `workspace_tokens` rows of up-projected K and V (N x (P + V) values a
        row), the bound of a step's peak that TRITON's path keeps (bench/RESULTS.md). Never less than half of
        `workspace_tokens`' K and V (many small chunks cost time, and precision in their merges), nor one
        block per prefill with context."""
        if impl.takes_split_key:
            return self.workspace_tokens
        found = metadata.backend_plans.get("prefill_chunk_counts")
        if found is None:
            num_decodes, _, num_decode_tokens, _ = self._split(metadata)
            with_context = sum(1 for n in metadata.host_lengths()[1][num_decodes:] if n > 0)
            found = metadata.backend_plans["prefill_chunk_counts"] = (
                with_context, metadata.num_actual_tokens - num_decode_tokens
            )
        with_context, new_tokens = found
        d = self.dims
        split_kv, whole_kv = d.qk_nope_head_dim + d.v_head_dim, d.qk_head_dim + d.v_head_dim
        results = (1 if impl.takes_out else 2) * d.v_head_dim + 8
        room = self.workspace_tokens * split_kv - new_tokens * results
        rows = max(room // whole_kv, self.workspace_tokens * split_kv // whole_kv // 2)
        rows = max(rows // self.block_size * self.block_size, with_context * self.block_size)
        return min(rows, self.workspace_tokens)

    def _prefill_metadata(self, metadata: CommonAttentionMetadata):
        """The prefill metadata of the batch, built once per step (and planned, for backends that plan)."""
        backend, impl = self._step_prefill(metadata)
        metadata_cls = backend.get_prefill_metadata_cls()
        chunk_tokens = self._chunk_tokens(metadata, impl)
        key = ("prefill_metadata", chunk_tokens, metadata_cls)
        prefill_metadata = metadata.backend_plans.get(key)
        if prefill_metadata is None:
            prefill_metadata = build_prefill_metadata(metadata, chunk_tokens, metadata_cls, self._split(metadata))
            metadata.backend_plans[key] = prefill_metadata
        if backend.requires_plan:
            plan_key = impl.plan_key() + (self.dtype,)
            if plan_key not in prefill_metadata.backend_plans:
                prefill_metadata.backend_plans[plan_key] = impl.plan(prefill_metadata, self.dtype)
        return prefill_metadata

    # ------------------------------------------------------------------ forward
    def _check_step(self, q, kv_c_normed, k_pe, kv_cache, metadata, output) -> torch.Tensor:
        """Check a step's inputs against the layer (shapes, dtypes, device, cache layout); the output to write."""
        d = self.dims
        n, p, r, v, lkv = d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
        if not isinstance(metadata, CommonAttentionMetadata):
            raise ValueError(f"metadata={type(metadata).__name__}; accepted: a CommonAttentionMetadata")
        tokens = metadata.num_actual_tokens
        dtype, device = self.dtype, self.device
        width = FP8_DS_MLA_BYTES if self.kv_cache_dtype == torch.uint8 else lkv + r
        # every layer runs these on every call: one comparison a tensor, the messages only where one fails
        checks.expect_tensor("q", q, (tokens, n, p + r), dtype, device)
        checks.expect_tensor("kv_c_normed", kv_c_normed, (tokens, lkv), dtype, device)
        checks.expect_tensor("k_pe", k_pe, (tokens, r), dtype, device)
        checks.expect_tensor("kv_cache", kv_cache, (None, self.block_size, width), self.kv_cache_dtype, device)
        if metadata.block_size != self.block_size:
            raise ValueError(f"metadata.block_size={metadata.block_size}; this layer's block_size is {self.block_size}")
        return _step_output(output, tokens, n * v, dtype, device)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CommonAttentionMetadata,
        output: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output [T, N * V] for the batch described by `metadata`.

        Sparse mode (`sparse_topk`): `topk_indices` int32 [T, k <= sparse_topk]
        gives each new token the positions inside its own request that it
        attends to (-1 = none), as an indexer produces them.

        q [T, N, P + R]; kv_c_normed [T, Lkv]; k_pe [T, R] (rotary applied);
        kv_cache [num_blocks, block_size, Lkv + R] of the layer's kv_cache_dtype
        (the conventions: the class docstring). The tokens come request by
        request in the metadata's order: decodes first, or the caller's own
        order where the metadata was built with ``reorder=True``. Calling the
        module (``layer(q, kv_c_normed, k_pe, kv_cache, metadata)``) runs this.

        Under grad mode it runs under `torch.no_grad()` (inference only: a
        backward through its output raises RuntimeError naming
        `torch.inference_mode()`); the cache never joins the autograd graph.

        Under `torch.compile` the whole forward is one opaque op,
        ``torch.ops.mla_multi.mla_attention`` (``mla_sparse_attention`` in sparse
        mode, with topk_indices), that runs this eager forward with
        the current step of q's device (set by `plan` or `mla_multi.set_step`);
        `metadata` is not read there and may be None.
        """
        if torch.compiler.is_compiling():
            if output is None:
                output = q.new_empty((q.shape[0], self.dims.num_heads * self.dims.v_head_dim))
            if self.sparse_topk is not None:
                if topk_indices is None:
                    raise ValueError("this MLAAttention is sparse (sparse_topk): forward needs topk_indices, int32 "
                                     "[T, <= sparse_topk] positions inside each token's request")
                torch.ops.mla_multi.mla_sparse_attention(q, kv_c_normed, k_pe, kv_cache, output, topk_indices,
                                                         self.layer_id)
            else:
                torch.ops.mla_multi.mla_attention(q, kv_c_normed, k_pe, kv_cache, output, self.layer_id)
            return output
        if torch.is_grad_enabled():
            # inference only (the class docstring): under grad mode (transformers' default outside generate) the
            # cache is written and the output computed without autograd, and a backward says why it cannot be
            with torch.no_grad():
                out = self._forward_eager(q, kv_c_normed, k_pe, kv_cache, metadata, output, topk_indices)
            weight = self._parameters["kv_b_proj_weight"]
            if q.requires_grad or kv_c_normed.requires_grad or k_pe.requires_grad or weight.requires_grad:
                out = _InferenceOnly.apply(out, q, kv_c_normed, k_pe, weight)
            return out
        return self._forward_eager(q, kv_c_normed, k_pe, kv_cache, metadata, output, topk_indices)

    def _forward_eager(self, q, kv_c_normed, k_pe, kv_cache, metadata, output, topk_indices) -> torch.Tensor:
        order = metadata.batch_order if isinstance(metadata, CommonAttentionMetadata) else None
        if order is not None and not order.identity:
            return self._forward_in_caller_order(order, q, kv_c_normed, k_pe, kv_cache, metadata, output,
                                                 topk_indices)
        return self._forward_step(q, kv_c_normed, k_pe, kv_cache, metadata, output, topk_indices)

    def _forward_in_caller_order(self, order, q, kv_c_normed, k_pe, kv_cache, metadata, output,
                                 topk_indices) -> torch.Tensor:
        """A step whose metadata was built with ``from_lengths(..., reorder=True)``: its requests run decodes
        first, the caller's tensors are in the caller's order. The step's tokens are gathered into the step's
        order (q, kv_c_normed, k_pe, topk_indices: one gather each) and its output written back into the
        caller's rows (one scatter); a caller that orders its batch itself (decodes first) pays none of it."""
        result = self._check_step(q, kv_c_normed, k_pe, kv_cache, metadata, output)  # in the caller's order
        step_out = self._forward_step(
            order.to_step(q), order.to_step(kv_c_normed), order.to_step(k_pe), kv_cache, metadata, None,
            None if topk_indices is None else order.to_step(topk_indices),
        )
        result.index_copy_(0, order.token_index, step_out)
        return result

    def _forward_step(self, q, kv_c_normed, k_pe, kv_cache, metadata, output, topk_indices) -> torch.Tensor:
        """The forward of a step in the metadata's order (decodes first)."""
        if self.sparse_topk is not None:
            return self._forward_sparse(q, kv_c_normed, k_pe, kv_cache, metadata, output, topk_indices)
        if topk_indices is not None:
            raise ValueError("topk_indices given to a dense MLAAttention; accepted: None (or build it with sparse_topk)")
        output = self._check_step(q, kv_c_normed, k_pe, kv_cache, metadata, output)
        num_decodes, num_prefills, num_decode_tokens, _ = self._split(metadata)
        if num_prefills == 0 and 0 < num_decode_tokens <= MAX_PRODUCT_TOKENS:
            prologue = self._absorbed().prologue
            if (prologue is not None and q.stride(2) == 1 and kv_c_normed.stride(1) == 1 and k_pe.stride(1) == 1
                    and kv_cache.is_contiguous() and metadata.slot_mapping.dtype == torch.int64
                    and metadata.slot_mapping.shape[0] == q.shape[0] and not checks.data_checks_enabled(self.device)):
                # a decode step of a few tokens: the cache write and the W_UK product in one launch (the cache
                # op's rules: `kernels.absorb`); with the data checks on, the op's checks run instead
                ql_nope = prologue.prologue(q, kv_c_normed, k_pe, kv_cache, metadata.slot_mapping, self.k_scale,
                                            self._error_flag, self.workspace.side)
                self._forward_decode(q, kv_cache, metadata, num_decodes, num_decode_tokens, output, ql_nope)
                return output
        slot_mapping = metadata.slot_mapping if self.dcp is None else self.dcp.local_slot_mapping(metadata)
        ops.concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping, scale=self.k_scale)

        if num_decode_tokens > 0:
            self._forward_decode(q, kv_cache, metadata, num_decodes, num_decode_tokens, output)
        if num_prefills > 0:
            self._forward_prefill(q, kv_c_normed, k_pe, kv_cache, metadata, num_decode_tokens, output)
        return output

    # ------------------------------------------------------------------ sparse mode
    def _token_requests(self, metadata: CommonAttentionMetadata) -> torch.Tensor:
        """The request row of every new token of the step [T] int64 on the device (made once per step)."""
        found = metadata.backend_plans.get("token_requests")
        if found is None:
            query_lens = metadata.query_lens_cpu.long()
            found = to_device(torch.repeat_interleave(torch.arange(len(query_lens)), query_lens),
                              metadata.block_table.device)
            metadata.backend_plans["token_requests"] = found
        return found

    def _positions_to_slots(self, positions: torch.Tensor, metadata: CommonAttentionMetadata) -> torch.Tensor:
        """Positions inside each token's request -> cache slots (int32); -1 stays -1. A position outside
        [-1, seq_len) of its request becomes an index past the cache: bad data for the sparse decode (a
        ValueError with the data checks on, NaN rows and the error flag without)."""
        requests = self._token_requests(metadata)
        table = metadata.block_table
        num_slots_past = 2**31 - 1
        pos = positions.long()
        seq_lens = metadata.seq_lens.long()[requests].unsqueeze(1)
        valid = (pos >= 0) & (pos < seq_lens)
        safe = torch.where(valid, pos, torch.zeros_like(pos))
        blocks = table.long()[requests.unsqueeze(1), safe // self.block_size]
        slots = blocks * self.block_size + safe % self.block_size
        slots = torch.where(valid, slots, torch.where(pos == -1, torch.full_like(pos, -1),
                                                       torch.full_like(pos, num_slots_past)))
        return slots.to(torch.int32)

    def _forward_sparse(self, q, kv_c_normed, k_pe, kv_cache, metadata, output, topk_indices) -> torch.Tensor:
        d = self.dims
        p = d.qk_nope_head_dim
        output = self._check_step(q, kv_c_normed, k_pe, kv_cache, metadata, output)
        tokens = metadata.num_actual_tokens
        if topk_indices is None:
            raise ValueError("this MLAAttention is sparse (sparse_topk): forward needs topk_indices, int32 "
                             f"[{tokens}, <= {self.sparse_topk}] positions inside each token's request")
        checks.check_tensor("topk_indices", topk_indices, ndim=2, dtypes=(torch.int32,), shape=(tokens, None),
                            device=self.device)
        if topk_indices.shape[1] > self.sparse_topk:
            raise ValueError(f"topk_indices has {topk_indices.shape[1]} entries a token; accepted: at most "
                             f"sparse_topk={self.sparse_topk}")
        if checks.data_checks_enabled(self.device):
            positions = topk_indices.detach().cpu().long()
            requests = self._token_requests(metadata).cpu()
            limits = metadata.seq_lens_cpu.long()[requests].unsqueeze(1)
            bad = positions[(positions < -1) | (positions >= limits)]
            if bad.numel():
                raise ValueError(f"topk_indices hold positions {bad[:8].tolist()} outside their requests; accepted: "
                                 "-1 (none) or a position in [0, seq_len) of the token's request")
        ops.concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, metadata.slot_mapping, scale=self.k_scale)
        slots = self._positions_to_slots(topk_indices, metadata)
        q_nope, q_pe = q[..., :p], q[..., p:]
        # every token, prefill or decode, attends in the latent space: absorb W_UK into the query
        ql_nope = torch.bmm(q_nope.transpose(0, 1), self._absorbed().w_uk).transpose(0, 1)
        # one [T, N, 576] buffer, read in place by kernels that take the joined query
        q_latent = torch.cat([ql_nope, q_pe], dim=-1)
        latent = ops.mla_sparse_decode(
            q_latent[..., : d.kv_lora_rank], q_latent[..., d.kv_lora_rank:], kv_cache, slots, self.scale,
            k_scale=self.k_scale, backend=self._sparse_forced,
        )
        self._up_project_latent(latent, output, tokens)
        return output

    def _decode_step(self, metadata: CommonAttentionMetadata, num_decodes: int) -> tuple:
        """(block_table, seq_lens, keywords, impl) of the step's decodes, shared by every layer of this decode
        configuration: the keywords hold its plan (backends that plan) or split count (TRITON), impl is the
        step's implementation (`_step_decode`). Looked up once per step, so that every later layer only
        launches; `plan` drops it when it replans."""
        key = self._decode_step_key(metadata, num_decodes)
        found = metadata.backend_plans.get(key)
        if found is not None:
            return found
        block_table, seq_lens = self._decode_inputs(metadata, num_decodes)
        _, impl = self._step_decode(metadata, num_decodes)
        plan = self._decode_plan(metadata, num_decodes)
        keywords = {} if plan is None else {"plan": plan}
        if impl.chooses_num_kv_splits:
            # the split count of the step, chosen by its first layer (under DCP for this rank's share: the
            # bound every rank's kernels see, so that the collectives meet equal shapes)
            bound = metadata.max_seq_len if self.dcp is None else self.dcp.local_num_tokens(metadata.max_seq_len, rank=0)
            splits_key = ("decode_splits", impl.num_heads, self.kv_cache_dtype, impl.max_partial_rows, bound)
            splits = metadata.backend_plans.get(splits_key)
            if splits is None:
                splits = metadata.backend_plans[splits_key] = impl.choose_num_kv_splits(
                    block_table.shape[0], 1, bound, self.kv_cache_dtype
                )
            keywords["num_kv_splits"] = splits
            keywords["step_plans"] = metadata.backend_plans
        found = metadata.backend_plans[key] = (block_table, seq_lens, keywords, impl)
        return found

    @functools.cached_property
    def _decode_step_key_base(self) -> tuple:
        """What makes layers' decodes share a step's lookup (`_decode_step`): the same backend, plan key,
        dtypes, heads, reservation and DCP group shape."""
        plan_key = self.decode_impl.plan_key() if self.decode_backend.requires_plan else None
        return ("decode step", self.decode_backend.name, plan_key, self.dtype, self.kv_cache_dtype,
                self.decode_impl.num_heads, self.decode_impl.max_partial_rows,
                None if self.dcp is None else (self.dcp.world_size, self.dcp.interleave))

    def _decode_step_key(self, metadata: CommonAttentionMetadata, num_decodes: int) -> tuple:
        return self._decode_step_key_base + (num_decodes, self._step_decode(metadata, num_decodes)[0].name)

    def _up_project_latent(self, latent: torch.Tensor, output: torch.Tensor, tokens: int) -> None:
        """output[:tokens] = latent [tokens, N, Lkv] up-projected with W_UV ([N, Lkv] x [N, Lkv, V] per head),
        written by the product itself (no copy, no temporary): the Triton launch for a few tokens
        (`kernels.absorb.DecodeProducts`), else `torch.bmm`."""
        views = self._absorbed()
        products = views.products
        if products is not None and tokens <= MAX_PRODUCT_TOKENS and latent.stride(2) == 1:
            products.up_project(latent, output)  # (the rows by their strides: no view)
            return
        n, v = self.dims.num_heads, self.dims.v_head_dim
        # the product's [N, tokens, V] view of the rows (their columns contiguous: `_check_step`): one view
        heads_first = output.as_strided((n, tokens, v), (v, output.stride(0), 1), output.storage_offset())
        torch.bmm(latent.transpose(0, 1), views.w_uv_t, out=heads_first)

    def _forward_decode(self, q, kv_cache, metadata, num_decodes, num_decode_tokens, output, ql_nope=None) -> None:
        d = self.dims
        p = d.qk_nope_head_dim
        block_table, seq_lens, keywords, impl = self._decode_step(metadata, num_decodes)
        if self.dcp is None:
            # the data checks of mm.ops.mla_decode (under DCP the table holds this rank's blocks only)
            checks.check_block_table_data(block_table, seq_lens, kv_cache.shape[0], self.block_size)
            forward_mqa = impl.forward_mqa
        else:
            forward_mqa = functools.partial(self.dcp.forward_mqa, impl)
        # the TRITON kernels take the query's strides as they are (under DCP the query is gathered anew)
        contiguous_pe = self.dcp is not None or "num_kv_splits" not in keywords
        # Absorb W_UK into the query: [N, B, P] x [N, P, Lkv] -> [N, B, Lkv], read by the kernels as [B, N, Lkv];
        # the decode tokens' nope part as [N, B, P] and their rotary part: one view each
        s0, s1, s2 = q.stride()
        offset = q.storage_offset()
        q_pe = q.as_strided((num_decode_tokens, d.num_heads, d.qk_rope_head_dim), (s0, s1, s2), offset + p * s2)
        if ql_nope is None:  # else made with the step's cache write (`_forward_step`)
            q_nope_t = q.as_strided((d.num_heads, num_decode_tokens, p), (s1, s0, s2), offset)
            ql_nope = torch.bmm(q_nope_t, self._absorbed().w_uk).transpose(0, 1)
        latent_out, _ = forward_mqa(
            ql_nope, q_pe.contiguous() if contiguous_pe else q_pe, kv_cache, block_table, seq_lens,
            k_scale=self.k_scale, workspace_manager=self.workspace, max_seq_len=metadata.max_seq_len, **keywords,
        )
        self._up_project_latent(latent_out, output, num_decode_tokens)

    def _up_project(self, kv_c: torch.Tensor, k_pe: torch.Tensor, impl=None):
        """Latent rows -> (k, v, k_pe): per-head k [T, N, P + R] and v [T, N, V], both contiguous, and None;
        or, where the prefill backend takes the shared rotary key apart (`takes_split_key`), k [T, N, P] and
        the rotary rows k_pe [T, R] as given (never repeated per head: a fifth less for MLA).

        V and K's nope part each come from one batched product written into
        them, so a chunk costs K and V alone, never the [T, N, P + V] product
        besides them. The products read W_UK and W_UV as the views of
        `kv_b_proj_weight` they are (per head, rows strided by P + V rows):
        the latent rows broadcast over the heads (batch stride 0), each head's
        product written by cuBLAS straight into its columns, no temporary.
        """
        d = self.dims
        n, p, r, v = d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        views = self._absorbed()
        w_uk, w_uv = views.w_uk, views.w_uv
        tokens = kv_c.shape[0]
        latent = kv_c.expand(n, tokens, kv_c.shape[1])
        value = torch.empty(tokens, n, v, dtype=kv_c.dtype, device=kv_c.device)
        torch.bmm(latent, w_uv.transpose(1, 2), out=value.transpose(0, 1))
        if (self.prefill_impl if impl is None else impl).takes_split_key:
            key = torch.empty(tokens, n, p, dtype=kv_c.dtype, device=kv_c.device)
            torch.bmm(latent, w_uk.transpose(1, 2), out=key.transpose(0, 1))
            return key, value, k_pe
        key = torch.empty(tokens, n, p + r, dtype=value.dtype, device=value.device)
        # per head, the product written straight into K's nope columns (its rows strided by the whole key)
        torch.bmm(latent, w_uk.transpose(1, 2), out=key.transpose(0, 1).narrow(2, 0, p))
        key[:, :, p:] = k_pe.unsqueeze(1)
        return key, value, None

    @staticmethod
    def _prefill_query(q_prefill: torch.Tensor) -> torch.Tensor:
        """The prefill rows of q as every prefill call of the step reads them: q itself where each token's heads
        lie side by side in its row (`mla_multi.kernels.rows_of_heads`), else a contiguous copy made once for
        the new tokens' call and every context chunk's. A query whose heads lie T rows apart (transformers'
        [T, N, P + R] view of [1, N, T, P + R]) cannot be read by the TMA descriptors of the sm_90 prefill
        kernel, which `prefill.varlen_attention` would then skip for the slower Triton kernel."""
        return q_prefill if rows_of_heads(q_prefill) else q_prefill.contiguous()

    def _forward_prefill(self, q, kv_c_normed, k_pe, kv_cache, metadata, num_decode_tokens, output) -> None:
        from mla_multi.kernels.merge import merge_attn_states as merge_kernel

        d = self.dims
        prefill_metadata = self._prefill_metadata(metadata)
        _, impl = self._step_prefill(metadata)
        q_prefill = self._prefill_query(q[num_decode_tokens:])
        key, value, key_pe = self._up_project(kv_c_normed[num_decode_tokens:], k_pe[num_decode_tokens:], impl)
        split = {} if key_pe is None else {"k_pe": key_pe}
        chunked = prefill_metadata.chunked_context
        # where the backend writes into a given buffer (and, with context, the merge kernel runs), the new
        # tokens' result goes straight into the step's output and the merges happen in place: no [T, N, V]
        # temporaries beside a chunk's K and V, no copy into the output
        in_place = (impl.takes_out and output.is_contiguous()
                    and ops._use_triton(q_prefill))
        if in_place:
            split["out"] = output[num_decode_tokens:].view(q_prefill.shape[0], d.num_heads, d.v_head_dim)
        if chunked is None:
            out = impl.run_prefill_new_tokens(prefill_metadata, q_prefill, key, value, False, **split)
            if in_place:
                return
        else:
            suffix_out, suffix_lse = impl.run_prefill_new_tokens(
                prefill_metadata, q_prefill, key, value, True, **split
            )
            del key, value, split  # the chunks' K and V take their place: one chunk's at a time
            # where the kernel merges, each chunk's result goes into the output as it is computed
            merges = in_place and impl.merges_chunks
            merge_into = (suffix_out, suffix_lse) if merges else None
            # elsewhere on a GPU each chunk's result is merged into the new tokens' as it comes, in place, the
            # last merge writing the step's output: one chunk's result at a time beside them, no copy
            merge_in_place = output.is_contiguous() and ops._use_triton(q_prefill)
            if merge_in_place:
                out_view = output[num_decode_tokens:].view(q_prefill.shape[0], d.num_heads, d.v_head_dim)
            context_out = context_lse = None
            for chunk_idx in range(chunked.num_chunks):
                if self.dcp is not None:
                    rows = self.dcp.gather_context_chunk(
                        kv_cache, prefill_metadata.block_table, chunked.starts_cpu[chunk_idx],
                        chunked.seq_lens_cpu[chunk_idx], scale=self.k_scale, out_dtype=self.dtype,
                    )
                else:
                    (gathered,) = self.workspace.get_simultaneous(self._gather_spec(chunked.seq_tot[chunk_idx]))
                    rows = ops.gather_cache(
                        kv_cache,
                        prefill_metadata.block_table,
                        chunked.starts[chunk_idx],
                        chunked.seq_lens[chunk_idx],
                        scale=self.k_scale,
                        out_dtype=self.dtype,
                        cu_seq_lens=chunked.cu_seq_lens[chunk_idx],
                        num_tokens=chunked.seq_tot[chunk_idx],
                        out=gathered,
                    )
                chunk_key, chunk_value, chunk_pe = self._up_project(rows[:, : d.kv_lora_rank],
                                                                    rows[:, d.kv_lora_rank :], impl)
                chunk_extra = {} if chunk_pe is None else {"k_pe": chunk_pe}
                if merge_into is not None:
                    chunk_extra["merge_into"] = merge_into
                chunk_out, chunk_lse = impl.run_prefill_context_chunk(
                    prefill_metadata, chunk_idx, q_prefill, chunk_key, chunk_value, **chunk_extra
                )
                del chunk_key, chunk_value, chunk_pe
                if merge_into is not None:
                    continue
                if merge_in_place:  # each element read before it is written
                    if chunk_idx == chunked.num_chunks - 1:
                        merge_kernel(suffix_out, suffix_lse, chunk_out, chunk_lse, out_view, return_lse=False)
                    else:
                        merge_kernel(suffix_out, suffix_lse, chunk_out, chunk_lse, suffix_out, suffix_lse)
                elif context_out is None:
                    context_out, context_lse = chunk_out, chunk_lse
                else:
                    context_out, context_lse = ops.merge_attn_states(context_out, context_lse, chunk_out, chunk_lse)
                del chunk_out, chunk_lse
            if merge_into is not None or merge_in_place:  # every chunk is already in the output
                return
            out, _ = ops.merge_attn_states(context_out, context_lse, suffix_out, suffix_lse)
        output[num_decode_tokens:] = out.reshape(out.shape[0], d.num_heads * d.v_head_dim)


# ---------------------------------------------------------------------------------------------------- DeepSeek-V4
V4_WIDTH = 512  # d_qk = d_v: 448 latent + 64 RoPE dims
V4_ROPE = 64
V4_MAIN_FORMATS = ("fp8_ds_mla_v4", "fp8_ds_mla_v41")
# the most new tokens a decode request may carry (MTP): FlashMLA's sparse decode takes s_q up to this
V4_MAX_DECODE_QUERY_LEN = 8


class MLAAttentionV4(torch.nn.Module):
    """One DeepSeek-V4 attention layer's attention (`torch.nn.Module`): sparse MLA under the V4 contract.

    Per step, for every new token t (decodes and prefills alike) one softmax runs over two KV segments of
    512-wide rows (448 latent + 64 RoPE dims; the key and the value are the whole row: d_qk = d_v = 512):

    * the top-k segment: the rows of the main cache `kv_cache` named by `topk_indices[t]` (the model's
      compressed tokens its indexer selected, or all of them), in `kv_format` ("fp8_ds_mla_v4", 584 bytes a
      token, or V4.1's "fp8_ds_mla_v41", 528);
    * the window segment: the `window_size` most recent tokens of t's request, t itself included (positions
      max(0, p - window_size + 1) .. p), from `window_cache`, in `window_kv_format` (the main cache's format,
      or "fp4_ds_mla_v41", 288 bytes, beside "fp8_ds_mla_v41"). Their indices are built by the layer, once per
      step, from the positions and the step's block table (vLLM's way).

    and the output is scaled by the attention sink of each head, exp(lse) / (exp(lse) + exp(attn_sink[h])).

    Conventions:

    * q [T, N, 512]: each head's query after `wq_b`, its last 64 dims rotated (RoPE is the caller's).
    * kv [T, 512]: the new tokens' rows (after `kv_norm`, the last 64 dims rotated); the layer writes them
      into `window_cache` at `metadata.slot_mapping` (`mla_multi.ops.concat_and_cache_mla_v4`).
    * metadata: the step's `CommonAttentionMetadata`, built for the window cache (its block_table and
      block_size page `window_cache`; block_size is this layer's). Decodes first (query_len <=
      metadata.decode_threshold, up to 8 new tokens a decode request: MTP), or ``reorder=True``.
    * topk_indices int32 [T, <= topk]: each token's top-k segment as slots of `kv_cache` (block *
      kv_block_size + offset: FlashMLA's ``indices``, vLLM's global top-k indices), -1 = none, a duplicate
      counts twice; topk_length int32 [T] (optional): only the first topk_length[t] count.
    * compressed_kv [C, 512] and compressed_slot_mapping [C] int64 (optional): rows the model's compressor
      produced this step, written into `kv_cache` (negative slot: skipped) before the attention reads it.
    * The output [T, N * 512]: each head's attended rows, in q's dtype. The projection after it is the
      model's: the inverse RoPE of each head's last 64 dims, then `wo_a` (grouped) and `wo_b`. In the V3.2
      mode the layer up-projects with W_UV because the value is `latent @ W_UV` (part of the attention, held
      in `kv_b_proj`); V4 has no kv_b_proj (its value is the row itself), and the inverse RoPE needs the
      caller's positions and rotation, as q's RoPE does: the layer ends where the attention ends.
    * scale: the softmax scale, 512 ** -0.5 for DeepSeek-V4 (head_dim ** -0.5).

    Weights: `attn_sink` [N] float32, the module's parameter (`state_dict()` key ``attn_sink``), -inf at
    construction (no sink: the output unscaled) until the checkpoint's values are loaded; `.to()` moves it
    and keeps it float32 (`.half()` etc. change the layer's compute dtype, not the sink's).

    A layer without a top-k segment (`topk=None`: V4's layers without compression) takes no kv_cache and no
    topk_indices; a layer with `window_size=0` takes no window_cache (its kv is then not written).

    Plan / forward / compile: as `MLAAttention` in sparse mode. `plan(metadata)` once per step (the window
    indices and the prefill chunks are made there, on the host and in queued device work: no
    synchronisation) and makes the step current; `forward` then only launches. Under `torch.compile` the
    forward is one opaque op, ``torch.ops.mla_multi.mla_attention_v4``, that runs this eager forward with the
    current step. Inference only (`NO_BACKWARD`).

    Args:
        num_heads: query heads on this device (N).
        scale: softmax scale.
        block_size: tokens per block of the window cache (the step metadata's block_size).
        max_model_len, max_num_seqs: the largest request and batch (bounds checked at plan).
        topk: the most top-k entries a token (None: no top-k segment, no main cache).
        window_size: tokens of the window segment (0: none; DeepSeek-V4's is 128).
        kv_format: the main cache's format ("fp8_ds_mla_v4" or "fp8_ds_mla_v41").
        window_kv_format: the window cache's format (None: kv_format; "fp4_ds_mla_v41" beside "fp8_ds_mla_v41").
        dtype: the compute dtype of q, kv and the output (float32 / float64 / bfloat16 / float16).
        device: where the sink parameter lives (the caches and inputs must be there too).
        workspace_tokens: entries (top-k and window together) of prefill tokens attended by one op call: the
            prefill tokens go in chunks of workspace_tokens // (topk + window_size) tokens (default 1M entries;
            the backends that gather or dequantise the named rows first, TRITON off sm_90 and REFERENCE, run a
            call in parts of at most 64K rows).
        decode_backend, prefill_backend: force the backend of the decode / prefill tokens by name. Prefill
            tokens too are read from the quantised caches by the sparse decode kernels, each token its own
            query (`mla_sparse_decode_v4`): nothing is dequantised into rows first, and the rows a request's
            tokens share are not copied once per token. Both are sparse_decode backends.
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        topk: int | None = None,
        window_size: int = 128,
        kv_format: str = "fp8_ds_mla_v4",
        window_kv_format: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        workspace_tokens: int | None = None,
        decode_backend: str | None = None,
        prefill_backend: str | None = None,
    ) -> None:
        super().__init__()
        from mla_multi import cache_formats

        for name, value in (("num_heads", num_heads), ("block_size", block_size), ("max_model_len", max_model_len),
                            ("max_num_seqs", max_num_seqs)):
            checks.check_positive_int(name, value)
        self.scale = checks.check_positive_float("scale", scale)
        checks.check_positive_int("topk", topk, allow_none=True)
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 0:
            raise ValueError(f"window_size={window_size!r}; accepted: an int >= 0 (0: no window segment)")
        if topk is None and window_size == 0:
            raise ValueError("topk=None with window_size=0 leaves nothing to attend to; accepted: a topk, a "
                             "window_size >= 1, or both")
        if kv_format not in V4_MAIN_FORMATS:
            raise ValueError(f"kv_format={kv_format!r}; accepted: {', '.join(V4_MAIN_FORMATS)}")
        window_kv_format = kv_format if window_kv_format is None else window_kv_format
        allowed = (kv_format,) + tuple(f.name for f in cache_formats.FORMATS.values() if kv_format in f.main_formats)
        if window_kv_format not in allowed:
            raise ValueError(f"window_kv_format={window_kv_format!r} beside kv_format={kv_format!r}; accepted: "
                             f"{', '.join(allowed)}")
        if topk is None and cache_formats.FORMATS[window_kv_format].second_segment_only:
            raise ValueError(f"window_kv_format={window_kv_format!r} serves only as a second segment; a layer "
                             "without topk reads the window as its only segment: accepted "
                             f"{', '.join(V4_MAIN_FORMATS)}")
        if dtype not in ops.FLOAT_DTYPES:
            raise ValueError(f"dtype={dtype!r}; accepted: {', '.join(dtype_name(d) for d in ops.FLOAT_DTYPES)}")
        if workspace_tokens is not None:
            checks.check_positive_int("workspace_tokens", workspace_tokens)
        self.num_heads = num_heads
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.topk = topk
        self.window_size = window_size
        self.kv_format = kv_format
        self.window_kv_format = window_kv_format
        self.dtype = dtype
        # entries of prefill tokens attended a call: at least one token's
        self.workspace_tokens = max(workspace_tokens or 1 << 20, (topk or 0) + window_size, 1)
        self._forced_backends = (decode_backend, prefill_backend)
        self.attn_sink = torch.nn.Parameter(
            torch.full((num_heads,), -math.inf, dtype=torch.float32, device=device), requires_grad=False
        )
        self._bind()
        from mla_multi import library

        self.layer_id: int = library.register_layer(self)

    # ------------------------------------------------------------------ selection
    @property
    def device(self) -> torch.device:
        return self.attn_sink.device

    def _segments(self) -> tuple[str, str | None]:
        """(kv_format, extra_kv_format) of the op calls: the top-k segment first (the window the second), or the
        window alone."""
        if self.topk is None:
            return self.window_kv_format, None
        return self.kv_format, (self.window_kv_format if self.window_size > 0 else None)

    def _bind(self) -> None:
        """The backends of the decode and the prefill tokens for the layer's dtype and device (again after
        `.to()`): both sparse_decode backends over the quantised caches."""
        from mla_multi.registry import select_sparse_backend

        dims = MLADims(self.num_heads, kv_lora_rank=V4_WIDTH - V4_ROPE, qk_rope_head_dim=V4_ROPE)
        entries = (self.topk or 0) + self.window_size
        kv_format, extra = self._segments()
        self.decode_backend, self.prefill_backend = (
            select_sparse_backend("sparse_decode", dims, self.dtype, torch.uint8, entries, backend=forced,
                                  with_lengths=True, kv_format=kv_format, extra_kv_format=extra, with_sink=True,
                                  platform=None)
            for forced in self._forced_backends
        )
        ops.error_flag(self.device)  # exists before a graph captures its address

    def backends(self) -> dict[str, str]:
        """{"sparse_decode_v4": name, "sparse_prefill_v4": name}: the registry's choice (sparse_decode
        backends) for this layer's decode and prefill tokens (each call is planned by the ops, which may choose
        by its token count)."""
        return {"sparse_decode_v4": self.decode_backend.name, "sparse_prefill_v4": self.prefill_backend.name}

    def _apply(self, fn, recurse=True):
        # `.to(device / dtype)`, `.half()` ...: the compute dtype follows a dtype change, the sink stays float32
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        result = super()._apply(fn, recurse)
        if self.attn_sink.dtype != torch.float32:
            self.attn_sink.data = self.attn_sink.data.float()
        if probe.is_floating_point() and probe.dtype in ops.FLOAT_DTYPES:
            self.dtype = probe.dtype
        self._bind()
        return result

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, scale={self.scale:.6g}, topk={self.topk}, "
                f"window_size={self.window_size}, kv_format={self.kv_format}, "
                f"window_kv_format={self.window_kv_format}, block_size={self.block_size}, "
                f"dtype={dtype_name(self.dtype)}, backends={self.backends()}")

    # ------------------------------------------------------------------ caches
    def allocate_kv_cache(self, num_blocks: int, block_size: int | None = None, *, device=None) -> torch.Tensor:
        """A zeroed main (top-k) cache: uint8 [num_blocks, block_size, bytes] in `kv_format` with its block
        stride (`CacheFormat.allocate`); block_size defaults to the layer's."""
        from mla_multi import cache_formats

        if self.topk is None:
            raise ValueError("this MLAAttentionV4 has no top-k segment (topk=None): it uses no kv_cache")
        checks.check_positive_int("num_blocks", num_blocks)
        checks.check_positive_int("block_size", block_size, allow_none=True)
        return cache_formats.get_format(self.kv_format).allocate(
            num_blocks, block_size or self.block_size, self.device if device is None else device)

    def allocate_window_cache(self, num_blocks: int, *, device=None) -> torch.Tensor:
        """A zeroed window cache: uint8 [num_blocks, block_size, bytes] in `window_kv_format`."""
        from mla_multi import cache_formats

        if self.window_size == 0:
            raise ValueError("this MLAAttentionV4 has no window segment (window_size=0): it uses no window_cache")
        checks.check_positive_int("num_blocks", num_blocks)
        return cache_formats.get_format(self.window_kv_format).allocate(
            num_blocks, self.block_size, self.device if device is None else device)

    # ------------------------------------------------------------------ planning
    def plan(self, metadata: CommonAttentionMetadata, *, cuda_graph: bool = False) -> None:
        """Plan the step of `metadata` once (shared by every V4 layer of the same window size and block size):
        each token's position and window indices, the decode / prefill split and the prefill chunks; and make
        it the current step of the layer's device (the compiled forward runs it). `cuda_graph` is accepted
        for `MLAAttention.plan`'s signature: the plan is the same."""
        if not isinstance(metadata, CommonAttentionMetadata):
            raise ValueError(f"metadata={type(metadata).__name__}; accepted: a CommonAttentionMetadata")
        from mla_multi import library

        library.set_current_metadata(self.device, metadata)
        self._step(metadata)

    def _step(self, metadata: CommonAttentionMetadata) -> dict:
        """The step's V4 plan, made once per (step, window_size, block_size, topk, entries a prefill chunk may
        hold)."""
        key = ("v4 step", self.window_size, self.block_size, self.topk, self.workspace_tokens)
        found = metadata.backend_plans.get(key)
        if found is not None:
            return found
        if metadata.block_size != self.block_size:
            raise ValueError(f"metadata.block_size={metadata.block_size}; this layer's block_size (its window "
                             f"cache's) is {self.block_size}")
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(metadata)
        query_lens, computed = metadata.host_lengths()
        longest_decode = max(query_lens[:num_decodes], default=0)
        if longest_decode > V4_MAX_DECODE_QUERY_LEN:
            raise ValueError(f"metadata.decode_threshold={metadata.decode_threshold} makes a decode of "
                             f"{longest_decode} tokens; accepted: at most {V4_MAX_DECODE_QUERY_LEN} new tokens a "
                             "decode request (MTP)")
        if metadata.num_reqs > self.max_num_seqs:
            raise ValueError(f"the step has {metadata.num_reqs} requests; this layer's max_num_seqs is "
                             f"{self.max_num_seqs}")
        if metadata.max_seq_len > self.max_model_len:
            raise ValueError(f"the step's longest request has {metadata.max_seq_len} tokens; this layer's "
                             f"max_model_len is {self.max_model_len}")
        tokens = metadata.num_actual_tokens
        device = metadata.block_table.device
        # every token's request and position, on the host, then one queued copy
        lengths = torch.tensor(query_lens, dtype=torch.int64)
        requests = torch.repeat_interleave(torch.arange(len(query_lens)), lengths)
        starts = torch.tensor(list(itertools.accumulate(query_lens, initial=0))[:-1], dtype=torch.int64)
        positions = torch.arange(tokens) - starts[requests] + torch.tensor(computed, dtype=torch.int64)[requests]
        packed = to_device(torch.cat([requests, positions]), device)
        requests, positions = packed[:tokens], packed[tokens:]
        table = metadata.block_table.long()
        step = {"num_decode_tokens": num_decode_tokens}
        width = self.window_size
        if width > 0:
            # newest first: the window's valid entries lead, so its length is min(p + 1, window_size)
            back = positions.unsqueeze(1) - torch.arange(width, device=device)
            valid = back >= 0
            safe = back.clamp(min=0)
            blocks = table[requests.unsqueeze(1), (safe // self.block_size).clamp(max=table.shape[1] - 1)]
            slots = blocks * self.block_size + safe % self.block_size
            step["window_indices"] = torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
            step["window_lengths"] = (positions + 1).clamp(max=width).to(torch.int32)
        # prefill tokens in chunks whose entries fit workspace_tokens
        per_chunk = max(1, self.workspace_tokens // ((self.topk or 0) + width))
        step["prefill_chunks"] = tuple(
            (start, min(start + per_chunk, tokens)) for start in range(num_decode_tokens, tokens, per_chunk)
        )
        metadata.backend_plans[key] = step
        return step

    # ------------------------------------------------------------------ forward
    def _check_inputs(self, q, kv, kv_cache, window_cache, metadata, output, topk_indices, topk_length,
                      compressed_kv, compressed_slot_mapping) -> torch.Tensor:
        """Check a step's inputs against the layer; the output to write."""
        from mla_multi import cache_formats

        if not isinstance(metadata, CommonAttentionMetadata):
            raise ValueError(f"metadata={type(metadata).__name__}; accepted: a CommonAttentionMetadata")
        tokens, n, dtype, device = metadata.num_actual_tokens, self.num_heads, self.dtype, self.device
        checks.expect_tensor("q", q, (tokens, n, V4_WIDTH), dtype, device)
        checks.expect_tensor("kv", kv, (tokens, V4_WIDTH), dtype, device)
        if self.window_size > 0:
            checks.check_tensor("window_cache", window_cache, ndim=3, dtypes=(torch.uint8,), device=device)
            cache_formats.check_cache("window_cache", window_cache, self.window_kv_format)
            if window_cache.shape[1] != self.block_size:
                raise ValueError(f"window_cache has blocks of {window_cache.shape[1]} tokens; this layer's "
                                 f"block_size is {self.block_size}")
        elif window_cache is not None:
            raise ValueError("window_cache given to an MLAAttentionV4 with window_size=0; accepted: None")
        if self.topk is not None:
            checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(torch.uint8,), device=device)
            cache_formats.check_cache("kv_cache", kv_cache, self.kv_format)
            if topk_indices is None:
                raise ValueError(f"this MLAAttentionV4 has a top-k segment (topk={self.topk}): forward needs "
                                 f"topk_indices, int32 [{tokens}, <= {self.topk}] slots of kv_cache")
            checks.check_tensor("topk_indices", topk_indices, ndim=2, dtypes=(torch.int32,), shape=(tokens, None),
                                device=device)
            if topk_indices.shape[1] > self.topk:
                raise ValueError(f"topk_indices has {topk_indices.shape[1]} entries a token; accepted: at most "
                                 f"topk={self.topk}")
            if topk_length is not None:
                checks.check_tensor("topk_length", topk_length, ndim=1, dtypes=(torch.int32,), shape=(tokens,),
                                    device=device)
            if (compressed_kv is None) != (compressed_slot_mapping is None):
                raise ValueError("compressed_kv and compressed_slot_mapping go together: the rows and their slots "
                                 "in kv_cache")
            if compressed_kv is not None:
                checks.check_tensor("compressed_kv", compressed_kv, ndim=2, dtypes=(dtype,), shape=(None, V4_WIDTH),
                                    device=device)
                checks.check_tensor("compressed_slot_mapping", compressed_slot_mapping, ndim=1,
                                    dtypes=checks.INDEX_DTYPES, shape=(compressed_kv.shape[0],), device=device)
        else:
            for name, value in (("kv_cache", kv_cache), ("topk_indices", topk_indices), ("topk_length", topk_length),
                                ("compressed_kv", compressed_kv),
                                ("compressed_slot_mapping", compressed_slot_mapping)):
                if value is not None:
                    raise ValueError(f"{name} given to an MLAAttentionV4 without a top-k segment (topk=None); "
                                     "accepted: None")
        return _step_output(output, tokens, n * V4_WIDTH, dtype, device)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor | None,
        window_cache: torch.Tensor | None,
        metadata: CommonAttentionMetadata | None,
        output: torch.Tensor | None = None,
        *,
        topk_indices: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
        compressed_kv: torch.Tensor | None = None,
        compressed_slot_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output [T, N * 512] for the step of `metadata` (the conventions: the class docstring).

        Under `torch.compile` it is one opaque op, ``torch.ops.mla_multi.mla_attention_v4``, run with the
        current step of q's device (set by `plan` or `mla_multi.set_step`); `metadata` is not read there.
        """
        if torch.compiler.is_compiling():
            if output is None:
                output = q.new_empty((q.shape[0], self.num_heads * V4_WIDTH))
            torch.ops.mla_multi.mla_attention_v4(q, kv, kv_cache, window_cache, output, topk_indices, topk_length,
                                                 compressed_kv, compressed_slot_mapping, self.layer_id)
            return output
        args = (q, kv, kv_cache, window_cache, metadata, output, topk_indices, topk_length, compressed_kv,
                compressed_slot_mapping)
        if torch.is_grad_enabled():
            with torch.no_grad():
                out = self._forward_eager(*args)
            if q.requires_grad or kv.requires_grad:
                out = _InferenceOnly.apply(out, q, kv)
            return out
        return self._forward_eager(*args)

    def _forward_eager(self, q, kv, kv_cache, window_cache, metadata, output, topk_indices, topk_length,
                       compressed_kv, compressed_slot_mapping) -> torch.Tensor:
        result = self._check_inputs(q, kv, kv_cache, window_cache, metadata, output, topk_indices, topk_length,
                                    compressed_kv, compressed_slot_mapping)
        order = metadata.batch_order
        if order is not None and not order.identity:
            # the caller's order of requests: the tokens gathered into the step's, the output scattered back
            step_out = self._forward_step(
                order.to_step(q), order.to_step(kv), kv_cache, window_cache, metadata, None,
                None if topk_indices is None else order.to_step(topk_indices),
                None if topk_length is None else order.to_step(topk_length), compressed_kv,
                compressed_slot_mapping,
            )
            result.index_copy_(0, order.token_index, step_out)
            return result
        return self._forward_step(q, kv, kv_cache, window_cache, metadata, result, topk_indices, topk_length,
                                  compressed_kv, compressed_slot_mapping)

    def _forward_step(self, q, kv, kv_cache, window_cache, metadata, output, topk_indices, topk_length,
                      compressed_kv, compressed_slot_mapping) -> torch.Tensor:
        tokens, n = metadata.num_actual_tokens, self.num_heads
        if output is None:
            output = torch.empty(tokens, n * V4_WIDTH, dtype=self.dtype, device=self.device)
        step = self._step(metadata)
        if self.topk is not None and checks.data_checks_enabled(self.device):
            num_slots = kv_cache.shape[0] * kv_cache.shape[1]
            slots = topk_indices.detach().cpu().long()
            bad = slots[(slots < -1) | (slots >= num_slots)]
            if bad.numel():
                raise ValueError(f"topk_indices hold slots {bad[:8].tolist()} outside kv_cache; accepted: -1 (none) "
                                 f"or a slot in [0, {num_slots})")
        if self.window_size > 0:  # the window's blocks (with the data checks on)
            checks.check_block_table_data(metadata.block_table, metadata.seq_lens, window_cache.shape[0],
                                          self.block_size)
        # the cache writes: this step's rows into the window, the compressor's rows into the main cache
        if self.window_size > 0:
            ops.concat_and_cache_mla_v4(kv[:, : V4_WIDTH - V4_ROPE], kv[:, V4_WIDTH - V4_ROPE:], window_cache,
                                        metadata.slot_mapping, kv_format=self.window_kv_format)
        if compressed_kv is not None:
            ops.concat_and_cache_mla_v4(compressed_kv[:, : V4_WIDTH - V4_ROPE], compressed_kv[:, V4_WIDTH - V4_ROPE:],
                                        kv_cache, compressed_slot_mapping, kv_format=self.kv_format)
        out = output.view(tokens, n, V4_WIDTH)
        decode_tokens = step["num_decode_tokens"]
        if decode_tokens > 0:
            self._attend(q, kv_cache, window_cache, step, topk_indices, topk_length, 0, decode_tokens,
                         out[:decode_tokens], self._forced_backends[0])
        for start, end in step["prefill_chunks"]:
            self._attend(q, kv_cache, window_cache, step, topk_indices, topk_length, start, end, out[start:end],
                         self._forced_backends[1])
        return output

    def _segment_args(self, kv_cache, window_cache, step, topk_indices, topk_length, start, end) -> list:
        """[(cache, format, indices, lengths), ...] of tokens start .. end: the top-k segment, then the window."""
        segments = []
        if self.topk is not None:
            segments.append((kv_cache, self.kv_format, topk_indices[start:end],
                             None if topk_length is None else topk_length[start:end]))
        if self.window_size > 0:
            segments.append((window_cache, self.window_kv_format, step["window_indices"][start:end],
                             step["window_lengths"][start:end]))
        return segments

    def _attend(self, q, kv_cache, window_cache, step, topk_indices, topk_length, start, end, out,
                backend: str | None) -> None:
        """Tokens start .. end (each token its own query: MTP and prefill tokens of a request included), read
        from the quantised caches by `mla_sparse_decode_v4` into `out` (`ops.sparse_decode_v4_into`;
        `backend`: forced, or the op's choice). A slot outside its cache gives the token NaN rows and the
        SPARSE_INDEX error flag, never a read outside it."""
        segments = self._segment_args(kv_cache, window_cache, step, topk_indices, topk_length, start, end)
        (cache, fmt, indices, lengths), extra = segments[0], segments[1:]
        keywords = {}
        if extra:
            extra_cache, extra_fmt, extra_indices, extra_lengths = extra[0]
            keywords = dict(extra_kv_cache=extra_cache, extra_indices=extra_indices, extra_topk_length=extra_lengths,
                            extra_kv_format=extra_fmt)
        # written in place by a backend that takes the output buffer (`v4_takes_out`), else copied there
        target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        ops.sparse_decode_v4_into(
            target, q[start:end], cache, indices, self.scale, kv_format=fmt, topk_length=lengths,
            attn_sink=self.attn_sink, backend=backend, **keywords,
        )
        if target is not out:
            out.copy_(target)
