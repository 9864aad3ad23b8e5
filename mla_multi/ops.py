"""Public functional ops.

`mla_decode` and `mla_prefill` run through the registry (``backend=None``
chooses, a name forces one).  The cache ops and `merge_attn_states` use Triton
kernels on GPUs and PyTorch elsewhere.  Every op checks its inputs on the host
(see `mla_multi.checks`) and raises ValueError naming the bad argument.

Index data (block tables, lengths, slots, cumulative lengths) is checked
when `MLA_MULTI_CHECK_INPUTS=1` and always on the CPU.  Without the checks the
kernels never leave their tensors: a request with bad indices gets NaN rows
(a bad slot is not written) and the kind of error is recorded on the device,
reported by `raise_pending_errors()` or by the next call that runs the checks.
Under ``TRITON_INTERPRET=1`` the Triton kernels also serve CPU tensors, so they
can be stepped through without a GPU.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_multi import checks, envs, errors, library
from mla_multi.backends import reference
from mla_multi.backends.base import FP8_DTYPES
from mla_multi.dims import MLADims
from mla_multi.registry import select_decode_backend, select_prefill_backend

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES

__all__ = [
    "mla_decode",
    "mla_prefill",
    "mla_sparse_decode",
    "mla_sparse_prefill",
    "plan_mla_decode",
    "plan_mla_prefill",
    "MLADecodePlan",
    "MLAPrefillPlan",
    "merge_attn_states",
    "concat_and_cache_mla",
    "gather_cache",
    "raise_pending_errors",
    "error_flag",
]

raise_pending_errors = errors.raise_pending_errors
error_flag = errors.error_flag


def _use_triton(tensor: torch.Tensor) -> bool:
    """Triton kernels serve GPU tensors (float64 excepted), and CPU tensors under Triton's interpreter;
    the PyTorch versions serve the rest."""
    if tensor.dtype == torch.float64:
        return False
    if tensor.device.type == "cuda":
        return True
    from mla_multi.kernels import interpreter_active

    return tensor.device.type == "cpu" and interpreter_active()


def _scale_tensor(scale, device: torch.device):
    if scale is None or torch.is_tensor(scale):
        return scale
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale=None,
    num_kv_splits: int | None = None,
    backend: str | None = None,
    return_lse: bool = False,
):
    """MLA decode: MQA of absorbed queries over the paged latent cache.

    q_nope [B, N, Lkv] (already multiplied by W_UK_T) or [B, Q, N, Lkv] for Q
    query tokens per request (causal: token j sees positions < seq_len - Q + 1 + j);
    q_pe [B, (Q,) N, R]; kv_cache [num_blocks, block_size, Lkv + R] (fp8 with
    `k_scale`); block_table [B, max_blocks] int32; seq_lens [B] int32.
    Returns out [B, (Q,) N, Lkv] in q's dtype, and lse [B, (Q,) N] float32
    when `return_lse`. seq_len 0 gives 0 and -inf. Without the data checks a
    request whose seq_len lies outside [0, max_blocks * block_size], or that
    reads a block-table entry outside [0, num_blocks), gets NaN (TRITON,
    REFERENCE) and is recorded for `raise_pending_errors`.

    Non-finite input (README "Non-finite input and edge cases"): `scale` and `k_scale` (FP8 caches only: refused
    for others) must be finite and positive
    (ValueError naming it, on every call); a NaN, or a score of +inf, reaching a row's softmax makes that row
    and its LSE NaN; scores of -inf weigh nothing; an empty batch gives empty outputs.
    seq_lens may be int32 or int64.
    """
    if torch.compiler.is_compiling():
        return library.mla_decode_traced(
            q_nope, q_pe, kv_cache, block_table, seq_lens, scale,
            k_scale=k_scale, num_kv_splits=num_kv_splits, backend=backend, return_lse=return_lse,
        )
    scale = checks.check_positive_float("scale", scale)
    checks.check_backend_arg("decode", backend)
    try:
        key = _decode_plan_key(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend)
    except (AttributeError, TypeError):  # not tensors: the checks below say what was wrong
        key = None
    plan = _DECODE_PLANS.get(key)
    if plan is None:
        plan = _plan_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend)
        _remember(_DECODE_PLANS, key, plan)
    elif plan.data_checks:
        checks.report_pending_errors(plan.device)
        checks.check_scale("k_scale", k_scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
        checks.check_block_table_data(block_table, seq_lens, kv_cache.shape[0], kv_cache.shape[1])
    out, lse = plan.run(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, k_scale)
    if return_lse and lse is None:
        raise ValueError(
            f"return_lse=True, but the decode backend {plan.backend_cls.name} returns no LSE with the installed "
            "library; accepted: return_lse=False, or a backend that returns it (backend='TRITON')"
        )
    return (out, lse) if return_lse else out


# Plans of the functional ops: a repeated call with the same shapes, strides, dtypes, devices, alignment,
# options and MLA_MULTI_* environment skips the checks that the first call ran, the backend selection,
# the split heuristic, the launch configuration and Triton's argument binding.
_DECODE_PLANS: dict = {}
_PLANS_MAX = 256


def _remember(plans: dict, key, plan) -> None:
    """Keep `plan` under `key` (None: arguments without a layout, never kept), at most _PLANS_MAX plans."""
    if key is not None:
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[key] = plan


def _layout(tensor: torch.Tensor) -> tuple:
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.data_ptr() % 16)


def _scale_key(k_scale):
    if k_scale is None or isinstance(k_scale, bool):
        return k_scale
    if torch.is_tensor(k_scale):
        return _layout(k_scale)
    if not isinstance(k_scale, (int, float)):  # a string, a list...: not a key; the checks name k_scale
        raise TypeError("k_scale")
    return ("value", float(k_scale))


def _decode_plan_key(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend) -> tuple:
    scale_key = _scale_key(k_scale)
    if num_kv_splits is not None and (isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int)):
        raise TypeError("num_kv_splits")
    return (
        _layout(q_nope), _layout(q_pe), _layout(kv_cache), _layout(block_table), _layout(seq_lens), scale_key,
        num_kv_splits, backend, envs.snapshot(),
    )


class _DecodePlan:
    """What `mla_decode` decided for one key: the backend, its impl and (TRITON) the bound kernels.

    The TRITON partials of an eager call are sliced from the device's shared
    workspace (`shared_split_partials`); a call being captured in a CUDA
    graph allocates its own, since the graph must not read a buffer that a
    later, larger call reallocates.
    """

    def __init__(self, backend_cls, impl, device, data_checks: bool, k_scale) -> None:
        self.backend_cls = backend_cls
        self.impl = impl
        self.device = device
        self.data_checks = data_checks
        self.k_scale = k_scale  # the tensor of a float k_scale, made once
        self.num_kv_splits = None
        self.kernel_plans = {}  # capturing a CUDA graph or not -> the bound kernels (TRITON)
        self.partial_dims = None  # (rows, heads, splits, kv_lora_rank) of the split-KV partials (TRITON)

    def run(self, q_nope, q_pe, kv_cache, block_table, seq_lens, scale, k_scale, out=None, lse=None,
            attn_logits=None):
        """(out, lse) of tensors with the plan's key; `out` / `lse` / `attn_logits`, when given, are
        contiguous tensors of the shapes and dtypes the plan would allocate (checked by the caller)."""
        if self.k_scale is not None or not torch.is_tensor(k_scale):
            k_scale = self.k_scale
        if seq_lens.dtype != torch.int32:
            seq_lens = seq_lens.to(torch.int32)
        if self.partial_dims is None:
            impl = self.impl
            impl.scale = float(scale)
            result, result_lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale=k_scale,
                                                  num_kv_splits=self.num_kv_splits)
            if out is not None:
                result = out.copy_(result)
            if lse is not None and result_lse is not None:
                result_lse = lse.copy_(result_lse)
            return result, result_lse
        device = q_nope.device
        if out is None:
            out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=device)
        if lse is None:
            lse = torch.empty(q_nope.shape[:-1], dtype=torch.float32, device=device)
        from mla_multi.kernels.mla_decode import DecodeKernelPlan, capturing, shared_split_partials

        graph = capturing(q_nope)  # a captured launch may take TMA where a small eager one does not
        if attn_logits is None:
            attn_logits = shared_split_partials(*self.partial_dims, device)
        kernel_plan = self.kernel_plans.get(graph)
        if kernel_plan is None:
            kernel_plan = self.kernel_plans[graph] = DecodeKernelPlan(
                q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, self.num_kv_splits, attn_logits, out, lse,
                platform=self.impl.platform,
            )
        kernel_plan.launch(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, attn_logits, out, lse, scale)
        return out, lse


def _plan_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend) -> _DecodePlan:
    """Check the inputs of `mla_decode` (all of them, once per key) and decide how to run them."""
    checks.check_tensor("q_nope", q_nope, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    device = q_nope.device
    checks.check_tensor("q_pe", q_pe, ndim=q_nope.dim(), dtypes=(q_nope.dtype,), shape=(*q_nope.shape[:-1], None), device=device)
    width = q_nope.shape[-1] + q_pe.shape[-1]
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=CACHE_DTYPES, shape=(None, None, width), device=device)
    batch = q_nope.shape[0]
    checks.check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), shape=(batch, None), device=device)
    checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(batch,), device=device)
    checks.check_scale("k_scale", k_scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
    checks.check_positive_int("num_kv_splits", num_kv_splits, allow_none=True)
    checks.report_pending_errors(device)
    checks.check_block_table_data(block_table, seq_lens, kv_cache.shape[0], kv_cache.shape[1])

    num_heads = q_nope.shape[-2]
    q_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
    dims = MLADims(num_heads, kv_lora_rank=q_nope.shape[-1], qk_rope_head_dim=q_pe.shape[-1])
    backend_cls = select_decode_backend(
        dims, q_nope.dtype, kv_cache.dtype, kv_cache.shape[1], max_query_len=q_len, backend=backend
    )
    impl = backend_cls.get_decode_impl_cls()(
        num_heads, 1.0, dims.kv_lora_rank, dims.qk_rope_head_dim, kv_cache.dtype, kv_cache.shape[1], device
    )
    scale_tensor = None if k_scale is None or torch.is_tensor(k_scale) else _scale_tensor(k_scale, device)
    plan = _DecodePlan(backend_cls, impl, device, checks.data_checks_enabled(device), scale_tensor)
    from mla_multi.backends.triton import TritonDecodeImpl
    from mla_multi.kernels import interpreter_active

    if isinstance(impl, TritonDecodeImpl) and device.type == "cuda" and not interpreter_active():
        plan.num_kv_splits = impl.choose_num_kv_splits(
            batch, q_len, None, kv_cache.dtype, num_kv_splits, max_blocks=block_table.shape[1]
        )
        plan.partial_dims = (batch * q_len, num_heads, plan.num_kv_splits, dims.kv_lora_rank)
    else:
        plan.num_kv_splits = num_kv_splits
    return plan


class MLADecodePlan:
    """A decode planned once for one layout (`plan_mla_decode`); `run` only launches.

    In the style of FlashInfer's plan/run: the checks, the backend selection,
    the split count and (TRITON) the bound kernels and the split-KV partials
    are made by `plan_mla_decode`; `run` takes tensors of the same shapes,
    strides, dtypes, devices and alignment (new values, new cache, new
    lengths) and writes `out` / `lse` when given, so a planned decode
    allocates nothing. The partials belong to the plan: run one plan on one
    stream at a time (a CUDA graph captured over `run` stays valid while the
    plan lives).
    """

    def __init__(self, plan: _DecodePlan, key: tuple, scale: float, shape: tuple, dtype: torch.dtype,
                 num_kv_splits: int | None, backend: str | None) -> None:
        self._plan = plan
        self._key = key
        self._options = (num_kv_splits, backend)  # the key's options, as asked
        self.scale = scale
        self.backend = plan.backend_cls.name
        self.num_kv_splits = plan.num_kv_splits
        self._out_shape = shape
        self._dtype = dtype
        self._attn_logits = None
        if plan.partial_dims is not None:
            from mla_multi.kernels.mla_decode import split_partials

            self._attn_logits = split_partials(*plan.partial_dims, plan.device)

    def _check_output(self, name: str, tensor, shape, dtype) -> None:
        if tensor is None:
            return
        checks.check_tensor(name, tensor, dtypes=(dtype,), shape=shape, device=self._plan.device)
        if not tensor.is_contiguous() or tensor.data_ptr() % 16:
            raise ValueError(f"{name}={checks.describe(tensor)} is not contiguous and 16-byte aligned; accepted: "
                             f"a contiguous tensor (torch.empty{tuple(shape)})")

    def run(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, out=None, lse=None):
        """(out [B, (Q,) N, Lkv], lse [B, (Q,) N] float32) for tensors laid out as the planned ones.

        `k_scale` as given to `plan_mla_decode` (a float scale is planned once);
        `out` / `lse`: contiguous tensors to write instead of new ones. The LSE is
        None where the backend returns none and no `lse` was passed.
        """
        try:
            key = _decode_plan_key(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, *self._options)
        except (AttributeError, TypeError):
            key = None
        if key != self._key:
            raise ValueError(
                "the tensors differ from the planned ones in shape, strides, dtype, device, alignment, k_scale or "
                "MLA_MULTI_* environment; accepted: tensors laid out as at plan_mla_decode (plan again for others)"
            )
        self._check_output("out", out, self._out_shape, self._dtype)
        self._check_output("lse", lse, self._out_shape[:-1], torch.float32)
        plan = self._plan
        if plan.data_checks:
            checks.report_pending_errors(plan.device)
            checks.check_scale("k_scale", k_scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
            checks.check_block_table_data(block_table, seq_lens, kv_cache.shape[0], kv_cache.shape[1])
        return plan.run(q_nope, q_pe, kv_cache, block_table, seq_lens, self.scale, k_scale, out=out, lse=lse,
                        attn_logits=self._attn_logits)


def plan_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, *, k_scale=None, num_kv_splits=None,
                    backend=None) -> MLADecodePlan:
    """Plan `mla_decode` for tensors laid out as these (their values are not read, except by the data
    checks where they are on); `MLADecodePlan.run` then only launches. Arguments as in `mla_decode`."""
    scale = checks.check_positive_float("scale", scale)
    checks.check_backend_arg("decode", backend)
    plan = _plan_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend)
    key = _decode_plan_key(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend)
    return MLADecodePlan(plan, key, scale, tuple(q_nope.shape), q_nope.dtype, num_kv_splits, backend)


class MLAPrefillPlan:
    """A prefill planned once for one layout (`plan_mla_prefill`): the checks and the backend's impl (its
    wrappers, and FlashInfer's plan while the length tensors are the same, unchanged ones) are kept."""

    def __init__(self, plan: _PrefillPlan, key: tuple, causal: bool, return_lse: bool) -> None:
        self._plan = plan
        self._key = key
        self.backend = plan.backend_cls.name
        self.causal = causal
        self.return_lse = return_lse

    def run(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        """out [Tq, N, Dv] (and lse [N, Tq] with return_lse) for tensors laid out as the planned ones."""
        _, _, _, _, _, max_seqlen_q, max_seqlen_k, scale, causal, backend, _ = self._key
        try:
            key = (_layout(q), _layout(k), _layout(v), _layout(cu_seqlens_q), _layout(cu_seqlens_k), max_seqlen_q,
                   max_seqlen_k, scale, causal, backend, envs.snapshot())
        except (AttributeError, TypeError):
            key = None
        if key != self._key:
            raise ValueError(
                "the tensors differ from the planned ones in shape, strides, dtype, device, alignment or "
                "MLA_MULTI_* environment; accepted: tensors laid out as at plan_mla_prefill (plan again for others)"
            )
        if self._plan.data_checks:
            _check_prefill_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        cu_seqlens_q, cu_seqlens_k = checks.as_int32(cu_seqlens_q), checks.as_int32(cu_seqlens_k)
        return self._plan.impl.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              causal=self.causal, return_softmax_lse=self.return_lse)


