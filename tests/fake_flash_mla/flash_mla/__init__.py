"""A PyTorch stand-in of FlashMLA's Python interface (`sgl-flash-mla` 1.0.0, `flash_mla_interface.py`) for
CPU tests: the published signatures, and the semantics and limits of its kernels as they behave on the GPU.

V3.2 (d_qk 576, the legacy kernels): sparse decode reads only the fp8_ds_mla layout, takes no topk_length,
treats only -1 as no token (any other index outside the cache is an illegal address: here an IndexError) and
leaves LSE +inf for a token with nothing to attend to; sparse prefill takes bf16 rows, -1 or indices >= S_kv
as no token (another negative index: an IndexError) and topk a multiple of 128; 64 or 128 heads for both.

V4 / V4.1 (d_qk 512): sparse decode over a cache whose format its bytes a token name (584 "V4": legacy
kernels, ``kv_format`` None or "V4"; 528 "V41" and 288 "V41_FP4": the current kernels, ``use_legacy=False``
and no ``kv_format``), the fp4 cache only as extra_k_cache beside a V41 one, extra_k_cache otherwise in the
main cache's format; each block's tokens contiguous (k_cache.stride(1) == bytes a token); topk and
extra_topk multiples of 64; topk_length / extra_topk_length [b] int32 honoured; the sink; the same index
rules. Its split-KV schedule is made on the first call of a FlashMLASchedMeta from the shapes and the
length values passed: reusing it with other length values (FlashMLA's documented misuse: stale metadata)
raises here. The values are the package's readers' (`mla_multi.cache_formats`), the arithmetic float32.
Sparse prefill also takes d_qk 512 rows, topk_length in [0, topk] and the sink. Every call is recorded
in CALLS."""

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


# the length values each schedule made in a call was made for, by the id of its metadata tensor
_SCHEDULED: dict = {}
# FlashMLA's kv_format names by bytes a token (d_qk 512)
_V4_FORMATS = {584: "V4", 528: "V41", 288: "V41_FP4"}
_PACKAGE_FORMATS = {"V4": "fp8_ds_mla_v4", "V41": "fp8_ds_mla_v41", "V41_FP4": "fp4_ds_mla_v41"}


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
    assert num_splits is None, "num_splits must be None"
    batch, s_q, heads, width = q.shape
    if width == 512:
        return _v4_decode(q, k_cache, head_dim_v, tile_scheduler_metadata, softmax_scale, causal, is_fp8_kvcache,
                          indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length,
                          use_legacy, kv_format)
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
    assert width in (512, 576) and kv.shape[-1] == width, "Invalid d_qk"
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
    assert heads in (64, 128) and indices.shape[:2] == (s_q, 1) and indices.dtype == torch.int32
    topk = indices.shape[-1]
    assert topk % 128 == 0, "params.topk % (2*B_TOPK) == 0"
    if attn_sink is not None:
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (heads,) and attn_sink.is_contiguous()
    if topk_length is not None:
        assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,) and topk_length.is_contiguous()
        if bool(((topk_length < 0) | (topk_length > topk)).any()):
            raise IndexError("a topk_length outside [0, topk]: the kernel reads past the index list")
    CALLS.append(dict(function="flash_mla_sparse_fwd", q_ptr=q.data_ptr(), topk_length=topk_length,
                      use_legacy=use_legacy, width=width, topk=topk, attn_sink=attn_sink is not None))
    flat = indices[:, 0].long()
    if bool(((flat < 0) & (flat != -1)).any()):
        raise IndexError("a negative index other than -1: an illegal memory access on the GPU")
    valid = (flat >= 0) & (flat < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(topk).unsqueeze(0) < topk_length.long().unsqueeze(1)
    rows = kv[:, 0].float()[flat.clamp(0, kv.shape[0] - 1)]
    out, lse = _attend(q.float(), rows, valid, sm_scale, attn_sink)
    return out.to(torch.bfloat16), lse.clone(), lse


def _v4_format(cache: torch.Tensor, name: str) -> str:
    assert cache.dim() == 4 and cache.shape[2] == 1, f"{name} must be (num_blocks, page_block_size, 1, bytes)"
    assert cache.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn), f"{name} must have dtype fp8_e4m3fn, int8 or uint8"
    fmt = _V4_FORMATS.get(cache.shape[-1])
    assert fmt is not None, f"Unsupported bytes_per_token for d_qk=512: {cache.shape[-1]}"
    assert cache.stride(1) == cache.shape[-1], f"The whole block must be contiguous for the paged {name}"
    return fmt


