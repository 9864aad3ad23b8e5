"""`aiter.mla` with the v0.1.20.post1 signatures (../contract.json), computed in float64.

`mla_decode_fwd` models what decides correctness (see _model.py): which
configurations have a kernel (the error aiter raises where none has), the
persistent path (its metadata must come from `get_mla_metadata_v1` for the
same step) and its batch gate, the split count of the non-persistent path,
and the LSE: returned where a kernel writes it, NaN where aiter would hand
back an unwritten buffer (the one-split paths), None where not asked for.
"""

import torch

from aiter import _model
from aiter.ops import attention

CALLS = []


def mla_decode_fwd_ds32(
    q_nope_buffer,
    q_rope_buffer,
    kv_nope_buffer,
    kv_rope_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    page_size=1,
    nhead_kv=1,
    sm_scale=None,
    num_kv_splits=None,
    work_meta_data=None,
    work_indptr=None,
    work_info_set=None,
    reduce_indptr=None,
    reduce_final_map=None,
    reduce_partial_map=None,
    intra_batch_mode=False,
    q_scale=None,
    kv_scale=None,
    return_lse=False,
):
    assert _model.get_gfx() == "gfx950", "mla_decode_fwd_ds32 is only supported on gfx950"
    raise NotImplementedError("not modelled by the stand-in aiter")


def mla_decode_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    page_size=1,
    nhead_kv=1,
    sm_scale=None,
    logit_cap=0.0,
    num_kv_splits=None,
    num_kv_splits_indptr=None,
    work_meta_data=None,
    work_indptr=None,
    work_info_set=None,
    reduce_indptr=None,
    reduce_final_map=None,
    reduce_partial_map=None,
    q_scale=None,
    kv_scale=None,
    intra_batch_mode=False,
    return_logits=False,
    return_lse=False,
    g_kv_indptr=None,
    cp_world_size=1,
    cp_rank=0,
    causal=True,
):
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    arch = _model.get_gfx()
    num_page, page, nhead_kv_buffer, qk_head_dim = kv_buffer.shape
    total_s, nhead, v_head_dim = o.shape
    bs = qo_indptr.shape[0] - 1
    assert page_size == 1 and page == 1 and nhead_kv == 1 and nhead_kv_buffer == 1, (page_size, page, nhead_kv)
    assert q.shape == (total_s, nhead, qk_head_dim), (q.shape, o.shape, kv_buffer.shape)
    assert q.is_contiguous(), "only support Q.is_contiguous() for now"
    for name, index in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_lens", kv_last_page_lens)):
        assert index.dtype == torch.int32, (name, index.dtype)
    q_type, kv_type = _model.type_name(q.dtype), _model.type_name(kv_buffer.dtype)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    assert qo[-1] == total_s, (qo, total_s)
    assert all(qo[i + 1] - qo[i] <= max_seqlen_q for i in range(bs)), (qo, max_seqlen_q)
    persistent = work_meta_data is not None
    gated = False
    sparse_topk = -1
    if persistent:
        buffers = (work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map)
        assert all(b is not None for b in buffers), "the persistent path takes all six metadata buffers"
        plan = attention.PLANS.get(int(work_meta_data.view(torch.int64)[0]))
        assert plan is not None, "work_meta_data was not filled by get_mla_metadata_v1"
        assert (plan["qo"], plan["kv"]) == (qo, kv), (
            "the metadata was built for other qo / kv indptr values (another step)", plan["qo"], qo, plan["kv"], kv)
        assert plan["heads"] == nhead, (plan["heads"], nhead)
        sparse_topk = plan.get("topk", -1)
        if num_kv_splits is None and not _model.persistent_gate(arch, bs, nhead, max_seqlen_q, q_type, kv_type):
            # aiter's split-KV fallback ignores the metadata and cannot honour a sparse plan's topk
            assert sparse_topk < 0, "sparse metadata with num_kv_splits=None: aiter's batch gate drops the topk"
            persistent, gated = False, True
    row, kernel_heads = _model.decode_kernel(arch, q_type, kv_type, nhead, max_seqlen_q, persistent, return_lse,
                                             causal)
    splits = None
    lse_written = True
    if not persistent:
        splits = _model.non_persistent_splits(num_kv_splits, bs, kv_indices.shape[0], nhead, max_seqlen_q, q_type)
        lse_written = _model.non_persistent_lse_written(splits, nhead, max_seqlen_q, q_type, kv_type)
    CALLS.append(dict(sm_scale=sm_scale, num_kv_splits=num_kv_splits, splits=splits, q_dtype=q.dtype,
                      kv_dtype=kv_buffer.dtype, persistent=persistent, gated=gated, kernel=row["kernel"],
                      kernel_heads=kernel_heads, nhead=nhead, max_seqlen_q=max_seqlen_q, return_lse=return_lse,
                      lse_written=lse_written))
    if sm_scale is None:
        sm_scale = 1.0 / (qk_head_dim ** 0.5)
    queries = q.double()
    keys = kv_buffer.reshape(num_page, qk_head_dim).double()
    if q.dtype in _model.FP8:
        assert q_scale is not None and kv_scale is not None, "fp8 Q requires q_scale and kv_scale"
        queries = queries * q_scale.double()
    if kv_buffer.dtype in _model.FP8:
        assert q.dtype in _model.FP8 or persistent, "no non-persistent kernel for a bf16 query over an fp8 cache"
        keys = keys * kv_scale.double()
    lse = torch.full((total_s, nhead), float("nan"), dtype=torch.float32)
    if persistent and sparse_topk >= 0:
        assert kv_indices.numel() >= total_s * sparse_topk, ("kv_indices shorter than tokens x topk",
                                                              kv_indices.numel(), total_s, sparse_topk)
    for b in range(bs):
        length, count = kv[b + 1] - kv[b], qo[b + 1] - qo[b]
        if not (persistent and sparse_topk >= 0):
            indices = kv_indices[kv[b]:kv[b + 1]].long()
            assert bool(((indices >= 0) & (indices < num_page)).all()), ("kv_indices out of the cache", indices)
            rows = keys[indices]
        for j, t in enumerate(range(qo[b], qo[b + 1])):
            visible = length - count + 1 + j if causal else length
            if persistent and sparse_topk >= 0:  # token t: its own batch, rows from t * topk
                visible = min(length, sparse_topk)
                indices = kv_indices[t * sparse_topk:t * sparse_topk + visible].long()
                assert bool(((indices >= 0) & (indices < num_page)).all()), ("kv_indices out of the cache", indices)
                rows = keys[indices]
            if visible <= 0:
                o[t] = float("nan")  # the real kernels leave such rows undefined
                continue
            scores = queries[t] @ rows[:visible].T * sm_scale
            o[t] = (torch.softmax(scores, dim=-1) @ rows[:visible, :v_head_dim]).to(o.dtype)
            lse[t] = torch.logsumexp(scores, dim=-1).float()
    logits = torch.empty(total_s, 1, nhead, v_head_dim, dtype=torch.float32)
    if not return_lse:
        return logits, None
    if not lse_written:
        lse.fill_(float("nan"))  # an unwritten torch.empty buffer
    return logits, lse


