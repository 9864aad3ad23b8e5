"""`flash_attn_varlen_func` with aiter's v0.1.20.post1 signature (../../contract.json), computed in float64.

The sink (`sink_ptr`, one logit a head) joins each row's softmax denominator."""

import torch
from torch import Tensor

CALLS = []


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    dropout_p=0.0,
    softmax_scale=None,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1, 0),
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    how_v3_bf16_cvt=1,
    block_table=None,
    out=None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    sink_ptr: Tensor | None = None,
):
    CALLS.append(dict(softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, sink=sink_ptr is not None))
    assert len(window_size) == 3, window_size
    assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    total_q, num_heads, _ = q.shape
    result = torch.zeros(total_q, num_heads, v.shape[-1], dtype=torch.float64)
    # Rows that see no key: output 0, and an LSE of +inf as some CK kernels report.
    lse = torch.full((num_heads, total_q), float("inf"), dtype=torch.float32)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k[k0:k1].double()) * softmax_scale
        if causal:
            rows = torch.arange(q1 - q0).unsqueeze(1)
            cols = torch.arange(k1 - k0).unsqueeze(0)
            scores = scores.masked_fill(cols > rows + (k1 - k0) - (q1 - q0), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        seen = torch.isfinite(row_lse)
        probs = torch.where(seen.unsqueeze(-1), torch.exp(scores - row_lse.unsqueeze(-1)), torch.zeros_like(scores))
        if sink_ptr is not None:  # the sink joins the denominator; the LSE returned is the keys' own
            probs = probs * torch.sigmoid(row_lse - sink_ptr.double().view(-1, 1)).unsqueeze(-1)
        result[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v[k0:k1].double())
        lse[:, q0:q1] = torch.where(seen, row_lse, torch.full_like(row_lse, float("inf"))).float()
    result = result.to(q.dtype)
    return (result, lse) if return_lse else result
