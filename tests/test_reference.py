"""The REFERENCE backend against independent float64 math written here.

Shapes are small (the reference loops over requests on the host); the float64
oracles compute the softmax explicitly (max, exp, sum) rather than through the
reference's own `logsumexp` path.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mla_multi.backends.reference import (
    ReferenceDecodeBackend,
    ReferenceDecodeImpl,
    ReferencePrefillBackend,
    ReferencePrefillImpl,
    concat_and_cache_mla_reference,
    gather_cache_reference,
    merge_attn_states_reference,
    mla_decode_reference,
    varlen_attention_reference,
)
from mla_multi.metadata import MLAPrefillMetadata, plan_context_chunks
from mla_multi.platforms import SPECS

NEG_INF = float("-inf")
FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; NaN or inf in `out` never passes."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def naive_attention(q, k, v, scale, mask=None):
    """float64 attention of one sequence, softmax written out.

    q [lq, N, D], k [lk, N, D], v [lk, N, Dv], mask [lq, lk] bool (True = attend).
    Returns out [lq, N, Dv] and lse [N, lq]; a row that sees no key gives 0 and -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("qnd,knd->nqk", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(0), NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else torch.full((*scores.shape[:-1], 1), NEG_INF, dtype=torch.float64)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - shift)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("nqk,knd->qnd", weights / torch.where(total > 0, total, torch.ones_like(total)), v)
    lse = torch.where(total > 0, shift + torch.log(total), torch.full_like(total, NEG_INF)).squeeze(-1)
    return out, lse


def bottom_right_mask(lq: int, lk: int) -> torch.Tensor:
    return torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist() if lengths else []), dtype=torch.int32)


def varlen_expected(q, k, v, lens_q, lens_k, scale, causal):
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        mask = bottom_right_mask(lq, lk) if causal else None
        out, lse = naive_attention(q[q0 : q0 + lq], k[k0 : k0 + lk], v[k0 : k0 + lk], scale, mask)
        outs.append(out)
        lses.append(lse)
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def test_naive_oracle_matches_torch_sdpa():
    # The oracle itself against PyTorch's attention in float64 (bottom-right mask passed explicitly).
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(9, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(9, 2, 6, generator=gen, dtype=torch.float64)
    mask = bottom_right_mask(5, 9)
    out, _ = naive_attention(q, k, v, 0.3, mask)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3)
    assert rel_err(out, sdpa.transpose(0, 1)) < 1e-13


# --------------------------------------------------------------------------- varlen prefill


PREFILL_LENGTHS = {
    # (lens_q, lens_k): equal lengths, bottom-right (lq < lk), single tokens, zero-length queries
    "causal": ([3, 0, 5, 1, 4, 7], [3, 4, 9, 1, 12, 7]),
    "noncausal": ([3, 0, 5, 1, 4, 2], [6, 4, 2, 1, 12, 9]),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_varlen_prefill(dtype, causal):
    lens_q, lens_k = PREFILL_LENGTHS["causal" if causal else "noncausal"]
    gen = torch.Generator().manual_seed(1)
    heads, dqk, dv, scale = 3, 24, 16, 24**-0.5
    q = torch.randn(sum(lens_q), heads, dqk, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), heads, dqk, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), heads, dv, generator=gen).to(dtype)
    out, lse = varlen_attention_reference(q, k, v, cu(lens_q), cu(lens_k), scale, causal)
    expected_out, expected_lse = varlen_expected(q, k, v, lens_q, lens_k, scale, causal)
    assert out.shape == (sum(lens_q), heads, dv) and out.dtype == dtype
    assert lse.shape == (heads, sum(lens_q))
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(out, expected_out) < TOLERANCE[dtype]
    assert rel_err(lse, expected_lse) < (1e-12 if dtype == torch.float64 else 1e-6)


