"""REFERENCE: pure PyTorch MLA on any device and any float dtype.

It is the oracle of the test suite and the backend of last resort.  Every
function loops over requests on the host and computes in float32 (float64
when the inputs are float64), so it is simple to read, not fast.

Bad index data gets the same result as from the Triton kernels (see
`mla_multi.errors`): the request's rows are NaN (a slot past the cache is not
written) and the kind of error is recorded on the tensors' device; nothing is
indexed outside the tensors, so no PyTorch indexing error is raised.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from mla_multi import errors
from mla_multi.backends.base import (
    FP8_DTYPES,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    MLASparseBackend,
    MLASparseImpl,
    forward_v4_in_parts,
    v4_tokens_per_call,
)

_ALL_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _softmax_with_lse(scores: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the last dim and its natural-log LSE, as the kernels compute it: p = exp(s - max) / sum
    (normalised by the sum itself, so that rounding in the LSE cannot scale a row), lse = max + log(sum).

    The non-finite policy (README "Non-finite input and edge cases"): a fully masked row gives p 0 and lse -inf;
    a NaN score, or a score of +inf, among a row's unmasked ones makes the row's p and lse NaN.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if scores.shape[-1] == 0:
        shape = scores.shape[:-1]
        return scores, torch.full(shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    top = scores.amax(dim=-1, keepdim=True)  # NaN where a score is NaN
    empty = top == float("-inf")
    shifted = torch.exp(scores - torch.where(empty, torch.zeros_like(top), top))  # NaN where top is +inf or NaN
    total = shifted.sum(dim=-1, keepdim=True)
    probs = torch.where(empty, torch.zeros_like(shifted), shifted / torch.where(empty, torch.ones_like(total), total))
    lse = torch.where(empty, torch.full_like(top, float("-inf")), top + torch.log(total))
    return probs, lse.squeeze(-1)


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention, causal aligned bottom-right.

    q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv], cu_seqlens [B + 1].
    Query i of a sequence with lq queries and lk keys sees keys j <= i + lk - lq
    when causal. Returns out [Tq, N, Dv] in q's dtype and lse [N, Tq] float32
    (float64 for float64 inputs); rows that see no key give 0 and -inf.
    A sequence whose boundaries are not non-decreasing from 0 inside [0, T], or
    that is longer than max_seqlen_* (when given), gets NaN in its rows inside
    the output and records `errors.CU_SEQLENS`; rows no sequence covers stay 0.
    """
    compute = _compute_dtype(q.dtype)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    out = torch.zeros(num_tokens, num_heads, v.shape[-1], dtype=compute, device=q.device)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=compute, device=q.device)
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    total_k = k.shape[0]
    bad_sequences = 0
    for i in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1]
        lq, lk = q1 - q0, k1 - k0
        valid = 0 <= q0 <= q1 <= num_tokens and 0 <= k0 <= k1 <= total_k and (i > 0 or q0 == k0 == 0)
        valid = valid and (max_seqlen_q is None or lq <= max_seqlen_q) and (max_seqlen_k is None or lk <= max_seqlen_k)
        if not valid:
            bad_sequences += 1
            low = min(max(q0, 0), num_tokens)
            high = max(min(q1, num_tokens), low)
            out[low:high] = float("nan")
            lse[:, low:high] = float("nan")
            continue
        if lq == 0:
            continue
        qi = q[q0:q1].to(compute).transpose(0, 1)  # [N, lq, D]
        ki = k[k0:k1].to(compute).transpose(0, 1)
        vi = v[k0:k1].to(compute).transpose(0, 1)
        scores = torch.matmul(qi, ki.transpose(1, 2)) * scale  # [N, lq, lk]
        mask = None
        if causal:
            rows = torch.arange(lq, device=q.device).unsqueeze(1)
            cols = torch.arange(lk, device=q.device).unsqueeze(0)
            mask = (cols <= rows + (lk - lq)).unsqueeze(0)
        probs, row_lse = _softmax_with_lse(scores, mask)
        out[q0:q1] = torch.matmul(probs, vi).transpose(0, 1)
        lse[:, q0:q1] = row_lse
    errors.record(q.device, errors.CU_SEQLENS if bad_sequences else 0)
    lse_dtype = torch.float64 if compute == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def dequantize_cache_rows(rows: torch.Tensor, k_scale, compute: torch.dtype) -> torch.Tensor:
    """Cache rows as `compute` values; FP8 rows are multiplied by their per-tensor scale."""
    values = rows.to(compute)
    if rows.dtype in FP8_DTYPES:
        if k_scale is None:
            raise ValueError("k_scale=None with an fp8 kv_cache; accepted: a float or a 1-element tensor")
        scale = k_scale if not torch.is_tensor(k_scale) else k_scale.to(device=values.device, dtype=compute).reshape(())
        values = values * scale
    return values


