"""The stand-in of FlashMLA's `_loader`: `get_ops(True)` is the legacy op namespace, whose `sparse_decode_fwd`
takes the published op's arguments (its schema, read from the wheel's `_C_legacy` library by
tests/test_backend_flashmla.py) and runs the stand-in's `flash_mla_with_kvcache` on them."""

from __future__ import annotations

import types

import torch

# the published op's schema (sgl-flash-mla 1.0.0, `_C_legacy.abi3.so`)
SPARSE_DECODE_SCHEMA = (
    "flash_mla_legacy::sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
    "Tensor(a!)? tile_scheduler_metadata, Tensor(b!)? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
    "Tensor? extra_topk_length, int d_v, float sm_scale, str? kv_format=None) -> (Tensor, Tensor, Tensor(a)?, Tensor(b)?)"
)


class _SparseDecodeOp:
    def __init__(self) -> None:
        self.default = types.SimpleNamespace(_schema=torch._C.parse_schema(SPARSE_DECODE_SCHEMA))

    def __call__(self, q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits, extra_kv,
                 extra_indices, extra_topk_length, d_v, sm_scale, kv_format=None):
        import flash_mla

        sched, _ = flash_mla.get_mla_metadata()
        sched.tile_scheduler_metadata, sched.num_splits = tile_scheduler_metadata, num_splits
        flash_mla.CALLS.append(dict(function="sparse_decode_fwd", q_ptr=q.data_ptr(),
                                    given_schedule=tile_scheduler_metadata is not None))
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, kv, None, None, d_v, sched, softmax_scale=sm_scale, is_fp8_kvcache=True, indices=indices,
            attn_sink=attn_sink, extra_k_cache=extra_kv, extra_indices_in_kvcache=extra_indices,
            topk_length=topk_length, extra_topk_length=extra_topk_length, use_legacy=True, kv_format=kv_format)
        return out, lse, sched.tile_scheduler_metadata, sched.num_splits


_LEGACY = types.SimpleNamespace(sparse_decode_fwd=_SparseDecodeOp())


def get_ops(use_legacy: bool):
    if not use_legacy:
        raise RuntimeError("the stand-in carries the legacy op namespace only")
    return _LEGACY