def test_varlen_prefill_empty_rows():
    # A query sequence with no keys (non-causal), and causal rows that see no key (lq > lk).
    gen = torch.Generator().manual_seed(2)
    lens_q, lens_k = [2, 0, 3, 4], [0, 3, 3, 2]
    q = torch.randn(sum(lens_q), 2, 8, generator=gen)
    k = torch.randn(sum(lens_k), 2, 8, generator=gen)
    v = torch.randn(sum(lens_k), 2, 4, generator=gen)
    for causal in (False, True):
        out, lse = varlen_attention_reference(q, k, v, cu(lens_q), cu(lens_k), 0.5, causal)
        expected_out, expected_lse = varlen_expected(q, k, v, lens_q, lens_k, 0.5, causal)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.equal(out[:2], torch.zeros_like(out[:2]))  # no keys at all
        assert (lse[:, :2] == NEG_INF).all()
        if causal:
            # 4 queries over 2 keys: the first 2 queries see nothing.
            assert torch.equal(out[5:7], torch.zeros_like(out[5:7])) and (lse[:, 5:7] == NEG_INF).all()
        assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
        finite = torch.isfinite(expected_lse)
        assert torch.allclose(lse[finite].double(), expected_lse[finite], atol=1e-5)
        assert rel_err(out, expected_out) < 1e-5


def test_prefill_impl_entry_points():
    gen = torch.Generator().manual_seed(3)
    heads, p, r, vdim, scale = 2, 16, 8, 12, 0.2
    lens_q, context_lens = [5, 3, 8], [20, 0, 33]
    q = torch.randn(sum(lens_q), heads, p + r, generator=gen, dtype=torch.float64)
    k_new = torch.randn(sum(lens_q), heads, p + r, generator=gen, dtype=torch.float64)
    v_new = torch.randn(sum(lens_q), heads, vdim, generator=gen, dtype=torch.float64)
    contexts = [(torch.randn(c, heads, p + r, generator=gen, dtype=torch.float64),
                 torch.randn(c, heads, vdim, generator=gen, dtype=torch.float64)) for c in context_lens]
    block_size = 4
    chunks = plan_context_chunks(context_lens, workspace_tokens=17, block_size=block_size)
    assert chunks.num_chunks > 1
    metadata = MLAPrefillMetadata(
        query_start_loc=cu(lens_q), max_query_len=max(lens_q), block_table=torch.zeros(3, 9, dtype=torch.int32),
        context_lens_cpu=torch.tensor(context_lens), chunked_context=chunks,
    )
    impl = ReferencePrefillImpl(heads, scale, 64, p, r, vdim)
    out_only = impl.run_prefill_new_tokens(metadata, q, k_new, v_new, return_softmax_lse=False)
    out, lse = impl.run_prefill_new_tokens(metadata, q, k_new, v_new, return_softmax_lse=True)
    assert torch.equal(out_only, out)
    for chunk in range(chunks.num_chunks):
        starts, lengths = chunks.starts[chunk].tolist(), chunks.seq_lens[chunk].tolist()
        k_chunk = torch.cat([ctx[0][s : s + n] for ctx, s, n in zip(contexts, starts, lengths)])
        v_chunk = torch.cat([ctx[1][s : s + n] for ctx, s, n in zip(contexts, starts, lengths)])
        assert k_chunk.shape[0] == chunks.seq_tot[chunk]
        chunk_out, chunk_lse = impl.run_prefill_context_chunk(metadata, chunk, q, k_chunk, v_chunk)
        out, lse = merge_attn_states_reference(out, lse, chunk_out, chunk_lse)
    # Whole: each request's queries over [context | new keys], causal bottom-right.
    expected_out, expected_lse = [], []
    q0 = 0
    for (ctx_k, ctx_v), lq in zip(contexts, lens_q):
        keys = torch.cat([ctx_k, k_new[q0 : q0 + lq]])
        values = torch.cat([ctx_v, v_new[q0 : q0 + lq]])
        o, l = naive_attention(q[q0 : q0 + lq], keys, values, scale, bottom_right_mask(lq, keys.shape[0]))
        expected_out.append(o)
        expected_lse.append(l)
        q0 += lq
    assert rel_err(out, torch.cat(expected_out)) < 1e-12
    assert rel_err(lse, torch.cat(expected_lse, dim=1)) < 1e-12


