"""`mla_decode_fwd` with aiter's published (0.1.7.post2.dev18) signature, computed in float64."""

import torch

CALLS = []
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def mla_decode_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
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
):
    CALLS.append(dict(sm_scale=sm_scale, num_kv_splits=num_kv_splits, q_dtype=q.dtype, kv_dtype=kv_buffer.dtype))
    num_page, page_size, nhead_kv, qk_head_dim = kv_buffer.shape
    total_s, nhead, v_head_dim = o.shape
    # The split-KV path's kernel table: 16 or 128 query heads per latent head.
    assert nhead in (16, 128), f"nhead={nhead} not supported"
    assert page_size == 1 and nhead_kv == 1, (page_size, nhead_kv)
    assert q.shape == (total_s, nhead, qk_head_dim), (q.shape, o.shape, kv_buffer.shape)
    assert q.is_contiguous()
    for name, index in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_lens", kv_last_page_lens)):
        assert index.dtype == torch.int32, (name, index.dtype)
    assert int(kv_last_page_lens.min()) == 1 if kv_last_page_lens.numel() else True
    if sm_scale is None:
        sm_scale = 1.0 / (qk_head_dim ** 0.5)
    queries = q.double()
    keys = kv_buffer.reshape(num_page, qk_head_dim).double()
    if q.dtype in _FP8:
        assert q_scale is not None and kv_scale is not None, "a8w8 kernels need q_scale and kv_scale"
        queries = queries * q_scale.double()
    if kv_buffer.dtype in _FP8:
        assert q.dtype in _FP8, "no non-persistent kernel for a bf16 query over an fp8 cache"
        keys = keys * kv_scale.double()
    batch = qo_indptr.shape[0] - 1
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    assert max(qo[i + 1] - qo[i] for i in range(batch)) <= max_seqlen_q
    for b in range(batch):
        rows = keys[kv_indices[kv[b]:kv[b + 1]].long()]
        for t in range(qo[b], qo[b + 1]):
            if rows.shape[0] == 0:
                # The real kernels leave such rows undefined.
                o[t] = float("nan")
                continue
            scores = queries[t] @ rows.T * sm_scale
            probs = torch.softmax(scores, dim=-1)
            o[t] = (probs @ rows[:, :v_head_dim]).to(o.dtype)
    logits = torch.empty(total_s, 1, nhead, v_head_dim, dtype=torch.float32)
    final_lse = torch.full((total_s, nhead), float("nan"), dtype=torch.float32)
    return logits, final_lse
