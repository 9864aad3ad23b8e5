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
from mla_multi.registry import names as registry_names
from mla_multi.registry import select_decode_backend, select_prefill_backend

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES

__all__ = [
    "mla_decode",
    "mla_prefill",
    "mla_sparse_decode",
    "mla_sparse_prefill",
    "mla_sparse_decode_v4",
    "mla_sparse_prefill_v4",
    "concat_and_cache_mla_v4",
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


def _check_backend_arg(phase: str, backend) -> None:
    """A ValueError naming `backend` unless it is None or a string (the registry then says whether it names a
    backend of `phase`), listing the valid names; a list or another unhashable value is refused here, before it
    reaches a plan cache's key."""
    if backend is None or isinstance(backend, str):
        return
    raise ValueError(f"backend={backend!r} ({type(backend).__name__}); accepted: None (the registry chooses) or one "
                     f"{phase} backend name: {', '.join(registry_names(phase))}")


def _use_triton(tensor: torch.Tensor) -> bool:
    """Triton kernels serve GPU tensors (float64 excepted), and CPU tensors under Triton's interpreter;
    the PyTorch versions serve the rest."""
    if tensor.dtype == torch.float64:
        return False
    if tensor.device.type == "cuda":
        return True
    from mla_multi.kernels import interpreter_active

    return tensor.device.type == "cpu" and interpreter_active()


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` where its rows are contiguous (what the cache writers' kernels read), else a contiguous copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


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
    _check_backend_arg("decode", backend)
    try:
        key = _decode_plan_key(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend)
        key += (bool(return_lse),)
    except (AttributeError, TypeError):  # not tensors: the checks below say what was wrong
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend,
                            needs_lse=bool(return_lse))
        _remember(key, plan)
    elif checks.planned_checks_run(plan.data_checks, plan.device):
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


# The plans of the functional ops (the one cache they keep), by op and key: a repeated call with the same
# shapes, strides, dtypes, devices, alignment, options and MLA_MULTI_* environment skips the checks that the
# first call ran, the backend selection and the impl's binding (`MLADecodeImpl.bind`: for TRITON the split
# count, the launch configuration and Triton's argument binding).
_PLANS: dict = {}
_PLANS_MAX = 256


def _remember(key, plan) -> None:
    """Keep `plan` under `key` (None: arguments without a layout, never kept), at most _PLANS_MAX plans."""
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan


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
        "mla_decode", _layout(q_nope), _layout(q_pe), _layout(kv_cache), _layout(block_table), _layout(seq_lens),
        scale_key, num_kv_splits, backend, envs.snapshot(),
    )


class _DecodePlan:
    """What `mla_decode` decided for one key: the backend and the impl's launch bound to the key's layout
    (`MLADecodeImpl.bind`: for TRITON the split count and the bound kernels, whose partials an eager call
    slices from the device's shared workspace)."""

    def __init__(self, backend_cls, launch, device, data_checks: bool, k_scale) -> None:
        self.backend_cls = backend_cls
        self.launch = launch
        self.device = device
        self.data_checks = data_checks
        self.k_scale = k_scale  # the tensor of a float k_scale, made once

    def run(self, q_nope, q_pe, kv_cache, block_table, seq_lens, scale, k_scale, out=None, lse=None,
            attn_logits=None):
        """(out, lse) of tensors with the plan's key; `out` / `lse` / `attn_logits`, when given, are
        contiguous tensors of the shapes and dtypes the plan would allocate (checked by the caller)."""
        if self.k_scale is not None or not torch.is_tensor(k_scale):
            k_scale = self.k_scale
        if seq_lens.dtype != torch.int32:
            seq_lens = seq_lens.to(torch.int32)
        return self.launch(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, k_scale=k_scale, out=out, lse=lse,
                           attn_logits=attn_logits)


def _width_source(first: str, first_tensor, second: str, second_tensor) -> str:
    """Where a cache's expected width comes from, naming both arguments (either may be the one at fault)."""
    a, b = first_tensor.shape[-1], second_tensor.shape[-1]
    return f"{first}'s {a} + {second}'s {b} columns; DeepSeek's MLA: 512 + 64"


def _plan_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale, num_kv_splits, backend,
                 needs_lse: bool = False) -> _DecodePlan:
    """Check the inputs of `mla_decode` (all of them, once per key) and decide how to run them."""
    checks.check_tensor("q_nope", q_nope, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    device = q_nope.device
    checks.check_tensor("q_pe", q_pe, ndim=q_nope.dim(), dtypes=(q_nope.dtype,), shape=(*q_nope.shape[:-1], None), device=device,
                        shape_from="q_nope's leading dims")
    width = q_nope.shape[-1] + q_pe.shape[-1]
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=CACHE_DTYPES, shape=(None, None, width), device=device,
                        shape_from=_width_source("q_nope", q_nope, "q_pe", q_pe))
    batch = q_nope.shape[0]
    checks.check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), shape=(batch, None), device=device,
                        shape_from="one row per request of q_nope")
    checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(batch,), device=device,
                        shape_from="one per request of q_nope")
    checks.check_scale("k_scale", k_scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
    checks.check_positive_int("num_kv_splits", num_kv_splits, allow_none=True)
    checks.report_pending_errors(device)
    checks.check_block_table_data(block_table, seq_lens, kv_cache.shape[0], kv_cache.shape[1])

    num_heads = q_nope.shape[-2]
    q_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
    dims = MLADims(num_heads, kv_lora_rank=q_nope.shape[-1], qk_rope_head_dim=q_pe.shape[-1])
    backend_cls = select_decode_backend(
        dims, q_nope.dtype, kv_cache.dtype, kv_cache.shape[1], max_query_len=q_len, backend=backend,
        num_tokens=batch * q_len, needs_lse=needs_lse,
    )
    impl = backend_cls.get_decode_impl_cls()(
        num_heads, 1.0, dims.kv_lora_rank, dims.qk_rope_head_dim, kv_cache.dtype, kv_cache.shape[1], device
    )
    scale_tensor = None if k_scale is None or torch.is_tensor(k_scale) else _scale_tensor(k_scale, device)
    launch = impl.bind(q_nope, q_pe, kv_cache, block_table, seq_lens,
                       k_scale=k_scale if torch.is_tensor(k_scale) else scale_tensor, num_kv_splits=num_kv_splits)
    return _DecodePlan(backend_cls, launch, device, checks.data_checks_enabled(device), scale_tensor)


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
        self.num_kv_splits = plan.launch.num_kv_splits
        self._out_shape = shape
        self._dtype = dtype
        self._attn_logits = plan.launch.new_partials()  # the plan's own partials, where the backend keeps any

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
        if checks.planned_checks_run(plan.data_checks, plan.device):
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
    _check_backend_arg("decode", backend)
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
        if checks.planned_checks_run(self._plan.data_checks, q.device):
            _check_prefill_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        cu_seqlens_q, cu_seqlens_k = checks.as_int32(cu_seqlens_q), checks.as_int32(cu_seqlens_k)
        return self._plan.impl.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              causal=self.causal, return_softmax_lse=self.return_lse)


def plan_mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, *, causal=True,
                     return_lse=False, backend=None) -> MLAPrefillPlan:
    """Plan `mla_prefill` for tensors laid out as these; `MLAPrefillPlan.run` then skips the checks and the
    selection. Arguments as in `mla_prefill` (max_seqlen_* are fixed by the plan)."""
    _check_backend_arg("prefill", backend)
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
    q_scale=None,
    k_scale=None,
    v_scale=None,
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

    FP8 prefill: k and v in one FP8 type with their per-tensor dequantisation scales `k_scale` / `v_scale`
    (a finite positive float or a 1-element float tensor), q float (the backend quantises it per tensor where
    its kernel takes an FP8 query) or FP8 with `q_scale`; the output is q's dtype, bfloat16 for an FP8 q.
    ROCM_AITER runs it on gfx950 (aiter's FP8 MLA prefill: new tokens, no LSE), REFERENCE anywhere (the
    dequantised values in float32); a scale given with float k / v is refused (ValueError naming it).
    """
    if torch.compiler.is_compiling():
        return library.mla_prefill_traced(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
            causal=causal, return_lse=return_lse, backend=backend, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        )
    _check_backend_arg("prefill", backend)
    try:
        key = (
            "mla_prefill", _layout(q), _layout(k), _layout(v), _layout(cu_seqlens_q), _layout(cu_seqlens_k),
            max_seqlen_q, max_seqlen_k, scale, bool(causal), backend, _scale_key(q_scale), _scale_key(k_scale),
            _scale_key(v_scale), envs.snapshot(),
        )
        hash(key)
    except (AttributeError, TypeError):  # not tensors (or unhashable): the checks say what was wrong
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend,
                             q_scale, k_scale, v_scale)
        _remember(key, plan)
    elif checks.planned_checks_run(plan.data_checks, q.device):
        _check_prefill_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if plan.fp8:  # a float scale is part of the key, checked when planned; a tensor's value is not
            for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
                if torch.is_tensor(value):
                    checks.check_scale(name, value, required=True)
    cu_seqlens_q, cu_seqlens_k = checks.as_int32(cu_seqlens_q), checks.as_int32(cu_seqlens_k)  # int64 taken too
    scales = dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale) if plan.fp8 else {}
    return plan.impl.forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, return_softmax_lse=return_lse,
        **scales,
    )


class _PrefillPlan:
    """What `mla_prefill` decided for one key: the backend and its impl (whose wrappers and plans persist)."""

    def __init__(self, backend_cls, impl, data_checks: bool, fp8: bool = False) -> None:
        self.backend_cls = backend_cls
        self.impl = impl
        self.data_checks = data_checks
        self.fp8 = fp8  # FP8 k / v: the impl takes q_scale, k_scale and v_scale


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


def _check_prefill_fp8(q, k, q_scale, k_scale, v_scale) -> bool:
    """Whether k / v are FP8 (then their scales are required, and q is float or FP8 with q_scale); a scale given
    with float k / v is refused. The tensors' dtypes: `_plan_prefill`'s checks."""
    fp8 = torch.is_tensor(k) and k.dtype in FP8_DTYPES
    if not fp8:
        for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise ValueError(f"{name}={checks.describe(value)} with {checks.describe(k)} keys (not FP8: "
                                 f"nothing is scaled); accepted: {name}=None, or FP8 k and v with their scales")
        return False
    checks.check_scale("k_scale", k_scale, required=True, scaled="FP8 k")
    checks.check_scale("v_scale", v_scale, required=True, scaled="FP8 v")
    if torch.is_tensor(q) and q.dtype in FP8_DTYPES:
        checks.check_scale("q_scale", q_scale, required=True, scaled="an FP8 q")
    elif q_scale is not None:
        raise ValueError(f"q_scale={checks.describe(q_scale)} with a {checks.describe(q)} query (not FP8: the "
                         "backend quantises a float query itself); accepted: q_scale=None, or an FP8 query")
    return True


def _plan_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend, q_scale=None,
                  k_scale=None, v_scale=None) -> _PrefillPlan:
    """Check the inputs of `mla_prefill` (all of them, once per key) and choose the backend."""
    fp8 = _check_prefill_fp8(q, k, q_scale, k_scale, v_scale)
    checks.check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES + ((k.dtype,) if fp8 else ()))
    device = q.device
    num_heads, qk_head_dim = q.shape[1], q.shape[2]
    kv_dtypes = FP8_DTYPES if fp8 else (q.dtype,)
    checks.check_tensor("k", k, ndim=3, dtypes=kv_dtypes, shape=(None, num_heads, qk_head_dim), device=device,
                        shape_from="q's heads and head dim")
    checks.check_tensor("v", v, ndim=3, dtypes=(k.dtype,), shape=(k.shape[0], num_heads, None), device=device,
                        shape_from="k's tokens, q's heads")
    checks.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=checks.INDEX_DTYPES, device=device)
    checks.check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(cu_seqlens_q.shape[0],),
                        device=device, shape_from="cu_seqlens_q's length")
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
    # FP8 k / v select by their dtype: the backends that take it run FP8 prefill
    backend_cls = select_prefill_backend(dims, k.dtype if fp8 else q.dtype, backend=backend)
    impl = backend_cls.get_prefill_impl_cls()(
        num_heads, scale, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, device
    )
    return _PrefillPlan(backend_cls, impl, checks.data_checks_enabled(device), fp8)


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
    _check_backend_arg("sparse_decode", backend)
    try:
        key = ("mla_sparse_decode", _layout(q_nope), _layout(q_pe), _layout(kv_cache), _layout(indices), _scale_key(k_scale),
               _optional_layout(topk_length), _optional_layout(attn_sink), backend, envs.snapshot())
    except (AttributeError, TypeError):  # not tensors: the checks say what was wrong
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_sparse_decode(q_nope, q_pe, kv_cache, indices, k_scale, topk_length, attn_sink, backend)
        _remember(key, plan)
    elif checks.planned_checks_run(plan.data_checks, plan.device):
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
    if plan.k_scale is not None:
        k_scale = plan.k_scale
    launch = plan.launch
    if launch is None:  # the layout's first call: the impl binds it (the plan's key holds every layout it reads)
        launch = plan.impl.bind(q_nope, q_pe, kv_cache, indices, k_scale=k_scale, topk_length=lengths,
                                attn_sink=attn_sink)
        if key is not None:
            plan.launch = launch
    out, lse = launch(q_nope, q_pe, kv_cache, indices, scale, k_scale=k_scale, topk_length=lengths, attn_sink=attn_sink)
    return _sparse_result(plan, out, lse, heads, return_lse)


def _sparse_result(plan, out, lse, heads: int, return_lse: bool):
    """A sparse op's (out, lse) in the caller's leading shape ([B, Q, ..] where the query had it), the LSE only
    where asked (and a clear error where the backend returns none)."""
    if len(plan.lead) > 1:
        out = out.reshape(*plan.lead, heads, out.shape[-1])
        lse = None if lse is None else lse.reshape(*plan.lead, heads)
    if not return_lse:
        return out
    _check_sparse_lse(lse, plan.backend_cls.name)
    return out, lse


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
    launch: object = None  # the impl's launch bound to the plan's layout (`MLASparseImpl.bind`), at its first call


def _check_sparse_index_data(indices, topk_length, num_slots: int, topk: int, out_of_range_is_bad: bool,
                             name: str = "indices", lengths_name: str = "topk_length") -> None:
    """With the data checks on: decode indices inside [-1, num_slots), topk_length inside [0, topk]."""
    if out_of_range_is_bad:
        values = indices.detach().cpu()
        bad = values[(values < -1) | (values >= num_slots)]
        if bad.numel():
            raise ValueError(f"{name} hold {bad[:8].tolist()}; accepted: -1 (no token) or slots in [0, {num_slots})")
    if topk_length is not None:
        lengths = topk_length.detach().cpu()
        if bool((lengths < 0).any()) or bool((lengths > topk).any()):
            raise ValueError(f"{lengths_name}={lengths.tolist()}; accepted: values in [0, {topk}]")


def _plan_sparse_decode(q_nope, q_pe, kv_cache, indices, k_scale, topk_length, attn_sink, backend) -> _SparsePlan:
    checks.check_tensor("q_nope", q_nope, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    device = q_nope.device
    checks.check_tensor("q_pe", q_pe, ndim=q_nope.dim(), dtypes=(q_nope.dtype,), shape=(*q_nope.shape[:-1], None),
                        device=device, shape_from="q_nope's leading dims")
    lead = tuple(q_nope.shape[:-2])
    heads = q_nope.shape[-2]
    checks.check_tensor("indices", indices, ndim=len(lead) + 1, dtypes=(torch.int32,), shape=(*lead, None),
                        device=device, shape_from="one list per query token of q_nope")
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
        raise ValueError(f"kv_cache has width {kv_cache.shape[-1]}; accepted: {width} "
                         f"({_width_source('q_nope', q_nope, 'q_pe', q_pe)}) or a uint8 "
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
    _check_backend_arg("sparse_prefill", backend)
    checks.check_tensor("q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    device = q_nope.device
    tokens, heads = q_nope.shape[0], q_nope.shape[1]
    checks.check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,), shape=(tokens, heads, None), device=device,
                        shape_from="q_nope's tokens and heads")
    width = q_nope.shape[-1] + q_pe.shape[-1]
    checks.check_tensor("kv", kv, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, width), device=device,
                        shape_from=_width_source("q_nope", q_nope, "q_pe", q_pe))
    checks.check_tensor("indices", indices, ndim=2, dtypes=(torch.int32,), shape=(tokens, None), device=device,
                        shape_from="one list per token of q_nope")
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
    checks.check_tensor("suffix_output", suffix_output, ndim=3, dtypes=(prefix_output.dtype,), shape=tuple(prefix_output.shape), device=device,
                        shape_from="prefix_output's shape")
    lse_dtypes = (torch.float32, torch.float64)
    checks.check_tensor("prefix_lse", prefix_lse, ndim=2, dtypes=lse_dtypes, shape=(heads, tokens), device=device,
                        shape_from="[heads, tokens] of prefix_output")
    checks.check_tensor("suffix_lse", suffix_lse, ndim=2, dtypes=(prefix_lse.dtype,), shape=(heads, tokens), device=device,
                        shape_from="[heads, tokens] of prefix_output")
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
        key = ("concat_and_cache_mla", _layout(kv_c), _layout(k_pe), _layout(kv_cache), _layout(slot_mapping),
               _layout(scale) if torch.is_tensor(scale) else scale, envs.snapshot())
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks below say what was wrong
        key = plan = None
    if plan is not None:
        return plan.run(kv_c, k_pe, kv_cache, slot_mapping, scale)
    checks.check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES)
    device = kv_c.device
    tokens = kv_c.shape[0]
    checks.check_tensor("k_pe", k_pe, ndim=2, dtypes=(kv_c.dtype,), shape=(tokens, None), device=device,
                        shape_from="kv_c's tokens")
    if torch.is_tensor(kv_cache) and kv_cache.dtype == torch.uint8:
        return _concat_and_cache_fp8_ds_mla(key, kv_c, k_pe, kv_cache, slot_mapping, scale)
    width = kv_c.shape[1] + k_pe.shape[1]
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=CACHE_DTYPES, shape=(None, None, width), device=device,
                        shape_from=_width_source("kv_c", kv_c, "k_pe", k_pe))
    checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(tokens,), device=device,
                        shape_from="one slot per token of kv_c")
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
        write = cache_kernel(kv_c, k_pe, kv_cache, slot_mapping.long(), scale_tensor)
        if key is not None and kv_cache.device.type == "cuda" and slot_mapping.dtype == torch.int64:
            _remember(key, _WritePlan(write, device, None if torch.is_tensor(scale) else scale_tensor))
        return None
    reference.concat_and_cache_mla_reference(kv_c, k_pe, kv_cache, slot_mapping, scale)


class _WritePlan:
    """A cache write planned for one layout, kept in `_PLANS`: the kernel module's bound write of that layout
    (`ConcatAndCachePlan`, `QuantizedCacheWrite`), its device, whether the data checks ran when it was planned
    (a key of its own for each environment: the bound write is shared), the scale tensor it launches with
    (None: the call's)."""

    __slots__ = ("write", "device", "data_checks", "scale")

    def __init__(self, write, device: torch.device, scale) -> None:
        self.write = write
        self.device = device
        self.data_checks = checks.data_checks_enabled(device)
        self.scale = scale

    def run(self, kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
        """Checked when planned: the data checks again where they were on, then only the launch."""
        if checks.planned_checks_run(self.data_checks, self.device):
            checks.report_pending_errors(self.device)
            checks.check_scale("scale", scale, required=kv_cache.dtype in FP8_DTYPES, refuse_unused=True)
            checks.check_slot_data(slot_mapping, kv_cache.shape[0] * kv_cache.shape[1])
        self.write.launch(kv_c, k_pe, kv_cache, slot_mapping, self.scale if self.scale is not None else scale)


def _write_quantized(key, kv_c, k_pe, kv_cache, slot_mapping, kv_format: str) -> None:
    """The byte-format write by the kernel (`concat_and_cache_quantized`), kept under `key` for the next call
    of this layout on a GPU where the rows are contiguous (the checks then skipped but the data checks)."""
    from mla_multi.kernels.cache_ops import concat_and_cache_quantized

    rows_c, rows_pe = _rows(kv_c), _rows(k_pe)
    write = concat_and_cache_quantized(rows_c, rows_pe, kv_cache, slot_mapping, kv_format)
    if (key is not None and write is not None and kv_cache.device.type == "cuda" and rows_c is kv_c
            and rows_pe is k_pe):
        _remember(key, _WritePlan(write, kv_cache.device, None))


def _concat_and_cache_fp8_ds_mla(key, kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
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
    if _use_triton(kv_c):  # one launch, no host synchronisation (CUDA graphs)
        _write_quantized(key, kv_c, k_pe, kv_cache, slot_mapping, "fp8_ds_mla")
        return None
    slots = slot_mapping.long()
    # a negative slot skips its token; a slot past the cache is skipped too and recorded
    errors.error_flag(device).bitwise_or_((slots >= num_slots).any().to(torch.int32) * errors.SLOT)
    keep = (slots >= 0) & (slots < num_slots)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    # PyTorch's write: selecting the kept tokens reads the mask on the host (a synchronisation on GPUs)
    kept = torch.nonzero(keep).flatten()
    kv_cache.view(num_slots, FP8_DS_MLA_BYTES).index_copy_(0, slots[kept], rows[kept])


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
    checks.check_tensor("seq_starts", seq_starts, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(batch,), device=device,
                        shape_from="one per row of block_table")
    checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(batch,), device=device,
                        shape_from="one per row of block_table")
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



# --------------------------------------------------------------------------- the V4 contract
#
# DeepSeek-V4 / V4.1 sparse MLA: q [.., N, 512] (448 latent + 64 RoPE dims: d_qk = 512), the value the whole
# 512-wide row (d_v = 512), caches in the formats of `mla_multi.cache_formats`, an attention sink, and a second
# KV segment (the sliding window of recent tokens in V4) softmaxed together with the top-k segment. The ops
# carry the suffix ``_v4``; the second segment's arguments are FlashMLA's extra_k_cache /
# extra_indices_in_kvcache / extra_topk_length under the names extra_kv_cache / extra_indices /
# extra_topk_length.

V4_WIDTH = 512
V4_ROPE = 64
_V4_MAIN_FORMATS = ("fp8_ds_mla_v4", "fp8_ds_mla_v41")


def _v4_cache_format(name: str, cache, kv_format, device, *, extra_of: str | None = None) -> str:
    """The V4 format of the cache argument `name` ("rows" for a float [num_blocks, block_size, 512] cache);
    `extra_of`: the main cache's format, for the second segment's cache."""
    from mla_multi import cache_formats

    if torch.is_tensor(cache) and cache.dtype != torch.uint8 and kv_format in (None, "rows"):
        checks.check_tensor(name, cache, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, V4_WIDTH), device=device)
        fmt = "rows"
    else:
        checks.check_tensor(name, cache, ndim=3, dtypes=(torch.uint8,), device=device)
        fmt = cache_formats.check_cache(name, cache, None if kv_format == "rows" else kv_format,
                                        accepted=cache_formats.V4_FORMATS).name
    if extra_of is None:
        if fmt != "rows" and cache_formats.FORMATS[fmt].second_segment_only:
            mains = " or ".join(cache_formats.FORMATS[fmt].main_formats)
            raise ValueError(f"{name} is a {fmt} cache, which serves only as the second KV segment (beside a "
                             f"{mains} cache); accepted for {name}: {', '.join(_V4_MAIN_FORMATS)} or float rows")
        return fmt
    # the main cache's format, or a format that declares it may accompany it (V4.1 FP4 beside V4.1)
    allowed = (extra_of,) + tuple(f.name for f in cache_formats.FORMATS.values() if extra_of in f.main_formats)
    if fmt not in allowed:
        raise ValueError(f"{name} is a {fmt} cache beside a {extra_of} kv_cache; accepted: {', '.join(allowed)}")
    return fmt


@dataclasses.dataclass
class _SparseV4Plan:
    backend_cls: type
    impl: object
    device: torch.device
    lead: tuple
    tokens: int
    heads: int
    q_len: int
    kv_format: str
    extra_kv_format: str | None
    num_slots: int
    extra_num_slots: int
    data_checks: bool
    launch: object = None  # the impl's launch bound to the plan's layout (`MLASparseImpl.bind_v4`), at its first call


def _plan_sparse_v4(phase, q, kv, indices, kv_format, topk_length, attn_sink, extra_kv, extra_indices,
                    extra_topk_length, extra_kv_format, backend, *, kv_name: str, extra_name: str) -> _SparseV4Plan:
    decode = phase == "sparse_decode"
    checks.check_tensor("q", q, ndim=(3, 4) if decode else 3, dtypes=FLOAT_DTYPES)
    device = q.device
    if q.shape[-1] != V4_WIDTH:
        raise ValueError(f"q={checks.describe(q)}; the V4 contract takes q [.., N, {V4_WIDTH}] (448 latent + "
                         f"{V4_ROPE} RoPE dims)")
    lead = tuple(q.shape[:-2])
    heads = q.shape[-2]
    batch = lead[0]
    q_len = lead[1] if len(lead) == 2 else 1
    tokens = batch * q_len
    if decode:
        fmt = _v4_cache_format(kv_name, kv, kv_format, device)
        num_slots = kv.shape[0] * kv.shape[1]
    else:
        if kv_format not in (None, "rows"):
            raise ValueError(f"kv_format={kv_format!r}; the V4 sparse prefill reads float rows: accepted None or 'rows'")
        checks.check_tensor(kv_name, kv, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, V4_WIDTH), device=device)
        fmt, num_slots = "rows", kv.shape[0]
    checks.check_tensor("indices", indices, ndim=len(lead) + 1, dtypes=(torch.int32,), shape=(*lead, None),
                        device=device)
    if topk_length is not None:
        checks.check_tensor("topk_length", topk_length, ndim=1, dtypes=(torch.int32,), shape=(batch,), device=device)
    if attn_sink is not None:
        checks.check_tensor("attn_sink", attn_sink, ndim=1, dtypes=(torch.float32,), shape=(heads,), device=device)
    extra_fmt, extra_slots = None, 0
    if extra_kv is None:
        for name, value in (("extra_indices", extra_indices), ("extra_topk_length", extra_topk_length),
                            ("extra_kv_format", extra_kv_format)):
            if value is not None:
                raise ValueError(f"{name} is given without {extra_name}; a second KV segment needs {extra_name} and "
                                 "extra_indices")
    else:
        if extra_indices is None:
            raise ValueError(f"{extra_name} is given without extra_indices; a second KV segment needs its own "
                             "indices (int32 [.., extra_topk])")
        if decode:
            extra_fmt = _v4_cache_format(extra_name, extra_kv, extra_kv_format, device, extra_of=fmt)
            extra_slots = extra_kv.shape[0] * extra_kv.shape[1]
        else:
            if extra_kv_format not in (None, "rows"):
                raise ValueError(f"extra_kv_format={extra_kv_format!r}; the V4 sparse prefill reads float rows: "
                                 "accepted None or 'rows'")
            checks.check_tensor(extra_name, extra_kv, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, V4_WIDTH),
                                device=device)
            extra_fmt, extra_slots = "rows", extra_kv.shape[0]
        checks.check_tensor("extra_indices", extra_indices, ndim=len(lead) + 1, dtypes=(torch.int32,),
                            shape=(*lead, None), device=device)
        if extra_topk_length is not None:
            checks.check_tensor("extra_topk_length", extra_topk_length, ndim=1, dtypes=(torch.int32,),
                                shape=(batch,), device=device)
    checks.report_pending_errors(device)
    data_checks = checks.data_checks_enabled(device)
    dims = MLADims(heads, kv_lora_rank=V4_WIDTH - V4_ROPE, qk_rope_head_dim=V4_ROPE)
    from mla_multi.registry import select_sparse_backend

    topk = indices.shape[-1] + (extra_indices.shape[-1] if extra_indices is not None else 0)
    backend_cls = select_sparse_backend(
        phase, dims, q.dtype, kv.dtype, max(topk, 1), max_query_len=q_len, backend=backend,
        num_tokens=tokens, with_lengths=topk_length is not None or extra_topk_length is not None, kv_format=fmt,
        extra_kv_format=extra_fmt, with_sink=attn_sink is not None,
    )
    impl = backend_cls.get_impl_cls()(heads, dims.kv_lora_rank, dims.qk_rope_head_dim, device)
    plan = _SparseV4Plan(backend_cls, impl, device, lead, tokens, heads, q_len, fmt, extra_fmt, num_slots,
                         extra_slots, data_checks)
    if data_checks:
        _check_v4_plan_data(plan, decode, indices, topk_length, extra_indices, extra_topk_length)
    return plan


def _check_v4_plan_data(plan, decode, indices, topk_length, extra_indices, extra_topk_length) -> None:
    _check_sparse_index_data(indices, topk_length, plan.num_slots, indices.shape[-1], decode)
    if extra_indices is not None:
        _check_sparse_index_data(extra_indices, extra_topk_length, plan.extra_num_slots, extra_indices.shape[-1],
                                 decode, name="extra_indices", lengths_name="extra_topk_length")


def _run_sparse_v4(op, phase, q, kv, indices, scale, kv_format, topk_length, attn_sink, extra_kv, extra_indices,
                   extra_topk_length, extra_kv_format, backend, return_lse, *, kv_name, extra_name, out=None):
    scale = checks.check_positive_float("scale", scale)
    try:
        key = (op, _layout(q), _layout(kv), _layout(indices), kv_format, _optional_layout(topk_length),
               _optional_layout(attn_sink), _optional_layout(extra_kv), _optional_layout(extra_indices),
               _optional_layout(extra_topk_length), extra_kv_format, backend, envs.snapshot())
    except (AttributeError, TypeError):  # not tensors: the checks say what was wrong
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_sparse_v4(phase, q, kv, indices, kv_format, topk_length, attn_sink, extra_kv, extra_indices,
                               extra_topk_length, extra_kv_format, backend, kv_name=kv_name, extra_name=extra_name)
        _remember(key, plan)
    elif checks.planned_checks_run(plan.data_checks, plan.device):
        checks.report_pending_errors(plan.device)
        _check_v4_plan_data(plan, phase == "sparse_decode", indices, topk_length, extra_indices, extra_topk_length)
    tokens, heads = plan.tokens, plan.heads
    if plan.q_len > 1:
        topk_length = None if topk_length is None else topk_length.repeat_interleave(plan.q_len)
        extra_topk_length = None if extra_topk_length is None else extra_topk_length.repeat_interleave(plan.q_len)
    if len(plan.lead) > 1:
        q = q.reshape(tokens, heads, V4_WIDTH)
        indices = indices.reshape(tokens, -1)
        extra_indices = None if extra_indices is None else extra_indices.reshape(tokens, -1)
    launch = plan.launch
    if launch is None:  # the layout's first call: the impl binds it (the plan's key holds every layout it reads)
        launch = plan.impl.bind_v4(q, kv, indices, kv_format=plan.kv_format, topk_length=topk_length,
                                   attn_sink=attn_sink, extra_kv=extra_kv, extra_indices=extra_indices,
                                   extra_topk_length=extra_topk_length, extra_kv_format=plan.extra_kv_format)
        if key is not None:
            plan.launch = launch
    # `out` (`sparse_decode_v4_into`): written by the kernels where the impl takes it, else copied there
    given = {"out": out} if out is not None and plan.impl.v4_takes_out else {}
    result, lse = launch(q, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink, extra_kv=extra_kv,
                         extra_indices=extra_indices, extra_topk_length=extra_topk_length, **given)
    if out is not None and result is not out:
        result = out.copy_(result)
    return _sparse_result(plan, result, lse, heads, return_lse)


def mla_sparse_decode_v4(q, kv_cache, indices, scale, *, kv_format=None, topk_length=None, attn_sink=None,
                         extra_kv_cache=None, extra_indices=None, extra_topk_length=None, extra_kv_format=None,
                         backend=None, return_lse=False):
    """Sparse MLA decode under the DeepSeek-V4 contract (d_qk = d_v = 512, the sink, a second KV segment).

    q [T, N, 512] or [B, Q, N, 512] (the absorbed query: 448 latent + 64 RoPE
    dims); kv_cache a paged cache in a `mla_multi.cache_formats` V4 format,
    ``uint8 [num_blocks, block_size, 584]`` (``fp8_ds_mla_v4``) or ``[..,
    528]`` (``fp8_ds_mla_v41``), or a float ``[num_blocks, block_size, 512]``
    cache of rows; kv_format names the format to insist on (None: found from
    the width); indices int32 [T, topk] or [B, Q, topk]: slot = block *
    block_size + offset, -1 = no token, a list (a duplicate counts twice);
    topk_length int32 [T] or [B]: only the first topk_length[i] count;
    attn_sink float32 [N]: out *= exp(lse) / (exp(lse) + exp(attn_sink)), the
    LSE returned without it (+inf gives zeros, -inf changes nothing).
    The second segment: extra_kv_cache (the format of kv_cache, or
    ``fp4_ds_mla_v41`` beside ``fp8_ds_mla_v41``; its own block size),
    extra_indices [.., extra_topk] into it, extra_topk_length; one softmax over
    the union of both segments. Returns out [.., N, 512] in q's dtype and, with
    `return_lse`, lse [.., N] (float32; float64 for a float64 query). A token
    with nothing to attend to gives 0 and -inf. An index outside [-1,
    num_slots) of its segment: NaN rows and a recorded error without the data
    checks, ValueError with them (always on CPU tensors).
    """
    if torch.compiler.is_compiling():
        return library.mla_sparse_decode_v4_traced(
            q, kv_cache, indices, scale, kv_format=kv_format, topk_length=topk_length, attn_sink=attn_sink,
            extra_kv_cache=extra_kv_cache, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
            extra_kv_format=extra_kv_format, backend=backend, return_lse=return_lse,
        )
    return _run_sparse_v4("mla_sparse_decode_v4", "sparse_decode", q, kv_cache, indices, scale, kv_format,
                          topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length, extra_kv_format,
                          backend, return_lse, kv_name="kv_cache", extra_name="extra_kv_cache")


def sparse_decode_v4_into(out, q, kv_cache, indices, scale, *, kv_format=None, topk_length=None, attn_sink=None,
                          extra_kv_cache=None, extra_indices=None, extra_topk_length=None, extra_kv_format=None,
                          backend=None) -> torch.Tensor:
    """`mla_sparse_decode_v4` of q [T, N, 512] written into `out` (contiguous [T, N, 512], q's dtype, on q's
    device; checked here): by the kernels where the backend declares `v4_takes_out`, else copied. Returns out.
    What `MLAAttentionV4` calls for its tokens (eager, or inside its own registered op)."""
    checks.check_tensor("out", out, ndim=3, dtypes=(q.dtype,), shape=tuple(q.shape), device=q.device)
    if not out.is_contiguous():
        raise ValueError(f"out has strides {tuple(out.stride())}; accepted: a contiguous [T, N, 512] tensor")
    return _run_sparse_v4("mla_sparse_decode_v4", "sparse_decode", q, kv_cache, indices, scale, kv_format,
                          topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length, extra_kv_format,
                          backend, False, kv_name="kv_cache", extra_name="extra_kv_cache", out=out)


def mla_sparse_prefill_v4(q, kv, indices, scale, *, topk_length=None, attn_sink=None, extra_kv=None,
                          extra_indices=None, extra_topk_length=None, backend=None, return_lse=False):
    """Sparse MLA prefill under the DeepSeek-V4 contract: each query token attends to the rows of `kv` its
    indices name (and to those of `extra_kv` that `extra_indices` name, one softmax over both).

    q [T, N, 512]; kv [S_kv, 512] float rows (the value is the whole row);
    indices int32 [T, topk] into kv's rows, -1 or >= S_kv = no token;
    topk_length int32 [T]; attn_sink float32 [N] as in `mla_sparse_decode_v4`;
    extra_kv [S_extra, 512], extra_indices int32 [T, extra_topk],
    extra_topk_length int32 [T]: an optional second segment. Returns out [T, N,
    512] in q's dtype, and lse [T, N] with `return_lse`; a token with no valid
    index gives 0 and -inf.
    """
    if torch.compiler.is_compiling():
        return library.mla_sparse_prefill_v4_traced(
            q, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink, extra_kv=extra_kv,
            extra_indices=extra_indices, extra_topk_length=extra_topk_length, backend=backend, return_lse=return_lse,
        )
    return _run_sparse_v4("mla_sparse_prefill_v4", "sparse_prefill", q, kv, indices, scale, None, topk_length,
                          attn_sink, extra_kv, extra_indices, extra_topk_length, None, backend, return_lse,
                          kv_name="kv", extra_name="extra_kv")


def concat_and_cache_mla_v4(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format=None) -> None:
    """Quantise rows [kv_c | k_pe] into a cache of any `mla_multi.cache_formats` format.

    kv_c [T, W - 64] (448 for the V4 formats, 512 for ``fp8_ds_mla``), k_pe
    [T, 64]; kv_cache uint8 [num_blocks, block_size, bytes a token] with the
    format's block stride (`CacheFormat.allocate`); kv_format names the format
    to insist on (None: found from the width); slot_mapping [T] int64 (or
    int32): a negative slot skips its token; a slot named by several tokens
    gets one of them on the CPU, and on a GPU bytes from one of them each
    (concurrent writers, as in `concat_and_cache_mla`). The bytes are the
    format's quantiser's (`CacheFormat.quantize`); on a GPU one launch
    quantises and writes them (`mla_multi.kernels.cache_ops.
    concat_and_cache_quantized`), free of host synchronisation. Without the
    data checks a slot past the cache is skipped and recorded for
    `raise_pending_errors`. Zero tokens: nothing.
    """
    if torch.compiler.is_compiling():
        return library.concat_and_cache_mla_v4_traced(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)
    try:
        key = ("concat_and_cache_mla_v4", _layout(kv_c), _layout(k_pe), _layout(kv_cache), _layout(slot_mapping),
               kv_format, envs.snapshot())
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks below say what was wrong
        key = plan = None
    if plan is not None:
        return plan.run(kv_c, k_pe, kv_cache, slot_mapping, None)
    from mla_multi import cache_formats

    checks.check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES)
    device = kv_c.device
    tokens = kv_c.shape[0]
    checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(torch.uint8,), device=device)
    fmt = cache_formats.check_cache("kv_cache", kv_cache, kv_format)
    latent = fmt.width - fmt.rope_dims
    checks.check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES, shape=(tokens, latent), device=device)
    checks.check_tensor("k_pe", k_pe, ndim=2, dtypes=(kv_c.dtype,), shape=(tokens, fmt.rope_dims), device=device)
    checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(tokens,), device=device)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    checks.report_pending_errors(device)
    checks.check_slot_data(slot_mapping, num_slots)
    if tokens == 0:
        return None
    if _use_triton(kv_c):  # one launch: the format's bytes quantised and written by the kernel
        _write_quantized(key, kv_c, k_pe, kv_cache, slot_mapping, fmt.name)
        return None
    slots = slot_mapping.long()
    errors.error_flag(device).bitwise_or_((slots >= num_slots).any().to(torch.int32) * errors.SLOT)
    if num_slots == 0:  # a cache of no block: nothing to write (a slot past it is flagged above)
        return None
    kept = (slots >= 0) & (slots < num_slots)
    records = fmt.quantize(torch.cat([kv_c, k_pe], dim=-1))
    # No host synchronisation (CUDA graphs): a skipped token writes the first kept token's record to that
    # token's slot (the same bytes, so duplicates agree) or, where no token is kept, slot 0's own bytes back.
    first = torch.argmax(kept.to(torch.int32)).reshape(1)
    any_kept = kept.any()
    donor_slot = torch.where(any_kept, slots.index_select(0, first), torch.zeros_like(first))
    donor_record = torch.where(any_kept, records.index_select(0, first), fmt.read_records(kv_cache, donor_slot))
    fmt.write_records(kv_cache, torch.where(kept, slots, donor_slot), torch.where(kept.unsqueeze(1), records,
                                                                                    donor_record))
    return None

library.bind_eager(
    mla_decode=mla_decode, mla_prefill=mla_prefill, merge_attn_states=merge_attn_states,
    concat_and_cache_mla=concat_and_cache_mla, gather_cache=gather_cache, mla_sparse_decode=mla_sparse_decode,
    mla_sparse_prefill=mla_sparse_prefill, mla_sparse_decode_v4=mla_sparse_decode_v4,
    mla_sparse_prefill_v4=mla_sparse_prefill_v4, concat_and_cache_mla_v4=concat_and_cache_mla_v4,
)