def test_backend_declarations():
    for backend in (ReferencePrefillBackend, ReferenceDecodeBackend):
        assert backend.name == "REFERENCE"
        assert backend.is_available()
        for spec in SPECS.values():
            assert backend.supports_platform(spec)
    assert ReferencePrefillBackend.get_prefill_impl_cls() is ReferencePrefillImpl
    assert ReferenceDecodeBackend.get_decode_impl_cls() is ReferenceDecodeImpl
    for dtype in FP8:
        assert dtype in ReferenceDecodeBackend.supported_kv_cache_dtypes


# --------------------------------------------------------------------------- paged decode


def paged_cache(seq_lens, block_size, width, dtype, seed, *, scale=1.0):
    """A poisoned paged cache with the given sequences written at shuffled blocks.

    Returns (kv_cache, block_table, rows) where rows[b] [seq_lens[b], width] float64
    are the values as stored (dequantised for fp8). Every unused slot, block and
    table entry is NaN / points at a NaN block, so reading outside a sequence shows.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    poison_block = order.pop()
    kv_cache = torch.full((num_blocks, block_size, width), float("nan")).to(dtype)
    table = torch.full((len(seq_lens), max(needed, default=0) + 2), poison_block, dtype=torch.int32)
    rows = []
    for b, (length, count) in enumerate(zip(seq_lens, needed)):
        blocks = [order.pop() for _ in range(count)]
        table[b, :count] = torch.tensor(blocks, dtype=torch.int32)
        values = torch.randn(length, width, generator=gen, dtype=torch.float64)
        stored = (values / scale).to(dtype) if dtype in FP8 else values.to(dtype)
        for position in range(length):
            kv_cache[blocks[position // block_size], position % block_size] = stored[position]
        rows.append(stored.double() * scale if dtype in FP8 else stored.double())
    return kv_cache, table, rows


def decode_expected(q_nope, q_pe, rows, kv_lora_rank, scale):
    """q [B, Q, N, *] -> out [B, Q, N, Lkv], lse [B, Q, N]; token j of Q sees positions < S - Q + 1 + j."""
    batch, q_len, heads, _ = q_nope.shape
    out = torch.zeros(batch, q_len, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((batch, q_len, heads), NEG_INF, dtype=torch.float64)
    query = torch.cat([q_nope, q_pe], dim=-1).double()
    for b, seq_rows in enumerate(rows):
        length = seq_rows.shape[0]
        if length == 0:
            continue
        mask = torch.arange(length).unsqueeze(0) < (length - q_len + 1 + torch.arange(q_len)).unsqueeze(1)
        keys = seq_rows.unsqueeze(1).expand(length, heads, seq_rows.shape[1])
        values = seq_rows[:, :kv_lora_rank].unsqueeze(1).expand(length, heads, kv_lora_rank)
        o, l = naive_attention(query[b], keys, values, scale, mask)
        out[b], lse[b] = o, l.transpose(0, 1)
    return out, lse


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_paged_decode(block_size, dtype):
    kv_lora_rank, rope, heads, scale = 32, 8, 4, 40**-0.5
    seq_lens = [17, 0, 1, 70, 64]
    kv_cache, table, rows = paged_cache(seq_lens, block_size, kv_lora_rank + rope, dtype, seed=block_size)
    gen = torch.Generator().manual_seed(4)
    q_nope = torch.randn(len(seq_lens), heads, kv_lora_rank, generator=gen).to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, rope, generator=gen).to(dtype)
    out, lse = mla_decode_reference(q_nope, q_pe, kv_cache, table, torch.tensor(seq_lens, dtype=torch.int32), scale)
    expected_out, expected_lse = decode_expected(q_nope.unsqueeze(1), q_pe.unsqueeze(1), rows, kv_lora_rank, scale)
    expected_out, expected_lse = expected_out.squeeze(1), expected_lse.squeeze(1)
    assert out.shape == (len(seq_lens), heads, kv_lora_rank) and out.dtype == dtype
    assert lse.shape == (len(seq_lens), heads)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # seq_len 0: output 0 and LSE -inf, never NaN.
    assert torch.equal(out[1], torch.zeros_like(out[1])) and (lse[1] == NEG_INF).all()
    assert not torch.isnan(lse).any()
    keep = torch.tensor([True, False, True, True, True])
    assert rel_err(out[keep], expected_out[keep]) < TOLERANCE[dtype]
    assert rel_err(lse[keep], expected_lse[keep]) < (1e-12 if dtype == torch.float64 else 1e-6)
    impl = ReferenceDecodeImpl(heads, scale, kv_lora_rank, rope, dtype, block_size)
    impl_out, impl_lse = impl.forward_mqa(q_nope, q_pe, kv_cache, table, torch.tensor(seq_lens, dtype=torch.int32), num_kv_splits=4)
    assert torch.equal(impl_out, out) and torch.equal(impl_lse, lse)


@pytest.mark.parametrize("block_size", [1, 16])
def test_multi_token_decode_is_causal(block_size):
    kv_lora_rank, rope, heads, q_len, scale = 16, 8, 2, 3, 0.25
    seq_lens = [3, 9, 40, 0, 2]  # the last one is shorter than Q: its first token sees nothing
    kv_cache, table, rows = paged_cache(seq_lens, block_size, kv_lora_rank + rope, torch.float32, seed=9)
    gen = torch.Generator().manual_seed(5)
    q_nope = torch.randn(len(seq_lens), q_len, heads, kv_lora_rank, generator=gen)
    q_pe = torch.randn(len(seq_lens), q_len, heads, rope, generator=gen)
    out, lse = mla_decode_reference(q_nope, q_pe, kv_cache, table, torch.tensor(seq_lens), scale)
    expected_out, expected_lse = decode_expected(q_nope, q_pe, rows, kv_lora_rank, scale)
    assert out.shape == (len(seq_lens), q_len, heads, kv_lora_rank) and lse.shape == (len(seq_lens), q_len, heads)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    assert (lse[4, 0] == NEG_INF).all() and torch.isfinite(lse[4, 1:]).all()
    assert rel_err(out, expected_out) < 1e-5
    finite = torch.isfinite(expected_lse)
    assert rel_err(lse[finite], expected_lse[finite]) < 1e-6
    # Each token differs from full (non-causal) attention unless it is the last one.
    full_out, _ = decode_expected(q_nope[:, -1:].expand_as(q_nope).contiguous(), q_pe[:, -1:].expand_as(q_pe).contiguous(), rows, kv_lora_rank, scale)
    assert rel_err(out[2, 2], full_out[2, 2]) < 1e-5
    assert rel_err(out[2, 0], full_out[2, 0]) > 1e-3


@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("tensor_scale", [False, True], ids=["float_scale", "tensor_scale"])
def test_paged_decode_fp8(fp8_dtype, tensor_scale):
    kv_lora_rank, rope, heads, scale, k_scale = 32, 16, 4, 0.15, 0.05
    seq_lens = [5, 33, 0, 16]
    kv_cache, table, rows = paged_cache(seq_lens, 16, kv_lora_rank + rope, fp8_dtype, seed=11, scale=k_scale)
    assert kv_cache.dtype == fp8_dtype
    gen = torch.Generator().manual_seed(6)
    q_nope = torch.randn(len(seq_lens), heads, kv_lora_rank, generator=gen)
    q_pe = torch.randn(len(seq_lens), heads, rope, generator=gen)
    k_scale_arg = torch.tensor([k_scale]) if tensor_scale else k_scale
    out, lse = mla_decode_reference(q_nope, q_pe, kv_cache, table, torch.tensor(seq_lens), scale, k_scale_arg)
    expected_out, expected_lse = decode_expected(q_nope.unsqueeze(1), q_pe.unsqueeze(1), rows, kv_lora_rank, scale)
    keep = torch.tensor(seq_lens) > 0
    assert rel_err(out[keep], expected_out.squeeze(1)[keep]) < 1e-5
    assert rel_err(lse[keep], expected_lse.squeeze(1)[keep]) < 1e-6
    assert torch.equal(out[2], torch.zeros_like(out[2])) and (lse[2] == NEG_INF).all()
    # Without dequantisation (scale 1) the answer is different: the scale is really applied.
    wrong, _ = mla_decode_reference(q_nope, q_pe, kv_cache, table, torch.tensor(seq_lens), scale, 1.0)
    assert rel_err(wrong[keep], expected_out.squeeze(1)[keep]) > 0.1
    with pytest.raises(ValueError, match="k_scale"):
        mla_decode_reference(q_nope, q_pe, kv_cache, table, torch.tensor(seq_lens), scale)


# --------------------------------------------------------------------------- merge_attn_states


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_merging_two_halves_equals_the_whole(dtype):
    gen = torch.Generator().manual_seed(7)
    tokens, heads, dim, keys, scale = 6, 3, 16, 20, 0.3
    q = torch.randn(tokens, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(keys, heads, dim, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(keys, heads, dim, generator=gen, dtype=torch.float64)
    whole_out, whole_lse = naive_attention(q, k, v, scale)
    for split in (1, 7, 19):
        prefix_out, prefix_lse = naive_attention(q, k[:split], v[:split], scale)
        suffix_out, suffix_lse = naive_attention(q, k[split:], v[split:], scale)
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        out, lse = merge_attn_states_reference(
            prefix_out.to(dtype), prefix_lse.to(lse_dtype), suffix_out.to(dtype), suffix_lse.to(lse_dtype)
        )
        assert out.dtype == dtype and lse.dtype == lse_dtype
        assert out.shape == (tokens, heads, dim) and lse.shape == (heads, tokens)
        assert rel_err(out, whole_out) < TOLERANCE[dtype]
        assert rel_err(lse, whole_lse) < (1e-12 if dtype == torch.float64 else 1e-6)


INF = float("inf")


@pytest.mark.parametrize(
    "prefix_lse, suffix_lse, expect",
    [
        (INF, 0.5, "suffix"),      # +inf counts as -inf
        (0.5, INF, "prefix"),
        (NEG_INF, 1.5, "suffix"),
        (2.0, NEG_INF, "prefix"),
        (NEG_INF, NEG_INF, "empty"),
        (INF, INF, "empty"),
        (INF, NEG_INF, "empty"),
        (NEG_INF, INF, "empty"),
    ],
)
def test_merge_inf_rules(prefix_lse, suffix_lse, expect):
    gen = torch.Generator().manual_seed(8)
    prefix_out = torch.randn(1, 1, 8, generator=gen)
    suffix_out = torch.randn(1, 1, 8, generator=gen)
    out, lse = merge_attn_states_reference(
        prefix_out, torch.tensor([[prefix_lse]]), suffix_out, torch.tensor([[suffix_lse]])
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if expect == "empty":
        assert torch.equal(out, torch.zeros_like(out)) and lse.item() == NEG_INF
    else:
        source_out, source_lse = (prefix_out, prefix_lse) if expect == "prefix" else (suffix_out, suffix_lse)
        assert torch.allclose(out, source_out, rtol=1e-6, atol=0)
        assert lse.item() == pytest.approx(source_lse, rel=1e-6)


def test_merge_mixed_infinities_never_nan():
    gen = torch.Generator().manual_seed(9)
    tokens, heads, dim = 50, 4, 8
    choices = torch.tensor([NEG_INF, INF, -3.0, 0.0, 4.0, 80.0])
    prefix_lse = choices[torch.randint(0, 6, (heads, tokens), generator=gen)]
    suffix_lse = choices[torch.randint(0, 6, (heads, tokens), generator=gen)]
    prefix_out = torch.randn(tokens, heads, dim, generator=gen)
    suffix_out = torch.randn(tokens, heads, dim, generator=gen)
    out, lse = merge_attn_states_reference(prefix_out, prefix_lse, suffix_out, suffix_lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # Independent float64 merge with the same rules.
    p = torch.where(prefix_lse == INF, NEG_INF, prefix_lse).double()
    s = torch.where(suffix_lse == INF, NEG_INF, suffix_lse).double()
    for n in range(heads):
        for t in range(tokens):
            a, b = p[n, t].item(), s[n, t].item()
            if a == NEG_INF and b == NEG_INF:
                assert torch.equal(out[t, n], torch.zeros(dim)) and lse[n, t].item() == NEG_INF
                continue
            m = max(a, b)
            wa, wb = torch.exp(torch.tensor(a - m, dtype=torch.float64)), torch.exp(torch.tensor(b - m, dtype=torch.float64))
            expected = (prefix_out[t, n].double() * wa + suffix_out[t, n].double() * wb) / (wa + wb)
            assert torch.allclose(out[t, n].double(), expected, rtol=1e-5, atol=1e-6)
            assert lse[n, t].item() == pytest.approx(m + torch.log(wa + wb).item(), rel=1e-6, abs=1e-6)


# --------------------------------------------------------------------------- concat_and_cache_mla


def poisoned_cache(num_blocks, block_size, width, dtype):
    return torch.full((num_blocks, block_size, width), float("nan")).to(dtype)


def raw_rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes per slot, [num_slots, width * element_size] uint8 (compares NaN bit-exactly)."""
    return cache.reshape(-1, cache.shape[-1]).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_concat_and_cache_writes_only_its_slots(dtype):
    gen = torch.Generator().manual_seed(10)
    num_blocks, block_size, kv_lora_rank, rope, tokens = 6, 4, 16, 8, 10
    kv_c = torch.randn(tokens, kv_lora_rank, generator=gen).to(dtype)
    k_pe = torch.randn(tokens, rope, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5, 9]] = -1  # padding tokens
    cache = poisoned_cache(num_blocks, block_size, kv_lora_rank + rope, dtype)
    before = raw_rows(cache).clone()
    concat_and_cache_mla_reference(kv_c, k_pe, cache, slots)
    flat = cache.reshape(-1, kv_lora_rank + rope)
    written = set()
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written.add(slot)
        assert torch.equal(flat[slot, :kv_lora_rank], kv_c[token])
        assert torch.equal(flat[slot, kv_lora_rank:], k_pe[token])
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert len(written) == tokens - 3
    assert torch.equal(raw_rows(cache)[untouched], before[untouched])


