"""The public functional ops as torch.library ops in the ``mla_multi`` namespace.

`torch.compile` (``fullgraph=True`` included) and `torch.export` see each op of
`mla_multi.ops` as one opaque node, ``torch.ops.mla_multi.<op>``: Dynamo does
not trace the checks or the backend selection, Inductor never re-traces the
Triton kernels, and the graph needs no break around them.  Eagerly nothing
changes: `mla_multi.ops.<op>` runs its Python body as before; only while
compiling (``torch.compiler.is_compiling()``) does it call ``<op>_traced``
here, which converts its arguments to the schema and calls the registered op.

Each registered kernel (``CompositeExplicitAutograd``: every device, one
Python function) calls the public `mla_multi.ops.<op>` itself, so every check
-- the ones that read index data included -- runs when the compiled code runs,
never in the traced graph.  The fake (meta) kernels compute output shapes and
dtypes from the inputs' metadata alone.

The ops are defined with ``torch.library.Library(...).define`` / ``.impl``
rather than ``torch.library.custom_op``: on an op that only copies its input,
``bench/registration_cost.py`` measured +1.6 us per call for this registration
and +3.8 us (inference mode) to +8.6 us (grad mode) for custom_op, on a CPU.

The ops have no backward (the Triton kernels have none): no autograd kernel is
registered, so a compiled graph treats their outputs as constants for autograd
and gradients do not flow through them (eager REFERENCE calls of the Python ops
stay differentiable).  Compile inference code under ``torch.no_grad()`` or
``torch.inference_mode()``.

Schemas (scales that the Python API takes as float or tensor are ``Tensor?``:
the ``*_traced`` wrappers turn a float into a 1-element float32 tensor on the
inputs' device):

* ``mla_decode(... bool return_lse=False) -> (Tensor out, Tensor lse)``: lse is
  [B, (Q,) N] (float32, float64 for float64 queries) when ``return_lse``, else an
  empty float32 tensor of shape [0]; ``return_lse=True`` with a backend that
  returns no LSE raises ValueError, as the eager op does.
* ``mla_prefill(... bool return_lse=False) -> (Tensor out, Tensor lse)``: lse is
  [N, Tq] when ``return_lse``, else shape [0].
* ``merge_attn_states(...) -> (Tensor, Tensor)``.
* ``concat_and_cache_mla(..., Tensor(a!) kv_cache, ...) -> ()``: writes kv_cache.
* ``gather_cache(...) -> Tensor``: [num_tokens, W] when ``num_tokens`` is
  given (the eager result must have that many rows, else ValueError), else a
  data-dependent (unbacked) number of rows.

Every output of the registered ops is contiguous, as the fakes promise (the
kernels copy a non-contiguous backend result, e.g. the PyTorch merge's output,
which is laid out [N, T, D]), and never aliases an input.

One more op is a whole layer, as vLLM's unified attention op is:
``mla_attention(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) kv_cache,
Tensor(b!) output, int layer_id) -> ()``.  `MLAAttention.forward` calls it while
compiling, so a model compiled with ``fullgraph=True`` holds each attention
layer as one node whose inputs are tensors and an int.  Its kernel finds the
layer by ``layer_id`` (`register_layer`: every `MLAAttention` has one; the
registry holds weak references) and the step's `CommonAttentionMetadata` as the
*current step* of q's device (`set_current_metadata`; `MLAAttention.plan` and
`set_step` set it), then runs the layer's eager forward into ``output``.  The
metadata never enters the graph: new lengths and batch compositions do not
recompile, and planning stays outside the compiled region.  The op is tagged
``cudagraph_unsafe``: its kernel reads the current step on the host at every
call, which a replayed graph would not.  It is not in `SCHEMAS` (the functional
ops of `mla_multi.ops`).
"""

from __future__ import annotations

import threading
import weakref

import torch

from mla_multi.backends.base import FP8_DTYPES
from mla_multi.metadata import CommonAttentionMetadata