def mla_decode_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA decode over the paged latent cache.

    q_nope [B, N, Lkv] or [B, Q, N, Lkv]; q_pe [B, (Q,) N, R]; kv_cache
    [num_blocks, block_size, Lkv + R]; block_table [B, max_blocks]; seq_lens [B].
    Query token j of Q sees cache positions < seq_len - Q + 1 + j.
    Returns out [B, (Q,) N, Lkv] in q's dtype and lse [B, (Q,) N] float32.
    A request whose seq_len lies outside [0, max_blocks * block_size], or whose
    first ceil(seq_len / block_size) block-table entries leave [0, num_blocks),
    gets out and lse NaN and records `errors.SEQ_RANGE` / `errors.BLOCK_INDEX`.
    """
    single_token = q_nope.dim() == 3
    if single_token:
        q_nope, q_pe = q_nope.unsqueeze(1), q_pe.unsqueeze(1)
    batch, q_len, num_heads, kv_lora_rank = q_nope.shape
    compute = _compute_dtype(q_nope.dtype)
    block_size = kv_cache.shape[1]
    out = torch.zeros(batch, q_len, num_heads, kv_lora_rank, dtype=compute, device=q_nope.device)
    lse = torch.full((batch, q_len, num_heads), float("-inf"), dtype=compute, device=q_nope.device)
    query = torch.cat([q_nope, q_pe], dim=-1).to(compute)
    table = block_table.detach().cpu()
    capacity = block_table.shape[1] * block_size
    error_bits = 0
    for b, seq_len in enumerate(seq_lens.tolist()):
        if not 0 <= seq_len <= capacity:
            error_bits |= errors.SEQ_RANGE
            out[b], lse[b] = float("nan"), float("nan")
            continue
        if seq_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        used = table[b, :num_blocks]
        if bool(((used < 0) | (used >= kv_cache.shape[0])).any()):
            error_bits |= errors.BLOCK_INDEX
            out[b], lse[b] = float("nan"), float("nan")
            continue
        blocks = block_table[b, :num_blocks].long()
        rows = kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:seq_len]
        rows = dequantize_cache_rows(rows, k_scale, compute)
        scores = torch.einsum("qhd,sd->qhs", query[b], rows) * scale  # [Q, N, S]
        limits = seq_len - q_len + 1 + torch.arange(q_len, device=q_nope.device)
        mask = torch.arange(seq_len, device=q_nope.device).unsqueeze(0) < limits.unsqueeze(1)
        probs, row_lse = _softmax_with_lse(scores, mask.unsqueeze(1))
        out[b] = torch.einsum("qhs,sd->qhd", probs, rows[:, :kv_lora_rank])
        lse[b] = row_lse
    errors.record(q_nope.device, error_bits)
    lse_dtype = torch.float64 if compute == torch.float64 else torch.float32
    out, lse = out.to(q_nope.dtype), lse.to(lse_dtype)
    if single_token:
        out, lse = out.squeeze(1), lse.squeeze(1)
    return out, lse


def merge_attn_states_reference(prefix_output, prefix_lse, suffix_output, suffix_lse):
    """Merge two partial attentions by their LSE.

    outputs [T, N, D], lse [N, T]. An LSE of +inf counts as -inf; when both
    sides are -inf the output is 0 and the LSE -inf; a side at -inf contributes
    nothing, whatever its output holds. Returns (output, lse).
    """
    compute = _compute_dtype(prefix_output.dtype)
    neg_inf = torch.tensor(float("-inf"), dtype=compute, device=prefix_lse.device)
    p_lse = prefix_lse.to(compute)
    s_lse = suffix_lse.to(compute)
    p_lse = torch.where(p_lse == float("inf"), neg_inf, p_lse)
    s_lse = torch.where(s_lse == float("inf"), neg_inf, s_lse)
    max_lse = torch.maximum(p_lse, s_lse)
    empty = max_lse == float("-inf")
    safe_max = torch.where(empty, torch.zeros_like(max_lse), max_lse)
    p_weight = torch.exp(p_lse - safe_max)
    s_weight = torch.exp(s_lse - safe_max)
    total = p_weight + s_weight
    safe_total = torch.where(empty, torch.ones_like(total), total)
    p_weight = torch.where(empty, torch.zeros_like(p_weight), p_weight / safe_total)
    s_weight = torch.where(empty, torch.zeros_like(s_weight), s_weight / safe_total)
    # [N, T] -> [T, N, 1]
    p_weight, s_weight = p_weight.transpose(0, 1).unsqueeze(-1), s_weight.transpose(0, 1).unsqueeze(-1)
    # select, not multiply: a side without keys may hold garbage (0 * NaN is NaN)
    output = torch.where(p_weight > 0, prefix_output.to(compute) * p_weight, 0.0) + torch.where(
        s_weight > 0, suffix_output.to(compute) * s_weight, 0.0
    )
    lse = torch.where(empty, neg_inf.expand_as(max_lse), torch.log(safe_total) + safe_max)
    # a NaN LSE on either side (a state a NaN reached) makes the merged row and its LSE NaN (the NaN policy)
    nan_lse = torch.isnan(p_lse) | torch.isnan(s_lse)
    output = output.masked_fill(nan_lse.transpose(0, 1).unsqueeze(-1), float("nan"))
    lse = lse.masked_fill(nan_lse, float("nan"))
    return output.to(prefix_output.dtype), lse.to(prefix_lse.dtype)


def quantize_to_fp8(values: torch.Tensor, scale, fp8_dtype: torch.dtype) -> torch.Tensor:
    """values / scale, saturated to the FP8 dtype's finite range."""
    if scale is None:
        raise ValueError("scale=None with an fp8 kv_cache; accepted: a float or a 1-element tensor")
    finite_max = torch.finfo(fp8_dtype).max
    scale_value = scale.to(device=values.device, dtype=torch.float32).reshape(()) if torch.is_tensor(scale) else scale
    return (values.float() / scale_value).clamp(-finite_max, finite_max).to(fp8_dtype)