@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("tensor_scale", [False, True], ids=["float_scale", "tensor_scale"])
def test_concat_and_cache_fp8_quantises_and_saturates(fp8_dtype, tensor_scale):
    gen = torch.Generator().manual_seed(12)
    block_size, kv_lora_rank, rope, tokens, scale = 8, 16, 8, 12, 0.03
    kv_c = torch.randn(tokens, kv_lora_rank, generator=gen) * 2
    k_pe = torch.randn(tokens, rope, generator=gen) * 2
    kv_c[3, :4] = torch.tensor([1e4, -1e4, 1e6, -50.0])  # far outside the fp8 range once divided by the scale
    slots = torch.arange(tokens) * 2
    slots[7] = -5
    cache = poisoned_cache(4, block_size, kv_lora_rank + rope, fp8_dtype)
    before = raw_rows(cache).clone()
    concat_and_cache_mla_reference(kv_c, k_pe, cache, slots, torch.tensor(scale) if tensor_scale else scale)
    finite_max = torch.finfo(fp8_dtype).max
    smallest_step = torch.finfo(fp8_dtype).smallest_normal * 2.0**-3  # subnormal spacing
    flat = cache.reshape(-1, kv_lora_rank + rope)
    source = torch.cat([kv_c, k_pe], dim=-1).double()
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        stored = flat[slot].double()
        assert not torch.isnan(stored).any()
        wanted = source[token] / scale
        saturated = wanted.abs() > finite_max
        assert torch.equal(stored[saturated], torch.sign(wanted[saturated]) * finite_max)
        inside = ~saturated
        # Round to nearest: half a unit of the 3-bit mantissa, or half the subnormal step.
        error = (stored[inside] - wanted[inside]).abs()
        assert (error <= wanted[inside].abs() * 2.0**-4 + smallest_step / 2).all()
    assert (flat[slots[3]].double()[:3].abs() == finite_max).all()
    untouched = [s for s in range(flat.shape[0]) if s not in set(slots.tolist())]
    assert torch.equal(raw_rows(cache)[untouched], before[untouched])