__all__ = [
    "LIBRARY",
    "SCHEMAS",
    "mla_decode_traced",
    "mla_prefill_traced",
    "merge_attn_states_traced",
    "concat_and_cache_mla_traced",
    "gather_cache_traced",
    "mla_sparse_decode_traced",
    "mla_sparse_prefill_traced",
    "mla_sparse_decode_v4_traced",
    "mla_sparse_prefill_v4_traced",
    "concat_and_cache_mla_v4_traced",
    "ATTENTION_SCHEMA",
    "register_layer",
    "layer_by_id",
    "set_current_metadata",
    "current_metadata",
    "set_step",
]

NAMESPACE = "mla_multi"

SCHEMAS: dict[str, str] = {
    "mla_decode": (
        "mla_decode(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale, *, "
        "Tensor? k_scale=None, int? num_kv_splits=None, str? backend=None, bool return_lse=False) -> (Tensor, Tensor)"
    ),
    "mla_prefill": (
        "mla_prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, float scale, *, bool causal=True, bool return_lse=False, str? backend=None, "
        "Tensor? q_scale=None, Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor, Tensor)"
    ),
    "merge_attn_states": (
        "merge_attn_states(Tensor prefix_output, Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse) "
        "-> (Tensor, Tensor)"
    ),
    "concat_and_cache_mla": (
        "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, *, "
        "Tensor? scale=None) -> ()"
    ),
    "gather_cache": (
        "gather_cache(Tensor kv_cache, Tensor block_table, Tensor seq_starts, Tensor seq_lens, *, Tensor? scale=None, "
        "ScalarType? out_dtype=None, Tensor? cu_seq_lens=None, SymInt? num_tokens=None) -> Tensor"
    ),
    "mla_sparse_decode": (
        "mla_sparse_decode(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor indices, float scale, *, "
        "Tensor? k_scale=None, Tensor? topk_length=None, Tensor? attn_sink=None, str? backend=None, "
        "bool return_lse=False) -> (Tensor, Tensor)"
    ),
    "mla_sparse_prefill": (
        "mla_sparse_prefill(Tensor q_nope, Tensor q_pe, Tensor kv, Tensor indices, float scale, *, "
        "Tensor? topk_length=None, Tensor? attn_sink=None, str? backend=None, bool return_lse=False) "
        "-> (Tensor, Tensor)"
    ),
    "mla_sparse_decode_v4": (
        "mla_sparse_decode_v4(Tensor q, Tensor kv_cache, Tensor indices, float scale, *, str? kv_format=None, "
        "Tensor? topk_length=None, Tensor? attn_sink=None, Tensor? extra_kv_cache=None, Tensor? extra_indices=None, "
        "Tensor? extra_topk_length=None, str? extra_kv_format=None, str? backend=None, bool return_lse=False) "
        "-> (Tensor, Tensor)"
    ),
    "mla_sparse_prefill_v4": (
        "mla_sparse_prefill_v4(Tensor q, Tensor kv, Tensor indices, float scale, *, Tensor? topk_length=None, "
        "Tensor? attn_sink=None, Tensor? extra_kv=None, Tensor? extra_indices=None, Tensor? extra_topk_length=None, "
        "str? backend=None, bool return_lse=False) -> (Tensor, Tensor)"
    ),
    "concat_and_cache_mla_v4": (
        "concat_and_cache_mla_v4(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, *, "
        "str? kv_format=None) -> ()"
    ),
}

LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    LIBRARY.define(_schema)


# --------------------------------------------------------------------------- helpers


# The eager bodies of the public ops (`mla_multi.ops.<op>`), handed over by `mla_multi.ops` as it is
# imported (`bind_eager`): ops calls into this module while compiling, so this module never imports ops.
_EAGER: dict = {}


def bind_eager(**functions) -> None:
    """Give the registered kernels the public ops' eager bodies, by op name."""
    _EAGER.update(functions)


def _eager(fn, *args, **kwargs):
    """Run the public op `fn`'s eager body from a registered kernel.

    The public ops divert to the registered ops while `torch.compiler.is_compiling()`
    holds.  Compiled code calls the kernels with the flag down; a kernel run with real
    tensors inside a compile session (Inductor folding constants, say) would otherwise
    call itself, so the flag is lowered around that call.
    """
    if not torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    torch.compiler._is_compiling_flag = False
    try:
        return fn(*args, **kwargs)
    finally:
        torch.compiler._is_compiling_flag = True