def concat_and_cache_mla_reference(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    """Write [kv_c | k_pe] rows into the paged cache at `slot_mapping`.

    Negative slots are skipped; slots past the cache too, recording `errors.SLOT`.
    """
    rows = torch.cat([kv_c, k_pe], dim=-1)
    past_cache = slot_mapping >= kv_cache.shape[0] * kv_cache.shape[1]
    if bool(past_cache.any()):
        errors.record(kv_cache.device, errors.SLOT)
    keep = (slot_mapping >= 0) & ~past_cache
    slots = slot_mapping[keep].long()
    rows = rows[keep]
    if kv_cache.dtype in FP8_DTYPES:
        rows = quantize_to_fp8(rows, scale, kv_cache.dtype)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat[slots] = rows.to(kv_cache.dtype)


def gather_cache_reference(kv_cache, block_table, seq_starts, seq_lens, scale=None, out_dtype=None) -> torch.Tensor:
    """For each request i, its cached rows seq_starts[i] .. seq_starts[i] + seq_lens[i], concatenated.

    Returns [sum(seq_lens), Lkv + R], dequantised to `out_dtype` (default: the
    cache dtype, or bfloat16 for an fp8 cache). A negative length gives no rows;
    a row whose position lies outside [0, max_blocks * block_size) or whose
    block lies outside the cache is NaN; both are recorded (`errors.SEQ_RANGE`,
    `errors.BLOCK_INDEX`).
    """
    block_size = kv_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    if out_dtype is None:
        out_dtype = torch.bfloat16 if kv_cache.dtype in FP8_DTYPES else kv_cache.dtype
    pieces = []
    error_bits = 0
    for i, (start, length) in enumerate(zip(seq_starts.tolist(), seq_lens.tolist())):
        if length <= 0:
            error_bits |= errors.SEQ_RANGE if length < 0 else 0
            continue
        positions = torch.arange(start, start + length, device=kv_cache.device)
        in_table = (positions >= 0) & (positions < capacity)
        if capacity > 0:
            blocks = block_table[i].long()[torch.where(in_table, positions // block_size, 0)]
        else:
            blocks = torch.zeros_like(positions)
        in_cache = (blocks >= 0) & (blocks < kv_cache.shape[0])
        valid = in_table & in_cache
        error_bits |= errors.SEQ_RANGE if not bool(in_table.all()) else 0
        error_bits |= errors.BLOCK_INDEX if not bool((in_cache | ~in_table).all()) else 0
        if kv_cache.shape[0] > 0:
            rows = kv_cache[torch.where(valid, blocks, 0), torch.where(valid, positions % block_size, 0)]
        else:
            rows = torch.zeros(length, kv_cache.shape[-1], dtype=kv_cache.dtype, device=kv_cache.device)
        if kv_cache.dtype in FP8_DTYPES:
            rows = dequantize_cache_rows(rows, scale, torch.float32)
        rows = rows.to(out_dtype)
        rows[~valid] = float("nan")
        pieces.append(rows)
    errors.record(kv_cache.device, error_bits)
    if not pieces:
        return torch.empty(0, kv_cache.shape[-1], dtype=out_dtype, device=kv_cache.device)
    return torch.cat(pieces)


def sparse_attention_reference(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    bad_is_error: bool = True,
    latent_width: int = 512,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA in the latent space: each token attends to the rows its indices name.

    q [T, N, 576] (absorbed query and rotary part), kv_rows [S, 576] (float,
    already dequantised), indices [T, topk] (a list: duplicates count twice),
    topk_length [T] (only the first topk_length[t] indices count) and attn_sink
    [N] (out *= exp(lse) / (exp(lse) + exp(sink)), lse unchanged). Index -1
    means no token; with `bad_is_error` another index outside [0, S) makes the
    token's rows and LSE NaN (decode), otherwise it counts as no token
    (prefill). A token with no valid index gives 0 and LSE -inf. Returns
    (out [T, N, 512] in q's compute dtype, lse [T, N] float32, or float64 for
    float64 inputs) and the per-token bad flags [T]. The values are the first
    `latent_width` columns of the rows.
    """
    compute = _compute_dtype(q.dtype)
    tokens, topk = indices.shape
    num_rows = kv_rows.shape[0]
    idx = indices.long()
    in_range = (idx >= 0) & (idx < num_rows)
    valid = in_range
    if topk_length is not None:
        valid = valid & (torch.arange(topk, device=idx.device).unsqueeze(0) < topk_length.long().unsqueeze(1))
    bad = ((idx < -1) | (idx >= num_rows)).any(dim=1) if bad_is_error else torch.zeros(
        tokens, dtype=torch.bool, device=idx.device)
    rows = kv_rows.to(compute)[idx.clamp(0, max(num_rows - 1, 0))] if num_rows else torch.zeros(
        tokens, topk, kv_rows.shape[-1], dtype=compute, device=q.device)  # [T, topk, 576]
    # rows no valid index names are never read: their contents (poison, stale data) must not reach the sums
    rows = rows.masked_fill(~valid.unsqueeze(-1), 0)
    scores = torch.einsum("tnd,tkd->tnk", q.to(compute), rows) * scale
    # [T, N]: lse -inf where nothing is valid, NaN where a valid score is NaN or +inf (a NaN or inf query or row)
    weights, lse = _softmax_with_lse(scores, valid.unsqueeze(1))
    out = torch.einsum("tnk,tkd->tnd", weights, rows[..., :latent_width])
    if attn_sink is not None:
        # a sink of +inf takes every row's mass (0), -inf none; a NaN sink makes the row NaN; a row without a
        # valid index keeps 0 and -inf
        finite = torch.isfinite(lse)
        sink = attn_sink.to(compute).unsqueeze(0)
        factor = torch.sigmoid(torch.where(finite, lse, torch.zeros_like(lse)) - sink)
        out = out * torch.where(lse == float("-inf"), torch.ones_like(factor), factor).unsqueeze(-1)
    out = out.masked_fill(bad.view(-1, 1, 1), float("nan"))
    lse = lse.masked_fill(bad.view(-1, 1), float("nan"))
    return out, lse.to(torch.float64 if compute == torch.float64 else torch.float32), bad


def sparse_attention_v4_reference(
    q: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    bad_is_error: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The V4 sparse attention over one or two KV segments, softmaxed together.

    q [T, N, 512] (d_qk = d_v = 512: the value is the whole row); segments:
    (rows [S_i, 512] already dequantised, indices [T, topk_i], topk_length [T]
    or None) each; the union of the segments' valid entries is attended (a
    list: a duplicate counts twice). -1 means no token; with `bad_is_error`
    another index outside [0, S_i) (past topk_length too) makes the token's rows
    and LSE NaN, otherwise it counts as no token. attn_sink [N]: out *= exp(lse)
    / (exp(lse) + exp(sink)), the LSE returned without it. A token with no valid
    entry gives 0 and LSE -inf. Returns (out [T, N, 512] in the compute dtype,
    lse [T, N] float32 or float64 for float64 inputs, bad [T]).
    """
    compute = _compute_dtype(q.dtype)
    tokens = q.shape[0]
    all_rows, all_indices = [], []
    bad = torch.zeros(tokens, dtype=torch.bool, device=q.device)
    offset = 0
    for rows, indices, topk_length in segments:
        idx = indices.long().to(q.device)
        count = rows.shape[0]
        valid = (idx >= 0) & (idx < count)
        if topk_length is not None:
            positions = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
            valid &= positions < topk_length.long().to(idx.device).unsqueeze(1)
        if bad_is_error:
            bad |= ((idx < -1) | (idx >= count)).any(dim=1)
        all_indices.append(torch.where(valid, idx + offset, torch.full_like(idx, -1)))
        all_rows.append(rows.to(compute))
        offset += count
    rows = torch.cat(all_rows) if all_rows else torch.zeros(0, q.shape[-1], dtype=compute, device=q.device)
    indices = torch.cat(all_indices, dim=1)
    out, lse, _ = sparse_attention_reference(q, rows, indices, scale, attn_sink=attn_sink, bad_is_error=False,
                                             latent_width=rows.shape[-1])
    out = out.masked_fill(bad.view(-1, 1, 1), float("nan"))
    lse = lse.masked_fill(bad.view(-1, 1), float("nan"))
    return out, lse, bad


def gathered_segment_v4(kv: torch.Tensor, kv_format: str, indices: torch.Tensor, compute: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a segment's indices name, dequantised, and the indices into them: (rows [T * topk, 512],
    indices [T, topk]) where a named slot becomes its entry's position, -1 stays -1 and an index outside
    [-1, num_slots) becomes -2 (still outside). Only the named slots are read, whatever the cache's size."""
    num_slots = kv.shape[0] * kv.shape[1] if kv_format != "rows" or kv.dim() == 3 else kv.shape[0]
    idx = indices.long().to(kv.device)
    named = (idx >= 0) & (idx < num_slots)
    slots = torch.where(named, idx, torch.zeros_like(idx)).flatten()
    if num_slots == 0 or slots.numel() == 0:
        rows = torch.zeros(slots.numel(), 512, dtype=compute, device=kv.device)
    elif kv_format == "rows":
        rows = kv.reshape(num_slots, kv.shape[-1])[slots].to(compute)
    else:
        from mla_multi.cache_formats import get_format

        rows = get_format(kv_format).read_rows(kv, compute, slots)
    positions = torch.arange(idx.numel(), device=idx.device).view(idx.shape)
    remapped = torch.where(named, positions, torch.where(idx == -1, idx, torch.full_like(idx, -2)))
    return rows, remapped


# --------------------------------------------------------------------------- backend classes


class ReferencePrefillImpl(MLAPrefillImpl):
    def forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, return_softmax_lse,
                       *, q_scale=None, k_scale=None, v_scale=None):
        """Float q / k / v as they are; FP8 k and v (and an FP8 q) dequantised with their per-tensor scales and
        computed in float32, the output in q's dtype (bfloat16 for an FP8 q)."""
        out_dtype = q.dtype
        if k.dtype in FP8_DTYPES:
            out_dtype = torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype
            q = dequantize_cache_rows(q, q_scale, torch.float32)
            k, v = dequantize_cache_rows(k, k_scale, torch.float32), dequantize_cache_rows(v, v_scale, torch.float32)
        out, lse = varlen_attention_reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, self.scale, causal, max_seqlen_q, max_seqlen_k
        )
        out = out.to(out_dtype)
        return (out, lse) if return_softmax_lse else out


class ReferencePrefillBackend(MLAPrefillBackend):
    name: ClassVar[str] = "REFERENCE"
    # FP8 prefill: FP8 k / v with their scales (`mla_multi.ops.mla_prefill`), dequantised
    supported_dtypes = _ALL_FLOAT_DTYPES + FP8_DTYPES

    @staticmethod
    def get_prefill_impl_cls():
        return ReferencePrefillImpl


class ReferenceDecodeImpl(MLADecodeImpl):
    def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, num_kv_splits=None, workspace_manager=None, max_seq_len=None):
        # The reference computes each request in one piece: num_kv_splits does not apply.
        out, lse = mla_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, self.scale, k_scale)
        return out, lse