def mla_prefill_ps_fwd(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    output: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    work_indptr: torch.Tensor | None,
    work_info_set: torch.Tensor | None,
    max_seqlen_q: int,
    is_causal: bool,
    reduce_indptr: torch.Tensor | None = None,
    reduce_final_map: torch.Tensor | None = None,
    reduce_partial_map: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """aiter's wrapper: partial buffers of reduce_partial_map.size(0) x 256 rows, the kernel, the reduce into
    `output` with a final LSE it keeps to itself; it returns the partial LSE buffer (as aiter does)."""
    total_s, nhead, v_head_dim = output.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / (v_head_dim ** 0.5)
    tile_q = 256
    logits = torch.empty((reduce_partial_map.size(0) * tile_q, nhead, v_head_dim), dtype=torch.float32)
    attn_lse = torch.empty((reduce_partial_map.size(0) * tile_q, nhead), dtype=torch.float32)
    final_lse = torch.empty((total_s, nhead), dtype=torch.float32)
    attention.mla_prefill_ps_asm_fwd(Q, K, V, qo_indptr, kv_indptr, kv_page_indices, work_indptr, work_info_set,
                                     max_seqlen_q, softmax_scale, is_causal, logits, attn_lse, output, q_scale,
                                     k_scale, v_scale)
    attention.mla_reduce_v1(logits, attn_lse, reduce_indptr, reduce_final_map, reduce_partial_map, tile_q, 0,
                            output, final_lse)
    return output.view(total_s, nhead, v_head_dim), attn_lse


# DeepSeek-V4 decode entry points: their gates only (ROCM_AITER declines the V4 contract with reasons, see
# rocm_aiter.AITER_V4_DECODE); past a gate the stand-in does not compute them.
def mla_v40_decode_fwd(
    q,
    q_rope,
    kv_buffer,
    kv_buffer_rope,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    work_indptr,
    work_info_set,
    reduce_indptr,
    reduce_final_map,
    reduce_partial_map,
    sm_scale=None,
    return_lse=False,
    attn_sink=None,
):
    import os

    assert q.shape[-1] == 512 and kv_buffer.shape[-1] == 512, "the packed V4.0 rows are 512 bytes"
    assert q_rope.shape[-1] == 64 and kv_buffer_rope.shape[-1] == 64, "the V4.0 RoPE rows are 64 bf16"
    experimental = os.environ.get("AITER_ENABLE_EXPERIMENTAL", "0")
    use_hk = (_model.get_gfx() == "gfx950" and o.shape[1] * max_seqlen_q in (64, 128)
              and q.dtype in _model.FP8 and kv_buffer.dtype in _model.FP8 and q_rope.dtype == torch.bfloat16
              and kv_buffer_rope.dtype == torch.bfloat16 and kv_buffer.shape[1] in (1, 64)
              and experimental.lstrip("-").isdigit() and int(experimental) != 0)
    if not use_hk:
        raise NotImplementedError("mla_v40_decode_fwd: no backend available")
    raise NotImplementedError("mla_v40_decode_fwd: not modelled by the stand-in aiter")


def mla_decode_fwd_v4_nm(
    q,
    qrope,
    kv_buffer,
    kvrope,
    output,
    qo_indptr,
    kv_indptr,
    kv_page_indices,
    max_seqlen_q,
    *,
    sink,
    split_indptr=None,
    sm_scale=None,
    out_16_nosplit=0,
    num_kv_splits=None,
    logits=None,
    attn_lse=None,
    kv_last_page_lens=None,
):
    if sink.dtype != torch.float32:
        raise ValueError(f"mla_decode_fwd_v4_nm: `sink` must be FP32, got {sink.dtype}.")
    if _model.get_gfx() != "gfx950":
        raise _model.AiterError("mla_decode_v4_asm: cannot find suitable kernel")
    raise NotImplementedError("mla_decode_fwd_v4_nm: not modelled by the stand-in aiter")