def _scale_tensor(scale, device: torch.device):
    """A float scale as a 1-element float32 tensor on `device`; None and tensors pass through."""
    if scale is None or torch.is_tensor(scale):
        return scale
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _no_lse(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.float32)


# --------------------------------------------------------------------------- mla_decode


def _mla_decode_kernel(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, *, k_scale=None, num_kv_splits=None,
                       backend=None, return_lse=False):
    result = _eager(
        _EAGER["mla_decode"], q_nope, q_pe, kv_cache, block_table, seq_lens, scale,
        k_scale=k_scale, num_kv_splits=num_kv_splits, backend=backend, return_lse=return_lse,
    )
    if return_lse:
        out, lse = result
        return out.contiguous(), lse.contiguous()
    return result.contiguous(), _no_lse(result)


def _mla_decode_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, *, k_scale=None, num_kv_splits=None,
                     backend=None, return_lse=False):
    out = q_nope.new_empty(q_nope.shape)
    lse = q_nope.new_empty(q_nope.shape[:-1], dtype=_lse_dtype(q_nope.dtype)) if return_lse else _no_lse(q_nope)
    return out, lse


def mla_decode_traced(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, *, k_scale=None, num_kv_splits=None,
                      backend=None, return_lse=False):
    """`mla_multi.ops.mla_decode` through ``torch.ops.mla_multi.mla_decode`` (what a compiled graph records)."""
    out, lse = torch.ops.mla_multi.mla_decode(
        q_nope, q_pe, kv_cache, block_table, seq_lens, float(scale),
        k_scale=_scale_tensor(k_scale, q_nope.device), num_kv_splits=num_kv_splits, backend=backend,
        return_lse=bool(return_lse),
    )
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- mla_prefill


def _mla_prefill_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, *, causal=True,
                        return_lse=False, backend=None, q_scale=None, k_scale=None, v_scale=None):
    result = _eager(
        _EAGER["mla_prefill"], q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
        causal=causal, return_lse=return_lse, backend=backend, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
    )
    if return_lse:
        out, lse = result
        return out.contiguous(), lse.contiguous()
    return result.contiguous(), _no_lse(result)


def _mla_prefill_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, *, causal=True,
                      return_lse=False, backend=None, q_scale=None, k_scale=None, v_scale=None):
    tokens, heads = q.shape[0], q.shape[1]
    dtype = torch.bfloat16 if q.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else q.dtype
    out = q.new_empty((tokens, heads, v.shape[-1]), dtype=dtype)
    lse = q.new_empty((heads, tokens), dtype=_lse_dtype(dtype)) if return_lse else _no_lse(out)
    return out, lse


def mla_prefill_traced(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, *, causal=True,
                       return_lse=False, backend=None, q_scale=None, k_scale=None, v_scale=None):
    """`mla_multi.ops.mla_prefill` through ``torch.ops.mla_multi.mla_prefill``."""
    out, lse = torch.ops.mla_multi.mla_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(scale),
        causal=bool(causal), return_lse=bool(return_lse), backend=backend, q_scale=_scale_tensor(q_scale, q.device),
        k_scale=_scale_tensor(k_scale, q.device), v_scale=_scale_tensor(v_scale, q.device),
    )
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- merge_attn_states


def _merge_attn_states_kernel(prefix_output, prefix_lse, suffix_output, suffix_lse):
    out, lse = _eager(_EAGER["merge_attn_states"], prefix_output, prefix_lse, suffix_output, suffix_lse)
    return out.contiguous(), lse.contiguous()


def _merge_attn_states_fake(prefix_output, prefix_lse, suffix_output, suffix_lse):
    out = prefix_output.new_empty(prefix_output.shape)
    lse = prefix_lse.new_empty(prefix_lse.shape)
    return out, lse


def merge_attn_states_traced(prefix_output, prefix_lse, suffix_output, suffix_lse):
    """`mla_multi.ops.merge_attn_states` through ``torch.ops.mla_multi.merge_attn_states``."""
    return torch.ops.mla_multi.merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse)