class ReferenceDecodeBackend(MLADecodeBackend):
    name: ClassVar[str] = "REFERENCE"
    supported_dtypes = _ALL_FLOAT_DTYPES
    supported_kv_cache_dtypes = _ALL_FLOAT_DTYPES + FP8_DTYPES
    max_num_heads = 1 << 16
    max_query_len = 1 << 16
    # Host loops over the batch read seq_lens back, which a graph cannot capture.
    supports_cuda_graphs = False

    @staticmethod
    def get_decode_impl_cls():
        return ReferenceDecodeImpl



# --------------------------------------------------------------------------- sparse


def _cache_rows(kv_cache: torch.Tensor, k_scale, compute: torch.dtype) -> torch.Tensor:
    """The paged cache as dequantised rows [num_blocks * block_size, 576] (fp8_ds_mla, FP8 with k_scale, float)."""
    from mla_multi.ds_mla_cache import dequantize_fp8_ds_mla, is_fp8_ds_mla

    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    if is_fp8_ds_mla(kv_cache):
        return dequantize_fp8_ds_mla(flat, compute)
    return dequantize_cache_rows(flat, k_scale, compute)


class ReferenceSparseDecodeImpl(MLASparseImpl):
    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        compute = _compute_dtype(q_nope.dtype)
        rows = _cache_rows(kv, k_scale, compute)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out, lse, bad = sparse_attention_reference(
            q, rows, indices, scale, topk_length=topk_length, attn_sink=attn_sink, bad_is_error=True,
            latent_width=q_nope.shape[-1],
        )
        # recorded on the device without a synchronisation
        errors.error_flag(q_nope.device).bitwise_or_(bad.any().to(torch.int32) * errors.SPARSE_INDEX)
        return out.to(q_nope.dtype), lse.float()

    def forward_v4(self, q, kv, indices, scale, *, kv_format, topk_length=None, attn_sink=None, extra_kv=None,
                   extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        """Every named row dequantised in the compute dtype: a call of more than `base.V4_ROWS_AT_ONCE` entries
        runs in parts (`forward_v4_in_parts`)."""
        per_call = v4_tokens_per_call(indices, extra_indices)
        if q.shape[0] > per_call:
            return forward_v4_in_parts(self.forward_v4, q, kv, indices, scale, per_call, topk_length=topk_length,
                                       extra_indices=extra_indices, extra_topk_length=extra_topk_length,
                                       kv_format=kv_format, attn_sink=attn_sink, extra_kv=extra_kv,
                                       extra_kv_format=extra_kv_format)
        out, lse, bad = _forward_v4(q, kv, indices, scale, kv_format, topk_length, attn_sink, extra_kv,
                                    extra_indices, extra_topk_length, extra_kv_format, bad_is_error=True)
        errors.error_flag(q.device).bitwise_or_(bad.any().to(torch.int32) * errors.SPARSE_INDEX)
        return out, lse



def _forward_v4(q, kv, indices, scale, kv_format, topk_length, attn_sink, extra_kv, extra_indices,
                extra_topk_length, extra_kv_format, *, bad_is_error):
    compute = _compute_dtype(q.dtype)
    segments = [(*gathered_segment_v4(kv, kv_format, indices, compute), topk_length)]
    if extra_kv is not None:
        segments.append((*gathered_segment_v4(extra_kv, extra_kv_format, extra_indices, compute), extra_topk_length))
    out, lse, bad = sparse_attention_v4_reference(q, segments, scale, attn_sink=attn_sink, bad_is_error=bad_is_error)
    return out.to(q.dtype), lse.to(torch.float64 if compute == torch.float64 else torch.float32), bad


# every V4 format, and float rows
_V4_FORMATS = ("fp8_ds_mla_v4", "fp8_ds_mla_v41", "fp4_ds_mla_v41", "rows")


class ReferenceSparseDecodeBackend(MLASparseBackend):
    name: ClassVar[str] = "REFERENCE"
    supported_dtypes = _ALL_FLOAT_DTYPES
    supported_kv_dtypes = _ALL_FLOAT_DTYPES + FP8_DTYPES + (torch.uint8,)
    supported_v4_formats = _V4_FORMATS
    max_num_heads = 1 << 16
    max_query_len = 1 << 16

    @staticmethod
    def get_impl_cls():
        return ReferenceSparseDecodeImpl


class ReferenceSparsePrefillImpl(MLASparseImpl):
    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        q = torch.cat([q_nope, q_pe], dim=-1)
        out, lse, _ = sparse_attention_reference(
            q, kv, indices, scale, topk_length=topk_length, attn_sink=attn_sink, bad_is_error=False,
            latent_width=q_nope.shape[-1],
        )
        return out.to(q_nope.dtype), lse.float()

    def forward_v4(self, q, kv, indices, scale, *, kv_format="rows", topk_length=None, attn_sink=None,
                   extra_kv=None, extra_indices=None, extra_topk_length=None, extra_kv_format=None):
        out, lse, _ = _forward_v4(q, kv, indices, scale, kv_format, topk_length, attn_sink, extra_kv, extra_indices,
                                  extra_topk_length, extra_kv_format or ("rows" if extra_kv is not None else None),
                                  bad_is_error=False)
        return out, lse


class ReferenceSparsePrefillBackend(MLASparseBackend):
    name: ClassVar[str] = "REFERENCE"
    supported_dtypes = _ALL_FLOAT_DTYPES
    supported_kv_dtypes = _ALL_FLOAT_DTYPES
    supported_v4_formats = ("rows",)
    max_num_heads = 1 << 16

    @staticmethod
    def get_impl_cls():
        return ReferenceSparsePrefillImpl