def test_concat_and_cache_fp8_needs_a_scale():
    cache = poisoned_cache(2, 4, 12, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale"):
        concat_and_cache_mla_reference(torch.ones(1, 8), torch.ones(1, 4), cache, torch.tensor([0]))


# --------------------------------------------------------------------------- gather_cache


def gather_expected(kv_cache, table, starts, lens, dequant):
    rows = []
    block_size = kv_cache.shape[1]
    for i, (start, length) in enumerate(zip(starts, lens)):
        for position in range(start, start + length):
            rows.append(dequant(kv_cache[int(table[i, position // block_size]), position % block_size]))
    return torch.stack(rows) if rows else torch.zeros(0, kv_cache.shape[-1], dtype=torch.float64)


@pytest.mark.parametrize("block_size", [1, 16])
def test_gather_cache(block_size):
    seq_lens = [20, 5, 0, 40]
    kv_cache, table, _ = paged_cache(seq_lens, block_size, 24, torch.float32, seed=13)
    starts, lens = [3, 0, 0, 16], [17, 5, 0, 24]  # non-zero starts, one empty request
    out = gather_cache_reference(kv_cache, table, torch.tensor(starts), torch.tensor(lens))
    expected = gather_expected(kv_cache, table, starts, lens, lambda row: row.double())
    assert out.shape == (sum(lens), 24) and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    assert torch.equal(out.double(), expected)


@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_gather_cache_fp8_dequantises(fp8_dtype):
    k_scale = 0.07
    seq_lens = [9, 30]
    kv_cache, table, rows = paged_cache(seq_lens, 8, 24, fp8_dtype, seed=14, scale=k_scale)
    starts, lens = torch.tensor([2, 8]), torch.tensor([7, 22])
    expected = torch.cat([rows[0][2:9], rows[1][8:30]])
    out32 = gather_cache_reference(kv_cache, table, starts, lens, torch.tensor([k_scale]), out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and rel_err(out32, expected) < 1e-6
    out_default = gather_cache_reference(kv_cache, table, starts, lens, k_scale)
    assert out_default.dtype == torch.bfloat16 and rel_err(out_default, expected) < 1e-2
    with pytest.raises(ValueError, match="k_scale|scale"):
        gather_cache_reference(kv_cache, table, starts, lens)


def test_gather_cache_all_empty():
    kv_cache, table, _ = paged_cache([4], 4, 10, torch.bfloat16, seed=15)
    out = gather_cache_reference(kv_cache, table, torch.tensor([0]), torch.tensor([0]))
    assert out.shape == (0, 10) and out.dtype == torch.bfloat16


def test_concat_then_gather_round_trip():
    gen = torch.Generator().manual_seed(16)
    block_size, width_c, rope = 4, 12, 4
    seq_lens = [7, 10]
    table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32)
    slots = torch.cat([table[i, torch.arange(s) // block_size].long() * block_size + torch.arange(s) % block_size
                       for i, s in enumerate(seq_lens)])
    kv_c = torch.randn(sum(seq_lens), width_c, generator=gen).bfloat16()
    k_pe = torch.randn(sum(seq_lens), rope, generator=gen).bfloat16()
    cache = poisoned_cache(6, block_size, width_c + rope, torch.bfloat16)
    concat_and_cache_mla_reference(kv_c, k_pe, cache, slots)
    out = gather_cache_reference(cache, table, torch.tensor([0, 0]), torch.tensor(seq_lens))
    assert torch.equal(out, torch.cat([kv_c, k_pe], dim=-1))