# --------------------------------------------------------------------------- concat_and_cache_mla


def _concat_and_cache_mla_kernel(kv_c, k_pe, kv_cache, slot_mapping, *, scale=None):
    _eager(_EAGER["concat_and_cache_mla"], kv_c, k_pe, kv_cache, slot_mapping, scale=scale)


def _concat_and_cache_mla_fake(kv_c, k_pe, kv_cache, slot_mapping, *, scale=None):
    return None


def concat_and_cache_mla_traced(kv_c, k_pe, kv_cache, slot_mapping, *, scale=None):
    """`mla_multi.ops.concat_and_cache_mla` through ``torch.ops.mla_multi.concat_and_cache_mla``."""
    torch.ops.mla_multi.concat_and_cache_mla(
        kv_c, k_pe, kv_cache, slot_mapping, scale=_scale_tensor(scale, kv_cache.device)
    )


# --------------------------------------------------------------------------- gather_cache


def _gather_out_dtype(kv_cache, out_dtype):
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if kv_cache.dtype in FP8_DTYPES else kv_cache.dtype


def _gather_cache_kernel(kv_cache, block_table, seq_starts, seq_lens, *, scale=None, out_dtype=None,
                         cu_seq_lens=None, num_tokens=None):
    out = _eager(
        _EAGER["gather_cache"], kv_cache, block_table, seq_starts, seq_lens,
        scale=scale, out_dtype=out_dtype, cu_seq_lens=cu_seq_lens, num_tokens=num_tokens,
    )
    if num_tokens is not None and out.shape[0] != num_tokens:
        # A compiled graph sized everything after this op by num_tokens.
        raise ValueError(
            f"num_tokens={num_tokens}, but seq_lens add up to {out.shape[0]} rows; accepted: num_tokens = sum(seq_lens)"
        )
    return out.contiguous()


def _gather_cache_fake(kv_cache, block_table, seq_starts, seq_lens, *, scale=None, out_dtype=None,
                       cu_seq_lens=None, num_tokens=None):
    if num_tokens is None:
        num_tokens = torch.library.get_ctx().new_dynamic_size()
    return kv_cache.new_empty((num_tokens, kv_cache.shape[-1]), dtype=_gather_out_dtype(kv_cache, out_dtype))


def gather_cache_traced(kv_cache, block_table, seq_starts, seq_lens, *, scale=None, out_dtype=None,
                        cu_seq_lens=None, num_tokens=None):
    """`mla_multi.ops.gather_cache` through ``torch.ops.mla_multi.gather_cache``."""
    return torch.ops.mla_multi.gather_cache(
        kv_cache, block_table, seq_starts, seq_lens, scale=_scale_tensor(scale, kv_cache.device),
        out_dtype=out_dtype, cu_seq_lens=cu_seq_lens, num_tokens=num_tokens,
    )


# --------------------------------------------------------------------------- sparse MLA


def _sparse_kernel(fn):
    def kernel(q_nope, q_pe, kv, indices, scale, *, return_lse=False, **options):
        result = _eager(fn, q_nope, q_pe, kv, indices, scale, return_lse=return_lse, **options)
        if return_lse:
            out, lse = result
            return out.contiguous(), lse.contiguous()
        return result.contiguous(), _no_lse(result)

    return kernel


def _sparse_fake(q_nope, q_pe, kv, indices, scale, *, return_lse=False, **options):
    lse = q_nope.new_empty(q_nope.shape[:-1], dtype=torch.float32) if return_lse else _no_lse(q_nope)
    return q_nope.new_empty(q_nope.shape), lse


def mla_sparse_decode_traced(q_nope, q_pe, kv_cache, indices, scale, *, k_scale=None, topk_length=None,
                             attn_sink=None, backend=None, return_lse=False):
    """`mla_multi.ops.mla_sparse_decode` through ``torch.ops.mla_multi.mla_sparse_decode``."""
    out, lse = torch.ops.mla_multi.mla_sparse_decode(
        q_nope, q_pe, kv_cache, indices, float(scale), k_scale=_scale_tensor(k_scale, q_nope.device),
        topk_length=topk_length, attn_sink=attn_sink, backend=backend, return_lse=bool(return_lse),
    )
    return (out, lse) if return_lse else out