def plan_mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, *, causal=True,
                     return_lse=False, backend=None) -> MLAPrefillPlan:
    """Plan `mla_prefill` for tensors laid out as these; `MLAPrefillPlan.run` then skips the checks and the
    selection. Arguments as in `mla_prefill` (max_seqlen_* are fixed by the plan)."""
    checks.check_backend_arg("prefill", backend)
    plan = _plan_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend)
    key = (_layout(q), _layout(k), _layout(v), _layout(cu_seqlens_q), _layout(cu_seqlens_k), max_seqlen_q,
           max_seqlen_k, float(scale), bool(causal), backend, envs.snapshot())
    return MLAPrefillPlan(plan, key, bool(causal), bool(return_lse))


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    *,
    causal: bool = True,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Varlen MHA of MLA prefill (qk head dim P + R, v head dim V).

    q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv]; cu_seqlens_* int32 [B + 1].
    Causal masks align bottom-right (a sequence with fewer queries than keys
    is the tail of the keys). Returns out [Tq, N, Dv] in q's dtype, and
    lse [N, Tq] float32 when `return_lse`. Without the data checks a sequence
    whose boundaries are not non-decreasing from 0 within the token count, or
    longer than max_seqlen_*, gets NaN rows (TRITON, REFERENCE) and is recorded
    for `raise_pending_errors`.

    Non-finite input (README "Non-finite input and edge cases"): `scale` must be finite and positive
    (ValueError naming it, on every call); a NaN, or a score of +inf, reaching a row's softmax makes that row
    and its LSE NaN; scores of -inf weigh nothing; an empty batch gives empty outputs.
    cu_seqlens_* may be int32 or int64 (converted once to int32).
    """
    if torch.compiler.is_compiling():
        return library.mla_prefill_traced(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
            causal=causal, return_lse=return_lse, backend=backend,
        )
    checks.check_backend_arg("prefill", backend)
    try:
        key = (
            _layout(q), _layout(k), _layout(v), _layout(cu_seqlens_q), _layout(cu_seqlens_k), max_seqlen_q,
            max_seqlen_k, scale, bool(causal), backend, envs.snapshot(),
        )
        hash(key)
    except (AttributeError, TypeError):  # not tensors (or unhashable): the checks say what was wrong
        key = None
    plan = _PREFILL_PLANS.get(key)
    if plan is None:
        plan = _plan_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend)
        _remember(_PREFILL_PLANS, key, plan)
    elif plan.data_checks:
        _check_prefill_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    cu_seqlens_q, cu_seqlens_k = checks.as_int32(cu_seqlens_q), checks.as_int32(cu_seqlens_k)  # int64 taken too
    return plan.impl.forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, return_softmax_lse=return_lse
    )


_PREFILL_PLANS: dict = {}


class _PrefillPlan:
    """What `mla_prefill` decided for one key: the backend and its impl (whose wrappers and plans persist)."""

    def __init__(self, backend_cls, impl, data_checks: bool) -> None:
        self.backend_cls = backend_cls
        self.impl = impl
        self.data_checks = data_checks


def _check_prefill_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """The checks of `mla_prefill` that read the cumulative lengths (when the data checks are on)."""
    device = q.device
    if not checks.data_checks_enabled(device):
        return
    checks.report_pending_errors(device)
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        values = cu.cpu()
        if int(values[0]) != 0 or bool((values[1:] < values[:-1]).any()) or int(values[-1]) > total:
            raise ValueError(f"{name}={values.tolist()}; accepted: non-decreasing from 0 up to {total}")
    for name, cu, bound in (("max_seqlen_q", cu_seqlens_q, max_seqlen_q), ("max_seqlen_k", cu_seqlens_k, max_seqlen_k)):
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        if bound < longest:
            raise ValueError(f"{name}={bound} is below the longest sequence ({longest}); accepted: >= {longest}")


def _plan_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend) -> _PrefillPlan:
    """Check the inputs of `mla_prefill` (all of them, once per key) and choose the backend."""
    checks.check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    num_heads, qk_head_dim = q.shape[1], q.shape[2]
    checks.check_tensor("k", k, ndim=3, dtypes=(q.dtype,), shape=(None, num_heads, qk_head_dim), device=device)
    checks.check_tensor("v", v, ndim=3, dtypes=(q.dtype,), shape=(k.shape[0], num_heads, None), device=device)
    checks.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=checks.INDEX_DTYPES, device=device)
    checks.check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(cu_seqlens_q.shape[0],),
                        device=device)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q is empty; accepted: [B + 1] cumulative lengths starting at 0")
    checks.check_positive_int("max_seqlen_q", max_seqlen_q) if max_seqlen_q else None
    checks.check_positive_int("max_seqlen_k", max_seqlen_k) if max_seqlen_k else None
    scale = checks.check_positive_float("scale", scale)
    if qk_head_dim < 2:
        raise ValueError(f"q has head dim {qk_head_dim}; accepted: at least 2")
    _check_prefill_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    rope = min(64, qk_head_dim - 1)
    dims = MLADims(num_heads, qk_nope_head_dim=qk_head_dim - rope, qk_rope_head_dim=rope, v_head_dim=v.shape[-1])
    backend_cls = select_prefill_backend(dims, q.dtype, backend=backend)
    impl = backend_cls.get_prefill_impl_cls()(
        num_heads, scale, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, device
    )
    return _PrefillPlan(backend_cls, impl, checks.data_checks_enabled(device))


def _check_sparse_extras(tokens: int, heads: int, topk_length, attn_sink, device, lengths_name: str = "topk_length",
                         length_rows: int | None = None) -> None:
    rows = tokens if length_rows is None else length_rows
    if topk_length is not None:
        checks.check_tensor(lengths_name, topk_length, ndim=1, dtypes=(torch.int32,), shape=(rows,), device=device)
    if attn_sink is not None:
        checks.check_tensor("attn_sink", attn_sink, ndim=1, dtypes=(torch.float32,), shape=(heads,), device=device)


def mla_sparse_decode(q_nope, q_pe, kv_cache, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None,
                      backend=None, return_lse=False):
    """Sparse MLA decode (DeepSeek Sparse Attention): each query token attends to the cached tokens its
    indices name, in the absorbed latent space.

    q_nope [T, N, 512] or [B, Q, N, 512] (absorbed), q_pe [.., N, 64];
    kv_cache [num_blocks, block_size, 576] float (bf16 / fp16 / fp32), FP8
    with a per-tensor `k_scale`, or uint8 [num_blocks, block_size, 656] in the
    fp8_ds_mla layout (`mla_multi.ds_mla_cache`); indices int32 [T, topk] or
    [B, Q, topk]: slot = block * block_size + offset, -1 = no token, a list
    (a duplicate counts twice); topk_length int32 [T] or [B]: only the first
    topk_length[i] indices count; attn_sink float32 [N]: out *= exp(lse) /
    (exp(lse) + exp(attn_sink)), lse unchanged. Returns out [.., N, 512] in
    q's dtype, and lse [.., N] float32 (natural log) with `return_lse`. A token
    with no valid index gives 0 and -inf. Without the data checks an index
    outside [-1, num_slots) makes its token's rows and LSE NaN and is recorded
    for `raise_pending_errors`; with them (always on CPU tensors) it is a
    ValueError.

    Non-finite input (README "Non-finite input and edge cases"): `scale` and `k_scale` (per-tensor FP8 caches only:
    refused for 16-bit and fp8_ds_mla caches) must be finite and positive
    (ValueError naming it, on every call); a NaN, or a score of +inf, reaching a row's softmax makes that row
    and its LSE NaN; scores of -inf weigh nothing; an empty batch gives empty outputs.
    A sink of +inf gives 0 rows, -inf changes nothing, NaN gives NaN rows (a token with no valid index stays
    0 and -inf).
    """
    if torch.compiler.is_compiling():
        return library.mla_sparse_decode_traced(
            q_nope, q_pe, kv_cache, indices, scale, k_scale=k_scale, topk_length=topk_length, attn_sink=attn_sink,
            backend=backend, return_lse=return_lse,
        )
    scale = checks.check_positive_float("scale", scale)
    checks.check_backend_arg("sparse_decode", backend)
    try:
        key = ("sparse_decode", _layout(q_nope), _layout(q_pe), _layout(kv_cache), _layout(indices), _scale_key(k_scale),
               _optional_layout(topk_length), _optional_layout(attn_sink), backend, envs.snapshot())
    except (AttributeError, TypeError):  # not tensors: the checks say what was wrong
        key = None
    plan = _SPARSE_PLANS.get(key)
    if plan is None:
        plan = _plan_sparse_decode(q_nope, q_pe, kv_cache, indices, k_scale, topk_length, attn_sink, backend)
        _remember(_SPARSE_PLANS, key, plan)
    elif plan.data_checks:
        checks.report_pending_errors(plan.device)
        if torch.is_tensor(k_scale):  # a float k_scale is part of the key, checked when planned; a tensor's value not
            checks.check_scale("k_scale", k_scale, required=True)
        _check_sparse_index_data(indices, topk_length, plan.num_slots, plan.topk, out_of_range_is_bad=True)
    tokens, heads, topk = plan.tokens, plan.heads, plan.topk
    if tokens == 0:  # an empty batch of any rank: empty outputs of the query's lead shape, nothing launched
        out = torch.empty(*plan.lead, heads, q_nope.shape[-1], dtype=q_nope.dtype, device=plan.device)
        lse = torch.empty(*plan.lead, heads, dtype=torch.float32, device=plan.device)
        return (out, lse) if return_lse else out
    lengths = topk_length
    if topk_length is not None and plan.q_len > 1:
        lengths = topk_length.repeat_interleave(plan.q_len)
    if plan.q_len > 1 or q_nope.dim() == 4:  # [B, Q, ..] as tokens
        q_nope, q_pe, indices = (q_nope.reshape(tokens, heads, q_nope.shape[-1]),
                                 q_pe.reshape(tokens, heads, q_pe.shape[-1]), indices.reshape(tokens, topk))
    out, lse = plan.impl.forward(
        q_nope, q_pe, kv_cache, indices, scale, k_scale=k_scale if plan.k_scale is None else plan.k_scale,
        topk_length=lengths, attn_sink=attn_sink,
    )
    if len(plan.lead) > 1:
        out = out.reshape(*plan.lead, heads, out.shape[-1])
        lse = None if lse is None else lse.reshape(*plan.lead, heads)
    if not return_lse:
        return out
    _check_sparse_lse(lse, plan.backend_cls.name)
    return out, lse


# Plans of the sparse ops, by the layouts of their tensors, their options and the MLA_MULTI_* environment:
# a repeated call skips the shape checks, the backend selection and the impl's construction.
_SPARSE_PLANS: dict = {}


def _optional_layout(tensor) -> tuple | None:
    return None if tensor is None else _layout(tensor)


@dataclasses.dataclass
class _SparsePlan:
    backend_cls: type
    impl: object
    device: torch.device
    lead: tuple
    tokens: int
    heads: int
    topk: int
    q_len: int
    num_slots: int
    k_scale: torch.Tensor | None  # the tensor of a float k_scale, made once
    data_checks: bool


def _check_sparse_index_data(indices, topk_length, num_slots: int, topk: int, out_of_range_is_bad: bool) -> None:
    """With the data checks on: decode indices inside [-1, num_slots), topk_length inside [0, topk]."""
    if out_of_range_is_bad:
        values = indices.detach().cpu()
        bad = values[(values < -1) | (values >= num_slots)]
        if bad.numel():
            raise ValueError(f"indices hold {bad[:8].tolist()}; accepted: -1 (no token) or slots in [0, {num_slots})")
    if topk_length is not None:
        lengths = topk_length.detach().cpu()
        if bool((lengths < 0).any()) or bool((lengths > topk).any()):
            raise ValueError(f"topk_length={lengths.tolist()}; accepted: values in [0, {topk}]")


def _plan_sparse_decode(q_nope, q_pe, kv_cache, indices, k_scale, topk_length, attn_sink, backend) -> _SparsePlan:
    checks.check_tensor("q_nope", q_nope, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    device = q_nope.device
    checks.check_tensor("q_pe", q_pe, ndim=q_nope.dim(), dtypes=(q_nope.dtype,), shape=(*q_nope.shape[:-1], None),
                        device=device)
    lead = tuple(q_nope.shape[:-2])
    heads = q_nope.shape[-2]
    checks.check_tensor("indices", indices, ndim=len(lead) + 1, dtypes=(torch.int32,), shape=(*lead, None),
                        device=device)
    topk = indices.shape[-1]
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=CACHE_DTYPES + (torch.uint8,), device=device)
    from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES

    width = q_nope.shape[-1] + q_pe.shape[-1]
    if kv_cache.dtype == torch.uint8:
        if kv_cache.shape[-1] != FP8_DS_MLA_BYTES or (q_nope.shape[-1], q_pe.shape[-1]) != (512, 64):
            raise ValueError(
                f"kv_cache={checks.describe(kv_cache)} with q widths {q_nope.shape[-1]} / {q_pe.shape[-1]}; a uint8 "
                f"cache is the fp8_ds_mla layout: [num_blocks, block_size, {FP8_DS_MLA_BYTES}] with 512 / 64"
            )
        if k_scale is not None:
            raise ValueError(f"k_scale={k_scale!r} with an fp8_ds_mla cache (its scales are in the cache); accepted: None")
    elif kv_cache.shape[-1] != width:
        raise ValueError(f"kv_cache has width {kv_cache.shape[-1]}; accepted: {width} (q_nope + q_pe widths) or a uint8 "
                         f"fp8_ds_mla cache of {FP8_DS_MLA_BYTES} bytes a token")
    else:
        checks.check_scale("k_scale", k_scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
    batch = lead[0]
    q_len = lead[1] if len(lead) == 2 else 1
    tokens = batch * q_len
    _check_sparse_extras(tokens, heads, topk_length, attn_sink, device, length_rows=batch)
    checks.report_pending_errors(device)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    data_checks = checks.data_checks_enabled(device)
    if data_checks:
        _check_sparse_index_data(indices, topk_length, num_slots, topk, out_of_range_is_bad=True)

    dims = MLADims(heads, kv_lora_rank=q_nope.shape[-1], qk_rope_head_dim=q_pe.shape[-1])
    from mla_multi.registry import select_sparse_backend

    backend_cls = select_sparse_backend("sparse_decode", dims, q_nope.dtype, kv_cache.dtype, topk,
                                        max_query_len=q_len, backend=backend, num_tokens=tokens,
                                        with_lengths=topk_length is not None)
    impl = backend_cls.get_impl_cls()(heads, dims.kv_lora_rank, dims.qk_rope_head_dim, device)
    k_scale_tensor = None if k_scale is None or torch.is_tensor(k_scale) else _scale_tensor(k_scale, device)
    return _SparsePlan(backend_cls, impl, device, lead, tokens, heads, topk, q_len, num_slots, k_scale_tensor,
                       data_checks)


def _check_sparse_lse(lse, name: str) -> None:
    if lse is None:
        raise ValueError(f"return_lse=True, but the sparse backend {name} returns no LSE with the installed library; "
                         "accepted: return_lse=False, or a backend that returns it (backend='TRITON')")


def mla_sparse_prefill(q_nope, q_pe, kv, indices, scale, *, topk_length=None, attn_sink=None, backend=None,
                       return_lse=False):
    """Sparse MLA prefill: each query token attends to the rows of `kv` its indices name (latent space).

    q_nope [T, N, 512] (absorbed), q_pe [T, N, 64]; kv [S_kv, 576] float;
    indices int32 [T, topk] into the rows of kv, -1 or >= S_kv = no token;
    topk_length int32 [T]; attn_sink float32 [N] as in `mla_sparse_decode`.
    Returns out [T, N, 512] in q's dtype, and lse [T, N] float32 with
    `return_lse`; a token with no valid index gives 0 and -inf, and so does
    every token over `kv` of no rows ([0, 576]), on every backend.

    Non-finite input (README "Non-finite input and edge cases"): `scale` must be finite and positive
    (ValueError naming it, on every call); a NaN, or a score of +inf, reaching a row's softmax makes that row
    and its LSE NaN; scores of -inf weigh nothing; an empty batch gives empty outputs.
    """
    if torch.compiler.is_compiling():
        return library.mla_sparse_prefill_traced(
            q_nope, q_pe, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink, backend=backend,
            return_lse=return_lse,
        )
    checks.check_backend_arg("sparse_prefill", backend)
    checks.check_tensor("q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    device = q_nope.device
    tokens, heads = q_nope.shape[0], q_nope.shape[1]
    checks.check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,), shape=(tokens, heads, None), device=device)
    width = q_nope.shape[-1] + q_pe.shape[-1]
    checks.check_tensor("kv", kv, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, width), device=device)
    checks.check_tensor("indices", indices, ndim=2, dtypes=(torch.int32,), shape=(tokens, None), device=device)
    topk = indices.shape[-1]
    scale = checks.check_positive_float("scale", scale)
    _check_sparse_extras(tokens, heads, topk_length, attn_sink, device)
    if topk_length is not None and checks.data_checks_enabled(device):
        lengths = topk_length.detach().cpu()
        if bool((lengths < 0).any()) or bool((lengths > topk).any()):
            raise ValueError(f"topk_length={lengths.tolist()}; accepted: values in [0, {topk}]")
    dims = MLADims(heads, kv_lora_rank=q_nope.shape[-1], qk_rope_head_dim=q_pe.shape[-1])
    from mla_multi.registry import select_sparse_backend

    backend_cls = select_sparse_backend("sparse_prefill", dims, q_nope.dtype, kv.dtype, topk, backend=backend)
    if kv.shape[0] == 0:  # no row to attend to: every token's documented 0 and -inf, on every backend
        out = torch.zeros(tokens, heads, q_nope.shape[-1], dtype=q_nope.dtype, device=device)
        lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=device)
        return (out, lse) if return_lse else out
    impl = backend_cls.get_impl_cls()(heads, dims.kv_lora_rank, dims.qk_rope_head_dim, device)
    out, lse = impl.forward(q_nope, q_pe, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink)
    if return_lse:
        _check_sparse_lse(lse, backend_cls.name)
    return (out, lse) if return_lse else out


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse):
    """Combine two partial attentions over disjoint keys by their LSE.

    outputs [T, N, D], lse [N, T] float32. An LSE of +inf counts as -inf; when
    both are -inf the output is 0 and the LSE -inf; a NaN LSE on either side
    gives a NaN row and LSE. Returns (output [T, N, D] in prefix_output's
    dtype, lse [N, T] float32).
    """
    if torch.compiler.is_compiling():
        return library.merge_attn_states_traced(prefix_output, prefix_lse, suffix_output, suffix_lse)
    checks.check_tensor("prefix_output", prefix_output, ndim=3, dtypes=FLOAT_DTYPES)
    device = prefix_output.device
    tokens, heads, _ = prefix_output.shape
    checks.check_tensor("suffix_output", suffix_output, ndim=3, dtypes=(prefix_output.dtype,), shape=tuple(prefix_output.shape), device=device)
    lse_dtypes = (torch.float32, torch.float64)
    checks.check_tensor("prefix_lse", prefix_lse, ndim=2, dtypes=lse_dtypes, shape=(heads, tokens), device=device)
    checks.check_tensor("suffix_lse", suffix_lse, ndim=2, dtypes=(prefix_lse.dtype,), shape=(heads, tokens), device=device)
    if _use_triton(prefix_output) and prefix_lse.dtype == torch.float32:
        from mla_multi.kernels.merge import merge_attn_states as merge_kernel

        return merge_kernel(prefix_output, prefix_lse, suffix_output, suffix_lse)
    return reference.merge_attn_states_reference(prefix_output, prefix_lse, suffix_output, suffix_lse)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, *, scale=None) -> None:
    """Write rows [kv_c | k_pe] into the paged latent cache.

    kv_c [T, Lkv], k_pe [T, R], kv_cache [num_blocks, block_size, Lkv + R],
    slot_mapping [T] int64 (or int32); a negative slot skips that token; a slot
    named by several tokens gets each element from one of them (concurrent
    writers: which one is unspecified, and on a GPU rows may interleave). An fp8
    cache is written as value / scale saturated to the fp8 range. Without the
    data checks a slot past the cache is skipped too and recorded for
    `raise_pending_errors`. Zero tokens are a no-op in every cache format.
    `scale` must be finite and positive, and is refused for a cache that is
    not FP8 (ValueError naming it).
    """
    if torch.compiler.is_compiling():
        return library.concat_and_cache_mla_traced(kv_c, k_pe, kv_cache, slot_mapping, scale=scale)
    try:
        key = (_layout(kv_c), _layout(k_pe), _layout(kv_cache), _layout(slot_mapping),
               _layout(scale) if torch.is_tensor(scale) else scale, envs.snapshot())
        plan = _CACHE_WRITE_PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks below say what was wrong
        key = plan = None
    if plan is not None:
        # checked when planned; the data checks run on every call where they are on
        if plan.data_checks:
            checks.report_pending_errors(plan.device)
            checks.check_scale("scale", scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
            checks.check_slot_data(slot_mapping, kv_cache.shape[0] * kv_cache.shape[1])
        plan.launch(kv_c, k_pe, kv_cache, slot_mapping, plan.scale if plan.scale is not None else scale)
        return None
    checks.check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES)
    device = kv_c.device
    tokens = kv_c.shape[0]
    checks.check_tensor("k_pe", k_pe, ndim=2, dtypes=(kv_c.dtype,), shape=(tokens, None), device=device)
    if torch.is_tensor(kv_cache) and kv_cache.dtype == torch.uint8:
        return _concat_and_cache_fp8_ds_mla(kv_c, k_pe, kv_cache, slot_mapping, scale)
    width = kv_c.shape[1] + k_pe.shape[1]
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=CACHE_DTYPES, shape=(None, None, width), device=device)
    checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(tokens,), device=device)
    checks.check_scale("scale", scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache={checks.describe(kv_cache)} is not contiguous; accepted: a contiguous cache")
    checks.report_pending_errors(device)
    checks.check_slot_data(slot_mapping, kv_cache.shape[0] * kv_cache.shape[1])
    if tokens == 0:  # a step without new tokens (an idle rank, a drained batch): nothing to write
        return None
    if _use_triton(kv_cache) and _use_triton(kv_c):
        from mla_multi.kernels.cache_ops import concat_and_cache_mla as cache_kernel

        scale_tensor = _scale_tensor(scale, kv_cache.device)
        cache_kernel(kv_c, k_pe, kv_cache, slot_mapping.long(), scale_tensor)
        if key is not None and kv_cache.device.type == "cuda" and slot_mapping.dtype == torch.int64:
            from mla_multi.kernels.cache_ops import ConcatAndCachePlan

            plan = ConcatAndCachePlan(kv_c, k_pe, kv_cache, slot_mapping, scale_tensor, errors.error_flag(device))
            plan.device = device
            plan.data_checks = checks.data_checks_enabled(device)
            plan.scale = None if torch.is_tensor(scale) else scale_tensor
            _remember(_CACHE_WRITE_PLANS, key, plan)
        return None
    reference.concat_and_cache_mla_reference(kv_c, k_pe, kv_cache, slot_mapping, scale)


def _concat_and_cache_fp8_ds_mla(kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
    """concat_and_cache_mla into a uint8 [num_blocks, block_size, 656] cache (FlashMLA's fp8_ds_mla layout:
    `mla_multi.ds_mla_cache`), tile scales from the data."""
    from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES, KV_LORA_RANK, ROPE_DIM, quantize_fp8_ds_mla

    device = kv_c.device
    tokens = kv_c.shape[0]
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(torch.uint8,), shape=(None, None, FP8_DS_MLA_BYTES),
                        device=device)
    if (kv_c.shape[1], k_pe.shape[1]) != (KV_LORA_RANK, ROPE_DIM):
        raise ValueError(f"kv_c / k_pe widths {kv_c.shape[1]} / {k_pe.shape[1]} for an fp8_ds_mla cache; "
                         f"accepted: {KV_LORA_RANK} / {ROPE_DIM}")
    if scale is not None:
        raise ValueError(f"scale={scale!r} with an fp8_ds_mla cache, whose tile scales come from the data; accepted: None")
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache={checks.describe(kv_cache)} is not contiguous; accepted: a contiguous cache")
    checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(tokens,), device=device)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    checks.report_pending_errors(device)
    checks.check_slot_data(slot_mapping, num_slots)
    if tokens == 0:  # a step without new tokens: nothing to write
        return None
    slots = slot_mapping.long()
    # a negative slot skips its token; a slot past the cache is skipped too and recorded
    errors.error_flag(device).bitwise_or_((slots >= num_slots).any().to(torch.int32) * errors.SLOT)
    keep = (slots >= 0) & (slots < num_slots)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    # PyTorch's write: selecting the kept tokens reads the mask on the host (a synchronisation on GPUs)
    kept = torch.nonzero(keep).flatten()
    kv_cache.view(num_slots, FP8_DS_MLA_BYTES).index_copy_(0, slots[kept], rows[kept])


# layout key -> the checked, bound cache write (GPU tensors; see _DECODE_PLANS)
_CACHE_WRITE_PLANS: dict = {}


def gather_cache(
    kv_cache, block_table, seq_starts, seq_lens, *, scale=None, out_dtype=None, cu_seq_lens=None, num_tokens=None,
    out=None,
) -> torch.Tensor:
    """Gather cached rows of several requests into one contiguous tensor.

    kv_cache [num_blocks, block_size, W]; block_table [B, max_blocks] int32;
    seq_starts, seq_lens [B]: request i contributes its positions seq_starts[i]
    .. seq_starts[i] + seq_lens[i] - 1. Returns [sum(seq_lens), W] in
    `out_dtype` (default: the cache dtype; bfloat16 for an fp8 cache, dequantised
    with `scale`). Reads seq_lens on the host to size the output unless the
    caller passes `cu_seq_lens` ([B + 1] int32 on the device) and `num_tokens`.
    `out` ([num_tokens, W] of the output dtype, on the GPU path) receives the
    rows instead of a new tensor.
    Without the data checks a row outside its block-table row or in a block
    outside the cache is NaN, a negative length gives no rows; both are
    recorded for `raise_pending_errors`. `scale` must be finite and positive,
    and is refused for a cache that is not FP8 (ValueError naming it).
    """
    if torch.compiler.is_compiling():
        return library.gather_cache_traced(
            kv_cache, block_table, seq_starts, seq_lens,
            scale=scale, out_dtype=out_dtype, cu_seq_lens=cu_seq_lens, num_tokens=num_tokens,
        )
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=CACHE_DTYPES)
    device = kv_cache.device
    checks.check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    batch = block_table.shape[0]
    checks.check_tensor("seq_starts", seq_starts, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(batch,), device=device)
    checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(batch,), device=device)
    checks.check_scale("scale", scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES + (kv_cache.dtype,):
        raise ValueError(f"out_dtype={out_dtype}; accepted: a float dtype")
    checks.report_pending_errors(device)
    checks.check_non_negative_data("seq_starts", seq_starts)
    checks.check_non_negative_data("seq_lens", seq_lens)
    checks.check_block_table_data(
        block_table, seq_starts.long() + seq_lens.long(), kv_cache.shape[0], kv_cache.shape[1], name="seq_starts + seq_lens"
    )
    if _use_triton(kv_cache) and out_dtype != torch.float64:
        from mla_multi.kernels.cache_ops import gather_cache as gather_kernel

        if cu_seq_lens is None:
            # A negative length contributes no rows, as in the PyTorch version;
            # it is recorded on the device without a synchronisation.
            negative = seq_lens < 0
            error_bits = negative.any().to(torch.int32) * errors.SEQ_RANGE
            errors.error_flag(device).bitwise_or_(error_bits)
            cu_seq_lens = torch.zeros(batch + 1, dtype=torch.int32, device=device)
            cu_seq_lens[1:] = seq_lens.masked_fill(negative, 0).cumsum(0)
        if num_tokens is None:
            num_tokens = max(0, int(cu_seq_lens[-1]))
        dtype = out_dtype or (torch.bfloat16 if kv_cache.dtype in FP8_DTYPES else kv_cache.dtype)
        if out is None:
            out = torch.empty(num_tokens, kv_cache.shape[-1], dtype=dtype, device=device)
        else:
            checks.check_tensor("out", out, ndim=2, dtypes=(dtype,), shape=(num_tokens, kv_cache.shape[-1]), device=device)
        return gather_kernel(
            kv_cache, block_table, cu_seq_lens.to(torch.int32), seq_starts.to(torch.int32), out,
            _scale_tensor(scale, device),
        )
    return reference.gather_cache_reference(kv_cache, block_table, seq_starts, seq_lens, scale, out_dtype)