def _v4_rows(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    """The cache's every slot as float32 rows [slots, 512], read by the package's reader of the format."""
    from mla_multi import cache_formats

    view = cache.view(torch.uint8).squeeze(2)
    return cache_formats.get_format(_PACKAGE_FORMATS[fmt]).read_rows(view, torch.float32)


def _v4_decode(q, k_cache, head_dim_v, sched, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink,
               extra_k_cache, extra_indices, topk_length, extra_topk_length, use_legacy, kv_format):
    batch, s_q, heads, width = q.shape
    assert indices is not None, "Sparse attention is required: `indices` must be provided"
    assert not causal and is_fp8_kvcache is not False
    assert q.dtype == torch.bfloat16 and head_dim_v == 512 and heads in (64, 128), f"Unsupported h_q: {heads}"
    assert q.stride(-1) == 1 and indices.stride(-1) == 1 and indices.dtype == torch.int32
    fmt = _v4_format(k_cache, "KV cache")
    if fmt == "V41_FP4":
        raise AssertionError("The fp4 KV cache is only supported as extra_kv")
    if use_legacy:
        assert fmt == "V4", f"the legacy kernels here read the V4 cache, not {fmt}"
        assert kv_format in (None, "V4"), f"kv_format says {kv_format} but q/kv have d_qk 512 and {k_cache.shape[-1]} bytes per token"
    else:
        assert kv_format is None, "kv_format only applies to the legacy kernels"
        assert fmt == "V41", f"the current kernels read the V4.1 formats, not {fmt}"
    assert indices.shape == (batch, s_q, indices.shape[-1]), "indices must have shape (b, s_q, topk)"
    topk = indices.shape[-1]
    assert topk > 0 and topk % 64 == 0, f"topk ({topk}) mod B_TOPK (64) must be 0"
    extra_fmt = extra_topk = None
    if extra_k_cache is None:
        assert extra_indices is None and extra_topk_length is None, (
            "extra_indices_in_kvcache / extra_topk_length must not be provided when extra_k_cache is not provided")
    else:
        assert extra_indices is not None, "extra_indices_in_kvcache must be provided when extra_kcache is provided"
        extra_fmt = _v4_format(extra_k_cache, "extra KV cache")
        allowed = (fmt, "V41_FP4") if fmt == "V41" else (fmt,)
        assert extra_fmt in allowed, f"extra_kv must have the format of kv, or the V4.1 fp4 format: got {extra_fmt}"
        extra_topk = extra_indices.shape[-1]
        assert extra_indices.shape == (batch, s_q, extra_topk) and extra_indices.dtype == torch.int32
        assert extra_indices.stride(-1) == 1
        assert extra_topk % 64 == 0, f"extra_topk ({extra_topk}) mod B_TOPK (64) must be 0"
    for name, lengths in (("topk_length", topk_length), ("extra_topk_length", extra_topk_length)):
        if lengths is not None:
            assert lengths.dtype == torch.int32 and lengths.shape == (batch,) and lengths.is_contiguous(), name
    if attn_sink is not None:
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (heads,) and attn_sink.is_contiguous()

    # the interface's schedule bookkeeping, and the schedule's dependence on the length values
    config = (batch, s_q, heads, k_cache.shape[1], topk, None if extra_k_cache is None else extra_k_cache.shape[1],
              extra_topk)
    lengths_now = tuple(None if t is None else t.clone() for t in (topk_length, extra_topk_length))
    made = sched.tile_scheduler_metadata is None
    if not sched.have_initialized:
        sched.have_initialized = True
        sched.config = config
    else:
        assert sched.config == config, "Your input arguments are inconsistent with sched_meta"
    if made:
        sched.tile_scheduler_metadata = torch.zeros(4, 8, dtype=torch.int32, device=q.device)
        sched.num_splits = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
        _SCHEDULED[id(sched.tile_scheduler_metadata)] = lengths_now
    else:
        kept = _SCHEDULED[id(sched.tile_scheduler_metadata)]
        for was, now in zip(kept, lengths_now):
            if (was is None) != (now is None) or (was is not None and not torch.equal(was, now)):
                raise AssertionError("stale split-KV schedule: reused with other topk_length / extra_topk_length")
    CALLS.append(dict(function="flash_mla_with_kvcache", sparse=True, v4=True, q_ptr=q.data_ptr(), kv_format=kv_format,
                      use_legacy=use_legacy, scheduled=made, schedule_id=id(sched.tile_scheduler_metadata),
                      topk=topk, extra_topk=extra_topk, topk_length=topk_length,
                      extra_topk_length=extra_topk_length, attn_sink=attn_sink is not None))
    if softmax_scale is None:
        softmax_scale = width ** -0.5

    def segment(cache, cache_fmt, idx, lengths):
        rows = _v4_rows(cache, cache_fmt)
        flat = idx.reshape(batch * s_q, -1).long()
        outside = (flat != -1) & ((flat < 0) | (flat >= rows.shape[0]))
        if bool(outside.any()):
            raise IndexError("an index outside the cache: an illegal memory access on the GPU")
        valid = flat != -1
        if lengths is not None:
            per_token = lengths.long().repeat_interleave(s_q)
            valid &= torch.arange(flat.shape[1]).unsqueeze(0) < per_token.unsqueeze(1)
        return rows[flat.clamp_min(0)], valid

    gathered, valid = segment(k_cache, fmt, indices, topk_length)
    if extra_k_cache is not None:
        extra_rows, extra_valid = segment(extra_k_cache, extra_fmt, extra_indices, extra_topk_length)
        gathered, valid = torch.cat([gathered, extra_rows], 1), torch.cat([valid, extra_valid], 1)
    out, lse = _attend(q.reshape(batch * s_q, heads, width).float(), gathered, valid, softmax_scale, attn_sink)
    return (out.view(batch, s_q, heads, 512).to(torch.bfloat16),
            lse.view(batch, s_q, heads).contiguous().transpose(1, 2))


from flash_mla import _loader  # noqa: E402 - as the published package: `flash_mla._loader` after import