def mla_sparse_prefill_traced(q_nope, q_pe, kv, indices, scale, *, topk_length=None, attn_sink=None, backend=None,
                              return_lse=False):
    """`mla_multi.ops.mla_sparse_prefill` through ``torch.ops.mla_multi.mla_sparse_prefill``."""
    out, lse = torch.ops.mla_multi.mla_sparse_prefill(
        q_nope, q_pe, kv, indices, float(scale), topk_length=topk_length, attn_sink=attn_sink, backend=backend,
        return_lse=bool(return_lse),
    )
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- the V4 contract


def _sparse_v4_kernel(name):
    def kernel(q, kv, indices, scale, *, return_lse=False, **options):
        result = _eager(_EAGER[name], q, kv, indices, scale, return_lse=return_lse, **options)
        if return_lse:
            out, lse = result
            return out.contiguous(), lse.contiguous()
        return result.contiguous(), _no_lse(result)

    return kernel


def _sparse_v4_fake(q, kv, indices, scale, *, return_lse=False, **options):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_empty(q.shape[:-1], dtype=lse_dtype) if return_lse else _no_lse(q)
    return q.new_empty(q.shape), lse


def mla_sparse_decode_v4_traced(q, kv_cache, indices, scale, *, return_lse=False, **options):
    """`mla_multi.ops.mla_sparse_decode_v4` through ``torch.ops.mla_multi.mla_sparse_decode_v4``."""
    out, lse = torch.ops.mla_multi.mla_sparse_decode_v4(q, kv_cache, indices, float(scale),
                                                         return_lse=bool(return_lse), **options)
    return (out, lse) if return_lse else out


def mla_sparse_prefill_v4_traced(q, kv, indices, scale, *, return_lse=False, **options):
    """`mla_multi.ops.mla_sparse_prefill_v4` through ``torch.ops.mla_multi.mla_sparse_prefill_v4``."""
    out, lse = torch.ops.mla_multi.mla_sparse_prefill_v4(q, kv, indices, float(scale), return_lse=bool(return_lse),
                                                          **options)
    return (out, lse) if return_lse else out


def _concat_and_cache_mla_v4_kernel(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format=None):
    _eager(_EAGER["concat_and_cache_mla_v4"], kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)


def _concat_and_cache_mla_v4_fake(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format=None):
    return None


def concat_and_cache_mla_v4_traced(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format=None):
    """`mla_multi.ops.concat_and_cache_mla_v4` through ``torch.ops.mla_multi.concat_and_cache_mla_v4``."""
    torch.ops.mla_multi.concat_and_cache_mla_v4(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)


# --------------------------------------------------------------------------- registration

_KERNELS = {
    "mla_decode": (_mla_decode_kernel, _mla_decode_fake),
    "mla_prefill": (_mla_prefill_kernel, _mla_prefill_fake),
    "merge_attn_states": (_merge_attn_states_kernel, _merge_attn_states_fake),
    "concat_and_cache_mla": (_concat_and_cache_mla_kernel, _concat_and_cache_mla_fake),
    "gather_cache": (_gather_cache_kernel, _gather_cache_fake),
    "mla_sparse_decode": (_sparse_kernel(lambda *a, **k: _EAGER["mla_sparse_decode"](*a, **k)), _sparse_fake),
    "mla_sparse_prefill": (_sparse_kernel(lambda *a, **k: _EAGER["mla_sparse_prefill"](*a, **k)), _sparse_fake),
    "mla_sparse_decode_v4": (_sparse_v4_kernel("mla_sparse_decode_v4"), _sparse_v4_fake),
    "mla_sparse_prefill_v4": (_sparse_v4_kernel("mla_sparse_prefill_v4"), _sparse_v4_fake),
    "concat_and_cache_mla_v4": (_concat_and_cache_mla_v4_kernel, _concat_and_cache_mla_v4_fake),
}

