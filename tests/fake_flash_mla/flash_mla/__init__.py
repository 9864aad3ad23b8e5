"""A PyTorch stand-in of FlashMLA's Python interface (`sgl-flash-mla` 1.0.0, `flash_mla_interface.py`) for
CPU tests: the published signatures, and the semantics and limits of its sm_90 ("legacy") kernels as they
behave on the GPU: sparse decode reads only the fp8_ds_mla layout, takes no topk_length, treats only -1 as
no token (any other index outside the cache is an illegal address: here an IndexError) and leaves LSE +inf
for a token with nothing to attend to; sparse prefill takes bf16 rows, -1 or indices >= S_kv as no token
(another negative index: an IndexError) and topk a multiple of 128; 64 or 128 heads for both. Every call is
recorded in CALLS."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

__version__ = "1.0.0"
CALLS: list[dict] = []


def has_legacy() -> bool:
    return True


@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False
    config: Optional[object] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def get_mla_decoding_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False, topk=None,
                              use_legacy=False):
    CALLS.append(dict(function="get_mla_decoding_metadata", batch=seqlens_k.shape[0], topk=topk,
                      is_fp8_kvcache=is_fp8_kvcache, use_legacy=use_legacy))
    return (torch.zeros(4, 8, dtype=torch.int32, device=seqlens_k.device),
            torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32, device=seqlens_k.device))


def _ds_mla_rows(cache: torch.Tensor) -> torch.Tensor:
    flat = cache.reshape(-1, 656)
    values = flat[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    scales = flat[:, 512:528].contiguous().view(torch.float32)
    rope = flat[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(values * scales.unsqueeze(-1)).view(-1, 512), rope], -1)


def _attend(q, rows, valid, scale, attn_sink):
    """q [T, H, 576] float, rows [T, K, 576], valid [T, K] -> out [T, H, 512] float, lse [T, H] (+inf if empty)."""
    scores = torch.einsum("thd,tkd->thk", q, rows) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    empty = ~valid.any(-1)
    weights = torch.softmax(scores.masked_fill(empty[:, None, None], 0.0), -1).masked_fill(empty[:, None, None], 0.0)
    out = torch.einsum("thk,tkd->thd", weights, rows[..., :512])
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.float()).nan_to_num(1.0).unsqueeze(-1)
    out = out.masked_fill(empty[:, None, None], 0.0)
    return out, lse.masked_fill(empty[:, None], math.inf)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, enable_batch_invariant=False, use_legacy=False, kv_format=None,
                           descale_q=None, descale_k=None):
    assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta)
    batch, s_q, heads, width = q.shape
    assert q.dtype == torch.bfloat16 and width == 576 and head_dim_v == 512 and k_cache.shape[2] == 1
    if softmax_scale is None:
        softmax_scale = width ** -0.5
    CALLS.append(dict(function="flash_mla_with_kvcache", sparse=indices is not None, q_ptr=q.data_ptr(),
                      causal=causal, has_schedule=tile_scheduler_metadata.tile_scheduler_metadata is not None,
                      topk_length=topk_length, use_legacy=use_legacy))
    if indices is None:  # dense decode (legacy only)
        assert use_legacy and not is_fp8_kvcache and k_cache.dtype == torch.bfloat16 and k_cache.shape[1] == 64
        rows = k_cache.float().view(-1, 576)
        out = torch.zeros(batch, s_q, heads, 512)
        lse = torch.full((batch, heads, s_q), math.inf)
        for b in range(batch):
            length = int(cache_seqlens[b])
            if length == 0:
                continue
            slots = (block_table[b].long().repeat_interleave(64) * 64 + torch.arange(64).repeat(block_table.shape[1]))
            keys = rows[slots[:length]]
            for t in range(s_q):
                visible = length - s_q + 1 + t if causal else length
                o, l = _attend(q[b, t].float()[None], keys[:visible][None], torch.ones(1, visible, dtype=torch.bool),
                               softmax_scale, None)
                out[b, t], lse[b, :, t] = o[0], l[0]
        return out.to(torch.bfloat16), lse
    assert use_legacy and is_fp8_kvcache and k_cache.dtype == torch.uint8 and k_cache.shape[-1] == 656
    assert not causal and heads in (64, 128) and indices.shape[:2] == (batch, s_q)
    assert topk_length is None, "V3.2 does not support dynamic topk length"
    topk = indices.shape[-1]
    assert topk % 64 == 0
    rows = _ds_mla_rows(k_cache)
    flat = indices.reshape(batch * s_q, topk).long()
    outside = (flat != -1) & ((flat < 0) | (flat >= rows.shape[0]))
    if bool(outside.any()):
        raise IndexError("an index outside the cache: an illegal memory access on the GPU")
    valid = flat != -1
    gathered = rows[flat.clamp_min(0)]
    out, lse = _attend(q.reshape(batch * s_q, heads, width).float(), gathered, valid, softmax_scale, attn_sink)
    return out.view(batch, s_q, heads, 512).to(torch.bfloat16), lse.view(batch, s_q, heads).transpose(1, 2).contiguous()


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False,
                         return_log2_lse=None):
    s_q, heads, width = q.shape
    assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and kv.shape[1] == 1 and d_v == 512
    assert heads in (64, 128) and indices.shape[:2] == (s_q, 1)
    topk = indices.shape[-1]
    assert topk % 128 == 0, "params.topk % (2*B_TOPK) == 0"
    CALLS.append(dict(function="flash_mla_sparse_fwd", q_ptr=q.data_ptr(), topk_length=topk_length,
                      use_legacy=use_legacy))
    flat = indices[:, 0].long()
    if bool(((flat < 0) & (flat != -1)).any()):
        raise IndexError("a negative index other than -1: an illegal memory access on the GPU")
    valid = (flat >= 0) & (flat < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(topk).unsqueeze(0) < topk_length.long().unsqueeze(1)
    rows = kv[:, 0].float()[flat.clamp(0, kv.shape[0] - 1)]
    out, lse = _attend(q.float(), rows, valid, sm_scale, attn_sink)
    return out.to(torch.bfloat16), lse.clone(), lse