for _name, (_kernel, _fake) in _KERNELS.items():
    LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=LIBRARY)


# --------------------------------------------------------------------------- mla_attention: one MLAAttention layer

ATTENTION_SCHEMA = (
    "mla_attention(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) kv_cache, Tensor(b!) output, int layer_id) "
    "-> ()"
)
LIBRARY.define(ATTENTION_SCHEMA, tags=(torch.Tag.cudagraph_unsafe,))

# layer_id -> weak reference to its MLAAttention; ids are never reused, a freed layer's entry is dropped
_LAYERS: dict[int, weakref.ref] = {}
_NEXT_LAYER_ID = 0
_LAYERS_LOCK = threading.Lock()


def register_layer(layer) -> int:
    """A new id for `layer` (an `MLAAttention`), by which ``torch.ops.mla_multi.mla_attention`` finds it.

    Only a weak reference is kept: registering does not keep a layer alive.
    """
    global _NEXT_LAYER_ID
    with _LAYERS_LOCK:
        layer_id = _NEXT_LAYER_ID
        _NEXT_LAYER_ID += 1
        _LAYERS[layer_id] = weakref.ref(layer, lambda _ref, layer_id=layer_id: _LAYERS.pop(layer_id, None))
    return layer_id


def layer_by_id(layer_id: int):
    """The live layer registered under `layer_id`; ValueError for an id never given out or a freed layer."""
    ref = _LAYERS.get(layer_id)
    layer = ref() if ref is not None else None
    if layer is not None:
        return layer
    if isinstance(layer_id, int) and not isinstance(layer_id, bool) and 0 <= layer_id < _NEXT_LAYER_ID:
        raise ValueError(
            f"layer_id={layer_id}: that MLAAttention was freed; a compiled model must keep its layers alive "
            "(compile again for the live layers)"
        )
    raise ValueError(f"layer_id={layer_id!r}; accepted: the layer_id of a live MLAAttention")


# device -> the CommonAttentionMetadata of the step that runs on it
_CURRENT_STEP: dict[torch.device, CommonAttentionMetadata] = {}


def _device_key(device) -> torch.device:
    """`device` with its index ("cuda" is the current CUDA device, as for tensors created there)."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return device


def set_current_metadata(device, metadata: CommonAttentionMetadata | None) -> None:
    """Make `metadata` the current step of `device` (None: no current step)."""
    if metadata is not None and not isinstance(metadata, CommonAttentionMetadata):
        raise ValueError(f"metadata={type(metadata).__name__}; accepted: a CommonAttentionMetadata or None")
    key = _device_key(device)
    if metadata is None:
        _CURRENT_STEP.pop(key, None)
    else:
        _CURRENT_STEP[key] = metadata


def current_metadata(device) -> CommonAttentionMetadata | None:
    """The current step of `device`, or None."""
    return _CURRENT_STEP.get(_device_key(device))


class set_step:
    """Make `metadata` the current step of its device (``metadata.block_table.device``, or `device`).

    The compiled `MLAAttention.forward` reads the step from here; `MLAAttention.plan(metadata)` sets it
    too, so call this only where a step runs without `plan`. Takes effect at the call; used as a
    context manager (``with mla_multi.set_step(metadata): ...``) it restores the previous step on exit.
    ``set_step(None, device=...)`` clears the device's step.
    """

    def __init__(self, metadata: CommonAttentionMetadata | None, device=None) -> None:
        if metadata is None and device is None:
            raise ValueError("set_step(None) needs the device whose step to clear; accepted: set_step(None, device=)")
        if metadata is not None and not isinstance(metadata, CommonAttentionMetadata):
            raise ValueError(f"metadata={type(metadata).__name__}; accepted: a CommonAttentionMetadata or None")
        self.metadata = metadata
        self.device = _device_key(metadata.block_table.device if device is None else device)
        self.previous = _CURRENT_STEP.get(self.device)
        set_current_metadata(self.device, metadata)

    def __enter__(self) -> CommonAttentionMetadata | None:
        return self.metadata

    def __exit__(self, *exc_info) -> None:
        set_current_metadata(self.device, self.previous)


def _mla_attention_kernel(q, kv_c_normed, k_pe, kv_cache, output, layer_id):
    layer = layer_by_id(layer_id)
    metadata = _current_step_for(q, layer_id)
    _eager(layer.forward, q, kv_c_normed, k_pe, kv_cache, metadata, output=output)


def _mla_attention_fake(q, kv_c_normed, k_pe, kv_cache, output, layer_id):
    return None  # writes kv_cache and output in place, as declared; nothing changes shape


LIBRARY.impl("mla_attention", _mla_attention_kernel, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::mla_attention", _mla_attention_fake, lib=LIBRARY)

# The sparse layer (MLAAttention with sparse_topk): the same opaque op with each token's top-k positions.
SPARSE_ATTENTION_SCHEMA = (
    "mla_sparse_attention(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) kv_cache, Tensor(b!) output, "
    "Tensor topk_indices, int layer_id) -> ()"
)
LIBRARY.define(SPARSE_ATTENTION_SCHEMA, tags=(torch.Tag.cudagraph_unsafe,))


def _current_step_for(q, layer_id):
    metadata = current_metadata(q.device)
    if metadata is None:
        raise ValueError(
            f"no current step on {q.device} for the compiled MLAAttention.forward (layer_id={layer_id}); call "
            "layer.plan(metadata) or mla_multi.set_step(metadata) with the step's CommonAttentionMetadata before it"
        )
    if q.dim() >= 1 and q.shape[0] != metadata.num_actual_tokens:
        raise ValueError(
            f"q has {q.shape[0]} tokens, the current step on {q.device} {metadata.num_actual_tokens}; call "
            "layer.plan(metadata) or mla_multi.set_step(metadata) for each step before the compiled forward"
        )
    return metadata


def _mla_sparse_attention_kernel(q, kv_c_normed, k_pe, kv_cache, output, topk_indices, layer_id):
    layer = layer_by_id(layer_id)
    metadata = _current_step_for(q, layer_id)
    _eager(layer.forward, q, kv_c_normed, k_pe, kv_cache, metadata, output=output, topk_indices=topk_indices)


def _mla_sparse_attention_fake(q, kv_c_normed, k_pe, kv_cache, output, topk_indices, layer_id):
    return None  # writes kv_cache and output in place, as declared


LIBRARY.impl("mla_sparse_attention", _mla_sparse_attention_kernel, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::mla_sparse_attention", _mla_sparse_attention_fake, lib=LIBRARY)

# The DeepSeek-V4 layer (`MLAAttentionV4`): the same opaque op with both caches (either may be absent), each
# token's top-k slots and lengths, and the compressor's rows for the main cache.
V4_ATTENTION_SCHEMA = (
    "mla_attention_v4(Tensor q, Tensor kv, Tensor(a!)? kv_cache, Tensor(b!)? window_cache, Tensor(c!) output, "
    "Tensor? topk_indices, Tensor? topk_length, Tensor? compressed_kv, Tensor? compressed_slot_mapping, "
    "int layer_id) -> ()"
)
LIBRARY.define(V4_ATTENTION_SCHEMA, tags=(torch.Tag.cudagraph_unsafe,))


def _mla_attention_v4_kernel(q, kv, kv_cache, window_cache, output, topk_indices, topk_length, compressed_kv,
                             compressed_slot_mapping, layer_id):
    layer = layer_by_id(layer_id)
    metadata = _current_step_for(q, layer_id)
    _eager(layer.forward, q, kv, kv_cache, window_cache, metadata, output, topk_indices=topk_indices,
           topk_length=topk_length, compressed_kv=compressed_kv, compressed_slot_mapping=compressed_slot_mapping)


def _mla_attention_v4_fake(q, kv, kv_cache, window_cache, output, topk_indices, topk_length, compressed_kv,
                           compressed_slot_mapping, layer_id):
    return None  # writes the caches and output in place, as declared


LIBRARY.impl("mla_attention_v4", _mla_attention_v4_kernel, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::mla_attention_v4", _mla_attention_v4_fake, lib=LIBRARY)
